"""Import routing traces made elsewhere (vLLM, llama.cpp hooks) from the JSONL format of DESIGN.md.

One JSON object per (sequence, token, MoE layer)::

    {"seq": id, "token": t, "layer": l, "experts": [...K ids], "weights": [...K], "phase": "prefill"|"decode"}

Optional: ``token_id`` (the vocabulary id at that position; -1 when absent) and ``weights``
(uniform 1/K when absent, with a warning). L is the largest layer index + 1 (or ``num_layers``),
K the length of ``experts`` (the same on every row). Tokens missing a layer are dropped with a
warning. Prefill tokens must come before decode tokens of the same sequence; their count is
``prompt_len``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.trace_format import TraceMeta, TraceSequence


class ImportFormatError(ValueError):
    """A JSONL import row is malformed (the message names the file and line)."""


def read_import_jsonl(path: str | os.PathLike, num_experts: int, num_layers: int | None = None,
                      ) -> tuple[list[TraceSequence], dict[str, int]]:
    """Parse ``path`` into sequences; returns them and counts (rows, dropped_tokens, ...)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"import file {path} does not exist")
    if num_experts < 1:
        raise ValueError(f"--num-experts must be >= 1, got {num_experts}")
    seqs: dict[str, dict[int, dict[int, tuple[list[int], list[float] | None, str, int]]]] = {}
    K: int | None = None
    max_layer = -1
    rows = 0
    no_weights = 0
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{ln}"
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ImportFormatError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(r, dict):
                raise ImportFormatError(f"{where}: expected a JSON object")
            missing = [k for k in ("seq", "token", "layer", "experts") if k not in r]
            if missing:
                raise ImportFormatError(f"{where}: missing field(s) {', '.join(missing)}")
            try:
                sid, t, li = str(r["seq"]), int(r["token"]), int(r["layer"])
                experts = [int(e) for e in r["experts"]]
            except (TypeError, ValueError):
                raise ImportFormatError(f"{where}: token/layer must be integers and experts a list of integers") from None
            if t < 0 or li < 0:
                raise ImportFormatError(f"{where}: negative token or layer index")
            if num_layers is not None and li >= num_layers:
                raise ImportFormatError(f"{where}: layer {li} but --num-layers is {num_layers}")
            if K is None:
                K = len(experts)
                if K < 1:
                    raise ImportFormatError(f"{where}: empty experts list")
            if len(experts) != K:
                raise ImportFormatError(f"{where}: {len(experts)} experts, earlier rows have K={K}")
            if len(set(experts)) != K:
                raise ImportFormatError(f"{where}: repeated expert in {experts}")
            bad = [e for e in experts if not 0 <= e < num_experts]
            if bad:
                raise ImportFormatError(f"{where}: expert id(s) {bad} outside [0, E={num_experts})")
            weights = r.get("weights")
            if weights is None:
                no_weights += 1
            else:
                try:
                    weights = [float(w) for w in weights]
                except (TypeError, ValueError):
                    raise ImportFormatError(f"{where}: weights must be a list of numbers") from None
                if len(weights) != K:
                    raise ImportFormatError(f"{where}: {len(weights)} weights for {K} experts")
            phase = r.get("phase", "decode")
            if phase not in ("prefill", "decode"):
                raise ImportFormatError(f"{where}: phase must be 'prefill' or 'decode', got {phase!r}")
            tok = seqs.setdefault(sid, {}).setdefault(t, {})
            if li in tok:
                raise ImportFormatError(f"{where}: duplicate row for seq {sid!r} token {t} layer {li}")
            tok[li] = (experts, weights, phase, int(r.get("token_id", -1)))
            max_layer = max(max_layer, li)
            rows += 1
    if not rows:
        raise ImportFormatError(f"{path} holds no rows")
    assert K is not None
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
        out.append(TraceSequence(sid, token_ids, prompt_len, ids, w.astype(np.float16)))
    if dropped:
        warnings.warn(
            f"{path}: dropped {dropped} incomplete token(s) (fewer than L={L} layers)"
            + (f"; {dropped_seqs} sequence(s) had no complete token" if dropped_seqs else ""),
            stacklevel=2,
        )
    if not out:
        raise ImportFormatError(f"{path}: no complete token (every token misses a layer of L={L})")
    return out, {"rows": rows, "sequences": len(out), "num_layers": L, "top_k": K, "dropped_tokens": dropped}


def import_jsonl(path: str | os.PathLike, out: str | os.PathLike, num_experts: int, expert_bytes: int = 0,
                 model_id: str | None = None, num_layers: int | None = None, shard_size: int = 256,
                 overwrite: bool = True) -> tuple[TraceMeta, dict[str, Any]]:
    """Read ``path`` and write the trace set ``out``; returns its meta and the import counts."""
    from expertcast.data.traces import write_traces

    seqs, counts = read_import_jsonl(path, num_experts, num_layers)
    meta = TraceMeta(
        model_id=model_id or "imported", num_layers=counts["num_layers"], num_experts=num_experts,
        top_k=counts["top_k"], expert_bytes=int(expert_bytes), dataset=Path(path).name,
        generation={"source": "import", "file": str(path)},
    )
    write_traces(out, meta, seqs, shard_size=shard_size, run={"import": str(Path(path).resolve())},
                 overwrite=overwrite)
    return meta, counts
