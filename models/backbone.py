"""Load an MoE causal LM and its tokenizer: a preset name, the embedded default, a local Hugging Face
directory or a Hub id. ``trust_remote_code`` is always off: only architectures that transformers
itself implements (:func:`supported_families`) are accepted.

    >>> model, tok = load_moe_model("qwen3_moe-tiny")      # random-init tiny preset + byte tokenizer
    >>> model, tok = load_moe_model(resolve_model("tiny-default"))   # the embedded default (cached dir)
    >>> model, tok = load_moe_model("/models/Qwen3-30B-A3B", dtype="bfloat16", device="cuda")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from expertcast.models.presets import build_tiny, get_preset, is_preset
from expertcast.models.spec import SUPPORTED_FAMILIES, UnsupportedModelError, unsupported_message

DEFAULT_MODEL_NAMES = ("tiny-default", "default")
"""Names of the embedded default model: resolve them first with
:func:`expertcast.train.model_names.resolve_model` (the command layer does), which returns its cached
directory; ``models/`` never builds it."""


def supported_families() -> list[str]:
    """transformers ``model_type`` of every supported MoE family."""
    return list(SUPPORTED_FAMILIES)


def check_supported(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` (naming the config class and the supported families)
    unless ``config`` is an MoE family expertcast supports."""
    if getattr(config, "model_type", None) not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(unsupported_message(config))


def _torch_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype:
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    out = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r} (use 'auto', 'float32', 'bfloat16', 'float16')")
    return out


def _looks_local(name: str) -> bool:
    """A path rather than a Hub id ("owner/name"): absolute, relative with ./ or ../, ~, or more
    than one slash."""
    return name.startswith(("/", "./", "../", "~", ".")) or name.count("/") > 1 or os.sep == "\\" and "\\" in name


def resolve_model_path(name_or_path: str | os.PathLike) -> tuple[str, bool]:
    """(where to load from, is_local). Raises FileNotFoundError for a local path that does not
    exist and for a directory without ``config.json``."""
    name = str(name_or_path)
    if name in DEFAULT_MODEL_NAMES:
        from expertcast.utils.errors import UsageError

        raise UsageError(f"model name {name!r} names the embedded default model: resolve it with "
                         f"expertcast.train.model_names.resolve_model (every command does) and load its directory")
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            raise FileNotFoundError(f"model path {p} is a file; expected a Hugging Face model directory")
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"model directory {p} has no config.json (not a Hugging Face model directory)")
        return str(p), True
    if _looks_local(name):
        raise FileNotFoundError(f"model path {p} does not exist")
    return name, False


def load_moe_model(name_or_path: str | os.PathLike, dtype: str | torch.dtype | None = "auto",
                   device: str | torch.device = "cpu", *, seed: int = 0, revision: str | None = None,
                   attn_implementation: str | None = None):
    """(model in eval mode on ``device``, tokenizer) for a preset name, ``"tiny-default"``, a local
    Hugging Face directory or a Hub id.

    ``dtype="auto"`` keeps the checkpoint's dtype (float32 for tiny presets). Tiny presets are built
    with random init (deterministic by ``seed``) and get the untrained byte-level tokenizer; a
    real-size preset name (e.g. ``qwen3-30b-a3b``) loads its Hub id.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name = str(name_or_path)
    if is_preset(name):
        preset = get_preset(name)
        if preset.size == "tiny":
            from expertcast.models.tokenizer import byte_level_tokenizer

            td = _torch_dtype(dtype)
            model = build_tiny(name, seed=seed, dtype=torch.float32 if td == "auto" else td)
            tok = byte_level_tokenizer(model_max_length=model.config.max_position_embeddings)
            return model.to(device).eval(), tok
        name = preset.hub_id  # real-size preset: its released checkpoint
    path, local = resolve_model_path(name)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False, revision=revision)
    except ValueError as e:
        # Unknown model_type: an architecture transformers does not implement (remote code only).
        raise UnsupportedModelError(
            f"{path}: cannot read its config without remote code ({e}); supported families: "
            + ", ".join(f"{k} ({v})" for k, v in SUPPORTED_FAMILIES.items())) from None
    except OSError as e:
        where = "local directory" if local else "Hub id"
        raise FileNotFoundError(f"cannot load model config from {where} {path!r}: {e}") from None
    check_supported(config)
    kwargs: dict[str, Any] = {"dtype": _torch_dtype(dtype), "trust_remote_code": False, "revision": revision}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False, revision=revision)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"{path}: no usable tokenizer next to the model ({e})") from None
    return model.to(device).eval(), tok


def save_tiny(name: str, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Build tiny preset ``name`` (random init) and save it with the byte-level tokenizer as a Hugging
    Face directory (safetensors) that :func:`load_moe_model` and ``from_pretrained`` read."""
    model, tok = load_moe_model(name, seed=seed)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
