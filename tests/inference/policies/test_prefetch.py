"""Prefetch scheduling: EDF feasibility, optimality of the matroid greedy, expiry, EMA transfer estimate."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from expertcast.inference.policies.prefetch import (
    PrefetchScheduler,
    PrefetchTask,
    TransferEstimator,
    edf_feasible,
    generate_tasks,
    select_feasible,
)


def test_edf_feasibility():
    assert edf_feasible([1, 2, 3], now=0, tau=1)
    assert not edf_feasible([1, 1], now=0, tau=1)
    assert edf_feasible([2, 2], now=0, tau=1)
    assert not edf_feasible([2, 2], now=0, tau=1, backlog=1)
    assert edf_feasible([], now=5, tau=1)


def _brute_best(tasks, now, tau, backlog):
    best = 0.0
    for r in range(len(tasks) + 1):
        for sub in itertools.combinations(tasks, r):
            if edf_feasible([t.deadline for t in sub], now, tau, backlog):
                best = max(best, sum(t.confidence for t in sub))
    return best


def test_greedy_is_optimal_and_feasible():
    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(1, 8))
        tasks = [PrefetchTask(int(i), 0, float(rng.random()), float(rng.integers(1, 6))) for i in range(n)]
        tau = float(rng.choice([0.5, 1.0, 1.5]))
        backlog = float(rng.integers(0, 2))
        kept = select_feasible(tasks, now=0.0, tau=tau, backlog=backlog)
        assert edf_feasible([t.deadline for t in kept], 0.0, tau, backlog)
        assert sum(t.confidence for t in kept) == pytest.approx(_brute_best(tasks, 0.0, tau, backlog)), trial
        assert [t.deadline for t in kept] == sorted(t.deadline for t in kept)  # EDF order


def test_generate_tasks_top_per_layer_skips_resident():
    probs = np.array([[0.9, 0.8, 0.1, 0.05], [0.2, 0.3, 0.6, 0.01]])
    skip = np.zeros_like(probs, dtype=bool)
    skip[0, 0] = True
    tasks = generate_tasks(probs, np.array([10.0, 11.0]), skip, max_per_layer=2, min_confidence=0.15)
    got = {(t.layer, t.expert): (t.confidence, t.deadline) for t in tasks}
    assert got == {(0, 1): (0.8, 10.0), (1, 2): (0.6, 11.0), (1, 1): (0.3, 11.0)}


def test_scheduler_expires_and_drops_lowest_confidence():
    sch = PrefetchScheduler(TransferEstimator(tau=1.0), lookahead=10)
    sch.submit([PrefetchTask(0, 0, 0.9, 2.0), PrefetchTask(0, 1, 0.2, 2.0), PrefetchTask(0, 2, 0.5, 2.0),
                PrefetchTask(1, 0, 0.7, 0.5)])
    sch.expire(now=1.0)  # (1, 0) expired
    assert (1, 0) not in sch.tasks and sch.dropped == 1
    out = sch.next_transfers(now=0.0)  # two unit transfers fit before deadline 2: lowest confidence dropped
    assert [t.key for t in out] == [(0, 0), (0, 2)]
    assert sch.dropped == 2 and not sch.tasks


def test_scheduler_paces_by_lookahead():
    sch = PrefetchScheduler(TransferEstimator(tau=1.0), lookahead=2.0)
    sch.submit([PrefetchTask(0, e, 0.5 + e / 10, 10.0) for e in range(4)])
    first = sch.next_transfers(now=0.0, backlog=0)
    assert len(first) == 2 and first[0].confidence >= first[1].confidence
    assert len(sch.tasks) == 2  # the rest stay for later
    assert sch.next_transfers(now=0.0, backlog=2) == []


def test_ema_tracks_link_rate():
    est = TransferEstimator(tau=1.0, alpha=0.5)
    for _ in range(20):
        est.observe_window(landed=4, span=1.0)
    assert est.tau == pytest.approx(0.25, rel=1e-3)
    est.observe_duration(2.0)
    assert est.tau > 0.25
    with pytest.raises(ValueError):
        TransferEstimator(tau=0)
