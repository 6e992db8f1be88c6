"""Mixtral (``MixtralConfig``): routed experts in every decoder layer; softmax router, top-K always renormalised."""

from __future__ import annotations

from expertcast.models.families.spec import FamilySpec, Preset, tiny_common

SPEC = FamilySpec(
    "mixtral", "MixtralConfig", experts_key="num_local_experts", expert_intermediate_key="intermediate_size",
    router="softmax",
    presets=(
        Preset(
            name="mixtral-tiny", model_type="mixtral", size="tiny",
            description="Mixtral debug size: 2 layers, 8 experts, top-2",
            config=tiny_common(num_hidden_layers=2, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2),
        ),
        Preset(
            name="mixtral-8x7b", model_type="mixtral", size="real", hub_id="mistralai/Mixtral-8x7B-v0.1",
            description="Mixtral-8x7B: 32 MoE layers, 8 experts, top-2, 352 MB per expert (bf16)",
            config=dict(
                vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                max_position_embeddings=32768, rms_norm_eps=1e-5, hidden_act="silu", sliding_window=None,
                router_aux_loss_coef=0.02, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16",
            ),
        ),
    ),
)
