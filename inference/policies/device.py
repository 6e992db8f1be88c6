"""The public device-step interface of a policy (docs/design.md, "Graph-compatible decode path").

A policy whose decisions can run as fixed-shape tensor operations on the device engine
(:mod:`expertcast.inference.runtime.graph`) returns a :class:`DeviceProgram` from its ``device_program()``
method; a policy without that method (or whose method returns None) decides on the host only. The program
says which eviction rule the device step applies, how wide its proactive plan is, how the policy's host
keys are read onto the device and written back, and (forecast rule) which policy's public forecast steps
plan the proactive loads. The device engine reads nothing else of the policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

EVICT_RECENCY = "recency"
"""Evict the least recent access on one access clock (one tick per accessed expert, hits first then misses,
each in selection order): LRU."""
EVICT_FORECAST = "forecast"
"""Evict the lowest forecast CacheScore of the key's next execution, ties to the least recent
layer-execution: SeqMoE."""
EVICTION_RULES = (EVICT_RECENCY, EVICT_FORECAST)
PLAN_FLOOR = "floor"
"""The device engine's proactive plan: each layer's ``plan_width`` most likely experts of its next execution at or
above the policy's floor (``plan_keys``; seqmoe's ``prefetch_rule=floor``, SeqMoE 6.1)."""


@dataclass
class DeviceKeys:
    """A policy's eviction keys as the device step holds them: ``recency`` float64 [L*E] (the access clock of
    each key, or its last layer-execution) and ``clock`` (the access clock; unused by the forecast rule)."""

    recency: np.ndarray
    clock: float = 0.0


@dataclass
class DeviceProgram:
    """What the device engine needs to run one policy's decisions.

    Attributes:
        eviction: one of :data:`EVICTION_RULES`.
        plan_width: proactive loads per layer the step may admit (0: demand only).
        read_keys: the policy's current keys (called once per call, after the prefill replay).
        write_keys: give the keys the device step ended with back to the policy.
        forecaster: forecast rule only: the policy whose public forecast steps
            (``forecast_rows``, ``forecast``, ``forecast_from_tables``, ``forecast_scores``, ``install_scores``)
            the device engine's background planner calls.
        plan_rule: the rule the policy chooses its proactive loads by (seqmoe's ``prefetch_rule``; None without a
            plan). The device engine plans by :data:`PLAN_FLOOR` only and refuses another rule by name.
    """

    eviction: str
    plan_width: int
    read_keys: Callable[[], DeviceKeys]
    write_keys: Callable[[DeviceKeys], None]
    forecaster: Any = None
    plan_rule: str | None = None

    def __post_init__(self) -> None:
        if self.eviction not in EVICTION_RULES:
            raise ValueError(f"device eviction rule must be one of {EVICTION_RULES}, got {self.eviction!r}")


def overrides_any(obj: Any, base: type, hooks: tuple[str, ...]) -> bool:
    """Whether ``type(obj)`` redefines any of ``hooks`` of ``base``: a subclass that changes a decision hook is
    not described by its base class's device program."""
    return any(getattr(type(obj), h) is not getattr(base, h) for h in hooks)
