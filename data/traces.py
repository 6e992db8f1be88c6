"""Routing traces on disk: a directory of Arrow shards written through `datasets` (DESIGN.md).

Layout of a trace set ``DIR``::

    DIR/trace_meta.json          TraceMeta (also in every shard's dataset info)
    DIR/manifest.json            finished shards: rows, tokens, file sizes; the run's settings; complete flag
    DIR/shard-00000/             Dataset.save_to_disk output (one row per sequence)
    DIR/shard-00001/ ...

A shard is written to a temporary directory and renamed into place, then the manifest is updated
atomically; an interrupted run therefore leaves only whole shards, and :class:`TraceWriter` resumes
from them (a shard that was renamed but not yet listed in the manifest is checked and adopted).

Row schema: ``seq_id`` string, ``prompt_len`` int32, ``token_ids`` int32 [T], ``expert_ids`` int16
[T, L, K], ``expert_weights`` float16 [T, L, K], optional ``router_probs`` float16 [T, L, E].
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.trace_format import TRACE_FORMAT_VERSION, TraceMeta, TraceSequence
from expertcast.utils.io import atomic_write_json

META_FILE = "trace_meta.json"
MANIFEST_FILE = "manifest.json"
SHARD_PREFIX = "shard-"
_TMP_PREFIX = ".tmp-shard-"
_INFO_TAG = "expertcast-trace-meta:"


class TraceFormatError(ValueError):
    """A trace directory or shard is missing, corrupt, truncated, empty or from another run."""


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:05d}"


def trace_features(num_layers: int, top_k: int, num_experts: int | None = None):
    """`datasets.Features` of a trace row; ``num_experts`` given = with ``router_probs``."""
    from datasets import Array3D, Features, List, Value

    feats = {
        "seq_id": Value("string"),
        "prompt_len": Value("int32"),
        "token_ids": List(Value("int32")),
        "expert_ids": Array3D(shape=(None, num_layers, top_k), dtype="int16"),
        "expert_weights": Array3D(shape=(None, num_layers, top_k), dtype="float16"),
    }
    if num_experts is not None:
        feats["router_probs"] = Array3D(shape=(None, num_layers, num_experts), dtype="float16")
    return Features(feats)


@contextmanager
def _quiet_datasets():
    import datasets.utils as ds_utils
    from datasets.utils import logging as ds_logging

    was = ds_utils.are_progress_bars_disabled()
    level = ds_logging.get_verbosity()
    ds_utils.disable_progress_bars()
    ds_logging.set_verbosity_error()
    try:
        yield
    finally:
        if not was:
            ds_utils.enable_progress_bars()
        ds_logging.set_verbosity(level)


def _dir_sizes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}


def _check_sequence(seq: TraceSequence, meta: TraceMeta) -> None:
    L, K, E = meta.num_layers, meta.top_k, meta.num_experts
    if seq.num_tokens == 0:
        raise ValueError(f"sequence {seq.seq_id}: no tokens")
    if seq.expert_ids.shape[1:] != (L, K):
        raise ValueError(
            f"sequence {seq.seq_id}: expert_ids {seq.expert_ids.shape} do not match the trace's [T, L={L}, K={K}]"
        )
    if seq.expert_ids.size and (seq.expert_ids.min() < 0 or seq.expert_ids.max() >= E):
        raise ValueError(f"sequence {seq.seq_id}: expert ids outside [0, E={E})")
    if meta.has_router_probs:
        if seq.router_probs is None or seq.router_probs.shape[1:] != (L, E):
            got = None if seq.router_probs is None else seq.router_probs.shape
            raise ValueError(f"sequence {seq.seq_id}: router_probs {got} but the trace needs [T, L={L}, E={E}]")
    elif seq.router_probs is not None:
        raise ValueError(f"sequence {seq.seq_id}: router_probs given but the trace meta has has_router_probs=False")


def _row(seq: TraceSequence, with_probs: bool) -> dict[str, Any]:
    r = {
        "seq_id": str(seq.seq_id),
        "prompt_len": int(seq.prompt_len),
        "token_ids": np.asarray(seq.token_ids, dtype=np.int32),
        "expert_ids": np.asarray(seq.expert_ids, dtype=np.int16),
        "expert_weights": np.asarray(seq.expert_weights, dtype=np.float16),
    }
    if with_probs:
        r["router_probs"] = np.asarray(seq.router_probs, dtype=np.float16)
    return r


def _meta_diff(a: TraceMeta, b: TraceMeta) -> list[str]:
    keys = ("model_id", "num_layers", "num_experts", "top_k", "has_router_probs", "dataset", "split", "format_version")
    da, db = a.to_dict(), b.to_dict()
    return [f"{k}: {da[k]!r} vs {db[k]!r}" for k in keys if da[k] != db[k]]


class TraceWriter:
    """Writes a trace set shard by shard, resumably.

    ``run`` is a JSON-able dict of the settings that produced the traces (model, benchmark, limit,
    generation settings, shard size...): resuming into a directory whose manifest holds different
    settings or a different :class:`TraceMeta` is refused unless ``overwrite=True`` (which deletes
    the old trace set first).
    """

    def __init__(self, out_dir: str | os.PathLike, meta: TraceMeta, run: dict[str, Any] | None = None,
                 overwrite: bool = False):
        self.dir = Path(out_dir)
        self.meta = meta
        self.run = json.loads(json.dumps(run or {}, default=str))
        self.features = trace_features(meta.num_layers, meta.top_k, meta.num_experts if meta.has_router_probs else None)
        if overwrite and self.dir.exists():
            if self.dir.is_dir() and not (self.dir / META_FILE).exists() and any(self.dir.iterdir()):
                raise TraceFormatError(f"refusing to overwrite {self.dir}: it is not empty and not a trace set")
            shutil.rmtree(self.dir)
        if self.dir.exists() and not self.dir.is_dir():
            raise TraceFormatError(f"{self.dir} exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest = self._open()

    # -- set-up / resume -------------------------------------------------------------------------
    def _open(self) -> dict[str, Any]:
        meta_path = self.dir / META_FILE
        man_path = self.dir / MANIFEST_FILE
        if meta_path.exists():
            old = read_meta(self.dir)
            diff = _meta_diff(old, self.meta)
            if diff:
                raise TraceFormatError(
                    f"{self.dir} holds traces of another run ({'; '.join(diff)}); use another --out or --overwrite"
                )
            manifest = _read_json(man_path) if man_path.exists() else {"shards": {}}
            old_run = manifest.get("run", {})
            if old_run and self.run and old_run != self.run:
                changed = sorted(k for k in set(old_run) | set(self.run) if old_run.get(k) != self.run.get(k))
                raise TraceFormatError(
                    f"{self.dir} holds a run with other settings (changed: {', '.join(changed)}); "
                    f"use another --out or --overwrite"
                )
        else:
            if any(p.name.startswith(SHARD_PREFIX) for p in self.dir.iterdir()):
                raise TraceFormatError(f"{self.dir} holds shards but no {META_FILE}: not a trace set of expertcast")
            manifest = {"shards": {}}
        manifest.update(format_version=TRACE_FORMAT_VERSION, run=self.run or manifest.get("run", {}))
        manifest.setdefault("complete", False)
        # leftovers of an interrupted write: temp dirs are dropped, renamed-but-unlisted shards adopted
        for p in self.dir.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
        for key, entry in list(manifest["shards"].items()):
            # a listed shard that is gone or whose files changed size is redone
            d = self.dir / (SHARD_PREFIX + key)
            if not d.is_dir() or ("files" in entry and _dir_sizes(d) != entry["files"]):
                del manifest["shards"][key]
                shutil.rmtree(d, ignore_errors=True)
        for p in sorted(self.dir.glob(f"{SHARD_PREFIX}*")):
            key = p.name[len(SHARD_PREFIX):]
            if key in manifest["shards"]:
                continue
            try:
                ds = _load_shard(p, self.meta)
                manifest["shards"][key] = {
                    "num_sequences": len(ds), "num_tokens": int(sum(len(t) for t in ds["token_ids"])),
                    "seq_ids": [str(x) for x in ds["seq_id"]], "files": _dir_sizes(p),
                }
            except TraceFormatError:
                shutil.rmtree(p)  # unlisted and unreadable: redo it
        atomic_write_json(meta_path, self.meta.to_dict())
        atomic_write_json(self.dir / MANIFEST_FILE, manifest)
        return manifest

    @property
    def finished_shards(self) -> set[int]:
        return {int(k) for k in self.manifest["shards"]}

    def is_done(self, index: int) -> bool:
        return f"{index:05d}" in self.manifest["shards"]

    def check_done_shard(self, index: int, seq_ids: list[str]) -> None:
        """Raise TraceFormatError when finished shard ``index`` holds other sequences than ``seq_ids``
        (the input changed since the interrupted run)."""
        got = self.manifest["shards"][f"{index:05d}"].get("seq_ids")
        if got is not None and list(got) != [str(x) for x in seq_ids]:
            raise TraceFormatError(
                f"finished shard {shard_name(index)} of {self.dir} holds sequences {got[:3]}... but this run's input "
                f"puts {list(seq_ids)[:3]}... there: the input changed; use another --out or --overwrite"
            )

    # -- writing -----------------------------------------------------------------------------------
    def write_shard(self, index: int, sequences: Iterable[TraceSequence]) -> Path:
        """Write ``sequences`` as shard ``index`` (atomic) and record it in the manifest."""
        from datasets import Dataset, DatasetInfo

        seqs = list(sequences)
        if not seqs:
            raise ValueError(f"shard {index}: no sequences to write")
        for s in seqs:
            _check_sequence(s, self.meta)
        final = self.dir / shard_name(index)
        if self.is_done(index):
            raise TraceFormatError(f"shard {final.name} is already finished in {self.dir}")
        info = DatasetInfo(description=_INFO_TAG + json.dumps(self.meta.to_dict()), features=self.features)
        ds = Dataset.from_list([_row(s, self.meta.has_router_probs) for s in seqs], features=self.features, info=info)
        tmp = Path(tempfile.mkdtemp(dir=self.dir, prefix=f"{_TMP_PREFIX}{index:05d}-"))
        try:
            with _quiet_datasets():
                ds.save_to_disk(str(tmp / "d"))
            if final.exists():  # an unlisted leftover that failed validation was removed in _open
                shutil.rmtree(final)
            os.replace(tmp / "d", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.manifest["shards"][f"{index:05d}"] = {
            "num_sequences": len(seqs),
            "num_tokens": int(sum(s.num_tokens for s in seqs)),
            "seq_ids": [str(s.seq_id) for s in seqs],
            "files": _dir_sizes(final),
        }
        self.manifest["complete"] = False
        atomic_write_json(self.dir / MANIFEST_FILE, self.manifest)
        return final

    def finalize(self, **summary: Any) -> None:
        """Mark the trace set complete (``summary`` is stored in the manifest, e.g. tokens/s)."""
        if not self.manifest["shards"]:
            raise TraceFormatError(f"{self.dir}: no shard was written (empty input?)")
        self.manifest["complete"] = True
        if summary:
            self.manifest["summary"] = json.loads(json.dumps(summary, default=str))
        atomic_write_json(self.dir / MANIFEST_FILE, self.manifest)


# -- reading ---------------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TraceFormatError(f"{path} is unreadable or not valid JSON ({e})") from None


def is_trace_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_meta(path: str | os.PathLike) -> TraceMeta:
    """The :class:`TraceMeta` of trace set ``path`` (TraceFormatError when ``path`` is not one)."""
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(f"trace set {p} does not exist")
    if not is_trace_dir(p):
        raise TraceFormatError(
            f"{p} is not a trace set: no {META_FILE} (expected an --out directory of `expertcast collect` "
            f"or `expertcast traces import`)"
        )
    d = _read_json(p / META_FILE)
    try:
        meta = TraceMeta.from_dict(d)
    except TypeError as e:
        raise TraceFormatError(f"{p / META_FILE} is not a trace meta file ({e})") from None
    if meta.format_version > TRACE_FORMAT_VERSION:
        raise TraceFormatError(
            f"{p} has trace format version {meta.format_version}; this expertcast reads up to {TRACE_FORMAT_VERSION}"
        )
    return meta


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path) / MANIFEST_FILE
    return _read_json(p) if p.exists() else {"shards": {}}


def _load_shard(shard: Path, meta: TraceMeta, expected: dict[str, Any] | None = None):
    """Load and validate one shard directory; TraceFormatError naming it on any problem."""
    from datasets import load_from_disk

    if expected and "files" in expected:
        for fname, size in expected["files"].items():
            f = shard / fname
            if not f.is_file():
                raise TraceFormatError(f"shard {shard.name} of {shard.parent} is incomplete: {fname} is missing")
            if f.stat().st_size != size:
                raise TraceFormatError(
                    f"shard {shard.name} of {shard.parent} is truncated or corrupt: {fname} has "
                    f"{f.stat().st_size} bytes, the manifest recorded {size}"
                )
    try:
        with _quiet_datasets():
            ds = load_from_disk(str(shard))
        n = len(ds)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TraceFormatError(f"shard {shard.name} of {shard.parent} is corrupt or truncated: {first}") from None
    desc = ds.info.description or ""
    if desc.startswith(_INFO_TAG):
        try:
            smeta = TraceMeta.from_dict(json.loads(desc[len(_INFO_TAG):]))
        except (json.JSONDecodeError, TypeError):
            raise TraceFormatError(f"shard {shard.name} of {shard.parent}: unreadable trace metadata") from None
        diff = _meta_diff(smeta, meta)
        if diff:
            raise TraceFormatError(f"shard {shard.name} belongs to another trace set ({'; '.join(diff)})")
    needed = {"seq_id", "prompt_len", "token_ids", "expert_ids", "expert_weights"}
    if meta.has_router_probs:
        needed.add("router_probs")
    missing = needed - set(ds.column_names)
    if missing:
        raise TraceFormatError(f"shard {shard.name} of {shard.parent} lacks columns {sorted(missing)}")
    if expected and expected.get("num_sequences") not in (None, n):
        raise TraceFormatError(
            f"shard {shard.name} of {shard.parent} is truncated: {n} rows, the manifest recorded {expected['num_sequences']}"
        )
    if n == 0:
        raise TraceFormatError(f"shard {shard.name} of {shard.parent} holds no sequences")
    return ds


def shard_paths(path: str | os.PathLike) -> list[Path]:
    """Shard directories of trace set ``path`` in order (those listed in the manifest, else all on disk)."""
    p = Path(path)
    manifest = read_manifest(p)
    listed = sorted(manifest.get("shards", {}))
    on_disk = sorted(q.name[len(SHARD_PREFIX):] for q in p.glob(f"{SHARD_PREFIX}*") if q.is_dir())
    keys = listed or on_disk
    missing = [k for k in listed if k not in on_disk]
    if missing:
        raise TraceFormatError(f"trace set {p} is missing shard(s) {', '.join(SHARD_PREFIX + k for k in missing)}")
    return [p / (SHARD_PREFIX + k) for k in keys]


def _decode_shard(ds, meta: TraceMeta) -> Iterator[TraceSequence]:
    cols = ["seq_id", "prompt_len", "token_ids", "expert_ids", "expert_weights"]
    if meta.has_router_probs:
        cols.append("router_probs")
    ds = ds.select_columns(cols).with_format("numpy")
    step = 256
    for start in range(0, len(ds), step):
        b = ds[start:start + step]
        for i in range(len(b["seq_id"])):
            yield TraceSequence(
                seq_id=str(b["seq_id"][i]),
                token_ids=np.asarray(b["token_ids"][i], dtype=np.int32),
                prompt_len=int(b["prompt_len"][i]),
                expert_ids=_as3d(b["expert_ids"][i], np.int16, meta),
                expert_weights=_as3d(b["expert_weights"][i], np.float16, meta),
                router_probs=_as3d(b["router_probs"][i], np.float16, meta) if meta.has_router_probs else None,
            )


def _as3d(x: Any, dtype, meta: TraceMeta) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == object:  # ragged batches can come back as nested objects
        a = np.stack([np.asarray(v) for v in a])
    return a.astype(dtype, copy=False)


def iter_traces(path: str | os.PathLike, meta: TraceMeta | None = None) -> Iterator[TraceSequence]:
    """Lazily yield the sequences of trace set ``path``, one shard in memory at a time."""
    p = Path(path)
    meta = meta or read_meta(p)
    manifest = read_manifest(p)
    shards = shard_paths(p)
    if not shards:
        raise TraceFormatError(f"trace set {p} holds no shards (empty split, or the run wrote nothing yet)")
    for s in shards:
        ds = _load_shard(s, meta, manifest.get("shards", {}).get(s.name[len(SHARD_PREFIX):]))
        for seq in _decode_shard(ds, meta):
            if seq.expert_ids.shape[1:] != (meta.num_layers, meta.top_k):
                raise TraceFormatError(
                    f"shard {s.name}: sequence {seq.seq_id} has expert_ids {seq.expert_ids.shape}, the trace meta "
                    f"says [T, L={meta.num_layers}, K={meta.top_k}]"
                )
            yield seq


def load_traces(path: str | os.PathLike, max_sequences: int | None = None) -> tuple[TraceMeta, list[TraceSequence]]:
    """All sequences of trace set ``path`` (TraceFormatError on a missing/corrupt/empty set).

    A set whose manifest is not marked complete (an interrupted collect) loads its finished shards
    with a warning.
    """
    p = Path(path)
    meta = read_meta(p)
    manifest = read_manifest(p)
    if manifest.get("shards") and not manifest.get("complete", False):
        import warnings

        warnings.warn(f"trace set {p} is incomplete (interrupted run?): loading its finished shards", stacklevel=2)
    seqs: list[TraceSequence] = []
    for s in iter_traces(p, meta):
        seqs.append(s)
        if max_sequences is not None and len(seqs) >= max_sequences:
            break
    if not seqs:
        raise TraceFormatError(f"trace set {p} holds no sequences")
    return meta, seqs


def check_model_compatible(meta: TraceMeta, model_or_spec: Any) -> None:
    """Raise ValueError (naming both sides) unless the traces' L/E/K and MoE layers match the model.

    ``model_or_spec``: a transformers MoE model or an :class:`expertcast.models.spec.MoESpec`.
    """
    from expertcast.models.spec import MoESpec

    spec = model_or_spec if isinstance(model_or_spec, MoESpec) else MoESpec.from_model(model_or_spec)
    meta.check_compatible(spec.num_layers, spec.num_experts, spec.top_k, what=f"model {spec.model_id!r}")
    if meta.moe_layers is not None and list(meta.moe_layers) != list(spec.moe_layers):
        raise ValueError(f"trace of {meta.model_id!r} has MoE layers {meta.moe_layers} but the model "
                         f"{spec.model_id!r} has {spec.moe_layers}")


def write_traces(out_dir: str | os.PathLike, meta: TraceMeta, sequences: Iterable[TraceSequence],
                 shard_size: int = 256, run: dict[str, Any] | None = None, overwrite: bool = True) -> Path:
    """Write a whole trace set in one go (used by import and tests); returns ``out_dir``."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    w = TraceWriter(out_dir, meta, run=run, overwrite=overwrite)
    buf: list[TraceSequence] = []
    idx = 0
    for s in sequences:
        buf.append(s)
        if len(buf) == shard_size:
            w.write_shard(idx, buf)
            idx, buf = idx + 1, []
    if buf:
        w.write_shard(idx, buf)
    w.finalize()
    return Path(out_dir)
