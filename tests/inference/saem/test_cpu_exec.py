"""Latency model of CPU execution vs transfer.

The latency model measured at start-up: :meth:`LatencyModel.measure` fits the CPU line through timed
points, takes the transfer and device times as medians, and raises points to an emulated CPU floor.

SAEM's CPU execution in the runtime: cold experts run on a host thread in parallel with the device's
work on the layer's other experts, with the same tokens as the full-load model and as the serial
reference; the CPU-vs-transfer choice uses the latency model measured at start-up.
"""

from __future__ import annotations

import time

import pytest
import torch
from expertcast.inference.cache.cost_model import CostConfig
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.saem.cpu_exec import LatencyModel, fit_cpu_line, median_ms
from expertcast.models.presets import build_tiny


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


torch.set_num_threads(1)
NEW = 6


def _prompts(B: int = 2, P: int = 7):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 400, (B, P), generator=g)
    return ids, torch.ones_like(ids)


def _stage(lat: LatencyModel):
    return make_policy("stage", cues="a|e", decoder=lambda i: bytes([int(i) % 256]), latency=lat)


@pytest.mark.parametrize("preset", ["qwen3_moe-tiny", "gpt_oss-tiny"])
def test_parallel_cpu_execution_keeps_full_load_tokens(preset):
    model = build_tiny(preset, seed=0)
    ids, am = _prompts()
    ref = model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    K = model.config.num_experts_per_tok
    counters = {}
    for parallel in (True, False):
        lat = LatencyModel(transfer_ms=1.0, cpu_expert_ms=0.5, cpu_token_ms=0.15)  # CPU for <= 3 tokens
        om = OffloadedModel(model, _stage(lat), K, cpu_parallel=parallel)
        out = om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        assert torch.equal(out.sequences, ref), (preset, parallel)
        counters[parallel] = (om.stats.cpu.sum(), om.stats.demand.sum(), om.stats.A)
        assert om.stats.cpu.sum() > 0
        model = om.restore()
    assert counters[True] == counters[False]  # the same decisions; only the execution overlaps


def test_cpu_experts_run_on_a_host_thread_beside_the_device_experts(monkeypatch):
    """Parallel: while a CPU expert runs on the host thread (emulated 15 ms), the layer's resident experts
    are computed on the calling thread; serial: CPU experts run on the calling thread, one after another."""
    import threading

    from expertcast.inference.runtime import experts

    model = build_tiny("qwen3_moe-tiny", seed=1)
    ids, am = _prompts(B=2)
    K = model.config.num_experts_per_tok
    main = threading.get_ident()
    for parallel in (True, False):
        device_calls: list[float] = []
        cpu_runs: list[tuple[int, float, float]] = []
        mlp, cpu_expert = experts._expert_mlp, OffloadedModel._cpu_expert

        def device_mlp(module, x, w, out, gu, _mlp=mlp, _calls=device_calls):
            if threading.get_ident() == main and x.shape[0] and gu is not None:  # a resident (slot) expert
                _calls.append(time.perf_counter())
            return _mlp(module, x, w, out, gu)

        def host_expert(self, *a, _f=cpu_expert, _runs=cpu_runs):
            t0 = time.perf_counter()
            out = _f(self, *a)
            _runs.append((threading.get_ident(), t0, time.perf_counter()))
            return out

        monkeypatch.setattr(experts, "_expert_mlp", device_mlp)
        monkeypatch.setattr(OffloadedModel, "_cpu_expert", host_expert)
        lat = LatencyModel(transfer_ms=100.0, cpu_expert_ms=1.0, cpu_token_ms=0.0)  # every miss on the CPU
        om = OffloadedModel(model, _stage(lat), K, cpu_parallel=parallel, cpu_exec_ms=lambda n: 15.0)
        om.generate(ids, am, max_new_tokens=3, eos_token_id=None, pad_token_id=0)
        model = om.restore()
        monkeypatch.undo()
        if parallel:
            assert cpu_runs and all(tid != main for tid, _, _ in cpu_runs)
            overlapped = sum(any(t0 < t < t1 for t in device_calls) for _, t0, t1 in cpu_runs)
            assert overlapped > 0, "no resident expert was computed while a CPU expert ran"
        else:
            assert not cpu_runs  # the serial reference computes CPU experts inline


def test_latency_model_measured_at_start_up_drives_the_policy():
    model = build_tiny("qwen3_moe-tiny", seed=0)
    K = model.config.num_experts_per_tok
    om = OffloadedModel(model, make_policy("lru"), K)
    eb = om.layout.expert_bytes
    model = om.restore()
    link = eb / 4e-3 / 1e9  # an emulated link moving one expert in 4 ms
    pol = _stage(LatencyModel(transfer_ms=0.38, cpu_expert_ms=0.19, cpu_token_ms=0.01))
    om = OffloadedModel(model, pol, K, link_gbps=link, cpu_exec_ms=lambda n: 1.0 + 0.5 * n, measure_latency=True)
    fig = om.latency_measurement
    assert fig is not None and fig["source"] == "measured at start-up"
    assert 3.0 <= fig["transfer_ms"] <= 12.0  # the emulated link, measured through the transfer engine
    assert fig["cpu_expert_ms"] == pytest.approx(1.0, abs=0.3) and fig["cpu_token_ms"] == pytest.approx(0.5, abs=0.1)
    assert pol.latency.transfer_ms == fig["transfer_ms"] and pol.latency.parallel  # not the constants
    ids, am = _prompts()
    om.generate(ids, am, max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    assert pol.latency.transfer_ms == fig["transfer_ms"]  # kept across the policy's resets
    om.restore()
