"""Trace-driven expert-cache simulator: replay routing traces through a policy and measure hit rate,
traffic and modelled speed (DESIGN.md, cache semantics).

How a replay is formed:
* Batches: the sequences are taken in order, ``batch_size`` consecutive sequences at a time, and
  decoded in lockstep; a sequence that has finished drops out while the others go on. The next batch
  starts when the whole batch is done. The cache persists across batches (one long serving session).
* Steps: each batch first replays its prompts position by position (prefill step ``p`` accesses
  position ``p`` of every member whose prompt is longer than ``p``), then decodes (decode step ``d``
  accesses position ``prompt_len + d`` of every unfinished member). Every step runs layers 0..L-1; a
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
decoded token, per-layer hit, ``belady_fraction = hit / hit of belady`` (protect-rule Belady, same
capacity, pool and batch), and the cost model's stall and % of full-load speed
(:mod:`expertcast.inference.cost_model`).

Two engines replay the same stream: the generic Python driver (:func:`replay`), which calls every
:class:`~expertcast.inference.policy.Policy` hook and keeps the cost model's clock (late prefetches
need it), and compiled kernels (:mod:`expertcast.inference._kernels`) for the demand-only classic
policies and oracles, whose stall is exactly ``D * transfer_ms`` because nothing else uses the link.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference import _kernels as K
from expertcast.inference.cache import COMPUTE, FETCH, USED, CacheConfig, ExpertCache, acquire_slot
from expertcast.inference.cost_model import QWEN3_30B_A3B_EXPERT_BYTES, CostConfig, Event, Link
from expertcast.inference.metrics import CacheMetricsMixin
from expertcast.inference.policy import MissAction, Policy

WARMUP_NOTE = "decode-only; prefill replayed through the policy uncounted"
ORACLE_NOTE = "belady = protect-rule Belady (selection kept, furthest next use evicted)"


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
            self._next["exec"] = K.next_use_kernel(self.experts, self.exec_ptr, self.num_layers,
                                                   self.num_experts, False)
        return self._next["exec"]

    @property
    def next_access(self) -> np.ndarray:
        """int64 [A]: next access index of the same (layer, expert) (sequential Belady)."""
        if "access" not in self._next:
            self._next["access"] = K.next_use_kernel(self.experts, self.exec_ptr, self.num_layers,
                                                     self.num_experts, True)
        return self._next["access"]

    def batch_prefill_steps(self, b: int) -> int:
        """Prefill steps of batch ``b`` (its longest prompt)."""
        return max(self.sequences[s].prompt_len for s in self.batches[b]) if self.sequences else 0


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
    sequences in lockstep; see the module docstring)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    validate_traces(meta, sequences)
    L, E, Kk = meta.num_layers, meta.num_experts, meta.top_k
    n = len(sequences)
    batches = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
    if batch_size == 1:
        experts = np.concatenate([np.ascontiguousarray(s.expert_ids, dtype=np.int16).reshape(-1) for s in sequences])
        counts = np.ones(len(experts), np.int32)
        exec_ptr = np.arange(0, len(experts) + 1, Kk, dtype=np.int64)
        step_counted = np.concatenate([np.arange(s.num_tokens) >= s.prompt_len for s in sequences])
        step_tokens = np.ones(len(step_counted), np.int32)
        step_batch = np.concatenate([np.full(s.num_tokens, i, np.int32) for i, s in enumerate(sequences)])
    else:
        flat = np.concatenate([np.ascontiguousarray(s.expert_ids, dtype=np.int16).reshape(-1) for s in sequences])
        sizes = np.array([s.num_tokens * L * Kk for s in sequences], np.int64)
        seq_off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        seq_T = np.array([s.num_tokens for s in sequences], np.int64)
        seq_prompt = np.array([s.prompt_len for s in sequences], np.int64)
        members = np.array([i for b in batches for i in b], np.int64)
        bptr = np.concatenate([[0], np.cumsum([len(b) for b in batches])]).astype(np.int64)
        experts, counts, exec_ptr, step_counted, step_tokens, step_batch = K.build_batch_stream(
            flat, seq_off, seq_T, seq_prompt, members, bptr, L, Kk, E)
    return AccessStream(L, E, Kk, experts, counts, exec_ptr, step_counted.astype(np.bool_), step_tokens,
                        step_batch, batches, list(sequences))


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------
@dataclass
class ReplayResult(CacheMetricsMixin):
    """Counters of one replay (decode steps only), per layer: int64 [L] each."""

    accesses: np.ndarray
    hits: np.ndarray
    demand: np.ndarray
    temp: np.ndarray
    late: np.ndarray
    cpu: np.ndarray
    proactive: np.ndarray
    dropped: np.ndarray
    stall_ms: float
    compute_ms: float
    decoded_tokens: int
    decode_steps: int
    expert_bytes: int
    engine: str
    seconds: float = 0.0
    resident: set[tuple[int, int]] | None = None
    timeline: list[Event] | None = None

    @property
    def per_layer_hit(self) -> list[float]:
        acc = np.maximum(self.accesses, 1)
        return [float(v) for v in 1.0 - self.demand / acc]

    def metrics(self) -> dict[str, Any]:
        total = self.compute_ms + self.stall_ms
        return {
            **self.counter_metrics(),
            "resident_hit": int(self.hits.sum()) / self.A if self.A else float("nan"),
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
           record_timeline: bool = False, progress: bool = False) -> ReplayResult:
    """Generic engine: drive ``policy`` through every hook of :mod:`expertcast.inference.policy`
    with the cost model's clock. Works for any policy (prefetching, CPU execution, temporary slots)."""
    if getattr(policy, "kernel_only", False):
        raise ValueError(f"policy {policy.name!r} runs only on the compiled engine")
    _check_stream(stream, config)
    cost = cost or CostConfig()
    L, E = config.num_layers, config.num_experts
    xbytes = _expert_bytes(config, cost)
    compute = cost.compute_ms(L)
    link = Link(cost.transfer_ms(xbytes), cost.queue, timeline=[] if record_timeline else None)
    cache = ExpertCache(config)
    policy.reset(config)
    if policy.needs_future:
        policy.set_future(stream)
    if stream.sequences and hasattr(policy, "prepare_sequences"):
        policy.prepare_sequences(stream.sequences)  # optional hook: per-replay setup over all sequences (seqmoe)
    for layer, expert in policy.warm_start(cache):
        slot = cache.take_free_slot(cache.pool_of(layer))
        if slot < 0:
            raise ValueError(f"{policy.name}: warm start places more experts than layer {layer}'s pool holds")
        cache.assign(slot, layer, expert, USED)

    z = lambda: np.zeros(L, np.int64)  # noqa: E731
    acc, hits, demand, temp, late, cpu, proactive, dropped = z(), z(), z(), z(), z(), z(), z(), z()
    fetch_of: dict[int, Any] = {}
    clock = 0.0
    stall_total = 0.0
    compute_total = 0.0
    seqs = stream.sequences
    t0 = time.perf_counter()

    def issue(t: int, cur_layer: int, items, now: float, after: bool, counted: bool) -> None:
        for (pl, pe) in items:
            pl, pe = int(pl), int(pe)
            if not (0 <= pl < L and 0 <= pe < E):
                raise ValueError(f"{policy.name} asked to prefetch ({pl}, {pe}) outside L={L}, E={E}")
            if cache.contains(pl, pe):
                continue
            slot = acquire_slot(cache, policy, t, pl, cache.pool_of(pl))
            if slot < 0:
                if counted:
                    dropped[pl] += 1
                continue
            cache.assign(slot, pl, pe, FETCH, proactive=True)
            policy.on_insert(pl, pe, True)
            later = pl > cur_layer or (pl == cur_layer and not after)
            deadline = (t if later else t + 1) * L + pl
            fetch_of[slot] = link.issue_prefetch(slot, pl, pe, now, deadline, t)
            if counted:
                proactive[pl] += 1

    steps = range(stream.num_steps)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=f"replay {policy.name}", unit="step", leave=False)
    prev_batch = -1
    for t in steps:
        b = int(stream.step_batch[t])
        if b != prev_batch:
            policy.begin_batch([seqs[i] for i in stream.batches[b]] if seqs else stream.batches[b])
            batch_start, prev_batch = t, b
        policy.on_step(t)
        counted = bool(stream.step_counted[t])
        for layer in range(L):
            x = t * L + layer
            now = clock
            for tr in link.advance(now):
                if cache.slot_layer[tr.slot] == tr.layer and cache.state[tr.slot] == FETCH:
                    cache.set_state(tr.slot, COMPUTE)
                    fetch_of.pop(tr.slot, None)
            issue(t, layer, policy.before_layer(t, layer, cache), now, False, counted)
            for s in cache.slots_in_state(COMPUTE, layer):  # landed prefetches of this layer
                cache.set_state(int(s), USED)
            sel, cnt = stream.selection(x)
            pool = cache.pool_of(layer)
            wait = now
            missing = []
            for e in sel:
                e = int(e)
                s = cache.slot(layer, e)
                if s < 0:
                    missing.append(e)
                    continue
                if cache.state[s] == FETCH:
                    tr = fetch_of.pop(s)
                    wait = max(wait, link.wait_for(tr, now))
                    link.inflight.remove(tr)
                    if link.timeline is not None:
                        link.timeline.append(Event(t, layer, "late", e, now, tr.end))
                    cache.set_state(s, COMPUTE)
                    if counted:
                        late[layer] += 1
                elif counted:
                    hits[layer] += 1
                cache.proactive[s] = False
            cpu_ms = 0.0
            cpu_jobs: list[tuple[int, float]] = []
            cnt_of = dict(zip(sel.tolist(), cnt.tolist(), strict=True))
            for e in missing:
                action = MissAction(policy.on_miss(t, layer, e, cnt_of[e], cache))
                slot = -1
                if action == MissAction.LOAD:
                    slot = acquire_slot(cache, policy, t, layer, pool, sel)
                    if slot < 0:
                        action = MissAction.TEMP  # every slot holds a selected or in-flight expert
                if action == MissAction.LOAD:
                    cache.assign(slot, layer, e, COMPUTE)
                    policy.on_insert(layer, e, False)
                    wait = max(wait, link.demand(layer, e, now, t))
                elif action == MissAction.TEMP:
                    wait = max(wait, link.demand(layer, e, now, t, kind="temp"))
                    if counted:
                        temp[layer] += 1
                else:
                    c = cost.cpu_ms(cnt_of[e])
                    cpu_jobs.append((e, c))
                    cpu_ms += c
                    if counted:
                        cpu[layer] += 1
                if counted and action != MissAction.CPU:
                    demand[layer] += 1
            if counted:
                acc[layer] += len(sel)
            layer_stall = wait - now
            begin = wait
            if link.timeline is not None:
                if layer_stall > 0:
                    link.timeline.append(Event(t, layer, "stall", -1, now, wait))
                cur = now if cost.cpu_parallel else begin
                for e, c in cpu_jobs:  # CPU experts run one after another beside the device work
                    link.timeline.append(Event(t, layer, "cpu", e, cur, cur + c))
                    cur += c
                link.timeline.append(Event(t, layer, "compute", -1, begin, begin + compute[layer]))
            if cost.cpu_parallel:  # CPU experts start with the layer, beside its transfers and compute
                clock = max(begin + compute[layer], now + cpu_ms)
            else:
                clock = begin + max(compute[layer], cpu_ms)
            if counted:
                stall_total += clock - now - compute[layer]
                compute_total += compute[layer]
            for e in sel:
                s = cache.slot(layer, int(e))
                if s >= 0 and cache.state[s] == COMPUTE:
                    cache.set_state(s, USED)
            policy.on_access(t, layer, sel, cnt, cache)
            issue(t, layer, policy.after_layer(t, layer, cache), clock, True, counted)
        if seqs is not None:
            produced = _produced_tokens(stream, t, batch_start)
            if produced:
                policy.observe_tokens(t, produced)
    return ReplayResult(acc, hits, demand, temp, late, cpu, proactive, dropped, stall_total, compute_total,
                        stream.decoded_tokens, int(stream.step_counted.sum()), xbytes, "python",
                        time.perf_counter() - t0, cache.resident_set(), link.timeline)


def _produced_tokens(stream: AccessStream, t: int, batch_start: int) -> list[int]:
    """Token ids produced at step ``t`` by the active members (the input of their next position)."""
    b = int(stream.step_batch[t])
    j = t - batch_start
    mp = stream.batch_prefill_steps(b)
    out = []
    for s in stream.batches[b]:
        seq = stream.sequences[s]
        if j < mp:
            if j >= seq.prompt_len:
                continue
            pos = j
        else:
            pos = seq.prompt_len + j - mp
            if pos >= seq.num_tokens:
                continue
        if pos + 1 < seq.num_tokens:
            out.append(int(seq.token_ids[pos + 1]))
    return out


def replay_kernel(stream: AccessStream, policy: Policy, config: CacheConfig,
                  cost: CostConfig | None = None) -> ReplayResult:
    """Compiled engine for policies exposing ``kernel_params()`` (classic policies, oracles)."""
    _check_stream(stream, config)
    policy.reset(config)
    params = policy.kernel_params() if hasattr(policy, "kernel_params") else None
    if params is None:
        raise ValueError(f"policy {policy.name!r} has no compiled fast path; use engine='python'")
    cost = cost or CostConfig()
    L, E = config.num_layers, config.num_experts
    xbytes = _expert_bytes(config, cost)
    if params["kind"] == K.KIND_BELADY_SEQ:
        nxt = stream.next_access
    elif params["kind"] == K.KIND_BELADY:
        nxt = stream.next_exec
    else:
        nxt = np.zeros(1, np.int64)
    z = lambda: np.zeros(L, np.int64)  # noqa: E731
    acc, hit, miss, temp = z(), z(), z(), z()
    resident = np.zeros(L * E, np.int8)
    t0 = time.perf_counter()
    K.replay_kernel(stream.experts, stream.exec_ptr, stream.step_counted, L, E, config.pool_of_layer,
                    config.pool_capacities, params["kind"], float(params["lam"]), int(params["horizon"]),
                    bool(params["perfect_history"]), nxt, acc, hit, miss, temp, resident)
    seconds = time.perf_counter() - t0
    compute = cost.compute_ms(L)
    n_steps = int(stream.step_counted.sum())
    compute_total = float(compute.sum()) * n_steps
    stall = float(miss.sum()) * cost.transfer_ms(xbytes)  # demand transfers only, each exposed
    res = {(int(i) // E, int(i) % E) for i in np.flatnonzero(resident)}
    return ReplayResult(acc, hit, miss, temp, z(), z(), z(), z(), stall, compute_total, stream.decoded_tokens,
                        n_steps, xbytes, "kernel", seconds, res, None)


def replay_static(stream: AccessStream, policy, config: CacheConfig, cost: CostConfig | None = None) -> ReplayResult:
    """Vectorized engine for the static placement (nothing ever moves)."""
    _check_stream(stream, config)
    cost = cost or CostConfig()
    L, E = config.num_layers, config.num_experts
    xbytes = _expert_bytes(config, cost)
    policy.reset(config)
    t0 = time.perf_counter()
    placed = np.zeros((L, E), np.bool_)
    for layer, e in policy.placement(config):
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
    z = np.zeros(L, np.int64)
    if policy.miss == "cpu":
        cpu_cost = np.where(is_hit, 0.0, cost.cpu_expert_ms + stream.counts * cost.cpu_token_ms)
        cum = np.concatenate([[0.0], np.cumsum(cpu_cost)])
        per_exec = cum[stream.exec_ptr[1:]] - cum[stream.exec_ptr[:-1]]
        over = np.maximum(per_exec - np.tile(compute, stream.num_steps), 0.0)
        stall = float(over[counted_exec].sum())
        res = ReplayResult(acc, hit, z.copy(), z.copy(), z.copy(), miss, z.copy(), z.copy(), stall, compute_total,
                           stream.decoded_tokens, n_steps, xbytes, "static", 0.0)
    else:
        stall = float(miss.sum()) * cost.transfer_ms(xbytes)
        res = ReplayResult(acc, hit, miss, miss.copy(), z.copy(), z.copy(), z.copy(), z.copy(), stall, compute_total,
                           stream.decoded_tokens, n_steps, xbytes, "static", 0.0)
    res.seconds = time.perf_counter() - t0
    res.resident = {(int(a), int(b)) for a, b in zip(*np.nonzero(placed), strict=True)}
    return res


def run_policy(stream: AccessStream, policy: Policy, config: CacheConfig, cost: CostConfig | None = None,
               engine: str = "auto", progress: bool = False) -> ReplayResult:
    """Replay with the fastest engine that supports ``policy`` (``engine='auto'``), or the one named."""
    if engine not in ("auto", "kernel", "python"):
        raise ValueError(f"engine must be auto, kernel or python, got {engine!r}")
    from expertcast.inference.policies.static import StaticFrequencyPolicy

    if isinstance(policy, StaticFrequencyPolicy) and policy.freq is None:
        from expertcast.inference.policies.static import selection_counts

        policy.calibrate(selection_counts(stream.sequences or [], config.num_layers, config.num_experts),
                         "in-sample")
    if engine == "python":
        return replay(stream, policy, config, cost, progress=progress)
    if isinstance(policy, StaticFrequencyPolicy) and engine == "auto":
        return replay_static(stream, policy, config, cost)
    if hasattr(policy, "kernel_params"):
        policy.reset(config)
        if policy.kernel_params() is not None:
            return replay_kernel(stream, policy, config, cost)
    if engine == "kernel":
        raise ValueError(f"policy {policy.name!r} has no compiled fast path; use engine='python'")
    return replay(stream, policy, config, cost, progress=progress)


# ------------------------------------------------------------------------------------------------
# The public API
# ------------------------------------------------------------------------------------------------
def _as_policy(spec: str | Policy, calibration=None) -> Policy:
    from expertcast.inference.policies import make_policy, parse_policy_spec

    if isinstance(spec, Policy):
        if not hasattr(spec, "label"):
            spec.label = spec.name
        return spec
    name, kwargs = parse_policy_spec(spec)
    if name.strip().lower() == "static" and calibration is not None and "calibration" not in kwargs:
        kwargs["calibration"] = calibration
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
    """(requested capacity, CacheConfig) for each capacity: a float is a fraction of L*E, an int is
    slots (per layer or shared), a list is per-layer budgets; ``slots_per_layer`` values are uniform
    per-layer budgets (per-layer pool). ``allow_below_top_k``: see :class:`CacheConfig`."""
    common = dict(num_layers=meta.num_layers, num_experts=meta.num_experts, top_k=meta.top_k,
                  expert_bytes=meta.expert_bytes, allow_below_top_k=allow_below_top_k)
    out = []
    if slots_per_layer:
        if pool != "per-layer":
            raise ValueError("--slots-per-layer gives per-layer budgets: use pool='per-layer'")
        for b in slots_per_layer:
            out.append((int(b), CacheConfig(pool="per-layer", slots=int(b), **common)))
    for c in capacities or ():
        if isinstance(c, (list, tuple, np.ndarray)):
            out.append((list(c), CacheConfig(pool=pool, slots_per_layer=[int(v) for v in c], **common)))
        elif isinstance(c, (int, np.integer)) and not isinstance(c, bool):
            out.append((int(c), CacheConfig(pool=pool, slots=int(c), **common)))
        else:
            out.append((float(c), CacheConfig(pool=pool, capacity=float(c), **common)))
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
            or an object with ``.meta`` and ``.sequences`` (e.g. :mod:`expertcast.inference.synthetic`).
        policies: registry names with options (``"lrfu:lam=0.1"``, ``"belady-k:k=8"``) or Policy objects
            (a Policy object is reset and reused for every capacity).
        capacities: fractions of L*E (floats), slot counts (ints) or per-layer budget lists.
        pool: ``per-layer`` or ``shared``; slots_per_layer: uniform per-layer budgets B (in addition
            to ``capacities``; pass ``capacities=None`` to use them alone).
        batch_size: sequences decoded in lockstep (see the module docstring).
        cost: cost-model parameters (defaults: PCIe 4.0 x16, the trace's expert size).
        belady_fraction: also run protect-rule Belady at each capacity and report hit / Belady's hit.
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
                if policy.name == "belady" and getattr(policy, "label", "belady") == "belady":
                    belady_hit[ck] = res.hit
                else:
                    from expertcast.inference.policies.oracle import BeladyPolicy

                    belady_hit[ck] = replay_kernel(stream, BeladyPolicy(), config, cost).hit
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
