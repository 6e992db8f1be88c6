"""Export of trained cache-aware routers: ``cache_routers.safetensors`` + ``cache_routers.json``.

The JSON holds the format name and version, the routers' sizes and mode, a description of the
backbone they were trained with (family, L, E, K, H) and the SHA-256 of the weights file, plus free
``extra`` settings (B, tau, sw, ...); ``export_manifest.json`` lists the sha256 of both files
(:func:`expertcast.utils.provenance.write_export_manifest`). :func:`load_routers` refuses, with a
message naming the problem, a directory that is not such an export, a newer format, an export
without a manifest (re-export it), a file altered after export (weights or JSON), and routers for
another model. Loading needs neither Lightning nor pickle (safetensors only).

A router-adaptation export (``expertcast fit --config configs/router/...``) is a folder holding
``export.json`` (its ``training`` block lists the train and held-out text ids), ``model/`` or
``adapter/``, ``routers/`` (the files above) and a manifest over all of them:
:func:`read_adaptation_export` verifies it and :func:`training_ids` reads its training ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from expertcast.models.cache_routers import ROUTER_MODES, CacheRouters
from expertcast.models.routing import find_routers
from expertcast.utils.errors import UsageError
from expertcast.utils.fitted_on import FittedOn, model_of
from expertcast.utils.io import atomic_write_bytes, atomic_write_json
from expertcast.utils.provenance import verify_named_export, write_export_manifest
from torch import nn

FORMAT = "expertcast-cache-routers"
FORMAT_VERSION = 1
WEIGHTS_FILE = "cache_routers.safetensors"
CONFIG_FILE = "cache_routers.json"
ADAPTATION_FILE = "export.json"
"""The top-level JSON of a router-adaptation export (written by RouterAdaptationModule.export)."""


def model_signature(model: nn.Module) -> dict[str, Any]:
    """What identifies a backbone for its routers: family, MoE layers, E, K and router input size."""
    sites = find_routers(model)
    cfg = getattr(model, "config", None)
    return {
        "model_type": getattr(cfg, "model_type", None),
        "name_or_path": getattr(cfg, "_name_or_path", None),
        "moe_layers": [s.layer_idx for s in sites],
        "num_experts": sites[0].num_experts,
        "top_k": sites[0].top_k,
        "hidden_size": int(sites[0].module.weight.shape[1]),
    }


def save_routers(directory: str | os.PathLike, routers: CacheRouters, model: nn.Module | None = None,
                 extra: dict[str, Any] | None = None) -> Path:
    """Write ``routers`` (and the signature of ``model``, when given) into ``directory`` atomically."""
    from safetensors.torch import save

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in routers.state_dict().items()}
    blob = save(tensors, metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mode": routers.mode,
        "num_layers": routers.num_layers,
        "num_experts": routers.num_experts,
        "hidden_size": routers.hidden_size,
        "bias": routers.has_bias,
        "model": model_signature(model) if model is not None else None,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "extra": dict(extra or {}),
    }
    meta.update({k: v for k, v in (extra or {}).items() if k not in meta})
    atomic_write_bytes(d / WEIGHTS_FILE, blob)
    atomic_write_json(d / CONFIG_FILE, meta)
    write_export_manifest(d, [WEIGHTS_FILE, CONFIG_FILE])
    return d


def read_router_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The validated JSON of an export (ValueError when missing, foreign or of a newer format)."""
    d = Path(directory)
    cfg_path = d / CONFIG_FILE
    if not cfg_path.is_file():
        raise ValueError(f"{d} is not an expertcast cache-router export: {CONFIG_FILE} is missing")
    try:
        meta = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is corrupt (not JSON): {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{cfg_path} is not an expertcast cache-router export (format != {FORMAT!r})")
    if not isinstance(meta.get("format_version"), int) or meta["format_version"] > FORMAT_VERSION:
        raise ValueError(
            f"{cfg_path} has format version {meta.get('format_version')!r}; this expertcast reads up to "
            f"{FORMAT_VERSION}: upgrade expertcast"
        )
    missing = [k for k in ("mode", "num_layers", "num_experts", "hidden_size", "sha256") if k not in meta]
    if missing or meta["mode"] not in ROUTER_MODES:
        raise ValueError(f"{cfg_path} is corrupt: missing {missing} or unknown mode {meta.get('mode')!r}")
    return meta


def load_routers(directory: str | os.PathLike, model: nn.Module | None = None,
                 map_location: str | torch.device = "cpu") -> tuple[CacheRouters, dict[str, Any]]:
    """Load an export; with ``model`` also check it was trained for that backbone (ValueError if not)."""
    from safetensors.torch import load

    d = Path(directory)
    meta = read_router_config(d)
    meta["export_hash"] = verify_named_export(d, "cache-router export")
    wpath = d / WEIGHTS_FILE
    if not wpath.is_file():
        raise ValueError(f"{d}: {WEIGHTS_FILE} is missing (incomplete export)")
    blob = wpath.read_bytes()
    if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
        raise ValueError(f"{wpath} is corrupt: its SHA-256 does not match the one recorded in {CONFIG_FILE}")
    try:
        tensors = load(blob)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{wpath} is corrupt: {e}") from None
    routers = CacheRouters(meta["num_layers"], meta["num_experts"], meta["hidden_size"], mode=meta["mode"],
                           bias=bool(meta.get("bias", False)))
    try:
        routers.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{wpath} does not hold {meta['mode']} routers of the recorded sizes: {e}") from None
    if model is not None:
        sig = meta.get("model") or {}
        mine = model_signature(model)
        if sig.get("model_type") and sig["model_type"] != mine["model_type"]:
            raise ValueError(
                f"routers in {d} were trained for a {sig['model_type']!r} model, not {mine['model_type']!r}: "
                "they belong to another model"
            )
        routers.check_model(model)
        if sig.get("top_k") not in (None, mine["top_k"]):
            raise ValueError(f"routers in {d} were trained with top-K={sig['top_k']}, the model has "
                             f"{mine['top_k']}: they belong to another model")
    return routers.to(map_location), meta


def read_adaptation_export(export_dir: str | os.PathLike) -> dict[str, Any]:
    """``export.json`` of a router-adaptation export, after checking the manifest over the whole folder
    (model, routers, JSON); the returned dict carries ``export_hash``. UsageError when it is missing,
    foreign or altered."""
    d = Path(export_dir)
    path = d / ADAPTATION_FILE
    if not path.is_file():
        raise UsageError(f"{d} is not a router-adaptation export: {ADAPTATION_FILE} is missing")
    export_hash = verify_named_export(d, "router-adaptation export")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is corrupt (not JSON): {e}") from None
    if not isinstance(info, dict):
        raise UsageError(f"{path} is not a router-adaptation export")
    info["export_hash"] = export_hash
    return info


def training_ids(export_dir: str | os.PathLike) -> set[str] | None:
    """The text ids a router-adaptation export was trained or validated on (train ∪ val), or None when
    its ``export.json`` records no ``training`` block. The export is verified first."""
    training = read_adaptation_export(export_dir).get("training")
    if not isinstance(training, dict) or "train_ids" not in training:
        return None
    return set(training.get("train_ids") or []) | set(training.get("val_ids") or [])


def router_fitted_on(export_dir: str | os.PathLike) -> FittedOn:
    """A router-adaptation export's record (verified first): its training text ids and its base model
    (``export.json`` ``base``). The adapted model itself is another model: its routing matches neither."""
    info = read_adaptation_export(export_dir)
    training = info.get("training") if isinstance(info.get("training"), dict) else {}
    ids = (frozenset(training.get("train_ids") or []) | frozenset(training.get("val_ids") or [])
           if "train_ids" in training else None)
    return FittedOn(f"the router export {export_dir}", ids, model_of(info.get("base")))
