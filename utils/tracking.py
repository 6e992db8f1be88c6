"""Experiment tracking with W&B beyond scalars: result tables, plots and exports.

wandb is imported only when a run is asked for (``--wandb``), so that `inference/` and `models/` never
import it. ``WANDB_MODE=offline`` (the tests') writes the run under ``$WANDB_DIR/wandb/offline-run-*``,
to be uploaded later with ``wandb sync``.

* :func:`log_table` logs rows (list of dicts) as a ``wandb.Table``; :func:`log_image` a PNG;
* :func:`log_export` logs an export folder (forecaster, routers, fine-tuned model) as an artifact whose
  metadata holds the export's JSON files (its config, training block, manifest);
* :func:`log_results` does all three for one command in a run of its own (simulate, forecast-eval,
  stages eval, ...); :func:`log_export_to_loggers` finds the W&B run of a Lightning fit,
  :func:`log_checkpoints_to_loggers` logs its checkpoints there;
* :func:`use_input` declares an export, trace set or cue set a command consumed as an input artifact of its
  run (lineage), named by its kind and the content hash the command's outputs record;
  :func:`define_step_axis` gives a run's series their step axis (``define_metric``);
* :func:`offline_run_contents` reads an offline run back (tables, images, artifacts used and logged, step
  axes); ``scripts/wandb_lineage.py RUN_DIR`` prints its lineage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def add_wandb_args(parser: Any, project: str = "expertcast") -> None:
    """``--wandb`` and ``--wandb-project`` on a command's parser."""
    parser.add_argument("--wandb", action="store_true", help="also log the tables, plots and exports to W&B")
    parser.add_argument("--wandb-project", default=project, help="W&B project (WANDB_MODE=offline to log locally)")


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as e:  # pragma: no cover - wandb is a core dependency
        raise RuntimeError("--wandb needs the wandb package (pip install wandb)") from e
    return wandb


def start_wandb_run(project: str, config: dict[str, Any], job_type: str, name: str) -> Any:
    """Start a W&B run (honours ``WANDB_MODE=offline``); returns the run, whose ``log``/``finish`` the
    caller uses. A missing wandb package is a clear error."""
    import os

    # the folder is read now: wandb caches its settings at the first run of the process; "create_new": a run
    # another caller left open in this process (a trainer's WandbLogger) is never reused for this one
    return _wandb().init(project=project, config=_jsonable(config), job_type=job_type, name=name,
                         dir=os.environ.get("WANDB_DIR") or None, reinit="create_new")


def _jsonable(v: Any) -> Any:
    return json.loads(json.dumps(v, default=str))


def _cell(v: Any) -> Any:
    """A table cell: scalars as they are, anything else as JSON text."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return json.dumps(_jsonable(v))


def log_table(run: Any, key: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Log ``rows`` (the command's printed table) as a ``wandb.Table`` under ``key``; the columns are the
    union of the rows' keys in first-seen order (a column mixing text and numbers, such as a layer column
    with an ``all`` row, is logged as text)."""
    columns: list[str] = []
    for r in rows:
        columns += [str(k) for k in r if str(k) not in columns]
    data = [[_cell(r.get(c)) for c in columns] for r in rows]
    for j in range(len(columns)):  # a wandb.Table column holds one type: one mixing text and numbers is text
        if len({isinstance(row[j], str) for row in data if row[j] is not None}) > 1:
            for row in data:
                row[j] = None if row[j] is None else str(row[j])
    run.log({key: _wandb().Table(columns=columns, data=data)})


def log_image(run: Any, key: str, path: str | Path) -> None:
    """Log the PNG at ``path`` under ``key`` (nothing when the command wrote no such file)."""
    if Path(path).is_file():
        run.log({key: _wandb().Image(str(path))})


def _artifact_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.") or "export"


UPLOAD_LIMIT_MB = 2048.0
"""Exports up to this size are uploaded; larger ones (a fine-tuned 30B model) are logged as a reference to
their folder (W&B records the paths, the metadata still holds the export manifest's sha256 of every file)."""


def export_artifact(export_dir: str | Path, kind: str, upload_limit_mb: float = UPLOAD_LIMIT_MB) -> Any:
    """The one artifact of an export (docs/design.md, "W&B lineage"): type ``INPUT_TYPES[kind]``
    (``forecaster-export``, ``router-export``), named ``<type>-<first 16 hex of its export_hash>``, holding the
    export's files (hidden ones, the output-folder marker and lock, left out; above ``upload_limit_mb`` a
    reference to the folder), metadata every top-level JSON file by name (config, training block, manifest) plus
    ``{path, sha256, kind}``. ``fit`` logs it and every consumer uses it by that name, so the same content is
    the same artifact version and a consumer's run leads back to the fit's."""
    from expertcast.utils.provenance import EXPORT_MANIFEST, verify_export_manifest

    d = Path(export_dir).resolve()
    digest = verify_export_manifest(d) if (d / EXPORT_MANIFEST).is_file() else input_digest(d, kind)
    files = sorted(p for p in d.rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(d).parts))
    meta: dict[str, Any] = {}
    for f in (p for p in files if p.parent == d and p.suffix == ".json"):
        try:
            meta[f.stem] = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    kind_type = INPUT_TYPES[kind]
    meta.update(path=str(d), sha256=digest, kind=kind)
    art = _wandb().Artifact(export_artifact_name(kind, digest), type=kind_type, metadata=meta)
    if sum(p.stat().st_size for p in files) / 2**20 <= upload_limit_mb:
        for f in files:  # the export's files, not the output-folder marker and lock
            art.add_file(str(f), name=str(f.relative_to(d)))
    else:
        art.add_reference(f"file://{d}", checksum=False)
    return art


def export_artifact_name(kind: str, digest: str) -> str:
    """``<type>-<first 16 hex of the export hash>``: the name fit logs an export under and consumers use."""
    return _artifact_name(f"{INPUT_TYPES[kind]}-{digest[:16]}")


def log_export(run: Any, export_dir: str | Path, kind: str, name: str | None = None,
               upload_limit_mb: float = UPLOAD_LIMIT_MB) -> Any:
    """Log the export folder ``export_dir`` (``kind``: ``forecaster``, ``router`` or ``model``, a
    router-adaptation export holding its fine-tuned model) as its :func:`export_artifact`, an output of ``run``.
    Another ``kind`` (no export type of its own) is logged under ``name`` (default ``<kind>-<folder>``) with its
    files. Returns the artifact."""
    kind = "router" if kind == "model" else kind
    if kind in ("forecaster", "router"):
        art = export_artifact(export_dir, kind, upload_limit_mb)
    else:
        d = Path(export_dir)
        art = _wandb().Artifact(_artifact_name(name or f"{kind}-{d.resolve().name}"), type=kind)
        for f in sorted(p for p in d.rglob("*") if p.is_file() and not p.name.startswith(".")):
            art.add_file(str(f), name=str(f.relative_to(d)))
    run.log_artifact(art)
    return art


def export_kind(export_dir: str | Path) -> str:
    """``model`` for an export holding a fine-tuned model (``model/``), else the kind its files name
    (``forecaster``/``router``), else ``export``."""
    d = Path(export_dir)
    if (d / "model").is_dir():
        return "model"
    names = " ".join(p.name for p in d.iterdir()) if d.is_dir() else ""
    return next((k for k in ("forecaster", "router") if k in names), "export")


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
        art = _wandb().Artifact(_artifact_name(f"{kind_type}-{digest[:16]}"), type=kind_type,
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


def define_step_axis(run: Any, axis: str, metrics: Iterable[str]) -> None:
    """Plot ``metrics`` of ``run`` against ``axis`` (``define_metric``): per-batch, per-capacity or per-step
    series get their own x-axis instead of wandb's log counter."""
    run.define_metric(axis)
    for m in metrics:
        if m != axis:
            run.define_metric(m, step_metric=axis)


def log_series(run: Any, axis: str, rows: Sequence[Mapping[str, Any]], group: str | Sequence[str] | None = None,
               metrics: Sequence[str] | None = None) -> None:
    """Log the numeric columns of ``rows`` (those in ``metrics`` when given) as series over the column ``axis``
    (one point per row), each named ``<group values>/<column>`` when ``group`` names columns (one curve per
    policy), with their step axis defined (:func:`define_step_axis`). Rows without a numeric ``axis`` are
    skipped."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    groups = [group] if isinstance(group, str) else list(group or ())
    points = []
    for r in rows:
        if not number(r.get(axis)):
            continue
        # "/" sections W&B's panels (only the one before the metric's name) and "." nests a metric's name
        prefix = re.sub(r"[/.]", "_", " ".join(str(r.get(g)) for g in groups)) + "/" if groups else ""
        vals = {f"{prefix}{k}": v for k, v in r.items() if k != axis and k not in groups and number(v)
                and (metrics is None or k in metrics)}
        points.append((r[axis], vals))
    define_step_axis(run, axis, sorted({k for _, v in points for k in v}))
    for x, vals in sorted(points, key=lambda t: t[0]):
        run.log({axis: x, **vals})


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


def log_export_to_loggers(loggers: Iterable[Any], export_dir: str | Path) -> None:
    """After a fit: log the export as an artifact to every W&B logger of the trainer (none: nothing)."""
    for lg in loggers:
        if type(lg).__name__ == "WandbLogger":
            log_export(lg.experiment, export_dir, export_kind(export_dir))


def use_inputs_of_loggers(loggers: Iterable[Any], inputs: Iterable[tuple[str | Path, str, str | None]]) -> None:
    """After a fit: declare its inputs (the trace sets it was fitted on) to every W&B logger of the trainer."""
    inputs = list(inputs)
    for lg in loggers:
        if type(lg).__name__ == "WandbLogger" and inputs:
            use_inputs(lg.experiment, inputs)


def log_checkpoints_to_loggers(loggers: Iterable[Any], ckpt_dir: str | Path, **metadata: Any) -> None:
    """After a fit (``expertcast fit --wandb-checkpoints``): log the checkpoints of ``ckpt_dir`` (``*.ckpt``)
    as one artifact of type ``model-checkpoint`` to every W&B logger of the trainer, named after the run
    directory, with ``metadata`` (step, export hash) and each file's size. Lightning's ``log_model`` refuses
    offline loggers; this works offline too."""
    d = Path(ckpt_dir)
    files = sorted(p for p in d.glob("*.ckpt") if p.is_file())
    for lg in loggers:
        if type(lg).__name__ != "WandbLogger" or not files:
            continue
        art = _wandb().Artifact(_artifact_name(f"checkpoints-{d.resolve().parent.name}"), type="model-checkpoint",
                                metadata={**_jsonable(metadata), "files": {p.name: p.stat().st_size for p in files}})
        for f in files:
            art.add_file(str(f), name=f.name)
        lg.experiment.log_artifact(art)


def finish_wandb_loggers(loggers: Iterable[Any]) -> None:
    """End the W&B run of every W&B logger that started one, so that the run a fit opened is closed when the
    fit returns (a later run in the same process must not be logged into it)."""
    for lg in loggers:
        if type(lg).__name__ == "WandbLogger" and getattr(lg, "_experiment", None) is not None:
            lg.experiment.finish()


def _wandb_records(path: Path) -> Iterable[bytes]:
    """The records of a ``run-*.wandb`` transaction log (LevelDB log format after a 7-byte header)."""
    import struct

    b, pos, block, buf = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(b):
        room = block - pos % block
        if room < 7:  # block trailer
            pos += room
            continue
        _crc, n, kind = struct.unpack("<IHB", b[pos:pos + 7])
        pos += 7
        if n == 0 and kind == 0:  # zero padding to the end of the block
            pos += room - 7
            continue
        buf += b[pos:pos + n]
        pos += n
        if kind in (1, 4):  # FULL or LAST fragment
            yield buf
            buf = b""


def offline_run_contents(run_dir: str | Path) -> dict[str, Any]:
    """What an offline run directory (``wandb/offline-run-*``) holds: its table and image files, the
    artifacts its transaction log records (name, type, files, metadata keys, ``digest``: W&B's content digest, equal
    for the same version; ``used``: an input of the run, :func:`use_input`, else logged by the run; the ``sha256`` and
    ``path`` of its metadata) and the step
    axes of its metrics (``define_metric``: metric -> step metric)."""
    from wandb.proto import wandb_internal_pb2 as pb

    d = Path(run_dir)
    media = d / "files" / "media"
    out: dict[str, Any] = {"run_dir": str(d), "artifacts": [], "step_axes": {},
                           "tables": sorted(str(p.relative_to(d)) for p in media.glob("table/**/*.table.json")),
                           "images": sorted(str(p.relative_to(d)) for p in media.glob("images/**/*.png"))}
    for log in d.glob("run-*.wandb"):
        for data in _wandb_records(log):
            rec = pb.Record()
            rec.ParseFromString(data)
            kind = rec.WhichOneof("record_type")
            if kind == "artifact":
                a = rec.artifact
                meta = json.loads(a.metadata or "{}")
                out["artifacts"].append({"name": a.name, "type": a.type, "files": [c.path for c in a.manifest.contents],
                                         "metadata": sorted(meta), "used": bool(a.use_after_commit),
                                         "sha256": meta.get("sha256"), "path": meta.get("path"),
                                         "digest": a.digest})
            elif kind == "metric" and rec.metric.name:
                out["step_axes"][rec.metric.name] = rec.metric.step_metric or None
    return out
