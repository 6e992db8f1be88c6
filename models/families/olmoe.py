"""OLMoE (``OlmoeConfig``): routed experts in every decoder layer; softmax router, renormalised when
``norm_topk_prob``."""

from __future__ import annotations

from expertcast.models.families.spec import FamilySpec, Preset, tiny_common

SPEC = FamilySpec(
    "olmoe", "OlmoeConfig", experts_key="num_experts", expert_intermediate_key="intermediate_size", router="softmax",
    presets=(
        Preset(
            name="olmoe-tiny", model_type="olmoe", size="tiny",
            description="OLMoE debug size: 2 layers, 16 experts, top-4",
            config=tiny_common(
                num_hidden_layers=2, intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                num_key_value_heads=4, norm_topk_prob=False, clip_qkv=None,
            ),
        ),
        Preset(
            name="olmoe-1b-7b", model_type="olmoe", size="real", hub_id="allenai/OLMoE-1B-7B-0924",
            description="OLMoE-1B-7B: 16 MoE layers, 64 experts, top-8, 12.6 MB per expert (bf16)",
            config=dict(
                vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                norm_topk_prob=False, max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
                clip_qkv=None, router_aux_loss_coef=0.01, tie_word_embeddings=False, pad_token_id=1,
                eos_token_id=50279, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                dtype="bfloat16",
            ),
        ),
    ),
)
