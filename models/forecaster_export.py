"""Forecaster export: safetensors weights + a JSON config with a format version.

Layout of an export directory::

    forecaster.json          {"format": "expertcast-forecaster", "format_version": 5, "config": {...},
                              "source": {model_id, num_layers, num_experts, top_k, ...},
                              "weights": "forecaster.safetensors", "weights_sha256": "...",
                              "num_parameters": N, "step_flops": F, "extra": {...},
                              "training": {traces, trace_fingerprint, split, train_ids, val_ids, run_dir,
                                           config, ...}}
    forecaster.safetensors   the state dict of :class:`~expertcast.models.forecaster.ExpertForecaster`
    export_manifest.json     sha256 of both files above (:func:`expertcast.utils.provenance.write_export_manifest`)

Format 2 added the online statistics (``config.online_half_lives`` and the ``online.mix`` / ``online.gate``
tensors); format 3 the exact components (``config.component_half_lives`` / ``selection`` / ``head_rank`` and the
fitted ``components.freq`` / ``components.trans`` tables, docs/design.md "Exact components"); format 4 the
per-sequence leader (``config.switch_half_life``); format 5 the project's own Mamba-2 backbone
(:mod:`expertcast.models.mamba2`). Earlier exports still load, as forecasters without them; formats 1-4 ran
transformers' ``Mamba2Model``, whose parameters are the project's under the same names
(``backbone.layers.{i}.mixer.*``, ``backbone.layers.{i}.norm.weight``, ``backbone.norm_f.weight``) plus a token
embedding the forecaster never used (``backbone.embeddings.weight``, [1, d]; dropped on load:
:data:`LEGACY_DROPPED`). An export whose backbone is transformers' Mamba-1 (``backbone: mamba``) is refused.
``step_flops``: FLOPs of one decode step at batch 1 (:meth:`~expertcast.models.forecaster.ExpertForecaster.step_flops`).

Loading needs neither Lightning nor pickle: JSON + safetensors only. The manifest is checked before
anything is used, so an edited ``temperature`` or ``trigger_layer`` is refused like corrupted weights;
the ``weights`` entry must name a file inside the export. A foreign file (wrong ``format``), a newer
format version, an export without a manifest (written by an older expertcast: re-export it),
missing/unexpected tensors or shape mismatches are refused with :class:`ForecasterExportError` naming
the problem. :func:`training_ids` reads the sequences an export was trained and validated on, for
the leakage checks of the commands that evaluate it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.utils.errors import UsageError
from expertcast.utils.fitted_on import FittedOn, model_of
from expertcast.utils.io import atomic_write_bytes, atomic_write_json
from expertcast.utils.jsonfields import check_format, require_keys
from expertcast.utils.provenance import (
    safe_member,
    verify_named_export,
    write_export_manifest,
)

EXPORT_FORMAT = "expertcast-forecaster"
EXPORT_FORMAT_VERSION = 5
LEGACY_BACKBONE_VERSIONS = range(1, 5)
"""Format versions written while the backbone was transformers' ``Mamba2Model`` / ``MambaModel``."""
LEGACY_DROPPED = ("backbone.embeddings.weight",)
"""Tensors of a format 1-4 export with no counterpart in the project's Mamba-2 (transformers' token embedding, unused:
the forecaster fed ``inputs_embeds``); every other tensor maps onto the same name and shape."""
CONFIG_NAME = "forecaster.json"
WEIGHTS_NAME = "forecaster.safetensors"


class ForecasterExportError(UsageError):
    """The path does not hold a usable forecaster export (foreign, corrupt, altered or incompatible)."""


@dataclass
class ForecasterExport:
    """A loaded export: the model (eval mode) and the metadata written beside it."""

    model: ExpertForecaster
    config: ForecasterConfig
    source: dict[str, Any] = field(default_factory=dict)
    """What the forecaster was trained on: model_id, num_layers, num_experts, top_k (of the traces)."""
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    training: dict[str, Any] | None = None
    """Provenance written by ``expertcast fit``: traces, fingerprint, split, train/val ids, run dir, config."""
    export_hash: str | None = None
    """sha256 over the export's files (its manifest): the identity outputs record for this forecaster."""

    def check_compatible(self, num_layers: int, num_experts: int, top_k: int, what: str = "trace") -> None:
        """Raise ValueError when this forecaster's L/E/K differ from ``what``'s."""
        c = self.config
        mine = (c.num_layers, c.num_experts, c.top_k)
        theirs = (num_layers, num_experts, top_k)
        if mine != theirs:
            src = self.source.get("model_id", "?")
            raise ValueError(
                f"forecaster {self.path or ''} (trained on {src!r}) has L={mine[0]}, E={mine[1]}, K={mine[2]} but the "
                f"{what} has L={theirs[0]}, E={theirs[1]}, K={theirs[2]}: it was trained for another model"
            )


def save_forecaster(model: ExpertForecaster, path: str | os.PathLike, *, source: dict[str, Any] | None = None,
                    extra: dict[str, Any] | None = None, training: dict[str, Any] | None = None) -> Path:
    """Write ``model`` to the export directory ``path`` (each file atomically: weights, JSON, then the
    manifest). ``training`` is the provenance block (see the module docstring). Returns the directory."""
    from safetensors.torch import save

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    blob = save(tensors, metadata={"format": EXPORT_FORMAT, "format_version": str(EXPORT_FORMAT_VERSION)})
    atomic_write_bytes(out / WEIGHTS_NAME, blob)
    src = dict(source or {})
    c = model.config
    src.setdefault("num_layers", c.num_layers)
    src.setdefault("num_experts", c.num_experts)
    src.setdefault("top_k", c.top_k)
    atomic_write_json(out / CONFIG_NAME, {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_FORMAT_VERSION,
        "config": c.to_dict(),
        "source": src,
        "weights": WEIGHTS_NAME,
        "weights_sha256": hashlib.sha256(blob).hexdigest(),
        "num_parameters": model.num_parameters(),
        "step_flops": model.step_flops(),
        "extra": dict(extra or {}),
        **({"training": training} if training is not None else {}),
    })
    write_export_manifest(out, [WEIGHTS_NAME, CONFIG_NAME])
    return out


def _config_path(path: Path) -> Path:
    if path.is_dir():
        return path / CONFIG_NAME
    return path


def read_export_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate the JSON half of an export (no weights loaded)."""
    p = _config_path(Path(path))
    if not p.exists():
        raise ForecasterExportError(f"no forecaster export at {path}: {p.name} not found")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ForecasterExportError(f"{p} is not a forecaster export: not valid JSON ({e})") from e
    check_format(cfg, EXPORT_FORMAT, EXPORT_FORMAT_VERSION, ForecasterExportError,
                 wrong_format=lambda found: f"{p} is not a forecaster export: format {found!r}, expected "
                                            f"{EXPORT_FORMAT!r}",
                 bad_version=lambda ver: f"{p}: forecaster export format version {ver!r} is not supported (this "
                                         f"expertcast reads 1..{EXPORT_FORMAT_VERSION})")
    require_keys(cfg, ("config", "weights", "weights_sha256"), ForecasterExportError,
                 lambda missing: f"{p}: forecaster export is missing the {missing[0]!r} entry")
    return cfg


def verify_export(path: str | os.PathLike) -> str:
    """Check the export's manifest (every file unaltered, none missing or extra); returns the export hash."""
    return verify_named_export(_config_path(Path(path)).parent, "forecaster export", ForecasterExportError)


def load_forecaster(path: str | os.PathLike, device: str | torch.device = "cpu") -> ForecasterExport:
    """Load an export directory (or its ``forecaster.json``) written by :func:`save_forecaster`."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    cfg = read_export_config(path)
    cpath = _config_path(Path(path))
    export_hash = verify_export(cpath.parent)
    version = cfg.get("format_version")
    if isinstance(cfg["config"], dict) and cfg["config"].get("backbone") == "mamba":
        raise ForecasterExportError(f"{cpath}: forecaster export format {version} with backbone 'mamba' (transformers' "
                                    "Mamba-1) cannot be loaded: expertcast's forecaster is its own Mamba-2 (refit it)")
    try:
        config = ForecasterConfig.from_dict(cfg["config"])
    except (TypeError, ValueError) as e:
        raise ForecasterExportError(f"{cpath}: invalid forecaster config: {e}") from e
    try:
        wpath = safe_member(cpath.parent, cfg["weights"])
    except UsageError as e:
        raise ForecasterExportError(f"{cpath}: {e}") from None
    if not wpath.exists():
        raise ForecasterExportError(f"{cpath}: weights file {wpath.name} is missing")
    blob = wpath.read_bytes()
    digest = hashlib.sha256(blob).hexdigest()
    if digest != cfg["weights_sha256"]:
        raise ForecasterExportError(
            f"{wpath} is corrupt or was replaced: sha256 {digest[:12]}... != {str(cfg['weights_sha256'])[:12]}... "
            "recorded in the export config"
        )
    try:
        tensors = load(blob)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise ForecasterExportError(f"{wpath}: cannot read safetensors weights ({e})") from e
    if version in LEGACY_BACKBONE_VERSIONS:  # transformers' Mamba2Model -> the project's (same names and shapes)
        tensors = {k: v for k, v in tensors.items() if k not in LEGACY_DROPPED}
    model = ExpertForecaster(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ForecasterExportError(
            f"{wpath}: weights do not match the forecaster config (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    bad = [k for k, v in tensors.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if bad:
        k = bad[0]
        raise ForecasterExportError(
            f"{wpath}: tensor {k} has shape {tuple(tensors[k].shape)}, the config implies {tuple(expected[k].shape)}"
        )
    model.load_state_dict(tensors, strict=True)
    model.to(device).eval()
    return ForecasterExport(model=model, config=config, source=dict(cfg.get("source") or {}),
                            extra=dict(cfg.get("extra") or {}), path=cpath.parent,
                            training=cfg.get("training"), export_hash=export_hash)


def training_ids(export_dir: str | os.PathLike) -> set[str] | None:
    """The sequence ids an export was trained or validated on (train ∪ val; held-out test ids are not
    included), or None for an export that records no ``training`` block. The export is verified first."""
    cfg = read_export_config(export_dir)
    verify_export(_config_path(Path(export_dir)).parent)
    training = cfg.get("training")
    if not isinstance(training, dict) or "train_ids" not in training:
        return None
    return set(training.get("train_ids") or []) | set(training.get("val_ids") or [])


def forecaster_fitted_on(export_dir: str | os.PathLike) -> FittedOn:
    """A forecaster export's record (verified first): its ``training`` block's train and validation ids and
    ``model`` (the trace set's model identity, recorded by ``expertcast fit``), else ``source.model_id``."""
    cfg = read_export_config(export_dir)
    ids = training_ids(export_dir)
    training = cfg.get("training") if isinstance(cfg.get("training"), dict) else {}
    source = cfg.get("source") if isinstance(cfg.get("source"), dict) else {}
    return FittedOn(f"the forecaster {export_dir}", None if ids is None else frozenset(ids),
                    model_of(training.get("model"), source.get("model_id")))
