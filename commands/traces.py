"""expertcast traces import | stats: routing trace tools (library: ``expertcast.data.importers``,
``expertcast.data.trace_stats``).

    expertcast traces import FILE --out DIR [--format auto|jsonl|granite|vllm|sglang|llamacpp|megatron|
                             moe-cache-lab|moe-beyond|gating-jsonl|hf-router-logits] [--num-experts E]
                             [--num-layers L] [--top-k K] [--expert-bytes N] [--model ID]
    expertcast traces stats DIR [--json PATH] [--csv PATH] [--plot PNG] [--phase decode|prefill|both]
"""

from __future__ import annotations

import sys
import warnings

from expertcast.commands.common import CommandParser, nonneg_int, positive_int, run_command
from expertcast.utils.errors import UsageError

PROG = "expertcast traces"


def build_parser() -> CommandParser:
    from expertcast.data.importers import FORMATS

    p = CommandParser(prog=PROG, description="routing trace tools")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{import,stats}")

    imp = sub.add_parser("import", help="routing traces recorded by another engine -> trace set",
                         description="Validate routing traces recorded elsewhere (vLLM, SGLang, llama.cpp, Megatron-LM, "
                                     "moe-cache-lab, MoE-Beyond, routing studies, transformers router logits) and "
                                     "write them as a trace set. Layouts: docs/design.md, 'Trace importers'.")
    imp.add_argument("file", help="import file (a folder of per-sequence files for llamacpp, moe-cache-lab, moe-beyond)")
    imp.add_argument("--out", required=True, help="output trace folder (new, empty, or a trace set with --overwrite)")
    imp.add_argument("--format", choices=["auto", *FORMATS], default="auto",
                     help="layout of FILE (auto: detected from its extension and first record or header); "
                          + "; ".join(f"{f.name}: {f.summary}" for f in FORMATS.values()))
    imp.add_argument("--num-experts", type=positive_int, default=None,
                     help="E: routed experts per layer (required where the file does not record it)")
    imp.add_argument("--num-layers", type=positive_int, default=None,
                     help="L: MoE layers (sglang: required; jsonl: None = largest layer index + 1; else checked)")
    imp.add_argument("--top-k", type=positive_int, default=None,
                     help="K: experts per token (sglang and llamacpp layer,expert: required; else checked)")
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
    from expertcast.data.importers import ImportOptions, import_traces

    opts = ImportOptions(a.num_experts, a.num_layers, a.top_k, a.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta, imp = import_traces(a.file, a.out, a.format, opts, expert_bytes=a.expert_bytes,
                                  shard_size=a.shard_size, overwrite=a.overwrite)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if a.expert_bytes is None and meta.expert_bytes:
        print(f"expert bytes: {meta.expert_bytes} (one f16 expert of {meta.model_id}; --expert-bytes overrides)",
              file=sys.stderr)
    print(import_summary(meta, imp, a.out))
    return 0


def import_summary(meta, imp, out) -> str:
    """The line ``traces import`` prints: sequences, layout, L/E/K, tokens, decode tokens, phase, notes."""
    seqs = imp.sequences
    tokens = sum(s.num_tokens for s in seqs)
    decode = sum(s.num_tokens - s.prompt_len for s in seqs)
    extra = [] if meta.phase_known else ["phase unknown: every position counted as decode"]
    if meta.has_sources:
        extra.append(f"sources {sorted({s.source for s in seqs})}")
    if meta.moe_layers is not None:
        extra.append(f"MoE layers {meta.moe_layers}")
    return (f"imported {len(seqs)} sequences ({meta.source_format} layout, L={meta.num_layers}, E={meta.num_experts}, "
            f"K={meta.top_k}, {tokens} tokens, {decode} decode tokens"
            + "".join(f", {x}" for x in [*imp.notes, *extra]) + f") -> {out}")


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
