"""The synthetic trace generators have the structure they claim (others' tests rely on it)."""

from __future__ import annotations

import numpy as np
import pytest
from expertcast.data.synthetic import (
    StickyRoutingProcess,
    markov_traces,
    random_traces,
    staged_traces,
    zipf_traces,
)
from expertcast.data.trace_stats import trace_stats


def _valid(tr):
    m = tr.meta
    for s in tr.sequences:
        assert s.expert_ids.shape == (s.num_tokens, m.num_layers, m.top_k)
        srt = np.sort(s.expert_ids.reshape(-1, m.top_k), axis=1)
        assert (srt[:, 1:] != srt[:, :-1]).all()  # distinct experts per selection
        w = s.expert_weights.astype(np.float32)
        assert np.allclose(w.sum(-1), 1.0, atol=1e-2) and (np.diff(w, axis=-1) <= 1e-3).all()  # router order


def test_markov_first_expert_follows_the_known_transition_matrix():
    tr = markov_traces(1, 6000, num_layers=1, num_experts=4, top_k=2, stay=0.5, seed=1)
    _valid(tr)
    first = tr.sequences[0].expert_ids[:, 0, 0].astype(int)
    counts = np.zeros((4, 4))
    np.add.at(counts, (first[:-1], first[1:]), 1)
    emp = counts / counts.sum(1, keepdims=True)
    assert np.abs(emp - tr.transition[0]).max() < 0.05


def test_zipf_and_random_popularity():
    z = zipf_traces(1, 3000, num_layers=1, num_experts=8, top_k=1, alpha=1.2, seed=2)
    _valid(z)
    freq = np.bincount(z.sequences[0].expert_ids[:, 0, 0], minlength=8) / 3000
    assert np.abs(freq - z.popularity[0]).max() < 0.03
    r = random_traces(1, 3000, num_layers=1, num_experts=8, top_k=3, seed=3)
    _valid(r)
    freq = np.bincount(r.sequences[0].expert_ids.reshape(-1), minlength=8) / 3000
    assert np.abs(freq - 3 / 8).max() < 0.04


def test_staged_traces_plant_cues_at_stage_boundaries():
    tr = staged_traces(2, 400, num_layers=2, num_experts=16, top_k=2, num_stages=3, hot=3, hot_mass=0.95, seed=4)
    _valid(tr)
    for s, st in zip(tr.sequences, tr.stage_ids, strict=True):
        boundary = np.flatnonzero(np.diff(st) != 0) + 1
        assert len(boundary) > 3
        cues = set(np.flatnonzero(s.token_ids == tr.cue_token).tolist())
        assert set(boundary.tolist()) <= cues and cues <= set(boundary.tolist()) | {0}
        # within a stage, selections sit on that stage's hot experts
        hot = tr.popularity[st, 0] > 0.2  # [T, E]
        on_hot = hot[np.arange(len(st)), s.expert_ids[:, 0, 0]]
        assert on_hot.mean() > 0.85


def _summary(meta, seqs) -> dict:
    rows, _ = trace_stats(meta, seqs)
    return next(r for r in rows if r.get("layer") == "all" and r.get("phase") == "decode")


def test_sticky_process_has_real_routing_statistics():
    """Top-6 of 64: normalised entropy of expert use ~0.99 in aggregate, step overlap ~0.27 (random: 0.094)."""
    proc = StickyRoutingProcess.realistic(num_layers=4, num_experts=64, top_k=6, seed=0)
    seqs = proc.sample(60, 100, seed=1)
    s = _summary(proc.meta(), seqs)
    assert 0.985 <= s["entropy"] <= 0.995, s
    assert 0.24 <= s["overlap"] <= 0.30, s
    # each sequence has favourites (what recent frequency reads), which differ between sequences
    per_seq = [np.bincount(q.expert_ids[:, 0].ravel(), minlength=64) / q.expert_ids[:, 0].size for q in seqs[:10]]
    assert np.mean([_norm_entropy(f) for f in per_seq]) < s["entropy"] - 0.05
    assert all(q.expert_ids.shape == (100, 4, 6) for q in seqs)
    assert all(len(set(row.tolist())) == 6 for q in seqs[:5] for row in q.expert_ids.reshape(-1, 6))


def _norm_entropy(f: np.ndarray) -> float:
    f = f[f > 0]
    return float(-(f * np.log(f)).sum() / np.log(64))


def test_sticky_cross_layer_makes_layer_l_follow_layer_l_minus_1_of_the_same_token():
    from expertcast.data.synthetic import StickyRoutingProcess

    L, E, K = 4, 32, 4
    base = StickyRoutingProcess.realistic(L, E, K, seed=2)
    same = StickyRoutingProcess.realistic(L, E, K, seed=2, cross_layer=0.0)
    a, b = base.sample(6, 30, seed=1), same.sample(6, 30, seed=1)
    assert all(np.array_equal(x.expert_ids, y.expert_ids) for x, y in zip(a, b, strict=True))  # 0: the old process
    cross = StickyRoutingProcess.realistic(L, E, K, seed=2, cross_layer=0.8)
    assert np.array_equal(cross.popularity, base.popularity) and cross.successor.shape == (L, E)

    def follows(proc, seqs):
        """Share of layer-l experts (l >= 1) that are the successor of one of the token's layer l-1 experts."""
        succ = proc.successor if proc.successor is not None else cross.successor
        hit = tot = 0
        for s in seqs:
            ids = s.expert_ids.astype(np.int64)
            for li in range(1, L):
                nxt = succ[li][ids[:, li - 1]]  # [T, K]
                hit += sum(len(set(x) & set(y)) for x, y in zip(ids[:, li].tolist(), nxt.tolist(), strict=True))
                tot += ids.shape[0] * K
        return hit / tot

    seqs = cross.sample(6, 30, seed=1)
    for s in seqs:  # still K distinct experts per position and layer
        assert all(len(set(row)) == K for row in s.expert_ids.reshape(-1, K).tolist())
    assert follows(cross, seqs) > 0.6 and follows(base, a) < 0.25
    again = StickyRoutingProcess.realistic(L, E, K, seed=2, cross_layer=0.8).sample(6, 30, seed=1)
    assert all(np.array_equal(x.expert_ids, y.expert_ids) for x, y in zip(seqs, again, strict=True))
    with pytest.raises(ValueError, match="cross_layer"):
        StickyRoutingProcess.realistic(L, E, K, cross_layer=1.5)


def test_next_step_probabilities_are_the_process_own_step():
    """The Monte Carlo next-step law: K experts per (sequence, layer) in total; with stay 1 every current expert
    stays (probability 1); the preferences are the ones ``sample`` draws (a sequence's favourites are its most used
    experts); cross-layer routing is refused."""
    from expertcast.data.synthetic import StickyRoutingProcess

    L, E, K = 3, 16, 2
    proc = StickyRoutingProcess.realistic(L, E, K, seed=4)
    log_rho = proc.preferences(5, seed=7)
    seqs = proc.sample(5, 400, seed=7)
    rng = np.random.default_rng(0)
    cur = np.stack([s.expert_ids[10].astype(np.int64) for s in seqs])  # [N, L, K]
    p = proc.next_step_probabilities(log_rho, cur, 300, rng)
    assert p.shape == (5, L, E) and np.allclose(p.sum(-1), K)
    always = StickyRoutingProcess(proc.popularity, K, stay=1e6)  # clipped to 1: every expert of S_t stays
    q = always.next_step_probabilities(log_rho, cur, 20, rng)
    assert np.all(np.take_along_axis(q, cur, -1) == 1.0) and np.allclose(q.sum(-1), K)
    # the preferences are sample()'s: each sequence's 4 most used experts (over 400 steps) are among its favourites
    for n, s in enumerate(seqs):
        for li in range(L):
            used = np.bincount(s.expert_ids[:, li].ravel(), minlength=E)
            fav = set(np.argsort(-log_rho[n, li])[:8].tolist())
            assert len(set(np.argsort(-used)[:4].tolist()) & fav) >= 3, (n, li)
    with pytest.raises(ValueError, match="cross_layer 0"):
        StickyRoutingProcess.realistic(L, E, K, seed=4, cross_layer=0.5).next_step_probabilities(log_rho, cur, 2, rng)
