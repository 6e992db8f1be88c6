"""DeepSeek-V3 (``DeepseekV3Config``): DeepSeek-V2's layout (transformers builds an MoE layer at every index >=
``first_k_dense_replace`` and ignores ``moe_layer_freq``, so any other value is refused); sigmoid router with a
score-correction bias, group-limited top-K."""

from __future__ import annotations

from typing import Any

from expertcast.models.families.deepseek_v2 import deepseek_checks, deepseek_moe_layers, deepseek_shared
from expertcast.models.families.spec import DROP, FamilySpec, Preset, tiny_common


def _moe_layers(config: Any) -> list[int]:
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    if freq != 1:
        raise ValueError(
            f"DeepseekV3Config has moe_layer_freq={freq}, but transformers' DeepseekV3 builds an MoE layer "
            f"at every index >= first_k_dense_replace (it ignores moe_layer_freq): the checkpoint's "
            f"layout would not match the model transformers builds")
    return deepseek_moe_layers(config)


SPEC = FamilySpec(
    "deepseek_v3", "DeepseekV3Config", experts_key="n_routed_experts", expert_intermediate_key="moe_intermediate_size",
    moe_layers=_moe_layers, shared_experts=deepseek_shared, router="sigmoid", checks=deepseek_checks,
    presets=(
        Preset(
            name="deepseek_v3-tiny", model_type="deepseek_v3", size="tiny",
            description="DeepSeek-V3 debug size: 3 layers (first dense), 16 routed experts in 4 groups, top-4, "
                        "1 shared",
            config=tiny_common(
                num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
                n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=32,
                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, head_dim=DROP,
            ),
        ),
    ),
)
