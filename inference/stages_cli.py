"""`expertcast stages calibrate | stats | detect | eval`: SAEM stage cues.

- ``calibrate --traces DIR [--tokenizer M] [--cues FILE] --out cues.json``: score candidate cues on
  routing traces (frequency, segmentation noise, TCseq vs a uniform control), prune, save the cue set.
- ``stats --traces DIR [--cues cues.json]``: stages per trace, stage lengths, TCseq per layer and overall
  against token-uniform and shuffled segmentations of the same lengths.
- ``detect --gold labeled40.jsonl --tokenizer M [--cues cues.json]``: detector precision/recall against
  sentence labels, for the calibrated set vs the full candidate set (text only, no routing needed).
- ``eval --traces DIR [--cues cues.json]``: stage-aware vs LRU vs static-frequency (and the oracle and
  ablations) in the trace-driven simulator (see :mod:`expertcast.inference.saem_eval`).

Every command prints a table and writes JSON + CSV (and a PNG where useful) under ``--out-dir``.

Where the cue set lives: ``calibrate --out <model dir>/cues.json`` saves it with the model's artifacts;
``stats``, ``eval`` and the stage-aware policy (``tokenizer=<model dir>``) find it there when ``--cues``
is not given (:func:`expertcast.inference.cues.resolve_cue_set`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.utils.io import atomic_write_json, report


def _load_traces(path: str, max_sequences: int | None = None):
    from expertcast.data.traces import load_traces

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"trace directory {p} does not exist (create it with `expertcast collect`)")
    return load_traces(p, max_sequences=max_sequences)


def _tokenizer_for(args: argparse.Namespace, meta: Any = None) -> tuple[Any, str]:
    from expertcast.inference.cues import load_tokenizer

    name = args.tokenizer or (meta.model_id if meta is not None else None)
    if not name:
        raise ValueError("give --tokenizer (or --model): the tokenizer of the model that produced the traces")
    return load_tokenizer(name), name


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from expertcast.inference.cues import CalibrationConfig, calibrate, load_candidates, sequences_from_traces
    from expertcast.inference.stages import TokenDecoder

    meta, seqs = _load_traces(args.traces, args.max_sequences)
    tok, tok_name = _tokenizer_for(args, meta)
    cands = load_candidates(args.cues)
    cfg = CalibrationConfig(min_stage_tokens=args.min_stage_tokens, min_rate_per_1k=args.min_rate,
                            max_noise=args.max_noise, tcseq_tolerance=args.tcseq_tolerance, max_cues=args.max_cues,
                            ignore_case=args.ignore_case, control=args.control)
    cs = calibrate(sequences_from_traces(seqs), TokenDecoder(tok), meta.num_experts, cands, cfg,
                   model_id=meta.model_id, tokenizer_id=tok_name, progress=True)
    cs.calibration["traces"] = str(Path(args.traces).resolve())
    cs.save(args.out)
    rows = [{"cue": c, **{k: v for k, v in s.items() if k != "kept"}, "kept": s["kept"]} for c, s in cs.scores.items()]
    rows.sort(key=lambda r: (not r["kept"], -r["rate_per_1k"]))
    out = Path(args.out)
    report(rows, title=f"cue calibration on {len(seqs)} traces ({meta.model_id})",
           json_path=out.with_suffix(".scores.json"), csv_path=out.with_suffix(".scores.csv"))
    sel, full = cs.calibration["selected"], cs.calibration["all_candidates"]
    report([{"set": "calibrated", "cues": len(cs.cues), **sel}, {"set": "all candidates", "cues": len(cands), **full}],
           title="segmentation of the calibration traces",
           columns=["set", "cues", "stages", "stage_len_median", "stage_len_mean", "noise", "tcseq", "tcseq_uniform",
                    "tcseq_shuffled"])
    print(f"kept {len(cs.cues)} cues: {cs.cues}\nwrote {out}")
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from expertcast.inference.cues import (
        CueSet,
        resolve_cue_set,
        segmentation_stats,
        sequences_from_traces,
        stage_starts,
    )
    from expertcast.inference.stages import StageDetector, TokenDecoder

    meta, seqs = _load_traces(args.traces, args.max_sequences)
    cs = CueSet.load(resolve_cue_set(args.cues, args.tokenizer or meta.model_id))
    cs.check_compatible(meta.num_layers, meta.num_experts)
    if args.tokenizer is None and cs.tokenizer:
        args.tokenizer = cs.tokenizer
    tok, _ = _tokenizer_for(args, meta)
    dec = TokenDecoder(tok)
    cal = sequences_from_traces(seqs)
    det = StageDetector(cs.cues, dec, ignore_case=cs.ignore_case)
    starts = []
    for s in cal:
        det.reset(1)
        ev = []
        for t in s.token_ids.tolist():
            ev += det.feed_token(0, t)
        ev += det.flush(0)
        starts.append(stage_starts(ev, len(s.token_ids)))
    st = segmentation_stats([s.expert_ids for s in cal], starts, meta.num_experts, args.min_stage_tokens)
    out = Path(args.out_dir)
    summ = st.summary()
    summ = {"cues": "|".join(cs.cues), **summ}
    report([{"statistic": k, "value": v} for k, v in summ.items()],
           title=f"stages of {len(cal)} traces with {len(cs.cues)} cues", json_path=None,
           csv_path=out / "stage_stats.csv")
    atomic_write_json(out / "stage_stats.json", summ)
    layers = [{"layer": i, "tcseq": float(a), "tcseq_uniform": float(b), "tcseq_shuffled": float(c)}
              for i, (a, b, c) in enumerate(zip(st.tcseq_layer, st.tcseq_uniform_layer, st.tcseq_shuffled_layer,
                                                strict=True))]
    layers.append({"layer": "all", "tcseq": st.tcseq, "tcseq_uniform": st.tcseq_uniform,
                   "tcseq_shuffled": st.tcseq_shuffled})
    report(layers, title="TCseq per layer vs controls", json_path=out / "tcseq_layers.json",
           csv_path=out / "tcseq_layers.csv")
    _plot_stats(st, out / "stage_stats.png")
    print(f"wrote {out}")
    return 0


def _plot_stats(st: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    if len(st.lengths):
        ax[0].hist(st.lengths, bins=40)
    ax[0].set_xlabel("stage length (tokens)")
    ax[0].set_ylabel("stages")
    x = np.arange(len(st.tcseq_layer))
    ax[1].plot(x, st.tcseq_layer, "o-", label="cue stages")
    ax[1].plot(x, st.tcseq_uniform_layer, "s--", label="uniform control")
    ax[1].plot(x, st.tcseq_shuffled_layer, "^:", label="shuffled control")
    ax[1].set_xlabel("MoE layer")
    ax[1].set_ylabel("TCseq (adjacent-stage cosine)")
    ax[1].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cmd_detect(args: argparse.Namespace) -> int:
    from expertcast.inference.cues import CueSet, load_candidates
    from expertcast.inference.stages import TokenDecoder
    from expertcast.inference.stages_gold import load_gold, score_cues, score_positions, tokenize_traces

    cs = CueSet.load(args.cues) if args.cues else None
    if args.tokenizer is None and cs is not None and cs.tokenizer:
        args.tokenizer = cs.tokenizer
    tok, tok_name = _tokenizer_for(args)
    dec = TokenDecoder(tok)
    gold = load_gold(args.gold)
    tk = tokenize_traces(gold, lambda s: tok.encode(s, add_special_tokens=False), dec)
    tols = tuple(int(x) for x in args.tolerances.split(","))
    cands = cs.candidates if cs is not None and cs.candidates else load_candidates(args.candidates)
    sets: list[tuple[str, list[str], bool]] = []
    if cs is not None:
        sets.append((f"calibrated ({len(cs.cues)})", list(cs.cues), cs.ignore_case))
    sets.append((f"all candidates ({len(cands)})", list(cands), cs.ignore_case if cs else False))
    sets.append(("paper cues (3)", ["Alternatively", "Instead", "Another way"], False))
    rows = []
    for name, cues, ic in sets:
        rows += [s.row() for s in score_cues(name, cues, gold, tk, dec, tols, ignore_case=ic)]
    rows += [s.row() for s in score_positions("every chunk start (reference)", gold, tk,
                                              lambda g: g.chunk_starts[1:], tols)]
    out = Path(args.out_dir)
    unaligned = sum(g.unaligned for g in gold)
    report(rows, title=f"detector vs gold stage changes ({len(gold)} traces, {sum(len(g.gold_starts) for g in gold)} "
           f"changes, {unaligned} unaligned chunks; tokenizer {tok_name})",
           json_path=out / "detect_gold.json", csv_path=out / "detect_gold.csv")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from expertcast.inference.saem_eval import main as eval_main

    return eval_main(args)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="expertcast stages", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser, traces: bool = True, required: bool = True) -> None:
        if traces:
            p.add_argument("--traces", required=required, help="routing-trace directory (expertcast collect)")
            p.add_argument("--max-sequences", type=int, default=None)
        p.add_argument("--tokenizer", "--model", dest="tokenizer", default=None,
                       help="tokenizer / model directory (default: the trace's model, or the cue set's tokenizer)")
        p.add_argument("--min-stage-tokens", type=int, default=32, help="stages shorter than this are noise")

    p = sub.add_parser("calibrate", help="score and prune candidate cues, save the cue set")
    common(p)
    p.add_argument("--cues", default=None, help="extra candidate cues, one per line")
    p.add_argument("--out", required=True, help="cue-set JSON to write")
    p.add_argument("--min-rate", type=float, default=0.3, help="min occurrences per 1000 decode tokens")
    p.add_argument("--max-noise", type=float, default=0.35, help="max share of too-short stages")
    p.add_argument("--tcseq-tolerance", type=float, default=0.01, help="allowed TCseq deficit vs uniform control")
    p.add_argument("--max-cues", type=int, default=12)
    p.add_argument("--ignore-case", action="store_true")
    p.add_argument("--control", choices=("uniform", "shuffled"), default="uniform",
                   help="segmentation a cue's TCseq is compared with (shuffled: same stage lengths)")
    p.set_defaults(fn=_cmd_calibrate)

    p = sub.add_parser("stats", help="stage statistics and TCseq vs controls")
    common(p)
    p.add_argument("--cues", default=None, help="cue-set JSON (default: cues.json in the model directory)")
    p.add_argument("--out-dir", default="results/stages")
    p.set_defaults(fn=_cmd_stats)

    p = sub.add_parser("detect", help="detector precision/recall against labelled CoT traces")
    common(p, traces=False)
    p.add_argument("--gold", required=True, help="labelled traces (labeled40.jsonl)")
    p.add_argument("--cues", default=None, help="calibrated cue-set JSON (compared with all candidates)")
    p.add_argument("--candidates", default=None, help="extra candidate cues file")
    p.add_argument("--tolerances", default="0,4,16", help="match tolerances in tokens")
    p.add_argument("--out-dir", default="results/stages")
    p.set_defaults(fn=_cmd_detect)

    p = sub.add_parser("eval", help="stage-aware vs LRU vs static in the simulator")
    common(p, required=False)
    p.add_argument("--cues", default=None, help="cue-set JSON (default with --traces: cues.json in the model directory)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--capacities", default="0.03,0.125,0.25,0.5",
                   help="fractions of each layer's experts (budgets below top-K allowed)")
    p.add_argument("--policies", default="stage,stage-oracle,stage-nocpu,stage-noupdate,lru,static",
                   help="comma-separated subset of the evaluated policies")
    p.add_argument("--expert-bytes", type=int, default=None,
                   help="expert size for the cost model (default: one Qwen3-30B-A3B expert, 9437184 bytes)")
    p.add_argument("--cpu-serial", action="store_true",
                   help="CPU-executed experts start after the layer's transfers (default: in parallel with them)")
    p.add_argument("--synthetic", action="store_true", help="also run on synthetic traces with planted stages")
    p.add_argument("--out-dir", default="results/stages")
    p.set_defaults(fn=_cmd_eval)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (FileNotFoundError, ValueError) as e:
        print(f"expertcast stages {args.cmd}: {e}", file=sys.stderr)
        return 2

