"""The one guard between what an artefact was fitted on and what it is scored on (docs/design.md, "Provenance").

A forecaster export, a router-adaptation export and a cue set each record what they were fitted on: the sequence
(or text) ids of their fit and validation sets, and the identity of the model whose routing they learnt
(:func:`expertcast.models.backbone.model_identity`, or only the model id a trace set records). Each artefact's own
module turns that record into a :class:`FittedOn` (``forecaster_export.forecaster_fitted_on``,
``router_export.router_fitted_on``, ``CueSet.fitted_on``); every entry point that scores one calls :func:`check_fitted_on` with the ids it scores and
the identity of the model whose routing it replays or runs:

* scoring sequences the artefact was fitted on (or an artefact recording no ids) is an :class:`OverlapError`
  unless ``allow_overlap`` (:func:`~expertcast.utils.provenance.check_overlap`);
* scoring another model's routing is a :class:`ModelMismatchError` unless ``allow_model_mismatch``. A router-adapted
  model routes differently from its base, so its identity (its own folder's files) never matches the base's.

The returned dict goes into the command's header (:func:`guard_note`) and its JSON.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expertcast.utils.errors import UsageError


class ModelMismatchError(UsageError):
    """An artefact fitted on one model's routing is scored on another model's."""


@dataclass(frozen=True)
class FittedOn:
    """What an artefact was fitted on (see the module docstring)."""

    what: str
    """The artefact, for messages: ``"the forecaster runs/x/export"``."""
    ids: frozenset[str] | None
    """Sequence ids of its fit and validation sets; None: it records none."""
    model: Mapping[str, Any] | None
    """Identity of the model whose routing it learnt (``model_identity``'s dict, or ``{"path": model id}``)."""
    verb: str = "fitted"
    """How it learnt from them, for messages (a cue set is ``calibrated``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "ids": None if self.ids is None else len(self.ids),
                "model": dict(self.model) if self.model else None}


def model_of(identity: Mapping[str, Any] | None = None, model_id: str | None = None) -> dict[str, Any] | None:
    """A model identity from what a record holds: ``identity`` (``model_identity``'s dict) when it has a path,
    else the bare ``model_id`` string (what an imported trace set or an older artefact records), else None."""
    if isinstance(identity, Mapping) and identity.get("path"):
        return dict(identity)
    return {"path": str(model_id)} if model_id else None


def _strong(ident: Mapping[str, Any]) -> tuple[Any, ...] | None:
    if ident.get("files_sha256"):
        return ("files", ident["files_sha256"])
    if ident.get("preset"):
        return ("preset", ident["preset"], ident.get("init_seed"))
    if ident.get("revision"):
        return ("hub", ident.get("path"), ident["revision"])
    return None


def _same_path(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def same_model(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool | None:
    """Whether two identities name the same weights: by their hashes (or preset + seed, Hub id + revision) when
    both record one of the same form, else by path (the same string, or two paths of one folder). None when
    either is unknown."""
    if not a or not b or not a.get("path") or not b.get("path"):
        return None
    sa, sb = _strong(a), _strong(b)
    if sa is not None and sb is not None and sa[0] == sb[0]:
        if sa[0] == "preset" and None in (sa[2], sb[2]):  # one side records no init seed: the preset decides
            return sa[1] == sb[1]
        return sa == sb
    return _same_path(str(a["path"]), str(b["path"]))


def describe_model(ident: Mapping[str, Any] | None, short: bool = False) -> str:
    """A model identity for a message: its path (``short``: without the machine's folders, for titles) and
    what fixes its weights (the first 12 hex of its files' hash, its preset and seed, its Hub revision)."""
    from expertcast.utils.paths import display_path

    if not ident:
        return "an unrecorded model"
    s = _strong(ident)
    tail = "" if s is None else f" ({s[0]} {str(s[1])[:12] if s[0] == 'files' else ' '.join(map(str, s[1:]))})"
    path = display_path(ident.get("path")) if short else ident.get("path")
    return f"{path!r}{tail}"


def check_fitted_on(fitted: FittedOn, evaluated_ids: Iterable[str] | None, model: Mapping[str, Any] | None, *,
                    scored: str = "the evaluated sequences", allow_overlap: bool = False,
                    allow_model_mismatch: bool = False,
                    mismatch_hint: str = "fit it on this model's traces or pass --allow-model-mismatch (reported "
                                         "in the output)") -> dict[str, Any]:
    """Refuse scoring ``fitted`` on its own fit sequences or on another model's routing (module docstring).

    ``evaluated_ids``: the sequence ids scored (None: the entry point scores no recorded sequences, e.g. live
    generation on prompts checked elsewhere); ``model``: the identity of the model whose routing is scored.
    Returns ``{"overlap", "evaluated", "allowed", "model_match", "model_mismatch_allowed", "fitted_model",
    "scored_model"}`` (``model_match`` None: one side records no model)."""
    from expertcast.utils.provenance import check_overlap

    out: dict[str, Any] = {}
    if evaluated_ids is not None:
        out.update(check_overlap(evaluated_ids, fitted.ids, what=fitted.what, allow_overlap=allow_overlap))
    match = same_model(fitted.model, model)
    if match is False and not allow_model_mismatch:
        raise ModelMismatchError(
            f"{fitted.what} was {fitted.verb} on model {describe_model(fitted.model)} but {scored} come from model "
            f"{describe_model(model)} (another model's routing; a router-adapted model routes unlike its base); "
            f"{mismatch_hint}")
    out.update(model_match=match, model_mismatch_allowed=match is False,
               fitted_model=dict(fitted.model) if fitted.model else None, scored_model=dict(model) if model else None)
    return out


def guard_note(results: Mapping[str, Mapping[str, Any]]) -> str | None:
    """One line naming every allowed overlap and model mismatch of ``{label: check_fitted_on result}``, or None."""
    parts = []
    for label, r in results.items():
        if "overlap" in r and r.get("overlap") is None:
            parts.append(f"{label} records no fit ids (--allow-overlap)")
        elif r.get("overlap"):
            parts.append(f"{label} was fitted on {r['overlap']} of the {r['evaluated']} scored sequences "
                         f"(--allow-overlap)")
        if r.get("model_match") is False:
            parts.append(f"{label} was fitted on model {describe_model(r.get('fitted_model'), True)}, scored on "
                         f"{describe_model(r.get('scored_model'), True)} (--allow-model-mismatch)")
    return "; ".join(parts) or None


def trace_set_model(trace_dir: str | os.PathLike | None, model_id: str | None) -> dict[str, Any] | None:
    """The identity of the model a trace set's routing comes from: the ``model`` its manifest's run settings
    record (``expertcast collect``), else ``model_id`` (None: the one its ``trace_meta.json`` records)."""
    ident = None
    if trace_dir is not None:
        run = _json(Path(trace_dir) / "manifest.json").get("run")
        if isinstance(run, Mapping):
            ident = run.get("model")
        if model_id is None:
            model_id = _json(Path(trace_dir) / "trace_meta.json").get("model_id")
    return model_of(ident, model_id)


def _json(path: Path) -> dict[str, Any]:
    import json

    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}
