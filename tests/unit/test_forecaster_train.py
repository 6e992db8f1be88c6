"""Forecaster training pieces: losses, split by sequence, windows, schedule; recall vs Bayes-optimal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data.synthetic import ModeMarkovProcess
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.models.forecaster import activation_vector, trigger_sequence
from expertcast.models.forecaster_recall import evaluate, fit_baselines
from expertcast.train.forecaster_data import (
    EpochShuffleSampler,
    ForecasterDataModule,
    ForecastWindows,
    split_sequences,
)
from expertcast.train.forecaster_module import fit_forecaster, kl_loss, ranking_loss, recall_at
from expertcast.utils.provenance import split_of

torch.set_num_threads(1)


def test_ranking_loss_prefers_true_experts_above_the_boundary():
    ids = torch.tensor([[[0, 1]]])
    good = torch.tensor([[[5.0, 4.0, 0.0, -1.0]]])
    bad = torch.tensor([[[0.0, -1.0, 5.0, 4.0]]])
    assert ranking_loss(good, ids, 2) < 0.05 < ranking_loss(bad, ids, 2)
    assert recall_at(good, ids, 2).item() == 1.0 and recall_at(bad, ids, 2).item() == 0.0
    assert recall_at(bad, ids, 4).item() == 1.0


def test_kl_zero_at_target():
    q = torch.tensor([[[0.7, 0.3, 0.0, 0.0]]])
    logits = torch.log(q.clamp_min(1e-12))
    assert kl_loss(logits, q).abs().item() < 1e-5
    assert kl_loss(torch.zeros_like(q), q).item() > 0.1


def _seqs(n: int, T: int = 20, L: int = 2, E: int = 6, K: int = 2, probs: bool = False) -> list[TraceSequence]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        ids = np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(T)]).astype(np.int16)
        w = rng.random((T, L, K)).astype(np.float16)
        rp = rng.dirichlet(np.ones(E), size=(T, L)).astype(np.float16) if probs else None
        out.append(TraceSequence(f"s{i}", np.zeros(T, np.int32), 5, ids, w, rp))
    return out


def test_split_is_by_sequence_and_stable():
    seqs = _seqs(60)
    parts = split_sequences(seqs, seed=3, val_fraction=0.2, test_fraction=0.1)
    ids = [{s.seq_id for s in parts[k]} for k in ("train", "val", "test")]
    assert sum(len(x) for x in ids) == 60 and not (ids[0] & ids[1]) and not (ids[0] & ids[2])
    assert len(ids[1]) > 3 and len(ids[2]) > 1
    # same split whatever the order or subset
    again = split_sequences(list(reversed(seqs[:30])), seed=3, val_fraction=0.2, test_fraction=0.1)
    assert {s.seq_id for s in again["val"]} == {s.seq_id for s in seqs[:30] if s.seq_id in ids[1]}
    # one implementation: the data module splits exactly like expertcast.utils.provenance.split_of
    for k, part in parts.items():
        assert all(split_of(s.seq_id, 0.2, 0.1, seed=3) == k for s in part)


def test_split_is_stable_under_subsetting_and_listed_in_training_info():
    meta = TraceMeta("m", num_layers=2, num_experts=6, top_k=2, expert_bytes=1)
    seqs = _seqs(40)
    full = ForecasterDataModule.from_sequences(meta, seqs, val_fraction=0.25, split_seed=1).training_info()
    sub = ForecasterDataModule.from_sequences(meta, seqs[:15], val_fraction=0.25, split_seed=1,
                                              max_sequences=None).training_info()
    first = {s.seq_id for s in seqs[:15]}
    assert set(sub["train_ids"]) == set(full["train_ids"]) & first
    assert set(sub["val_ids"]) == set(full["val_ids"]) & first
    assert sorted(full["train_ids"] + full["val_ids"]) == sorted(s.seq_id for s in seqs)
    assert full["train_ids"] == sorted(full["train_ids"]) and full["val_ids"]
    assert full["split"] == {"method": "sha256(seed, sequence id)", "seed": 1, "val_fraction": 0.25,
                             "test_fraction": 0.0}
    assert full["trace_fingerprint"] != sub["trace_fingerprint"]


def test_epoch_sampler_is_fixed_by_seed_and_epoch_and_resumes_mid_epoch():
    a, b = EpochShuffleSampler(20, seed=3), EpochShuffleSampler(20, seed=3)
    torch.manual_seed(0)
    e0 = list(a)
    torch.manual_seed(1)  # the global RNG plays no part
    assert list(b) == e0 and sorted(e0) == list(range(20))
    a.set_epoch(1)
    e1 = list(a)
    assert e1 != e0 and sorted(e1) == list(range(20))
    a.resume_at(1, 8)
    assert list(a) == e1[8:] and list(a) == e1  # the skip applies to one pass only
    a.resume_at(0, 8)
    assert list(a) == e1  # a position recorded for another epoch is ignored


@pytest.mark.parametrize("p", [1, 0])
def test_windows_align_inputs_and_targets(p):
    meta = TraceMeta("m", num_layers=2, num_experts=6, top_k=2, expert_bytes=1)
    seqs = _seqs(1, T=20)
    ds = ForecastWindows(seqs, meta, window=8, trigger_layer=p)
    s = seqs[0]
    el = trigger_sequence(activation_vector(torch.from_numpy(s.expert_ids.astype(np.int64)),
                                            torch.from_numpy(s.expert_weights.astype(np.float32)), 6), p)
    n_el = el.shape[0]
    assert sum(int(ds[i]["mask"].sum()) for i in range(len(ds))) == n_el - 1  # every target exactly once
    item = ds[1]
    assert torch.allclose(item["inputs"][0], el[8]) and torch.allclose(item["target_dist"][0], el[9], atol=1e-3)
    assert set(item["target_ids"][0, 0].tolist()) == set(torch.nonzero(el[9, 0]).flatten().tolist())
    assert item["decode"][0] == (9 >= s.prompt_len)


def test_router_probs_become_kl_targets_and_mismatch_is_named():
    meta = TraceMeta("m", num_layers=2, num_experts=6, top_k=2, expert_bytes=1, has_router_probs=True)
    seqs = _seqs(3, probs=True)
    item = ForecastWindows(seqs, meta, window=8)[0]
    rp = torch.from_numpy(seqs[0].router_probs[1].astype(np.float32))
    assert torch.allclose(item["target_dist"][0], rp / rp.sum(-1, keepdim=True), atol=1e-3)
    bad = TraceMeta("m", num_layers=2, num_experts=4, top_k=2, expert_bytes=1)
    with pytest.raises(ValueError, match="outside"):
        ForecasterDataModule.from_sequences(bad, seqs)
    with pytest.raises(ValueError, match="trigger_layer"):
        ForecasterDataModule.from_sequences(meta, seqs, trigger_layer=5)


def test_forecaster_recall_approaches_bayes_optimal():
    """Known Markov process: after a short CPU training the forecaster's held-out recall@K is within 3 points of
    the Bayes-optimal predictor's at horizons 1 and 2 (measured: 0.580 vs 0.591 at h=1, 0.521 vs 0.527 at h=2), and beats every baseline at h=1."""
    proc = ModeMarkovProcess.random(num_modes=6, num_layers=2, num_experts=8, top_k=2, seed=0)
    seqs, modes = proc.sample(240, 64, seed=1)
    module, dm = fit_forecaster(proc.meta(), seqs, epochs=12)
    val = dm.splits["val"]
    vmodes = [modes[int(s.seq_id.rsplit("-", 1)[1])] for s in val]
    tables = evaluate(module.net, val, proc.meta(), fit_baselines(dm.splits["train"], proc.meta(), 1), horizons=2,
                      progress=False)
    got = tables["forecaster"].recall("k")
    for h in (1, 2):
        bayes = proc.bayes_recall(vmodes, h)
        assert got[h - 1] > bayes - 0.03, (h, got, bayes)
        assert got[h - 1] <= bayes + 0.02  # sanity: nothing beats Bayes beyond sampling noise
    for name in ("repeat-last", "frequency", "transition"):
        assert got[0] > tables[name].recall("k")[0] - 0.005, name


def test_direct_heads_approach_bayes_optimal_at_longer_horizons():
    """Multi-horizon training (direct heads, no rollout) on a known Markov process: held-out recall@K within 3
    points of the Bayes-optimal predictor at horizons 1..4 (the process forgets its mode, so h4 is lower)."""
    proc = ModeMarkovProcess.random(num_modes=6, num_layers=2, num_experts=8, top_k=2, seed=0)
    seqs, modes = proc.sample(240, 64, seed=1)
    module, dm = fit_forecaster(proc.meta(), seqs, epochs=12, direct_horizons=4)
    val = dm.splits["val"]
    vmodes = [modes[int(s.seq_id.rsplit("-", 1)[1])] for s in val]
    tables = evaluate(module.net, val, proc.meta(), fit_baselines(dm.splits["train"], proc.meta(), 1), horizons=4,
                      progress=False)
    got = tables["forecaster"].recall("k")
    for h in (1, 2, 3, 4):
        bayes = proc.bayes_recall(vmodes, h)
        assert got[h - 1] > bayes - 0.03, (h, got, bayes)
        assert got[h - 1] <= bayes + 0.02
        assert got[h - 1] > tables["transition"].recall("k")[h - 1] - 0.01, (h, got)


def test_recent_frequency_baseline_follows_the_sequence_and_resets():
    from expertcast.models.forecaster_recall import RecentFrequencyBaseline

    freq = torch.full((2, 6), 1 / 6)
    freq[:, 5] = 0.5  # the training prior favours expert 5
    b = RecentFrequencyBaseline(freq, half_life=4)
    b.reset(1)
    x = torch.zeros(1, 2, 6)
    x[0, :, [1, 2]] = 0.5
    for _ in range(6):
        b.observe(x)
    y = torch.zeros(1, 2, 6)
    y[0, :, [3, 4]] = 0.5
    pred = b.predict(y, 3)
    assert pred.shape == (1, 3, 2, 6)
    top = set(pred[0, 0, 0].topk(4).indices.tolist())
    assert top == {1, 2, 3, 4}  # this sequence's experts, not the prior's favourite
    b.reset(1)
    assert int(b.predict(torch.zeros(1, 2, 6), 1)[0, 0, 0].argmax()) == 5  # fresh sequence: the prior
