"""Importers of routing traces recorded by other engines: the one registry of layouts ``expertcast traces import
--format`` reads (:func:`registry`, built from the modules of :data:`FORMAT_MODULES`: each ends with its
:class:`~expertcast.data.importers.spec.FormatSpec`), their detection (:func:`detect_format`) and the import itself
(:func:`import_traces`: read and validate everything, then write a trace set). Each layout's module docstring
states what it accepts and how it handles the prefill/decode boundary; docs/design.md, "Trace importers", lists
them all. The parsing helpers they share are public in :mod:`expertcast.data.importers.common`.

Every import records in the trace's meta ``source_format``, ``source_sha256`` (the imported file, or the files of
an imported folder) and ``phase_known`` (False: the source does not mark prefill, every position is stored as
decode), and in ``generation`` what a write cut short cost: the positions and sequences dropped for lacking some
layers' records, and a JSON-lines file's last line cut mid-record (:class:`~expertcast.data.importers.common.
JsonLines`); sequences keep their ``source`` (prompt set / dataset) when the layout records one.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from expertcast.data.importers.common import (
    SNIFF_BYTES,
    Imported,
    ImportFormatError,
    ImportOptions,
    check_num_experts,
    check_text,
    files_of,
    need,
)
from expertcast.data.importers.spec import FLAGS, FormatSpec
from expertcast.data.trace_format import TraceMeta
from expertcast.utils.errors import UsageError
from expertcast.utils.registry import spec_registry

__all__ = ["FORMAT_MODULES", "FormatSpec", "ImportOptions", "Imported", "detect_format", "import_traces",
           "read_traces", "registry"]

FORMAT_MODULES: tuple[str, ...] = (
    "expertcast.data.importers.jsonl",
    "expertcast.data.importers.granite",
    "expertcast.data.importers.vllm",
    "expertcast.data.importers.sglang",
    "expertcast.data.importers.llamacpp",
    "expertcast.data.importers.megatron",
    "expertcast.data.importers.moe_cache_lab",
    "expertcast.data.importers.moe_beyond",
    "expertcast.data.importers.gating_jsonl",
    "expertcast.data.importers.hf_logits",
)
"""The importer modules, in registry order: each ends with ``SPEC = FormatSpec(...)``. To add a layout, add one
module and its name here."""


def registry() -> dict[str, FormatSpec]:
    """``{--format name: FormatSpec}`` of every layout ``expertcast traces import`` reads, in registry order."""
    return spec_registry(FORMAT_MODULES, "trace layout")


def _hint() -> str:
    return f"layouts read: {', '.join(registry())} (docs/design.md, 'Trace importers'); give --format to force one"




def detect_format(path: str | os.PathLike) -> str:
    """The layout of ``path`` (a name in :func:`registry`): a file whose suffix a layout claims is that layout; a CSV
    is told by its header; a folder by its first file; anything else by its first JSON value (a pretty-printed
    document as a whole). ImportFormatError naming what was found when no layout matches, or listing the
    candidates when several do. A binary file is refused from its first bytes (nothing is read whole)."""
    path = Path(path)
    specs = registry()
    if not path.exists():
        raise FileNotFoundError(f"import file {path} does not exist")
    if path.is_dir():
        exts = sorted({f".{s.folder_ext}" for s in specs.values() if s.folder_ext})
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".") and p.suffix in exts)
        if not files:
            by_ext = "; ".join(f"{e}: {', '.join(n for n, s in specs.items() if s.folder_ext == e[1:])}" for e in exts)
            raise ImportFormatError(f"{path}: a folder is read as per-sequence files ({by_ext}), and it holds none")
        fmt = detect_format(files[0])
        if specs[fmt].folder_ext is None:
            raise ImportFormatError(f"{path}: its first file {files[0].name} is {fmt}, which is read from one file, "
                                    f"not a folder")
        return fmt
    by_suffix = [n for n, s in specs.items() if s.suffix is not None and path.suffix == s.suffix]
    if by_suffix:
        return by_suffix[0]
    check_text(path)
    first = _first_line(path, SNIFF_BYTES if path.suffix == ".csv" else None)
    if path.suffix == ".csv":
        head = tuple(c.strip() for c in first.strip().split(","))
        hits = [n for n, s in specs.items() if head in s.csv_headers]
        if hits:
            return hits[0]
        known = "; ".join(f"{n} files start {' or '.join(','.join(h) for h in s.csv_headers)}"
                          for n, s in specs.items() if s.csv_headers)
        raise ImportFormatError(f"{path}: unknown CSV trace layout (header {first.strip()[:80]!r}; {known}); "
                                f"{_hint()}")
    obj = _first_json(path, first)
    hits = [name for name, s in specs.items() if s.sniff is not None and s.sniff(obj)]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise ImportFormatError(f"{path}: ambiguous trace layout: its first record fits {', '.join(hits)}; give "
                                f"--format")
    if isinstance(obj, list):
        raise ImportFormatError(f"{path}: unknown trace layout (a JSON list); {_hint()}")
    if not isinstance(obj, dict):
        found = "no JSON object on its first line" if obj is None else f"a JSON {type(obj).__name__}"
        raise ImportFormatError(f"{path}: unknown trace layout ({found}); {_hint()}")
    keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
    raise ImportFormatError(f"{path}: unknown trace layout (an object with keys {keys}); {_hint()}")


def _first_line(path: Path, limit: int | None = None) -> str:
    """The first non-blank line of ``path`` (at most ``limit`` characters of it). Only a line that can open a JSON
    value (``{`` or ``[`` first) is read whole; any other is returned as its first :data:`SNIFF_BYTES`."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            head = f.readline(limit or SNIFF_BYTES)
            if not head:
                break
            if not head.strip():
                continue
            if limit is None and head.lstrip().startswith(("{", "[")) and not head.endswith("\n"):
                head += f.readline()
            return head
    raise ImportFormatError(f"{path} is empty: nothing to import")


def _first_json(path: Path, first: str) -> Any:
    try:
        return json.loads(first)
    except RecursionError:
        raise ImportFormatError(f"{path}: unknown trace layout (JSON nested too deeply on its first line)") from None
    except json.JSONDecodeError:
        if not first.lstrip().startswith(("{", "[")):
            return None  # no JSON document starts this way: nothing more to read
        try:  # a pretty-printed single JSON document
            return json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        except RecursionError:
            raise ImportFormatError(f"{path}: unknown trace layout (JSON nested too deeply)") from None


def read_traces(path: str | os.PathLike, fmt: str = "auto", opts: ImportOptions | None = None) -> tuple[str, Imported]:
    """(layout, what it holds) of ``path``, validated; nothing is written. The flags the layout requires must be
    given; the others, given, must agree with what the file shows (UsageError naming the flag and both values)."""
    path = Path(path)
    opts = opts or ImportOptions()
    specs = registry()
    if not path.exists():
        raise FileNotFoundError(f"import file {path} does not exist")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in specs:
        raise UsageError(f"unknown import layout {fmt!r}; {_hint()}")
    spec = specs[fmt]
    if path.is_dir() and spec.folder_ext is None:
        raise UsageError(f"{path} is a folder, but the {fmt} layout is read from one file")
    for key, why in spec.requires.items():
        need(getattr(opts, key), FLAGS[key], fmt, why)
    check_num_experts(opts.num_experts)
    if path.is_file() and spec.suffix is None:
        check_text(path)
    imp = spec.read(path, opts)
    for key, flag in FLAGS.items():
        given, have = getattr(opts, key), getattr(imp, key)
        if given is not None and key not in spec.inputs and given != have:
            raise UsageError(f"{flag} {given}, but {path} records {have} ({fmt} layout)")
    has = [s.source is not None for s in imp.sequences]
    if any(has) and not all(has):
        missing = next(s.seq_id for s in imp.sequences if s.source is None)
        raise ImportFormatError(f"{path}: some sequences record a source and some do not (e.g. {missing!r}); a "
                                f"split by source needs all or none")
    notes = [f"dropped the last line of {c} (cut short mid-write)" for c in imp.cut_lines]
    if imp.dropped_positions:
        notes.append(f"dropped {imp.dropped_positions} position(s) lacking some layers' records (a write cut short)"
                     + (f", {imp.dropped_sequences} sequence(s) with none complete" if imp.dropped_sequences else ""))
    for note in notes:
        imp.notes.append(note)
        warnings.warn(f"{path}: {note}", stacklevel=2)
    return fmt, imp


def source_files(path: str | os.PathLike, fmt: str) -> list[Path]:
    """The files an import of ``path`` in layout ``fmt`` reads (what ``source_sha256`` covers)."""
    path, spec = Path(path), registry()[fmt]
    if spec.files is not None:
        return spec.files(path)
    return files_of(path, spec.folder_ext) if path.is_dir() and spec.folder_ext else [path]


def fingerprint(path: str | os.PathLike, fmt: str) -> str:
    """sha256 of what an import of ``path`` reads: the file's own, or one over the files' names and hashes."""
    from expertcast.utils.provenance import sha256_file, sha256_files

    files = source_files(path, fmt)
    if len(files) == 1 and Path(path).is_file():
        return sha256_file(files[0])
    return sha256_files(files[0].parent, [f.name for f in files])


def import_traces(path: str | os.PathLike, out: str | os.PathLike, fmt: str = "auto",
                  opts: ImportOptions | None = None, *, expert_bytes: int | None = None, shard_size: int = 256,
                  overwrite: bool = False) -> tuple[TraceMeta, Imported]:
    """Read and validate ``path`` (:func:`read_traces`), then write the trace set ``out``; returns its meta and
    what was read. ``out`` is untouched until everything is valid; it is claimed as a ``traces`` output folder.
    A complete trace set there is refused unless ``overwrite``; an unfinished one (an import that was killed) is
    resumed when it was written from the same file with the same settings (its finished shards are checked and
    kept, the rest written), else refused naming it as unfinished. ``expert_bytes`` None: the size this code
    knows for the model (granite-3.0-1b-a400m), else 0."""
    from expertcast.data.importers.granite import default_expert_bytes
    from expertcast.data.traces import OUTPUT_KIND, TraceWriter, is_trace_dir, read_manifest
    from expertcast.utils.errors import ResumeMismatchError
    from expertcast.utils.outdir import claim_output_dir

    if expert_bytes is not None and expert_bytes < 0:
        raise UsageError(f"--expert-bytes must be >= 0, got {expert_bytes}")
    if shard_size < 1:
        raise UsageError(f"--shard-size must be >= 1, got {shard_size}")
    path = Path(path)
    fmt, imp = read_traces(path, fmt, opts)
    model_id = imp.model_id or "imported"
    digest = fingerprint(path, fmt)
    generation: dict[str, Any] = {"source": "import", "file": str(path), "format": fmt, "notes": list(imp.notes)}
    if imp.dropped_positions or imp.dropped_sequences or imp.cut_lines:
        generation.update(dropped_positions=imp.dropped_positions, dropped_sequences=imp.dropped_sequences,
                          cut_lines=list(imp.cut_lines))
    meta = TraceMeta(
        model_id=model_id, num_layers=imp.num_layers, num_experts=imp.num_experts, top_k=imp.top_k,
        expert_bytes=int(default_expert_bytes(model_id) if expert_bytes is None else expert_bytes),
        moe_layers=imp.moe_layers, dataset=path.name, generation=generation,
        has_router_probs=imp.has_router_probs, source_format=fmt, source_sha256=digest,
        phase_known=imp.phase_known, has_sources=bool(imp.sequences) and imp.sequences[0].source is not None,
    )
    run = {"import": str(path.resolve()), "sha256": digest, "format": fmt, "shard_size": shard_size}
    shards = [imp.sequences[i:i + shard_size] for i in range(0, len(imp.sequences), shard_size)]
    with claim_output_dir(out, OUTPUT_KIND, overwrite=overwrite) as od:
        resumed = 0
        if is_trace_dir(od.path):
            manifest = read_manifest(od.path)
            if manifest.get("complete"):
                raise UsageError(f"{od.path} already holds a trace set (pass --overwrite to replace it)")
            done = len(manifest.get("shards", {}))
            try:
                w = TraceWriter(od, meta, run=run)
            except ResumeMismatchError as e:
                raise UsageError(f"{od.path} holds an unfinished trace set ({done} shard(s) written before its run "
                                 f"stopped) that this import cannot resume: {e}") from None
            resumed = len(w.finished_shards)
        else:
            w = TraceWriter(od, meta, run=run)
        with w:
            w.reconcile([[(s.seq_id, None) for s in shard] for shard in shards])
            for i, shard in enumerate(shards):
                if not w.is_done(i):
                    w.write_shard(i, shard)
            w.finalize()
    if resumed:
        imp.notes.append(f"resumed an unfinished import: {resumed} of {len(shards)} shard(s) were already written")
    return meta, imp
