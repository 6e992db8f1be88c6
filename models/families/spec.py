"""One record per MoE model family: :class:`FamilySpec` (docs/design.md, "Model families").

Every question "what does family F's config say about its experts" reads the family's spec: which decoder layers
hold routed experts, how many experts and of what size, the shared experts, the router, the config keys its
transformers config class takes, the values that must agree, and its presets (the tiny one built for tests and the
real sizes written from released configs). Each family module of :mod:`expertcast.models.families` ends with
``SPEC = FamilySpec(...)``; the registry is built from the modules named in its ``FAMILY_MODULES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TINY_VOCAB = 512
"""Vocabulary of the tiny presets: room for the 256 byte tokens of
:func:`expertcast.models.tokenizer.byte_level_tokenizer` plus its special tokens."""

DROP = object()
"""An override value of :func:`tiny_common` that removes the key from the common tiny settings."""


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


def tiny_common(**overrides: Any) -> dict[str, Any]:
    """The settings every tiny preset shares (hidden 64, 4 heads, the byte-level tokenizer's ids), with
    ``overrides`` applied (a value :data:`DROP` removes the key)."""
    drop = [k for k, v in overrides.items() if v is DROP]
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


def _all_layers(config: Any) -> list[int]:
    return list(range(int(config.num_hidden_layers)))


def _no_shared(config: Any) -> int:
    return 0


def _no_checks(config: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class FamilySpec:
    """The experts layout, router and presets of one MoE family.

    Attributes:
        name: transformers ``model_type`` (``qwen3_moe``...).
        config_class: its transformers config class name (``Qwen3MoeConfig``).
        experts_key: the config key holding E, the routed experts per MoE layer.
        expert_intermediate_key: the config key holding one routed expert's MLP width.
        moe_layers: ``moe_layers(config) -> [decoder-layer index]``, by the rules of the family's modeling code.
        shared_experts: ``shared_experts(config) -> int``, the always-active experts per MoE layer.
        expert_bias: the fused experts carry biases (gate_up 2*I, down H per expert).
        router: how the router scores (``softmax``, ``sigmoid``, ``topk-softmax``; models/routing.py reads the
            module itself, this names it).
        checks: ``checks(config) -> [problem]``: the family's own constraints between config values (beyond the
            ones every family has, :func:`expertcast.models.families.config_problems`).
        presets: the family's presets: one tiny, and the real sizes written from released configs.
    """

    name: str
    config_class: str
    experts_key: str
    expert_intermediate_key: str
    moe_layers: Callable[[Any], list[int]] = _all_layers
    shared_experts: Callable[[Any], int] = _no_shared
    expert_bias: bool = False
    router: str = "softmax"
    checks: Callable[[Any], list[str]] = _no_checks
    presets: tuple[Preset, ...] = ()

    def __post_init__(self) -> None:
        tiny = [p for p in self.presets if p.size == "tiny"]
        if len(tiny) != 1:
            raise ValueError(f"family spec {self.name}: needs exactly one tiny preset, has {len(tiny)}")
        bad = [p.name for p in self.presets if p.model_type != self.name or p.size not in ("tiny", "real")]
        if bad:
            raise ValueError(f"family spec {self.name}: presets {bad} are of another family or size")
        if self.router not in ("softmax", "sigmoid", "topk-softmax"):
            raise ValueError(f"family spec {self.name}: unknown router {self.router!r}")

    def num_experts(self, config: Any) -> int:
        return int(getattr(config, self.experts_key))

    def expert_intermediate(self, config: Any) -> int:
        return int(getattr(config, self.expert_intermediate_key))

    def expert_numel(self, hidden_size: int, intermediate_size: int) -> int:
        """Elements of ONE routed expert: SwiGLU gate, up and down projections (3*H*I), plus the biases of
        gate_up (2*I) and down (H) where the family has them."""
        n = 3 * hidden_size * intermediate_size
        if self.expert_bias:
            n += 2 * intermediate_size + hidden_size
        return n
