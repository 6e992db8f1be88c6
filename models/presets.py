"""Named MoE model configurations: tiny random-init presets beside the real sizes they stand for.

Torchtitan-style registry, filled from the family records (:mod:`expertcast.models.families`: each family's
module holds its presets): every supported family has a ``<family>-tiny`` preset (hidden 64, 2-4
layers, 8-16 experts; builds in well under a second on CPU) for tests and quick experiments, and the
real configurations (``qwen3-30b-a3b``, ``mixtral-8x7b``, ``olmoe-1b-7b``, ``deepseek-v2-lite``) are written out from their
published ``config.json`` values, so that sizes (:class:`expertcast.models.spec.MoESpec`) and
cost models can be computed with no download.

    >>> cfg = get_config("qwen3-30b-a3b")          # a transformers Qwen3MoeConfig, no weights
    >>> model = build_tiny("mixtral-tiny", seed=0)  # random init, deterministic by seed
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from expertcast.models.dtypes import parse_dtype
from expertcast.models.families import registry as family_registry
from expertcast.models.families.spec import TINY_VOCAB, Preset

__all__ = ["TINY_VOCAB", "Preset", "build_from_config", "build_tiny", "get_config", "get_preset", "is_preset",
           "list_presets", "register"]

_REGISTERED: dict[str, Preset] = {}
"""Presets added with :func:`register` (beside the families' own)."""


def _presets() -> dict[str, Preset]:
    """Every preset: each family's (models/families/<family>.py; the tiny ones first, then the real sizes), then
    the registered ones."""
    out: dict[str, Preset] = {}
    for size in ("tiny", "real"):
        for fam in family_registry().values():
            out.update((p.name, p) for p in fam.presets if p.size == size)
    return {**out, **_REGISTERED}


def register(preset: Preset) -> Preset:
    """Add ``preset`` to the registry (names are unique)."""
    if preset.name in _presets():
        raise ValueError(f"preset {preset.name!r} is already registered")
    _REGISTERED[preset.name] = preset
    return preset


def list_presets(size: str | None = None) -> list[str]:
    """Registered preset names, optionally only ``size`` ("tiny" or "real")."""
    return [n for n, p in _presets().items() if size is None or p.size == size]


def get_preset(name: str) -> Preset:
    """The registered :class:`Preset` called ``name`` (KeyError listing the known names otherwise)."""
    try:
        return _presets()[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(_presets())}") from None


def is_preset(name: str) -> bool:
    return name in _presets()


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


def build_from_config(config, seed: int = 0, dtype: str | torch.dtype | None = torch.float32):
    """Random-init causal LM of ``config`` (deterministic given ``seed``), in eval mode."""
    from transformers import AutoModelForCausalLM

    torch_dtype = parse_dtype(dtype) or torch.float32
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
