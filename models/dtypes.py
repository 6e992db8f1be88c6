"""The one parser of dtype names (config fields, ``--dtype`` flags, preset settings)."""

from __future__ import annotations

from typing import Any

import torch

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def parse_dtype(value: Any) -> torch.dtype | None:
    """``torch.dtype`` of ``value`` (a dtype, or a name such as ``"bfloat16"`` / ``"torch.float16"``); None for
    None or ``"auto"`` (the caller's default: the checkpoint's or config's). ValueError in one line otherwise."""
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype):
        return value
    out = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {value!r} (use {', '.join(repr(c) for c in DTYPE_CHOICES)})")
    return out
