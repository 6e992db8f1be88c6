"""Device-aware dispatch of the Mamba kernels under the forecaster (docs/design.md, "Forecaster").

transformers resolves mamba-ssm's and causal-conv1d's kernels once, when its Mamba modules are
imported, and then calls them whatever device the tensors are on: with mamba-ssm installed, a
forecaster kept on the CPU (``forecaster_device: cpu`` on a GPU node) would be handed Triton/CUDA
kernels. :func:`install` wraps every kernel entry point of ``transformers.models.mamba2`` and
``transformers.models.mamba`` (the functions transformers' ``use_kernel_func_from_hub_with_fallback``
made, found by their closure) so that a call whose tensors are all on CUDA goes to the kernel and any
other call to transformers' own PyTorch reference, and counts which path ran (:func:`calls`), so a
GPU check can assert that the kernels were really used.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

MODULES = ("transformers.models.mamba2.modeling_mamba2", "transformers.models.mamba.modeling_mamba")
"""Modules whose kernel entry points are dispatched."""

_COUNTS: Counter = Counter()
_LOCK = threading.Lock()
_MARK = "_expertcast_dispatch"
_FORCE_REFERENCE = False


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]


def _reference(fn: Callable) -> Callable:
    """transformers' PyTorch implementation behind a kernel-or-fallback function (its ``__wrapped__``)."""
    return inspect.unwrap(fn)


def _takes(fn: Callable) -> Callable[[dict], dict]:
    """A filter keeping only the keyword arguments ``fn`` accepts (all of them with ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return lambda kw: kw
    return lambda kw: {k: v for k, v in kw.items() if k in params}


def _dispatcher(name: str, fn: Callable) -> Callable:
    """``fn`` (transformers' wrapper: kernel when installed) for all-CUDA calls, its reference otherwise."""
    ref = _reference(fn)
    kernel = fn is not ref and bool(_kernel_flag(fn))
    keep = _takes(ref)

    @functools.wraps(ref)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        ts = _tensors(args, kwargs)
        on_cuda = bool(ts) and all(t.is_cuda for t in ts)
        path = "kernel" if kernel and on_cuda and not _FORCE_REFERENCE else "torch"
        with _LOCK:
            _COUNTS[(name, path)] += 1
        return fn(*args, **kwargs) if path == "kernel" else ref(*args, **keep(kwargs))

    setattr(dispatch, _MARK, (name, kernel))
    return dispatch


def _kernel_flag(fn: Callable) -> bool | None:
    """Whether transformers resolved an installed package's implementation for ``fn`` (the
    ``is_new_implementation`` of its wrapper's closure); None when ``fn`` is no kernel-or-fallback wrapper."""
    seen: set[int] = set()
    todo = [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        code = getattr(f, "__code__", None)
        for var, cell in zip(code.co_freevars if code else (), getattr(f, "__closure__", None) or (), strict=False):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if var == "is_new_implementation":
                return bool(value)
            if callable(value):
                todo.append(value)
        if hasattr(f, "__wrapped__"):
            todo.append(f.__wrapped__)
    return None


def install() -> dict[str, bool]:
    """Wrap the kernel entry points of transformers' Mamba modules (idempotent). Returns, per entry point,
    whether an installed kernel package backs it (mamba-ssm / causal-conv1d)."""
    status: dict[str, bool] = {}
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        for name, fn in sorted(vars(mod).items()):
            if not inspect.isfunction(fn) or (not hasattr(fn, _MARK) and _kernel_flag(fn) is None):
                continue
            if not hasattr(fn, _MARK):
                fn = _dispatcher(name, fn)
                setattr(mod, name, fn)
            status[f"{mod_name.rsplit('.', 1)[-1]}.{name}"] = getattr(fn, _MARK)[1]
    return status


@contextmanager
def reference_only() -> Iterator[None]:
    """Inside: every call takes the PyTorch reference, CUDA tensors too (to time the fallback against the
    kernels)."""
    global _FORCE_REFERENCE
    old, _FORCE_REFERENCE = _FORCE_REFERENCE, True
    try:
        yield
    finally:
        _FORCE_REFERENCE = old


def calls() -> dict[str, int]:
    """Calls since the last :func:`reset_calls`, by ``name:path`` (path ``kernel`` or ``torch``)."""
    with _LOCK:
        return {f"{n}:{p}": c for (n, p), c in sorted(_COUNTS.items())}


def reset_calls() -> None:
    with _LOCK:
        _COUNTS.clear()
