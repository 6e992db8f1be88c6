"""Per-prompt expert-activation CSV files as MoE-Beyond publishes them.

One file per prompt (the prompt id is the file name's stem, which becomes the sequence id; a folder of ``*.csv``
files is one sequence per file), header exactly ``Layer ID,Batch Number,Token,Activated Expert IDs``, one row per
(token, layer)::

    Layer ID,Batch Number,Token,Activated Expert IDs
    0,0,0,"[12, 3]"

``Layer ID``, ``Batch Number`` and ``Token`` are decimal integers; the last column is a JSON list of the token's
K expert ids (integers). Positions are ordered by (batch number, token): each distinct pair is one position, and
every position needs every layer. The files record no prompt/generation boundary (phase unknown), no weights
(1/K) and not E (``--num-experts``). ``Layer ID`` values map in order to the trace's MoE layers.
"""

from __future__ import annotations

import json
from pathlib import Path

from expertcast.data.importers.common import (
    Imported,
    ImportOptions,
    RowCollector,
    csv_int,
    csv_rows,
    files_of,
    num_experts_of,
)
from expertcast.data.trace_import import INT16_MAX, ImportFormatError

NAME = "moe-beyond"
HEADER = ("Layer ID", "Batch Number", "Token", "Activated Expert IDs")


def read(path: Path, opts: ImportOptions) -> Imported:
    E = num_experts_of(opts, NAME)
    col = RowCollector(E)
    for f in files_of(path, "csv"):
        rows = []
        for ln, (layer, batch, tok, experts) in csv_rows(f, HEADER):
            where = f"{f}:{ln}"
            try:
                ids = json.loads(experts)
            except (json.JSONDecodeError, RecursionError):
                raise ImportFormatError(f"{where}: Activated Expert IDs must be a JSON list, got {experts!r}") from None
            rows.append((csv_int(batch, "Batch Number", where), csv_int(tok, "Token", where),
                         csv_int(layer, "Layer ID", where, 0, INT16_MAX), ids, where))
        if not rows:
            raise ImportFormatError(f"{f} holds no rows")
        pos = {k: i for i, k in enumerate(sorted({(b, t) for b, t, *_ in rows}))}
        for b, t, layer, ids, where in rows:
            col.add(where, f.stem, pos[(b, t)], layer, ids)
    seqs, L, layers = col.build(str(path))
    return Imported(seqs, L, E, int(col.K or 0), phase_known=False, model_id=opts.model_id,
                    moe_layers=None if layers == list(range(L)) else layers, records=col.records)
