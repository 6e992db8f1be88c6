"""Import routing traces in expertcast's own JSONL rows (``--format jsonl``) and the per-prompt JSON layout of
``moe_expert_trace.json`` (``--format granite``, :func:`read_expert_trace_json`); the validation helpers the
other layouts' importers (:mod:`expertcast.data.importers`, whose registry lists every layout) share.

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
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.utils.errors import UsageError
from expertcast.utils.io import iter_jsonl
from expertcast.utils.jsonfields import int_field, is_int, require_keys

FLOAT16_MAX = 65504.0
INT16_MAX = 32767
INT32_MAX = 2**31 - 1


class ImportFormatError(UsageError):
    """A JSONL import row is malformed (the message names the file and line)."""


def _int_field(v: Any, what: str, where: str, lo: int, hi: int) -> int:
    """``v`` if it is a JSON integer in [lo, hi], else ImportFormatError."""
    return int_field(v, what, where, lo, hi, ImportFormatError)


def _seq_id(v: Any, where: str) -> str:
    if is_int(v) or (isinstance(v, str) and v):
        return str(v)
    raise ImportFormatError(f"{where}: seq must be a non-empty string or an integer, got {json.dumps(v)}")


def _experts(v: Any, num_experts: int, where: str) -> list[int]:
    if not isinstance(v, list) or not v:
        raise ImportFormatError(f"{where}: experts must be a non-empty list of integers, got {json.dumps(v)}")
    out = []
    for e in v:
        if not is_int(e):
            raise ImportFormatError(f"{where}: experts must be a list of integers, got {json.dumps(e)} in {json.dumps(v)}")
        if not 0 <= e < num_experts:
            raise ImportFormatError(f"{where}: expert id(s) {[x for x in v if is_int(x) and not 0 <= x < num_experts]} "
                                    f"outside [0, E={num_experts})")
        out.append(e)
    if len(set(out)) != len(out):
        raise ImportFormatError(f"{where}: repeated expert in {out}")
    return out


def _weights(v: Any, k: int, where: str) -> list[float]:
    if not isinstance(v, list):
        raise ImportFormatError(f"{where}: weights must be a list of numbers, got {json.dumps(v)}")
    for w in v:
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ImportFormatError(f"{where}: weights must be numbers, got {json.dumps(w)}")
        if not math.isfinite(w):
            raise ImportFormatError(f"{where}: weight {w} is not finite")
        if not 0 <= w <= FLOAT16_MAX:
            raise ImportFormatError(f"{where}: weight {w} outside [0, {FLOAT16_MAX:g}] (weights are stored as float16)")
    if len(v) != k:
        raise ImportFormatError(f"{where}: {len(v)} weights for {k} experts")
    return [float(w) for w in v]


def _parse_row(r: Any, where: str, num_experts: int, num_layers: int | None, k: int | None):
    """(seq id, token, layer, experts, weights | None, phase, token_id) of one validated row; ``k``: the
    number of experts of the earlier rows (None on the first row)."""
    if not isinstance(r, dict):
        raise ImportFormatError(f"{where}: expected a JSON object")
    require_keys(r, ("seq", "token", "layer", "experts"), ImportFormatError,
                 lambda missing: f"{where}: missing field(s) {', '.join(missing)}")
    sid = _seq_id(r["seq"], where)
    t = _int_field(r["token"], "token", where, 0, INT32_MAX)
    max_layer = (num_layers - 1) if num_layers is not None else INT16_MAX
    if is_int(r["layer"]) and num_layers is not None and r["layer"] >= num_layers:
        raise ImportFormatError(f"{where}: layer {r['layer']} but --num-layers is {num_layers}")
    li = _int_field(r["layer"], "layer", where, 0, max_layer)
    experts = _experts(r["experts"], num_experts, where)
    if k is not None and len(experts) != k:
        raise ImportFormatError(f"{where}: {len(experts)} experts, earlier rows have K={k}")
    weights = _weights(r["weights"], len(experts), where) if r.get("weights") is not None else None
    phase = r.get("phase", "decode")
    if phase not in ("prefill", "decode"):
        raise ImportFormatError(f"{where}: phase must be 'prefill' or 'decode', got {json.dumps(phase)}")
    token_id = _int_field(r.get("token_id", -1), "token_id", where, -1, INT32_MAX)
    return sid, t, li, experts, weights, phase, token_id


def read_import_jsonl(path: str | os.PathLike, num_experts: int, num_layers: int | None = None,
                      ) -> tuple[list[TraceSequence], dict[str, int]]:
    """Parse ``path`` into sequences; returns them and counts (rows, sequences, num_layers, top_k,
    dropped_tokens, decode_tokens, phase_known: every row names its phase)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"import file {path} does not exist")
    if not 1 <= num_experts <= INT16_MAX + 1:
        raise UsageError(f"--num-experts must be in [1, {INT16_MAX + 1}] (expert ids are stored as int16), "
                         f"got {num_experts}")
    if num_layers is not None and num_layers < 1:
        raise UsageError(f"--num-layers must be >= 1, got {num_layers}")
    seqs: dict[str, dict[int, dict[int, tuple[list[int], list[float] | None, str, int]]]] = {}
    K: int | None = None
    max_layer = -1
    rows = 0
    no_weights = 0
    phased = 0
    for ln, r in iter_jsonl(path, error=ImportFormatError):
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
                 "decode_tokens": decode, "phase_known": phased == rows}


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


def import_jsonl(path: str | os.PathLike, out: str | os.PathLike, num_experts: int, expert_bytes: int = 0,
                 model_id: str | None = None, num_layers: int | None = None, shard_size: int = 256,
                 overwrite: bool = False) -> TraceMeta:
    """Read ``path`` and write the trace set ``out`` (:func:`expertcast.data.importers.import_traces`, format
    ``jsonl``); returns its meta."""
    from expertcast.data.importers import ImportOptions, import_traces

    meta, _ = import_traces(path, out, "jsonl", ImportOptions(num_experts, num_layers, model_id=model_id),
                            expert_bytes=expert_bytes, shard_size=shard_size, overwrite=overwrite)
    return meta


# ----------------------------------------------------------------------------------------------
# per-prompt expert-trace JSON (e.g. ../shared/data/traces/granite-3.0-1b-a400m/moe_expert_trace.json)

GRANITE_1B_EXPERT_BYTES = 3 * 1024 * 512 * 2
"""Bytes of one granite-3.0-1b-a400m expert in f16: gate, up and down projections of hidden 1024 x expert
intermediate 512 (the model's public config)."""


def _id_grid(v: Any, where: str, L: int, K: int, E: int) -> np.ndarray:
    """Validate a [T][L][K] list of expert ids -> int16 [T, L, K]."""
    if not isinstance(v, list):
        raise ImportFormatError(f"{where}: expected a [tokens][{L} layers][{K} experts] list, got {type(v).__name__}")
    out = np.zeros((len(v), L, K), dtype=np.int16)
    for t, tok in enumerate(v):
        if not isinstance(tok, list) or len(tok) != L:
            raise ImportFormatError(f"{where}[{t}]: expected {L} layers, got {json.dumps(tok)[:80]}")
        for li, row in enumerate(tok):
            if not isinstance(row, list) or len(row) != K:
                raise ImportFormatError(f"{where}[{t}][{li}]: expected {K} expert ids, got {json.dumps(row)[:80]}")
            out[t, li] = _experts(row, E, f"{where}[{t}][{li}]")
    return out


def read_expert_trace_json(path: str | os.PathLike, model_id: str | None = None, expert_bytes: int = 0
                           ) -> tuple[TraceMeta, list[TraceSequence]]:
    """Read the per-prompt expert-trace JSON layout into a trace set (one sequence per prompt, file order).

    Layout: ``{"model", "num_layers": L, "num_experts": E, "top_k": K, "prompts": {name: {"prompt_len",
    "prefill": [T_p][L][K], "decode": [T_d][L][K]}}}``: expert ids per token, layer and rank, no router
    weights, so each selected expert gets weight 1/K. The sequence id is the prompt's name, its prefill
    tokens come first (``prompt_len`` = their number, which must equal the recorded ``prompt_len``) and
    ``token_ids`` are -1 (not recorded). Errors are :class:`ImportFormatError` naming the file and key.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"expert trace file {path} does not exist")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ImportFormatError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ImportFormatError(f"{path}: JSON nested too deeply to be a granite trace file") from None
    if not isinstance(d, dict) or not isinstance(d.get("prompts"), dict) or not d["prompts"]:
        raise ImportFormatError(f"{path}: expected an object with a non-empty 'prompts' object")
    L = _int_field(d.get("num_layers"), "num_layers", str(path), 1, INT16_MAX)
    E = _int_field(d.get("num_experts"), "num_experts", str(path), 2, INT16_MAX + 1)
    K = _int_field(d.get("top_k"), "top_k", str(path), 1, E)
    seqs = []
    for name, pr in d["prompts"].items():
        where = f"{path}: prompts.{name}"
        if not isinstance(pr, dict) or "prefill" not in pr or "decode" not in pr:
            raise ImportFormatError(f"{where}: expected an object with 'prefill' and 'decode'")
        pre = _id_grid(pr["prefill"], f"{where}.prefill", L, K, E)
        dec = _id_grid(pr["decode"], f"{where}.decode", L, K, E)
        if "prompt_len" in pr and _int_field(pr["prompt_len"], "prompt_len", where, 0, INT32_MAX) != len(pre):
            raise ImportFormatError(f"{where}: prompt_len {pr['prompt_len']} but {len(pre)} prefill tokens")
        ids = np.concatenate([pre, dec])
        if not len(ids):
            raise ImportFormatError(f"{where}: no tokens")
        seqs.append(TraceSequence(str(name), np.full(len(ids), -1, dtype=np.int32), len(pre), ids,
                                  np.full(ids.shape, 1.0 / K, dtype=np.float16)))
    meta = TraceMeta(model_id=model_id or str(d.get("model") or "imported"), num_layers=L, num_experts=E, top_k=K,
                     expert_bytes=int(expert_bytes), dataset=path.name,
                     generation={"source": "import", "file": str(path), "weights": "uniform 1/K (not recorded)"})
    return meta, seqs


def import_expert_trace_json(path: str | os.PathLike, out: str | os.PathLike, expert_bytes: int = 0,
                             model_id: str | None = None, overwrite: bool = False, shard_size: int = 256,
                             ) -> tuple[TraceMeta, int]:
    """Read ``path`` (:func:`read_expert_trace_json`) and write the trace set ``out``
    (:func:`expertcast.data.importers.import_traces`, format ``granite``). Returns its meta and the number of
    sequences."""
    from expertcast.data.importers import ImportOptions, import_traces

    meta, imp = import_traces(path, out, "granite", ImportOptions(model_id=model_id), expert_bytes=expert_bytes,
                              shard_size=shard_size, overwrite=overwrite)
    return meta, len(imp.sequences)


def default_expert_bytes(model_id: str) -> int:
    """Bytes of one expert of a model whose size this module knows (granite-3.0-1b-a400m), else 0."""
    return GRANITE_1B_EXPERT_BYTES if str(model_id).lower().startswith("granite-3.0-1b-a400m") else 0
