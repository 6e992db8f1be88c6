"""expertcast's own JSONL rows (``--format jsonl``).

One JSON object per (sequence, token, MoE layer)::

    {"seq": id, "token": t, "layer": l, "experts": [...K ids], "weights": [...K], "phase": "prefill"|"decode"}

Optional: ``token_id`` (the vocabulary id at that position; -1 when absent), ``weights`` (uniform
1/K when absent, with a warning) and ``phase`` (``decode`` when absent). L is the largest layer
index + 1 (or ``num_layers``), K the length of ``experts`` (the same on every row). Tokens missing a
layer are dropped with a warning. Prefill tokens must come before decode tokens of the same
sequence; their count is ``prompt_len``.

Rows are validated, never coerced: ``seq`` is a string or an integer; ``token``, ``layer``, expert
ids and ``token_id`` are JSON integers (not strings, floats or booleans) in range; weights are finite
numbers in [0, 65504] (stored as float16). Every error is an :class:`ImportFormatError` naming
``file:line``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.importers.common import (
    INT16_MAX,
    INT32_MAX,
    Imported,
    ImportFormatError,
    ImportOptions,
    JsonLines,
    check_num_experts,
    expert_list,
    id_field,
    int_value,
    weight_list,
)
from expertcast.data.importers.spec import FormatSpec
from expertcast.data.trace_format import TraceSequence
from expertcast.utils.errors import UsageError
from expertcast.utils.jsonfields import is_int, require_keys

NAME = "jsonl"


def sniff(obj: Any) -> bool:
    return isinstance(obj, dict) and all(k in obj for k in ("seq", "token", "layer", "experts"))


def _parse_row(r: Any, where: str, num_experts: int, num_layers: int | None, k: int | None):
    """(seq id, token, layer, experts, weights | None, phase, token_id) of one validated row; ``k``: the
    number of experts of the earlier rows (None on the first row)."""
    if not isinstance(r, dict):
        raise ImportFormatError(f"{where}: expected a JSON object")
    require_keys(r, ("seq", "token", "layer", "experts"), ImportFormatError,
                 lambda missing: f"{where}: missing field(s) {', '.join(missing)}")
    sid = id_field(r["seq"], "seq", where)
    t = int_value(r["token"], "token", where, 0, INT32_MAX)
    max_layer = (num_layers - 1) if num_layers is not None else INT16_MAX
    if is_int(r["layer"]) and num_layers is not None and r["layer"] >= num_layers:
        raise ImportFormatError(f"{where}: layer {r['layer']} but --num-layers is {num_layers}")
    li = int_value(r["layer"], "layer", where, 0, max_layer)
    experts = expert_list(r["experts"], num_experts, where)
    if k is not None and len(experts) != k:
        raise ImportFormatError(f"{where}: {len(experts)} experts, earlier rows have K={k}")
    weights = weight_list(r["weights"], len(experts), where) if r.get("weights") is not None else None
    phase = r.get("phase", "decode")
    if phase not in ("prefill", "decode"):
        raise ImportFormatError(f"{where}: phase must be 'prefill' or 'decode', got {json.dumps(phase)}")
    token_id = int_value(r.get("token_id", -1), "token_id", where, -1, INT32_MAX)
    return sid, t, li, experts, weights, phase, token_id


def read_import_jsonl(path: str | os.PathLike, num_experts: int, num_layers: int | None = None,
                      ) -> tuple[list[TraceSequence], dict[str, int]]:
    """Parse ``path`` into sequences; returns them and counts (rows, sequences, num_layers, top_k,
    dropped_tokens, dropped_sequences, decode_tokens, phase_known: every row names its phase)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"import file {path} does not exist")
    check_num_experts(num_experts)
    if num_layers is not None and num_layers < 1:
        raise UsageError(f"--num-layers must be >= 1, got {num_layers}")
    seqs: dict[str, dict[int, dict[int, tuple[list[int], list[float] | None, str, int]]]] = {}
    K: int | None = None
    max_layer = -1
    rows = 0
    no_weights = 0
    phased = 0
    lines = JsonLines(path)
    for ln, r in lines:
        where = f"{path}:{ln}"
        sid, t, li, experts, weights, phase, token_id = _parse_row(r, where, num_experts, num_layers, K)
        K = len(experts)
        no_weights += weights is None
        phased += "phase" in r
        tok = seqs.setdefault(sid, {}).setdefault(t, {})
        if li in tok:
            raise ImportFormatError(f"{where}: duplicate row for seq {sid!r} token {t} layer {li}")
        tok[li] = (experts, weights, phase, token_id)
        max_layer = max(max_layer, li)
        rows += 1
    if not rows or K is None:
        raise ImportFormatError(f"{path} holds no rows")
    L = num_layers if num_layers is not None else max_layer + 1
    if no_weights:
        warnings.warn(f"{no_weights} rows of {path} have no weights: using 1/K", stacklevel=2)
    out: list[TraceSequence] = []
    dropped = 0
    dropped_seqs = 0
    for sid, toks in seqs.items():
        complete = [t for t in sorted(toks) if len(toks[t]) == L]
        dropped += len(toks) - len(complete)
        if not complete:
            dropped_seqs += 1
            continue
        out.append(_sequence(path, sid, toks, complete, L, K))
    if dropped:
        warnings.warn(
            f"{path}: dropped {dropped} incomplete token(s) (fewer than L={L} layers)"
            + (f"; {dropped_seqs} sequence(s) had no complete token" if dropped_seqs else ""),
            stacklevel=2,
        )
    if not out:
        raise ImportFormatError(f"{path}: no complete token (every token misses a layer of L={L})")
    decode = sum(s.num_tokens - s.prompt_len for s in out)
    if decode == 0:
        warnings.warn(f"{path}: every token is prefill; decode-only metrics (simulate, forecasters) will refuse "
                      f"these traces", stacklevel=2)
    return out, {"rows": rows, "sequences": len(out), "num_layers": L, "top_k": K, "dropped_tokens": dropped,
                 "dropped_sequences": dropped_seqs, "decode_tokens": decode, "phase_known": phased == rows,
                 "cut_lines": lines.cut_lines()}


def _sequence(path: Path, sid: str, toks: dict, complete: list[int], L: int, K: int) -> TraceSequence:
    """One :class:`TraceSequence` from the complete tokens ``complete`` of sequence ``sid``."""
    ids = np.zeros((len(complete), L, K), dtype=np.int16)
    w = np.full((len(complete), L, K), 1.0 / K, dtype=np.float32)
    token_ids = np.full(len(complete), -1, dtype=np.int32)
    phases = []
    for i, t in enumerate(complete):
        layer_phases = {toks[t][li][2] for li in range(L)}
        if len(layer_phases) != 1:
            raise ImportFormatError(f"{path}: seq {sid!r} token {t} has phase {sorted(layer_phases)} across layers")
        phases.append(layer_phases.pop())
        token_ids[i] = toks[t][0][3]
        for li in range(L):
            experts, weights, _, _ = toks[t][li]
            ids[i, li] = experts
            if weights is not None:
                w[i, li] = weights
    prompt_len = phases.count("prefill")
    if any(p == "decode" for p in phases[:prompt_len]):
        first_dec = complete[phases.index("decode")]
        raise ImportFormatError(f"{path}: seq {sid!r} has a prefill token after decode token {first_dec}")
    return TraceSequence(sid, token_ids, prompt_len, ids, w.astype(np.float16))


def read(path: Path, opts: ImportOptions) -> Imported:
    seqs, c = read_import_jsonl(path, int(opts.num_experts or 0), opts.num_layers)
    notes = [f"{c['rows']} rows"]
    return Imported(seqs, c["num_layers"], int(opts.num_experts or 0), c["top_k"], phase_known=c["phase_known"],
                    model_id=opts.model_id, records=c["rows"], notes=notes, dropped_positions=c["dropped_tokens"],
                    dropped_sequences=c["dropped_sequences"], cut_lines=c["cut_lines"])


SPEC = FormatSpec(NAME, "expertcast's rows: one per (seq, token, layer)", read, sniff=sniff,
                  requires={"num_experts": "its records do not name E"}, inputs=("num_layers",))
