"""The one device resolver: what ``--device`` (and a library's ``device=``) names."""

from __future__ import annotations

import os

from expertcast.utils.errors import UsageError


def resolve_device(device: str) -> str:
    """``auto`` -> cuda when available, else cpu; a bare ``cuda`` under torchrun (``LOCAL_RANK`` set) is
    this process's ``cuda:LOCAL_RANK``; refuses ``cuda`` without CUDA and anything but auto, cpu,
    cuda[:N] or mps, with one line."""
    import torch

    d = str(device)
    if d == "auto":
        d = "cuda" if torch.cuda.is_available() else "cpu"
    elif d.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {d}: CUDA is not available on this machine (use --device cpu)")
    elif not (d == "cpu" or d.startswith("cuda") or d == "mps"):
        raise UsageError(f"--device {d}: expected auto, cpu or cuda[:N]")
    if d == "cuda" and os.environ.get("LOCAL_RANK"):
        d = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return d
