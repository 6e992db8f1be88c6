"""SAEM's CPU execution in the runtime: cold experts run on a host thread in parallel with the device's
work on the layer's other experts, with the same tokens as the full-load model and as the serial
reference; the CPU-vs-transfer choice uses the latency model measured at start-up."""

from __future__ import annotations

import time

import pytest
import torch
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.saem.cpu_exec import LatencyModel
from expertcast.models.presets import build_tiny

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

    from expertcast.inference.runtime import experts as X

    model = build_tiny("qwen3_moe-tiny", seed=1)
    ids, am = _prompts(B=2)
    K = model.config.num_experts_per_tok
    main = threading.get_ident()
    for parallel in (True, False):
        device_calls: list[float] = []
        cpu_runs: list[tuple[int, float, float]] = []
        mlp, cpu_expert = X._expert_mlp, OffloadedModel._cpu_expert

        def device_mlp(module, x, w, out, gu, _mlp=mlp, _calls=device_calls):
            if threading.get_ident() == main and x.shape[0] and gu is not None:  # a resident (slot) expert
                _calls.append(time.perf_counter())
            return _mlp(module, x, w, out, gu)

        def host_expert(self, *a, _f=cpu_expert, _runs=cpu_runs):
            t0 = time.perf_counter()
            out = _f(self, *a)
            _runs.append((threading.get_ident(), t0, time.perf_counter()))
            return out

        monkeypatch.setattr(X, "_expert_mlp", device_mlp)
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
