"""Cost model: defaults, the serialized link with FIFO/EDF queues, demand priority and late prefetch."""

from __future__ import annotations

import pytest
from expertcast.inference.cache.cost_model import QWEN3_30B_A3B_EXPERT_BYTES, CostConfig, Link


def test_defaults_pcie_and_qwen_expert():
    c = CostConfig()
    assert QWEN3_30B_A3B_EXPERT_BYTES == 9_437_184
    assert c.transfer_ms(QWEN3_30B_A3B_EXPERT_BYTES) == pytest.approx(9.437184 / 25.0)  # 0.377 ms
    assert c.compute_ms(48).shape == (48,)
    assert c.cpu_ms(4) == pytest.approx(0.19 + 4 * 0.01)
    with pytest.raises(ValueError, match="lists 3 layers but the trace has L=4"):
        CostConfig(layer_compute_ms=[1.0, 1.0, 1.0]).compute_ms(4)
    with pytest.raises(ValueError, match="bandwidth"):
        CostConfig(bandwidth_gbps=0)
    with pytest.raises(ValueError, match="queue"):
        CostConfig(queue="lifo")


def _run_queue(queue: str):
    link = Link(transfer_ms=1.0, queue=queue, timeline=[])
    a = link.issue_prefetch(0, 5, 1, now=0.0, deadline=50)
    b = link.issue_prefetch(1, 2, 2, now=0.0, deadline=20)
    c = link.issue_prefetch(2, 3, 3, now=0.5, deadline=30)
    landed = link.advance(10.0)
    return a, b, c, landed


def test_fifo_serializes_in_issue_order():
    a, b, c, landed = _run_queue("fifo")
    assert [(t.start, t.end) for t in (a, b, c)] == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    assert {t.expert for t in landed} == {1, 2, 3}


def test_edf_serializes_by_deadline_among_issued():
    a, b, c, _ = _run_queue("edf")
    # at t=0 only a and b are issued: b (deadline 20) first; at t=1 c (30) beats a (50)
    assert [(t.start, t.end) for t in (b, c, a)] == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]


def test_demand_goes_ahead_of_queued_prefetches_but_not_the_wire():
    link = Link(transfer_ms=1.0)
    p1 = link.issue_prefetch(0, 0, 1, now=0.0, deadline=9)
    p2 = link.issue_prefetch(1, 0, 2, now=0.0, deadline=9)
    assert link.advance(0.5) == []  # p1 on the wire [0, 1], p2 queued
    end = link.demand(1, 7, now=0.5)  # waits for the wire, then jumps p2
    assert end == pytest.approx(2.0)
    assert [t.expert for t in link.advance(2.5)] == [1]  # p2 starts at 2.0, lands at 3.0
    assert (p2.start, p2.end) == (2.0, 3.0)
    assert link.wait_for(p2, 2.5) == pytest.approx(3.0)  # a late prefetch: 0.5 ms left is stall
    assert p1.end == 1.0


def test_late_prefetch_still_queued_is_promoted():
    link = Link(transfer_ms=1.0)
    link.issue_prefetch(0, 0, 1, now=0.0, deadline=9)
    q = link.issue_prefetch(1, 0, 2, now=0.0, deadline=9)
    link.advance(0.2)
    assert link.wait_for(q, 0.2) == pytest.approx(2.0)  # after the one on the wire
