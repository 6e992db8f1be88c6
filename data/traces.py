"""Routing traces on disk: a directory of Arrow shards written through `datasets` (docs/design.md).

Layout of a trace set ``DIR``::

    DIR/trace_meta.json          TraceMeta (also in every shard's dataset info)
    DIR/manifest.json            finished shards (rows, tokens, size and sha256 of every file, the ids and
                                 input digests of their sequences), the run's settings, complete flag
    DIR/shard-00000/             Dataset.save_to_disk output (one row per sequence)
    DIR/shard-00001/ ...
    DIR/.expertcast-output.json  marker of the output folder (what expertcast wrote; utils/outdir.py)

The folder is claimed with :func:`expertcast.utils.outdir.claim_output_dir` (kind ``"traces"``): a
foreign folder is refused, ``overwrite`` removes only what expertcast wrote there, and a lock makes a
second concurrent writer fail fast. A shard is written into the scratch folder ``DIR/.tmp-shards/``,
hashed, renamed into place, then the manifest is updated atomically; an interrupted run therefore
leaves only whole shards. On resume every listed shard is verified against its recorded sha256 (a
mismatch is an error naming the file), a listed shard that is gone is redone, and a shard renamed
but not yet listed (killed between the two steps) is removed and redone.

Row schema: ``seq_id`` string, ``prompt_len`` int32, ``token_ids`` int32 [T], ``expert_ids`` int16
[T, L, K], ``expert_weights`` float16 [T, L, K], optional ``router_probs`` float16 [T, L, E], optional ``source``
string (the sequence's prompt set or dataset; present when the meta's ``has_sources``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.trace_format import TRACE_FORMAT_VERSION, TraceMeta, TraceSequence
from expertcast.utils.errors import ResumeMismatchError, UsageError
from expertcast.utils.io import atomic_write_json
from expertcast.utils.outdir import OutputDir, claim_output_dir, read_marker
from expertcast.utils.provenance import check_resume, settings_key, sha256_file

META_FILE = "trace_meta.json"
MANIFEST_FILE = "manifest.json"
SHARD_PREFIX = "shard-"
OUTPUT_KIND = "traces"
_SCRATCH = ".tmp-shards"
_SHARD_RE = re.compile(rf"^{SHARD_PREFIX}(\d{{5}})$")
_INFO_TAG = "expertcast-trace-meta:"


class TraceFormatError(UsageError):
    """A trace directory or shard is missing, corrupt, truncated, empty or from another run."""


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:05d}"


def trace_features(num_layers: int, top_k: int, num_experts: int | None = None, with_source: bool = False):
    """`datasets.Features` of a trace row; ``num_experts`` given = with ``router_probs``; ``with_source``: with
    the ``source`` column."""
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
    if with_source:
        feats["source"] = Value("string")
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


def _file_records(d: Path) -> tuple[dict[str, int], dict[str, str]]:
    """(size, sha256) of every file of shard directory ``d``, by file name."""
    files = sorted(p for p in d.iterdir() if p.is_file())
    return {p.name: p.stat().st_size for p in files}, {p.name: sha256_file(p) for p in files}


def verify_shard_files(shard: Path, entry: dict[str, Any]) -> None:
    """Check the files of ``shard`` against its manifest ``entry`` (sizes, then sha256); TraceFormatError
    naming the shard file that is missing, truncated or altered."""
    for fname, size in entry.get("files", {}).items():
        f = shard / fname
        if not f.is_file():
            raise TraceFormatError(f"shard {shard.name} of {shard.parent} is incomplete: {f} is missing")
        if f.stat().st_size != size:
            raise TraceFormatError(f"shard {shard.name} of {shard.parent} is truncated or corrupt: {f} has "
                                   f"{f.stat().st_size} bytes, the manifest recorded {size}")
    for fname, digest in entry.get("sha256", {}).items():
        f = shard / fname
        if sha256_file(f) != digest:
            raise TraceFormatError(f"shard {shard.name} of {shard.parent} is corrupt: {f} does not match the sha256 "
                                   f"recorded in {MANIFEST_FILE}")


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
    if not np.isfinite(np.asarray(seq.expert_weights, dtype=np.float32)).all():
        raise ValueError(f"sequence {seq.seq_id}: non-finite expert weights")
    if meta.has_router_probs:
        if seq.router_probs is None or seq.router_probs.shape[1:] != (L, E):
            got = None if seq.router_probs is None else seq.router_probs.shape
            raise ValueError(f"sequence {seq.seq_id}: router_probs {got} but the trace needs [T, L={L}, E={E}]")
    elif seq.router_probs is not None:
        raise ValueError(f"sequence {seq.seq_id}: router_probs given but the trace meta has has_router_probs=False")
    if meta.has_sources and not (isinstance(seq.source, str) and seq.source):
        raise ValueError(f"sequence {seq.seq_id}: no source, but the trace meta has has_sources=True")


def _row(seq: TraceSequence, with_probs: bool, with_source: bool = False) -> dict[str, Any]:
    r = {
        "seq_id": str(seq.seq_id),
        "prompt_len": int(seq.prompt_len),
        "token_ids": np.asarray(seq.token_ids, dtype=np.int32),
        "expert_ids": np.asarray(seq.expert_ids, dtype=np.int16),
        "expert_weights": np.asarray(seq.expert_weights, dtype=np.float16),
    }
    if with_probs:
        r["router_probs"] = np.asarray(seq.router_probs, dtype=np.float16)
    if with_source:
        r["source"] = seq.source
    return r


def _meta_diff(a: TraceMeta, b: TraceMeta) -> list[str]:
    keys = ("model_id", "num_layers", "num_experts", "top_k", "has_router_probs", "has_sources", "dataset", "split",
            "format_version")
    da, db = a.to_dict(), b.to_dict()
    return [f"{k}: {da[k]!r} (saved) vs {db[k]!r} (now)" for k in keys if da[k] != db[k]]


class TraceWriter:
    """Writes a trace set shard by shard, resumably (use as a context manager, or call :meth:`close`).

    ``out_dir``: a folder to claim (kind ``"traces"``; ``overwrite`` removes what expertcast wrote
    there before), or an :class:`~expertcast.utils.outdir.OutputDir` the caller claimed and releases.
    ``run``: a JSON-able dict of the settings that produced the traces; resuming into a folder whose
    manifest holds other settings or another :class:`TraceMeta` raises
    :class:`~expertcast.utils.errors.ResumeMismatchError` naming the first difference.
    """

    def __init__(self, out_dir: str | os.PathLike | OutputDir, meta: TraceMeta, run: dict[str, Any] | None = None,
                 overwrite: bool = False):
        self.meta = meta
        self.run = settings_key(**(run or {}))
        self.features = trace_features(meta.num_layers, meta.top_k, meta.num_experts if meta.has_router_probs else None,
                                       with_source=meta.has_sources)
        self._owns = not isinstance(out_dir, OutputDir)
        self.out = claim_output_dir(out_dir, OUTPUT_KIND, overwrite=overwrite) if self._owns else out_dir
        self.dir = self.out.path
        try:
            self.manifest = self._open()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the output folder (when this writer claimed it)."""
        if self._owns:
            self.out.release()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- set-up / resume -------------------------------------------------------------------------
    def _open(self) -> dict[str, Any]:
        self.out.track(META_FILE, MANIFEST_FILE, _SCRATCH)
        self._drop_leftovers()
        if (self.dir / META_FILE).exists():
            diff = _meta_diff(read_meta(self.dir), self.meta)
            if diff:
                raise ResumeMismatchError(f"cannot resume {self.dir}: it holds traces of another model or data "
                                          f"({'; '.join(diff)}); use --overwrite or another --out")
            manifest = read_manifest(self.dir)
            check_resume(manifest.get("run"), self.run, self.dir)
        else:
            if any(_SHARD_RE.match(p.name) for p in self.dir.iterdir()):
                raise TraceFormatError(f"{self.dir} holds shards but no {META_FILE}: not a trace set of expertcast")
            manifest = {"shards": {}}
        manifest.update(format_version=TRACE_FORMAT_VERSION, run=self.run)
        manifest.setdefault("complete", False)
        for key, entry in list(manifest["shards"].items()):
            d = self.dir / (SHARD_PREFIX + key)
            if d.is_dir():
                verify_shard_files(d, entry)
            else:  # removed by hand: redo it
                del manifest["shards"][key]
                manifest["complete"] = False
        ours = set((read_marker(self.dir) or {}).get("written", []))
        for p in self.dir.iterdir():  # renamed into place but never listed: unverified, redo it
            m = _SHARD_RE.match(p.name)
            if m and m.group(1) not in manifest["shards"] and p.name in ours:
                shutil.rmtree(p)
        # the manifest first: a meta file without a manifest would read as a run that records no settings
        atomic_write_json(self.dir / MANIFEST_FILE, manifest)
        atomic_write_json(self.dir / META_FILE, self.meta.to_dict())
        return manifest

    def _drop_leftovers(self) -> None:
        """Remove the scratch folder and temp files of atomic writes an interrupted run left behind."""
        shutil.rmtree(self.dir / _SCRATCH, ignore_errors=True)
        for name in (META_FILE, MANIFEST_FILE):
            for p in self.dir.glob(f".{name}.*.tmp"):
                p.unlink(missing_ok=True)

    @property
    def finished_shards(self) -> set[int]:
        return {int(k) for k in self.manifest["shards"]}

    def is_done(self, index: int) -> bool:
        return f"{index:05d}" in self.manifest["shards"]

    def reconcile(self, planned: Sequence[Sequence[tuple[str, str]]]) -> list[int]:
        """Match the finished shards with this run's plan; returns the shards dropped to be redone.

        ``planned[i]``: (sequence id, input digest) of every item of shard i, in order. A finished shard
        is kept when it holds exactly its planned items. A finished *partial* shard (the last of a run
        with a smaller ``--limit``) whose items are a prefix of its planned items is dropped and redone,
        since a shard's batches (and sampling seed) would differ. Anything else (a shard the plan does
        not have, other sequences, a changed input) raises ResumeMismatchError naming the sequence.
        """
        dropped = []
        for key in sorted(self.manifest["shards"]):
            index, entry = int(key), self.manifest["shards"][key]
            got = list(zip(entry["seq_ids"], entry.get("inputs") or [None] * len(entry["seq_ids"]), strict=True))
            if index >= len(planned):
                raise ResumeMismatchError(
                    f"cannot resume {self.dir}: it holds {shard_name(index)} (sequences {', '.join(entry['seq_ids'][:2])}"
                    f"...) that this run does not produce (a smaller --limit or fewer input rows); use --overwrite "
                    f"or another --out")
            want = [tuple(x) for x in planned[index]]
            if got == want:
                continue
            if len(got) < len(want) and got == want[:len(got)]:
                self.drop_shard(index)
                dropped.append(index)
                continue
            i = next((j for j, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want)))
            if i < min(len(got), len(want)) and got[i][0] == want[i][0]:
                why = f"the input of sequence {got[i][0]} changed (prompt, completion text, tokenizer or chat template)"
            else:
                have = got[i][0] if i < len(got) else "nothing"
                put = want[i][0] if i < len(want) else "nothing"
                why = f"position {i} holds {have} where this run puts {put} (another --limit or input file?)"
            raise ResumeMismatchError(f"cannot resume {self.dir}: in {shard_name(index)} {why}; use --overwrite "
                                      f"or another --out")
        return dropped

    def drop_shard(self, index: int) -> None:
        """Forget finished shard ``index`` and delete its directory (it will be written again)."""
        self.manifest["shards"].pop(f"{index:05d}", None)
        self.manifest["complete"] = False
        atomic_write_json(self.dir / MANIFEST_FILE, self.manifest)
        shutil.rmtree(self.dir / shard_name(index), ignore_errors=True)

    # -- writing -----------------------------------------------------------------------------------
    def write_shard(self, index: int, sequences: Iterable[TraceSequence], inputs: Sequence[str] | None = None,
                    stats: dict[str, Any] | None = None) -> Path:
        """Write ``sequences`` as shard ``index`` (atomic) and record it in the manifest.

        ``inputs``: one digest per sequence of what produced it (prompt and completion ids), which
        :meth:`reconcile` compares on resume. ``stats``: the writer's figures of this shard (kept in its
        manifest entry, so a resumed run can report the whole set).
        """
        from datasets import Dataset, DatasetInfo

        seqs = list(sequences)
        if not seqs:
            raise ValueError(f"shard {index}: no sequences to write")
        if inputs is not None and len(inputs) != len(seqs):
            raise ValueError(f"shard {index}: {len(inputs)} input digests for {len(seqs)} sequences")
        for s in seqs:
            _check_sequence(s, self.meta)
        final = self.dir / shard_name(index)
        if self.is_done(index):
            raise TraceFormatError(f"shard {final.name} is already finished in {self.dir}")
        info = DatasetInfo(description=_INFO_TAG + json.dumps(self.meta.to_dict()), features=self.features)
        ds = Dataset.from_list([_row(s, self.meta.has_router_probs, self.meta.has_sources) for s in seqs],
                               features=self.features, info=info)
        self.out.track(final.name)
        (self.dir / _SCRATCH).mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.dir / _SCRATCH, prefix=f"{final.name}-"))
        try:
            with _quiet_datasets():
                ds.save_to_disk(str(tmp / "d"))
            sizes, digests = _file_records(tmp / "d")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp / "d", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.manifest["shards"][f"{index:05d}"] = {
            "num_sequences": len(seqs),
            "num_tokens": int(sum(s.num_tokens for s in seqs)),
            "seq_ids": [str(s.seq_id) for s in seqs],
            **({"inputs": list(inputs)} if inputs is not None else {}),
            **({"stats": dict(stats)} if stats is not None else {}),
            "files": sizes,
            "sha256": digests,
        }
        self.manifest["complete"] = False
        atomic_write_json(self.dir / MANIFEST_FILE, self.manifest)
        return final

    def adopt_shard(self, index: int, src: Path, entry: dict[str, Any]) -> Path:
        """Move the finished shard folder ``src`` of another trace set of the same run (a rank's part of a
        sharded collect, :mod:`expertcast.commands.collect`) into this set as shard ``index``, with its
        manifest ``entry``; its files are checked against the entry first."""
        verify_shard_files(src, entry)
        final = self.dir / shard_name(index)
        if self.is_done(index):
            raise TraceFormatError(f"shard {final.name} is already finished in {self.dir}")
        self.out.track(final.name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(src, final)
        self.manifest["shards"][f"{index:05d}"] = dict(entry)
        self.manifest["complete"] = False
        atomic_write_json(self.dir / MANIFEST_FILE, self.manifest)
        return final

    def finalize(self, **summary: Any) -> None:
        """Mark the trace set complete (``summary`` is stored in the manifest, e.g. tokens/s)."""
        if not self.manifest["shards"]:
            raise TraceFormatError(f"{self.dir}: no shard was written (empty input?)")
        self.manifest["complete"] = True
        shutil.rmtree(self.dir / _SCRATCH, ignore_errors=True)
        if summary:
            self.manifest["summary"] = json.loads(json.dumps(summary, default=str))
        atomic_write_json(self.dir / MANIFEST_FILE, self.manifest)


# -- reading ---------------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
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
    except (TypeError, AttributeError) as e:
        raise TraceFormatError(f"{p / META_FILE} is not a trace meta file ({e})") from None
    dims = (meta.num_layers, meta.num_experts, meta.top_k)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in dims) or meta.top_k > meta.num_experts:
        raise TraceFormatError(f"{p / META_FILE}: L, E, K must be positive integers with K <= E (got {dims})")
    if meta.format_version > TRACE_FORMAT_VERSION:
        raise TraceFormatError(
            f"{p} has trace format version {meta.format_version}; this expertcast reads up to {TRACE_FORMAT_VERSION}"
        )
    return meta


def _check_manifest(m: Any, where: Path) -> dict[str, Any]:
    """``m`` if it has the manifest's structure, else TraceFormatError naming ``where``."""
    shards = m.get("shards") if isinstance(m, dict) else None
    ok = isinstance(shards, dict) and all(
        isinstance(e, dict) and isinstance(e.get("seq_ids"), list) and isinstance(e.get("files"), dict)
        and isinstance(e.get("sha256"), dict) and isinstance(e.get("num_sequences"), int) and re.fullmatch(r"\d{5}", k)
        for k, e in shards.items())
    if not ok:
        raise TraceFormatError(f"{where} is corrupt: not a trace manifest (expected shards by 5-digit index with "
                               f"their seq_ids, files and sha256)")
    for k, e in shards.items():  # every file of a shard is verified by its sha256: none may go unchecked
        if not e["files"] or set(e["sha256"]) != set(e["files"]):
            raise TraceFormatError(f"{where} is corrupt: shard {k} records no sha256 for "
                                   f"{', '.join(sorted(set(e['files']) - set(e['sha256']))) or 'its files'}; "
                                   f"refusing to trust its files unverified")
    return m


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of trace set ``path`` (``{"shards": {}}`` when it has none yet)."""
    p = Path(path) / MANIFEST_FILE
    return _check_manifest(_read_json(p), p) if p.exists() else {"shards": {}}


def _load_shard(shard: Path, meta: TraceMeta, expected: dict[str, Any] | None = None):
    """Load and validate one shard directory; TraceFormatError naming it on any problem."""
    from datasets import load_from_disk

    if expected:
        verify_shard_files(shard, expected)
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
    if meta.has_sources:
        needed.add("source")
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
    on_disk = sorted(q.name[len(SHARD_PREFIX):] for q in p.iterdir() if _SHARD_RE.match(q.name) and q.is_dir())
    keys = listed or on_disk
    missing = [k for k in listed if k not in on_disk]
    if missing:
        raise TraceFormatError(f"trace set {p} is missing shard(s) {', '.join(SHARD_PREFIX + k for k in missing)}")
    return [p / (SHARD_PREFIX + k) for k in keys]


def _decode_shard(ds, meta: TraceMeta) -> Iterator[TraceSequence]:
    cols = ["seq_id", "prompt_len", "token_ids", "expert_ids", "expert_weights"]
    if meta.has_router_probs:
        cols.append("router_probs")
    if meta.has_sources:
        cols.append("source")
    ds = ds.select_columns(cols).with_format("numpy")
    step = 256
    for start in range(0, len(ds), step):
        b = ds[start:start + step]
        for i in range(len(b["seq_id"])):
            yield TraceSequence(
                seq_id=str(b["seq_id"][i]),
                token_ids=np.asarray(b["token_ids"][i], dtype=np.int32),
                prompt_len=int(b["prompt_len"][i]),
                expert_ids=_as3d(b["expert_ids"][i], np.int16),
                expert_weights=_as3d(b["expert_weights"][i], np.float16),
                router_probs=_as3d(b["router_probs"][i], np.float16) if meta.has_router_probs else None,
                source=str(b["source"][i]) if meta.has_sources else None,
            )


def _as3d(x: Any, dtype) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == object:  # ragged batches can come back as nested objects
        a = np.stack([np.asarray(v) for v in a])
    return a.astype(dtype, copy=False)


def check_finished(path: str | os.PathLike, manifest: dict[str, Any] | None = None) -> None:
    """TraceFormatError unless the trace set ``path`` is finished: a set whose writer stopped before marking its
    manifest complete (a killed ``collect`` or ``traces import``) holds only some of its sequences, and a replay
    of those would pass for the whole set. The command that wrote it resumes it."""
    p = Path(path)
    manifest = read_manifest(p) if manifest is None else manifest
    if manifest.get("shards") and not manifest.get("complete", False):
        run = manifest.get("run") or {}
        how = ("rerun the same `expertcast traces import` to resume it" if "import" in run else
               "rerun the command that wrote it (same settings) to resume it")
        raise TraceFormatError(f"trace set {p} is unfinished: its writer stopped after {len(manifest['shards'])} "
                               f"shard(s) and never marked it complete, so it holds only part of its sequences; "
                               f"{how}, or write it again with --overwrite")


def iter_traces(path: str | os.PathLike, meta: TraceMeta | None = None) -> Iterator[TraceSequence]:
    """Lazily yield the sequences of trace set ``path``, one shard in memory at a time; every shard's
    files are checked against the sha256 its manifest recorded. An unfinished set is refused
    (:func:`check_finished`)."""
    p = Path(path)
    meta = meta or read_meta(p)
    manifest = read_manifest(p)
    check_finished(p, manifest)
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

    A set whose manifest is not marked complete (an interrupted collect or import) is refused
    (:func:`check_finished`). Consumers that replay decode steps call :func:`require_decode_tokens` on the result.
    """
    p = Path(path)
    meta = read_meta(p)
    seqs: list[TraceSequence] = []
    for s in iter_traces(p, meta):
        seqs.append(s)
        if max_sequences is not None and len(seqs) >= max_sequences:
            break
    if not seqs:
        raise TraceFormatError(f"trace set {p} holds no sequences")
    return meta, seqs


def require_decode_tokens(meta: TraceMeta, seqs: Sequence[TraceSequence], where: str | os.PathLike) -> int:
    """The number of decode positions (``>= prompt_len``) in ``seqs``; TraceFormatError naming ``where``
    when there is none (decode-only metrics such as hit rates would be undefined)."""
    n = sum(s.num_tokens - s.prompt_len for s in seqs)
    if n == 0:
        raise TraceFormatError(f"trace set {where} ({meta.model_id}, {len(seqs)} sequences) holds no decode tokens: "
                               f"every position is prefill, so decode-only metrics are undefined")
    return n


def write_traces(out_dir: str | os.PathLike | OutputDir, meta: TraceMeta, sequences: Iterable[TraceSequence],
                 shard_size: int = 256, run: dict[str, Any] | None = None, overwrite: bool = True) -> Path:
    """Write a whole trace set in one go (used by import and tests); returns its folder.

    ``overwrite`` replaces a trace set expertcast wrote in ``out_dir`` before; a folder holding foreign
    files is refused either way (:func:`expertcast.utils.outdir.claim_output_dir`).
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    with TraceWriter(out_dir, meta, run=run, overwrite=overwrite) as w:
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
        return w.dir
