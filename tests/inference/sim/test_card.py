"""The protocol card's replay semantics (docs/design.md, "Protocol card"): a conformance trace whose every counter is
worked out by hand, the per-step tallies of the compiled kernels equal to the driver's, and the card's arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest
from expertcast.data.synthetic import markov_traces
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache.cost_model import CostConfig
from expertcast.inference.cache.expert_cache import Budget, CacheConfig
from expertcast.inference.policies import make_policy
from expertcast.inference.policies.classic import LRUPolicy
from expertcast.inference.sim.card import (
    CardSettings,
    add_gap,
    lifecycle_streams,
    make_card,
    replay_lifecycle,
    token_metrics,
)
from expertcast.inference.sim.simulator import build_stream, cache_configs, replay, replay_kernel
from expertcast.utils.errors import OverlapError


def _seq(name: str, ids: list[int], prompt_len: int) -> TraceSequence:
    e = np.asarray(ids, np.int16).reshape(-1, 1, 1)
    return TraceSequence(name, np.arange(len(ids), dtype=np.int32), prompt_len, e, np.ones(e.shape, np.float16))


META = TraceMeta("conformance", 1, 4, 1, 2_000_000)
A = _seq("A", [1, 0, 2, 1, 3, 1], 2)
B = _seq("B", [3, 1, 3, 2], 1)
C = _seq("C", [0, 1, 2, 3, 0], 1)
CFG = CacheConfig(num_layers=1, num_experts=4, top_k=1, pool="per-layer", budget=Budget.slots(2),
                  expert_bytes=2_000_000)
LINK = CostConfig(bandwidth_gbps=1.0, layer_compute_ms=1.0)  # 2e6 bytes at 1e9 B/s: one transfer = 2 ms


class ScheduledPrefetchLRU(LRUPolicy):
    """LRU that, after the layer of step ``t``, asks for a proactive load of each expert in ``schedule[t]`` (an
    unregistered policy: the driver engine, like any prefetching policy)."""

    name = "lru-scheduled-prefetch"

    def __init__(self, schedule: dict[int, list[int]]):
        super().__init__()
        self.schedule = schedule

    def after_layer(self, t, layer, cache):
        return [(layer, e) for e in self.schedule.get(t, ())]


def _counters(res) -> dict:
    return {"accesses": res.A, "hits": int(res.hits.sum()), "misses": res.D, "evictions": int(res.evictions.sum()),
            "per_token": list(res.step_demand), "late_per_token": list(res.step_late),
            "no_miss_tokens": res.steps_without_miss, "late": int(res.late.sum()), "proactive": res.P,
            "prefetch_used": res.U, "tokens": res.decoded_tokens}


def _run(seqs, policy, lifecycle, count_prefill=False, engine="auto"):
    streams = lifecycle_streams(META, seqs, lifecycle, count_prefill)
    return replay_lifecycle(streams, policy, CFG, LINK, engine)


@pytest.mark.parametrize("engine", ["auto", "python"])
def test_conformance_trace_counters_match_hand_worked_values(engine):
    """One layer, E=4, K=1, a per-layer pool of 2 slots; link: one transfer 2 ms, a layer computes 1 ms.

    Rules used: an Empty slot is taken first (lowest index); a miss evicts only when the pool is full; LRU evicts the
    least recent access; LFU the lowest count, ties to the least recent (history perfect); Belady the furthest next
    use (the sequence's own future, prefill included), ties (both never used again) to the lower id; prefill steps are
    replayed uncounted unless counted. Steps are written ``t:e`` (``*`` = prefill), cache states as sets.

    A = 1* 0* 2 1 3 1, B = 3* 1 3 2.

    LRU, cold (each sequence from an empty cache):
      A: 1* -> {1}; 0* -> {1,0}; 2 miss, evict 1 -> {2,0}; 1 miss, evict 0 -> {2,1}; 3 miss, evict 2 -> {3,1};
         1 hit.                                   decode: 4 accesses, 1 hit, 3 misses, 3 evictions, per token 1 1 1 0
      B: 3* -> {3}; 1 miss (empty slot, no eviction) -> {3,1}; 3 hit; 2 miss, evict 1 -> {3,2}.
                                                  3 accesses, 1 hit, 2 misses, 1 eviction, per token 1 0 1
      total: 7 accesses, 2 hits, 5 misses, 4 evictions, per token 1 1 1 0 1 0 1, 2 tokens without a miss.
    LRU, cold, prefill counted: A adds 2 misses into empty slots (per token 1 1 1 1 1 0), B adds 1 (1 1 0 1):
      10 accesses, 2 hits, 8 misses, 4 evictions, 2 tokens without a miss.
    LRU, persistent (A then B over one cache): A as above, ends {3,1}; B: 3* hit (uncounted); 1 hit; 3 hit;
      2 miss, evict 1 -> {3,2}.                   B: 3 accesses, 2 hits, 1 miss, 1 eviction, per token 0 0 1
      total: 7 accesses, 3 hits, 4 misses, 4 evictions, per token 1 1 1 0 0 0 1, 3 tokens without a miss.
    LFU, cold, the tie: at A's step 2 experts 1 and 0 both have count 1; the least recent (1) goes, as LRU: the same
      counters as LRU (a lower-id tie rule would evict 0 and hit 1 at step 3: 2 misses in A).
    Belady, cold: A: 2 miss, evict 0 (never used again; 1 is next used at step 3) -> {1,2}; 1 hit; 3 miss, evict 2
      (never again) -> {1,3}; 1 hit: 2 misses, 2 evictions, per token 1 0 1 0. B: 3*; 1 miss (empty slot); 3 hit;
      2 miss: 3 and 1 are never used again, the tie goes to the lower id: evict 1 -> {3,2}: 2 misses, 1 eviction.
      total: 7 accesses, 3 hits, 4 misses, 3 evictions, per token 1 0 1 0 1 0 1, 3 tokens without a miss.
    Belady, persistent: A ends {1,3}; B: 3* hit; 1 hit; 3 hit; 2 miss, tie again -> evict 1, resident {3,2}:
      7 accesses, 4 hits, 3 misses, 3 evictions, per token 1 0 1 0 0 0 1, 4 tokens without a miss.
    Gap (cold): LRU 2/7, Belady 3/7: gap 1/7; LFU closes 0 of it, Belady all.

    Late prefetch, C = 0* 1 2 3 0, LRU that prefetches 2 after step 1 and 0 after step 2 (cold, clock in ms):
      step 0* [0, 3): 0 demand, link 0-2, stall 2 (uncounted), compute 2-3.
      step 1 [3, 6): 1 miss into the empty slot, link 3-5, stall 2. Then the prefetch of 2: the pool is full, LRU
         evicts 0 (an eviction, counted), 2 queued at 6.
      step 2 [6, 9): the prefetch has not started at the layer start (6): late; promoted, link 6-8, stall 2; its first
         use counts as a used prefetch. Then the prefetch of 0 evicts 1 (LRU), queued at 9.
      step 3 [9, 12): 3 misses: the slot in Fetch cannot be evicted, 2 is (an eviction); the demand transfer goes
         ahead of the queued prefetch: link 9-11, stall 2. The prefetch starts when the link frees: 11-13.
      step 4 [12, 14): 0 is still in flight: late, waits until 13, stall 1; used.
      counted: 4 accesses, 0 resident hits, 2 late, 2 demand misses, 2 proactive, 2 used, 3 evictions; per token
      demand 1 0 1 0, late 0 1 0 1: no token without a miss. Stall 7 ms = 3.5 transfers: exposed misses/token
      0.875 (a demand-only policy's equal its misses/token); hit 1 - 2/4 = 0.5.
    """
    lru = lambda: make_policy("lru")  # noqa: E731
    base = {"late": 0, "proactive": 0, "prefetch_used": 0}
    cold = _counters(_run([A, B], lru(), "cold", engine=engine))
    assert cold == {**base, "accesses": 7, "hits": 2, "misses": 5, "evictions": 4, "per_token": [1, 1, 1, 0, 1, 0, 1],
                    "late_per_token": [0] * 7, "no_miss_tokens": 2, "tokens": 7}
    pre = _counters(_run([A, B], lru(), "cold", count_prefill=True, engine=engine))
    assert pre == {**base, "accesses": 10, "hits": 2, "misses": 8, "evictions": 4,
                   "per_token": [1, 1, 1, 1, 1, 0, 1, 1, 0, 1], "late_per_token": [0] * 10, "no_miss_tokens": 2,
                   "tokens": 10}
    pers = _counters(_run([A, B], lru(), "persistent", engine=engine))
    assert pers == {**base, "accesses": 7, "hits": 3, "misses": 4, "evictions": 4, "per_token": [1, 1, 1, 0, 0, 0, 1],
                    "late_per_token": [0] * 7, "no_miss_tokens": 3, "tokens": 7}
    lfu = _counters(_run([A, B], make_policy("lfu"), "cold", engine=engine))
    assert lfu == cold
    bel = _counters(_run([A, B], make_policy("belady"), "cold", engine=engine))
    assert bel == {**base, "accesses": 7, "hits": 3, "misses": 4, "evictions": 3, "per_token": [1, 0, 1, 0, 1, 0, 1],
                   "late_per_token": [0] * 7, "no_miss_tokens": 3, "tokens": 7}
    (stream,) = lifecycle_streams(META, [A, B], "persistent")
    run = replay_kernel if engine == "auto" else replay
    bel_p = run(stream, make_policy("belady"), CFG, LINK)
    assert _counters(bel_p) == {**base, "accesses": 7, "hits": 4, "misses": 3, "evictions": 3,
                                "per_token": [1, 0, 1, 0, 0, 0, 1], "late_per_token": [0] * 7, "no_miss_tokens": 4,
                                "tokens": 7}
    assert bel_p.resident == {(0, 3), (0, 2)}  # the tie went to the lower id: 1 was evicted, 3 kept
    rows = [{"pool": "per-layer", "capacity": 0.5, "policy": p, "hit": h}
            for p, h in (("lru", 2 / 7), ("lfu", 2 / 7), ("belady", 3 / 7))]
    add_gap(rows)
    assert [r["gap_closed"] for r in rows] == [0.0, 0.0, 1.0]
    assert rows[0]["lru_belady_gap"] == pytest.approx(1 / 7)
    m = token_metrics(_run([A, B], lru(), "cold", engine=engine), LINK)
    assert m["misses_per_token"] == m["exposed_per_token"] == pytest.approx(5 / 7)
    assert m["no_miss_share"] == pytest.approx(2 / 7)

    # the late prefetch: the driver over the modelled link (every engine choice ends there for this policy)
    res = _run([C], ScheduledPrefetchLRU({1: [2], 2: [0]}), "cold", engine=engine)
    assert res.engine == "python"
    got = _counters(res)
    assert got == {"accesses": 4, "hits": 0, "misses": 2, "evictions": 3, "per_token": [1, 0, 1, 0],
                   "late_per_token": [0, 1, 0, 1], "no_miss_tokens": 0, "late": 2, "proactive": 2,
                   "prefetch_used": 2, "tokens": 4}
    assert res.stall_ms == pytest.approx(7.0) and res.compute_ms == pytest.approx(4.0)
    assert res.hit == 0.5 and res.resident_hit == 0.0 and res.adj_hit == pytest.approx(1 / 3)
    m = token_metrics(res, LINK)
    assert m["misses_per_token"] == 0.5 and m["exposed_per_token"] == pytest.approx(0.875)
    assert m["no_miss_share"] == 0.0


def test_kernel_tallies_equal_the_driver():
    """Evictions and per-step demand misses of the compiled kernels and the static engine equal the driver's."""
    tr = markov_traces(num_sequences=3, num_tokens=40, num_layers=3, num_experts=8, top_k=2, seed=1)
    st = build_stream(tr.meta, tr.sequences)
    for pool in ("per-layer", "shared"):
        (_, cfg), = cache_configs(tr.meta, [0.5], pool)
        for name in ("lru", "fifo", "lfu", "lrfu", "belady", "belady-k"):
            a, b = replay(st, make_policy(name), cfg), replay_kernel(st, make_policy(name), cfg)
            assert b.engine == "kernel"
            assert (a.evictions == b.evictions).all() and a.step_demand == b.step_demand, (pool, name)
            assert a.step_late == b.step_late and sum(a.step_demand) == a.D and a.evictions.sum() > 0
        from expertcast.inference.sim.simulator import run_policy

        fit = tr.sequences[:1]
        s_fast = run_policy(st, make_policy("static", calibration=fit), cfg)
        s_slow = run_policy(st, make_policy("static", calibration=fit), cfg, engine="python")
        assert s_fast.engine == "static" and s_fast.step_demand == s_slow.step_demand
        assert int(s_slow.evictions.sum()) == 0 == int(s_fast.evictions.sum())


def test_card_numbers_are_consistent_and_overlap_refused():
    tr = markov_traces(num_sequences=4, num_tokens=48, num_layers=3, num_experts=8, top_k=2, seed=3)
    fit = markov_traces(num_sequences=3, num_tokens=48, num_layers=3, num_experts=8, top_k=2, seed=4).sequences
    for s in fit:
        s.seq_id = f"fit-{s.seq_id}"
    card = make_card(tr.meta, tr.sequences, CardSettings(capacities=(0.25, 0.5)), fit=fit)
    rows = card["cache"]
    assert {r["policy"] for r in rows} == {"lru", "lfu", "lrfu", "fifo", "static", "belady-k", "belady"}
    for r in rows:
        best = next(x["hit"] for x in rows if (x["pool"], x["capacity"], x["policy"]) ==
                    (r["pool"], r["capacity"], "belady"))
        if r["policy"] != "static":  # static bypasses: not bounded by Belady
            assert r["hit"] <= best + 1e-12
        assert 0 <= r["no_miss_share"] <= 1
        assert r["misses_per_token"] == pytest.approx(r["exposed_per_token"])  # demand-only: every miss exposed
        if r["policy"] == "belady" and not math.isnan(r["gap_closed"]):
            assert r["gap_closed"] == 1.0
    assert {r["predictor"] for r in card["recall"]} == {"repeat-last", "frequency", "transition", "recent-freq",
                                                         "recent-count", "cross-layer", "cross-x-recent"}
    h = card["header"]
    assert h["lifecycle"] == "cold" and h["prefill_counted"] is False and h["shape"] == {"L": 3, "E": 8, "K": 2}
    assert h["link_model"]["transfer_ms"] == pytest.approx(CostConfig().transfer_ms(tr.meta.expert_bytes))
    with pytest.raises(OverlapError, match="2 of the 4 evaluated sequences were used to train the fit set"):
        make_card(tr.meta, tr.sequences, fit=tr.sequences[:2])
