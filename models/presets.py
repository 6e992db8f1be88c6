"""Named MoE model configurations: tiny random-init presets beside the real sizes they stand for.

Torchtitan-style registry: every supported family has a ``<family>-tiny`` preset (hidden 64, 2-4
layers, 8-16 experts; builds in well under a second on CPU) for tests and quick experiments, and the
real configurations (``qwen3-30b-a3b``, ``mixtral-8x7b``, ``olmoe-1b-7b``, ``deepseek-v2-lite``) are written out from their
published ``config.json`` values, so that sizes (:class:`expertcast.models.spec.MoESpec`) and
cost models can be computed with no download.

    >>> cfg = get_config("qwen3-30b-a3b")          # a transformers Qwen3MoeConfig, no weights
    >>> model = build_tiny("mixtral-tiny", seed=0)  # random init, deterministic by seed
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

# Vocabulary of the tiny presets: room for the 256 byte tokens of
# :func:`expertcast.models.tokenizer.byte_level_tokenizer` plus its special tokens.
TINY_VOCAB = 512


@dataclass(frozen=True)
class Preset:
    """One named configuration."""

    name: str
    """Registry key, e.g. ``"qwen3_moe-tiny"``."""
    model_type: str
    """transformers ``model_type`` (the family), e.g. ``"qwen3_moe"``."""
    size: str
    """``"tiny"`` (random init, buildable on CPU) or ``"real"`` (config values of a released model)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the family's transformers config class."""
    hub_id: str | None = None
    """Hub id of the released model a ``"real"`` preset describes."""
    description: str = ""


_DROP = object()  # an override value that removes the key from the common tiny settings


def _tiny_common(**overrides: Any) -> dict[str, Any]:
    drop = [k for k, v in overrides.items() if v is _DROP]
    base = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=3,  # <|im_end|> of the byte-level tokenizer (expertcast.models.tokenizer)
        pad_token_id=0,  # <|pad|>
        dtype="float32",
    )
    base.update(overrides)
    for k in drop:
        del base[k]
    return base


_PRESETS: dict[str, Preset] = {}


def register(preset: Preset) -> Preset:
    """Add ``preset`` to the registry (names are unique)."""
    if preset.name in _PRESETS:
        raise ValueError(f"preset {preset.name!r} is already registered")
    _PRESETS[preset.name] = preset
    return preset


register(Preset(
    name="qwen3_moe-tiny", model_type="qwen3_moe", size="tiny",
    description="Qwen3-MoE debug size: 4 layers, 16 experts, top-4",
    config=_tiny_common(
        num_hidden_layers=4, intermediate_size=128, moe_intermediate_size=32, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.001,
    ),
))
register(Preset(
    name="qwen2_moe-tiny", model_type="qwen2_moe", size="tiny",
    description="Qwen2-MoE debug size: 4 layers (layer 0 dense), 8 experts top-2 + gated shared expert",
    config=_tiny_common(
        num_hidden_layers=4, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[0], qkv_bias=True,
    ),
))
register(Preset(
    name="mixtral-tiny", model_type="mixtral", size="tiny",
    description="Mixtral debug size: 2 layers, 8 experts, top-2",
    config=_tiny_common(num_hidden_layers=2, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2),
))
register(Preset(
    name="olmoe-tiny", model_type="olmoe", size="tiny",
    description="OLMoE debug size: 2 layers, 16 experts, top-4",
    config=_tiny_common(
        num_hidden_layers=2, intermediate_size=32, num_experts=16, num_experts_per_tok=4,
        num_key_value_heads=4, norm_topk_prob=False, clip_qkv=None,
    ),
))
register(Preset(
    name="deepseek_v3-tiny", model_type="deepseek_v3", size="tiny",
    description="DeepSeek-V3 debug size: 3 layers (first dense), 16 routed experts in 4 groups, top-4, 1 shared",
    config=_tiny_common(
        num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, head_dim=_DROP,
    ),
))
register(Preset(
    name="deepseek_v2-tiny", model_type="deepseek_v2", size="tiny",
    description="DeepSeek-V2 debug size: 3 layers (first dense), 16 routed experts, top-4, 2 shared, MLA without q LoRA",
    config=_tiny_common(
        num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
        n_shared_experts=2, num_experts_per_tok=4, first_k_dense_replace=1, topk_method="greedy", n_group=1,
        topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, head_dim=_DROP,
    ),
))
register(Preset(
    name="gpt_oss-tiny", model_type="gpt_oss", size="tiny",
    description="GPT-OSS debug size: 2 layers (sliding + full attention), 8 experts top-2, expert biases",
    config=_tiny_common(
        num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"], attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
    ),
))

# Real configurations, written from the released config.json files (no download).
register(Preset(
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
))
register(Preset(
    name="mixtral-8x7b", model_type="mixtral", size="real", hub_id="mistralai/Mixtral-8x7B-v0.1",
    description="Mixtral-8x7B: 32 MoE layers, 8 experts, top-2, 352 MB per expert (bf16)",
    config=dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, hidden_act="silu", sliding_window=None,
        router_aux_loss_coef=0.02, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16",
    ),
))
register(Preset(
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
))

register(Preset(
    name="deepseek-v2-lite", model_type="deepseek_v2", size="real", hub_id="deepseek-ai/DeepSeek-V2-Lite",
    description="DeepSeek-V2-Lite: 27 layers (first dense), 26 MoE layers, 64 routed experts + 2 shared, top-6, "
                "MLA attention, 17.3 MB per expert (bf16)",
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
))


def list_presets(size: str | None = None) -> list[str]:
    """Registered preset names, optionally only ``size`` ("tiny" or "real")."""
    return [n for n, p in _PRESETS.items() if size is None or p.size == size]


def get_preset(name: str) -> Preset:
    """The registered :class:`Preset` called ``name`` (KeyError listing the known names otherwise)."""
    try:
        return _PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(_PRESETS)}") from None


def is_preset(name: str) -> bool:
    return name in _PRESETS


def get_config(name: str, **overrides: Any):
    """transformers config (e.g. ``Qwen3MoeConfig``) of preset ``name``; ``overrides`` replace fields."""
    from transformers import AutoConfig

    preset = get_preset(name)
    kwargs = copy.deepcopy(preset.config)
    kwargs.update(overrides)
    config = AutoConfig.for_model(preset.model_type, **kwargs)
    if preset.hub_id:
        config._name_or_path = preset.hub_id
    else:
        config._name_or_path = f"preset:{name}"
    return config


def _as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        out = getattr(torch, dtype)
    except AttributeError:
        raise ValueError(f"unknown dtype {dtype!r} (use e.g. 'float32', 'bfloat16')") from None
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r} (use e.g. 'float32', 'bfloat16')")
    return out


def build_from_config(config, seed: int = 0, dtype: str | torch.dtype | None = torch.float32):
    """Random-init causal LM of ``config`` (deterministic given ``seed``), in eval mode."""
    from transformers import AutoModelForCausalLM

    torch_dtype = _as_dtype(dtype) or torch.float32
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, trust_remote_code=False)
    return model.eval()


def build_tiny(name: str, seed: int = 0, dtype: str | torch.dtype | None = torch.float32, **overrides: Any):
    """Random-init model of tiny preset ``name`` (deterministic given ``seed``), in eval mode.

    Real-size presets are refused (a 30B model does not fit a test machine): use :func:`get_config`
    for their sizes, or :func:`expertcast.models.backbone.load_moe_model` with their Hub id.
    """
    preset = get_preset(name)
    if preset.size != "tiny":
        raise ValueError(
            f"preset {name!r} is a real-size configuration ({preset.hub_id}); build_tiny only builds tiny "
            f"presets ({', '.join(list_presets('tiny'))}); use get_config({name!r}) for its sizes"
        )
    return build_from_config(get_config(name, **overrides), seed=seed, dtype=dtype)
