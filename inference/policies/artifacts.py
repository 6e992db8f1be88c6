"""The one loader of policy artefacts: file options -> the objects a policy is built with.

Policies do no I/O (docs/design.md, "Cache policies"): a policy's constructor takes its typed options and
the loaded objects as keyword-only arguments of the same names as its file options. :func:`load_artifacts`
fills every object the caller did not give from the options, driven by the file kinds of the options
(:attr:`~expertcast.inference.cache.options.PolicyOptions.file_options`) and the spec's ``needs``:

* ``forecaster`` (forecaster export) -> a :class:`~expertcast.models.forecaster_export.ForecasterExport`
  on the options' ``device``;
* ``calibration`` (trace set) -> its sequences;
* ``replay`` (router replay) -> a :class:`~expertcast.inference.policies.router.RouterReplay`;
* ``cue_set`` (cue-set JSON) -> a :class:`~expertcast.inference.saem.cues.CueSet`; for a policy that needs
  cues, without a cue set or cues, a ``tokenizer`` directory holding ``cues.json`` gives it;
* ``tokenizer`` (``needs`` names it and the options read tokens): the tokenizer named by the option, else
  by the cue set, unless a ``decoder`` was given.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from expertcast.inference.cache.spec import object_names

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.cache.options import PolicyOptions
    from expertcast.inference.cache.spec import PolicySpec


def load_forecaster_export(path: str, device: str = "cpu") -> Any:
    from expertcast.models.forecaster_export import load_forecaster

    return load_forecaster(path, device=device)


def load_calibration(path: str) -> list:
    from expertcast.data.traces import load_traces

    return load_traces(path)[1]


def load_router_replay(path: str) -> Any:
    from expertcast.inference.policies.router import RouterReplay

    return RouterReplay.load(path)


def load_cue_set(path: str | Path) -> Any:
    from expertcast.inference.saem.cues import CueSet

    return CueSet.load(path)


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer decoding a policy's tokens (a model directory, preset or Hub id)."""
    from expertcast.models.tokenizer import load_tokenizer as load

    return load(str(name_or_path))


LOADERS = {"forecaster": load_forecaster_export, "traces": load_calibration, "router_replay": load_router_replay,
           "cue_set": load_cue_set}
"""File kind -> loader (path -> object)."""


def load_artifacts(spec: PolicySpec, opts: PolicyOptions, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The constructor's objects of policy ``spec``: ``given`` (objects the caller loaded) completed from the
    file options of ``opts``; only objects the constructor takes are returned."""
    takes = set(object_names(spec.load()))
    out = dict(given or {})
    for name, kind in opts.file_options().items():
        path = getattr(opts, name)
        if name in takes and out.get(name) is None and path is not None:
            if kind == "forecaster":
                out[name] = load_forecaster_export(path, device=getattr(opts, "device", "cpu"))
            else:
                out[name] = LOADERS[kind](path)
    tok = getattr(opts, "tokenizer", None)
    if "cues" in spec.needs and "cue_set" in takes and out.get("cue_set") is None \
            and getattr(opts, "cues", None) is None and isinstance(tok, (str, Path)):
        from expertcast.inference.saem.cues import CUESET_FILENAME

        if (Path(tok) / CUESET_FILENAME).is_file():
            out["cue_set"] = load_cue_set(Path(tok) / CUESET_FILENAME)  # the model's own calibrated cue set
    if "tokenizer" in spec.needs and "tokenizer" in takes and out.get("tokenizer") is None \
            and out.get("decoder") is None and opts.reads_tokens():
        cue_set = out.get("cue_set")
        source = tok if tok is not None else getattr(cue_set, "tokenizer", None)
        if source is not None:
            out["tokenizer"] = load_tokenizer(source)
    return out
