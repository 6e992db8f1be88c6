"""The cache-policy interface shared by the simulator and the offloading runtime.

A policy never knows whether the cache it manages is simulated or holds real weights. One driver,
:class:`expertcast.inference.cache.driver.Driver`, owns an :class:`~expertcast.inference.cache.expert_cache.ExpertCache`
and calls the hooks; its module docstring lists the exact order. In short, for every step ``t`` and
MoE layer ``l``::

    policy.on_step(t, info)                             # once per step, before layer 0
    for l in range(L):
        policy.observe_routing(t, l, ids, weights)      # per-member routing, when the driver has it
        loads = policy.before_layer(t, l, cache)        # proactive loads to issue now (may be [])
        action = policy.on_miss(t, l, e, n_tokens, cache) for each non-resident selected e
        victim = policy.choose_victim(t, l, candidates, cache) whenever a slot must be freed
        policy.on_access(t, l, selected, counts, cache) # after the layer ran
        loads = policy.after_layer(t, l, cache)         # proactive loads after the layer ran
    policy.observe_tokens(t, tokens)                    # the tokens the step produced

Experts are addressed as ``(layer, expert)``. Candidates for eviction never include experts of the
running layer's selection, nor slots in state Fetch/Compute (the driver filters them: docs/design.md,
cache semantics). Oracles receive the future through :meth:`Policy.set_future`. Where each member of
the batch is comes from the driver (:class:`~expertcast.inference.cache.schedule.StepInfo`): no policy
rebuilds the lockstep schedule.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np
from expertcast.inference.cache.options import PolicyOptions

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.cache.expert_cache import CacheConfig, ExpertCache
    from expertcast.inference.cache.schedule import StepInfo


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

    A policy is built from its typed options (``Options``, a
    :class:`~expertcast.inference.cache.options.PolicyOptions` beside the class) and keyword-only loaded
    objects; it does no I/O. What it needs and where it runs is its
    :class:`~expertcast.inference.cache.spec.PolicySpec` (``expertcast.inference.policies.spec_of``).

    Attributes:
        name: registry name (``lru``, ``belady``, ``seqmoe``...).
        demand_only: True when the policy never issues proactive loads (it is then bounded by Belady);
            a property where an option decides it.
    """

    Options: type[PolicyOptions] = PolicyOptions
    name: str = "policy"
    demand_only: bool = True

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.options = options if options is not None else type(self).Options()

    def reset(self, config: CacheConfig) -> None:
        """Start a new replay/run with an empty history."""
        self.config = config

    def set_future(self, future: Any) -> None:
        """Oracles only: the accesses still to come (the driver's representation, documented there)."""

    def begin_batch(self, batch: Any) -> None:
        """A new batch of sequences starts (the :class:`TraceSequence` objects of the batch when the
        routing was recorded, so policies fed by recorded side information can look it up; a live
        generation: :class:`~expertcast.inference.runtime.run_state.LivePrompt` objects). Both have
        ``seq_id`` and ``prompt_len``."""

    def on_step(self, t: int, info: StepInfo) -> None:
        """Step ``t`` begins (before layer 0); ``info`` says where every member of the batch is
        (``info.positions`` int [B], -1 when idle; ``info.prefill``; ``info.schedule``)."""

    def observe_routing(self, t: int, layer: int, expert_ids: np.ndarray, weights: np.ndarray) -> None:
        """Per-member routing of (t, layer): ``expert_ids`` int [B, K], ``weights`` float [B, K] (rows of
        idle members are zeros). Called before the layer is served, only for policies overriding it."""

    def observe_tokens(self, t: int, token_ids: Sequence[int | None]) -> None:
        """Tokens of step ``t``, one entry per member of the batch: the token fed to the member's next
        position (a prompt token during prefill, the generated token after), None when the member has
        no next position (idle or finished). SAEM stage detection."""

    def before_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        """Proactive loads ``(layer, expert)`` to issue before ``layer`` routes at step ``t``; an item
        ``(layer, expert, deadline)`` names the layer-execution the load is for (default: the layer's next;
        the driver keeps it from eviction until then)."""
        return ()

    def on_miss(self, t: int, layer: int, expert: int, n_tokens: int, cache: ExpertCache) -> MissAction:
        """Decide how a selected, non-resident expert is served (default: demand-load it)."""
        return MissAction.LOAD

    def choose_victim(self, t: int, layer: int, candidates: np.ndarray, cache: ExpertCache) -> int:
        """Return the index into ``candidates`` (int array [N, 2] of (layer, expert)) to evict."""
        raise NotImplementedError

    def on_access(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray, cache: ExpertCache) -> None:
        """``selected`` int [S] experts routed at (t, layer); ``counts`` int [S] tokens routed to each."""

    def after_routing(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray,
                      cache: ExpertCache) -> Sequence[tuple[int, int]]:
        """Proactive loads to issue once ``layer`` of step ``t`` is routed and its misses are on the link, before it
        computes (items as :meth:`before_layer`'s; they queue behind the layer's demand loads and may use its compute
        time). ``selected`` / ``counts`` as :meth:`on_access`'s."""
        return ()

    def after_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        """Proactive loads to issue after ``layer`` ran at step ``t`` (items as :meth:`before_layer`'s)."""
        return ()

    def on_insert(self, layer: int, expert: int, proactive: bool) -> None:
        """An expert entered the cache (demand or proactive load)."""

    def on_evict(self, layer: int, expert: int) -> None:
        """An expert left the cache."""

    def warm_start(self, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        """Experts ``(layer, expert)`` to place before anything runs (e.g. a static placement), loaded
        like prefill: never counted. Default: none."""
        return ()


def check_policy_compatible(policy: Policy, num_layers: int, num_experts: int, top_k: int, what: str) -> None:
    """Raise ValueError when ``policy`` (or an artifact it holds: forecaster export, router export, cue
    set...) was made for a model of another shape. Policies may define ``check_compatible(L, E, K, what)``;
    artifacts held as attributes are checked through their own ``check_compatible``."""
    objs = [policy] + [v for v in vars(policy).values() if v is not policy]
    for obj in objs:
        fn = getattr(obj, "check_compatible", None)
        if not callable(fn):
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # pragma: no cover
            params = {}
        if "top_k" in params:
            fn(num_layers, num_experts, top_k, what=what)
        elif "num_experts" in params:
            fn(num_layers, num_experts, what=what)
