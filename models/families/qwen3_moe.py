"""Qwen3-MoE (``Qwen3MoeConfig``): softmax router, top-K renormalised when ``norm_topk_prob``; routed experts in
every decoder layer not in ``mlp_only_layers`` whose index + 1 is a multiple of ``decoder_sparse_step``."""

from __future__ import annotations

from typing import Any

from expertcast.models.families.spec import FamilySpec, Preset, tiny_common


def qwen_moe_layers(config: Any) -> list[int]:
    """Qwen{2,3}MoeDecoderLayer: MoE unless in mlp_only_layers, and every decoder_sparse_step-th layer."""
    n = int(config.num_hidden_layers)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    ne = int(config.num_experts)
    return [i for i in range(n) if i not in dense and ne > 0 and (i + 1) % step == 0]


SPEC = FamilySpec(
    "qwen3_moe", "Qwen3MoeConfig", experts_key="num_experts", expert_intermediate_key="moe_intermediate_size",
    moe_layers=qwen_moe_layers, router="softmax",
    presets=(
        Preset(
            name="qwen3_moe-tiny", model_type="qwen3_moe", size="tiny",
            description="Qwen3-MoE debug size: 4 layers, 16 experts, top-4",
            config=tiny_common(
                num_hidden_layers=4, intermediate_size=128, moe_intermediate_size=32, num_experts=16,
                num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                router_aux_loss_coef=0.001,
            ),
        ),
        Preset(
            name="qwen3-30b-a3b", model_type="qwen3_moe", size="real", hub_id="Qwen/Qwen3-30B-A3B",
            description="Qwen3-30B-A3B: 48 MoE layers, 128 experts, top-8, 9.44 MB per expert (bf16)",
            config=dict(
                vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu",
                attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=48,
                router_aux_loss_coef=0.001, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16",
            ),
        ),
    ),
)
