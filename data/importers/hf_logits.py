"""transformers ``output_router_logits`` dumps: per-layer router logits, top-K taken here.

A forward with ``output_router_logits=True`` gives one [T, E] logits tensor per MoE layer. Accepted: a
safetensors file of tensors named ``<seq_id>/<layer>`` ([T, E] floats; layers 0..L-1 in the order of the model's
``router_logits`` tuple, every sequence with all of them) and a JSON sidecar beside it, ``<stem>.json``::

    {"format": "expertcast-router-logits", "format_version": 1, "model_id": "Qwen/Qwen1.5-MoE-A2.7B",
     "top_k": 4, "norm_topk_prob": false,
     "sequences": {"<seq_id>": {"prompt_len": 12, "token_ids": [...], "source": "gsm8k"}}}

Routing is the softmax router of transformers' MoE models: probabilities = softmax(logits), the K largest are the
experts (ties to the lower id), their weights the probabilities, renormalised to sum to 1 when
``norm_topk_prob`` (the model config's flag; Mixtral-style routers renormalise, so give true). The full
distribution is kept as ``router_probs``. ``prompt_len`` (null for all: phase unknown), ``token_ids`` and
``source`` are optional per sequence. The tensors are read with safetensors (no pickle); nothing else is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.importers.common import (
    INT16_MAX,
    INT32_MAX,
    Imported,
    ImportFormatError,
    ImportOptions,
    int_grid,
    int_value,
    str_field,
)
from expertcast.data.importers.spec import FormatSpec
from expertcast.data.trace_format import TraceSequence
from expertcast.utils.jsonfields import check_format

NAME = "hf-router-logits"
FORMAT = "expertcast-router-logits"


def sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def read(path: Path, opts: ImportOptions) -> Imported:
    from safetensors import SafetensorError, safe_open

    side = sidecar(path)
    if not side.is_file():
        raise ImportFormatError(f"{path}: its sidecar {side.name} (top_k, norm_topk_prob, sequences) is missing")
    try:
        d = json.loads(side.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ImportFormatError(f"{side}: not valid JSON ({e})") from None
    check_format(d, FORMAT, 1, ImportFormatError,
                 wrong_format=lambda got: f"{side}: format must be {FORMAT!r}, got {got!r}",
                 bad_version=lambda v: f"{side}: format_version {v} is not read here (only version 1)")
    K = int_value(d.get("top_k"), "top_k", str(side), 1, INT16_MAX)
    norm = d.get("norm_topk_prob")
    if not isinstance(norm, bool):
        raise ImportFormatError(f"{side}: norm_topk_prob must be true or false (the model config's flag), got "
                                f"{json.dumps(norm)}")
    meta_seqs = d.get("sequences")
    if not isinstance(meta_seqs, dict) or not meta_seqs:
        raise ImportFormatError(f"{side}: sequences must be a non-empty object of sequence id -> fields")
    try:
        f = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise ImportFormatError(f"{path}: not a safetensors file ({str(e).splitlines()[0]})") from None
    with f:
        names = list(f.keys())
        by_seq: dict[str, dict[int, str]] = {}
        for n in names:
            sid, sep, layer = n.rpartition("/")
            if not sep or not sid or not layer.isdigit() or not layer.isascii():
                raise ImportFormatError(f"{path}: tensor {n!r} is not named <seq_id>/<layer>")
            by_seq.setdefault(sid, {})[int(layer)] = n
        extra = sorted(set(by_seq) - set(meta_seqs))
        if extra:
            raise ImportFormatError(f"{path}: tensors of sequence(s) {extra[:3]} that {side.name} does not list")
        L = max(max(v) for v in by_seq.values()) + 1 if by_seq else 0
        seqs, known, E = [], [], None
        for sid, m in meta_seqs.items():
            where = f"{side}: sequences.{sid}"
            if sid not in by_seq:
                raise ImportFormatError(f"{where}: no tensors {sid}/<layer> in {path.name}")
            if sorted(by_seq[sid]) != list(range(L)):
                raise ImportFormatError(f"{path}: sequence {sid!r} has layers {sorted(by_seq[sid])}, expected 0..{L - 1}")
            logits = []
            for li in range(L):
                t = f.get_tensor(by_seq[sid][li])
                if t.ndim != 2 or not t.is_floating_point():
                    raise ImportFormatError(f"{path}: tensor {by_seq[sid][li]!r} must be [T, E] floats, got "
                                            f"{list(t.shape)} {t.dtype}")
                logits.append(t.float().numpy())
            shapes = {a.shape for a in logits}
            if len(shapes) != 1:
                raise ImportFormatError(f"{path}: sequence {sid!r} has layers of shapes {sorted(shapes)}")
            T, e = shapes.pop()
            E = e if E is None else E
            if e != E:
                raise ImportFormatError(f"{path}: sequence {sid!r} has E={e}, earlier sequences E={E}")
            if not 1 <= K <= E or E > INT16_MAX + 1 or T == 0:
                raise ImportFormatError(f"{path}: sequence {sid!r}: top_k {K} with E={E} and {T} tokens")
            seq, has_prompt_len = _sequence(sid, np.stack(logits, axis=1), K, norm, m, where)
            seqs.append(seq)
            known.append(has_prompt_len)
    if any(known) and not all(known):
        raise ImportFormatError(f"{side}: some sequences give prompt_len and some do not (null); the phase must be "
                                f"known for all or none")
    return Imported(seqs, L, int(E or 0), K, phase_known=all(known), has_router_probs=True,
                    model_id=opts.model_id or (str(d["model_id"]) if d.get("model_id") else None),
                    records=len(names),
                    notes=[f"top-{K} of softmax(logits){', renormalised' if norm else ''}"])


def _sequence(sid: str, logits: np.ndarray, K: int, norm: bool, m: Any, where: str) -> tuple[TraceSequence, bool]:
    """Top-K routing of [T, L, E] logits, and whether the sidecar gives the sequence's prompt_len."""
    if not isinstance(m, dict):
        raise ImportFormatError(f"{where}: expected an object (prompt_len, token_ids, source)")
    if not np.isfinite(logits).all():
        raise ImportFormatError(f"{where}: non-finite router logits")
    T = logits.shape[0]
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[..., :K]
    w = np.take_along_axis(p, ids, axis=-1)
    if norm:
        w = w / w.sum(axis=-1, keepdims=True)
    pl = m.get("prompt_len")
    pl = None if pl is None else int_value(pl, "prompt_len", where, 0, T)
    tok = np.full(T, -1, dtype=np.int32)
    if m.get("token_ids") is not None:
        t = int_grid(m["token_ids"], 1, "token_ids", where)
        if len(t) != T or (t < 0).any() or (t > INT32_MAX).any():
            raise ImportFormatError(f"{where}: token_ids must be {T} ids in [0, {INT32_MAX}]")
        tok = t.astype(np.int32)
    source = str_field(m["source"], "source", where) if m.get("source") is not None else None
    return TraceSequence(sid, tok, pl or 0, ids.astype(np.int16), w.astype(np.float16), p.astype(np.float16),
                         source), pl is not None


SPEC = FormatSpec(NAME, "transformers output_router_logits: safetensors + JSON sidecar", read, suffix=".safetensors",
                  files=lambda p: [p, sidecar(p)])
