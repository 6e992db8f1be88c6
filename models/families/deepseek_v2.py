"""DeepSeek-V2 (``DeepseekV2Config``): a dense MLP for the first ``first_k_dense_replace`` decoder layers, routed
experts after (no ``moe_layer_freq``), ``n_shared_experts`` always-active experts; softmax router (greedy or
group-limited top-K)."""

from __future__ import annotations

from typing import Any

from expertcast.models.families.spec import DROP, FamilySpec, Preset, tiny_common


def deepseek_moe_layers(config: Any) -> list[int]:
    """DeepseekV{2,3}DecoderLayer: dense MLP for layer_idx < first_k_dense_replace, MoE after."""
    k = int(getattr(config, "first_k_dense_replace", 0) or 0)
    return list(range(k, int(config.num_hidden_layers)))


def deepseek_shared(config: Any) -> int:
    return int(getattr(config, "n_shared_experts", 0) or 0)


def deepseek_checks(config: Any) -> list[str]:
    """Grouped routing: n_group divides n_routed_experts, topk_group <= n_group; dense layers leave one MoE layer."""
    out = []
    E, groups, topk_group = config.n_routed_experts, getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if isinstance(groups, int) and groups >= 1 and isinstance(E, int) and E % groups:
        out.append(f"n_routed_experts={E} is not a multiple of n_group={groups}")
    if isinstance(groups, int) and isinstance(topk_group, int) and topk_group > groups:
        out.append(f"topk_group={topk_group} exceeds n_group={groups}")
    return out


SPEC = FamilySpec(
    "deepseek_v2", "DeepseekV2Config", experts_key="n_routed_experts", expert_intermediate_key="moe_intermediate_size",
    moe_layers=deepseek_moe_layers, shared_experts=deepseek_shared, router="softmax", checks=deepseek_checks,
    presets=(
        Preset(
            name="deepseek_v2-tiny", model_type="deepseek_v2", size="tiny",
            description="DeepSeek-V2 debug size: 3 layers (first dense), 16 routed experts, top-4, 2 shared, MLA "
                        "without q LoRA",
            config=tiny_common(
                num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
                n_shared_experts=2, num_experts_per_tok=4, first_k_dense_replace=1, topk_method="greedy", n_group=1,
                topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, kv_lora_rank=16, q_lora_rank=None,
                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, head_dim=DROP,
            ),
        ),
        Preset(
            name="deepseek-v2-lite", model_type="deepseek_v2", size="real", hub_id="deepseek-ai/DeepSeek-V2-Lite",
            description="DeepSeek-V2-Lite: 27 layers (first dense), 26 MoE layers, 64 routed experts + 2 shared, "
                        "top-6, MLA attention, 17.3 MB per expert (bf16)",
            config=dict(
                vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
                n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy", n_group=1,
                topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
                rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
                bos_token_id=100000, eos_token_id=100001,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                                 "original_max_position_embeddings": 4096},
                dtype="bfloat16",
            ),
        ),
    ),
)
