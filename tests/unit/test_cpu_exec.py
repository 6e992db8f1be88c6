"""Latency model of CPU execution vs transfer."""

from __future__ import annotations

import pytest
from expertcast.inference.cache.cost_model import CostConfig
from expertcast.inference.saem.cpu_exec import LatencyModel


def test_decision_and_crossover():
    m = LatencyModel(transfer_ms=0.4, cpu_expert_ms=0.19, cpu_token_ms=0.01)
    assert m.crossover_tokens() == 20  # 0.19 + 20*0.01 = 0.39 < 0.4; 21 tokens cost 0.40
    assert m.prefer_cpu(1) and m.prefer_cpu(20) and not m.prefer_cpu(21)
    assert LatencyModel(0.1, 0.2, 0.0).crossover_tokens() == 0
    with pytest.raises(ValueError, match="at least one"):
        m.prefer_cpu(0)
    with pytest.raises(ValueError, match="positive"):
        LatencyModel(0.0, 0.1, 0.1)


def test_from_cost_matches_cost_model():
    cost = CostConfig(bandwidth_gbps=25.0)
    m = LatencyModel.from_cost(cost, 9_437_184)
    assert m.transfer_ms == pytest.approx(cost.transfer_ms(9_437_184))
    for n in (1, 5, 50):
        assert m.cpu_ms(n) == pytest.approx(cost.cpu_ms(n))
        assert m.prefer_cpu(n) == (cost.cpu_ms(n) < cost.transfer_ms(9_437_184))


def test_measured_cpu_model_is_fitted_from_real_timings():
    m, pts = LatencyModel.measure_cpu(hidden=64, intermediate=128, transfer_ms=1.0, token_counts=(1, 8, 64),
                                      repeats=5, threads=1)
    assert [p["tokens"] for p in pts] == [1, 8, 64] and all(p["cpu_ms"] > 0 for p in pts)
    assert m.cpu_expert_ms >= 0 and m.cpu_token_ms >= 0
    assert m.cpu_expert_ms + m.cpu_token_ms > 0


def _greedy(m: LatencyModel, tokens: list[int]) -> tuple[list[bool], float]:
    """Decisions for one layer's misses and the layer's end time (parallel mode)."""
    cpu = link = 0.0
    out = []
    for n in tokens:
        c = m.prefer_cpu_queued(n, cpu, link)
        out.append(c)
        if c:
            cpu += m.cpu_ms(n)
        else:
            link += m.transfer_ms
    return out, max(link + m.device_ms, cpu)


def test_queued_split_balances_cpu_and_link():
    m = LatencyModel(transfer_ms=0.4, cpu_expert_ms=0.2, cpu_token_ms=0.0, parallel=True, device_ms=0.15)
    # one miss: the CPU (0.2) ends before transfer + compute (0.55)
    assert m.prefer_cpu_queued(1, 0.0, 0.0)
    # ten misses: each alone is cheaper on the CPU, but the greedy split uses both paths
    dec, end = _greedy(m, [1] * 10)
    assert 0 < sum(dec) < 10
    all_cpu = 10 * 0.2
    all_link = 10 * 0.4 + 0.15
    assert end < min(all_cpu, all_link)
    assert end == pytest.approx(1.4)  # 7 on the CPU (1.4 ms), 3 over the link (1.2 + 0.15 ms)
    # many tokens make the CPU slow: transfer instead (0.2 + 100 * 0.01 > 0.4 + 0.15)
    m2 = LatencyModel(transfer_ms=0.4, cpu_expert_ms=0.2, cpu_token_ms=0.01, parallel=True, device_ms=0.15)
    assert m2.prefer_cpu_queued(30, 0.0, 0.0) and not m2.prefer_cpu_queued(100, 0.0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        m.prefer_cpu_queued(0, 0.0, 0.0)


def test_from_cost_carries_parallel_mode():
    m = LatencyModel.from_cost(CostConfig(cpu_parallel=True, layer_compute_ms=[0.1, 0.3]), 9_437_184)
    assert m.parallel and m.device_ms == pytest.approx(0.2)
    assert not LatencyModel.from_cost(CostConfig(), 9_437_184).parallel
