"""GPT-OSS (``GptOssConfig``): routed experts in every decoder layer, with biases (gate_up 2*I, down H per
expert); top-K of the logits, then a softmax over those K."""

from __future__ import annotations

from expertcast.models.families.spec import FamilySpec, Preset, tiny_common

SPEC = FamilySpec(
    "gpt_oss", "GptOssConfig", experts_key="num_local_experts", expert_intermediate_key="intermediate_size",
    expert_bias=True, router="topk-softmax",
    presets=(
        Preset(
            name="gpt_oss-tiny", model_type="gpt_oss", size="tiny",
            description="GPT-OSS debug size: 2 layers (sliding + full attention), 8 experts top-2, expert biases",
            config=tiny_common(
                num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                sliding_window=16, layer_types=["sliding_attention", "full_attention"], attention_bias=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
            ),
        ),
    ),
)
