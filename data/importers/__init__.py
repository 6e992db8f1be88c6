"""Importers of routing traces recorded by other engines: the one registry of layouts ``expertcast traces import
--format`` reads (:data:`FORMATS`), their detection (:func:`detect_format`) and the import itself
(:func:`import_traces`: read and validate everything, then write a trace set). Each layout's module docstring
states what it accepts and how it handles the prefill/decode boundary; docs/design.md, "Trace importers", lists
them all.

Every import records in the trace's meta ``source_format``, ``source_sha256`` (the imported file, or the files of
an imported folder) and ``phase_known`` (False: the source does not mark prefill, every position is stored as
decode); sequences keep their ``source`` (prompt set / dataset) when the layout records one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expertcast.data.importers import (
    gating_jsonl,
    hf_logits,
    llamacpp,
    megatron,
    moe_beyond,
    moe_cache_lab,
    sglang,
    vllm,
)
from expertcast.data.importers.common import Imported, ImportOptions, files_of, num_experts_of
from expertcast.data.trace_format import TraceMeta
from expertcast.data.trace_import import (
    ImportFormatError,
    default_expert_bytes,
    read_expert_trace_json,
    read_import_jsonl,
)
from expertcast.utils.errors import UsageError

__all__ = ["FORMATS", "ImportFormat", "ImportOptions", "Imported", "detect_format", "import_traces", "read_traces"]


def _read_jsonl(path: Path, opts: ImportOptions) -> Imported:
    E = num_experts_of(opts, "jsonl")
    seqs, c = read_import_jsonl(path, E, opts.num_layers)
    notes = [f"{c['rows']} rows"] + ([f"dropped {c['dropped_tokens']} incomplete tokens"] if c["dropped_tokens"] else [])
    return Imported(seqs, c["num_layers"], E, c["top_k"], phase_known=c["phase_known"],
                    model_id=opts.model_id, records=c["rows"], notes=notes)


def _read_granite(path: Path, opts: ImportOptions) -> Imported:
    meta, seqs = read_expert_trace_json(path, opts.model_id)
    return Imported(seqs, meta.num_layers, meta.num_experts, meta.top_k, phase_known=True, model_id=meta.model_id,
                    records=len(seqs), notes=["router weights not recorded: 1/K"])


@dataclass(frozen=True)
class ImportFormat:
    """One layout: its reader, the files an import of ``path`` consumes (hashed into ``source_sha256``) and
    whether ``path`` may be a folder of per-sequence files."""

    name: str
    summary: str
    read: Callable[[Path, ImportOptions], Imported]
    folder_ext: str | None = None
    """Extension of the per-sequence files when a folder is accepted (None: one file only)."""
    files: Callable[[Path], list[Path]] | None = None
    inputs: tuple[str, ...] = ()
    """The :class:`ImportOptions` fields this layout reads as input (the others, given, are checked against the
    file)."""


FORMATS: dict[str, ImportFormat] = {f.name: f for f in (
    ImportFormat("jsonl", "expertcast's rows: one per (seq, token, layer)", _read_jsonl, inputs=("num_layers",)),
    ImportFormat("granite", "per-prompt expert-trace JSON (prefill/decode [T][L][K])", _read_granite),
    ImportFormat(vllm.NAME, "vLLM return-routed-experts: one request per line, [T, L, K]", vllm.read),
    ImportFormat(sglang.NAME, "SGLang /generate responses, base64 meta_info.routed_experts", sglang.read,
                 inputs=("num_layers", "top_k")),
    ImportFormat(llamacpp.NAME, "llama.cpp moe-trace CSV (layer,expert or phase,token,layer,rank,expert)",
                 llamacpp.read, folder_ext="csv", inputs=("top_k",)),
    ImportFormat(megatron.NAME, "Megatron-LM RouterTracer JSONL, one record per (step, layer, rank)", megatron.read),
    ImportFormat(moe_cache_lab.NAME, "moe-cache-lab routing-trace-v1 JSONL", moe_cache_lab.read, folder_ext="jsonl"),
    ImportFormat(moe_beyond.NAME, "MoE-Beyond per-prompt CSV (Layer ID,Batch Number,Token,Activated Expert IDs)",
                 moe_beyond.read, folder_ext="csv"),
    ImportFormat(gating_jsonl.NAME, "routing-study JSONL: dataset, problem_id, token_idx, layer, experts",
                 gating_jsonl.read),
    ImportFormat(hf_logits.NAME, "transformers output_router_logits: safetensors + JSON sidecar", hf_logits.read,
                 files=lambda p: [p, hf_logits.sidecar(p)]),
)}
"""Every layout ``expertcast traces import`` reads, by ``--format`` name."""

_JSON_SNIFFERS: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("jsonl", lambda o: isinstance(o, dict) and all(k in o for k in ("seq", "token", "layer", "experts"))),
    ("granite", lambda o: isinstance(o, dict) and all(k in o for k in ("num_layers", "num_experts", "top_k",
                                                                        "prompts"))),
    (vllm.NAME, vllm.sniff),
    (sglang.NAME, sglang.sniff),
    (megatron.NAME, megatron.sniff),
    (moe_cache_lab.NAME, moe_cache_lab.sniff),
    (gating_jsonl.NAME, gating_jsonl.sniff),
)
_HINT = f"layouts read: {', '.join(FORMATS)} (docs/design.md, 'Trace importers'); give --format to force one"


def detect_format(path: str | os.PathLike) -> str:
    """The layout of ``path`` (a name in :data:`FORMATS`): a ``.safetensors`` file is ``hf-router-logits``; a CSV
    is told by its header; a folder by its first file; anything else by its first JSON value (a pretty-printed
    document as a whole). ImportFormatError naming what was found when no layout matches, or listing the
    candidates when several do."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"import file {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")
                       and p.suffix in (".csv", ".jsonl"))
        if not files:
            raise ImportFormatError(f"{path}: a folder is read as per-sequence files (.csv: llamacpp, moe-beyond; "
                                    f".jsonl: moe-cache-lab), and it holds none")
        fmt = detect_format(files[0])
        if FORMATS[fmt].folder_ext is None:
            raise ImportFormatError(f"{path}: its first file {files[0].name} is {fmt}, which is read from one file, "
                                    f"not a folder")
        return fmt
    if path.suffix == ".safetensors":
        return hf_logits.NAME
    first = _first_line(path)
    if path.suffix == ".csv":
        head = tuple(c.strip() for c in first.strip().split(","))
        if llamacpp.sniff_header(head):
            return llamacpp.NAME
        if head == moe_beyond.HEADER:
            return moe_beyond.NAME
        raise ImportFormatError(f"{path}: unknown CSV trace layout (header {first.strip()[:80]!r}; llamacpp files "
                                f"start {','.join(llamacpp.UPSTREAM)} or {','.join(llamacpp.INDEXED)}, moe-beyond "
                                f"files {','.join(moe_beyond.HEADER)}); {_HINT}")
    obj = _first_json(path, first)
    hits = [name for name, sniff in _JSON_SNIFFERS if sniff(obj)]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise ImportFormatError(f"{path}: ambiguous trace layout: its first record fits {', '.join(hits)}; give "
                                f"--format")
    if isinstance(obj, list):
        raise ImportFormatError(f"{path}: unknown trace layout (a JSON list); {_HINT}")
    if not isinstance(obj, dict):
        found = "no JSON object on its first line" if obj is None else f"a JSON {type(obj).__name__}"
        raise ImportFormatError(f"{path}: unknown trace layout ({found}); {_HINT}")
    keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
    raise ImportFormatError(f"{path}: unknown trace layout (an object with keys {keys}); {_HINT}")


def _first_line(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return line
    raise ImportFormatError(f"{path} is empty: nothing to import")


def _first_json(path: Path, first: str) -> Any:
    try:
        return json.loads(first)
    except RecursionError:
        raise ImportFormatError(f"{path}: unknown trace layout (JSON nested too deeply on its first line)") from None
    except json.JSONDecodeError:
        try:  # a pretty-printed single JSON document
            return json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        except RecursionError:
            raise ImportFormatError(f"{path}: unknown trace layout (JSON nested too deeply)") from None


def read_traces(path: str | os.PathLike, fmt: str = "auto", opts: ImportOptions | None = None) -> tuple[str, Imported]:
    """(layout, what it holds) of ``path``, validated; nothing is written. The flags in ``opts`` must agree
    with what the file shows (UsageError naming the flag and both values)."""
    path = Path(path)
    opts = opts or ImportOptions()
    if not path.exists():
        raise FileNotFoundError(f"import file {path} does not exist")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise UsageError(f"unknown import layout {fmt!r}; {_HINT}")
    spec = FORMATS[fmt]
    if path.is_dir() and spec.folder_ext is None:
        raise UsageError(f"{path} is a folder, but the {fmt} layout is read from one file")
    imp = spec.read(path, opts)
    for flag, key, have in (("--num-experts", "num_experts", imp.num_experts),
                            ("--num-layers", "num_layers", imp.num_layers), ("--top-k", "top_k", imp.top_k)):
        given = getattr(opts, key)
        if given is not None and key not in spec.inputs and given != have:
            raise UsageError(f"{flag} {given}, but {path} records {have} ({fmt} layout)")
    has = [s.source is not None for s in imp.sequences]
    if any(has) and not all(has):
        missing = next(s.seq_id for s in imp.sequences if s.source is None)
        raise ImportFormatError(f"{path}: some sequences record a source and some do not (e.g. {missing!r}); a "
                                f"split by source needs all or none")
    return fmt, imp


def source_files(path: str | os.PathLike, fmt: str) -> list[Path]:
    """The files an import of ``path`` in layout ``fmt`` reads (what ``source_sha256`` covers)."""
    path, spec = Path(path), FORMATS[fmt]
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
    what was read. ``out`` is untouched until everything is valid; it is claimed as a ``traces`` output folder,
    one already holding a trace set refused unless ``overwrite``. ``expert_bytes`` None: the size this code
    knows for the model (granite-3.0-1b-a400m), else 0."""
    from expertcast.data.traces import OUTPUT_KIND, is_trace_dir, write_traces
    from expertcast.utils.outdir import claim_output_dir

    if expert_bytes is not None and expert_bytes < 0:
        raise UsageError(f"--expert-bytes must be >= 0, got {expert_bytes}")
    path = Path(path)
    fmt, imp = read_traces(path, fmt, opts)
    model_id = imp.model_id or "imported"
    digest = fingerprint(path, fmt)
    meta = TraceMeta(
        model_id=model_id, num_layers=imp.num_layers, num_experts=imp.num_experts, top_k=imp.top_k,
        expert_bytes=int(default_expert_bytes(model_id) if expert_bytes is None else expert_bytes),
        moe_layers=imp.moe_layers, dataset=path.name,
        generation={"source": "import", "file": str(path), "format": fmt, "notes": list(imp.notes)},
        has_router_probs=imp.has_router_probs, source_format=fmt, source_sha256=digest,
        phase_known=imp.phase_known, has_sources=bool(imp.sequences) and imp.sequences[0].source is not None,
    )
    with claim_output_dir(out, OUTPUT_KIND, overwrite=overwrite) as od:
        if is_trace_dir(od.path):
            raise UsageError(f"{od.path} already holds a trace set (pass --overwrite to replace it)")
        write_traces(od, meta, imp.sequences, shard_size=shard_size,
                     run={"import": str(path.resolve()), "sha256": digest, "format": fmt})
    return meta, imp
