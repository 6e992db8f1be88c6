"""Simulator: hand-worked metrics (with a prefetching policy), batch formation, static placement,
simulate() records and clear errors on bad input (the `expertcast simulate` command: test_simulate_command.py)."""

from __future__ import annotations

import numpy as np
import pytest
from expertcast.data.synthetic import markov_traces, staged_traces, zipf_traces
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache.cost_model import CostConfig
from expertcast.inference.cache.expert_cache import Budget, CacheConfig
from expertcast.inference.cache.policy import MissAction
from expertcast.inference.policies import make_policy
from expertcast.inference.policies.classic import LRUPolicy
from expertcast.inference.sim.simulator import build_stream, replay, replay_ceiling, replay_static, simulate


class ScriptedPrefetch(LRUPolicy):
    """Test-only prefetcher: after (step, layer) it issues the listed proactive loads; LRU otherwise."""

    demand_only = False

    def __init__(self, script: dict[tuple[int, int], list[tuple[int, int]]], cpu_experts=()):
        self.script = script
        self.cpu_experts = set(cpu_experts)

    def after_layer(self, t, layer, cache):
        return self.script.get((t, layer), [])

    def on_miss(self, t, layer, expert, n_tokens, cache):
        return MissAction.CPU if (layer, expert) in self.cpu_experts else MissAction.LOAD


def trace(rows, prompt_len=0, E=8, seq_id="s", expert_bytes=1_000_000):
    """rows: [T][L][K] expert ids."""
    ids = np.array(rows, np.int16)
    if ids.ndim == 2:
        ids = ids[:, :, None]
    T, L, K = ids.shape
    meta = TraceMeta("hand", L, E, K, expert_bytes=expert_bytes)
    seq = TraceSequence(seq_id, np.arange(T, dtype=np.int32), prompt_len, ids, np.ones(ids.shape, np.float16))
    return meta, seq


COST = CostConfig(bandwidth_gbps=2.0, layer_compute_ms=1.0)  # 1 MB experts: 0.5 ms per transfer


def test_hand_worked_metrics_with_a_late_prefetch():
    # L=1, 2 slots, top-1. t0: 0, t1: 1, t2: 2, t3: 0; prefetch 1 after t0 and 3 after t1.
    # t0 miss 0 [0, .5], compute .5-1.5, prefetch 1 queued at 1.5 (free slot).
    # t1 (1.5) the prefetch has not started: late; promoted [1.5, 2], compute 2-3; prefetch 3 evicts
    #    LRU 0 (1 is newer), queued at 3.
    # t2 (3) miss 2: 3 is Fetch (not evictable) so 1 is evicted; demand [3, 3.5] ahead of the queued
    #    prefetch; compute 3.5-4.5; the prefetch runs [3.5, 4] and lands.
    # t3 (4.5) 0 is gone: miss, evicts 3 (prefetched at clock 2 < 2's access at clock 3); [4.5, 5].
    meta, seq = trace([[0], [1], [2], [0]])
    st = build_stream(meta, [seq])
    pol = ScriptedPrefetch({(0, 0): [(0, 1)], (1, 0): [(0, 3)]})
    r = replay(st, pol, CacheConfig(1, 8, 1, budget=Budget.slots(2), expert_bytes=meta.expert_bytes), COST, record_timeline=True)
    m = r.metrics()
    assert (m["accesses"], m["hits"], m["late_prefetches"], m["demand_misses"], m["proactive_loads"]) == (4, 0, 1, 3, 2)
    assert m["hit"] == pytest.approx(1 - 3 / 4)
    assert m["adj_hit"] == pytest.approx((4 - 3) / (4 + 2))
    assert m["mb_per_token"] == pytest.approx((3 + 2) * 1.0 / 4)
    assert m["stall_ms_per_token"] == pytest.approx(0.5)
    assert m["pct_full_speed"] == pytest.approx(100 * 4 / 6)
    assert r.resident == {(0, 2), (0, 0)}
    ev = [(e.step, e.kind, e.expert, e.start, e.end) for e in r.timeline if e.kind != "compute"]
    assert (0, "prefetch", 1, 1.5, 2.0) in ev and (1, "late", 1, 1.5, 2.0) in ev
    assert (2, "demand", 2, 3.0, 3.5) in ev and (1, "prefetch", 3, 3.5, 4.0) in ev
    assert (3, "demand", 0, 4.5, 5.0) in ev


def test_hand_worked_timely_prefetch_overlaps_compute():
    # L=2, 1 slot per layer. t0: (L0: 0, L1: 0), t1: (L0: 1, L1: 0). After (t0, L0) prefetch (0, 1).
    # t0 L0 miss [0, .5], compute .5-1.5; prefetch issued at 1.5 (evicts (0, 0)).
    # t0 L1 (1.5) demand (1, 0) goes first [1.5, 2]; compute 2-3; the prefetch runs [2, 2.5].
    # t1 L0 (3): landed -> hit, no stall. t1 L1: hit.
    meta, seq = trace([[0, 0], [1, 0]], E=4)
    st = build_stream(meta, [seq])
    r = replay(st, ScriptedPrefetch({(0, 0): [(0, 1)]}), CacheConfig(2, 4, 1, budget=Budget.slots(1), expert_bytes=meta.expert_bytes),
               COST, record_timeline=True)
    m = r.metrics()
    assert (m["accesses"], m["hits"], m["demand_misses"], m["proactive_loads"], m["late_prefetches"]) == (4, 2, 2, 1, 0)
    assert (m["hit"], m["adj_hit"], m["mb_per_token"]) == pytest.approx((0.5, 2 / 5, 3 * 1.0 / 2))
    assert m["pct_full_speed"] == pytest.approx(80.0)
    got = [(e.step, e.layer, e.kind, e.expert, e.start, e.end) for e in r.timeline]
    assert got == [
        (0, 0, "demand", 0, 0.0, 0.5), (0, 0, "stall", -1, 0.0, 0.5), (0, 0, "compute", -1, 0.5, 1.5),
        (0, 1, "demand", 0, 1.5, 2.0), (0, 1, "stall", -1, 1.5, 2.0), (0, 1, "compute", -1, 2.0, 3.0),
        (0, 0, "prefetch", 1, 2.0, 2.5),
        (1, 0, "compute", -1, 3.0, 4.0), (1, 1, "compute", -1, 4.0, 5.0),
    ]


class RoutedPrefetch(LRUPolicy):
    """Test-only prefetcher: once (step, layer) is routed (driver step 4b) it issues the listed loads."""

    demand_only = False

    def __init__(self, script):
        self.script = script

    def after_routing(self, t, layer, selected, counts, cache):
        return self.script.get((t, layer), [])


def test_a_load_issued_once_the_layer_is_routed_uses_that_layers_compute():
    # L=2, 1 slot per layer; t0 (L0: 0, L1: 0), t1 (L0: 0, L1: 1). Once (t0, L0) is routed: load (1, 1) for t1.
    # t0 L0 miss 0 [0, .5]; the load queues behind it, runs [.5, 1] beside L0's compute (.5-1.5) and lands;
    # t0 L1 (1.5): (1, 1) waits for t1 (Compute, not evictable): 0 goes to the temporary slot.
    # Issued after the layer instead (step 8, at 1.5), the same load runs behind L1's demand: [2, 2.5].
    meta, seq = trace([[0, 0], [0, 1]], E=4)
    st = build_stream(meta, [seq])
    cfg = CacheConfig(2, 4, 1, budget=Budget.slots(1), expert_bytes=meta.expert_bytes)
    r = replay(st, RoutedPrefetch({(0, 0): [(1, 1, 3)]}), cfg, COST, record_timeline=True)
    ev = [(e.step, e.layer, e.kind, e.expert, e.start, e.end) for e in r.timeline]
    assert (0, 1, "prefetch", 1, 0.5, 1.0) in ev
    m = r.metrics()
    assert (m["proactive_loads"], m["late_prefetches"], m["prefetches_used"]) == (1, 0, 1)
    r8 = replay(st, ScriptedPrefetch({(0, 0): [(1, 1, 3)]}), cfg, COST, record_timeline=True)
    assert (0, 1, "prefetch", 1, 2.0, 2.5) in [(e.step, e.layer, e.kind, e.expert, e.start, e.end) for e in r8.timeline]


def test_a_load_issued_once_the_layer_is_routed_never_evicts_that_layers_selection():
    # shared pool of 2 slots, L=2: t0 (L0: 0, L1: 0) fills it; t1 L0 routes 0 again (a hit, least recent) and
    # asks for (1, 3): LRU would take (0, 0), which L0 is about to compute; the driver protects it, (1, 0) goes.
    meta, seq = trace([[0, 0], [0, 3]], E=4)
    st = build_stream(meta, [seq])
    cfg = CacheConfig(2, 4, 1, pool="shared", budget=Budget.slots(2), expert_bytes=meta.expert_bytes)
    r = replay(st, RoutedPrefetch({(1, 0): [(1, 3)]}), cfg, COST)
    assert r.resident == {(0, 0), (1, 3)}
    m = r.metrics()
    assert (m["hits"], m["proactive_loads"]) == (2, 1)


def test_hand_worked_prefetch_counters_used_late_precision():
    # L=1, 2 slots, top-1, prompt 1 (t0 uncounted). Accesses 0 | 1 3 1 5 0; prefetch 1 after t0 (uncounted),
    # 3 after t1, 5 after t2, 6 after t4 (LRU victims).
    # t0 miss 0 [0, .5], compute .5-1.5; prefetch 1 issued at 1.5, uncounted.
    # t1 (1.5) 1 still queued: late (promoted [1.5, 2]); its load was not counted, so not a counted use. Prefetch 3
    #    at 3 (evicts 0).
    # t2 (3) 3 queued: late, used (promoted [3, 3.5]). Prefetch 5 at 4.5 (evicts 1).
    # t3 (4.5) 1 gone: demand [4.5, 5], evicts 3 (5 is Fetch); 5 runs [5, 5.5].
    # t4 (6) 5 landed: on-time hit, used. Prefetch 6 at 7 (evicts 1).
    # t5 (7) 0: demand, evicts 5 (6 is Fetch); 6 lands unused.
    meta, seq = trace([[0], [1], [3], [1], [5], [0]], prompt_len=1)
    pol = ScriptedPrefetch({(0, 0): [(0, 1)], (1, 0): [(0, 3)], (2, 0): [(0, 5)], (4, 0): [(0, 6)]})
    r = replay(build_stream(meta, [seq]), pol, CacheConfig(1, 8, 1, budget=Budget.slots(2),
                                                           expert_bytes=meta.expert_bytes), COST)
    m = r.metrics()
    assert (m["accesses"], m["hits"], m["late_prefetches"], m["demand_misses"]) == (5, 1, 2, 2)
    assert (m["proactive_loads"], m["prefetches_used"]) == (3, 2)
    assert m["prefetch_precision"] == pytest.approx(2 / 3)
    assert m["proactive_per_token"] == pytest.approx(3 / 5)
    assert (m["hit"], m["adj_hit"], m["resident_hit"]) == pytest.approx((1 - 2 / 5, (5 - 2) / (5 + 3), 1 / 5))


def test_hand_worked_prefetch_for_a_later_execution_is_kept_until_its_deadline():
    # L=2, 1 slot per layer, top-1. Layer 1 routes 0 | 2 | 1. After (t0, L1) prefetch (1, 1) for layer 1's execution
    # after next (x = 2 * L + 1 = 5), evicting (1, 0); issued at 3, it runs [3, 3.5] during t1 L0's compute and lands
    # at t1 L1 (4), before its next execution. Given as (layer, expert, deadline) it stays Compute there: (1, 2) finds
    # no evictable slot and is served from a temporary one; at t2 L1 it is a hit, a used prefetch. Given as
    # (layer, expert), its deadline is that next execution: (1, 2) evicts it and t2 L1 misses.
    meta, seq = trace([[0, 0], [0, 2], [0, 1]], E=4)
    cfg = CacheConfig(2, 4, 1, budget=Budget.slots(1), expert_bytes=meta.expert_bytes)
    kept = replay(build_stream(meta, [seq]), ScriptedPrefetch({(0, 1): [(1, 1, 5)]}), cfg, COST)
    m = kept.metrics()
    assert (m["accesses"], m["hits"], m["demand_misses"], m["proactive_loads"], m["prefetches_used"]) == (6, 3, 3, 1, 1)
    assert kept.temp.tolist() == [0, 1] and kept.late.sum() == 0
    plain = replay(build_stream(meta, [seq]), ScriptedPrefetch({(0, 1): [(1, 1)]}), cfg, COST)
    m = plain.metrics()
    assert (m["hits"], m["demand_misses"], m["proactive_loads"], m["prefetches_used"]) == (2, 4, 1, 0)
    passed = replay(build_stream(meta, [seq]), ScriptedPrefetch({(0, 1): [(1, 1, 1)]}), cfg, COST)  # a deadline passed:
    assert passed.metrics() == plain.metrics()  # the next execution
    with pytest.raises(ValueError, match="not an execution of layer 1"):
        replay(build_stream(meta, [seq]), ScriptedPrefetch({(0, 1): [(1, 1, 4)]}), cfg, COST)


def test_cpu_execution_cost_and_counts():
    # batch of two sequences both routing layer 0 to expert 3 -> one access with 2 tokens, run on CPU:
    # cpu = 0.3 + 2 * 0.1 = 0.5 ms beside a 0.4 ms layer: 0.1 ms of stall. Not a demand miss.
    m1, s1 = trace([[3]], E=4, seq_id="a")
    _, s2 = trace([[3]], E=4, seq_id="b")
    st = build_stream(m1, [s1, s2], batch_size=2)
    assert st.counts.tolist() == [2]
    cost = CostConfig(bandwidth_gbps=2.0, layer_compute_ms=0.4, cpu_expert_ms=0.3, cpu_token_ms=0.1)
    r = replay(st, ScriptedPrefetch({}, cpu_experts=[(0, 3)]), CacheConfig(1, 4, 1, budget=Budget.slots(1)), cost,
               record_timeline=True)
    m = r.metrics()
    assert (m["cpu_exec"], m["demand_misses"], m["hits"], m["accesses"]) == (1, 0, 0, 1)
    assert r.stall_ms == pytest.approx(0.1)
    assert m["stall_ms_per_token"] == pytest.approx(0.05) and m["stall_ms_per_step"] == pytest.approx(0.1)
    assert [(e.kind, e.start, e.end) for e in r.timeline] == [("cpu", 0.0, 0.5), ("compute", 0.0, 0.4)]


def test_batch_formation_lockstep_and_dropout():
    # A: prompt 1, T=3; B: prompt 2, T=3 (L=1, K=1, distinct experts per position)
    mA, A = trace([[0], [1], [2]], prompt_len=1, seq_id="A")
    _, B = trace([[0], [4], [5]], prompt_len=2, seq_id="B")
    st = build_stream(mA, [A, B], batch_size=2)
    # prefill p0: A0, B0 (union {0}, 2 tokens); p1: B1 -> {4}; decode d0: A1, B2 -> {1, 5}; d1: A2 -> {2}
    sel = [st.selection(x) for x in range(st.num_execs)]
    assert [s[0].tolist() for s in sel] == [[0], [4], [1, 5], [2]]
    assert [s[1].tolist() for s in sel] == [[2], [1], [1, 1], [1]]
    assert st.step_counted.tolist() == [False, False, True, True]
    assert st.step_tokens.tolist() == [2, 1, 2, 1]
    assert st.decoded_tokens == 3


def test_prefill_warms_the_cache_but_is_not_counted():
    # prompt selects 5 then decode selects 5 again: a hit (post-prefill state), prefill miss not counted
    meta, seq = trace([[5], [5], [6]], prompt_len=1)
    st = build_stream(meta, [seq])
    r = replay(st, make_policy("lru"), CacheConfig(1, 8, 1, budget=Budget.slots(2)))
    assert (r.A, int(r.hits.sum()), r.D) == (2, 1, 1)


@pytest.mark.parametrize("miss", ["temp", "cpu"])
def test_static_placement_engines_agree(miss):
    tr = zipf_traces(3, 40, num_layers=2, num_experts=16, top_k=2, seed=1)
    st = build_stream(tr.meta, tr.sequences)
    cfg = CacheConfig(2, 16, 2, budget=Budget.fraction(0.25))
    cal = tr.sequences[:1]
    a = replay(st, make_policy("static", calibration=cal, miss=miss), cfg)
    b = replay_static(st, make_policy("static", calibration=cal, miss=miss), cfg)
    for f in ("accesses", "hits", "demand", "cpu", "temp"):
        assert (getattr(a, f) == getattr(b, f)).all(), f
    assert a.stall_ms == pytest.approx(b.stall_ms)
    assert a.resident == b.resident and len(a.resident) == 8


def test_simulate_records_and_belady_fraction():
    tr = markov_traces(3, 40, num_layers=3, num_experts=16, top_k=2, seed=3)
    recs = simulate(tr, ["lru", "lfu", "belady", "belady-k:k=2"], [0.25, 0.5], progress=False)
    assert len(recs) == 8
    need = {"policy", "capacity", "slots", "hit", "adj_hit", "mb_per_token", "belady_fraction", "demand_misses",
            "proactive_loads", "late_prefetches", "cpu_exec", "stall_ms_per_token", "pct_full_speed", "per_layer_hit"}
    for r in recs:
        assert need <= set(r)
        assert len(r["per_layer_hit"]) == 3
        assert 0 < r["belady_fraction"] <= 1.0 + 1e-12
        assert r["adj_hit"] == pytest.approx(r["hit"])  # demand-only: P = 0
        xfer = tr.meta.expert_bytes / 25e9 * 1e3
        assert r["stall_ms_per_token"] == pytest.approx(r["demand_misses"] * xfer / r["decoded_tokens"])
    bel = [r for r in recs if r["policy"] == "belady"]
    # the fraction's denominator is the demand-only ceiling (replay_ceiling), which protect-rule Belady may not reach
    stream = build_stream(tr.meta, tr.sequences)
    for r, cap in zip(bel, (0.25, 0.5), strict=True):
        cfg = CacheConfig(3, 16, 2, budget=Budget.fraction(cap))
        assert r["belady_hit"] == replay_ceiling(stream, cfg).hit >= r["hit"]
    assert [r["slots"] for r in bel] == [12, 24]
    lru = [r for r in recs if r["policy"] == "lru"]
    assert lru[1]["hit"] > lru[0]["hit"]
    # per-layer budgets, shared pool and batches go through the same API
    recs = simulate(tr, ["lru"], None, slots_per_layer=[2, 4], progress=False)
    assert [r["slots_per_layer"] for r in recs] == [2, 4]
    recs = simulate(tr, ["lru"], [0.25], pool="shared", batch_size=2, progress=False)
    assert recs[0]["pool"] == "shared" and recs[0]["batch_size"] == 2


def test_bad_input_errors():
    with pytest.raises(ValueError, match="below top-K=4"):
        CacheConfig(4, 16, 4, budget=Budget.fraction(0.1))
    with pytest.raises(ValueError, match="below top-K=8"):
        CacheConfig(2, 16, 8, pool="shared", budget=Budget.slots(7))
    with pytest.raises(ValueError, match="unknown policy 'lruu'"):
        simulate(zipf_traces(1, 10), ["lruu"], [0.5], progress=False)
    tr = zipf_traces(1, 10, num_layers=2, num_experts=8, top_k=2)
    st = build_stream(tr.meta, tr.sequences)
    with pytest.raises(ValueError, match="trace has L=2, E=8, K=2 but the cache is configured for L=3"):
        replay(st, make_policy("lru"), CacheConfig(3, 8, 2, budget=Budget.slots(2)))
    bad = TraceMeta("other-model", 2, 4, 2, expert_bytes=1)
    with pytest.raises(ValueError, match="outside \\[0, E=4\\).*trace/model mismatch"):
        build_stream(bad, tr.sequences)
    with pytest.raises(ValueError, match="expert_ids .* do not match"):
        build_stream(TraceMeta("m", 3, 8, 2, expert_bytes=1), tr.sequences)
    with pytest.raises(ValueError, match="engine"):
        simulate(tr, ["belady-seq"], [0.5], engine="python", progress=False)


def test_observe_tokens_and_begin_batch_reach_the_policy():
    tr = staged_traces(2, 20, num_layers=1, num_experts=8, top_k=2, hot=3, seed=0)
    seen = []

    class Spy(LRUPolicy):
        def begin_batch(self, batch):
            seen.append(("batch", [s.seq_id for s in batch]))

        def observe_tokens(self, t, ids):
            seen.append(("tok", t, list(ids)))

    st = build_stream(tr.meta, tr.sequences)
    replay(st, Spy(), CacheConfig(1, 8, 2, budget=Budget.slots(3)))
    s0 = tr.sequences[0]
    assert seen[0] == ("batch", [s0.seq_id])
    assert seen[1] == ("tok", 0, [int(s0.token_ids[1])])  # the token produced by step 0
    assert sum(1 for e in seen if e[0] == "batch") == 2


@pytest.mark.parametrize("name,engine", [("static", "auto"), ("lru", "auto"), ("belady", "auto"), ("lru", "python"),
                                         ("static", "python")])
def test_every_engine_leaves_the_lifecycle_calls_to_the_driver(name, engine, lifecycle_callers):
    """The vectorized placement engine, the compiled kernels and the driver engine alike: reset / set_future /
    warm_start come from the one driver (docs/design.md, "Driver"), never from the simulator itself."""
    tr = zipf_traces(num_sequences=2, num_tokens=20, num_layers=2, num_experts=8, top_k=2, seed=0)
    policy = make_policy(name)
    callers = lifecycle_callers(policy)
    simulate(tr, [policy], [0.5], progress=False, belady_fraction=False, engine=engine)
    assert {h for h, _ in callers} == {"reset", "set_future", "warm_start"}
    assert {m for _, m in callers} == {"expertcast.inference.cache.driver"}, callers


def test_seqmoe_forecast_tables_stream_within_forecast_cache_mb():
    """Precomputed forecasts never hold more than ``forecast_cache_mb`` of tables (one table at least): a budget of
    about two sequences streams the others in as the replay reaches them, with the counters of a replay that holds
    every table (oracle tables: exact), and the learned forecaster's streamed tables equal its all-at-once ones."""
    import torch
    from expertcast.inference.policies.seqmoe import SeqMoEPolicy
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig

    syn = zipf_traces(num_sequences=6, num_tokens=40, num_layers=3, num_experts=8, top_k=2, seed=2)
    per_seq = 40 * 4 * 3 * 8 * 2  # float16 bytes of one sequence's [elements, H=4, L, E] table (at most)
    tiny = 2.5 * per_seq / 2**20

    def run(pol):
        seen = []
        store = pol._store_table

        def watched(key, tab):
            out = store(key, tab)
            seen.append(pol._table_bytes)
            return out

        pol._store_table = watched
        recs = simulate((syn.meta, syn.sequences), [pol], [0.25, 0.5], belady_fraction=False, progress=False)
        return recs, seen

    kw = dict(horizon=4, forecast="oracle", recall=0.8, link_bytes_per_s=1e12)
    full, seen_full = run(make_policy("seqmoe", **kw))
    small, seen_small = run(make_policy("seqmoe", forecast_cache_mb=tiny, **kw))
    for a, b in zip(full, small, strict=True):
        for k in ("hit", "adj_hit", "demand_misses", "proactive_loads", "late_prefetches", "prefetches_used"):
            assert a[k] == b[k], k
    assert max(seen_full) > 4 * per_seq and max(seen_small) <= tiny * 2**20
    assert len(seen_small) > len(seen_full)  # streamed: recomputed for the second capacity

    torch.manual_seed(0)
    model = ExpertForecaster(ForecasterConfig(num_layers=3, num_experts=8, top_k=2, hidden_size=32, head_dim=16,
                                              state_size=8, num_blocks=1, chunk_size=16, direct_horizons=4)).eval()
    pols = [SeqMoEPolicy(SeqMoEPolicy.Options(horizon=4, forecast_cache_mb=mb), forecaster=model) for mb in (64, tiny)]
    for pol in pols:
        simulate((syn.meta, syn.sequences), [pol], [0.25], belady_fraction=False, progress=False)
    assert pols[1]._table_bytes <= tiny * 2**20 < pols[0]._table_bytes
    for key, tab in pols[1]._tables.items():
        assert np.allclose(tab.astype(np.float32), pols[0]._tables[key].astype(np.float32), atol=2e-3)
