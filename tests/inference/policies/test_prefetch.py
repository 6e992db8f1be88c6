"""Prefetch scheduling: EDF feasibility, optimality of the matroid greedy, expiry, EMA transfer estimate, the
headroom rule (hand-worked counts)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from expertcast.inference.policies.prefetch import (
    PrefetchScheduler,
    PrefetchTask,
    SparedMissCalibration,
    TransferEstimator,
    demand_probability,
    displaced_scores,
    edf_feasible,
    execution_rows,
    generate_tasks,
    headroom_may_issue,
    plan_within_headroom,
    pool_victims,
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


def test_estimate_never_reads_faster_than_the_links_own_transfer_time():
    """Window samples may slow the estimate (a contended link), never speed it past ``min_tau`` (seqmoe: the link's
    declared transfer time), which a transfer finishing in a demand stall would otherwise do."""
    est = TransferEstimator(tau=0.4, alpha=0.5, min_tau=0.4)
    for _ in range(20):
        est.observe_window(landed=4, span=1.0)  # 4 per window: 0.25 < 0.4
    assert est.tau == pytest.approx(0.4)
    for _ in range(20):
        est.observe_window(landed=1, span=1.0)  # slower than declared: followed
    assert est.tau == pytest.approx(1.0, rel=1e-3)


# ---------------------------------------------------------------------------------------------- headroom rule
# L=3, E=4; the next execution to start is x=1 (layer 1), so the deadlines are layer 1 -> 1, layer 2 -> 2,
# layer 0 -> 3. Every layer computes 1 ms (the link's free window), a transfer takes 0.4 ms, slots are free.
_Q = np.array([[0.9, 0.7, 0.2, 0.1],
               [0.8, 0.6, 0.1, 0.0],
               [0.5, 0.4, 0.3, 0.0]])
_DL = np.array([3, 1, 2])


def _plan(backlog=0, victims=None, compute=1.0, transfer=0.4):
    vic = victims if victims is not None else [np.zeros(2)] * 3
    return plan_within_headroom(_Q, _DL, None, np.arange(3), vic, now=1, compute_ms=np.full(3, compute),
                                transfer_ms=transfer, backlog=backlog, max_per_layer=2)


def test_demand_probability_is_one_minus_all_hit():
    rho = demand_probability(_Q, np.array([[True, False, False, False]] * 3))
    assert rho == pytest.approx([1 - 0.3 * 0.8 * 0.9, 1 - 0.4 * 0.9, 1 - 0.6 * 0.7])


def test_headroom_rule_fills_the_free_windows_and_prices_the_spill():
    tasks = _plan()
    # layer 1 (deadline 1) starts now: nothing can land before it. Layer 2's two loads fit window 1 (0.8 of 1 ms):
    # free, gain q * 0.4. Layer 0's first load spills 0.2 ms into the start of x=2, delaying its demand loads with
    # rho_2 = 1 - 0.5*0.6*0.7 = 0.79: cost 0.158 < gain 0.36; the second fits window 2: free.
    assert [(t.layer, t.expert, t.deadline) for t in tasks] == [(2, 0, 2), (2, 1, 2), (0, 0, 3), (0, 1, 3)]
    assert [t.confidence for t in tasks] == pytest.approx([0.2, 0.16, 0.36 - 0.79 * 0.2, 0.28])


def test_headroom_rule_issues_nothing_on_a_saturated_link():
    assert _plan(backlog=8) == []  # 8 queued transfers keep the link busy into x=3: no window before any deadline
    assert _plan(compute=0.0) == []  # no free window at all: every load delays a likely demand load by more than its gain
    assert len(_plan(backlog=2)) == 2  # window 1 is taken: layer 2 (deadline 2) gets nothing, layer 0 two loads


def test_headroom_rule_weighs_the_displaced_resident():
    likely = [np.array([0.95, 0.95])] * 3  # full pools of residents more likely needed than any load
    assert _plan(victims=likely) == []
    one_free = [np.array([0.0])] * 3  # one free slot per layer, then nothing to evict
    assert [(t.layer, t.expert) for t in _plan(victims=one_free)] == [(2, 0), (0, 0)]


def test_headroom_rule_breakeven_floor_drops_loads_that_would_lower_adjhit():
    """``min_net`` (seqmoe ``breakeven=true``: the running AdjHit) keeps only the loads whose expected spared
    misses q - v reach it; the loads it keeps are placed as without the floor."""
    vic = [np.zeros(2)] * 3
    plan = lambda m: plan_within_headroom(_Q, _DL, None, np.arange(3), vic, now=1, compute_ms=np.full(3, 1.0),  # noqa: E731
                                          transfer_ms=0.4, max_per_layer=2, min_net=m)
    assert [(t.layer, t.expert) for t in plan(0.0)] == [(2, 0), (2, 1), (0, 0), (0, 1)]
    assert [(t.layer, t.expert) for t in plan(0.45)] == [(2, 0), (0, 0), (0, 1)]  # q = .4 at layer 2 falls below
    assert [(t.layer, t.expert) for t in plan(0.8)] == [(0, 0)]  # only layer 0's q = .9


def test_pool_victims_displaced_scores_and_execution_rows():
    """The planner's inputs over a cache: per pool, free slots first (v = 0) then the evictable residents in the
    policy's order with their keys (Fetch/Compute slots are not victims); the lowest score a load would displace
    (0 with a free slot); the rows of the next execution and, with two, the one after at P2 x (1 - P1)."""
    from expertcast.inference.cache.expert_cache import Budget, CacheConfig, ExpertCache, SlotState

    cache = ExpertCache(CacheConfig(num_layers=2, num_experts=4, top_k=1, budget=Budget.slots(3)))
    for e, st in ((0, SlotState.USED), (1, SlotState.USED), (2, SlotState.FETCH)):  # layer 0: full
        cache.assign(cache.take_free_slot(0), 0, e, st)
    cache.assign(cache.take_free_slot(1), 1, 3, SlotState.USED)  # layer 1: two free slots
    value = np.arange(8, dtype=np.float64).reshape(2, 4) / 10
    score = np.array([[0.9, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.7]])
    by_score = lambda cl, ce: np.argsort(score[cl, ce], kind="stable")  # noqa: E731
    victims, keys = pool_victims(cache, value, by_score)
    assert [v.tolist() for v in victims] == [[0.1, 0.0], [0.0, 0.0, 0.7]]
    assert [k.tolist() for k in keys] == [[[0, 1], [0, 0]], [[-1, -1], [-1, -1], [1, 3]]]
    assert displaced_scores(cache, lambda cl, ce: score[cl, ce]).tolist() == [0.2, 0.0]
    p1, p2, skip = np.full((2, 4), 0.5), np.full((2, 4), 0.4), np.zeros((2, 4), bool)
    probs, execs, mask = execution_rows(p1, np.array([5, 2]), skip, p2, executions=2)
    assert probs.shape == (4, 4) and np.allclose(probs[2:], 0.2) and execs.tolist() == [5, 2, 7, 4]
    assert mask.shape == (4, 4)
    assert execution_rows(p1, np.array([5, 2]), skip, p2, executions=1)[0] is p1


# ---------------------------------------------------------------------------------------------- calibration
def test_spared_miss_calibration_scores_loads_and_victims_as_the_routing_arrives():
    cal = SparedMissCalibration(half_life=0.0)
    cal.expect(5, 3, 0.5)
    assert cal.scale == 1.0 and not cal._due  # off: no bookkeeping
    cal = SparedMissCalibration(half_life=1e9)
    assert cal.scale == 1.0  # no evidence: the prior's ratio
    cal.expect(5, 3, 0.6, victim=(5, 7))  # used, victim not needed: +1
    cal.expect(5, 4, 0.6, victim=(9, 2))  # loaded but demand missed anyway (evicted before use): 0; victim missed: -1
    cal.expect(6, 1, 0.6)  # its execution never reports (the sequence ended): no outcome
    cal.resolve(5, np.array([3, 4, 7]), missed=[4])
    assert (cal.realised, cal.expected, cal.resolved) == (1.0, pytest.approx(1.2), 2)
    cal.resolve(9, np.array([2]), missed=[2])
    assert cal.realised == 0.0 and not cal._due
    assert cal.scale == pytest.approx(4.0 / 5.2)


def test_spared_miss_calibration_withdraws_trust_from_an_overconfident_forecast_and_decays_back():
    cal = SparedMissCalibration(half_life=16.0)
    for x in range(40):  # forecasts that promise 0.8 spared misses per load and deliver none
        cal.expect(x, 0, 0.8)
        cal.resolve(x, np.array([1]), missed=[1])
        cal.step()
    low = cal.scale
    assert low < 0.25
    for _ in range(120):  # no loads: the evidence decays and the prior lets loads be tried again
        cal.step()
    assert low < cal.scale and cal.scale > 0.95


def test_headroom_rule_net_scale_shrinks_every_expected_gain_and_caps_it_at_one_miss():
    vic = [np.zeros(2)] * 3
    plan = lambda m, s: plan_within_headroom(_Q, _DL, None, np.arange(3), vic, now=1,  # noqa: E731
                                             compute_ms=np.full(3, 1.0), transfer_ms=0.4, max_per_layer=2,
                                             min_net=m, net_scale=s)
    assert [(t.layer, t.expert) for t in plan(0.45, 0.5)] == [(0, 0)]  # .5 * .9 reaches .45, nothing else does
    assert plan(0.45, 0.0) == []
    capped = plan(0.0, 10.0)
    assert [t.confidence for t in capped][:2] == pytest.approx([0.4, 0.4])  # gain = min(10 q, 1) * 0.4 ms


def test_headroom_rule_says_which_victim_slot_each_load_takes():
    one_free_then_residents = [np.array([0.0, 0.1, 0.2])] * 3
    tasks = _plan(victims=one_free_then_residents)
    by_pool = {}
    for t in tasks:
        by_pool.setdefault(t.layer, []).append(t.victim)
    assert by_pool and all(v == list(range(len(v))) for v in by_pool.values())  # in eviction order, per pool


def test_headroom_precondition_is_exact_where_it_says_no_load_can_pass():
    """``headroom_may_issue`` lets seqmoe skip ranking its victims: wherever it says no, the headroom rule issues
    nothing at any victims, link state and windows; and it says yes where a load does pass (free slots, an idle link),
    the bound ``net_scale * q >= min_net`` included at equality."""
    rng = np.random.default_rng(3)
    said_no = issued = 0
    for _ in range(400):
        R, E = int(rng.integers(1, 7)), int(rng.integers(2, 9))
        probs = rng.random((R, E)) ** rng.uniform(0.5, 4.0)
        skip = rng.random((R, E)) < rng.uniform(0.0, 1.0)
        scale = rng.uniform(0.0, 2.0, R) * (rng.random(R) > 0.2)
        min_net = float(rng.choice([0.0, rng.uniform(0.0, 1.0)]))
        may = headroom_may_issue(probs, skip, scale, min_net)
        for _ in range(3):
            victims = [rng.random(int(rng.integers(0, 4))) * rng.choice([0.0, 1.0])]
            tasks = plan_within_headroom(probs, np.arange(1, R + 1), skip, np.zeros(R, np.int64), victims, 0,
                                         rng.uniform(0.0, 2.0, R), float(rng.uniform(0.05, 1.0)),
                                         int(rng.integers(0, 3)), 2, min_net=min_net, net_scale=scale)
            issued += bool(tasks)
            if not may:
                said_no += 1
                assert tasks == []
        if may:  # an idle link with long windows and free slots: the best load passes
            free = [np.zeros(2 * R * E)]
            assert plan_within_headroom(probs, np.arange(1, R + 1), skip, np.zeros(R, np.int64), free, 0,
                                        np.full(R, 100.0), 0.1, 0, 1, min_net=min_net, net_scale=scale)
    assert said_no > 100 and issued > 100
    edge = np.array([[0.5, 0.25]])
    assert headroom_may_issue(edge, None, 1.0, 0.5) and not headroom_may_issue(edge, None, 1.0, 0.51)
    assert not headroom_may_issue(edge, np.array([[True, False]]), 1.0, 0.5)
    assert not headroom_may_issue(edge, None, 0.0, 0.0)
