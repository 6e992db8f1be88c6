"""expertcast traces import | stats: routing trace tools (library: ``expertcast.data.trace_import``,
``expertcast.data.trace_stats``).

    expertcast traces import FILE --out DIR [--format auto|jsonl|granite] [--num-experts E] [--expert-bytes N]
                             [--model ID]
    expertcast traces stats DIR [--json PATH] [--csv PATH] [--plot PNG] [--phase decode|prefill|both]
"""

from __future__ import annotations

import sys
import warnings

from expertcast.commands.common import CommandParser, nonneg_int, positive_int, run_command
from expertcast.utils.errors import UsageError

PROG = "expertcast traces"


def build_parser() -> CommandParser:
    from expertcast.data.trace_import import IMPORT_FORMATS

    p = CommandParser(prog=PROG, description="routing trace tools")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{import,stats}")

    imp = sub.add_parser("import", help="routing traces made elsewhere (JSONL rows, granite JSON) -> trace set",
                         description="Validate a file of routing traces made elsewhere and write it as a trace set.")
    imp.add_argument("file", help="import file (layouts: docs/design.md, 'Routing traces')")
    imp.add_argument("--out", required=True, help="output trace folder (new, empty, or a trace set with --overwrite)")
    imp.add_argument("--format", choices=["auto", *IMPORT_FORMATS], default="auto",
                     help="layout of FILE: jsonl (one row per sequence, token, layer), granite (per-prompt expert "
                          "ids [T][L][K], as ../shared/data/traces/granite-3.0-1b-a400m), auto (detected)")
    imp.add_argument("--num-experts", type=positive_int, default=None,
                     help="E: routed experts per layer (required for jsonl; granite: read from the file)")
    imp.add_argument("--num-layers", type=positive_int, default=None,
                     help="L (jsonl: None = largest layer index + 1; granite: read from the file)")
    imp.add_argument("--expert-bytes", type=nonneg_int, default=None,
                     help="bytes of one expert, for MB/token (default 0; granite-3.0-1b-a400m: its f16 expert size)")
    imp.add_argument("--model", default=None, help="model id the traces come from (None: the file's, else 'imported')")
    imp.add_argument("--shard-size", type=positive_int, default=256, help="sequences per shard")
    imp.add_argument("--overwrite", action="store_true",
                     help="replace a trace set expertcast wrote in --out (foreign files are never deleted)")

    st = sub.add_parser("stats", help="per-layer expert frequency, entropy, step-to-step overlap",
                        description="Per-layer expert frequency, entropy and step-to-step overlap of a trace set.")
    st.add_argument("dir", help="trace folder")
    st.add_argument("--phase", choices=["decode", "prefill", "both"], default="both", help="positions to summarise")
    st.add_argument("--json", default=None, help="write the rows as JSON here")
    st.add_argument("--csv", default=None, help="write the rows as CSV here")
    st.add_argument("--plot", default=None, help="write a PNG heatmap of expert frequencies here")
    return p


def _import(a) -> int:
    from expertcast.data.trace_import import detect_format, import_jsonl

    fmt = detect_format(a.file) if a.format == "auto" else a.format
    if fmt == "granite":
        return _import_granite(a)
    if a.num_experts is None:
        raise UsageError("--num-experts is required for the jsonl layout (its rows do not name E)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta, counts = import_jsonl(a.file, a.out, a.num_experts, a.expert_bytes or 0, a.model, a.num_layers,
                                    a.shard_size, overwrite=a.overwrite)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    print(f"imported {counts['sequences']} sequences ({counts['rows']} rows, L={meta.num_layers}, "
          f"E={meta.num_experts}, K={meta.top_k}, {counts['decode_tokens']} decode tokens, dropped "
          f"{counts['dropped_tokens']} incomplete tokens) -> {a.out}")
    return 0


def _import_granite(a) -> int:
    """``--format granite``: the per-prompt expert-trace JSON (one sequence per prompt; weights 1/K)."""
    import dataclasses

    from expertcast.data.trace_import import (
        default_expert_bytes,
        read_expert_trace_json,
        write_expert_trace_set,
    )

    meta, seqs = read_expert_trace_json(a.file, a.model)  # read once, validated before --out is touched
    for flag, given, have in (("--num-experts", a.num_experts, meta.num_experts),
                              ("--num-layers", a.num_layers, meta.num_layers)):
        if given is not None and given != have:
            raise UsageError(f"{flag} {given}, but {a.file} records {have} (granite layout)")
    expert_bytes = a.expert_bytes
    if expert_bytes is None:
        expert_bytes = default_expert_bytes(meta.model_id)
        if expert_bytes:
            print(f"expert bytes: {expert_bytes} (one f16 expert of {meta.model_id}; --expert-bytes overrides)",
                  file=sys.stderr)
    meta = dataclasses.replace(meta, expert_bytes=int(expert_bytes or 0))
    write_expert_trace_set(a.file, a.out, meta, seqs, overwrite=a.overwrite, shard_size=a.shard_size)
    n = len(seqs)
    tokens = sum(s.num_tokens for s in seqs)
    decode = sum(s.num_tokens - s.prompt_len for s in seqs)
    print(f"imported {n} sequences (granite layout, L={meta.num_layers}, E={meta.num_experts}, K={meta.top_k}, "
          f"{tokens} tokens, {decode} decode tokens, router weights not recorded: 1/K) -> {a.out}")
    return 0


def _stats(a) -> int:
    from expertcast.data.trace_stats import plot_frequencies, trace_stats
    from expertcast.data.traces import iter_traces, read_manifest, read_meta
    from expertcast.utils.io import report

    meta = read_meta(a.dir)
    n_seq = 0

    def counted():
        nonlocal n_seq
        for s in iter_traces(a.dir, meta):
            n_seq += 1
            yield s

    rows, freqs = trace_stats(meta, counted())
    if a.phase != "both":
        rows = [r for r in rows if r["phase"] == a.phase]
        freqs = {k: v for k, v in freqs.items() if k == a.phase}
        if not rows:
            raise UsageError(f"no {a.phase} positions in {a.dir}")
    complete = read_manifest(a.dir).get("complete", False)
    title = (f"{a.dir}: {meta.model_id}  L={meta.num_layers} E={meta.num_experts} K={meta.top_k}  "
             f"{n_seq} sequences{'' if complete else ' (INCOMPLETE run)'}")
    report(rows, title=title, json_path=a.json, csv_path=a.csv,
           columns=["phase", "layer", "tokens", "experts_used", "top1_share", "min_share", "entropy", "overlap"])
    if a.plot:
        plot_frequencies(freqs, meta, a.plot)
        print(f"plot: {a.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(f"{PROG} {args.cmd}", lambda: _import(args) if args.cmd == "import" else _stats(args))
