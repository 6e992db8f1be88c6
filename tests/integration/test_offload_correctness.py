"""Offloaded greedy generation equals the full-load model, for every policy and the tiny presets of
Qwen3-MoE, Mixtral, OLMoE and GPT-OSS, at capacities down to top-K per layer; and the runtime's
counters equal the simulator's on the routing recorded from the same run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data.trace_format import TraceMeta
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.saem.cpu_exec import LatencyModel
from expertcast.inference.sim.simulator import build_stream, replay, run_policy
from expertcast.models.presets import build_tiny

torch.set_num_threads(1)

PRESETS = ["qwen3_moe-tiny", "mixtral-tiny", "olmoe-tiny", "gpt_oss-tiny"]
NEW = 8


def _prompts(seed: int = 1, B: int = 2, P: int = 9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 500, (B, P), generator=g)
    am = torch.ones_like(ids)
    am[1, :3] = 0  # left padding: the second prompt is 3 tokens shorter
    ids[1, :3] = 0
    return ids, am


def _policy(name: str, traces, stream, K: int):
    """Every registered policy the runtime can drive with what a run provides."""
    if name == "static":
        return make_policy("static", calibration=traces), None
    if name in ("belady", "belady-k"):
        return make_policy(name), stream
    if name == "stage":  # SAEM: stage refills + CPU execution of cold experts (CPU favoured for <= 3 tokens)
        lat = LatencyModel(transfer_ms=1.0, cpu_expert_ms=0.5, cpu_token_ms=0.15)
        return make_policy("stage", cues="a|e", decoder=lambda i: bytes([int(i) % 256]), latency=lat), None
    if name == "seqmoe":  # forecaster-driven prefetch + probabilistic Belady (an untrained forecaster)
        from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig

        L = traces[0].expert_ids.shape[1]
        E = int(stream.num_experts)
        fc = ExpertForecaster(ForecasterConfig(num_layers=L, num_experts=E, top_k=K, hidden_size=32, num_blocks=1,
                                               state_size=8, head_dim=16, chunk_size=16)).eval()
        return make_policy("seqmoe", forecaster=fc), None
    return make_policy(name), None


POLICIES = ["lru", "fifo", "lfu", "lrfu", "static", "belady", "belady-k", "stage", "seqmoe"]


@pytest.mark.parametrize("preset", PRESETS)
def test_offloaded_generation_equals_full_load(preset):
    model = build_tiny(preset, seed=0)
    ids, am = _prompts()
    ref = model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    K = model.config.num_experts_per_tok
    # first run (LRU, top-K slots per layer) records the routing: calibration / future of the others
    om = OffloadedModel(model, make_policy("lru"), K, pool="per-layer")
    first = om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, record=True)
    assert torch.equal(first.sequences, ref)
    assert om.stats.D > 0, "capacity top-K must cause misses"
    meta = TraceMeta(preset, om.L, om.E, om.K, om.layout.expert_bytes)
    stream = build_stream(meta, first.traces, batch_size=2)
    model = om.restore()
    assert torch.equal(model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False,
                                      eos_token_id=None, pad_token_id=0), ref)
    for name in POLICIES:
        pools = [("per-layer", K)]
        if preset == "qwen3_moe-tiny" and name != "stage":  # SAEM manages per-layer budgets
            pools.append(("shared", K))  # a shared pool of only K slots for all layers
        for pool, cap in pools:
            pol, future = _policy(name, first.traces, stream, K)
            om = OffloadedModel(model, pol, cap, pool=pool, future=future)
            out = om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
            assert torch.equal(out.sequences, ref), (preset, name, pool)
            assert om.stats.A > 0
            if name == "stage":
                assert om.stats.metrics()["cpu_exec"] > 0  # cold experts executed in situ on the CPU
            if name == "seqmoe":
                assert om.stats.P > 0  # proactive loads were issued and served
            model = om.restore()


def test_capacity_between_topk_and_all_and_mmap_store(tmp_path):
    model = build_tiny("qwen3_moe-tiny", seed=3)
    ids, am = _prompts(seed=5)
    ref = model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    for cap in (0.5, 1.0):
        om = OffloadedModel(model, make_policy("lru"), cap, pool="shared", mmap_path=tmp_path / f"s{cap}.safetensors",
                            link_gbps=0.5)
        out = om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, record=True)
        assert torch.equal(out.sequences, ref)
        assert om.store.mmap_path is not None
        if cap == 1.0:  # nothing is ever evicted: only the first use of an expert in decode misses
            seen_prefill = {(li, int(e)) for tr in out.traces for li in range(om.L)
                            for e in tr.expert_ids[:tr.prompt_len, li].reshape(-1)}
            seen_decode = {(li, int(e)) for tr in out.traces for li in range(om.L)
                           for e in tr.expert_ids[tr.prompt_len:, li].reshape(-1)}
            assert om.stats.D == len(seen_decode - seen_prefill)
            assert om.cache.occupied() == len(seen_prefill | seen_decode)
        model = om.restore()


EOS = [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31]


@pytest.mark.parametrize("pool,cap", [("per-layer", 4), ("per-layer", 7), ("shared", 24)])
def test_runtime_counters_equal_simulator(pool, cap):
    """Same run, same routing: the runtime's counters equal the simulator's replay of its recorded trace
    (batch of 3, left padding, sequences finishing early on EOS)."""
    model = build_tiny("qwen3_moe-tiny", seed=0)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(40, 500, (3, 8), generator=g)
    am = torch.ones_like(ids)
    am[2, :2] = 0
    ids[2, :2] = 0
    seen_eos = False
    traces = stream = None
    for name in ("lru", "lfu", "fifo", "lrfu", "static", "belady"):
        if name in ("static", "belady"):
            pol = make_policy("static", calibration=traces) if name == "static" else make_policy("belady")
        else:
            pol = make_policy(name)
        om = OffloadedModel(model, pol, cap, pool=pool, future=stream if name == "belady" else None)
        res = om.generate(ids, am, max_new_tokens=14, eos_token_id=EOS, pad_token_id=0, record=True)
        meta = TraceMeta("tiny", om.L, om.E, om.K, om.layout.expert_bytes)
        if traces is None:
            traces = res.traces
            stream = build_stream(meta, traces, batch_size=3)
            seen_eos = len({len(t.token_ids) - t.prompt_len for t in traces}) > 1
        st = om.stats
        sim_pol = make_policy("static", calibration=traces) if name == "static" else make_policy(name)
        sim = replay(build_stream(meta, res.traces, batch_size=3), sim_pol, om.cache_config)
        for k in ("accesses", "hits", "demand", "temp", "late", "cpu", "proactive"):
            assert np.array_equal(getattr(st, k), getattr(sim, k)), (name, k, getattr(st, k), getattr(sim, k))
        assert st.decoded_tokens == sim.decoded_tokens
        assert om.cache.resident_set() == sim.resident
        if name != "static":  # the compiled engine agrees too
            fast = run_policy(build_stream(meta, res.traces, batch_size=3), make_policy(name), om.cache_config)
            assert fast.D == st.D and fast.A == st.A
        model = om.restore()
    assert seen_eos, "the batch should contain sequences of different decode lengths"


def test_forced_routing_replay_matches_simulator():
    """Replay of recorded traces on a random-weight model of the same shape: the runtime's counters
    equal the simulator's, and the model's own routing is replaced by the trace's."""
    from expertcast.data.synthetic import zipf_traces

    model = build_tiny("olmoe-tiny", seed=7)
    L, K = 2, 4
    syn = zipf_traces(num_sequences=2, num_tokens=24, num_layers=L, num_experts=16, top_k=K, seed=0)
    for name in ("lru", "belady"):
        stream = build_stream(syn.meta, syn.sequences, batch_size=1)
        om = OffloadedModel(model, make_policy(name), 6, pool="per-layer", future=stream if name == "belady" else None)
        st = om.replay(syn.sequences)
        sim = replay(stream, make_policy(name), om.cache_config)
        assert st.D == sim.D and st.A == sim.A and st.hits.sum() == sim.hits.sum()
        assert np.array_equal(st.demand, sim.demand)
        model = om.restore()
