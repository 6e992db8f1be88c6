"""The latency model measured at start-up: :meth:`LatencyModel.measure` fits the CPU line through timed
points, takes the transfer and device times as medians, and raises points to an emulated CPU floor."""

from __future__ import annotations

import time

import pytest
from expertcast.inference.saem.cpu_exec import LatencyModel, fit_cpu_line, median_ms


def _sleeper(ms: float):
    return lambda *_: time.sleep(ms * 1e-3)


def test_measure_fits_the_timed_callables():
    lat, fig = LatencyModel.measure(lambda n: time.sleep((4.0 + 2.0 * n) * 1e-3), _sleeper(12.0), _sleeper(3.0),
                                    token_counts=(1, 2, 4), repeats=3, parallel=True)
    # sleeps last at least as asked (a loaded host adds wake-up latency, mostly to the intercept)
    assert 3.9 <= lat.cpu_expert_ms <= 30.0
    assert lat.cpu_token_ms == pytest.approx(2.0, abs=1.0)
    assert 11.9 <= lat.transfer_ms <= 40.0 and 2.9 <= lat.device_ms <= 30.0
    assert lat.parallel and fig["parallel"]
    assert [p["tokens"] for p in fig["cpu_points"]] == [1, 2, 4]
    assert all(p["cpu_ms"] >= 4.0 + 2.0 * p["tokens"] - 0.1 for p in fig["cpu_points"])
    assert fig["transfer_ms"] == lat.transfer_ms and fig["crossover_tokens"] == lat.crossover_tokens()


def test_emulated_floor_raises_measured_points():
    lat, fig = LatencyModel.measure(lambda n: None, lambda: None, lambda: None, token_counts=(1, 3), repeats=2,
                                    cpu_floor_ms=lambda n: 5.0 * n)
    assert [p["cpu_ms"] for p in fig["cpu_points"]] == [5.0, 15.0]
    assert all(p["measured_ms"] < 5.0 for p in fig["cpu_points"])
    assert lat.cpu_token_ms == pytest.approx(5.0) and lat.cpu_expert_ms == pytest.approx(0.0, abs=1e-9)


def test_fit_line_and_median():
    assert fit_cpu_line([{"tokens": 2, "cpu_ms": 3.0}]) == (3.0, 0.0)  # one token count: all fixed cost
    assert fit_cpu_line([{"tokens": 1, "cpu_ms": 1.0}, {"tokens": 3, "cpu_ms": 0.5}]) == (pytest.approx(1.25), 0.0)
    calls = []
    assert median_ms(lambda: calls.append(1), 4) >= 0.0 and len(calls) == 5  # one warm-up run
