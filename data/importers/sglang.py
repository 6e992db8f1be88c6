"""SGLang ``return_routed_experts`` (server ``--enable-return-routed-experts``, request ``return_routed_experts``;
sglang#9499).

SGLang returns a request's routing in the response's ``meta_info["routed_experts"]``: the base64 encoding of a
flat array of expert ids in the order (position, layer, top-k slot), int32 unless ``meta_info
["routed_experts_dtype"]`` names another integer dtype (int8/16/32/64, uint8/16/32), covering the prompt and
the completion. The array does not carry its shape: ``--num-layers L`` and ``--top-k K`` (the model's layers
and experts per token) reshape it to [T, L, K]; since any pair with the same product L x K reshapes it, the rows
are cross-checked where they can tell: a row must hold K distinct ids (a K too large mixes two layers), dense
layers are -1 in whole rows, and two neighbouring layers that never share an expert at any position over enough
positions are one router's top-K cut in two (a K too small) and refused. Accepted file: JSON lines, each a ``/generate`` response object
(or a JSON list of them, as a batched request returns)::

    {"text": "...", "meta_info": {"id": "...", "prompt_tokens": P, "completion_tokens": C,
     "routed_experts": "<base64>", "routed_experts_dtype": "int32"}, "source": "gsm8k"}

T must be P + C - 1 (the last sampled token is not forwarded) or P + C; the first P positions are prefill.
Without ``prompt_tokens`` the phase is unknown. E is not recorded: ``--num-experts``. An optional top-level
``source`` string is kept per sequence. Layers whose ids are -1 everywhere are dense and dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.importers.common import (
    INT32_MAX,
    Imported,
    ImportFormatError,
    ImportOptions,
    JsonLines,
    Request,
    b64_bytes,
    check_not_split,
    id_field,
    int_value,
    request_sequences,
    str_field,
)
from expertcast.data.importers.spec import FormatSpec

NAME = "sglang"
_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


def sniff(obj: Any) -> bool:
    if isinstance(obj, list) and obj:
        obj = obj[0]
    return isinstance(obj, dict) and isinstance(obj.get("meta_info"), dict) and "routed_experts" in obj["meta_info"]


def read(path: Path, opts: ImportOptions) -> Imported:
    E, L, K = int(opts.num_experts), int(opts.num_layers), int(opts.top_k)
    reqs: list[Request] = []
    count = 0
    lines = JsonLines(path)
    for ln, rec in lines:
        where = f"{path}:{ln}"
        count += 1
        for i, r in enumerate(rec if isinstance(rec, list) else [rec]):
            w = where if not isinstance(rec, list) else f"{where}[{i}]"
            if not isinstance(r, dict) or not isinstance(r.get("meta_info"), dict):
                raise ImportFormatError(f"{w}: expected a /generate response object with meta_info")
            reqs.append(_request(r, w, L, K))
    hint = (f"the payload does not record its shape, so --num-layers {L} and --top-k {K} must be the model's (another "
            f"pair with the same product {L * K} reshapes it without error)")
    seqs, kept, notes = request_sequences(reqs, E, str(path), hint)
    check_not_split([s.expert_ids.astype(np.int64) for s in seqs], E, "layer", str(path), hint)
    known = all(r.prompt_len is not None for r in reqs)
    if not known and any(r.prompt_len is not None for r in reqs):
        raise ImportFormatError(f"{path}: some responses record prompt_tokens and some do not; the phase must be "
                                f"known for all or none")
    return Imported(seqs, seqs[0].expert_ids.shape[1], E, K, phase_known=known, model_id=opts.model_id,
                    moe_layers=kept, records=count, notes=notes,
                    cut_lines=lines.cut_lines())


def _request(r: dict, where: str, L: int, K: int) -> Request:
    m = r["meta_info"]
    sid = id_field(m.get("id", r.get("rid")), "meta_info.id", where)
    if m.get("routed_experts") is None:
        raise ImportFormatError(f"{where}: response {sid!r} has no meta_info.routed_experts (was it requested with "
                                f"return_routed_experts?)")
    dtype = m.get("routed_experts_dtype", "int32")
    if dtype not in _DTYPES:
        raise ImportFormatError(f"{where}: routed_experts_dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    raw = b64_bytes(m["routed_experts"], "meta_info.routed_experts", where)
    size = np.dtype(dtype).itemsize
    if len(raw) % (size * L * K):
        raise ImportFormatError(f"{where}: routed_experts holds {len(raw) // size} {dtype} ids, not a multiple of "
                                f"--num-layers x --top-k = {L} x {K}")
    ids = np.frombuffer(raw, dtype=dtype).astype(np.int64).reshape(-1, L, K)
    T = ids.shape[0]
    P = int_value(m["prompt_tokens"], "meta_info.prompt_tokens", where, 0, INT32_MAX) if "prompt_tokens" in m else None
    if P is not None and "completion_tokens" in m:
        C = int_value(m["completion_tokens"], "meta_info.completion_tokens", where, 0, INT32_MAX)
        if T not in (P + C - 1, P + C):
            raise ImportFormatError(f"{where}: response {sid!r} has {T} routed positions, but {P} prompt + {C} "
                                    f"completion tokens make {P + C - 1} (or {P + C})")
    if T == 0 or (P is not None and P > T):
        raise ImportFormatError(f"{where}: response {sid!r} has {T} routed positions for {P} prompt tokens")
    source = str_field(r["source"], "source", where) if r.get("source") is not None else None
    return Request(sid, ids, where, P, None, source)


SPEC = FormatSpec(NAME, "SGLang /generate responses, base64 meta_info.routed_experts", read, sniff=sniff,
                  requires={"num_experts": "its records do not name E",
                            "num_layers": "its payload is a flat array: give the model's MoE layers",
                            "top_k": "its payload is a flat array: give the experts per token"},
                  inputs=("num_layers", "top_k"))
