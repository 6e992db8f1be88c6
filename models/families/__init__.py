"""Registry of the MoE model families expertcast supports: ``family(name)``, ``family_of(config)``, ``registry()``.

The registry is built from :data:`FAMILY_MODULES`: each module ends with ``SPEC = FamilySpec(...)``
(:class:`~expertcast.models.families.spec.FamilySpec`: the family's experts layout, router, presets). To add a
family, add one module and its name to that tuple. A config of a family not listed is refused in one line
(:class:`UnsupportedModelError`, naming the supported ones), never read by another family's rules. The checks
every family's config must pass (:func:`config_problems`) and the keys its config class takes
(:func:`config_keys`) are here too, so that a configuration edited by hand is refused before a model is built.
"""

from __future__ import annotations

from typing import Any

from expertcast.models.families.spec import FamilySpec
from expertcast.utils.registry import spec_registry

FAMILY_MODULES: tuple[str, ...] = (
    "expertcast.models.families.qwen3_moe",
    "expertcast.models.families.qwen2_moe",
    "expertcast.models.families.mixtral",
    "expertcast.models.families.olmoe",
    "expertcast.models.families.deepseek_v2",
    "expertcast.models.families.deepseek_v3",
    "expertcast.models.families.gpt_oss",
)
"""The family modules, in registry order."""


class UnsupportedModelError(ValueError):
    """The model is not an MoE causal LM of a supported family."""


def registry() -> dict[str, FamilySpec]:
    """``{model_type: FamilySpec}`` of every supported family, in registry order."""
    return spec_registry(FAMILY_MODULES, "model family")


def supported_message() -> str:
    return "supported families: " + ", ".join(f"{k} ({s.config_class})" for k, s in registry().items())


def family(name: str) -> FamilySpec:
    """The spec of family ``name`` (a transformers ``model_type``); UnsupportedModelError naming the supported
    families otherwise."""
    spec = registry().get(name)
    if spec is None:
        raise UnsupportedModelError(f"model_type {name!r} is not a supported MoE architecture; {supported_message()}")
    return spec


def family_of(config: Any) -> FamilySpec:
    """The spec of ``config``'s family; UnsupportedModelError (one line, naming the config class) otherwise."""
    mt = getattr(config, "model_type", None)
    spec = registry().get(mt) if isinstance(mt, str) else None
    if spec is None:
        raise UnsupportedModelError(f"{type(config).__name__} (model_type {mt!r}) is not a supported MoE "
                                    f"architecture; {supported_message()}")
    return spec


def config_keys(model_type: str) -> set[str]:
    """The keys family ``model_type``'s transformers config class takes (its fields and their aliases)."""
    from transformers import AutoConfig

    family(model_type)
    config = AutoConfig.for_model(model_type)
    return set(config.to_dict()) | set(getattr(config, "attribute_map", {}) or {})


def _positive(config: Any, key: str) -> str | None:
    v = getattr(config, key, None)
    if isinstance(v, bool) or not isinstance(v, int):
        return f"{key} must be an integer, got {v!r}"
    return None if v >= 1 else f"{key} must be >= 1, got {v}"


def config_problems(config: Any) -> list[str]:
    """What makes ``config`` a model that cannot run: sizes that are not positive integers, K above E, key-value
    heads that do not divide the heads, no MoE layer, and the family's own constraints (empty: none)."""
    spec = family_of(config)
    sizes = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok",
             spec.experts_key, spec.expert_intermediate_key]
    out = [p for p in (_positive(config, k) for k in sizes) if p]
    if out:
        return out
    E, K = spec.num_experts(config), int(config.num_experts_per_tok)
    if K > E:
        out.append(f"num_experts_per_tok={K} exceeds the {E} routed experts ({spec.experts_key})")
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if isinstance(kv, int) and not isinstance(kv, bool) and (kv < 1 or heads % kv):
        out.append(f"num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    try:
        if not spec.moe_layers(config):
            out.append(f"no decoder layer of {config.num_hidden_layers} holds routed experts")
    except ValueError as e:
        out.append(str(e))
    return out + spec.checks(config)


def check_config(config: Any) -> None:
    """UnsupportedModelError (one line) listing :func:`config_problems` when there are any."""
    problems = config_problems(config)
    if problems:
        raise UnsupportedModelError(f"{type(config).__name__}: {'; '.join(problems)}")
