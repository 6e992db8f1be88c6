"""The per-prompt expert-trace JSON of ``moe_expert_trace.json`` (``--format granite``; e.g.
``../shared/data/traces/granite-3.0-1b-a400m/moe_expert_trace.json``): one document, read whole
(:func:`read_expert_trace_json`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.importers.common import (
    INT16_MAX,
    INT32_MAX,
    Imported,
    ImportFormatError,
    ImportOptions,
    expert_list,
    int_value,
)
from expertcast.data.importers.spec import FormatSpec
from expertcast.data.trace_format import TraceMeta, TraceSequence

NAME = "granite"


def sniff(obj: Any) -> bool:
    return isinstance(obj, dict) and all(k in obj for k in ("num_layers", "num_experts", "top_k", "prompts"))


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
            out[t, li] = expert_list(row, E, f"{where}[{t}][{li}]")
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
    L = int_value(d.get("num_layers"), "num_layers", str(path), 1, INT16_MAX)
    E = int_value(d.get("num_experts"), "num_experts", str(path), 2, INT16_MAX + 1)
    K = int_value(d.get("top_k"), "top_k", str(path), 1, E)
    seqs = []
    for name, pr in d["prompts"].items():
        where = f"{path}: prompts.{name}"
        if not isinstance(pr, dict) or "prefill" not in pr or "decode" not in pr:
            raise ImportFormatError(f"{where}: expected an object with 'prefill' and 'decode'")
        pre = _id_grid(pr["prefill"], f"{where}.prefill", L, K, E)
        dec = _id_grid(pr["decode"], f"{where}.decode", L, K, E)
        if "prompt_len" in pr and int_value(pr["prompt_len"], "prompt_len", where, 0, INT32_MAX) != len(pre):
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


def default_expert_bytes(model_id: str) -> int:
    """Bytes of one expert of a model whose size this module knows (granite-3.0-1b-a400m), else 0."""
    return GRANITE_1B_EXPERT_BYTES if str(model_id).lower().startswith("granite-3.0-1b-a400m") else 0


def read(path: Path, opts: ImportOptions) -> Imported:
    meta, seqs = read_expert_trace_json(path, opts.model_id)
    return Imported(seqs, meta.num_layers, meta.num_experts, meta.top_k, phase_known=True, model_id=meta.model_id,
                    records=len(seqs), notes=["router weights not recorded: 1/K"])


SPEC = FormatSpec(NAME, "per-prompt expert-trace JSON (prefill/decode [T][L][K])", read, sniff=sniff)
