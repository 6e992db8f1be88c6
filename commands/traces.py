"""expertcast traces import | stats | card | synth: routing trace tools (library: ``expertcast.data.importers``,
``expertcast.data.trace_stats``).

    expertcast traces import FILE --out DIR [--format auto|jsonl|granite|vllm|sglang|llamacpp|megatron|
                             moe-cache-lab|moe-beyond|gating-jsonl|hf-router-logits] [--num-experts E]
                             [--num-layers L] [--top-k K] [--expert-bytes N] [--model ID]
    expertcast traces stats DIR [--json PATH] [--csv PATH] [--plot PNG] [--phase decode|prefill|both]
    expertcast traces card TRACES --out DIR [--fit-traces FIT] [--forecaster EXPORT] [--lifecycle cold|persistent]
                           [--count-prefill] [--capacity 0.10,0.25,0.45] [--pools per-layer,shared]
                           [--bandwidth-gbps G] [--layer-compute-ms MS] [--expert-bytes N] [--mlp-steps N]

    expertcast traces synth --out DIR --shape L,E,K [--sequences N] [--tokens T] [--prompt P] [--seed S]
                            [--process-seed S] [--stay F] [--concentration F] [--skew F] [--cross-layer F]
                            [--expert-bytes N]

``synth``: real-like routing (``data.synthetic.StickyRoutingProcess``: near-uniform in aggregate, locally sticky,
per-sequence favourites; docs/design.md, "Generalisation protocol") written as a trace set, so that a wide trace
(26 x 64, 48 x 128) is one reproducible command; the settings go into the trace set's run record.

``card``: the protocol card (library: ``expertcast.inference.sim.card``; docs/design.md, "Protocol card"): hit vs
capacity for lru, lfu, lrfu, fifo, static (fitted on FIT), belady-k, belady (+ seqmoe, hybrid with EXPORT), recall@K
by horizon, misses / exposed misses per token and the share of tokens without a miss, the LRU->Belady gap closed;
``DIR/card.json``, ``card.csv``, ``card.png``. Evaluated ids shared with FIT or the export's training ids are refused.
"""

from __future__ import annotations

import sys
import warnings

from expertcast.commands.common import (
    CommandParser,
    nonneg_float,
    nonneg_int,
    parse_fractions,
    positive_float,
    positive_int,
    run_command,
)
from expertcast.utils.errors import UsageError

PROG = "expertcast traces"


def build_parser() -> CommandParser:
    from expertcast.data.importers import registry

    p = CommandParser(prog=PROG, description="routing trace tools")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{import,stats,card,synth}")

    imp = sub.add_parser("import", help="routing traces recorded by another engine -> trace set",
                         description="Validate routing traces recorded elsewhere (vLLM, SGLang, llama.cpp, Megatron-LM, "
                                     "moe-cache-lab, MoE-Beyond, routing studies, transformers router logits) and "
                                     "write them as a trace set. Layouts: docs/design.md, 'Trace importers'.")
    imp.add_argument("file", help="import file (a folder of per-sequence files for llamacpp, moe-cache-lab, moe-beyond)")
    imp.add_argument("--out", required=True, help="output trace folder (new, empty, or a trace set with --overwrite)")
    imp.add_argument("--format", choices=["auto", *registry()], default="auto",
                     help="layout of FILE (auto: detected from its extension and first record or header); "
                          + "; ".join(f"{f.name}: {f.summary}" for f in registry().values()))
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

    cd = sub.add_parser("card", help="the protocol card: policies, oracles and predictors on one trace set",
                        description="Hit vs capacity (per-layer and shared pools) for lru, lfu, lrfu, fifo, static, "
                                    "belady-k, belady (+ seqmoe, hybrid), recall@K by horizon, per-token misses, "
                                    "exposed misses and tokens without a miss, and the LRU->Belady gap each policy "
                                    "closes. docs/design.md, 'Protocol card'.")
    cd.add_argument("traces", help="trace folder to evaluate (`expertcast collect` or `traces import`)")
    cd.add_argument("--out", required=True, help="output folder (card.json, card.csv, card.png)")
    cd.add_argument("--fit-traces", default=None,
                    help="trace folder static and the fitted baselines are fitted on (no sequence id shared with "
                         "TRACES); unset: static is skipped, the baselines use no fitted prior")
    cd.add_argument("--forecaster", default=None,
                    help="forecaster export: adds seqmoe and hybrid and the forecaster's recall (TRACES must hold "
                         "none of its training ids)")
    cd.add_argument("--lifecycle", choices=["cold", "persistent"], default="cold",
                    help="cold: cache reset for every sequence; persistent: one cache across the sequences")
    cd.add_argument("--count-prefill", action="store_true",
                    help="count the prompt positions too (default: decode only; prefill replayed uncounted)")
    cd.add_argument("--capacity", default="0.10,0.25,0.45", help="comma list of fractions of all L*E experts")
    cd.add_argument("--pools", default="per-layer,shared", help="comma list of pools: per-layer, shared")
    cd.add_argument("--bandwidth-gbps", type=positive_float, default=25.0, help="link model: host-device GB/s")
    cd.add_argument("--layer-compute-ms", type=nonneg_float, default=0.15,
                    help="link model: compute ms of one MoE layer-execution")
    cd.add_argument("--expert-bytes", type=positive_int, default=None,
                    help="link model: bytes per expert (unset: the traces', else the Qwen3-30B-A3B expert)")
    cd.add_argument("--mlp-steps", type=nonneg_int, default=0,
                    help="training steps of the MLP reference predictor, fitted on --fit-traces (0: none)")
    cd.add_argument("--overwrite", action="store_true", help="replace an earlier card in --out")
    sy = sub.add_parser("synth", help="real-like synthetic routing (sticky, per-sequence favourites) -> trace set",
                        description="Sample StickyRoutingProcess.realistic routing (entropy ~0.99, step overlap ~0.27 at "
                                    "top-6 of 64) and write it as a trace set. docs/design.md, 'Generalisation protocol'.")
    sy.add_argument("--out", required=True, help="output trace folder (new, empty, or a trace set with --overwrite)")
    sy.add_argument("--shape", required=True, help="L,E,K: layers, experts per layer, experts per token")
    sy.add_argument("--sequences", type=positive_int, default=650, help="sequences to sample")
    sy.add_argument("--tokens", type=positive_int, default=128, help="positions per sequence (prompt included)")
    sy.add_argument("--prompt", type=nonneg_int, default=16, help="prompt positions per sequence (prefill)")
    sy.add_argument("--process-seed", type=nonneg_int, default=0, help="seed of the process (global popularity)")
    sy.add_argument("--seed", type=nonneg_int, default=1, help="seed of the sampled sequences (ids stickyLxE-SEED-i)")
    sy.add_argument("--stay", type=nonneg_float, default=0.13, help="mean probability an expert stays at the next step")
    sy.add_argument("--concentration", type=positive_float, default=1.0,
                    help="Dirichlet concentration of each sequence's favourites (lower: sharper favourites)")
    sy.add_argument("--skew", type=nonneg_float, default=0.25, help="log-normal skew of the global popularity")
    sy.add_argument("--cross-layer", type=nonneg_float, default=0.0,
                    help="within-token cross-layer dependence in [0, 1]: each expert of a token's layer l-1 puts its "
                         "fixed successor into the token's layer l with this probability (0: none)")
    sy.add_argument("--expert-bytes", type=nonneg_int, default=1 << 20, help="bytes of one expert, for MB/token")
    sy.add_argument("--shard-size", type=positive_int, default=256, help="sequences per shard")
    sy.add_argument("--overwrite", action="store_true",
                    help="replace a trace set expertcast wrote in --out (foreign files are never deleted)")
    return p


def _synth(a) -> int:
    from dataclasses import replace

    from expertcast.data.synthetic import StickyRoutingProcess
    from expertcast.data.traces import write_traces

    try:
        L, E, K = (int(x) for x in a.shape.split(","))
    except ValueError:
        raise UsageError(f"--shape: expected L,E,K (three integers), got {a.shape!r}") from None
    if min(L, E, K) < 1 or K > E:
        raise UsageError(f"--shape {a.shape}: need L, E, K >= 1 and K <= E")
    if a.prompt >= a.tokens:
        raise UsageError(f"--prompt {a.prompt} leaves no decode position in --tokens {a.tokens}")
    if a.cross_layer > 1:
        raise UsageError(f"--cross-layer {a.cross_layer}: expected a probability in [0, 1]")
    proc = StickyRoutingProcess.realistic(L, E, K, skew=a.skew, stay=a.stay, concentration=a.concentration,
                                          seed=a.process_seed, cross_layer=a.cross_layer)
    seqs = proc.sample(a.sequences, a.tokens, prompt_len=a.prompt, seed=a.seed, prefix=f"sticky{L}x{E}")
    meta = replace(proc.meta(), expert_bytes=a.expert_bytes)
    settings = {k: getattr(a, k) for k in ("shape", "sequences", "tokens", "prompt", "process_seed", "seed", "stay",
                                           "concentration", "skew", "expert_bytes")}
    if a.cross_layer > 0:
        settings["cross_layer"] = a.cross_layer
    out = write_traces(a.out, meta, seqs, shard_size=a.shard_size,
                       run={"command": "traces synth", "process": "StickyRoutingProcess.realistic", **settings},
                       overwrite=a.overwrite)
    print(f"wrote {len(seqs)} sequences (L={L}, E={E}, K={K}, {a.tokens} positions, {a.prompt} prompt) -> {out}")
    return 0


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
    from expertcast.utils.outdir import claim_output_file

    a.json, a.csv, plot = (claim_output_file(p, flag, f"traces stats {flag}") if p else None
                           for flag, p in (("--json", a.json), ("--csv", a.csv), ("--plot", a.plot)))
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
    if plot:
        plot_frequencies(freqs, meta, plot.path)
        plot.written()
        print(f"plot: {a.plot}")
    return 0


def _read(path: str, flag: str):
    from expertcast.data.traces import load_traces, require_decode_tokens
    from expertcast.inference.cache.options import check_file

    check_file("traces", path, f"{flag} {path}")
    meta, seqs = load_traces(path)
    require_decode_tokens(meta, seqs, path)
    return meta, seqs


def _card(a) -> int:
    from pathlib import Path

    from expertcast.inference.cache.cost_model import CostConfig
    from expertcast.inference.sim.card import POOLS, CardSettings, make_card, print_card, write_card
    from expertcast.utils.outdir import claim_output_dir

    pools = tuple(p.strip() for p in a.pools.split(",") if p.strip())
    if not pools or any(p not in POOLS for p in pools):
        raise UsageError(f"--pools: expected a comma list of {', '.join(POOLS)}, got {a.pools!r}")
    meta, seqs = _read(a.traces, "TRACES")
    fit = None
    if a.fit_traces:
        fmeta, fit = _read(a.fit_traces, "--fit-traces")
        try:
            fmeta.check_compatible(meta.num_layers, meta.num_experts, meta.top_k, what=f"trace set {a.traces}")
        except ValueError as e:
            raise UsageError(f"--fit-traces {a.fit_traces}: {e}") from None
    if a.forecaster:
        from expertcast.models.forecaster_export import load_forecaster

        exp = load_forecaster(a.forecaster)
        try:
            exp.check_compatible(meta.num_layers, meta.num_experts, meta.top_k, what=f"trace set {a.traces}")
        except ValueError as e:
            raise UsageError(f"--forecaster {a.forecaster}: {e}") from None
    settings = CardSettings(capacities=tuple(parse_fractions(a.capacity)), pools=pools, lifecycle=a.lifecycle,
                            count_prefill=a.count_prefill, mlp_steps=a.mlp_steps,
                            cost=CostConfig(bandwidth_gbps=a.bandwidth_gbps, layer_compute_ms=a.layer_compute_ms,
                                            expert_bytes=a.expert_bytes))
    sources = {"traces": str(Path(a.traces).resolve()),
               "fit_traces": str(Path(a.fit_traces).resolve()) if a.fit_traces else None}
    try:
        card = make_card(meta, seqs, settings, fit=fit, forecaster=a.forecaster, sources=sources, progress=True)
    except ValueError as e:
        raise UsageError(str(e)) from None
    with claim_output_dir(a.out, "traces-card", overwrite=a.overwrite) as out:
        paths = write_card(card, out)
    print_card(card)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    body = {"import": _import, "stats": _stats, "card": _card, "synth": _synth}[args.cmd]
    return run_command(f"{PROG} {args.cmd}", lambda: body(args))
