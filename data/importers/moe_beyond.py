"""Per-prompt expert-activation CSV files as MoE-Beyond writes them (its ``generate_deepseek_logs*.py``: forward
hooks on every MoE layer's gate of DeepSeek-V2-Lite-Chat, one forward over the prompt, rows written layer by
layer).

One file per prompt (``prompt_<n>_data.csv``; the file name's stem is the sequence id; a folder of ``*.csv`` files
is one sequence per file), header exactly ``Layer ID,Batch Number,Token,Activated Expert IDs``, one row per
(MoE layer, batch row, position), written layer-major::

    Layer ID,Batch Number,Token,Activated Expert IDs
    1,0,<｜begin▁of▁sentence｜>,"[8, 26, 56, 57, 60, 11]"
    1,0,w,"[8, 15, 21, 26, 44, 56]"
    ...
    2,0,<｜begin▁of▁sentence｜>,"[3, 35, 38, 62, 63, 60]"

``Layer ID`` is the model's decoder-layer index (dense layers have no rows: DeepSeek-V2-Lite's start at 1), a
decimal integer; its distinct values map in order to the trace's MoE layers (``moe_layers``). ``Batch Number``
is the row of the forward's batch (0 for a single prompt; every other value is a sequence of its own,
``<stem>:<batch>``). ``Token`` is the token's TEXT (the tokenizer's ``convert_ids_to_tokens``; CSV-quoted when
it holds a comma), not an id: token ids are not recorded (-1), and a position's text must be the same on every
layer. The last column is the token's K expert ids in the router's order, a JSON list of integers. A token's
position is its row order within its (layer, batch). The files record no prompt/generation boundary (phase
unknown), no weights (1/K) and not E (``--num-experts``). A file cut short mid-write lacks the last layers'
rows for the last positions: those positions are dropped and counted.
"""

from __future__ import annotations

import json
from pathlib import Path

from expertcast.data.importers.common import (
    INT16_MAX,
    Imported,
    ImportFormatError,
    ImportOptions,
    RowCollector,
    csv_int,
    csv_rows,
    files_of,
)
from expertcast.data.importers.spec import FormatSpec

NAME = "moe-beyond"
HEADER = ("Layer ID", "Batch Number", "Token", "Activated Expert IDs")


def read(path: Path, opts: ImportOptions) -> Imported:
    E = int(opts.num_experts)
    col = RowCollector(E)
    for f in files_of(path, "csv"):
        rows = []
        for ln, (layer, batch, text, experts) in csv_rows(f, HEADER):
            where = f"{f}:{ln}"
            try:
                ids = json.loads(experts)
            except (json.JSONDecodeError, RecursionError):
                raise ImportFormatError(f"{where}: Activated Expert IDs must be a JSON list, got {experts!r}") from None
            rows.append((csv_int(layer, "Layer ID", where, 0, INT16_MAX), csv_int(batch, "Batch Number", where),
                         text, ids, where))
        if not rows:
            raise ImportFormatError(f"{f} holds no rows")
        batches = sorted({b for _, b, *_ in rows})
        texts: dict[tuple[int, int], tuple[str, str]] = {}
        count: dict[tuple[int, int], int] = {}
        for layer, b, text, ids, where in rows:
            p = count.get((layer, b), 0)
            count[(layer, b)] = p + 1
            first = texts.setdefault((b, p), (text, where))
            if first[0] != text:
                raise ImportFormatError(f"{where}: position {p} of layer {layer} is token {text!r}, but layer rows "
                                        f"before it give {first[0]!r} ({first[1]}): the layers' rows are not aligned")
            col.add(where, f.stem if len(batches) == 1 else f"{f.stem}:{b}", p, layer, ids)
    seqs, L, layers = col.build(str(path))
    return Imported(seqs, L, E, int(col.K or 0), phase_known=False, model_id=opts.model_id,
                    moe_layers=None if layers == list(range(L)) else layers, records=col.records, **col.dropped())


SPEC = FormatSpec(NAME, "MoE-Beyond per-prompt CSV (Layer ID,Batch Number,Token,Activated Expert IDs)", read,
                  csv_headers=(HEADER,), folder_ext="csv", requires={"num_experts": "its records do not name E"})
