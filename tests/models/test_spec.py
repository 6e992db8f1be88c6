"""MoESpec: exact figures of the real configs, and every family's numbers against the tensors of a
built tiny model."""

from __future__ import annotations

import pytest
import torch
from expertcast.models.presets import build_tiny, get_config, list_presets
from expertcast.models.spec import MoESpec, UnsupportedModelError

torch.set_num_threads(1)


def test_qwen3_30b_a3b_figures():
    spec = MoESpec.from_config(get_config("qwen3-30b-a3b"))
    assert spec.family == "qwen3_moe" and spec.model_id == "Qwen/Qwen3-30B-A3B"
    assert spec.num_layers == 48 and spec.moe_layers == list(range(48))
    assert (spec.num_experts, spec.top_k, spec.num_shared_experts) == (128, 8, 0)
    assert spec.dtype == "bfloat16"
    assert spec.expert_bytes == 3 * 2048 * 768 * 2 == 9_437_184
    assert round(spec.expert_mb, 2) == 9.44
    assert spec.total_expert_bytes == 48 * 128 * 9_437_184
    # fp32 doubles it
    assert MoESpec.from_config(get_config("qwen3-30b-a3b"), dtype="float32").expert_bytes == 2 * 9_437_184


def test_other_real_configs():
    mix = MoESpec.from_config(get_config("mixtral-8x7b"))
    assert (mix.num_layers, mix.num_experts, mix.top_k) == (32, 8, 2)
    assert mix.expert_bytes == 3 * 4096 * 14336 * 2
    olmoe = MoESpec.from_config(get_config("olmoe-1b-7b"))
    assert (olmoe.num_layers, olmoe.num_experts, olmoe.top_k) == (16, 64, 8)
    assert olmoe.expert_bytes == 3 * 2048 * 1024 * 2


def _expert_tensor_bytes_per_expert(model, layer: int) -> tuple[int, int]:
    """Bytes of the fused expert tensors of decoder layer ``layer`` / E, from named parameters."""
    prefix = f"model.layers.{layer}.mlp.experts."
    tensors = {n: p for n, p in model.named_parameters() if n.startswith(prefix)}
    assert tensors, f"no expert tensors in layer {layer}"
    E = next(iter(tensors.values())).shape[0]
    return sum(p.numel() * p.element_size() for p in tensors.values()) // E, E


@pytest.mark.parametrize("name", list_presets("tiny"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_bytes_match_fused_tensors(name, dtype):
    model = build_tiny(name, dtype=dtype)
    spec = MoESpec.from_config(model.config, dtype=dtype)
    layers_with_experts = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert spec.moe_layers == layers_with_experts
    per_expert, E = _expert_tensor_bytes_per_expert(model, spec.moe_layers[0])
    assert spec.num_experts == E
    assert spec.expert_bytes == per_expert
    assert spec.top_k == model.config.num_experts_per_tok
    assert MoESpec.from_model(model) == spec


def test_family_specifics():
    # Qwen2-MoE: mlp_only_layers=[0], one gated shared expert.
    q2 = MoESpec.from_model(build_tiny("qwen2_moe-tiny"))
    assert q2.moe_layers == [1, 2, 3] and q2.num_shared_experts == 1 and q2.num_decoder_layers == 4
    # DeepSeek-V3: first_k_dense_replace=1, n_shared_experts=1.
    ds = MoESpec.from_model(build_tiny("deepseek_v3-tiny"))
    assert ds.moe_layers == [1, 2] and ds.num_shared_experts == 1 and ds.num_layers == 2
    # GPT-OSS: transposed fused experts with biases (3HI + 2I + H elements).
    go = MoESpec.from_model(build_tiny("gpt_oss-tiny"))
    H, In = go.hidden_size, go.expert_intermediate_size
    assert go.expert_bytes == (3 * H * In + 2 * In + H) * 4
    # Qwen3-MoE decoder_sparse_step=2: MoE at layers 1 and 3 only, and the built model agrees.
    sparse = build_tiny("qwen3_moe-tiny", decoder_sparse_step=2)
    assert MoESpec.from_model(sparse).moe_layers == [1, 3]
    assert MoESpec.from_config(get_config("deepseek_v3-tiny", first_k_dense_replace=2)).moe_layers == [2]


def test_deepseek_moe_layer_freq_not_built_by_transformers_is_an_error():
    cfg = get_config("deepseek_v3-tiny")
    cfg.moe_layer_freq = 2
    with pytest.raises(ValueError, match="moe_layer_freq"):
        MoESpec.from_config(cfg)


def test_roundtrip_and_bad_dicts():
    spec = MoESpec.from_config(get_config("olmoe-tiny"))
    d = spec.to_dict()
    assert d["num_layers"] == spec.num_layers
    assert MoESpec.from_dict(d) == spec
    with pytest.raises(ValueError, match="lacks"):
        MoESpec.from_dict({k: v for k, v in d.items() if k != "expert_bytes"})
    with pytest.raises(ValueError, match="num_layers"):
        MoESpec.from_dict({**d, "num_layers": 99})
    with pytest.raises(ValueError, match="newer"):
        MoESpec.from_dict({**d, "format_version": 99})


def test_unsupported_config_names_class_and_families():
    from transformers import LlamaConfig

    with pytest.raises(UnsupportedModelError, match=r"LlamaConfig.*qwen3_moe.*gpt_oss"):
        MoESpec.from_config(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2))


def test_check_model_compatible_names_the_mismatch():
    from expertcast.data.trace_format import TraceMeta
    from expertcast.models.presets import get_config
    from expertcast.models.spec import check_model_compatible

    spec = MoESpec.from_config(get_config("mixtral-tiny"))  # L=2, E=8, K=2
    with pytest.raises(ValueError, match="L=3, E=8, K=2 but the model 'preset:mixtral-tiny' has L=2, E=8, K=2"):
        check_model_compatible(TraceMeta("m", 3, 8, 2, 1), spec)
    ok = TraceMeta("m", 2, 8, 2, 1, moe_layers=[0, 1])
    check_model_compatible(ok, spec)
    with pytest.raises(ValueError, match=r"MoE layers \[1, 2\]"):
        check_model_compatible(TraceMeta("m", 2, 8, 2, 1, moe_layers=[1, 2]), spec)
