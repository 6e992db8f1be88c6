"""The inputs a run declares (W&B lineage, docs/design.md "W&B lineage"): an export, trace set or cue set a command
or a fit consumed, as an input artifact named by its kind and the content hash the command's outputs record.

A trace set's digest is its sequences' fingerprint, read with this room's trace reader, so the input side of the
lineage sits in data/ (above utils/, whose :mod:`~expertcast.utils.tracking` holds the W&B primitives and the
export artifact that ``fit`` logs and every consumer uses by name).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from expertcast.utils.tracking import INPUT_TYPES, artifact_name, export_artifact, wandb_module


def input_digest(path: str | Path, kind: str) -> str:
    """The content hash a command's outputs record for an input: the ``export_hash`` of an export's manifest
    (forecaster, router), the sequences fingerprint of a trace set, the sha256 of a file (cue set) or of a
    folder's files."""
    from expertcast.utils.provenance import EXPORT_MANIFEST, sha256_file, sha256_files

    p = Path(path)
    if kind in ("forecaster", "router") and (p / EXPORT_MANIFEST).is_file():
        from expertcast.utils.provenance import verify_export_manifest

        return verify_export_manifest(p)
    if kind == "traces":
        from expertcast.data.trace_format import sequences_fingerprint
        from expertcast.data.traces import load_traces

        return sequences_fingerprint(load_traces(p)[1])
    return sha256_file(p) if p.is_file() else sha256_files(p)



def _identity_files(p: Path, kind: str) -> list[Path]:
    """The small files that identify an input: an export's manifest, a trace set's meta and manifest, a file
    input itself."""
    from expertcast.utils.provenance import EXPORT_MANIFEST

    if p.is_file():
        return [p]
    names = ("trace_meta.json", "manifest.json") if kind == "traces" else (EXPORT_MANIFEST,)
    return [p / n for n in names if (p / n).is_file()]



def use_input(run: Any, path: str | Path, kind: str, digest: str | None = None) -> Any:
    """Declare ``path`` (an export, trace set or cue set of ``kind``, a key of :data:`INPUT_TYPES`) an input of
    ``run``: an export as its :func:`export_artifact` (what ``fit`` logged), anything else an artifact of type
    ``INPUT_TYPES[kind]`` named ``<type>-<first 16 hex of digest>`` (``digest``: the hash the command's outputs
    record, default :func:`input_digest`), metadata ``{path, sha256, kind}``, holding the input's identity files
    (a trace set's content is not uploaded). Online ``run.use_artifact``; offline,
    where wandb refuses ``use_artifact``, the artifact is logged marked for use after its commit (what
    ``use_artifact`` does with a new artifact), so ``wandb sync`` records the use. Returns the artifact."""
    from expertcast.utils.provenance import EXPORT_MANIFEST

    p = Path(path).resolve()
    if kind in ("forecaster", "router") and (p / EXPORT_MANIFEST).is_file():
        art = export_artifact(p, kind)  # the very artifact `fit` logged: same name, same files, same version
    else:
        digest = digest or input_digest(p, kind)
        kind_type = INPUT_TYPES[kind]
        art = wandb_module().Artifact(artifact_name(f"{kind_type}-{digest[:16]}"), type=kind_type,
                                metadata={"path": str(p), "sha256": digest, "kind": kind})
        for f in _identity_files(p, kind):
            art.add_file(str(f), name=f.name)
    if run.offline:
        run._log_artifact(art, is_user_created=True, use_after_commit=True)
    else:
        try:  # by name: the version the fit logged (its files are the same, so its digest is too)
            art = run.use_artifact(f"{art.name}:latest")
        except Exception:  # never logged online (a fit offline, an export made by hand): this content's version
            run.use_artifact(art)
    return art



def use_inputs(run: Any, inputs: Iterable[tuple[str | Path, str, str | None]]) -> None:
    """:func:`use_input` for each ``(path, kind, digest or None)``, each input once; ``run`` None: nothing."""
    if run is None:
        return
    seen = set()
    for path, kind, digest in inputs:
        key = (kind, str(Path(path).resolve()))
        if key not in seen:
            seen.add(key)
            use_input(run, path, kind, digest)



def policy_inputs(files: Mapping[str, str | Path], kinds: Mapping[str, str],
                  digests: Mapping[str, str | None] | None = None) -> list[tuple[str, str, str | None]]:
    """The ``(path, kind, digest)`` inputs of a policy's file options ``files`` (option -> path), ``kinds``
    (option -> file kind, :data:`~expertcast.inference.cache.options.FILE_KINDS`), ``digests`` (option -> the
    hash the outputs record, when known)."""
    return [(str(v), kinds[k], (digests or {}).get(k)) for k, v in files.items() if kinds.get(k) in INPUT_TYPES]



def use_inputs_of_loggers(loggers: Iterable[Any], inputs: Iterable[tuple[str | Path, str, str | None]]) -> None:
    """After a fit: declare its inputs (the trace sets it was fitted on) to every W&B logger of the trainer."""
    inputs = list(inputs)
    for lg in loggers:
        if type(lg).__name__ == "WandbLogger" and inputs:
            use_inputs(lg.experiment, inputs)


