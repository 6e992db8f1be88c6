"""A command's results in a W&B run of its own, with the inputs it consumed (lineage).

* :func:`use_input` declares an export, trace set or cue set a command consumed as an input artifact of its run,
  named by its kind and the content hash the command's outputs record (:func:`input_digest`);
* :func:`log_results` logs one command's inputs, tables, plots, series and exports in a run of its own (simulate,
  forecast-eval, stages eval, ...), through the W&B primitives of :mod:`expertcast.utils.tracking`.

Only commands declare inputs: a trace set's digest is its sequences' fingerprint, read with the data room's trace
reader, so this sits in the recipe room, above the library (docs/design.md "Layout").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from expertcast.utils.tracking import (
    artifact_name,
    log_export,
    log_image,
    log_series,
    log_table,
    start_wandb_run,
    wandb_module,
)

INPUT_TYPES = {"forecaster": "forecaster-export", "router": "router-export", "traces": "trace-set",
               "cue_set": "cue-set", "router_replay": "router-replay"}
"""W&B artifact type of each kind of input (the policies' file-option kinds, plus ``router``: a router export)."""


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
    ``run``: an artifact of type ``INPUT_TYPES[kind]`` named ``<type>-<first 16 hex of digest>`` (``digest``:
    the hash the command's outputs record, default :func:`input_digest`), metadata ``{path, sha256, kind}``,
    holding the input's identity files (its content is not uploaded). Online ``run.use_artifact``; offline,
    where wandb refuses ``use_artifact``, the artifact is logged marked for use after its commit (what
    ``use_artifact`` does with a new artifact), so ``wandb sync`` records the use. Returns the artifact."""
    p = Path(path).resolve()
    digest = digest or input_digest(p, kind)
    kind_type = INPUT_TYPES[kind]
    art = wandb_module().Artifact(artifact_name(f"{kind_type}-{digest[:16]}"), type=kind_type,
                            metadata={"path": str(p), "sha256": digest, "kind": kind})
    for f in _identity_files(p, kind):
        art.add_file(str(f), name=f.name)
    if run.offline:
        run._log_artifact(art, is_user_created=True, use_after_commit=True)
    else:
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


def log_results(project: str, job_type: str, name: str, config: Mapping[str, Any],
                tables: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
                images: Mapping[str, str | Path] | None = None,
                exports: Iterable[tuple[str | Path, str]] = (),
                inputs: Iterable[tuple[str | Path, str, str | None]] = (),
                series: Iterable[tuple[Sequence[Mapping[str, Any]], str, str | Sequence[str] | None,
                                       Sequence[str] | None]] = ()) -> str:
    """One W&B run for one command's results: ``inputs`` ((path, kind, digest) consumed, :func:`use_inputs`),
    ``tables`` (key -> rows), ``images`` (key -> PNG path), ``exports`` ((folder, kind) pairs), ``series``
    ((rows, axis, group, metrics) of :func:`log_series`). Returns the run's local directory."""
    run = start_wandb_run(project, dict(config), job_type=job_type, name=name)
    try:
        use_inputs(run, inputs)
        for rows, axis, group, metrics in series:
            log_series(run, axis, rows, group, metrics)
        for key, rows in (tables or {}).items():
            log_table(run, key, rows)
        for key, path in (images or {}).items():
            log_image(run, key, path)
        for folder, kind in exports:
            log_export(run, folder, kind)
        return str(Path(run.dir).parent)
    finally:
        run.finish()
