"""SeqMoE policy: forecaster-driven prefetch and probabilistic-Belady eviction (SeqMoE 4, 6, 7).

At the trigger layer p of every step (after it routed), the forecaster consumes the element of the
step (layers <= p of this step, layers > p of the previous one) and rolls out ``horizon`` = c future
elements. Then:

* Prefetch (6): from the first-step probabilities, up to ``max_tasks_per_layer`` (default K) tasks per
  layer, deadline = the layer's next execution. ``prefetch_rule="floor"`` is the paper's rule:
  confidence = probability, fixed floor ``min_confidence``. ``"benefit"``: a task's confidence is its
  expected benefit (its CacheScore minus that of the resident it would displace; tasks without a positive
  benefit are not generated) and the floor is at most chance (K/E). Measured on real-like routing
  (top-6 of 64, entropy ~0.99, step overlap ~0.27; forecaster with online statistics): both rules stay
  above LRU at 15/25/45%, but "benefit" moves 1.5-3x the bytes for slightly lower Hit and lower AdjHit. The
  :class:`~expertcast.inference.policies.prefetch.PrefetchScheduler` keeps the highest-confidence EDF-feasible
  set under the EMA transfer-time estimate and starts transfers in EDF order at every layer boundary;
  expired tasks are dropped. A task is issued only when a slot is free or its cache score beats the
  resident it would evict. ``"headroom"`` (the default): expected hit gain against the link's free time per layer,
  no floor (:func:`~expertcast.inference.policies.prefetch.plan_within_headroom`, docs/design.md "Prefetch"); its plan
  is issued at the trigger. With ``breakeven`` (default on) a load must also spare, in expectation, at least this
  run's AdjHit in demand misses, its forecast ``q - v`` scaled by the realised/expected ratio of the loads already
  issued (:class:`~expertcast.inference.policies.prefetch.SparedMissCalibration`).
* Eviction (7.1): CacheScore(e) = sum_{j=1..c} gamma^(j-1) P(e active at its j-th next execution);
  the lowest-score Used slot is evicted (ties: least recently used). Executions that already happened
  since the forecast are skipped, so the nearest remaining one weighs 1.

With a batch, the per-sequence forecasts combine as P = 1 - prod_b (1 - P_b).

Inputs: the forecaster needs each sequence's normalized top-K weights per layer. The driver passes
them through :meth:`SeqMoEPolicy.observe_routing` (simulator: from the traces; runtime: from the
model's router) and says which position each member processes (:meth:`on_step`); without per-member
routing the selection with its token counts is used.

Forecasts depend only on the routing history, never on cache decisions. When the batch's sequences
are known in advance (simulator replay), ``precompute=True`` computes each sequence's forecasts at
every position once (:mod:`~expertcast.inference.policies.forecast_tables`) and reuses them across
capacities; the results equal the online path's (a test checks it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from expertcast.inference.cache.expert_cache import SlotState
from expertcast.inference.cache.options import DEVICE_PATTERN, PolicyOptions, option
from expertcast.inference.cache.policy import Policy
from expertcast.inference.cache.spec import PolicySpec
from expertcast.inference.policies.device import EVICT_FORECAST, DeviceKeys, DeviceProgram, overrides_any
from expertcast.inference.policies.forecast_tables import (
    ForecastScores,
    ForecastTables,
    combine_members,
    online_forecast,
    precompute_forecasts,
    precompute_forecasts_many,
)
from expertcast.inference.policies.oracle_forecast import FORECAST_SOURCES, OracleForecast
from expertcast.inference.policies.prefetch import (
    PrefetchScheduler,
    SparedMissCalibration,
    TransferEstimator,
    chance_level,
    displaced_scores,
    execution_rows,
    expected_benefit,
    generate_tasks,
    headroom_may_issue,
    plan_within_headroom,
    pool_victims,
)
from expertcast.models.forecaster import ExpertForecaster, ForecasterState, trigger_offset
from expertcast.models.forecaster_components import within_token_chain, within_token_posterior
from expertcast.utils.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.cache.expert_cache import CacheConfig, ExpertCache
    from expertcast.inference.cache.schedule import StepInfo


PREFETCH_RULES = ("headroom", "benefit", "floor")
"""How prefetch tasks are chosen: expected hit gain against the link's headroom, expected benefit over the displaced
resident, or probability above a floor."""
_DEVICE_HOOKS = ("begin_batch", "on_step", "before_layer", "on_miss", "choose_victim", "on_access", "after_layer",
                 "on_insert", "on_evict", "_scores", "_load_scores", "_trigger", "_forecast")
"""The hooks :meth:`SeqMoEPolicy.device_program` reproduces on the device."""


@dataclass
class ForecastOptions(PolicyOptions):
    """Options shared by the SeqMoE policies."""

    forecaster: str | None = option(None, "forecaster export (required; or --forecaster)", file="forecaster")
    horizon: int = option(8, "forecast steps c read for eviction and prefetch", low=1)
    gamma: float = option(0.5, "discount per forecast step in (0, 1]", low=0.0, low_open=True, high=1.0)
    prefetch: bool = option(True, "issue proactive loads (false: eviction only)")
    max_tasks_per_layer: int | None = option(None, "most prefetches per layer (default: top-K)", low=1)
    min_confidence: float = option(0.2, "smallest forecast probability worth a prefetch", low=0.0, high=1.0)
    lookahead: float = option(2.0, "prefetch window in layer-execution times", low=0.0, low_open=True)
    transfer_layers: float | None = option(None, "one transfer's time in layer executions (default: from the "
                                           "link and compute settings)", low=0.0, low_open=True)
    bandwidth_gbps: float = option(25.0, "host-device link GB/s used for the transfer-time estimate", low=0.0,
                                   low_open=True)
    link_bytes_per_s: float | None = option(None, "measured link rate in bytes/s (overrides bandwidth_gbps)",
                                            low=0.0, low_open=True)
    layer_compute_ms: float = option(0.15, "per-layer compute ms used for the transfer-time estimate", low=0.0,
                                     low_open=True)
    ema_alpha: float = option(0.2, "EMA weight of the newest sample of the transfer-time estimate (never below the "
                              "link's own transfer time)", low=0.0, high=1.0)
    device: str = option("cpu", "device of the forecaster: cpu, cuda[:N] or mps", pattern=DEVICE_PATTERN)
    forecast_cache_mb: float = option(1024.0, "memory for precomputed forecasts, MB", low=0.0)
    replan: int = option(0, "re-plan prefetch every N layers after the trigger layer, the forecast of the token's "
                         "later layers refined by the forecaster's within-token table from the layer just routed "
                         "(batch 1; needs an export with within_token_table; 0: off; docs/design.md, 'Prefetch')",
                         low=0)

    def check(self) -> None:
        if self.forecaster is None:
            raise UsageError(f"{self.policy} needs a forecaster: {self.policy}:forecaster=EXPORT_DIR "
                             f"(or --forecaster EXPORT_DIR)")


def _load_model(forecaster: Any, device: str) -> tuple[ExpertForecaster, str]:
    from expertcast.models.forecaster_export import ForecasterExport

    if isinstance(forecaster, ExpertForecaster):
        return forecaster.to(device).eval(), "in-memory"
    if isinstance(forecaster, ForecasterExport):
        return forecaster.model.to(device).eval(), str(forecaster.path)
    raise ValueError("seqmoe needs a forecaster: an export directory (seqmoe:forecaster=PATH, or --forecaster PATH "
                     "with `expertcast simulate`), a ForecasterExport or an ExpertForecaster")


class SeqMoEPolicy(Policy):
    """Forecast-driven prefetch + probabilistic-Belady eviction (registered as ``seqmoe``).

    Args (``forecaster`` a loaded object, the others fields of :class:`SeqMoEPolicy.Options`):
        forecaster: a loaded :class:`ForecasterExport` or an :class:`ExpertForecaster`.
        horizon: c, forecast steps used by the eviction score (recursive rollout).
        gamma: discount of farther steps in the eviction score. With gamma <= 0.5 a certain use at step j
            outweighs any uses after it, so exact forecasts reproduce Belady's order (measured on a synthetic
            process: gamma 0.5 matched Belady, 0.9 fell to LRU's level at 25% capacity).
        prefetch: issue proactive loads (False: eviction only, a demand-only policy).
        max_tasks_per_layer: prefetch tasks per layer per forecast (default K).
        min_confidence: tasks below this probability are not generated (with ``prefetch_rule="benefit"`` the floor
            is min(min_confidence, K/E)). 0.2 measured on the default model's CoT
            routing (12 held-out sequences): vs 0.05, at 25% capacity Hit 0.844 vs 0.850 with 1.19 vs 1.78
            MB/token (LRU 0.546, 1.43); at 45% Hit 0.956 vs 0.944 with 0.48 vs 0.76 MB/token.
        prefetch_rule: ``"benefit"``: rank tasks by expected benefit over the displaced resident, floor capped at
            chance (K/E); ``"floor"``: rank by probability above the fixed ``min_confidence`` (SeqMoE 6.1).
        lookahead: layer-executions of link time kept queued by the scheduler.
        transfer_layers: initial transfer-time estimate in layer-executions (default: from the cache's
            expert bytes with ``bandwidth_gbps`` and ``layer_compute_ms``).
        ema_alpha: EMA weight of the transfer-time estimate.
        precompute: compute forecasts per sequence up front when the batch's routing is known (simulator).
        device: where the forecaster runs.
        forecast_cache_mb: memory budget for precomputed forecasts kept across replays.
    """

    @dataclass
    class Options(ForecastOptions):
        """SeqMoE: forecaster-driven prefetch and probabilistic-Belady eviction."""

        precompute: bool = option(True, "compute every forecast of a sequence up front (same results, faster)")
        prefetch_rule: str = option("headroom", "headroom: expected hit gain against the link's free time per "
                                    "layer (no floor); floor: probability above min_confidence (SeqMoE 6.1); "
                                    "benefit: expected benefit over the displaced resident (floor capped at chance K/E)",
                                    choices=PREFETCH_RULES)
        breakeven: bool = option(True, "headroom rule: also require that the demand misses a load spares in "
                                 "expectation (q - v, calibrated) reach this run's AdjHit (A - D)/(A + P), so that no "
                                 "proactive load lowers AdjHit in expectation (false: the link's headroom alone "
                                 "decides: more loads on an idle link, a little more speed, a lower AdjHit)")
        plan_executions: int = option(2, "headroom rule: plan each layer's next N executions (2: also the one "
                                      "after, which reaches the layer right after the trigger a step ahead and fills "
                                      "the link's idle time at the end of a step, its loads calibrated apart; 1: the "
                                      "next only, SeqMoE 6)", low=1, high=2)
        calibration_half_life: float = option(64.0, "break-even: half-life in decode steps of the realised/expected "
                                              "ratio of demand misses spared by the loads issued, which scales every "
                                              "q - v (0: take the forecast's q - v as it is)", low=0.0)
        calibrate: bool | None = option(None, "headroom rule: scale every q - v by the realised/expected ratio "
                                        "(calibration_half_life) whether or not the break-even floor is on (default: "
                                        "with the break-even only); breakeven=false,calibrate=true drops the AdjHit "
                                        "floor and keeps the check that a forecast's loads spare what it says")
        forecast: str = option("model", "where forecasts come from: model (the forecaster) or oracle (the replayed "
                               "trace's true future at recall@K = recall; docs/design.md, 'Oracle forecast')",
                               choices=FORECAST_SOURCES)
        recall: float = option(1.0, "forecast=oracle: recall@K of the oracle (true experts dropped, false ones added "
                               "at the same rate, seeded)", low=0.0, high=1.0)
        forecast_seed: int = option(0, "forecast=oracle: seed of the recall draws", low=0)
        trigger_layer: int | None = option(None, "forecast=oracle without a forecaster: the trigger layer p (default "
                                           "L-1); with a forecaster, its own", low=0)

        def check(self) -> None:
            if self.forecast != "oracle":
                super().check()

    name = "seqmoe"

    def __init__(self, options: ForecastOptions | None = None, *, forecaster: Any = None):
        super().__init__(options)
        o = self.options
        self.oracle: OracleForecast | None = None
        if getattr(o, "forecast", "model") == "oracle":  # forecasts from the replayed routing (oracle_forecast)
            self.model = _load_model(forecaster, o.device)[0] if forecaster is not None else None
            self.oracle = OracleForecast(o.recall, o.forecast_seed, o.trigger_layer,
                                         self.model.config if self.model is not None else None)
            self.source = self.oracle.source
            self.fc = self.oracle.config
        else:
            self.model, self.source = _load_model(forecaster, o.device)
            self.fc = self.model.config
        self.horizon = int(o.horizon)
        self.gamma = float(o.gamma)
        self.prefetch = bool(o.prefetch)
        self.max_tasks = int(o.max_tasks_per_layer or (self.fc.top_k if self.fc is not None else 1))
        self.min_confidence = float(o.min_confidence)
        # seqmoe-async's options have neither field: it ranks by the floor rule and forecasts online
        self.prefetch_rule = getattr(o, "prefetch_rule", "floor")
        self.breakeven = bool(getattr(o, "breakeven", False))
        self.calibration_half_life = float(getattr(o, "calibration_half_life", 0.0))
        self.calibrate = getattr(o, "calibrate", None)
        self.plan_executions = int(getattr(o, "plan_executions", 2))
        self.lookahead = float(o.lookahead)
        self.transfer_layers = o.transfer_layers
        self.bandwidth_gbps = float(o.bandwidth_gbps)
        self.link_bytes_per_s = float(o.link_bytes_per_s) if getattr(o, "link_bytes_per_s", None) else \
            self.bandwidth_gbps * 1e9
        self.layer_compute_ms = float(o.layer_compute_ms)
        self.ema_alpha = float(o.ema_alpha)
        self.precompute = bool(getattr(o, "precompute", False))
        self.device = o.device
        self.forecast_cache_bytes = int(o.forecast_cache_mb * 2**20)
        self._step_flops = self.model.step_flops() if self.model is not None else 0  # one step at batch 1
        self.tables = ForecastTables(self.forecast_cache_bytes, self._one_table, self._many_tables,
                                     lambda: self.horizon * self.fc.num_layers * self.fc.num_experts * 2,
                                     store=lambda key, tab: self._store_table(key, tab))
        self.disc = self.gamma ** np.arange(self.horizon)
        self.forecasting = True
        """Run the forecaster (False: a composing policy uses this one's eviction and prefetch steps with its own
        priority only, :meth:`add_priority`; no forecast is made, nothing is prefetched)."""
        self.priority_extra: np.ndarray | None = None
        """float [L, E] added to every CacheScore (:meth:`add_priority`), None: the forecast's score alone."""
        self.replan_every = int(getattr(o, "replan", 0))
        self._within: np.ndarray | None = None
        self._within_freq: np.ndarray | None = None
        if self.replan_every:
            comps = getattr(self.model, "components", None) if self.oracle is None else None
            if comps is None or comps.within is None:
                raise UsageError(f"{self.name}: replan needs a learned forecaster whose export carries the "
                                 f"within-token table (within_token_table: true in its recipe); "
                                 f"{'forecast=oracle' if self.oracle is not None else self.source} has none")
            self._within = comps.within.detach().float().cpu().numpy()
            self._within_freq = comps.freq.detach().float().cpu().numpy()

    @property
    def demand_only(self) -> bool:
        """Eviction only (``prefetch=false``): no proactive loads."""
        return not self.prefetch

    # ------------------------------------------------------------------------------------------ setup
    def check_compatible(self, num_layers: int, num_experts: int, top_k: int, what: str = "model") -> None:
        if self.fc is None:  # the oracle alone forecasts at the shape it first meets
            self.fc = self.oracle.bind(num_layers, num_experts, top_k)
            self.max_tasks = int(self.options.max_tasks_per_layer or self.fc.top_k)
        mine = (self.fc.num_layers, self.fc.num_experts, self.fc.top_k)
        if mine != (num_layers, num_experts, top_k):
            raise ValueError(f"seqmoe forecaster ({self.source}) has L={mine[0]}, E={mine[1]}, K={mine[2]} but the "
                             f"{what} has L={num_layers}, E={num_experts}, K={top_k}: it was trained for another model")

    def reset(self, config: CacheConfig) -> None:
        super().reset(config)
        self.check_compatible(config.num_layers, config.num_experts, config.top_k, what="cache/trace")
        L, E = config.num_layers, config.num_experts
        self.L, self.E, self.K = L, E, config.top_k
        self.p = self.fc.p
        self.s = trigger_offset(L, self.p)
        self.last_use = np.full((L, E), -1.0)
        self.score_before = np.zeros((L, E))
        self.score_after = np.zeros((L, E))
        self.first_exec = np.full(L, -1, np.int64)
        self.first_probs = np.zeros((L, E))
        self.second_probs: np.ndarray | None = None
        self.has_forecast = False
        tau = self.transfer_layers
        if tau is None:
            ms = (config.expert_bytes or 1) / self.link_bytes_per_s * 1e3
            tau = max(ms / max(self.layer_compute_ms, 1e-9), 1e-6)
        # the link's own transfer time is a floor: observed windows may say slower (contention), never faster
        self.scheduler = PrefetchScheduler(TransferEstimator(float(tau), self.ema_alpha, min_tau=float(tau)),
                                           self.lookahead)
        self._inflight: set[tuple[int, int]] = set()
        self._planned: list[tuple[int, int, int]] = []
        self._tally = [0, 0, 0]  # accesses, demand misses, proactive loads seen by the hooks (the AdjHit break-even)
        calibrate = self.breakeven if self.calibrate is None else self.calibrate
        half_life = self.calibration_half_life if self.prefetch_rule == "headroom" and calibrate else 0.0
        self.calibrations = [SparedMissCalibration(half_life) for _ in range(self.plan_executions)]
        """One per execution planned (the next, the one after): a forecast two executions ahead is less sure than
        one execution ahead, and its loads hold their slots longer; each is scaled by its own realised/expected
        ratio (docs/design.md, "Prefetch")."""
        self._missed: tuple[int, set[int]] = (-1, set())  # this layer-execution's demand misses
        self._prior: set[tuple[int, int]] = set()
        self._prior_x = -1
        self._now = (0, 0, 0)
        self.members: list[Any] = []
        self._pos: list[int] = []
        self._active = np.zeros(0, np.int64)
        self._state: ForecasterState | None = None
        self._latest: np.ndarray | None = None
        self._pending: list[tuple] = []  # routing noted for _latest, not written yet (_flush_routing)
        self._observed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._row_tables: list[np.ndarray | None] = []
        self.priority_extra = None
        self.stats = {"forecasts": 0, "tasks": 0, "issued": 0, "rejected_by_score": 0, "forecast_seconds": 0.0,
                      "forecast_cpu_seconds": 0.0, "forecast_path_seconds": 0.0, "forecast_calls": 0,
                      "forecast_flops": 0, "dropped": 0, "precompute_seconds": 0.0, "precompute_elements": 0,
                      "precompute_flops": 0, "replans": 0, "replans_skipped": 0}

    def add_priority(self, extra: np.ndarray | None) -> None:
        """From now on the priority of (layer, expert) is its CacheScore plus ``extra`` float [L, E] (in expected
        uses, like the CacheScore; None: the CacheScore alone), for eviction, the prefetch benefit and admission
        alike. A composing policy's own terms (``hybrid``: docs/design.md, "Forecaster"); cleared by reset."""
        self.priority_extra = extra

    def stop_forecasting(self) -> None:
        """Never run the forecaster (it still fixes the trigger layer): no forecast tables, no recurrent state,
        no prefetch; the priority is :meth:`add_priority`'s term alone (a demand-only policy)."""
        self.forecasting = False
        self.prefetch = False

    # ------------------------------------------------------------------------------------------ device step
    def device_program(self) -> DeviceProgram | None:
        """This policy's decisions on the device engine (:mod:`~expertcast.inference.policies.device`): eviction
        by the forecast CacheScore, ties to the least recent layer-execution, a plan of :meth:`plan_keys` per
        layer when prefetching, forecasts from this policy's public forecast steps. None for a subclass that
        redefines a decision hook (its decisions are not these)."""
        if (overrides_any(self, SeqMoEPolicy, _DEVICE_HOOKS) or not self.forecasting or self.priority_extra is not None
                or self.replan_every):
            return None
        return DeviceProgram(EVICT_FORECAST, self.max_tasks if self.prefetch else 0,
                             read_keys=lambda: DeviceKeys(self.last_use.reshape(-1).copy()),
                             write_keys=self._set_device_keys, forecaster=self,
                             plan_rule=self.prefetch_rule if self.prefetch else None)

    def _set_device_keys(self, keys: DeviceKeys) -> None:
        self.last_use = np.asarray(keys.recency, np.float64).reshape(self.L, self.E).copy()

    def plan_keys(self, probs: np.ndarray, width: int) -> np.ndarray:
        """int64 [L, max(width, 1)]: keys ``layer * E + expert`` of the ``width`` most likely experts of each
        layer's next execution (``probs`` [L, E]) at or above :attr:`min_confidence`, -1 padded (the device
        engine's proactive plan; all -1 when ``width`` is 0)."""
        if width == 0:
            return np.full((self.L, 1), -1, np.int64)
        top = np.argsort(-probs, axis=1, kind="stable")[:, :width]
        conf = np.take_along_axis(probs, top, axis=1)
        keys = np.arange(self.L)[:, None] * self.E + top
        return np.where((conf >= self.min_confidence) & (conf > 0), keys, -1).astype(np.int64)

    # ------------------------------------------------------------------------------------------ batch / steps
    def begin_batch(self, batch: Any) -> None:
        self.members = list(batch)
        B = len(self.members)
        if not self.forecasting:  # the forecaster never runs: no forecast tables, no recurrent state to step
            self._traced = False
            self._row_tables = [None] * B
            self._state = self._latest = None
            return
        self._traced = all(hasattr(m, "expert_ids") and hasattr(m, "expert_weights") for m in self.members)
        for cal in self.calibrations:
            cal.clear_pending()
        self._row_tables = [None] * B
        if self.oracle is not None and not self._traced:
            raise UsageError("seqmoe:forecast=oracle reads the replayed routing: every batch member needs its "
                             "recorded expert_ids (a trace replay or forced routing), not live generation")
        if self.precomputed:
            self._row_tables = [self.tables.table_for(m) for m in self.members]
        else:
            self._state = self.model.init_state(B, self.device)
            self._latest = np.zeros((B, self.L, self.E), np.float32)
            self._pending = []

    def _store_table(self, key: str, tab: np.ndarray) -> np.ndarray:
        return self.tables.put(key, tab)

    _tables = property(lambda self: self.tables.tables, doc="The cached tables, by key (:class:`ForecastTables`).")
    _table_bytes = property(lambda self: self.tables.nbytes, doc="Their float16 bytes.")

    def prepare_sequences(self, sequences: Sequence[Any]) -> None:
        """Simulator hook: every sequence of the replay is known up front, so their forecast tables are computed
        together and streamed within ``forecast_cache_mb`` (:meth:`ForecastTables.prepare`)."""
        if (self.precompute or self.oracle is not None) and self.forecasting:
            self.tables.prepare(sequences)

    def _one_table(self, seq: Any) -> np.ndarray:
        if self.oracle is not None:
            return self.oracle.table(seq, self.fc, self.horizon)
        t0 = time.perf_counter()
        tab = precompute_forecasts(self.model, seq.expert_ids, seq.expert_weights, self.horizon)
        self._count_precompute([tab], time.perf_counter() - t0)
        return tab

    def _many_tables(self, seqs: Sequence[Any]) -> list[np.ndarray]:
        if self.oracle is not None:
            return self.oracle.tables(seqs, self.fc, self.horizon)
        t0 = time.perf_counter()
        tabs = precompute_forecasts_many(self.model, [(s.expert_ids, s.expert_weights) for s in seqs], self.horizon)
        self._count_precompute(tabs, time.perf_counter() - t0)
        return tabs

    def _count_precompute(self, tables: Sequence[np.ndarray], seconds: float) -> None:
        """The forecaster's cost of computing ``tables`` before the decode (its time, elements and FLOPs: one step
        per element plus the recursive rollout beyond the direct heads), kept apart from the online counters: a
        replay's tokens/s does not include it, and its report says so."""
        n = sum(len(t) for t in tables)
        st = self.stats
        st["precompute_seconds"] += seconds
        st["precompute_elements"] += n
        st["precompute_flops"] += self._step_flops * (1 + max(self.horizon - self.fc.direct_horizons, 0)) * n

    def on_step(self, t: int, info: StepInfo) -> None:
        self._pos = info.positions.tolist()
        self._active = np.flatnonzero(np.asarray(info.positions) >= 0)  # the members this step runs
        self._observed = {}

    def observe_routing(self, t: int, layer: int, expert_ids: np.ndarray, weights: np.ndarray) -> None:
        """Per-member routing of (t, layer): expert_ids int [B, K], weights float [B, K] (rows of idle members ignored)."""
        self._observed[layer] = (np.asarray(expert_ids), np.asarray(weights, dtype=np.float32))

    # ------------------------------------------------------------------------------------------ forecasting
    def _record_routing(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray) -> None:
        """Online mode: note this layer's routing of every active member (the driver's per-member routing; without
        it, the selection weighted by its token counts) for ``_latest``; :meth:`_flush_routing` writes the noted
        layers when an element is read, all of one step's at once."""
        self._pending.append((layer, self._active, self._observed.get(layer), selected, counts))

    def _flush_routing(self) -> None:
        """Write the noted layers' routing into ``_latest`` (rows normalized per member and layer), in the order
        noted; the layers of one step with per-member routing go through one weighted count."""
        pending, self._pending = self._pending, []
        E, i = self.E, 0
        while i < len(pending):
            layer, active, obs, selected, counts = pending[i]
            n = len(active)
            if obs is None:
                rows = np.zeros((n, E), np.float32)
                np.add.at(rows[0], np.asarray(selected, np.int64), np.asarray(counts, np.float32))
                rows[1:] = rows[0]
                self._latest[active, layer] = rows / np.maximum(rows.sum(axis=1, keepdims=True), 1e-9)
                i += 1
                continue
            j = i + 1  # the run of noted layers of the same step (same active members), all with per-member routing
            while j < len(pending) and pending[j][1] is active and pending[j][2] is not None:
                j += 1
            layers = [pending[k][0] for k in range(i, j)]
            ids = np.stack([pending[k][2][0][active] for k in range(i, j)], axis=1).astype(np.int64)  # [n, G, K]
            w = np.stack([pending[k][2][1][active] for k in range(i, j)], axis=1).astype(np.float32)
            G = len(layers)
            flat = ((np.arange(n * G) * E).reshape(n, G, 1) + ids).reshape(-1)
            rows = np.bincount(flat, w.reshape(-1), n * G * E).reshape(n, G, E)
            rows = rows.astype(np.float32)  # an entry is one weight (top-K never repeats an expert): exact
            self._latest[active[:, None], np.asarray(layers)] = rows / np.maximum(rows.sum(axis=2, keepdims=True),
                                                                                  1e-9)
            i = j

    @property
    def precomputed(self) -> bool:
        """Whether this batch's forecasts come from the precomputed tables (recorded routing, ``precompute``)
        rather than from the online forecaster state."""
        return self._traced and (self.precompute or self.oracle is not None)

    def forecast_rows(self, members: Sequence[int], positions: Sequence[int]) -> list[int]:
        """The ``members`` (batch rows, processing ``positions``) whose element exists (position >= s)."""
        return [b for b, pos in zip(members, positions, strict=True) if pos >= 0 and pos - self.s >= 0]

    def element(self, rows: Sequence[int]) -> np.ndarray:
        """float32 [len(rows), L, E]: a copy of the newest element of members ``rows`` (online mode)."""
        assert self._latest is not None
        if self._pending:
            self._flush_routing()
        return self._latest[list(rows)].copy()

    def record_element(self, rows: Sequence[int], act: np.ndarray, layers: slice) -> None:
        """Online mode: members ``rows`` routed ``act`` float32 [len(rows), L', E] at ``layers`` (normalized
        activation vectors) in the current step."""
        assert self._latest is not None
        if self._pending:
            self._flush_routing()
        self._latest[list(rows), layers] = act

    @torch.no_grad()
    def forecast(self, rows: Sequence[int], x: np.ndarray, rollout: bool = True,
                 state: ForecasterState | None = None) -> np.ndarray | None:
        """Online forecaster step: members ``rows`` consume element ``x`` float32 [len(rows), L, E]; with
        ``rollout``, returns the [H, L, E] combined activation probabilities of their next ``horizon`` elements
        (float16-rounded per member, as precomputed tables store them), else None. Runs on any one thread; ``state``:
        the recurrent state it advances (default the batch's). Its time, calls and FLOPs go to :attr:`stats`."""
        state = self._state if state is None else state
        assert state is not None
        t0, c0 = time.perf_counter(), time.thread_time()
        F, steps = online_forecast(self.model, state, rows, x, self.horizon, rollout, self.device)
        st, st["forecast_calls"] = self.stats, self.stats["forecast_calls"] + 1
        st["forecast_seconds"] += time.perf_counter() - t0
        st["forecast_cpu_seconds"] += time.thread_time() - c0
        st["forecast_flops"] += self._step_flops * steps * len(rows)
        return F

    def forecast_from_tables(self, members: Sequence[int], positions: Sequence[int]) -> np.ndarray | None:
        """[H, L, E] combined precomputed forecasts of ``members`` at ``positions`` (precomputed mode), or None."""
        per_member = []
        for b, pos in zip(members, positions, strict=True):
            el = pos - self.s
            tab = self._row_tables[b]
            if pos >= 0 and tab is not None and 0 <= el < len(tab):
                per_member.append(tab[el].astype(np.float32))
        return combine_members(per_member) if per_member else None

    def forecast_scores(self, t: int, F: np.ndarray) -> ForecastScores:
        """The eviction scores and prefetch inputs of forecast ``F`` [H, L, E] made at step ``t``'s trigger."""
        H = F.shape[0]
        d = self.disc[:H]
        layers = np.arange(self.L)
        return ForecastScores(before=np.einsum("h,hle->le", d, F),
                              after=np.einsum("h,hle->le", d[: H - 1], F[1:]) if H > 1 else np.zeros_like(F[0]),
                              first_exec=np.where(layers > self.p, t * self.L + layers, (t + 1) * self.L + layers),
                              first_probs=F[0], second_probs=F[1] if H > 1 else None)

    def current_scores(self) -> ForecastScores:
        """The scores in use (zeros and first executions -1 before the first forecast)."""
        return ForecastScores(self.score_before, self.score_after, self.first_exec, self.first_probs)

    def install_scores(self, sc: ForecastScores) -> None:
        """Make ``sc`` the scores of eviction and prefetch (counts one forecast)."""
        self.stats["forecasts"] += 1
        self.score_before, self.score_after = sc.before, sc.after
        self.first_exec, self.first_probs = sc.first_exec, sc.first_probs
        self.second_probs = sc.second_probs
        self.has_forecast = True

    def _forecast(self, t: int) -> np.ndarray | None:
        """[H, L, E] combined activation probabilities of the next ``horizon`` elements, or None."""
        members = list(range(len(self._pos)))
        if self.precomputed:
            return self.forecast_from_tables(members, self._pos)
        rows = self.forecast_rows(members, self._pos)
        return self.forecast(rows, self.element(rows)) if rows else None

    def trigger(self, t: int, F: np.ndarray | None) -> None:
        """Install the forecast ``F`` made at step ``t``'s trigger (nothing when None)."""
        if F is not None:
            self.install_scores(self.forecast_scores(t, F))

    def _trigger(self, t: int) -> None:
        if self.forecasting:
            t0 = time.perf_counter()
            self.trigger(t, self._forecast(t))
            self.stats["forecast_path_seconds"] += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------ scores
    def _scores(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """CacheScore of (layers[i], experts[i]) at the current time (plus :attr:`priority_extra`)."""
        if not self.has_forecast:
            score = np.zeros(len(layers))
        else:
            t, cur, phase = self._now
            x_now = t * self.L + cur
            fx = self.first_exec[layers]
            ahead = (fx > x_now) | ((fx == x_now) & (phase == 0))
            score = np.where(ahead, self.score_before[layers, experts], self.score_after[layers, experts])
        return score if self.priority_extra is None else score + self.priority_extra[layers, experts]

    def _load_scores(self) -> np.ndarray:
        """float [L, E]: the score an expert loaded now would have (its CacheScore from its next execution, plus
        :attr:`priority_extra`)."""
        return self.score_before if self.priority_extra is None else self.score_before + self.priority_extra

    def eviction_order(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """Indices of (layers[i], experts[i]) in eviction order: lowest CacheScore first, ties least recent first."""
        return np.lexsort((self.last_use[layers, experts], self._scores(layers, experts)))

    def choose_victim(self, t: int, layer: int, candidates: np.ndarray, cache: ExpertCache) -> int:
        return int(self.eviction_order(candidates[:, 0].astype(np.int64), candidates[:, 1].astype(np.int64))[0])

    # ------------------------------------------------------------------------------------------ hooks
    def on_miss(self, t: int, layer: int, expert: int, n_tokens: int, cache: ExpertCache):
        self._now = (t, layer, 1)
        self._tally[1] += 1
        x = t * self.L + layer
        if self._missed[0] != x:
            self._missed = (x, set())
        self._missed[1].add(int(expert))
        return super().on_miss(t, layer, expert, n_tokens, cache)

    def on_access(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray, cache: ExpertCache) -> None:
        self._now = (t, layer, 2)
        self._tally[0] += len(selected)
        x = t * self.L + layer
        self.last_use[layer, np.asarray(selected, np.int64)] = x
        for cal in self.calibrations:
            cal.resolve(x, selected, self._missed[1] if self._missed[0] == x else ())
        if not (self._traced and self.precompute) and self._latest is not None:
            t0 = time.perf_counter()
            self._record_routing(t, layer, selected, counts)
            self.stats["forecast_path_seconds"] += time.perf_counter() - t0

    def before_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        self._now = (t, layer, 0)
        if not self.prefetch:
            return ()
        x = t * self.L + layer
        self._update_estimate(x, cache)
        return self._issue(float(x), cache)

    def after_routing(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray,
                      cache: ExpertCache) -> Sequence[tuple[int, int]]:
        return self.replan_after_routing(t, layer, selected, counts, cache)

    def after_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        self.mark_after(t, layer)
        if layer == self.p:
            self._trigger(t)
            self.plan_prefetch(cache)
        return self.issue_after(t, layer, cache)

    # ------------------------------------------------------------------------------------------ public steps
    # The steps of the hooks above, for a policy that runs this one's decisions with its own forecast source
    # (AsyncSeqMoEPolicy composes them: docs/design.md, "Graph-compatible decode path").
    def trigger_rows(self) -> list[int]:
        """The members of the current step whose element exists (the rows a forecast at its trigger covers)."""
        return self.forecast_rows(range(len(self._pos)), self._pos)

    def mark_after(self, t: int, layer: int) -> None:
        """``layer`` of step ``t`` has run (the time the scores of the coming decisions are taken at)."""
        self._now = (t, layer, 2)

    def plan_prefetch(self, cache: ExpertCache, rule: str | None = None) -> None:
        """Replace the scheduler's tasks by those of the newest forecast (``rule``: default
        :attr:`prefetch_rule`); nothing without prefetch or before the first forecast."""
        if not (self.prefetch and self.has_forecast):
            return
        for cal in self.calibrations:
            cal.step()
        tasks = self._generate(cache, rule)
        self.scheduler.clear()
        self._planned = []
        if (rule or self.prefetch_rule) == "headroom":  # placed on the link already: issued as planned, each load
            self._planned = [(t.layer, t.expert, int(t.deadline)) for t in tasks]  # kept until its deadline
        else:
            self.scheduler.submit(tasks)
        self.stats["tasks"] += len(tasks)

    def replan_after_routing(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray,
                             cache: ExpertCache) -> Sequence[tuple[int, int]]:
        """The re-plan's loads, once ``layer`` of step ``t`` is routed (driver step 4b): its routing is known and its
        compute is still to come, so the walk's first window is this layer's own (docs/design.md, "Prefetch")."""
        if not self.replan_due(layer):
            return ()
        self._now = (t, layer, 1)
        self.replan(t, layer, selected, counts, cache)
        return self._issue(float(t * self.L + layer), cache)

    def replan_due(self, layer: int) -> bool:
        """Whether ``replan`` asks for a re-plan after ``layer`` (every ``replan`` layers after the trigger layer,
        before the last layer, once a forecast is installed and prefetch is on)."""
        return (self.replan_every > 0 and self.prefetch and self.has_forecast and self.p < layer < self.L - 1
                and (layer - self.p) % self.replan_every == 0)

    def replan(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray, cache: ExpertCache) -> None:
        """Refine the installed forecast of step ``t``'s layers after ``layer`` by what ``layer``'s routing
        (``selected`` / ``counts`` as :meth:`on_access`'s, where the driver gave no per-member routing) tells
        through the within-token table (:func:`~expertcast.models.forecaster_components.within_token_chain`, then
        :func:`~expertcast.models.forecaster_components.within_token_posterior`), update their next-execution
        probabilities and eviction scores, and plan prefetch again (docs/design.md, "Prefetch"). Skipped (counted)
        with more than one active member (the installed forecast combines members; a member's own prior is not
        kept) or when the installed forecast is not this step's (a late one)."""
        t0 = time.perf_counter()
        v = self._routing_of(layer, selected, counts)
        ahead = np.arange(layer + 1, self.L)
        if v is None or not np.array_equal(self.first_exec[ahead], t * self.L + ahead):
            self.stats["replans_skipped"] += 1
            return
        told = within_token_chain(v, self._within, layer + 1, self.L - 1)
        old = self.first_probs[ahead]
        new = within_token_posterior(old, told, self._within_freq[layer + 1:], self.K).astype(self.first_probs.dtype)
        probs = self.first_probs.copy()  # installed arrays may be shared (a published forecast): replaced, not edited
        probs[ahead] = new
        before = self.score_before.copy()
        before[ahead] += self.disc[0] * (new - old)
        self.first_probs, self.score_before = probs, before
        self.plan_prefetch(cache)
        self.stats["replans"] += 1
        self.stats["forecast_path_seconds"] += time.perf_counter() - t0

    def _routing_of(self, layer: int, selected: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
        """float32 [E]: the weights the running ``layer`` routed the one active member to (the driver's per-member
        routing, else ``selected`` weighted by ``counts``); None with another number of active members."""
        if len(self._active) != 1:
            return None
        obs = self._observed.get(layer)
        if obs is not None:
            b = int(self._active[0])
            ids, w = obs[0][b], obs[1][b]
        else:
            ids, w = selected, counts
        v = np.zeros(self.E, np.float32)
        np.add.at(v, np.asarray(ids, np.int64), np.asarray(w, np.float32))
        return v

    def issue_after(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        """The proactive loads to start after ``layer`` of step ``t`` ran (the scheduler's, admitted)."""
        if not self.prefetch:
            return ()
        return self._issue(float(t * self.L + layer + 1), cache)

    def on_insert(self, layer: int, expert: int, proactive: bool) -> None:
        if proactive:
            self._inflight.add((layer, expert))
            self._tally[2] += 1

    def on_evict(self, layer: int, expert: int) -> None:
        self._inflight.discard((layer, expert))

    # ------------------------------------------------------------------------------------------ prefetch
    def _generate(self, cache: ExpertCache, rule: str | None = None) -> list:
        """Prefetch tasks of the newest forecast under ``rule`` (one of :data:`PREFETCH_RULES`; default
        :attr:`prefetch_rule`)."""
        rule = rule or self.prefetch_rule
        skip = self._in_cache_mask(cache)
        if rule == "headroom":
            return self._plan_headroom(cache, skip)
        deadlines = self.first_exec.astype(np.float64)
        if rule == "floor":
            return generate_tasks(self.first_probs, deadlines, skip, self.max_tasks, self.min_confidence)
        floor = min(self.min_confidence, chance_level(self.E, self.K))
        value = expected_benefit(self._load_scores(), displaced_scores(cache, self._scores))
        return generate_tasks(self.first_probs, deadlines, skip, self.max_tasks, floor, value=value)

    def transfer_ms(self) -> float:
        """One transfer's time in ms: the scheduler's estimate (layer-executions, seeded from the link rate and
        updated from observed landings) times the per-layer compute time."""
        return self.scheduler.estimator.tau * self.layer_compute_ms

    def _plan_headroom(self, cache: ExpertCache, skip: np.ndarray) -> list:
        """``prefetch_rule=headroom``: :func:`~expertcast.inference.policies.prefetch.plan_within_headroom` over the
        newest forecast, victims in this policy's eviction order, the link's backlog = our transfers in flight."""
        a, d, p = self._tally
        floor = (a - d) / (a + p) if (self.breakeven and a) else 0.0  # the running AdjHit
        probs, execs, mask = execution_rows(self.first_probs, self.first_exec, skip, self.second_probs,
                                            self.plan_executions)
        scale = np.repeat([c.scale for c in self.calibrations], self.L)[:len(probs)]
        if not headroom_may_issue(probs, mask, scale, floor):
            return []  # no load could pass: the victims' ranking (most of the plan's cost) is skipped
        victims, victim_keys = pool_victims(cache, self.first_probs, self.eviction_order)
        pool_of = cache.config.pool_of_layer.astype(np.int64)
        tms = self.transfer_ms()
        backlog = sum(cache.state_of(*k) == SlotState.FETCH for k in self._inflight)
        tasks = plan_within_headroom(probs, execs, mask, pool_of, victims, self._next_execution(),
                                     np.full(self.L, self.layer_compute_ms), tms, backlog, self.max_tasks,
                                     min_net=floor, num_layers=self.L, net_scale=scale)
        for task in tasks:  # the outcome each load is expected to have, settled as the routing arrives
            pool = int(pool_of[task.layer])
            vk = victim_keys[pool][task.victim]
            later = int(task.deadline > self.first_exec[task.layer])  # for the execution after next
            net = float(probs[task.layer + later * self.L, task.expert]) - float(victims[pool][task.victim])
            self.calibrations[later].expect(int(task.deadline), task.expert, net,
                                            None if vk[0] < 0 else (int(self.first_exec[vk[0]]), int(vk[1])))
        return tasks

    def _next_execution(self) -> int:
        """The layer-execution whose compute comes next (the headroom walk's first window): the one after the layer
        that has run (:meth:`mark_after`), else the current one. A re-plan once layer l of step t is routed starts at
        t*L + l (its compute is still to come), not at the earliest installed execution (the trigger's layer + 1,
        whose windows have passed)."""
        t, cur, phase = self._now
        return max(int(self.first_exec.min()), t * self.L + cur + (1 if phase == 2 else 0))

    def _in_cache_mask(self, cache: ExpertCache) -> np.ndarray:
        return cache.slot_of >= 0

    def _update_estimate(self, x: int, cache: ExpertCache) -> None:
        """Count our transfers that left Fetch since the last layer boundary; sample the link rate when it
        stayed busy (some of the earlier transfers are still in flight)."""
        still = {k for k in self._inflight if cache.state_of(*k) == SlotState.FETCH}
        if self._prior and self._prior_x >= 0 and x > self._prior_x:
            landed = len(self._prior - still)
            if self._prior & still:
                self.scheduler.estimator.observe_window(landed, float(x - self._prior_x))
        self._inflight = still
        self._prior = set(still)
        self._prior_x = x

    def _issue(self, now: float, cache: ExpertCache) -> list[tuple[int, ...]]:
        if self._planned:  # the headroom rule's plan, issued at once in its (EDF) order
            out, self._planned = self._planned, []
            self.stats["issued"] += len(out)
            return out
        sch = self.scheduler
        if not sch.tasks:
            return []
        done = [k for k in sch.tasks if cache.contains(*k)]
        sch.expire(now, done)
        backlog = float(len(self._inflight))
        picks = sch.next_transfers(now, backlog)
        if not picks:
            return []
        # admission: a prefetch must beat the resident it would evict (per pool, lowest scores first)
        out: list[tuple[int, int]] = []
        incoming = self._load_scores()
        victims: dict[int, list[float]] = {}
        free: dict[int, int] = {}
        for task in picks:
            pool = cache.pool_of(task.layer)
            if pool not in free:
                free[pool] = cache.free_count(pool)
                cands = cache.eviction_candidates(pool)
                sc = self._scores(cands[:, 0].astype(np.int64), cands[:, 1].astype(np.int64)) if len(cands) else []
                victims[pool] = sorted(float(v) for v in sc)
            mine = float(incoming[task.layer, task.expert])
            if free[pool] > 0:
                free[pool] -= 1
            elif victims[pool] and victims[pool][0] < mine:
                victims[pool].pop(0)
            else:
                self.stats["rejected_by_score"] += 1
                continue
            out.append(task.key)
        self.stats["issued"] += len(out)
        return out


SPECS = (
    PolicySpec("seqmoe", SeqMoEPolicy, SeqMoEPolicy.Options, engines={"driver", "device"}, needs={"forecaster"},
               help="forecaster-driven prefetch and probabilistic-Belady eviction"),
)
