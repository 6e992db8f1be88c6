"""The cache-policy interface shared by the simulator and the offloading runtime.

A policy never knows whether the cache it manages is simulated or holds real weights. The driver
(simulator engine or runtime) owns an :class:`~expertcast.inference.cache.ExpertCache` and calls the
policy's hooks in this order for every decode step ``t`` and MoE layer ``l``::

    policy.on_step(t)                                   # once per decode step, before layer 0
    for l in range(L):
        loads = policy.before_layer(t, l, cache)        # proactive loads to issue now (may be [])
        action = policy.on_miss(t, l, e, n_tokens, cache) for each non-resident selected e
        victim = policy.choose_victim(t, l, candidates, cache) whenever a slot must be freed
        policy.on_access(t, l, selected, counts, cache) # after the layer's routing is known
        loads = policy.after_layer(t, l, cache)         # proactive loads after the layer ran

Experts are addressed as ``(layer, expert)``. Candidates for eviction never include experts of the
running layer's selection, nor slots in state Fetch/Compute (the driver filters them: DESIGN.md,
cache semantics). Oracles receive the future through :meth:`Policy.set_future`.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.cache import CacheConfig, ExpertCache


class MissAction(IntEnum):
    """What to do with a selected expert that is not resident."""

    LOAD = 0
    """Demand-load it into the cache (counts as a demand miss D)."""
    TEMP = 1
    """Load it into a reserved temporary slot, used once and not retained (counts in D)."""
    CPU = 2
    """Execute it on the CPU where its host copy lives (neither a hit nor a transfer)."""


class Policy:
    """Base class: LRU-like defaults are *not* provided; subclasses implement ``choose_victim``.

    Attributes:
        name: registry name (``lru``, ``belady``, ``seqmoe``...).
        demand_only: True when the policy never issues proactive loads (it is then bounded by Belady).
        needs_future: True for oracles that read the trace through :meth:`set_future`.
    """

    name: str = "policy"
    demand_only: bool = True
    needs_future: bool = False

    def reset(self, config: CacheConfig) -> None:
        """Start a new replay/run with an empty history."""
        self.config = config

    def set_future(self, future: Any) -> None:
        """Oracles only: the accesses still to come (the driver's representation, documented there)."""

    def begin_batch(self, batch: Any) -> None:
        """A new batch of sequences starts decoding (simulator: the :class:`TraceSequence` objects of the
        batch, so policies fed by recorded side information can look it up; runtime: the prompts)."""

    def on_step(self, t: int) -> None:
        """Decode step ``t`` begins (before layer 0)."""

    def observe_tokens(self, t: int, token_ids: Sequence[int]) -> None:
        """Token ids produced at step ``t`` (one per sequence of the batch; SAEM stage detection)."""

    def before_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        """Proactive loads ``(layer, expert)`` to issue before ``layer`` routes at step ``t``."""
        return ()

    def on_miss(self, t: int, layer: int, expert: int, n_tokens: int, cache: ExpertCache) -> MissAction:
        """Decide how a selected, non-resident expert is served (default: demand-load it)."""
        return MissAction.LOAD

    def choose_victim(self, t: int, layer: int, candidates: np.ndarray, cache: ExpertCache) -> int:
        """Return the index into ``candidates`` (int array [N, 2] of (layer, expert)) to evict."""
        raise NotImplementedError

    def on_access(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray, cache: ExpertCache) -> None:
        """``selected`` int [S] experts routed at (t, layer); ``counts`` int [S] tokens routed to each."""

    def after_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        """Proactive loads to issue after ``layer`` ran at step ``t``."""
        return ()

    def on_insert(self, layer: int, expert: int, proactive: bool) -> None:
        """An expert entered the cache (demand or proactive load)."""

    def on_evict(self, layer: int, expert: int) -> None:
        """An expert left the cache."""

    def warm_start(self, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        """Experts ``(layer, expert)`` to place before anything runs (e.g. a static placement), loaded
        like prefill: never counted. Default: none."""
        return ()
