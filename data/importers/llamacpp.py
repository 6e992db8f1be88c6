"""llama.cpp ``moe-trace`` CSV (``examples/moe-trace``, llama.cpp#28544: the scheduler eval callback reads every
``ffn_moe_topk-<layer>`` tensor of a prompt evaluation and a greedy continuation).

Two headers are accepted, one file per sequence (the file name's stem is its id; a folder of ``*.csv`` files is one
sequence per file):

* ``layer,expert`` (the upstream example): one row per routed activation in callback order, i.e. per ubatch, per
  MoE layer, the rows of its tokens in order, each token's K experts in rank order. The file names no token, so
  ``--top-k K`` is required: each layer's rows are cut into tokens of K rows (every layer the same number of
  rows, a multiple of K; a file cut short mid-write leaves its last layers short of the last tokens, which are
  dropped and counted). The prompt/continuation boundary is not recorded: phase unknown. A wrong ``--top-k`` that
  divides the row count is cross-checked where the rows can tell: a token's K ids are distinct (a K too large
  mixes tokens), and neighbouring "tokens" that never share an expert over enough rows are one token's top-K cut
  in pieces (a K too small) and refused.
* ``phase,token,layer,rank,expert`` (the fork that adds token and phase indices): ``phase`` is ``prefill`` or
  ``decode``, ``token`` the zero-based position, ``rank`` the expert's place in the top-K. Phase known; K is
  the file's (a ``--top-k`` that disagrees is refused).

``layer`` is the model's layer index (dense layers have no rows): the distinct values map in order to the trace's
MoE layers and are recorded as ``moe_layers``. E is not recorded: ``--num-experts``. Weights are not recorded: 1/K.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from expertcast.data.importers.common import (
    INT16_MAX,
    Imported,
    ImportFormatError,
    ImportOptions,
    RowCollector,
    check_ids,
    check_not_split,
    csv_int,
    csv_rows,
    files_of,
    need,
)
from expertcast.data.importers.spec import FormatSpec
from expertcast.data.trace_format import TraceSequence
from expertcast.utils.errors import UsageError

NAME = "llamacpp"
UPSTREAM = ("layer", "expert")
INDEXED = ("phase", "token", "layer", "rank", "expert")


def sniff_header(cells: tuple[str, ...]) -> bool:
    return cells in (UPSTREAM, INDEXED)


def read(path: Path, opts: ImportOptions) -> Imported:
    E = int(opts.num_experts)
    files = files_of(path, "csv")
    with open(files[0], encoding="utf-8") as f:
        head = tuple(c.strip() for c in f.readline().strip().split(","))
    if head == UPSTREAM:
        return _read_upstream(files, E, need(opts.top_k, "--top-k", f"{NAME} (layer,expert)",
                                             "its rows name no token: give the experts per token"), opts)
    return _read_indexed(files, E, opts)


def _read_indexed(files: list[Path], E: int, opts: ImportOptions) -> Imported:
    col = RowCollector(E)
    for f in files:
        groups: dict[tuple[int, int], dict[int, tuple[int, str, str]]] = {}
        for ln, (phase, tok, layer, rank, expert) in csv_rows(f, INDEXED):
            where = f"{f}:{ln}"
            if phase not in ("prefill", "decode"):
                raise ImportFormatError(f"{where}: phase must be 'prefill' or 'decode', got {phase!r}")
            key = (csv_int(tok, "token", where), csv_int(layer, "layer", where, 0, INT16_MAX))
            r = csv_int(rank, "rank", where, 0, INT16_MAX)
            g = groups.setdefault(key, {})
            if r in g:
                raise ImportFormatError(f"{where}: duplicate rank {r} for token {key[0]} layer {key[1]}")
            g[r] = (csv_int(expert, "expert", where, 0, INT16_MAX), phase, where)
        for (t, layer), g in groups.items():
            ranks = sorted(g)
            first = g[ranks[0]][2]
            if ranks != list(range(len(ranks))):
                raise ImportFormatError(f"{first}: token {t} layer {layer} has ranks {ranks}, expected 0..K-1")
            phases = {v[1] for v in g.values()}
            if len(phases) != 1:
                raise ImportFormatError(f"{first}: token {t} layer {layer} has phases {sorted(phases)}")
            col.add(first, f.stem, t, layer, [g[r][0] for r in ranks], phase=phases.pop())
    seqs, L, layers = col.build(str(files[0] if len(files) == 1 else files[0].parent))
    if opts.top_k is not None and opts.top_k != col.K:  # this header records the rank: K is the file's
        raise UsageError(f"--top-k {opts.top_k}, but {files[0]} records {col.K} ranks per token ({NAME} layout, "
                         f"{','.join(INDEXED)})")
    return Imported(seqs, L, E, int(col.K or 0), phase_known=True, model_id=opts.model_id,
                    moe_layers=None if layers == list(range(L)) else layers, records=col.records,
                    **col.dropped())


def _read_upstream(files: list[Path], E: int, K: int, opts: ImportOptions) -> Imported:
    hint = (f"the file records no token, so --top-k {K} must be the model's (a wrong K that divides a layer's row "
            f"count cuts the rows into other tokens without error)")
    seqs = []
    layers_all: list[int] | None = None
    rows = dropped = dropped_seqs = 0
    for f in files:
        per: dict[int, list[int]] = {}
        first: dict[int, str] = {}
        for ln, (layer, expert) in csv_rows(f, UPSTREAM):
            where = f"{f}:{ln}"
            li = csv_int(layer, "layer", where, 0, INT16_MAX)
            per.setdefault(li, []).append(csv_int(expert, "expert", where, 0, INT16_MAX))
            first.setdefault(li, where)
            rows += 1
        if not per:
            raise ImportFormatError(f"{f} holds no rows")
        layers = sorted(per)
        if layers_all is not None and layers != layers_all:
            raise ImportFormatError(f"{f}: MoE layers {layers}, {files[0]} has {layers_all}")
        layers_all = layers
        n = {li: len(v) for li, v in per.items()}
        count = max(n.values())
        if len(set(n.values())) == 1 and count % K:
            raise ImportFormatError(f"{f}: {count} rows per layer is not a multiple of --top-k {K}")
        # rows come per ubatch, layer by layer: a write cut short leaves the last layers short of the last
        # tokens; the tokens every layer has are kept, the rest dropped and counted
        keep = min(n.values()) // K
        dropped += -(-count // K) - keep
        if keep == 0:
            dropped_seqs += 1
            continue
        ids = np.stack([np.asarray(per[li][:keep * K], dtype=np.int64).reshape(-1, K) for li in layers], axis=1)
        check_ids(ids, E, f"{f}", hint)
        seqs.append(TraceSequence(f.stem, np.full(len(ids), -1, dtype=np.int32), 0, ids.astype(np.int16),
                                  np.full(ids.shape, 1.0 / K, dtype=np.float16)))
    if not seqs:
        raise ImportFormatError(f"{files[0]}: no token has every layer's rows (--top-k {K} rows per token)")
    check_not_split([q.expert_ids.astype(np.int64) for q in seqs], E, "position",
                    str(files[0] if len(files) == 1 else files[0].parent), hint)
    L = len(layers_all or [])
    return Imported(seqs, L, E, K, phase_known=False, model_id=opts.model_id,
                    moe_layers=None if layers_all == list(range(L)) else layers_all, records=rows,
                    dropped_positions=dropped, dropped_sequences=dropped_seqs)


SPEC = FormatSpec(NAME, "llama.cpp moe-trace CSV (layer,expert or phase,token,layer,rank,expert)", read,
                  csv_headers=(UPSTREAM, INDEXED), folder_ext="csv",
                  requires={"num_experts": "its records do not name E"}, inputs=("top_k",))
