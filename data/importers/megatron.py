"""Megatron-LM ``RouterTracer`` JSONL (``--moe-routing-trace-path``, Megatron-LM#5220).

The tracer writes one file per rank (``router_trace_rank{r}.jsonl``), one record per (step, block, layer)::

    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0, "num_tokens": 128,
     "topk": 8, "top_indices": [[12, 45, ...], ...]}

``top_indices`` is [num_tokens][topk], the router's top-K of every token that step (in inference a step is one
forward: the prompt, then one row per decode step of each request in the batch). Records of the MTP block (with
``mtp_idx``) are skipped; the decoder's ``layer`` values map in order to the trace's MoE layers (``moe_layers``).
Each rank in the file is one sequence (``rank{r}``) whose positions are the steps' rows in step order; every step
must have every layer once, with the same ``num_tokens`` (a file cut short mid-write lacks some layers of its
last steps: those steps' positions are dropped and counted). The records name neither requests nor phases: phase
unknown (pass one rank's file when tensor-parallel ranks record the same tokens). E is not recorded:
``--num-experts``. Weights are not recorded: 1/K. Sidecar fields (``hs_offset``, ``logit_offset`` ...) are ignored.
"""

from __future__ import annotations

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
    check_ids,
    int_grid,
    int_value,
)
from expertcast.data.importers.spec import FormatSpec
from expertcast.data.trace_format import TraceSequence
from expertcast.utils.jsonfields import require_keys

NAME = "megatron"
_KEYS = ("step", "block", "layer", "rank", "num_tokens", "topk", "top_indices")


def sniff(obj: Any) -> bool:
    return isinstance(obj, dict) and all(k in obj for k in ("step", "layer", "rank", "top_indices"))


def read(path: Path, opts: ImportOptions) -> Imported:
    E = int(opts.num_experts)
    steps: dict[int, dict[int, dict[int, tuple[np.ndarray, str]]]] = {}  # rank -> step -> layer -> (ids, where)
    K: int | None = None
    records = skipped = 0
    lines = JsonLines(path)
    for ln, r in lines:
        where = f"{path}:{ln}"
        if not isinstance(r, dict):
            raise ImportFormatError(f"{where}: expected a JSON object")
        require_keys(r, _KEYS, ImportFormatError, lambda m, w=where: f"{w}: missing field(s) {', '.join(m)}")
        records += 1
        if r["block"] != "decoder":
            if r["block"] != "mtp":
                raise ImportFormatError(f"{where}: block must be 'decoder' or 'mtp', got {r['block']!r}")
            skipped += 1
            continue
        rank = int_value(r["rank"], "rank", where, 0, INT32_MAX)
        step = int_value(r["step"], "step", where, 0, INT32_MAX)
        layer = int_value(r["layer"], "layer", where, 0, INT16_MAX)
        n = int_value(r["num_tokens"], "num_tokens", where, 1, INT32_MAX)
        k = int_value(r["topk"], "topk", where, 1, E)
        if K is not None and k != K:
            raise ImportFormatError(f"{where}: topk {k}, earlier records have {K}")
        K = k
        ids = int_grid(r["top_indices"], 2, "top_indices", where)
        if ids.shape != (n, k):
            raise ImportFormatError(f"{where}: top_indices is {list(ids.shape)}, num_tokens x topk is [{n}, {k}]")
        check_ids(ids, E, where)
        by_layer = steps.setdefault(rank, {}).setdefault(step, {})
        if layer in by_layer:
            raise ImportFormatError(f"{where}: rank {rank} step {step} layer {layer} again (first at "
                                    f"{by_layer[layer][1]})")
        by_layer[layer] = (ids, where)
    if K is None:
        raise ImportFormatError(f"{path} holds no decoder routing records")
    layers = sorted({li for st in steps.values() for by in st.values() for li in by})
    seqs = []
    dropped = dropped_seqs = 0
    for rank in sorted(steps):
        parts = []
        order = sorted(steps[rank])
        full = [sorted(steps[rank][st]) == layers for st in order]
        cut = full.index(False) if not all(full) else len(order)
        if any(full[cut:]):  # a step lacking a layer before a complete one: no write cut short
            by = steps[rank][order[cut]]
            raise ImportFormatError(f"{path}: rank {rank} step {order[cut]} has no record for layer(s) "
                                    f"{sorted(set(layers) - set(by))}, and later steps have every layer")
        # a write cut short: the last steps lack some layers' records; their positions are dropped and counted
        dropped += sum(max(v[0].shape[0] for v in steps[rank][st].values()) for st in order[cut:])
        if cut == 0:
            dropped_seqs += 1
            continue
        for step in order[:cut]:
            by = steps[rank][step]
            counts = {by[li][0].shape[0] for li in layers}
            if len(counts) != 1:
                raise ImportFormatError(f"{by[layers[0]][1]}: rank {rank} step {step} has different num_tokens "
                                        f"across layers ({sorted(counts)})")
            parts.append(np.stack([by[li][0] for li in layers], axis=1))
        ids = np.concatenate(parts).astype(np.int16)
        seqs.append(TraceSequence(f"rank{rank}", np.full(len(ids), -1, dtype=np.int32), 0, ids,
                                  np.full(ids.shape, 1.0 / K, dtype=np.float16)))
    if not seqs:
        raise ImportFormatError(f"{path}: no step has every one of the {len(layers)} layers' records")
    L = len(layers)
    notes = [f"skipped {skipped} MTP record(s)"] if skipped else []
    return Imported(seqs, L, E, K, phase_known=False, model_id=opts.model_id,
                    moe_layers=None if layers == list(range(L)) else layers, records=records, notes=notes,
                    dropped_positions=dropped, dropped_sequences=dropped_seqs, cut_lines=lines.cut_lines())


SPEC = FormatSpec(NAME, "Megatron-LM RouterTracer JSONL, one record per (step, layer, rank)", read, sniff=sniff,
                  requires={"num_experts": "its records do not name E"})
