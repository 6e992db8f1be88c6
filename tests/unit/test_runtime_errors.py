"""Bad input to the runtime fails with a clear error before any generation (and before the model is
touched); memory accounting of the offloaded model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel, check_policy_compatible
from expertcast.inference.runtime.store import UnsupportedModelError, find_experts_modules
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
