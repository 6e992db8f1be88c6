"""Hybrid policy: one eviction/prefetch priority from the forecaster, the routers and the stage signal.

Every (layer, expert) gets one priority, in units of expected uses (docs/design.md, "Forecaster"):

    P(l, e) = [forecast] CacheScore(l, e)                     SeqMoE's discounted forecast of its next uses
            + [routers]  router_weight * K/2 * s^T_{t,l}(e)   the adapted routers' retention score (p^R + p^T; the
                                                              K/2 scale makes its per-layer sum K, as the uses)
            + [stage]    stage_weight * f_stage(l, e)         per-token selection frequency of the stage that just
                                                              ended, refreshed at each stage boundary (SAEM's cues)

The lowest-P evictable resident is evicted (ties: least recently used); a forecast prefetch is admitted only when
its P beats the resident it would displace, and ranked by that expected benefit under the link budget, exactly as
``seqmoe``: the policy holds a :class:`~expertcast.inference.policies.seqmoe.SeqMoEPolicy` (:attr:`HybridPolicy.core`),
runs its hooks and adds the router and stage terms to its priority through its public
:meth:`~expertcast.inference.policies.seqmoe.SeqMoEPolicy.add_priority`. ``parts`` switches the terms: ``forecast+routers+stage``,
any subset (``+``-separated), or ``auto`` = the forecaster plus every part whose inputs were given (router
scores: ``replay``; cues: ``cue_set``/``cues``). Without ``forecast`` the forecaster is loaded (it fixes the
trigger layer) but not run, and nothing is prefetched: the policy is demand-only.

The router part reads ``s^T`` through the router policies' score source (a :class:`RouterReplay` in the simulator,
live scores in the runtime via :meth:`use_routers`) and needs per-layer pools, like ``router-temporal``. In a live
evaluation (``expertcast eval --model ROUTER_EXPORT``) the export's routers are attached to the running model
(:func:`expertcast.inference.runtime.live_routers.attach_live_routers`): ``auto`` gains the routers part when the
export carries Temporal routers and says why not otherwise; an explicit ``routers`` part may be given without
``replay`` for that case, and a batch that opens with no score source is refused. The stage
part runs a :class:`~expertcast.inference.policies.stage_aware.StageAwarePolicy` for its boundary detection and
stage counts only (no CPU execution, no SAEM refill loads).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from expertcast.inference.cache.options import option
from expertcast.inference.cache.policy import Policy
from expertcast.inference.cache.spec import PolicySpec
from expertcast.inference.policies.seqmoe import SeqMoEPolicy

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.cache.expert_cache import CacheConfig, ExpertCache
    from expertcast.inference.cache.schedule import StepInfo

PARTS = ("forecast", "routers", "stage")


ROUTERS_MISSING = ("hybrid part 'routers' needs the routers' scores: replay=DIR (recorded router outputs) or "
                   "a router-adaptation export in the runtime")


def parse_parts(parts: str, has_routers: bool, has_stage: bool, routers_later: bool = False) -> tuple[str, ...]:
    """The enabled parts of ``parts`` (``auto`` or a ``+``-separated subset of :data:`PARTS`); ValueError for an
    unknown part or a part whose inputs are missing (``routers_later``: the router scores may still arrive, from
    live routers attached before the first batch)."""
    text = str(parts).strip().lower()
    if text == "auto":
        return tuple(p for p, on in zip(PARTS, (True, has_routers, has_stage), strict=True) if on)
    chosen = tuple(dict.fromkeys(p.strip() for p in text.split("+") if p.strip()))
    bad = [p for p in chosen if p not in PARTS]
    if bad or not chosen:
        raise ValueError(f"hybrid parts must be 'auto' or a '+'-separated subset of {', '.join(PARTS)}; got {parts!r}")
    if "routers" in chosen and not has_routers and not routers_later:
        raise ValueError(ROUTERS_MISSING)
    if "stage" in chosen and not has_stage:
        raise ValueError("hybrid part 'stage' needs stage cues: cue_set=JSON (expertcast stages calibrate) or "
                         "cues='Wait|Alternatively|...'")
    return chosen


class HybridPolicy(Policy):
    """Forecaster + router + stage-boundary priorities in one eviction/prefetch score (registered as ``hybrid``).

    Args (loaded objects; the options are :class:`HybridPolicy.Options`, every ``seqmoe`` option included):
        forecaster: as ``seqmoe`` (required).
        replay: router score source for the ``routers`` part (a RouterReplay or live scores).
        cue_set / tokenizer / decoder: the ``stage`` part's inputs (as ``stage``).
    """

    @dataclass
    class Options(SeqMoEPolicy.Options):
        """Forecaster + router + stage-boundary priorities in one eviction/prefetch score."""

        parts: str = option("auto", "terms of the priority: auto (forecast + every part given inputs) or a '+' list "
                            "of forecast, routers, stage", pattern=re.compile(r"^(auto|(forecast|routers|stage)"
                                                                              r"(\+(forecast|routers|stage))*)$"))
        replay: str | None = option(None, "recorded router outputs (routers part)", file="router_replay")
        router_weight: float = option(1.0, "weight of the routers' s^T term", low=0.0)
        cue_set: str | None = option(None, "calibrated cue set (stage part)", file="cue_set")
        cues: str | tuple[str, ...] | None = option(None, "explicit stage cues separated by '|' (stage part)")
        tokenizer: str | None = option(None, "tokenizer directory or Hub id decoding the token ids (stage part)")
        stage_weight: float = option(1.0, "weight of the stage-frequency term", low=0.0)
        min_stage_steps: int = option(1, "ignore stage boundaries closer than this many decode steps", low=1)

        def reads_tokens(self) -> bool:
            text = str(self.parts).strip().lower()
            return "stage" in text.split("+") or (text == "auto" and (self.cue_set is not None
                                                                      or self.cues is not None))

    name = "hybrid"

    def __init__(self, options: Options | None = None, *, forecaster: Any = None, replay: Any = None,
                 cue_set: Any = None, tokenizer: Any = None, decoder: Any = None) -> None:
        super().__init__(options)
        o = self.options
        self.core = SeqMoEPolicy(o, forecaster=forecaster)
        """The forecast part's eviction and prefetch steps, whose priority this policy widens."""
        parts = o.parts
        self.parts_spec = str(parts).strip().lower()
        """``parts`` as given (``auto`` lets live routers add the routers part)."""
        self.parts = parse_parts(parts, replay is not None, cue_set is not None or o.cues is not None,
                                 routers_later=True)
        self.router_weight = float(o.router_weight)
        self.stage_weight = float(o.stage_weight)
        if "forecast" not in self.parts:
            self.core.stop_forecasting()
        self._router = None
        if "routers" in self.parts:
            from expertcast.inference.policies.router import TemporalRetentionPolicy

            self._router = TemporalRetentionPolicy(replay=replay)
        self._stage = None
        if "stage" in self.parts:
            from expertcast.inference.policies.stage_aware import StageAwarePolicy

            self._stage = StageAwarePolicy(StageAwarePolicy.Options(cues=o.cues, cpu_exec=False,
                                                                    min_stage_steps=o.min_stage_steps),
                                           cue_set=cue_set, tokenizer=tokenizer, decoder=decoder)

    # ------------------------------------------------------------------------------------------ router source
    @property
    def replay(self) -> Any:
        """The routers' score source (None without the ``routers`` part)."""
        return self._router.replay if self._router is not None else None

    def set_replay(self, replay: Any) -> None:
        """Read s^T from ``replay`` (a RouterReplay or live router scores) from the next batch on."""
        if self._router is not None:
            self._router.set_replay(replay)

    @property
    def routers_explicit(self) -> bool:
        """True when ``parts`` names ``routers`` (not ``auto``): the part must get scores or the run fails."""
        return self.parts_spec != "auto" and "routers" in self.parts

    def use_routers(self, source: Any) -> None:
        """Read s^T from ``source`` (e.g. live router scores) from the next batch on; an ``auto`` policy without
        the routers part gains it (ValueError for explicit ``parts`` without ``routers``)."""
        if self._router is None:
            if self.parts_spec != "auto":
                raise ValueError(f"hybrid parts={self.parts_spec} leave the routers part off: no router scores read")
            from expertcast.inference.policies.router import TemporalRetentionPolicy

            self._router = TemporalRetentionPolicy(replay=source)
            self.parts = tuple(p for p in PARTS if p in self.parts or p == "routers")
            if getattr(self, "config", None) is not None:  # already reset by a runtime: the part catches up
                self._router.reset(self.config)
            return
        self._router.set_replay(source)

    def wants_tokenizer(self) -> bool:
        """True when the stage part decodes tokens and has neither a tokenizer nor a decoder yet."""
        return self._stage is not None and self._stage.wants_tokenizer()

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Decode the stage part's tokens with ``tokenizer`` (e.g. the evaluated model's)."""
        if self._stage is not None:
            self._stage.use_tokenizer(tokenizer)

    # ------------------------------------------------------------------------------------------ the core's
    @property
    def demand_only(self) -> bool:
        """No proactive loads: ``prefetch=false`` or no forecast part."""
        return not self.core.prefetch

    @property
    def stats(self) -> dict:
        """The forecast part's counters, with ``stage_refreshes``."""
        return self.core.stats

    @property
    def link_bytes_per_s(self) -> float:
        """The forecast part's link estimate (a runtime may set the measured one before a reset)."""
        return self.core.link_bytes_per_s

    @link_bytes_per_s.setter
    def link_bytes_per_s(self, value: float) -> None:
        self.core.link_bytes_per_s = value

    @property
    def layer_compute_ms(self) -> float:
        return self.core.layer_compute_ms

    @layer_compute_ms.setter
    def layer_compute_ms(self, value: float) -> None:
        self.core.layer_compute_ms = value

    def check_compatible(self, num_layers: int, num_experts: int, top_k: int, what: str = "model") -> None:
        self.core.check_compatible(num_layers, num_experts, top_k, what)

    # ------------------------------------------------------------------------------------------ lifecycle
    def reset(self, config: CacheConfig) -> None:
        super().reset(config)
        self.core.reset(config)
        self.L, self.E, self.K = self.core.L, self.core.E, self.core.K
        self.extra = np.zeros((self.L, self.E))
        """float [L, E]: the router and stage terms of the priority."""
        self._router_term = np.zeros((self.L, self.E))
        self._stage_term = np.zeros((self.L, self.E))
        for part in (self._router, self._stage):
            if part is not None:
                part.reset(config)
        self.stats.update({"stage_refreshes": 0})
        self.core.add_priority(self.extra)

    def begin_batch(self, batch: Any) -> None:
        if self._router is not None and self._router.replay is None:
            raise ValueError(ROUTERS_MISSING)
        members = list(batch)
        self.core.begin_batch(members)
        for part in (self._router, self._stage):
            if part is not None:
                part.begin_batch(members)
        self._router_term[:] = 0.0
        self._stage_term[:] = 0.0
        self._combine()

    def prepare_sequences(self, sequences: Sequence[Any]) -> None:
        self.core.prepare_sequences(sequences)

    def on_step(self, t: int, info: StepInfo) -> None:
        self.core.on_step(t, info)
        for part in (self._router, self._stage):
            if part is not None:
                part.on_step(t, info)

    def observe_tokens(self, t: int, token_ids: Sequence[int | None]) -> None:
        if self._stage is not None:
            self._stage.observe_tokens(t, token_ids)

    # ------------------------------------------------------------------------------------------ the priority
    def _combine(self) -> None:
        self.extra = self.router_weight * self._router_term + self.stage_weight * self._stage_term
        self.core.add_priority(self.extra)

    def _read_router(self, t: int, layer: int) -> None:
        """s^T_{t,layer} of the members processing a token (after this layer's routing), scaled to sum K."""
        s = self._router.temporal_priority(t, layer)
        if s is not None:
            self._router_term[layer] = np.asarray(s, np.float64) * (self.K / 2.0)
            self._combine()

    def _refresh_stage(self, t: int) -> None:
        """At a stage boundary: the finished stage's per-token selection frequency becomes the stage term."""
        counts = self._stage.refresh_ranking(t)
        if counts is None:
            return
        tokens = np.maximum(counts.sum(axis=1, keepdims=True) / self.K, 1.0)
        self._stage_term = np.asarray(counts, np.float64) / tokens
        self._combine()
        self.stats["stage_refreshes"] += 1

    # ------------------------------------------------------------------------------------------ hooks
    def observe_routing(self, t: int, layer: int, expert_ids: np.ndarray, weights: np.ndarray) -> None:
        self.core.observe_routing(t, layer, expert_ids, weights)

    def before_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        if self._stage is not None:
            self._refresh_stage(t)
        return self.core.before_layer(t, layer, cache)

    def on_miss(self, t: int, layer: int, expert: int, n_tokens: int, cache: ExpertCache):
        if self._router is not None:
            self._read_router(t, layer)
        return self.core.on_miss(t, layer, expert, n_tokens, cache)

    def choose_victim(self, t: int, layer: int, candidates: np.ndarray, cache: ExpertCache) -> int:
        return self.core.choose_victim(t, layer, candidates, cache)

    def after_routing(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray,
                      cache: ExpertCache) -> Sequence[tuple[int, int]]:
        return self.core.after_routing(t, layer, selected, counts, cache)

    def after_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        return self.core.after_layer(t, layer, cache)

    def on_insert(self, layer: int, expert: int, proactive: bool) -> None:
        self.core.on_insert(layer, expert, proactive)

    def on_evict(self, layer: int, expert: int) -> None:
        self.core.on_evict(layer, expert)

    def on_access(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray, cache: ExpertCache) -> None:
        self.core.on_access(t, layer, selected, counts, cache)
        if self._router is not None:
            self._read_router(t, layer)
        if self._stage is not None:
            self._stage.on_access(t, layer, selected, counts, cache)


SPECS = (
    PolicySpec("hybrid", HybridPolicy, HybridPolicy.Options, needs={"forecaster", "tokenizer"},
               parts={"router_scores", "cues"},
               help="forecaster + router + stage-boundary priorities in one score"),
)
