"""moe-cache-lab routing-trace-v1 (``moe-cache-lab.routing-jsonl``, format_version 1;
``schemas/routing-trace-v1.schema.json``).

One file is one independent trace (a sequence, named by the file's stem; a folder of ``*.jsonl`` files is one
sequence per file). Its first non-blank line is the metadata record::

    {"record_type": "metadata", "format": "moe-cache-lab.routing-jsonl", "format_version": 1, "model_id": "...",
     "num_experts": 64, "experts_per_token": 8, ...}

then one ``routing_selection`` record per (layer, token)::

    {"record_type": "routing_selection", "phase": "prompt" | "generated", "token_position": 0, "layer": 3,
     "token_id": 17, "selected_experts": [5, 2], "selected_probabilities": [0.6, 0.3]}

Checked as the format states it (a closed contract): unknown fields and record types are refused; all prompt
records come before generated ones; prompt records in ascending (layer, position) order, generated ones in
ascending (position, layer) order; (position, layer) unique; every prompt position below every generated one;
ids below ``num_experts`` and as many as ``experts_per_token`` when the metadata gives them. Version 2 files
(encoder-decoder stages) are refused. Phase known: ``prompt`` is prefill. Weights: ``selected_probabilities`` as
recorded (1/K when empty). ``layer`` values map in order to the trace's MoE layers (``moe_layers``). E: the
metadata's ``num_experts``, else ``--num-experts``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from expertcast.data.importers.common import (
    INT16_MAX,
    INT32_MAX,
    Imported,
    ImportFormatError,
    ImportOptions,
    JsonLines,
    RowCollector,
    files_of,
    int_value,
    str_field,
)
from expertcast.data.importers.spec import FormatSpec
from expertcast.utils.errors import UsageError
from expertcast.utils.io import iter_jsonl
from expertcast.utils.jsonfields import check_format, require_keys

NAME = "moe-cache-lab"
FORMAT = "moe-cache-lab.routing-jsonl"
_META_FIELDS = {"record_type", "format", "format_version", "model_id", "num_experts", "experts_per_token",
                "source_text", "generated_text", "capture_method", "created_at", "transformers_version",
                "model_revision"}
_EVENT_FIELDS = {"record_type", "phase", "token_position", "layer", "selected_experts", "token_id",
                 "selected_probabilities"}


def sniff(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("record_type") == "metadata" and obj.get("format") == FORMAT


def read(path: Path, opts: ImportOptions) -> Imported:
    files = files_of(path, "jsonl")
    metas = [_metadata(f) for f in files]
    E_file = {m.get("num_experts") for m in metas} - {None}
    if len(E_file) > 1:
        raise ImportFormatError(f"{path}: the files record different num_experts {sorted(E_file)}")
    E = next(iter(E_file)) if E_file else opts.num_experts
    if E is None:
        raise UsageError(f"--num-experts is required for the {NAME} layout ({files[0]}'s metadata has no num_experts)")
    col = RowCollector(E)
    cut: list[str] = []
    for f, meta in zip(files, metas, strict=True):
        cut += _events(f, meta, col)
    seqs, L, layers = col.build(str(path))
    models = {m["model_id"] for m in metas}
    return Imported(seqs, L, E, int(col.K or 0), phase_known=True,
                    model_id=opts.model_id or (models.pop() if len(models) == 1 else None),
                    moe_layers=None if layers == list(range(L)) else layers, records=col.records + len(files),
                    cut_lines=cut, **col.dropped())


def _metadata(f: Path) -> dict:
    for ln, m in iter_jsonl(f, limit=1, error=ImportFormatError):
        where = f"{f}:{ln}"
        if not isinstance(m, dict) or m.get("record_type") != "metadata":
            raise ImportFormatError(f"{where}: the first record must be the metadata record")
        check_format(m, FORMAT, 1, ImportFormatError,
                     wrong_format=lambda got, w=where: f"{w}: format must be {FORMAT!r}, got {got!r}",
                     bad_version=lambda v, w=where: f"{w}: format_version {v} is not read here (only version 1)")
        unknown = sorted(set(m) - _META_FIELDS)
        if unknown:
            raise ImportFormatError(f"{where}: unknown metadata field(s) {', '.join(unknown)}")
        str_field(m.get("model_id"), "model_id", where)
        for k in ("num_experts", "experts_per_token"):
            if m.get(k) is not None:
                int_value(m[k], k, where, 1, INT16_MAX + 1)
            else:
                m.pop(k, None)
        return m
    raise ImportFormatError(f"{f} is empty: nothing to import")


def _events(f: Path, meta: dict, col: RowCollector) -> list[str]:
    """Add ``f``'s routing records to ``col``; returns the file's cut line, if a write cut it short."""
    E = col.E
    width = meta.get("experts_per_token")
    if "num_experts" in meta and meta["num_experts"] != E:
        raise ImportFormatError(f"{f}: metadata num_experts {meta['num_experts']} but E={E}")
    last: dict[str, Any] = {"phase": None, "key": None, "max_prompt": -1}
    seen: set[tuple[int, int]] = set()
    lines = JsonLines(f)
    records = iter(lines)
    next(records)  # the metadata record (checked by _metadata)
    n = 0
    for ln, r in records:
        n += 1
        where = f"{f}:{ln}"
        if not isinstance(r, dict) or r.get("record_type") != "routing_selection":
            got = r.get("record_type") if isinstance(r, dict) else type(r).__name__
            raise ImportFormatError(f"{where}: expected a routing_selection record, got {got!r}")
        unknown = sorted(set(r) - _EVENT_FIELDS)
        if unknown:
            raise ImportFormatError(f"{where}: unknown field(s) {', '.join(unknown)}")
        require_keys(r, ("phase", "token_position", "layer", "selected_experts"), ImportFormatError,
                     lambda m, w=where: f"{w}: missing field(s) {', '.join(m)}")
        phase = r["phase"]
        if phase not in ("prompt", "generated"):
            raise ImportFormatError(f"{where}: phase must be 'prompt' or 'generated', got {phase!r}")
        pos = int_value(r["token_position"], "token_position", where, 0, INT32_MAX)
        layer = int_value(r["layer"], "layer", where, 0, INT16_MAX)
        if last["phase"] == "generated" and phase == "prompt":
            raise ImportFormatError(f"{where}: a prompt record after generated records")
        key = (layer, pos) if phase == "prompt" else (pos, layer)
        if last["phase"] == phase and last["key"] is not None and key <= last["key"]:
            order = "(layer, token_position)" if phase == "prompt" else "(token_position, layer)"
            raise ImportFormatError(f"{where}: {phase} records must come in ascending {order} order")
        if (pos, layer) in seen:
            raise ImportFormatError(f"{where}: duplicate event for token_position {pos} layer {layer}")
        seen.add((pos, layer))
        if phase == "prompt":
            last["max_prompt"] = max(last["max_prompt"], pos)
        elif pos <= last["max_prompt"]:
            raise ImportFormatError(f"{where}: generated token_position {pos} is not above every prompt position")
        last["phase"], last["key"] = phase, key
        experts = r["selected_experts"]
        if width is not None and isinstance(experts, list) and len(experts) != width:
            raise ImportFormatError(f"{where}: {len(experts)} selected experts, experts_per_token is {width}")
        probs = r.get("selected_probabilities")
        if probs is not None and not isinstance(probs, list):
            raise ImportFormatError(f"{where}: selected_probabilities must be a list of numbers")
        if probs:
            bad = [p for p in probs if isinstance(p, (int, float)) and not isinstance(p, bool) and not 0 <= p <= 1]
            if bad:
                raise ImportFormatError(f"{where}: selected_probabilities {bad} outside [0, 1]")
        tid = r.get("token_id")
        tid = -1 if tid is None else int_value(tid, "token_id", where, 0, INT32_MAX)
        col.add(where, f.stem, pos, layer, experts, probs or None, "prefill" if phase == "prompt" else "decode", tid)
    if not n:
        raise ImportFormatError(f"{f}: no routing_selection record after the metadata")
    return lines.cut_lines()


SPEC = FormatSpec(NAME, "moe-cache-lab routing-trace-v1 JSONL", read, sniff=sniff, folder_ext="jsonl")
