"""Routing-study JSONL: one row per (problem, token, layer), as some Mixtral routing studies publish::

    {"dataset": "gsm8k", "problem_id": 17, "token_idx": 0, "layer": 0, "experts": [3, 6],
     "gating_probs": [0.71, 0.29]}

A sequence is one (dataset, problem_id) pair, id ``dataset/problem_id``; ``dataset`` is kept as its source (for a
fit/eval split by dataset). ``token_idx`` positions run without a gap from the first; every position needs every
layer. ``gating_probs`` (optional) are the K experts' gate weights, kept as recorded (1/K when absent). No
prompt/generation boundary is recorded (phase unknown) and not E (``--num-experts``).
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
    id_field,
    int_value,
    str_field,
)
from expertcast.data.importers.spec import FormatSpec
from expertcast.utils.jsonfields import require_keys

NAME = "gating-jsonl"
_KEYS = ("dataset", "problem_id", "token_idx", "layer", "experts")


def sniff(obj: Any) -> bool:
    return isinstance(obj, dict) and all(k in obj for k in _KEYS)


def read(path: Path, opts: ImportOptions) -> Imported:
    E = int(opts.num_experts)
    col = RowCollector(E)
    lines = JsonLines(path)
    for ln, r in lines:
        where = f"{path}:{ln}"
        if not isinstance(r, dict):
            raise ImportFormatError(f"{where}: expected a JSON object")
        require_keys(r, _KEYS, ImportFormatError, lambda m, w=where: f"{w}: missing field(s) {', '.join(m)}")
        ds = str_field(r["dataset"], "dataset", where)
        sid = f"{ds}/{id_field(r['problem_id'], 'problem_id', where)}"
        col.add(where, sid, int_value(r["token_idx"], "token_idx", where, 0, INT32_MAX),
                int_value(r["layer"], "layer", where, 0, INT16_MAX), r["experts"], r.get("gating_probs"),
                source=ds)
    seqs, L, layers = col.build(str(path))
    return Imported(seqs, L, E, int(col.K or 0), phase_known=False, model_id=opts.model_id,
                    moe_layers=None if layers == list(range(L)) else layers, records=col.records,
                    cut_lines=lines.cut_lines(), **col.dropped())


SPEC = FormatSpec(NAME, "routing-study JSONL: dataset, problem_id, token_idx, layer, experts", read, sniff=sniff,
                  requires={"num_experts": "its records do not name E"})
