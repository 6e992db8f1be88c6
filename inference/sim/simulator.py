"""Trace-driven expert-cache simulator: replay routing traces through a policy and measure hit rate,
traffic and modelled speed (docs/design.md, cache semantics).

How a replay is formed:
* Batches: the sequences are taken in order, ``batch_size`` consecutive sequences at a time, and run
  in lockstep by the schedule of :class:`~expertcast.inference.cache.schedule.BatchSchedule` (prompts first,
  position by position; then decode steps; finished sequences drop out). The next batch starts when
  the whole batch is done. The cache persists across batches (one long serving session). A
  layer-execution accesses the union of the active members' top-K selections, in first-appearance
  order, with the number of tokens routed to each expert.
* Warm-up: the prefill steps go through the same policy, with the same rules, but are not counted;
  decode-only accounting starts from the post-prefill cache state. Warm-start placements
  (:meth:`Policy.warm_start`, e.g. static placement) are loaded before anything runs, also uncounted.
* Oracles see the whole stream (prefill included) as their future.

Metrics (counted decode steps only): accesses A (one selected expert at one layer-execution), resident
hits, late prefetches, demand misses D (including temporary-slot loads), proactive loads P, CPU-executed
accesses; ``hit = 1 - D/A`` (a late prefetch or a CPU-executed access is not a demand miss; see also
``resident_hit``), ``adj_hit = (A - D) / (A + P)``, ``mb_per_token = (D + P) * expert_bytes / 1e6`` per
decoded token, per-layer hit, ``belady_fraction = hit / ceiling hit`` and the cost model's stall and %
of full-load speed (:mod:`expertcast.inference.cache.cost_model`).

The ceiling (:func:`replay_ceiling`, same capacity, pool and batch) is the offline optimum of every
demand-only policy on these decode-only counts: each batch's decode starts from the best cache for
free (a policy may shape its post-prefill cache by its warm start and uncounted prefill loads), then
furthest-next-use retention with bypass (a miss may be served from a temporary slot, as the static
placement does). So no demand-only policy has a ``belady_fraction`` above 1; the ``belady`` policy
(protect-rule Belady from its own post-prefill cache) may stay below it. Prefetching and
CPU-executing policies are not bounded by it.

Engines: the generic :func:`replay` runs the one driver (:class:`~expertcast.inference.cache.driver.Driver`,
every :class:`~expertcast.inference.cache.policy.Policy` hook, the hook order of the runtime) over the cost
model's modelled link (:class:`~expertcast.inference.cache.cost_model.ModelledTransport`, late prefetches need
its clock) or over the landings recorded from a runtime run (``transport=RecordedTransport(...)``);
compiled kernels (:mod:`expertcast.inference.policies.kernels`) replay the demand-only classic policies and
oracles with identical counters (their stall is exactly ``D * transfer_ms``: nothing else uses the link).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache.cost_model import (
    QWEN3_30B_A3B_EXPERT_BYTES,
    CostConfig,
    Event,
    ModelledTransport,
)
from expertcast.inference.cache.counters import Counters
from expertcast.inference.cache.driver import Driver, Transport
from expertcast.inference.cache.expert_cache import Budget, CacheConfig, ExpertCache
from expertcast.inference.cache.policy import Policy
from expertcast.inference.cache.schedule import BatchSchedule, StepInfo, stream_schedule
from expertcast.inference.policies import kernels

WARMUP_NOTE = "decode-only; prefill replayed through the policy uncounted"
ORACLE_NOTE = ("belady_fraction = hit / ceiling of demand-only policies (furthest next use kept, bypass allowed, "
               "each batch's decode starting from the best cache); belady = protect-rule Belady from its own "
               "post-prefill cache")


# ------------------------------------------------------------------------------------------------
# The access stream
# ------------------------------------------------------------------------------------------------
@dataclass
class AccessStream:
    """A replay flattened to layer-executions ``x = step * L + layer`` (the oracles' future).

    Shapes: ``experts`` int16 [A], ``counts`` int32 [A] (tokens routed to each accessed expert),
    ``exec_ptr`` int64 [S*L + 1], ``step_counted`` bool [S] (decode steps), ``step_tokens`` int32 [S]
    (sequences active at the step = tokens it processes), ``step_batch`` int32 [S].
    """

    num_layers: int
    num_experts: int
    top_k: int
    experts: np.ndarray
    counts: np.ndarray
    exec_ptr: np.ndarray
    step_counted: np.ndarray
    step_tokens: np.ndarray
    step_batch: np.ndarray
    batches: list[list[int]] = field(default_factory=list)
    sequences: list[TraceSequence] | None = None
    schedules: list[BatchSchedule] = field(default_factory=list)
    """The lockstep schedule of each batch (:class:`~expertcast.inference.cache.schedule.BatchSchedule`)."""
    _next: dict = field(default_factory=dict, repr=False)

    @property
    def num_steps(self) -> int:
        return len(self.step_counted)

    @property
    def num_execs(self) -> int:
        return len(self.exec_ptr) - 1

    @property
    def decoded_tokens(self) -> int:
        return int(self.step_tokens[self.step_counted].sum())

    @property
    def counted_accesses(self) -> int:
        per_exec = np.diff(self.exec_ptr)
        return int(per_exec[np.repeat(self.step_counted, self.num_layers)].sum())

    def selection(self, x: int) -> tuple[np.ndarray, np.ndarray]:
        """(experts int [S], token counts int [S]) of layer-execution ``x``."""
        a0, a1 = self.exec_ptr[x], self.exec_ptr[x + 1]
        return self.experts[a0:a1], self.counts[a0:a1]

    @property
    def next_exec(self) -> np.ndarray:
        """int64 [A]: next layer-execution selecting the same (layer, expert), or ``NEVER``."""
        if "exec" not in self._next:
            self._next["exec"] = kernels.next_use_kernel(self.experts, self.exec_ptr, self.num_layers,
                                                   self.num_experts, False)
        return self._next["exec"]

    @property
    def next_access(self) -> np.ndarray:
        """int64 [A]: next access index of the same (layer, expert) (sequential Belady)."""
        if "access" not in self._next:
            self._next["access"] = kernels.next_use_kernel(self.experts, self.exec_ptr, self.num_layers,
                                                     self.num_experts, True)
        return self._next["access"]


def validate_traces(meta: TraceMeta, sequences: Sequence[TraceSequence]) -> None:
    """Raise ValueError naming the problem when the sequences do not match ``meta`` (L, K, expert
    range) or a top-K row repeats an expert."""
    L, E, Kk = meta.num_layers, meta.num_experts, meta.top_k
    if not sequences:
        raise ValueError("no trace sequences to replay")
    for s in sequences:
        ids = s.expert_ids
        if ids.shape[1:] != (L, Kk):
            raise ValueError(f"sequence {s.seq_id}: expert_ids {ids.shape} do not match the trace metadata "
                             f"[T, L={L}, K={Kk}] of {meta.model_id!r}")
        if ids.size == 0:
            continue
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"sequence {s.seq_id}: expert id {hi if hi >= E else lo} outside [0, E={E}) of "
                             f"{meta.model_id!r}: trace/model mismatch")
        if Kk > 1:
            srt = np.sort(ids.reshape(-1, Kk), axis=1)
            if (srt[:, 1:] == srt[:, :-1]).any():
                raise ValueError(f"sequence {s.seq_id}: a top-K selection repeats an expert")


def build_stream(meta: TraceMeta, sequences: Sequence[TraceSequence], batch_size: int = 1) -> AccessStream:
    """Flatten ``sequences`` into an :class:`AccessStream` (batches of ``batch_size`` consecutive
    sequences in lockstep, scheduled by :func:`expertcast.inference.cache.schedule.stream_schedule`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    validate_traces(meta, sequences)
    L, E, Kk = meta.num_layers, meta.num_experts, meta.top_k
    n = len(sequences)
    batches = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
    prompt = np.array([s.prompt_len for s in sequences], np.int64)
    lengths = np.array([s.num_tokens for s in sequences], np.int64)
    scheds, step_batch, step_counted, step_seq, step_pos = stream_schedule(prompt, lengths, batches)
    flat = np.concatenate([np.ascontiguousarray(s.expert_ids, dtype=np.int16).reshape(-1) for s in sequences])
    sizes = lengths * L * Kk
    seq_off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    experts, counts, exec_ptr, step_tokens = kernels.build_batch_stream(flat, seq_off, step_seq, step_pos, L, Kk, E)
    return AccessStream(L, E, Kk, experts, counts, exec_ptr, step_counted, step_tokens, step_batch, batches,
                        list(sequences), scheds)


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ReplayResult(Counters):
    """The :class:`~expertcast.inference.cache.counters.Counters` of one replay (decode steps only), plus
    the cost model's timings."""

    stall_ms: float
    compute_ms: float
    engine: str
    seconds: float = 0.0
    resident: set[tuple[int, int]] | None = None
    timeline: list[Event] | None = None
    landings: list[tuple[int, int, int]] | None = None
    """``(x, layer, expert)`` of every landing (``replay(..., record_landings=True)``)."""

    def metrics(self) -> dict[str, Any]:
        total = self.compute_ms + self.stall_ms
        return {
            **self.counter_metrics(),
            "resident_hit": self.resident_hit,
            "adj_hit": self.adj_hit,
            "mb_per_token": self.mb_per_token,
            "decoded_tokens": self.decoded_tokens,
            "stall_ms_per_token": self.stall_ms / max(self.decoded_tokens, 1),
            "stall_ms_per_step": self.stall_ms / max(self.decode_steps, 1),
            "pct_full_speed": 100.0 * self.compute_ms / total if total > 0 else 100.0,
            "per_layer_hit": self.per_layer_hit,
        }


# ------------------------------------------------------------------------------------------------
# Engines
# ------------------------------------------------------------------------------------------------
def _expert_bytes(config: CacheConfig, cost: CostConfig) -> int:
    return int(cost.expert_bytes or config.expert_bytes or QWEN3_30B_A3B_EXPERT_BYTES)


def _check_stream(stream: AccessStream, config: CacheConfig) -> None:
    mine = (stream.num_layers, stream.num_experts, stream.top_k)
    theirs = (config.num_layers, config.num_experts, config.top_k)
    if mine != theirs:
        raise ValueError(f"trace has L={mine[0]}, E={mine[1]}, K={mine[2]} but the cache is configured for "
                         f"L={theirs[0]}, E={theirs[1]}, K={theirs[2]}")


def replay(stream: AccessStream, policy: Policy, config: CacheConfig, cost: CostConfig | None = None,
           record_timeline: bool = False, progress: bool = False, transport: Transport | None = None,
           record_landings: bool = False) -> ReplayResult:
    """Generic engine: the :class:`~expertcast.inference.cache.driver.Driver` calls every hook of ``policy``
    over the stream; transfers go to the cost model's modelled link (default) or to ``transport``
    (e.g. a :class:`~expertcast.inference.cache.driver.RecordedTransport` of a runtime run). Works for any
    policy (prefetching, CPU execution, temporary slots). ``record_landings``: keep the driver's
    landings in ``ReplayResult.landings``."""
    from expertcast.inference.policies import spec_of

    if not spec_of(policy).runs_on("driver"):
        raise ValueError(f"policy {policy.name!r} runs only on the compiled engine")
    _check_stream(stream, config)
    cost = cost or CostConfig()
    L = config.num_layers
    xbytes = _expert_bytes(config, cost)
    if transport is None:
        transport = ModelledTransport(cost, L, xbytes, record_timeline)
    counters = Counters(L, xbytes, decoded_tokens=stream.decoded_tokens, decode_steps=int(stream.step_counted.sum()))
    driver = Driver(policy, ExpertCache(config), transport, counters, record_landings=record_landings)
    driver.reset(stream)
    seqs = stream.sequences
    if seqs and hasattr(policy, "prepare_sequences"):
        policy.prepare_sequences(seqs)  # optional hook: per-replay setup over all sequences (seqmoe)
    t0 = time.perf_counter()
    steps = range(stream.num_steps)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=f"replay {policy.name}", unit="step", leave=False)
    prev_batch = -1
    for t in steps:
        b = int(stream.step_batch[t])
        if b != prev_batch:
            members = [seqs[i] for i in stream.batches[b]] if seqs else stream.batches[b]
            driver.begin_batch(members, stream.schedules[b])
            prev_batch = b
        info = driver.begin_step(counted=bool(stream.step_counted[t]))
        for layer in range(L):
            sel, cnt = stream.selection(t * L + layer)
            routing = _member_routing(info, members, layer) if driver.wants_routing and seqs else None
            driver.run_layer(layer, sel, cnt, routing)
        if seqs:
            driver.end_step(_fed_tokens(info, members))
    return ReplayResult(**counters.counts(), stall_ms=transport.stall_ms, compute_ms=transport.compute_ms,
                        engine="python", seconds=time.perf_counter() - t0, resident=driver.cache.resident_set(),
                        timeline=transport.timeline, landings=driver.landings if record_landings else None)


def _member_routing(info: StepInfo, members: Sequence[TraceSequence], layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [B, K], weights float32 [B, K]) of ``layer`` at the step, zeros for idle members."""
    K_ = members[0].expert_ids.shape[2]
    ids = np.zeros((len(members), K_), np.int64)
    w = np.zeros((len(members), K_), np.float32)
    for i in info.active.tolist():
        pos = int(info.positions[i])
        ids[i] = members[i].expert_ids[pos, layer]
        w[i] = members[i].expert_weights[pos, layer]
    return ids, w


def _fed_tokens(info: StepInfo, members: Sequence[TraceSequence]) -> list[int | None]:
    """The token each member feeds to its next position (None when it has none)."""
    nxt = info.schedule.has_next(info.local)
    return [int(m.token_ids[p + 1]) if ok else None
            for m, p, ok in zip(members, info.positions.tolist(), nxt.tolist(), strict=True)]


def replay_kernel(stream: AccessStream, policy: Policy, config: CacheConfig,
                  cost: CostConfig | None = None) -> ReplayResult:
    """Compiled engine for policies exposing ``kernel_params()`` (classic policies, oracles)."""
    _check_stream(stream, config)
    Driver(policy, ExpertCache(config), Transport()).reset(stream)  # the run's lifecycle calls, as every engine's
    from expertcast.inference.policies import spec_of

    params = policy.kernel_params() if spec_of(policy).runs_on("kernel") else None
    if params is None:
        raise ValueError(f"policy {policy.name!r} has no compiled fast path; use engine='python'")
    cost = cost or CostConfig()
    L, E = config.num_layers, config.num_experts
    xbytes = _expert_bytes(config, cost)
    if params["kind"] == kernels.KIND_BELADY_SEQ:
        nxt = stream.next_access
    elif params["kind"] == kernels.KIND_BELADY:
        nxt = stream.next_exec
    else:
        nxt = np.zeros(1, np.int64)
    z = lambda: np.zeros(L, np.int64)  # noqa: E731
    acc, hit, miss, temp = z(), z(), z(), z()
    resident = np.zeros(L * E, np.int8)
    evict, step_miss = z(), np.zeros(stream.num_steps, np.int64)
    t0 = time.perf_counter()
    kernels.replay_kernel(stream.experts, stream.exec_ptr, stream.step_counted, L, E, config.pool_of_layer,
                    config.pool_capacities, params["kind"], float(params["lam"]), int(params["horizon"]),
                    bool(params["perfect_history"]), nxt, acc, hit, miss, temp, resident, evict, step_miss)
    seconds = time.perf_counter() - t0
    compute = cost.compute_ms(L)
    n_steps = int(stream.step_counted.sum())
    compute_total = float(compute.sum()) * n_steps
    stall = float(miss.sum()) * cost.transfer_ms(xbytes)  # demand transfers only, each exposed
    res = {(int(i) // E, int(i) % E) for i in np.flatnonzero(resident)}
    step_demand = step_miss[stream.step_counted].tolist()
    return ReplayResult(L, xbytes, accesses=acc, hits=hit, demand=miss, temp=temp, decoded_tokens=stream.decoded_tokens,
                        decode_steps=n_steps, evictions=evict, step_demand=step_demand, step_late=[0] * n_steps,
                        stall_ms=stall, compute_ms=compute_total, engine="kernel", seconds=seconds, resident=res)


def replay_ceiling(stream: AccessStream, config: CacheConfig, cost: CostConfig | None = None) -> ReplayResult:
    """The ceiling of every demand-only policy on the counted steps (``belady_fraction``'s denominator):
    furthest-next-use retention with bypass, each counted segment (the decode steps after a batch's
    uncounted prefill) starting from the best cache for free (:func:`~expertcast.inference.policies.kernels.
    ceiling_kernel`). It is an accounting bound, not a policy (no resident set)."""
    _check_stream(stream, config)
    cost = cost or CostConfig()
    L = config.num_layers
    xbytes = _expert_bytes(config, cost)
    acc, hit = np.zeros(L, np.int64), np.zeros(L, np.int64)
    t0 = time.perf_counter()
    kernels.ceiling_kernel(stream.experts, stream.exec_ptr, stream.step_counted, L, config.num_experts, config.pool_of_layer,
                     config.pool_capacities, stream.next_exec, acc, hit)
    seconds = time.perf_counter() - t0
    n_steps = int(stream.step_counted.sum())
    miss = acc - hit
    return ReplayResult(L, xbytes, accesses=acc, hits=hit, demand=miss, decoded_tokens=stream.decoded_tokens,
                        decode_steps=n_steps, stall_ms=float(miss.sum()) * cost.transfer_ms(xbytes),
                        compute_ms=float(cost.compute_ms(L).sum()) * n_steps, engine="ceiling", seconds=seconds)


def replay_static(stream: AccessStream, policy, config: CacheConfig, cost: CostConfig | None = None) -> ReplayResult:
    """Vectorized engine for a fixed placement (nothing ever moves): the policy's warm start, placed by the driver, is
    the resident set of the whole run."""
    _check_stream(stream, config)
    cost = cost or CostConfig()
    L, E = config.num_layers, config.num_experts
    xbytes = _expert_bytes(config, cost)
    cache = ExpertCache(config)
    Driver(policy, cache, Transport()).reset(stream)
    t0 = time.perf_counter()
    placed = np.zeros((L, E), np.bool_)
    for layer, e in cache.resident_set():
        placed[layer, e] = True
    n_exec = stream.num_execs
    sizes = np.diff(stream.exec_ptr)
    layer_of_acc = np.repeat(np.arange(n_exec) % L, sizes)
    counted_exec = np.repeat(stream.step_counted, L)
    counted_acc = np.repeat(counted_exec, sizes)
    is_hit = placed[layer_of_acc, stream.experts.astype(np.int64)]
    acc = np.bincount(layer_of_acc[counted_acc], minlength=L).astype(np.int64)
    hit = np.bincount(layer_of_acc[counted_acc & is_hit], minlength=L).astype(np.int64)
    miss = acc - hit
    compute = cost.compute_ms(L)
    n_steps = int(stream.step_counted.sum())
    compute_total = float(compute.sum()) * n_steps
    base = Counters(L, xbytes, accesses=acc, hits=hit, decoded_tokens=stream.decoded_tokens, decode_steps=n_steps,
                    step_late=[0] * n_steps)
    if policy.miss == "cpu":
        cpu_cost = np.where(is_hit, 0.0, cost.cpu_expert_ms + stream.counts * cost.cpu_token_ms)
        cum = np.concatenate([[0.0], np.cumsum(cpu_cost)])
        per_exec = cum[stream.exec_ptr[1:]] - cum[stream.exec_ptr[:-1]]
        over = np.maximum(per_exec - np.tile(compute, stream.num_steps), 0.0)
        stall = float(over[counted_exec].sum())
        base.cpu = miss
        base.step_demand = [0] * n_steps
    else:
        step_of_acc = np.repeat(np.arange(n_exec) // L, sizes)
        per_step = np.bincount(step_of_acc[counted_acc & ~is_hit], minlength=stream.num_steps)
        base.step_demand = per_step[stream.step_counted].astype(np.int64).tolist()
        stall = float(miss.sum()) * cost.transfer_ms(xbytes)
        base.demand, base.temp = miss, miss.copy()
    return ReplayResult(**base.counts(), stall_ms=stall, compute_ms=compute_total, engine="static",
                        seconds=time.perf_counter() - t0,
                        resident={(int(a), int(b)) for a, b in zip(*np.nonzero(placed), strict=True)})


def run_policy(stream: AccessStream, policy: Policy, config: CacheConfig, cost: CostConfig | None = None,
               engine: str = "auto", progress: bool = False) -> ReplayResult:
    """Replay with the fastest engine that supports ``policy`` (``engine='auto'``), or the one named."""
    if engine not in ("auto", "kernel", "python"):
        raise ValueError(f"engine must be auto, kernel or python, got {engine!r}")
    from expertcast.inference.policies import spec_of

    spec = spec_of(policy)
    if "calibration" in spec.needs and policy.calibration_source is None:
        from expertcast.inference.policies.static import selection_counts

        policy.calibrate(selection_counts(stream.sequences or [], config.num_layers, config.num_experts),
                         "in-sample")
    if engine == "python":
        return replay(stream, policy, config, cost, progress=progress)
    if spec.runs_on("placement") and engine == "auto":
        return replay_static(stream, policy, config, cost)  # nothing moves: the driver's result, vectorized
    if spec.runs_on("kernel"):
        return replay_kernel(stream, policy, config, cost)
    if engine == "kernel":
        raise ValueError(f"policy {policy.name!r} has no compiled fast path; use engine='python'")
    return replay(stream, policy, config, cost, progress=progress)


# ------------------------------------------------------------------------------------------------
# The public API
# ------------------------------------------------------------------------------------------------
def _as_policy(spec: str | Policy, calibration=None) -> Policy:
    from expertcast.inference.policies import make_policy, parse_policy_spec, policy_spec

    if isinstance(spec, Policy):
        if not hasattr(spec, "label"):
            spec.label = spec.name
        return spec
    name, kwargs = parse_policy_spec(spec)
    if calibration is not None and "calibration" not in kwargs and "calibration" in policy_spec(name).needs:
        kwargs["calibration"] = calibration  # a calibrated policy (static) without its own calibration
    return make_policy(name, **kwargs)


def _load(traces) -> tuple[TraceMeta, list[TraceSequence]]:
    if isinstance(traces, (str, Path)):
        from expertcast.data.traces import load_traces

        p = Path(traces)
        if not p.exists():
            raise FileNotFoundError(f"trace directory {p} does not exist (record traces with `expertcast collect`)")
        return load_traces(p)
    if isinstance(traces, tuple) and len(traces) == 2 and isinstance(traces[0], TraceMeta):
        return traces[0], list(traces[1])
    if hasattr(traces, "meta") and hasattr(traces, "sequences"):
        return traces.meta, list(traces.sequences)
    raise TypeError("traces must be a trace directory, a (TraceMeta, [TraceSequence]) tuple or an object with "
                    ".meta and .sequences")


def cache_configs(meta: TraceMeta, capacities: Sequence[Any] | None = None, pool: str = "per-layer",
                  slots_per_layer: Sequence[int] | None = None,
                  allow_below_top_k: bool = False) -> list[tuple[Any, CacheConfig]]:
    """(requested capacity, CacheConfig) for each capacity: a :class:`Budget`, or its number form
    (:meth:`Budget.parse`: a float is a fraction of L*E, an int is slots per layer or shared, a list is
    per-layer budgets); ``slots_per_layer`` values are uniform
    per-layer budgets (per-layer pool). ``allow_below_top_k``: see :class:`CacheConfig`."""
    common = dict(num_layers=meta.num_layers, num_experts=meta.num_experts, top_k=meta.top_k,
                  expert_bytes=meta.expert_bytes, allow_below_top_k=allow_below_top_k)
    out = []
    if slots_per_layer:
        if pool != "per-layer":
            raise ValueError("--slots-per-layer gives per-layer budgets: use pool='per-layer'")
        for b in slots_per_layer:
            out.append((int(b), CacheConfig(pool="per-layer", budget=Budget.slots(int(b)), **common)))
    for c in capacities or ():
        budget = Budget.parse(c)
        out.append((budget.requested, CacheConfig(pool=pool, budget=budget, **common)))
    if not out:
        raise ValueError("no capacity given")
    return out


def simulate(traces, policies: Sequence[str | Policy], capacities: Sequence[Any] | None = (0.15, 0.25, 0.35, 0.45),
             *, pool: str = "per-layer", slots_per_layer: Sequence[int] | None = None, batch_size: int = 1,
             cost: CostConfig | None = None, belady_fraction: bool = True, engine: str = "auto",
             calibration=None, progress: bool = True, done: dict[str, dict] | None = None,
             on_record=None, allow_below_top_k: bool = False) -> list[dict[str, Any]]:
    """Replay ``traces`` for every (policy, capacity) and return one record per pair.

    Args:
        traces: a trace directory (``data.traces.load_traces``), a ``(TraceMeta, [TraceSequence])`` tuple
            or an object with ``.meta`` and ``.sequences`` (e.g. :mod:`expertcast.data.synthetic`).
        policies: registry names with options (``"lrfu:lam=0.1"``, ``"belady-k:k=8"``) or Policy objects
            (a Policy object is reset and reused for every capacity).
        capacities: fractions of L*E (floats), slot counts (ints) or per-layer budget lists.
        pool: ``per-layer`` or ``shared``; slots_per_layer: uniform per-layer budgets B (in addition
            to ``capacities``; pass ``capacities=None`` to use them alone).
        batch_size: sequences decoded in lockstep (see the module docstring).
        cost: cost-model parameters (defaults: PCIe 4.0 x16, the trace's expert size).
        belady_fraction: also compute the demand-only ceiling at each capacity (:func:`replay_ceiling`) and
            report ``belady_hit`` (its hit) and ``belady_fraction`` (hit / ceiling hit).
        engine: ``auto`` (compiled kernels where available), ``kernel`` or ``python``.
        calibration: [L, E] counts or sequences for ``static`` (default: in-sample).
        done: records of an interrupted run keyed by :func:`record_key`; they are reused, not replayed.
        on_record: called with each new record (the CLI saves partial results with it).
        allow_below_top_k: accept per-layer budgets below top-K (the excess of a selection goes to the
            temporary slot or the CPU; SAEM's smallest expert-cache ratios).

    Returns:
        list of dicts with policy, pool, capacity (realized fraction of L*E), slots, hit, adj_hit,
        mb_per_token, belady_fraction and the other counters of :meth:`ReplayResult.metrics`.
    """
    meta, seqs = _load(traces)
    cost = cost or CostConfig()
    stream = build_stream(meta, seqs, batch_size)
    configs = cache_configs(meta, capacities, pool, slots_per_layer, allow_below_top_k)
    pols = [_as_policy(p, calibration) for p in policies]
    runs = [(p, c) for c in configs for p in pols]
    belady_hit: dict[int, float] = {}
    records = []
    it = runs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(runs, desc="simulate", unit="run")
    for policy, (requested, config) in it:
        key = record_key(getattr(policy, "label", policy.name), config, batch_size)
        if done and key in done:
            records.append(done[key])
            continue
        res = run_policy(stream, policy, config, cost, engine)
        rec: dict[str, Any] = {
            "policy": getattr(policy, "label", policy.name),
            "pool": config.pool,
            "capacity": round(config.fraction, 6),
            "capacity_requested": requested,
            "slots": config.total_slots,
            "slots_per_layer": config.uniform_slots_per_layer,
            "batch_size": batch_size,
        }
        rec.update(res.metrics())
        if belady_fraction:
            ck = id(config)
            if ck not in belady_hit:
                belady_hit[ck] = replay_ceiling(stream, config, cost).hit
            rec["belady_hit"] = belady_hit[ck]
            rec["belady_fraction"] = rec["hit"] / belady_hit[ck] if belady_hit[ck] > 0 else float("nan")
        rec["engine"] = res.engine
        rec["seconds"] = round(res.seconds, 4)
        rec["accesses_per_s"] = len(stream.experts) / res.seconds if res.seconds > 0 else float("nan")
        if getattr(policy, "calibration_source", None):
            rec["calibration"] = policy.calibration_source
        rec["accounting"] = WARMUP_NOTE
        rec["oracle"] = ORACLE_NOTE
        rec["key"] = key
        records.append(rec)
        if on_record is not None:
            on_record(rec)
    return records


def record_key(label: str, config: CacheConfig, batch_size: int) -> str:
    """Identity of one (policy, capacity) run, for resuming."""
    budgets = ",".join(str(int(b)) for b in config.pool_capacities)
    return f"{label}|{config.pool}|{budgets}|b{batch_size}"
