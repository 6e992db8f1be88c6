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


def wandb_module() -> Any:
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
    return wandb_module().init(project=project, config=_jsonable(config), job_type=job_type, name=name,
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
    run.log({key: wandb_module().Table(columns=columns, data=data)})


def log_image(run: Any, key: str, path: str | Path) -> None:
    """Log the PNG at ``path`` under ``key`` (nothing when the command wrote no such file)."""
    if Path(path).is_file():
        run.log({key: wandb_module().Image(str(path))})


def artifact_name(text: str) -> str:
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
    from expertcast.utils.provenance import EXPORT_MANIFEST, sha256_files, verify_export_manifest

    d = Path(export_dir).resolve()
    digest = verify_export_manifest(d) if (d / EXPORT_MANIFEST).is_file() else sha256_files(d)
    files = sorted(p for p in d.rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(d).parts))
    meta: dict[str, Any] = {}
    for f in (p for p in files if p.parent == d and p.suffix == ".json"):
        try:
            meta[f.stem] = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    kind_type = INPUT_TYPES[kind]
    meta.update(path=str(d), sha256=digest, kind=kind)
    art = wandb_module().Artifact(exportartifact_name(kind, digest), type=kind_type, metadata=meta)
    if sum(p.stat().st_size for p in files) / 2**20 <= upload_limit_mb:
        for f in files:  # the export's files, not the output-folder marker and lock
            art.add_file(str(f), name=str(f.relative_to(d)))
    else:
        art.add_reference(f"file://{d}", checksum=False)
    return art


def exportartifact_name(kind: str, digest: str) -> str:
    """``<type>-<first 16 hex of the export hash>``: the name fit logs an export under and consumers use."""
    return artifact_name(f"{INPUT_TYPES[kind]}-{digest[:16]}")


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
        art = wandb_module().Artifact(artifact_name(name or f"{kind}-{d.resolve().name}"), type=kind)
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


def log_export_to_loggers(loggers: Iterable[Any], export_dir: str | Path) -> None:
    """After a fit: log the export as an artifact to every W&B logger of the trainer (none: nothing)."""
    for lg in loggers:
        if type(lg).__name__ == "WandbLogger":
            log_export(lg.experiment, export_dir, export_kind(export_dir))


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
        art = wandb_module().Artifact(artifact_name(f"checkpoints-{d.resolve().parent.name}"), type="model-checkpoint",
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
    """The records of a ``run-*.wandb`` transaction log (LevelDB log format after a 7-byte header); a record the
    file ends inside (wandb's service still writing it) is not yielded."""
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
        if pos + n > len(b):  # a live log: the writer has not finished this record; stop before it
            break
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
