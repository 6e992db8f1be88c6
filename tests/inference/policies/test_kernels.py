"""Exactness of the classic policies and oracles: against libcachesim, hand-worked cases, and the compiled
kernels against the generic Python engine.

The ceiling of belady_fraction: on the decode-only counts every table reports, no
demand-only policy beats it, whatever cache it starts decoding from (warm start, prefill warm-up);
it equals the exhaustive optimum on small streams; and on real routing it bounds the static placement
that protect-rule Belady did not bound.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from expertcast.data.synthetic import markov_traces, random_traces, zipf_traces
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache.expert_cache import Budget, CacheConfig
from expertcast.inference.policies import available_policies, make_policy
from expertcast.inference.policies.router import RouterRecord, RouterReplay
from expertcast.inference.sim.simulator import (
    build_stream,
    replay,
    replay_ceiling,
    replay_kernel,
    run_policy,
    simulate,
)
from hypothesis import given, settings
from hypothesis import strategies as st

lcs = pytest.importorskip("libcachesim")

INT64_MAX = 2**63 - 1


def _req(obj_id: int, vtime: int, next_vtime: int | None = None):
    r = lcs.Request()
    r.obj_id = int(obj_id)
    r.obj_size = 1
    r.clock_time = vtime
    if next_vtime is not None:
        r.next_access_vtime = next_vtime
    return r


def lcs_lru_protect_hits(stream, pool_layers: list[int], capacity: int, E: int) -> int:
    """libcachesim LRU fed the requests of ``pool_layers`` step by step, each step's resident experts
    requested first (router order), then the others: the protect rule in libcachesim's terms."""
    cache = lcs.LRU(capacity)
    hits, vt = 0, 0
    for x in range(stream.num_execs):
        layer = x % stream.num_layers
        if layer not in pool_layers:
            continue
        sel, _ = stream.selection(x)
        ids = [layer * E + int(e) for e in sel]
        counted = bool(stream.step_counted[x // stream.num_layers])
        resident = [i for i in ids if cache.find(_req(i, vt), update_cache=False) is not None]
        others = [i for i in ids if i not in resident]
        for i in resident + others:
            h = cache.get(_req(i, vt))
            vt += 1
            hits += int(h and counted)
    return hits


def lcs_belady_hits(requests: list[int], counted: list[bool], capacity: int) -> int:
    """libcachesim Belady on a flat request list (next access times computed here)."""
    n = len(requests)
    nxt = [INT64_MAX] * n
    seen: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        nxt[i] = seen.get(requests[i], INT64_MAX)
        seen[requests[i]] = i
    cache = lcs.Belady(capacity)
    return sum(int(cache.get(_req(o, i, nxt[i])) and counted[i]) for i, o in enumerate(requests))


def _flat(stream, layers: list[int], E: int) -> tuple[list[int], list[bool]]:
    reqs, counted = [], []
    for x in range(stream.num_execs):
        layer = x % stream.num_layers
        if layer in layers:
            sel, _ = stream.selection(x)
            reqs += [layer * E + int(e) for e in sel]
            counted += [bool(stream.step_counted[x // stream.num_layers])] * len(sel)
    return reqs, counted


TRACES = {
    "random-top1": lambda: random_traces(3, 40, num_layers=3, num_experts=12, top_k=1, prompt_len=5, seed=3),
    "zipf-top1": lambda: zipf_traces(3, 40, num_layers=3, num_experts=12, top_k=1, alpha=1.1, prompt_len=5, seed=4),
    "random-topK": lambda: random_traces(3, 40, num_layers=3, num_experts=12, top_k=3, prompt_len=5, seed=5),
    "zipf-topK": lambda: zipf_traces(3, 40, num_layers=3, num_experts=12, top_k=3, alpha=1.1, prompt_len=5, seed=6),
}


@pytest.mark.parametrize("name", list(TRACES))
@pytest.mark.parametrize("slots", [3, 5, 8])
def test_lru_per_layer_equals_libcachesim(name, slots):
    tr = TRACES[name]()
    m = tr.meta
    stream = build_stream(m, tr.sequences)
    cfg = CacheConfig(m.num_layers, m.num_experts, m.top_k, pool="per-layer", budget=Budget.slots(slots))
    res = replay_kernel(stream, make_policy("lru"), cfg)
    for layer in range(m.num_layers):
        assert res.hits[layer] == lcs_lru_protect_hits(stream, [layer], slots, m.num_experts), (name, layer)
    # and the generic engine agrees
    assert (replay(stream, make_policy("lru"), cfg).hits == res.hits).all()


@pytest.mark.parametrize("name", ["zipf-top1", "zipf-topK"])
def test_lru_shared_pool_equals_libcachesim(name):
    tr = TRACES[name]()
    m = tr.meta
    stream = build_stream(m, tr.sequences)
    slots = 10
    cfg = CacheConfig(m.num_layers, m.num_experts, m.top_k, pool="shared", budget=Budget.slots(slots))
    res = replay_kernel(stream, make_policy("lru"), cfg)
    assert res.hits.sum() == lcs_lru_protect_hits(stream, list(range(m.num_layers)), slots, m.num_experts)


@pytest.mark.parametrize("name", ["random-top1", "zipf-top1"])
@pytest.mark.parametrize("slots", [2, 4, 7])
def test_belady_top1_equals_libcachesim(name, slots):
    tr = TRACES[name]()
    m = tr.meta
    stream = build_stream(m, tr.sequences)
    cfg = CacheConfig(m.num_layers, m.num_experts, 1, pool="per-layer", budget=Budget.slots(slots))
    res = replay_kernel(stream, make_policy("belady"), cfg)
    for layer in range(m.num_layers):
        reqs, counted = _flat(stream, [layer], m.num_experts)
        assert res.hits[layer] == lcs_belady_hits(reqs, counted, slots)
    shared = CacheConfig(m.num_layers, m.num_experts, 1, pool="shared", budget=Budget.slots(slots * 2))
    reqs, counted = _flat(stream, list(range(m.num_layers)), m.num_experts)
    assert replay_kernel(stream, make_policy("belady"), shared).hits.sum() == lcs_belady_hits(reqs, counted, slots * 2)


@pytest.mark.parametrize("name", ["random-topK", "zipf-topK"])
def test_sequential_belady_is_libcachesim_belady_and_looser_than_protect_rule(name):
    tr = TRACES[name]()
    m = tr.meta
    stream = build_stream(m, tr.sequences)
    for slots in (3, 6):
        cfg = CacheConfig(m.num_layers, m.num_experts, m.top_k, budget=Budget.slots(slots))
        seq = replay_kernel(stream, make_policy("belady-seq"), cfg)
        prot = replay_kernel(stream, make_policy("belady"), cfg)
        for layer in range(m.num_layers):
            reqs, counted = _flat(stream, [layer], m.num_experts)
            assert seq.hits[layer] == lcs_belady_hits(reqs, counted, slots)
        assert seq.hits.sum() >= prot.hits.sum()
    # on these traces the looser bound is strictly looser at the smallest capacity
    cfg = CacheConfig(m.num_layers, m.num_experts, m.top_k, budget=Budget.slots(3))
    assert replay_kernel(stream, make_policy("belady-seq"), cfg).hits.sum() > \
        replay_kernel(stream, make_policy("belady"), cfg).hits.sum()


def _one_layer(rows: list[list[int]], E: int = 8, prompt_len: int = 0) -> tuple[TraceMeta, list[TraceSequence]]:
    ids = np.array(rows, np.int16)[:, None, :]
    T, K = ids.shape[0], ids.shape[2]
    meta = TraceMeta("hand", 1, E, K, expert_bytes=1_000_000)
    seq = TraceSequence("s", np.zeros(T, np.int32), prompt_len, ids, np.ones_like(ids, dtype=np.float16))
    return meta, [seq]


def test_lfu_hand_worked_counting_and_ties():
    # one layer, 2 slots, top-1. Stream: a a b c b c a
    # t0 a miss (a:1)  t1 a hit (a:2)  t2 b miss (b:1)  t3 c miss: evict b (count 1 < 2) -> {a, c}
    # t4 b miss: c(1) vs a(2): evict c; perfect history b:2 -> {a:2, b:2}
    # t5 c miss: a(2,last t1) vs b(2,last t4): tie on count -> least recent a goes; c:2 (perfect) -> {b, c}
    # t6 a miss (a:3). Hits: 1.
    a, b, c = 0, 1, 2
    meta, seqs = _one_layer([[a], [a], [b], [c], [b], [c], [a]])
    st = build_stream(meta, seqs)
    cfg = CacheConfig(1, 8, 1, budget=Budget.slots(2))
    for engine in (replay, replay_kernel):
        r = engine(st, make_policy("lfu"), cfg)
        assert int(r.hits.sum()) == 1 and int(r.demand.sum()) == 6
        assert r.resident == {(0, a), (0, c)}
    # in-cache history: at t4 b restarts at 1 -> b:1 vs... t4 evicts c(1) over a(2); b:1.
    # t5 c miss: a(2) vs b(1): evict b -> {a, c}; t6 a hit. Hits: 2.
    for engine in (replay, replay_kernel):
        r = engine(st, make_policy("lfu", history="in-cache"), cfg)
        assert int(r.hits.sum()) == 2
        assert r.resident == {(0, a), (0, c)}


def test_lfu_counts_layer_executions_not_tokens_and_ties_by_recency_within_a_step():
    # top-2, 3 slots: t0 {0,1} t1 {2,0} t2 {3,4}: at t2, counts 0:2, 1:1, 2:1; 3 needs a slot: the
    # count-1 experts tie, 1 (last access t0) is older than 2 (t1) -> evict 1; then 4: count-1 left is 2
    # (3 is protected) -> evict 2. Resident {0, 3, 4}.
    meta, seqs = _one_layer([[0, 1], [2, 0], [3, 4]])
    st = build_stream(meta, seqs)
    for engine in (replay, replay_kernel):
        r = engine(st, make_policy("lfu"), CacheConfig(1, 8, 2, budget=Budget.slots(3)))
        assert r.resident == {(0, 0), (0, 3), (0, 4)}
        assert int(r.hits.sum()) == 1


@pytest.mark.parametrize("pool", ["per-layer", "shared"])
def test_lrfu_spans_lfu_to_lru(pool):
    tr = zipf_traces(3, 50, num_layers=3, num_experts=16, top_k=2, alpha=0.8, seed=11)
    st = build_stream(tr.meta, tr.sequences)
    cfg = CacheConfig(3, 16, 2, pool=pool, budget=Budget.fraction(0.25))
    lru = replay_kernel(st, make_policy("lru"), cfg)
    lfu = replay_kernel(st, make_policy("lfu"), cfg)
    assert lru.hits.sum() != lfu.hits.sum()  # the two ends differ on this trace, so the check has teeth
    l1 = replay_kernel(st, make_policy("lrfu", lam=1.0), cfg)
    l0 = replay_kernel(st, make_policy("lrfu", lam=0.0), cfg)
    assert (l1.hits == lru.hits).all() and l1.resident == lru.resident
    assert (l0.hits == lfu.hits).all() and l0.resident == lfu.resident


def test_belady_k_spans_lru_to_belady():
    tr = markov_traces(2, 60, num_layers=2, num_experts=16, top_k=2, seed=2)
    st = build_stream(tr.meta, tr.sequences)
    for pool in ("per-layer", "shared"):
        cfg = CacheConfig(2, 16, 2, pool=pool, budget=Budget.fraction(0.3))
        lru = replay_kernel(st, make_policy("lru"), cfg).hits
        bel = replay_kernel(st, make_policy("belady"), cfg).hits
        assert (replay_kernel(st, make_policy("belady-k", k=0), cfg).hits == lru).all()
        assert (replay_kernel(st, make_policy("belady-k", k=st.num_steps), cfg).hits == bel).all()
        mid = replay_kernel(st, make_policy("belady-k", k=4), cfg).hits.sum()
        assert lru.sum() <= mid <= bel.sum()


ALL_KERNEL_POLICIES = [("lru", {}), ("fifo", {}), ("lfu", {}), ("lfu", {"history": "in-cache"}),
                       ("lrfu", {"lam": 0.05}), ("lrfu", {"lam": 0.5, "history": "in-cache"}),
                       ("belady", {}), ("belady-k", {"k": 3})]


@pytest.mark.parametrize("pool", ["per-layer", "shared"])
@pytest.mark.parametrize("batch", [1, 3])
def test_kernels_equal_python_engine(pool, batch):
    tr = markov_traces(4, 30, num_layers=3, num_experts=12, top_k=2, prompt_len=6, seed=7)
    # uneven lengths so that sequences finish at different steps of a batch
    tr.sequences[1] = TraceSequence("short", tr.sequences[1].token_ids[:17], 4, tr.sequences[1].expert_ids[:17],
                                    tr.sequences[1].expert_weights[:17])
    st = build_stream(tr.meta, tr.sequences, batch_size=batch)
    # capacity 0.25 of 12 = 3 slots per layer: batch unions of up to 6 experts overflow into temporary slots
    cfg = CacheConfig(3, 12, 2, pool=pool, budget=Budget.fraction(0.25))
    for name, kw in ALL_KERNEL_POLICIES:
        a = replay(st, make_policy(name, **kw), cfg)
        b = replay_kernel(st, make_policy(name, **kw), cfg)
        assert (a.accesses == b.accesses).all()
        assert (a.hits == b.hits).all(), (name, kw)
        assert (a.demand == b.demand).all() and (a.temp == b.temp).all(), (name, kw)
        assert a.resident == b.resident, (name, kw)
        assert a.stall_ms == pytest.approx(b.stall_ms)
    if batch > 1 and pool == "per-layer":
        assert b.temp.sum() > 0  # the overflow path was exercised


def test_registry_lists_importable_and_rejects_unknown():
    names = available_policies()
    for n in ("lru", "lfu", "lrfu", "fifo", "static", "belady", "belady-k", "belady-seq"):
        assert n in names
    with pytest.raises(ValueError, match="unknown policy 'nope'.*available: .*lru"):
        make_policy("nope")
    from expertcast.inference.policies import registry

    for n in ("seqmoe", "stage", "stage-oracle", "router-temporal", "router-full", "router-spatio"):
        assert n in registry()
    with pytest.raises(ValueError, match=r"lrfu option lam=2.0: must be in \[0.0, 1.0\]"):
        make_policy("lrfu", lam=2.0)


KERNEL_DEMAND = [("lru", {}), ("fifo", {}), ("lfu", {}), ("lfu", {"history": "in-cache"}), ("lrfu", {"lam": 0.3}),
                 ("belady", {}), ("belady-k", {"k": 2})]


def _optimum(stream, cfg) -> int:
    """Exhaustive search: after each counted layer-execution, any subset of (held + selected) that fits its
    pool; any start state at each counted segment (decode after uncounted steps). Best total hits."""
    L, E = cfg.num_layers, cfg.num_experts
    total = 0
    for p, cap in enumerate(cfg.pool_capacities.tolist()):
        layers = [la for la in range(L) if cfg.pool_of_layer[la] == p]
        states: dict[frozenset, int] | None = None
        for x in range(stream.num_execs):
            s, layer = divmod(x, L)
            if not stream.step_counted[s] or layer not in layers:
                continue
            if states is None or (layer == layers[0] and (s == 0 or not stream.step_counted[s - 1])):
                base = max(states.values()) if states else 0
                items = {layer_ * E + int(e) for y in range(x, stream.num_execs) if stream.step_counted[y // L]
                         and (layer_ := y % L) in layers for e in stream.selection(y)[0]}
                states = {frozenset(c): base for c in itertools.combinations(sorted(items), min(cap, len(items)))}
            sel = {layer * E + int(e) for e in stream.selection(x)[0]}
            new: dict[frozenset, int] = {}
            for held, v in states.items():
                h = v + len(sel & held)
                union = sorted(held | sel)
                for c in itertools.combinations(union, min(cap, len(union))):
                    if new.get(frozenset(c), -1) < h:
                        new[frozenset(c)] = h
            states = new
        total += max(states.values()) if states else 0
    return total


@st.composite
def cases(draw, small: bool = False):
    L = draw(st.integers(1, 2))
    E = draw(st.integers(3, 5 if small else 8))
    K = draw(st.integers(1, min(2 if small else 3, E)))
    T = draw(st.integers(2, 7 if small else 30))
    n_seq = draw(st.integers(1, 2 if small else 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    skew = rng.dirichlet(np.full(E, draw(st.sampled_from([0.2, 1.0, 5.0]))), size=L)
    seqs = []
    for i in range(n_seq):
        ids = np.array([[rng.choice(E, K, replace=False, p=skew[la]) for la in range(L)] for _ in range(T)], np.int16)
        prompt = draw(st.integers(0, T - 1))
        seqs.append(TraceSequence(f"s{i}", rng.integers(0, 50, T).astype(np.int32), prompt, ids,
                                  np.ones(ids.shape, np.float16)))
    pool = draw(st.sampled_from(["per-layer", "shared"]))
    hi = E if pool == "per-layer" else L * E
    slots = draw(st.integers(K, min(hi, K + 2) if small else hi))
    batch = draw(st.integers(1, 2))
    return TraceMeta("prop", L, E, K, expert_bytes=1), seqs, CacheConfig(L, E, K, pool=pool, budget=Budget.slots(slots)), batch


@settings(max_examples=60, deadline=None)
@given(cases())
def test_no_demand_only_policy_beats_the_ceiling(case):
    """Decode-only counts, each policy from its own post-prefill (and warm-start) cache."""
    meta, seqs, cfg, batch = case
    stream = build_stream(meta, seqs, batch_size=batch)
    ceiling = replay_ceiling(stream, cfg)
    assert ceiling.A == stream.counted_accesses
    for name, kw in KERNEL_DEMAND + [("static", {}), ("static", {"calibration": seqs[:1]})]:
        got = run_policy(stream, make_policy(name, **kw), cfg)
        assert got.A == ceiling.A
        assert got.hits.sum() <= ceiling.hits.sum(), (name, kw)


@settings(max_examples=40, deadline=None)
@given(cases(small=True))
def test_ceiling_is_the_exhaustive_optimum(case):
    meta, seqs, cfg, batch = case
    stream = build_stream(meta, seqs, batch_size=batch)
    assert replay_ceiling(stream, cfg).hits.sum() == _optimum(stream, cfg)


def _granite(data_dir) -> tuple[TraceMeta, list[TraceSequence]]:
    """Real routing: granite-3.0-1b-a400m, 3 prompts, prefill + 64 greedy decode steps (no weights)."""
    d = json.loads((data_dir / "traces" / "granite-3.0-1b-a400m" / "moe_expert_trace.json").read_text())
    seqs = []
    for name, p in d["prompts"].items():
        ids = np.concatenate([np.array(p["prefill"], np.int16), np.array(p["decode"], np.int16)])
        seqs.append(TraceSequence(name, np.zeros(len(ids), np.int32), int(p["prompt_len"]), ids,
                                  np.full(ids.shape, 1.0 / d["top_k"], np.float16)))
    return TraceMeta(d["model"], d["num_layers"], d["num_experts"], d["top_k"], expert_bytes=1), seqs


@pytest.mark.parametrize("pool,batch", [("per-layer", 1), ("per-layer", 3), ("shared", 1)])
def test_real_routing_every_demand_only_policy_under_the_ceiling(data_dir, pool, batch):
    meta, seqs = _granite(data_dir)
    L, E = meta.num_layers, meta.num_experts
    rng = np.random.default_rng(0)
    routers = RouterReplay({s.seq_id: RouterRecord(rng.random((s.num_tokens, L, E)).astype(np.float16),
                                                   rng.random((s.num_tokens, L, E)).astype(np.float16))
                            for s in seqs})
    recs = simulate((meta, seqs), [make_policy(n, **kw) for n, kw in KERNEL_DEMAND + [("static", {})]],
                    [0.25, 0.45], pool=pool, batch_size=batch, progress=False)
    for r in recs:
        assert r["belady_fraction"] <= 1.0, r["policy"]
    stream = build_stream(meta, seqs, batch_size=batch)
    cfg = CacheConfig(L, E, meta.top_k, pool=pool, budget=Budget.fraction(0.45))
    if pool == "per-layer":  # the router policies manage per-layer pools
        rt = replay(stream, make_policy("router-temporal", replay=routers), cfg)
        assert rt.proactive.sum() == 0 and rt.hit <= replay_ceiling(stream, cfg).hit
    if batch == 3:  # the case of the issue: static beats protect-rule Belady on decode-only counts
        static = run_policy(stream, make_policy("static"), cfg)
        assert static.hit > run_policy(stream, make_policy("belady"), cfg).hit
        assert static.hit <= replay_ceiling(stream, cfg).hit
