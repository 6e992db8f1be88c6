"""vLLM "return routed experts" (rollout router replay, R3: ``enable_return_routed_experts``, vllm#28284).

vLLM returns, per completion, the top-K expert ids every MoE layer chose for every forwarded position: an
integer array [T, L, K] with T = prompt tokens + completion tokens - 1 (the last sampled token is never
forwarded). The offline API puts it in ``CompletionOutput.routed_experts`` (a numpy array); the OpenAI-compatible
server puts it in each choice as ``routed_experts``, a base64-encoded ``.npy`` payload. Accepted file: JSON lines,
one request per line, in either shape a user would dump::

    {"request_id": "r0", "prompt_token_ids": [...], "outputs": [{"index": 0, "token_ids": [...],
     "routed_experts": ROUTED}]}                                   # RequestOutput (routed_experts.tolist())
    {"request_id": "r0", "prompt_token_ids": [...], "token_ids": [...], "routed_experts": ROUTED}   # flat
    {"id": "cmpl-1", "choices": [{"index": 0, "token_ids": [...], "routed_experts": "<base64 .npy>"}],
     "usage": {"prompt_tokens": P, "completion_tokens": C}, "prompt_token_ids": [...]}            # server response

``ROUTED`` is a [T][L][K] list of JSON integers or a base64 ``.npy`` string (read with ``allow_pickle=False``).
The sequence id is the request id (``id:index`` when a request has several choices). Phase: the first P positions
are prefill when P is known (``prompt_token_ids`` or ``usage.prompt_tokens``), and T must then be P + C - 1 when C
is known; without P the phase is unknown. E is not recorded: ``--num-experts``. An optional top-level ``source``
string (prompt set / dataset) is kept per sequence. Layers whose ids are -1 everywhere are dense and dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from expertcast.data.importers.common import (
    INT32_MAX,
    Imported,
    ImportFormatError,
    ImportOptions,
    JsonLines,
    Request,
    b64_bytes,
    id_field,
    int_grid,
    int_value,
    npy_array,
    request_sequences,
    str_field,
    token_ids_of,
)
from expertcast.data.importers.spec import FormatSpec

NAME = "vllm"


def sniff(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    units = obj.get("choices") or obj.get("outputs")
    if isinstance(units, list) and units and isinstance(units[0], dict):
        return "routed_experts" in units[0]
    return "routed_experts" in obj and "meta_info" not in obj


def _routed(v: Any, where: str):
    if isinstance(v, str):
        a = npy_array(b64_bytes(v, "routed_experts", where), "routed_experts", where)
        if a.ndim != 3:
            raise ImportFormatError(f"{where}: routed_experts must be [tokens, layers, top_k], got shape {a.shape}")
        return a
    return int_grid(v, 3, "routed_experts", where)


def read(path: Path, opts: ImportOptions) -> Imported:
    E = int(opts.num_experts)
    reqs: list[Request] = []
    count = 0
    lines = JsonLines(path)
    for ln, rec in lines:
        where = f"{path}:{ln}"
        count += 1
        if not isinstance(rec, dict):
            raise ImportFormatError(f"{where}: expected a JSON object (one request)")
        rid = id_field(rec.get("request_id", rec.get("id")), "request_id (or id)", where)
        source = str_field(rec["source"], "source", where) if rec.get("source") is not None else None
        usage = rec.get("usage") if isinstance(rec.get("usage"), dict) else {}
        prompt_ids = rec.get("prompt_token_ids")
        P = len(prompt_ids) if isinstance(prompt_ids, list) else (
            int_value(usage["prompt_tokens"], "usage.prompt_tokens", where, 0, INT32_MAX)
            if "prompt_tokens" in usage else None)
        units = rec.get("choices", rec.get("outputs"))
        if units is None:
            units = [rec]
        if not isinstance(units, list) or not units or not all(isinstance(u, dict) for u in units):
            raise ImportFormatError(f"{where}: choices/outputs must be a non-empty list of objects")
        for u in units:
            if "routed_experts" not in u or u["routed_experts"] is None:
                raise ImportFormatError(f"{where}: request {rid!r} has no routed_experts (was the engine started with "
                                        f"--enable-return-routed-experts?)")
            ids = _routed(u["routed_experts"], where)
            sid = rid if len(units) == 1 else f"{rid}:{id_field(u.get('index'), 'index', where)}"
            out_ids = u.get("token_ids")
            C = len(out_ids) if isinstance(out_ids, list) else (
                int_value(usage["completion_tokens"], "usage.completion_tokens", where, 0, INT32_MAX)
                if "completion_tokens" in usage and len(units) == 1 else None)
            T = ids.shape[0]
            if P is not None and C is not None and T != P + C - 1:
                raise ImportFormatError(f"{where}: request {sid!r} has {T} routed positions, but {P} prompt + {C} "
                                        f"completion tokens make {P + C - 1} forwarded positions")
            if P is not None and P > T:
                raise ImportFormatError(f"{where}: request {sid!r} has {P} prompt tokens but {T} routed positions")
            if T == 0:
                raise ImportFormatError(f"{where}: request {sid!r} has no routed positions")
            reqs.append(Request(sid, ids, where, P, token_ids_of(prompt_ids, out_ids, T, where), source))
    seqs, kept, notes = request_sequences(reqs, E, str(path))
    known = all(r.prompt_len is not None for r in reqs)
    if not known and any(r.prompt_len is not None for r in reqs):
        raise ImportFormatError(f"{path}: some requests record their prompt length and some do not; the phase "
                                f"must be known for all or none")
    _, L, K = seqs[0].expert_ids.shape
    return Imported(seqs, L, E, K, phase_known=known, model_id=opts.model_id, moe_layers=kept, records=count,
                    notes=notes, cut_lines=lines.cut_lines())


SPEC = FormatSpec(NAME, "vLLM return-routed-experts: one request per line, [T, L, K]", read, sniff=sniff,
                  requires={"num_experts": "its records do not name E"})
