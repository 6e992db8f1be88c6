"""Load an MoE causal LM and its tokenizer: a preset name, the embedded default, a local Hugging Face
directory, a Hub id or a router-adaptation export. ``trust_remote_code`` is always off: only
architectures that transformers itself implements (:func:`supported_families`) are accepted.

    >>> model, tok = load_moe_model("qwen3_moe-tiny")      # random-init tiny preset + byte tokenizer
    >>> model, tok = load_moe_model(resolve_model("tiny-default"))   # the embedded default (its last build)
    >>> model, tok = load_moe_model("/models/Qwen3-30B-A3B", dtype="bfloat16", device="cuda")
    >>> model, tok = load_moe_model("runs/router/tiny/router-tiny-.../export")   # a fine-tuned export

A router-adaptation export (what ``expertcast fit --config configs/router/*.yaml`` writes; docs/design.md,
"Cache-aware router adaptation (restated)") holds either ``model/``, a plain Hugging Face folder with the
LoRA already merged (the default), or ``adapter/``, a peft adapter over the base model the export
records in ``export.json`` (``base``: its name and :func:`model_identity`). An adapter export is loaded as base +
adapter through peft and merged on load (the runtime offloads plain expert weights); the base is
checked against the recorded identity first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from expertcast.models.dtypes import parse_dtype
from expertcast.models.names import is_export_dir, resolve_model
from expertcast.models.presets import build_tiny, get_preset, is_preset
from expertcast.models.spec import SUPPORTED_FAMILIES, UnsupportedModelError, unsupported_message
from expertcast.utils.errors import UsageError


def supported_families() -> list[str]:
    """transformers ``model_type`` of every supported MoE family."""
    return list(SUPPORTED_FAMILIES)


def check_supported(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` (naming the config class and the supported families)
    unless ``config`` is an MoE family expertcast supports."""
    if getattr(config, "model_type", None) not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(unsupported_message(config))


def _torch_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype:
    return parse_dtype(dtype) or "auto"


def resolve_model_path(name_or_path: str | os.PathLike) -> tuple[str, bool]:
    """(where to load from, is_local) of a name :func:`resolve_model` accepts; a merged router-adaptation
    export resolves to its ``model/`` folder (an adapter export raises UsageError: only
    :func:`load_moe_model` merges it)."""
    name = str(name_or_path)
    if is_export_dir(name):  # a merged router-adaptation export: its model/ folder
        mdir = export_model_dir(name)
        if mdir is None:
            raise UsageError(f"{name}: this export keeps a peft adapter (no model/ folder): load it with "
                             f"load_moe_model, which merges it over its recorded base")
        return str(mdir), True
    path = resolve_model(name)
    return path, Path(path).is_dir()


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The checkpoint files ``from_pretrained`` loads from a local model directory."""


def check_local_weights(name_or_path: str | os.PathLike) -> None:
    """A local model directory (not an export) must hold a checkpoint, not only its config: a
    FileNotFoundError naming the folder otherwise (cheap: before any output folder is claimed)."""
    name = str(name_or_path)
    if is_export_dir(name) or is_preset(name):
        return
    p = Path(name).expanduser()
    if p.is_dir() and (p / "config.json").is_file() and not any((p / f).is_file() for f in WEIGHT_FILES):
        raise FileNotFoundError(f"model directory {p} has a config.json but no weights ({' or '.join(WEIGHT_FILES[::2])}"
                                f"); a model folder needs its checkpoint")


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
    if is_export_dir(name):
        return _load_export(Path(name), dtype, device, revision=revision, attn_implementation=attn_implementation)
    if is_preset(name):
        preset = get_preset(name)
        if preset.size == "tiny":
            from expertcast.models.tokenizer import byte_level_tokenizer

            td = _torch_dtype(dtype)
            model = build_tiny(name, seed=seed, dtype=torch.float32 if td == "auto" else td)
            tok = byte_level_tokenizer(model_max_length=model.config.max_position_embeddings)
            return standard_lm_head_input(model.to(device).eval()), tok
        name = preset.hub_id  # real-size preset: its released checkpoint
    path, local = resolve_model_path(name)
    if local:
        check_local_weights(path)
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
    model = standard_lm_head_input(realign_tensors(AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)))
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False, revision=revision)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"{path}: no usable tokenizer next to the model ({e})") from None
    return model.to(device).eval(), tok


TENSOR_ALIGNMENT = 64
"""Bytes: the alignment of every CPU tensor torch allocates itself (and SIMD kernels assume for their fast path)."""


def _standard_strides(x: torch.Tensor) -> bool:
    expect, acc = [], 1
    for n in reversed(x.shape):
        expect.append(acc)
        acc *= n
    return tuple(reversed(expect)) == x.stride()


def standard_lm_head_input(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its LM head fed row-major inputs (a forward pre-hook; idempotent; same values).

    transformers slices the last position out of the prefill's hidden states (``logits_to_keep``), a [1, 1, H] view
    whose batch stride is the prompt's T·H. On the CPU in bf16, ``F.linear`` then takes a path that copies the
    whole transposed head weight: for a 102,400 x 2,048 head, +400 MB of transient RSS and 2.9 s instead of 37 ms
    per prefill (docs/design.md, "Disk tier"). A copy of that one row with standard strides avoids it; the logits
    are bit-identical."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "_expertcast_standard_input", False):
        return model

    def pre(_mod: torch.nn.Module, args: tuple) -> tuple | None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() > 2 and not _standard_strides(x):
            return (x.clone(memory_format=torch.contiguous_format), *args[1:])
        return None

    head.register_forward_pre_hook(pre)
    head._expertcast_standard_input = True
    return model


def realign_tensors(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every CPU parameter and buffer in storage of its own, aligned to :data:`TENSOR_ALIGNMENT`.

    ``from_pretrained`` may leave tensors as views of the memory-mapped safetensors file, at whatever offset
    the file's header gives them. CPU kernels take another accumulation order for unaligned operands, so the
    same weights then give different logits (last-bit differences, which flip greedy tokens) than when built
    or copied in memory, and "token-identical to the full load" would depend on how the model was loaded.
    Copying a tensor moves it into torch's own (aligned) allocation; aligned tensors are left as they are."""
    with torch.no_grad():
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for name, t in store.items():
                    if t is not None and t.device.type == "cpu" and t.data_ptr() % TENSOR_ALIGNMENT:
                        if isinstance(t, torch.nn.Parameter):
                            t.data = t.data.clone(memory_format=torch.contiguous_format)
                        else:
                            store[name] = t.clone(memory_format=torch.contiguous_format)
    return model


def save_tiny(name: str, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Build tiny preset ``name`` (random init) and save it with the byte-level tokenizer as a Hugging
    Face directory (safetensors) that :func:`load_moe_model` and ``from_pretrained`` read."""
    model, tok = load_moe_model(name, seed=seed)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


# -- router-adaptation exports ---------------------------------------------------------------------
def export_model_dir(export_dir: str | os.PathLike) -> Path | None:
    """The plain Hugging Face folder (``model/``) of a verified router-adaptation export, or None when the
    export keeps a peft adapter instead (load it with :func:`load_moe_model`)."""
    from expertcast.models.router_export import read_adaptation_export
    from expertcast.utils.provenance import safe_member

    d = Path(export_dir).expanduser()
    info = read_adaptation_export(d)
    return safe_member(d, info["model_dir"]) if info.get("model_dir") else None


def load_adaptation_export(export_dir: str | os.PathLike, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer, routers | None, info) of a router-adaptation export, verified by its manifest
    and loaded without Lightning (the routers checked against the model)."""
    from expertcast.models.router_export import load_routers, read_adaptation_export

    d = Path(export_dir)
    info = read_adaptation_export(d)
    model, tok = load_moe_model(d, dtype=dtype, device=device)  # model/, or base + adapter/ merged on load
    routers = None
    if info.get("routers_dir"):
        routers, _ = load_routers(d / info["routers_dir"], model=model, map_location=device)
    return model, tok, routers, info


def load_moe_config(name_or_path: str | os.PathLike) -> Any:
    """The transformers config of what :func:`load_moe_model` loads, without weights (for an export:
    its model's, or its adapter's base model's)."""
    from transformers import AutoConfig

    name = str(name_or_path)
    if is_export_dir(name):
        from expertcast.models.router_export import read_adaptation_export

        info = read_adaptation_export(name)
        mdir = export_model_dir(name)
        return load_moe_config(mdir if mdir is not None else _base_source(info.get("base") or {}, name))
    if is_preset(name):
        from expertcast.models.presets import get_config

        return get_config(name)
    path, _ = resolve_model_path(name)
    return AutoConfig.from_pretrained(path, trust_remote_code=False)


def model_identity(resolved: str, *, init_seed: int | None = 0, model: Any = None) -> dict[str, Any]:
    """What fixes the weights (and tokenizer) behind a resolved model name: the one identity that traces,
    evaluations and adapter exports record.

    ``path`` (where they load from: the preset name, the absolute local folder or the Hub id), plus one of

    * ``preset`` + ``init_seed``: a random-init tiny preset (built with that seed; ``init_seed=None`` leaves it
      out for a caller that records its seed beside the identity);
    * ``files_sha256``: a local folder, sha256 over every non-hidden file (weights, config, tokenizer;
      :func:`~expertcast.utils.provenance.sha256_files`, per-file digests cached);
    * ``revision``: a Hub id (a real-size preset: its Hub id), the commit transformers resolved
      (``model``'s config when the model is loaded, else its config's).
    """
    from expertcast.utils.provenance import sha256_files

    name = str(resolved)
    if is_preset(name):
        preset = get_preset(name)
        if preset.size == "tiny":
            ident: dict[str, Any] = {"path": name, "preset": name}
            if init_seed is not None:
                ident["init_seed"] = int(init_seed)
            return ident
        name = str(preset.hub_id)
    p = Path(name).expanduser()
    if p.is_dir():
        return {"path": str(p.resolve()), "files_sha256": sha256_files(p, cached=True)}
    config = getattr(model, "config", None)
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name, trust_remote_code=False)
    return {"path": name, "revision": getattr(config, "_commit_hash", None)}


def _base_source(base: dict[str, Any], export: str | os.PathLike) -> str:
    """Where to load an adapter export's base from: its recorded local folder, preset or Hub id."""
    path = base.get("path")
    if not path:
        raise UsageError(f"{export}: adapter export records no base model (export.json `base`); re-export it")
    if base.get("files_sha256") and not Path(path).is_dir():
        raise UsageError(f"{export}: the adapter's base model {base.get('name')!r} is not at {path} on this machine; "
                         f"put it there (or re-export with lora.merge_on_export: true)")
    return str(path)


def _check_base(base: dict[str, Any], source: str, export: Path) -> None:
    if "weights_sha256" in base:  # recorded before model_identity hashed every file of a base folder
        raise UsageError(f"{export}: the adapter export records its base in an older form (weights_sha256), "
                         f"which cannot be checked any more; re-export it")
    here = model_identity(source, init_seed=int(base.get("init_seed", 0)))
    for key in ("preset", "init_seed", "files_sha256", "revision"):
        if base.get(key) is not None and here.get(key) != base[key]:
            raise UsageError(f"{export}: the adapter was trained on base {base.get('name')!r} with {key} "
                             f"{base[key]}, but {source} has {here.get(key)}: not the same base weights")


def _load_export(export: Path, dtype: Any, device: Any, **kwargs: Any):
    """(merged model, tokenizer) of a router-adaptation export (manifest verified first)."""
    from expertcast.models.router_export import read_adaptation_export
    from expertcast.utils.provenance import safe_member

    info = read_adaptation_export(export)
    mdir = export_model_dir(export)
    if mdir is not None:
        return load_moe_model(mdir, dtype=dtype, device=device, **kwargs)
    from peft import PeftModel
    from transformers import AutoTokenizer

    base = info.get("base") or {}
    source = _base_source(base, export)
    _check_base(base, source, export)
    model, _ = load_moe_model(source, dtype=dtype, device="cpu", seed=int(base.get("init_seed", 0)), **kwargs)
    adapter = safe_member(export, info["adapter_dir"])
    model = PeftModel.from_pretrained(model, str(adapter), is_trainable=False).merge_and_unload()
    tok = AutoTokenizer.from_pretrained(str(adapter), trust_remote_code=False)
    return model.to(device).eval(), tok
