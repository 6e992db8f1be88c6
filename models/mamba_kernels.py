"""Device-aware dispatch of the forecaster's Mamba-2 operations (docs/design.md, "Forecaster").

Each operation of :mod:`expertcast.models.mamba_ssd` has a kernel in mamba-ssm or causal-conv1d (the ``gpu`` extra):
a call whose tensors are all on CUDA goes to the kernel when its package is installed, any other call to the
PyTorch reference, so a forecaster kept on the CPU on a GPU node (``forecaster_device: cpu``) never meets a
Triton/CUDA kernel. :func:`calls` counts which path ran, so a GPU check can assert that the kernels were used;
:func:`reference_only` forces the reference (to time it against the kernels). The kernels compute what the
reference computes (tests/models/test_mamba2.py holds them equal on a GPU).

=================  ==========================================  =========================================
operation          kernel                                      reference
=================  ==========================================  =========================================
``chunk_scan``     ``mamba_ssm...ssd_combined.mamba_chunk_scan_combined``  :func:`~expertcast.models.mamba_ssd.ssd_scan`
``state_update``   ``mamba_ssm...selective_state_update``      :func:`~expertcast.models.mamba_ssd.ssd_step`
``conv``           ``causal_conv1d.causal_conv1d_fn``          :func:`~expertcast.models.mamba_ssd.causal_conv`
``conv_update``    ``causal_conv1d.causal_conv1d_update``      :func:`~expertcast.models.mamba_ssd.conv_step`
=================  ==========================================  =========================================

``conv`` continuing from a window (a state and a window of several elements) always takes the reference
(``F.conv1d``, itself a cuDNN call on CUDA): the kernel's initial-state form needs a channel-last layout; so does
a convolution wider than causal-conv1d's kernels take (:data:`KERNEL_WIDTHS`).
"""

from __future__ import annotations

import importlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from expertcast.models import mamba_ssd

KERNELS = {
    "chunk_scan": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    "state_update": ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update"),
    "conv": ("causal_conv1d", "causal_conv1d_fn"),
    "conv_update": ("causal_conv1d", "causal_conv1d_update"),
}
"""Operation -> (module, function) of its kernel."""
KERNEL_WIDTHS = (2, 3, 4)
"""Convolution widths causal-conv1d's kernels take; other widths take the reference."""

_COUNTS: Counter = Counter()
_LOCK = threading.Lock()
_FORCE_REFERENCE = False
_RESOLVED: dict[str, Callable | None] = {}


def _kernel(op: str) -> Callable | None:
    """The installed kernel of ``op`` (None when its package is not importable); resolved once."""
    if op not in _RESOLVED:
        mod, name = KERNELS[op]
        try:
            fn = getattr(importlib.import_module(mod), name)
        except Exception:  # noqa: BLE001 - a missing or broken kernel package means the reference
            fn = None
        _RESOLVED[op] = fn
    return _RESOLVED[op]


def kernel_status() -> dict[str, bool]:
    """Per operation, whether an installed kernel package backs it (mamba-ssm / causal-conv1d)."""
    return {op: _kernel(op) is not None for op in KERNELS}


def _path(op: str, *tensors: torch.Tensor | None) -> Callable | None:
    """The kernel when every tensor is on CUDA and the kernel is installed (counted), else None (the reference)."""
    ts = [t for t in tensors if t is not None]
    fn = _kernel(op) if ts and all(t.is_cuda for t in ts) and not _FORCE_REFERENCE else None
    with _LOCK:
        _COUNTS[(op, "kernel" if fn is not None else "torch")] += 1
    return fn


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor, dt_bias: torch.Tensor, chunk_size: int, initial_state: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~expertcast.models.mamba_ssd.ssd_scan` (same arguments and results)."""
    fn = _path("chunk_scan", x, dt, A, B, C, D, dt_bias, initial_state)
    if fn is None:
        return mamba_ssd.ssd_scan(x, dt, A, B, C, D, dt_bias, chunk_size, initial_state)
    init = initial_state.float().contiguous() if initial_state is not None else None
    y, final = fn(x.contiguous(), dt.contiguous(), A.float(), B.contiguous(), C.contiguous(), chunk_size, D=D.float(),
                  dt_bias=dt_bias.float(), initial_states=init, dt_softplus=True, return_final_states=True)
    return y.float(), final.float()


def state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """:func:`~expertcast.models.mamba_ssd.ssd_step` (same arguments and result; ``state`` advanced in place)."""
    fn = _path("state_update", state, x, dt, A, B, C, D, dt_bias)
    if fn is None:
        return mamba_ssd.ssd_step(state, x, dt, A, B, C, D, dt_bias)
    P, N = x.shape[-1], state.shape[-1]
    y = fn(state, x, dt.unsqueeze(-1).expand(-1, -1, P), A.float().view(-1, 1, 1).expand(-1, P, N), B, C,
           D=D.view(-1, 1).expand(-1, P), dt_bias=dt_bias.view(-1, 1).expand(-1, P), dt_softplus=True)
    return y.float()


def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor | None = None
         ) -> torch.Tensor:
    """:func:`~expertcast.models.mamba_ssd.causal_conv` (same arguments and result)."""
    fn = _path("conv", x, weight, bias) if window is None and weight.shape[-1] in KERNEL_WIDTHS else \
        _path("conv", None)
    if fn is None:
        return mamba_ssd.causal_conv(x, weight, bias, window)
    return fn(x.contiguous(), weight.contiguous(), bias, activation="silu").to(x.dtype)


def conv_update(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
    """:func:`~expertcast.models.mamba_ssd.conv_step` (same arguments and result; ``window`` advanced in place)."""
    fn = _path("conv_update", x, window, weight, bias) if weight.shape[-1] in KERNEL_WIDTHS else \
        _path("conv_update", None)
    if fn is None:
        return mamba_ssd.conv_step(x, window, weight, bias)
    return fn(x, window, weight, bias, activation="silu").to(x.dtype)


@contextmanager
def reference_only() -> Iterator[None]:
    """Inside: every call takes the PyTorch reference, CUDA tensors too (to time the reference against the
    kernels)."""
    global _FORCE_REFERENCE
    old, _FORCE_REFERENCE = _FORCE_REFERENCE, True
    try:
        yield
    finally:
        _FORCE_REFERENCE = old


def calls() -> dict[str, int]:
    """Calls since the last :func:`reset_calls`, by ``operation:path`` (path ``kernel`` or ``torch``)."""
    with _LOCK:
        return {f"{n}:{p}": c for (n, p), c in sorted(_COUNTS.items())}


def reset_calls() -> None:
    with _LOCK:
        _COUNTS.clear()
