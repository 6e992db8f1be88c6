"""Which decode path runs, and why (docs/design.md, "Graph-compatible decode path")."""

from __future__ import annotations

import sys
from typing import Any

import torch
from expertcast.inference.policies.device import PLAN_FLOOR, DeviceProgram
from expertcast.utils.errors import UsageError

DECODE_PATHS = ("eager", "graph", "auto")


def device_program_of(policy: Any) -> DeviceProgram | None:
    """The one place the graph path decides whether it can run a policy: the policy's public device step
    (``policy.device_program()``, :mod:`~expertcast.inference.policies.device`), or None when it has none (it
    decides on the host). Only a policy whose :class:`~expertcast.inference.cache.spec.PolicySpec` lists the
    ``device`` engine is asked; a subclass that redefines a decision hook has no device program."""
    from expertcast.inference.policies import spec_of

    if not spec_of(policy).runs_on("device"):
        return None
    make = getattr(policy, "device_program", None)
    return make() if callable(make) else None


def choose_decode_path(requested: str, policy: Any, device: torch.device, link_gbps: float | None,
                       pinned_store: bool, modules: list[torch.nn.Module] = (), announce: bool = False
                       ) -> tuple[str, str]:
    """(path, reason): which decode path runs and why. ``requested="graph"`` raises UsageError when the
    graph path cannot run; ``"auto"`` falls back to the eager path. ``modules``: the model's experts modules.
    ``announce``: print the choice (on stderr) unless the eager path was asked for."""
    if requested not in DECODE_PATHS:
        raise UsageError(f"decode path must be one of {DECODE_PATHS}, got {requested!r}")
    if requested == "eager":
        return "eager", "the eager path was asked for"
    why_not = None
    program = device_program_of(policy)
    if program is None:
        why_not = f"policy {policy.name!r} decides on the host (the graph path covers lru and seqmoe)"
    elif program.plan_width and program.plan_rule != PLAN_FLOOR:
        why_not = (f"policy {policy.name!r} prefetches by prefetch_rule={program.plan_rule}; the device plan is the "
                   f"{PLAN_FLOOR} rule's (each layer's most likely experts at or above min_confidence): give "
                   f"prefetch_rule={PLAN_FLOOR} or prefetch=false")
    elif link_gbps is not None:
        why_not = "an emulated host-device link (link_gbps) throttles host-driven transfers only"
    elif device.type == "cuda" and not (_has_triton() and pinned_store):
        why_not = "device-side miss copies on CUDA need Triton and a pinned (not memory-mapped) host store"
    elif any(getattr(m, "has_post_expert_norm", False) for m in modules):
        why_not = "the experts apply a per-layer post-expert norm (one layer function serves every layer)"
    elif device.type not in ("cpu", "cuda"):
        why_not = f"device {device.type} is not supported by the graph path"
    if why_not is not None and requested == "graph":
        raise UsageError(f"decode path 'graph' cannot run: {why_not}")
    path = "eager" if why_not else "graph"
    reason = why_not or f"policy {policy.name} keeps its residency and eviction scores on the device"
    if announce:
        print(f"decode path: {path} ({reason})", file=sys.stderr)
    return path, reason


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
