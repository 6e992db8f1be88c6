"""Bad input to the runtime fails with a clear error before any generation (and before the model is
touched); memory accounting of the offloaded model.

Offloaded greedy generation equals the full-load model, for every policy and the tiny presets of
Qwen3-MoE, Mixtral, OLMoE and GPT-OSS, at capacities down to top-K per layer; and the runtime's
counters equal the simulator's on the routing recorded from the same run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel, check_policy_compatible
from expertcast.inference.runtime.store import UnsupportedModelError, find_experts_modules
from expertcast.inference.saem.cpu_exec import LatencyModel
from expertcast.inference.sim.simulator import build_stream, replay, run_policy
from expertcast.models.presets import build_tiny

torch.set_num_threads(1)


@pytest.fixture
def qwen():
    return build_tiny("qwen3_moe-tiny", seed=0)  # L=4, E=16, K=4


def _untouched(model) -> bool:
    return all(r.module.gate_up_proj.numel() > 0 for r in find_experts_modules(model))


@pytest.mark.parametrize("pool,cap", [("per-layer", 3), ("per-layer", 0.1), ("shared", 3)])
def test_capacity_below_top_k(qwen, pool, cap):
    with pytest.raises(ValueError, match="below top-K=4"):
        OffloadedModel(qwen, make_policy("lru"), cap, pool=pool)
    assert _untouched(qwen)


def test_unsupported_architecture():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture LlamaForCausalLM"):
        OffloadedModel(dense, make_policy("lru"), 0.5)


def test_forecaster_export_for_another_model(qwen, tmp_path):
    """A policy holding a forecaster export trained for another model (L/E/K) is refused up front."""
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
    from expertcast.models.forecaster_export import load_forecaster, save_forecaster

    cfg = ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=32, num_blocks=1, state_size=8,
                           head_dim=16, chunk_size=16)
    save_forecaster(ExpertForecaster(cfg), tmp_path / "fc", source={"model_id": "mixtral-tiny"})
    export = load_forecaster(tmp_path / "fc")
    policy = make_policy("lru")
    policy.forecaster = export  # as a forecaster-driven policy holds it
    with pytest.raises(ValueError, match="trained for another model"):
        OffloadedModel(qwen, policy, 0.5)
    assert _untouched(qwen)
    check_policy_compatible(make_policy("lru"), 4, 16, 4, "model")  # nothing held: fine


def test_cue_set_for_another_model(qwen):
    from expertcast.inference.saem.cues import CueSet

    cs = CueSet(cues=["Wait"], model_id="olmoe-tiny", expert_frequency=np.ones((2, 16)).tolist())
    pol = make_policy("stage", cue_set=cs, decoder=lambda i: b"x")
    with pytest.raises(ValueError, match="another model"):
        OffloadedModel(qwen, pol, 0.5)
    assert _untouched(qwen)


def test_oracle_without_future_and_trace_mismatch(qwen):
    with pytest.raises(ValueError, match="oracle"):
        OffloadedModel(qwen, make_policy("belady"), 0.5)
    assert _untouched(qwen)
    om = OffloadedModel(qwen, make_policy("lru"), 0.5)
    try:
        T = 6
        bad = TraceSequence("s", np.arange(T, dtype=np.int32), 3, np.zeros((T, 2, 2), np.int16),
                            np.zeros((T, 2, 2), np.float16))
        with pytest.raises(ValueError, match="trace/model mismatch"):
            om.replay([bad])
        with pytest.raises(ValueError, match="recorded on another model"):
            om.replay([], meta=TraceMeta("mixtral-tiny", 2, 8, 2, 1))
        with pytest.raises(RuntimeError, match="OffloadedModel.generate"):
            qwen(input_ids=torch.tensor([[5, 6]]))  # the wrapped model is not called directly
        with pytest.raises(ValueError, match="left-padded"):
            om.generate(torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]]), max_new_tokens=2)
    finally:
        om.close()


def test_memory_matches_slots_plus_non_expert_weights(qwen):
    total = sum(p.numel() * p.element_size() for p in qwen.parameters()) + \
        sum(b.numel() * b.element_size() for b in qwen.buffers())
    om = OffloadedModel(qwen, make_policy("lru"), 0.5, pool="shared")
    try:
        om.generate(torch.randint(5, 500, (1, 6)), max_new_tokens=4, eos_token_id=None, pad_token_id=0)
        m = om.memory_report()
        xb = om.layout.expert_bytes
        assert xb == 3 * 64 * 32 * 4  # gate, up, down of hidden 64 x moe_intermediate 32, float32
        assert m.host_expert_bytes == 4 * 16 * xb  # every expert once on the host
        assert m.device_expert_param_bytes == 0  # the fused weights do not stay beside the slots
        assert m.device_non_expert_bytes == total - 4 * 16 * xb
        assert m.num_slots == 32 and m.device_slot_bytes == (32 + m.num_temp_slots) * xb
        assert m.device_total == m.expected_device + m.device_workspace_bytes
    finally:
        om.close()


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
        # the link's headroom alone decides (breakeven off): the untrained forecast still issues loads, which the
        # runtime must serve with the same tokens (the default break-even rightly declines them)
        return make_policy("seqmoe", forecaster=fc, breakeven=False), None
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


def test_replay_reports_the_forecast_tables_it_computed_before_the_decode():
    """A replay with a learned forecaster computes each sequence's forecast tables as its batch opens (the routing is
    known ahead): that work is not in the decode time, so the run reports it beside tokens/s (elements, seconds and
    FLOPs per element), never as a forecaster that cost nothing; a second replay of the same sequences reuses the
    tables and reports none computed."""
    from expertcast.data.synthetic import zipf_traces
    from expertcast.inference.runtime.stats import forecaster_line
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
    from expertcast.models.forecaster_inputs import trigger_offset

    model = build_tiny("olmoe-tiny", seed=7)
    L, K = 2, 4
    syn = zipf_traces(num_sequences=2, num_tokens=24, num_layers=L, num_experts=16, top_k=K, seed=0)
    fc = ExpertForecaster(ForecasterConfig(num_layers=L, num_experts=16, top_k=K, hidden_size=32, num_blocks=1,
                                           state_size=8, head_dim=16, chunk_size=16)).eval()
    pol = make_policy("seqmoe", forecaster=fc)
    om = OffloadedModel(model, pol, 6, pool="per-layer")
    st = om.replay(syn.sequences)
    m = st.metrics()
    elements = sum(len(s.expert_ids) - trigger_offset(L, fc.config.p) for s in syn.sequences)
    assert m["forecaster_precomputed_elements"] == elements
    assert m["forecaster_precompute_ms_per_element"] > 0 and m["forecaster_precompute_s"] > 0
    assert m["forecaster_precompute_flops_per_element"] == fc.step_flops() * pol.horizon  # one head: rollout steps
    assert m["forecaster_calls_per_step"] == 0  # nothing ran online
    assert f"tables precomputed before the decode (not in tokens/s): {elements} elements" in forecaster_line(m)
    again = om.replay(syn.sequences).metrics()
    assert "forecaster_precomputed_elements" not in again and "precomputed" not in forecaster_line(again)
    om.restore()


def test_a_closed_runtime_is_not_kept_alive_by_the_model(qwen):
    """close() unbinds the experts modules, so a closed runtime's slots are freed before the next one over the
    same model allocates its own (the disk benchmark's cells: else two pools live at once)."""
    import gc
    import weakref

    om = OffloadedModel(qwen, make_policy("lru"), 0.5)
    om.close()
    ref = weakref.ref(om)
    del om
    gc.collect()
    assert ref() is None
    assert all(r.module._expertcast_runtime is None for r in find_experts_modules(qwen))



def test_the_driver_makes_every_policy_lifecycle_call(qwen, lifecycle_callers):
    """The runtime never calls reset / set_future / warm_start itself: at construction, reset and set_future the
    calls come from the one driver (docs/design.md, "Driver")."""
    policy = make_policy("static", calibration=np.ones((4, 16), np.int64))
    callers = lifecycle_callers(policy)
    om = OffloadedModel(qwen, policy, 8)
    om.set_future(None)
    om.reset()
    assert {h for h, _ in callers} == {"reset", "set_future", "warm_start"}
    assert {m for _, m in callers} == {"expertcast.inference.cache.driver"}, callers
    assert len(om.cache.resident_set()) == 4 * 8  # the warm start was placed
    om.restore()
