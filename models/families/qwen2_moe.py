"""Qwen2-MoE (``Qwen2MoeConfig``): Qwen3-MoE's layout plus one gated shared expert per MoE layer when
``shared_expert_intermediate_size`` > 0."""

from __future__ import annotations

from typing import Any

from expertcast.models.families.qwen3_moe import qwen_moe_layers
from expertcast.models.families.spec import FamilySpec, Preset, tiny_common


def _shared(config: Any) -> int:
    return 1 if int(getattr(config, "shared_expert_intermediate_size", 0) or 0) > 0 else 0


SPEC = FamilySpec(
    "qwen2_moe", "Qwen2MoeConfig", experts_key="num_experts", expert_intermediate_key="moe_intermediate_size",
    moe_layers=qwen_moe_layers, shared_experts=_shared, router="softmax",
    presets=(
        Preset(
            name="qwen2_moe-tiny", model_type="qwen2_moe", size="tiny",
            description="Qwen2-MoE debug size: 4 layers (layer 0 dense), 8 experts top-2 + gated shared expert",
            config=tiny_common(
                num_hidden_layers=4, intermediate_size=128, moe_intermediate_size=32,
                shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                decoder_sparse_step=1, mlp_only_layers=[0], qkv_bias=True,
            ),
        ),
    ),
)
