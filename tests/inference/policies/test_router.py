"""Router cache policies (Algorithms 1 and 2, spatio-only) replayed by the simulator on hand-worked traces."""

from __future__ import annotations

import numpy as np
import pytest
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache.expert_cache import Budget, CacheConfig
from expertcast.inference.policies import make_policy
from expertcast.inference.policies.router import (
    RouterRecord,
    RouterReplay,
)
from expertcast.inference.sim.simulator import build_stream, replay, simulate

# one MoE layer, E = 4, K = 1, B = 2; prompt = position 0, decode = positions 1..5
ROUTE = [0, 1, 2, 0, 1, 0]
E = 4


def _onehot(i: int) -> np.ndarray:
    v = np.zeros(E, np.float32)
    v[i] = 1.0
    return v


def _trace(seq_id: str = "s0"):
    T = len(ROUTE)
    meta = TraceMeta(model_id="hand", num_layers=1, num_experts=E, top_k=1, expert_bytes=1_000_000)
    seq = TraceSequence(seq_id, np.zeros(T, np.int32), 1, np.array(ROUTE, np.int16).reshape(T, 1, 1),
                        np.ones((T, 1, 1), np.float16))
    return meta, seq


def _record(p_S_kind: str = "next") -> RouterRecord:
    """p^R = 0.6 on the routed expert + 0.1 elsewhere; p^T = one-hot of the next token's expert (a perfect
    Temporal router); p^S = one-hot of the next position's expert (L = 1: the next position is the next
    token's layer 0) or uniform."""
    T = len(ROUTE)
    p_R = np.stack([np.full(E, 0.1, np.float32) + 0.5 * _onehot(e) for e in ROUTE])
    p_T = np.stack([_onehot(ROUTE[min(t + 1, T - 1)]) for t in range(T)])
    if p_S_kind == "next":
        p_S = p_T.copy()
    else:
        p_S = np.full((T, E), 0.25, np.float32)
    f = lambda a: a.reshape(T, 1, E).astype(np.float16)  # noqa: E731
    return RouterRecord(f(p_R), f(p_T), f(p_S))


def _run(policy, seqs=None, batch_size=1, B=2):
    meta, seq = _trace()
    seqs = seqs or [seq]
    cfg = CacheConfig(num_layers=1, num_experts=E, top_k=1, budget=Budget.slots(B), expert_bytes=meta.expert_bytes)
    return replay(build_stream(meta, seqs, batch_size), policy, cfg)


def test_lru_reference():
    res = _run(make_policy("lru"))
    assert (res.A, res.D, res.P) == (5, 4, 0)  # hand-worked: only the last access hits


def test_temporal_retention_algorithm1():
    """Misses at positions 1, 2, 4; at 2 the retention keeps expert 0 (needed next) and evicts 1."""
    pol = make_policy("router-temporal", replay=RouterReplay({"s0": _record()}))
    res = _run(pol)
    assert (res.A, res.D, res.P) == (5, 3, 0)
    assert res.hit == pytest.approx(0.4)
    assert res.resident == {(0, 0), (0, 1)}


def test_full_pre_access_algorithm2():
    """s^ST puts 2.1 on the true expert: every decode access is covered by one proactive load
    (positions 1-4), each replacing the lowest-priority resident; position 5 is already resident."""
    pol = make_policy("router-full", replay=RouterReplay({"s0": _record()}, mode="full"), R=1)
    res = _run(pol)
    assert (res.A, res.D, res.P) == (5, 0, 4)
    assert res.hit == pytest.approx(1.0)
    assert res.adj_hit == pytest.approx(5 / 9)
    assert res.mb_per_token == pytest.approx(4 * 1.0 / 5)


def test_spatio_only_with_uninformative_spatio_router_is_lru():
    """Uniform p^S: the top candidate is the previous token's expert, always resident, so nothing is
    prefetched and the LRU retention gives LRU's counts; an informative p^S prefetches."""
    res = _run(make_policy("router-spatio", replay=RouterReplay({"s0": _record("uniform")}), R=1))
    assert (res.A, res.D, res.P) == (5, 4, 0)
    res2 = _run(make_policy("router-spatio", replay=RouterReplay({"s0": _record("next")}), R=1))
    assert res2.D == 0 and res2.P == 4


def test_candidate_must_beat_lowest_resident():
    """A non-resident candidate whose score is not higher than every resident's is not loaded."""
    rec = _record()
    rec.p_S[:] = 0.0  # s^ST = p^R_{t-1} + p^T_{t-1}: next expert at 1.1, previous at 0.6, others 0.1
    rec.p_R[:] = 0.25  # flat native router: the next expert (1.25) still beats residents at 0.25
    res = _run(make_policy("router-full", replay=RouterReplay({"s0": rec}), R=1))
    assert res.D == 0
    rec.p_T[:] = 0.0  # now every score ties at 0.25: no candidate is higher than a resident
    res = _run(make_policy("router-full", replay=RouterReplay({"s0": rec}), R=2))
    assert res.P == 1  # only the free slot after prefill is filled; no tie ever replaces a resident
    assert res.D >= 2


def test_batched_replay_and_replay_roundtrip(tmp_path):
    meta, a = _trace("a")
    _, b = _trace("b")
    rp = RouterReplay({"a": _record(), "b": _record()}, mode="full")
    rp.save(tmp_path / "rp")
    loaded = RouterReplay.load(tmp_path / "rp")
    assert np.array_equal(loaded["a"].p_S, rp["a"].p_S)
    res = _run(make_policy("router-full", replay=tmp_path / "rp", R=1), seqs=[a, b], batch_size=2)
    assert res.D == 0  # both members route identically, so the batch mean is the same priority
    recs = simulate((meta, [a, b]), [make_policy("router-temporal", replay=rp), "lru"],
                    capacities=None, slots_per_layer=[2], progress=False)
    # the cache persists from a to b: b adds 3 hits out of 5 for router-temporal, 2 for LRU
    assert recs[0]["hit"] == pytest.approx(0.5) and recs[1]["hit"] == pytest.approx(0.3)


def test_clear_errors():
    with pytest.raises(ValueError, match="needs the routers' recorded outputs"):
        _run(make_policy("router-temporal"))
    with pytest.raises(KeyError, match="no router outputs recorded"):
        _run(make_policy("router-temporal", replay=RouterReplay({"other": _record()})))
    with pytest.raises(ValueError, match="R <= B"):
        _run(make_policy("router-full", replay=RouterReplay({"s0": _record()}), R=3))
    bad = _record()
    bad.p_T = None
    with pytest.raises(ValueError, match="needs Temporal-router outputs"):
        _run(make_policy("router-full", replay=RouterReplay({"s0": bad})))
    with pytest.raises(ValueError, match="recorded on another model"):
        _run(make_policy("router-temporal", replay=RouterReplay({"s0": RouterRecord(np.zeros((6, 2, E), np.float16))})))
    meta, seq = _trace()
    shared = CacheConfig(num_layers=1, num_experts=E, top_k=1, budget=Budget.slots(2), pool="shared")
    with pytest.raises(ValueError, match="per-layer"):
        replay(build_stream(meta, [seq]), make_policy("router-temporal", replay=RouterReplay({"s0": _record()})), shared)
