"""SAEM's stage-aware expert management as a cache policy (simulator and runtime alike).

:class:`StageAwarePolicy` (SAEM IV-2, docs/design.md "SAEM"):

- per-layer budgets: the cache must be a per-layer pool (B_l slots for layer l);
- the streaming :class:`~expertcast.inference.saem.stages.StageDetector` watches the tokens every sequence
  of the batch emits (:meth:`observe_tokens`); a cue in *any* sequence ends the current stage;
- while a stage runs, every access adds the tokens routed to each expert into per-layer counts [L, E]
  (all sequences of the batch together);
- at the next layer-0 hook after a boundary, each layer's experts are ranked by the finished stage's
  counts, and the layer's budget is refilled with the top-B_l experts as proactive loads (issued at
  once, layer order, so transfers overlap the following compute); evictions take the lowest-ranked
  resident;
- between boundaries the cache content does not change: a non-resident expert is executed on the CPU
  when the :class:`~expertcast.inference.saem.cpu_exec.LatencyModel` predicts that faster for its token count
  (``MissAction.CPU``: neither a hit nor a transfer), else served from a reserved temporary slot
  (``MissAction.TEMP``: a transfer not retained); when the cost model runs the CPU in parallel with the
  transfers (``CostConfig.cpu_parallel``), a layer's misses are split between the two paths so that the
  layer ends soonest (:meth:`~expertcast.inference.saem.cpu_exec.LatencyModel.prefer_cpu_queued`);
- the prompt (prefill) is the first finished stage when the driver reports prefill accesses; the
  calibration's static expert frequencies (cue-set JSON) seed the cache when it starts empty.

Ablations (paper V-D): ``stage_updates=False`` (static placement from calibration frequencies, never
updated) and ``cpu_exec=False`` (every miss through the temporary slot).

:class:`StageOraclePolicy` (paper V-C "oracle"): the same boundary events and cache enforcement, but at
each update it ranks experts by the *next* stage's true counts, read from the batch's recorded routing
(``begin_batch`` receives the :class:`~expertcast.data.trace_format.TraceSequence` objects).

Driver contract (inference/cache/driver.py): ``on_step`` gives each member's position (``StepInfo``);
``observe_tokens(t, ids)`` gives, per member, the token fed to its next position (None when it has
none); only generated tokens (position + 1 >= prompt length) reach the detector. The oracle reads the
next stage from the recorded routing: the batch's TraceSequence objects (simulator), or the recorded
run given as its future (runtime), looked up by sequence id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from expertcast.inference.cache.options import PolicyOptions, option
from expertcast.inference.cache.policy import MissAction, Policy
from expertcast.inference.cache.schedule import BatchSchedule, StepInfo
from expertcast.inference.cache.spec import PolicySpec
from expertcast.inference.saem.cpu_exec import LatencyModel
from expertcast.inference.saem.cues import CueSet
from expertcast.inference.saem.stages import StageDetector, TokenDecoder
from expertcast.utils.errors import UsageError


def _resolve_cues(cs: CueSet | None, cues: Sequence[str] | str | None) -> tuple[list[str], CueSet | None, bool]:
    if cues is not None:
        lst = [c.strip() for c in cues.split("|")] if isinstance(cues, str) else list(cues)
        return lst, cs, cs.ignore_case if cs else False
    if cs is not None:
        return list(cs.cues), cs, cs.ignore_case
    return [], None, False


class StageAwarePolicy(Policy):
    """SAEM stage-aware caching with CPU execution of cold experts.

    Args (loaded objects; the options are :class:`StageAwarePolicy.Options`):
        cue_set: a loaded :class:`CueSet` (``expertcast stages calibrate``): the cues, the tokenizer it names
            (loaded by :mod:`~expertcast.inference.policies.artifacts`) and static expert frequencies.
        tokenizer: a tokenizer object decoding the token ids.
        decoder: a ready token-id -> bytes function (overrides ``tokenizer``).
        latency: the CPU-vs-transfer latency model; default from ``cost`` (or the cost model defaults).
        cost: a :class:`~expertcast.inference.cache.cost_model.CostConfig` to derive ``latency`` from.
        static_frequency: float [L, E] placement used to seed (and for the no-update ablation);
            defaults to the cue set's ``expert_frequency``.
    """

    @dataclass
    class Options(PolicyOptions):
        """SAEM stage-aware caching with CPU execution of cold experts."""

        cue_set: str | None = option(None, "calibrated cue set (cues, tokenizer, expert frequencies)",
                                     file="cue_set")
        cues: str | tuple[str, ...] | None = option(None, "explicit cues separated by '|' (overrides the cue "
                                                    "set's; a programmatic caller may give a tuple)")
        tokenizer: str | None = option(None, "tokenizer directory or Hub id decoding the token ids")
        cpu_exec: bool = option(True, "execute cold experts on the CPU (false: temporary slot only)")
        stage_updates: bool = option(True, "refill at stage boundaries (false: calibration placement only)")
        min_stage_steps: int = option(1, "ignore boundaries closer than this many decode steps", low=1)

        def check(self) -> None:
            if self.stage_updates and self.cue_set is None and self.cues is None and self.tokenizer is None:
                raise UsageError(f"{self.policy} needs cues: {self.policy}:cue_set=CUES.json (expertcast stages "
                                 f"calibrate), cues='Wait|Alternatively' or tokenizer=MODEL_DIR holding cues.json")

        def reads_tokens(self) -> bool:
            return bool(self.stage_updates)

    name = "stage"
    demand_only = False

    def __init__(self, options: Options | None = None, *, cue_set: CueSet | None = None, tokenizer: Any = None,
                 decoder: Any = None, latency: LatencyModel | None = None, cost: Any = None,
                 static_frequency: np.ndarray | None = None) -> None:
        super().__init__(options)
        o = self.options
        self.cues, self.cue_set, self.ignore_case = _resolve_cues(cue_set, o.cues)
        if o.stage_updates and not self.cues:
            raise ValueError("StageAwarePolicy needs cues: pass cue_set=CUES.json (expertcast stages calibrate), "
                             "tokenizer=MODEL_DIR holding cues.json, or cues='Wait|Alternatively|...'")
        self._tokenizer = tokenizer
        self._decoder = decoder
        self.cpu_exec = bool(o.cpu_exec)
        self.stage_updates = bool(o.stage_updates)
        self._latency = latency
        self._cost = cost
        self.min_stage_steps = int(o.min_stage_steps)
        if static_frequency is None and self.cue_set is not None and self.cue_set.expert_frequency is not None:
            static_frequency = np.asarray(self.cue_set.expert_frequency, dtype=np.float64)
        self.static_frequency = None if static_frequency is None else np.asarray(static_frequency, np.float64)
        if not self.stage_updates and self.static_frequency is None:
            raise ValueError("the no-stage-update ablation places experts from calibration frequencies: give "
                             "cue_set=JSON with expert_frequency or static_frequency=[L, E]")
        self.detector: StageDetector | None = None
        # statistics a report can read
        self.n_boundaries = 0
        self.n_updates = 0
        self.n_cpu = 0
        self.n_temp = 0
        self.update_steps: list[int] = []

    # -- setup ------------------------------------------------------------------------------------
    def wants_tokenizer(self) -> bool:
        """True when the policy decodes tokens and has neither a tokenizer nor a decoder yet."""
        return self.stage_updates and self._decoder is None and self._tokenizer is None

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Decode with ``tokenizer`` (e.g. the evaluated model's) unless a tokenizer or decoder was given."""
        if self._decoder is None and self._tokenizer is None:
            self._tokenizer = tokenizer

    @property
    def decoder(self) -> Any:
        if self._decoder is None:
            if self._tokenizer is None:
                raise ValueError("StageAwarePolicy needs a tokenizer to read the generated tokens: pass "
                                 "tokenizer=DIR (the trace's model directory) or a cue set that names one")
            self._decoder = TokenDecoder(self._tokenizer)
        return self._decoder

    def reset(self, config: Any) -> None:
        super().reset(config)
        if getattr(config, "pool", "per-layer") != "per-layer":
            raise ValueError("SAEM manages per-layer budgets: run it with pool='per-layer' (got a shared pool)")
        self.L, self.E = int(config.num_layers), int(config.num_experts)
        self.budgets = np.asarray(config.pool_capacities, dtype=np.int64)
        if self.static_frequency is not None and self.static_frequency.shape != (self.L, self.E):
            raise ValueError(f"static expert frequencies have shape {self.static_frequency.shape} but the cache is "
                             f"L={self.L}, E={self.E}: the cue set was calibrated on another model")
        if self._latency is None:
            from expertcast.inference.cache.cost_model import QWEN3_30B_A3B_EXPERT_BYTES, CostConfig

            cost = self._cost or CostConfig()
            eb = int(getattr(config, "expert_bytes", 0) or QWEN3_30B_A3B_EXPERT_BYTES)
            self._latency = LatencyModel.from_cost(cost, eb)
        self._stage_counts = np.zeros((self.L, self.E), dtype=np.float64)
        self._miss_at: tuple[int, int] = (-1, -1)
        self._cpu_busy = self._link_busy = 0.0
        # tie-break: static frequencies (tiny weight), then expert id
        base = self.static_frequency if self.static_frequency is not None else np.zeros((self.L, self.E))
        self._tiebreak = base / (base.max() + 1.0) * 1e-3
        self._priority = self._tiebreak.copy()
        self._pending_update = False
        self._last_update = -(10 ** 9)
        self._step = -1
        self._traces = None
        self._batch_size = 1
        self._info: StepInfo | None = None
        self.n_boundaries = self.n_updates = self.n_cpu = self.n_temp = 0
        self.update_steps = []

    def use_latency(self, latency: LatencyModel) -> None:
        """Decide CPU vs transfer with ``latency`` from now on (e.g. measured by the runtime at start-up)."""
        self._latency = latency

    @property
    def latency(self) -> LatencyModel:
        if self._latency is None:
            raise RuntimeError("call reset(config) first")
        return self._latency

    def warm_start(self, cache: Any) -> Sequence[tuple[int, int]]:
        """Static calibration placement (top-B_l by calibration frequency), loaded uncounted."""
        if self.static_frequency is None:
            return ()
        self._priority = self.static_frequency + self._tiebreak
        return self._top_placement(self.static_frequency, cache, only_missing=True)

    def begin_batch(self, batch: Any) -> None:
        items = list(batch)
        self._traces = items if items and all(hasattr(b, "token_ids") and hasattr(b, "expert_ids") for b in items) \
            else None
        n = max(len(items), 1)
        if self.stage_updates:
            if self.detector is None:
                self.detector = StageDetector(self.cues, None, batch_size=n, ignore_case=self.ignore_case)
            self.detector.reset(n)
        self._batch_size = n
        self._stage_counts[:] = 0
        self._pending_update = False
        self._info = None
        self._last_update = -(10 ** 9)

    # -- hooks ------------------------------------------------------------------------------------
    def on_step(self, t: int, info: StepInfo) -> None:
        self._info = info
        self._step = t
        mp = info.schedule.prefill_steps
        if self.stage_updates and mp > 0 and info.local == mp and self._stage_counts.any():
            self._pending_update = True  # the prompt (prefill) is the first finished stage

    @staticmethod
    def _generated(info: StepInfo, token_ids: Sequence[int | None]) -> list[int | None]:
        """One entry per member: the token it fed to its next position when that token was generated
        (not a prompt token), else None."""
        out: list[int | None] = []
        for tid, pos, p0 in zip(token_ids, info.positions.tolist(), info.schedule.prompt_lens.tolist(), strict=True):
            gen = tid is not None and int(tid) >= 0 and pos >= 0 and pos + 1 >= p0
            out.append(int(tid) if gen else None)
        return out

    def observe_tokens(self, t: int, token_ids: Sequence[int | None]) -> None:
        if not self.stage_updates:
            return
        assert self.detector is not None and self._info is not None, "the driver calls begin_batch and on_step first"
        if len(token_ids) != self._batch_size:
            raise ValueError(f"observe_tokens got {len(token_ids)} ids for a batch of {self._batch_size}")
        if self.detector.decoder is None:
            self.detector.decoder = self.decoder
        events = self.detector.step(self._generated(self._info, token_ids))
        if events:
            self.n_boundaries += len(events)
            if t + 1 - self._last_update >= self.min_stage_steps:
                self._pending_update = True

    def before_layer(self, t: int, layer: int, cache: Any) -> Sequence[tuple[int, int]]:
        scores = self.refresh_ranking(t)
        if scores is None:
            return ()
        return self._top_placement(scores, cache, only_missing=True, first_layer=layer)

    def refresh_ranking(self, t: int) -> np.ndarray | None:
        """At a pending stage boundary: the ranking float [L, E] of the stage that starts now (the finished stage's
        counts), with the bookkeeping of an update; None when no boundary is pending (also used by ``hybrid``)."""
        if not self._pending_update:
            return None
        self._pending_update = False
        scores = self._next_ranking(t)
        self._stage_counts[:] = 0
        self.n_updates += 1
        self.update_steps.append(int(t))
        self._last_update = t
        self._priority = np.asarray(scores, np.float64) + self._tiebreak
        return scores

    def on_miss(self, t: int, layer: int, expert: int, n_tokens: int, cache: Any) -> MissAction:
        n = max(int(n_tokens), 1)
        lat = self.latency
        if lat.parallel:
            if self._miss_at != (t, layer):  # a new layer-execution: both paths idle
                self._miss_at, self._cpu_busy, self._link_busy = (t, layer), 0.0, 0.0
            use_cpu = self.cpu_exec and lat.prefer_cpu_queued(n, self._cpu_busy, self._link_busy)
            if use_cpu:
                self._cpu_busy += lat.cpu_ms(n)
            else:
                self._link_busy += lat.transfer_ms
        else:
            use_cpu = self.cpu_exec and lat.prefer_cpu(n)
        if use_cpu:
            self.n_cpu += 1
            return MissAction.CPU
        self.n_temp += 1
        return MissAction.TEMP

    def choose_victim(self, t: int, layer: int, candidates: np.ndarray, cache: Any) -> int:
        c = np.asarray(candidates)
        return int(np.argmin(self._priority[c[:, 0], c[:, 1]]))

    def on_access(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray, cache: Any) -> None:
        # the experts of one layer-execution are distinct (the union of the batch's selections)
        self._stage_counts[layer, np.asarray(selected, dtype=np.int64)] += counts

    # -- stage updates ----------------------------------------------------------------------------
    def _next_ranking(self, t: int) -> np.ndarray:
        """float [L, E] scores of the experts for the stage that starts now (finished stage's counts)."""
        return self._stage_counts.copy()

    def _top_placement(self, scores: np.ndarray, cache: Any, only_missing: bool, first_layer: int = 0
                       ) -> list[tuple[int, int]]:
        """``(layer, expert)`` making each layer's pool hold its top-B_l experts by ``scores`` [L, E]
        (experts with a zero score are left out), layers from ``first_layer`` on (deadline order)."""
        loads: list[tuple[int, int]] = []
        pr = np.asarray(scores, np.float64) + self._tiebreak
        for lyr in list(range(first_layer, self.L)) + list(range(0, first_layer)):
            B = int(self.budgets[lyr])
            used = np.flatnonzero(pr[lyr] > 0)
            top = used[np.argsort(-pr[lyr, used], kind="stable")][:B]
            for e in top.tolist():
                if not (only_missing and cache.contains(lyr, e)):
                    loads.append((lyr, int(e)))
        return loads


class StageOraclePolicy(StageAwarePolicy):
    """Same boundaries and cache enforcement as :class:`StageAwarePolicy`; at each update the ranking is
    the next stage's true per-layer counts over the batch (read from the batch's recorded routing)."""

    @dataclass
    class Options(StageAwarePolicy.Options):
        """SAEM stage-aware caching that knows each stage's experts in advance (upper bound)."""

        def check(self) -> None:
            super().check()
            if not self.stage_updates:
                raise UsageError(f"{self.policy}: stage_updates must stay true (the oracle acts at stage "
                                 f"boundaries)")

    name = "stage-oracle"

    def __init__(self, options: Options | None = None, *, cue_set: CueSet | None = None, tokenizer: Any = None,
                 decoder: Any = None, latency: LatencyModel | None = None, cost: Any = None,
                 static_frequency: np.ndarray | None = None) -> None:
        if options is not None and not options.stage_updates:
            raise ValueError("the stage oracle is defined at stage boundaries: stage_updates must stay on")
        super().__init__(options, cue_set=cue_set, tokenizer=tokenizer, decoder=decoder, latency=latency, cost=cost,
                         static_frequency=static_frequency)
        self._future: dict[str, Any] = {}
        self._plan: list[int] | None = None

    def set_future(self, future: Any) -> None:
        """``future``: the recorded run (an :class:`~expertcast.inference.sim.simulator.AccessStream` or a list of
        :class:`TraceSequence`); a live batch's members are looked up by sequence id."""
        seqs = getattr(future, "sequences", future) or []
        self._future = {s.seq_id: s for s in seqs}

    def begin_batch(self, batch: Any) -> None:
        items = list(batch)
        if not all(hasattr(b, "token_ids") and hasattr(b, "expert_ids") for b in items):
            known = self._future
            missing = [b.seq_id for b in items if b.seq_id not in known]
            if missing:
                raise ValueError(f"StageOraclePolicy reads the next stage from the recorded routing: no recorded "
                                 f"sequence {missing[0]!r} in its future (pass the run's traces as the future)")
            items = [known[b.seq_id] for b in items]
        super().begin_batch(items)
        self._plan = None

    def on_step(self, t: int, info: StepInfo) -> None:
        if self._plan is None:
            assert self._traces is not None
            # a live batch's ends are known from its recorded run
            self._schedule = BatchSchedule(info.schedule.prompt_lens, [len(s.token_ids) for s in self._traces])
            self._plan = self._plan_updates(self._schedule)
        super().on_step(t, info)

    def _plan_updates(self, schedule: BatchSchedule) -> list[int]:
        """Local steps of the batch at which the online policy updates (same detector, same rules)."""
        assert self._traces is not None
        det = StageDetector(self.cues, self.decoder, batch_size=len(self._traces), ignore_case=self.ignore_case)
        mp = schedule.prefill_steps
        plan = []
        last = -(10 ** 9)
        if mp > 0:
            plan.append(mp)
            last = mp
        for j in range(schedule.num_steps):
            pos, nxt = schedule.positions(j), schedule.has_next(j)
            ids: list[int | None] = [None] * len(self._traces)
            for i, s in enumerate(self._traces):
                if nxt[i] and pos[i] + 1 >= s.prompt_len:
                    ids[i] = int(s.token_ids[pos[i] + 1])
            if det.step(ids) and j + 1 - last >= self.min_stage_steps:
                plan.append(j + 1)
                last = j + 1
        return plan

    def _next_ranking(self, t: int) -> np.ndarray:
        assert self._traces is not None and self._info is not None and self._plan is not None
        sch, j = self._schedule, self._info.local
        later = [u for u in self._plan if u > j]
        end = later[0] if later else sch.num_steps
        counts = np.zeros((self.L, self.E))
        for i, s in enumerate(self._traces):
            a, b = sch.span(i, j, end)
            if b <= a:
                continue
            e = np.asarray(s.expert_ids[a:b], dtype=np.int64)  # [n, L, K]
            flat = (np.arange(self.L)[None, :, None] * self.E + e).ravel()
            counts += np.bincount(flat, minlength=self.L * self.E).reshape(self.L, self.E)
        return counts


SPECS = (
    PolicySpec("stage", StageAwarePolicy, StageAwarePolicy.Options, needs={"cues", "tokenizer"},
               help="SAEM stage-aware caching with CPU execution of cold experts"),
    PolicySpec("stage-oracle", StageOraclePolicy, StageOraclePolicy.Options, needs={"future", "cues", "tokenizer"},
               live=False, help="SAEM stage-aware caching knowing each stage's experts (upper bound)"),
)
