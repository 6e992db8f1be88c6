"""Latency model of CPU execution vs transfer."""

from __future__ import annotations

import pytest
from expertcast.inference.cost_model import CostConfig
from expertcast.inference.cpu_exec import LatencyModel


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
