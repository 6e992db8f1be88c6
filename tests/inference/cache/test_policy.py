"""Property: protect-rule Belady is an upper bound of every demand-paging policy at every capacity, and
sequential Belady bounds protect-rule Belady.

Belady maximizes the hits of the whole replayed stream, so the bound is checked with every access
counted (warm-up included). On decode-only counts a policy can trade uncounted prefill hits for decode
hits, so tables use the demand-only ceiling instead (tests/inference/policies/test_kernels.py)."""

from __future__ import annotations

import numpy as np
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache.expert_cache import Budget, CacheConfig
from expertcast.inference.policies import make_policy
from expertcast.inference.sim.simulator import build_stream, replay_kernel
from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def cases(draw):
    L = draw(st.integers(1, 2))
    E = draw(st.integers(3, 8))
    K = draw(st.integers(1, min(3, E)))
    T = draw(st.integers(2, 30))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    skew = rng.dirichlet(np.full(E, draw(st.sampled_from([0.2, 1.0, 5.0]))), size=L)
    ids = np.empty((T, L, K), np.int16)
    for t in range(T):
        for layer in range(L):
            ids[t, layer] = rng.choice(E, K, replace=False, p=skew[layer])
    prompt = draw(st.integers(0, T - 1))
    pool = draw(st.sampled_from(["per-layer", "shared"]))
    hi = E if pool == "per-layer" else L * E
    slots = draw(st.integers(K, hi))
    batch = draw(st.integers(1, 2))
    lam = draw(st.floats(0.0, 1.0))
    k = draw(st.integers(0, 6))
    meta = TraceMeta("prop", L, E, K, expert_bytes=1)
    seqs = [TraceSequence(f"s{i}", np.zeros(T, np.int32), prompt, ids, np.ones(ids.shape, np.float16))
            for i in range(batch)]
    if batch == 2:  # a second, shifted sequence so that batch unions differ from single selections
        seqs[1] = TraceSequence("s1", np.zeros(T, np.int32), prompt, np.roll(ids, 1, axis=0), seqs[1].expert_weights)
    return meta, seqs, pool, slots, lam, k


@settings(max_examples=80, deadline=None)
@given(cases())
def test_belady_bounds_every_demand_policy(case):
    meta, seqs, pool, slots, lam, k = case
    stream = build_stream(meta, seqs, batch_size=1)
    stream.step_counted[:] = True  # count the warm-up too: Belady's objective is the whole stream
    cfg = CacheConfig(meta.num_layers, meta.num_experts, meta.top_k, pool=pool, budget=Budget.slots(slots))
    bel = replay_kernel(stream, make_policy("belady"), cfg).hits.sum()
    for name, kw in [("lru", {}), ("fifo", {}), ("lfu", {}), ("lfu", {"history": "in-cache"}),
                     ("lrfu", {"lam": lam}), ("belady-k", {"k": k})]:
        assert replay_kernel(stream, make_policy(name, **kw), cfg).hits.sum() <= bel, (name, kw)
    assert replay_kernel(stream, make_policy("belady-seq"), cfg).hits.sum() >= bel
