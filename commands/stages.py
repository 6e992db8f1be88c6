"""`expertcast stages calibrate | stats | detect | eval`: SAEM stage cues.

- ``calibrate --traces DIR [--model M] [--candidates FILE] --out cues.json``: score candidate cues on
  routing traces (frequency, segmentation noise, TCseq vs a uniform control), prune, save the cue set
  (one JSON file, written atomically).
- ``stats --traces DIR [--cues cues.json] --out DIR``: stages per trace, stage lengths, TCseq per layer
  and overall against token-uniform and shuffled segmentations of the same lengths.
- ``detect --gold labeled40.jsonl [--model M] [--cues cues.json] --out DIR``: detector precision/recall
  against sentence labels, for the calibrated set vs the full candidate set (text only).
- ``eval [--traces DIR] [--cues cues.json] [--synthetic] --out DIR``: stage-aware vs LRU vs
  static-frequency (and the oracle and ablations) in the trace-driven simulator (the grid:
  :mod:`expertcast.recipes.saem_eval`); resumes from its partial records on an exact settings match.

``--model`` names the model whose tokenizer decodes the traces (``tiny-default``, a preset, a model
folder or a Hub id; default: the cue set's tokenizer, else the traces' model). Where the cue set lives:
``calibrate --out <model dir>/cues.json`` saves it with the model's artifacts; ``stats``, ``eval`` and
the stage-aware policy find it there when ``--cues`` is not given.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from expertcast.commands.common import (
    CommandParser,
    add_capacity_args,
    capacities_from_args,
    nonneg_float,
    positive_int,
    resolve_model,
    run_command,
)
from expertcast.recipes.lineage import log_results
from expertcast.utils.errors import UsageError
from expertcast.utils.fitted_on import guard_note
from expertcast.utils.tracking import add_wandb_args

PROG = "expertcast stages"
EVAL_CAPACITIES = "0.03,0.125,0.25,0.5"
"""Capacities of ``stages eval`` when neither --capacity nor --slots is given (budgets below top-K allowed)."""


# -- argument types -----------------------------------------------------------------------------------
def unit_fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    v = nonneg_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text}")
    return v


def below_one(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    v = nonneg_float(text)
    if v >= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text}")
    return v


def _int_list(text: str, flag: str, minimum: int) -> list[int]:
    out = []
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        try:
            v = int(part)
        except ValueError:
            raise UsageError(f"{flag}: {part!r} is not an integer") from None
        if v < minimum:
            raise UsageError(f"{flag}: {v} is below {minimum}")
        out.append(v)
    if not out:
        raise UsageError(f"{flag}: no value given")
    return out


# -- shared loading -----------------------------------------------------------------------------------
def _load_traces(path: str, max_sequences: int | None):
    from expertcast.data.traces import load_traces

    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"--traces {p}: no such trace folder (create one with `expertcast collect`)")
    return load_traces(p, max_sequences=max_sequences)


def _tokenizer(model: str | None, fallback: str | None, what: str) -> tuple[Any, str]:
    """(tokenizer, its model name): ``--model`` when given, else ``fallback`` (``what`` says where that
    came from); both resolved through the one model resolver."""
    from expertcast.models.tokenizer import load_tokenizer

    name = model or fallback
    if not name:
        raise UsageError("give --model: the model whose tokenizer decodes the traces")
    try:
        resolved = resolve_model(name)
    except UsageError as e:
        if model:
            raise
        raise UsageError(f"{what} {name!r} cannot be used here ({e}); give --model") from None
    return load_tokenizer(resolved), name


def _cue_set(cues: str | None, model: str | None):
    """(cue set, its path): ``--cues`` when given, else ``cues.json`` in the folder of ``model``."""
    from expertcast.inference.saem.cues import CueSet, resolve_cue_set

    if cues is None and model and not Path(model).expanduser().is_dir():
        try:
            model = resolve_model(model, announce=False)
        except UsageError:
            raise UsageError(f"no --cues given and the model {model!r} is no local folder to find cues.json in; "
                             f"pass --cues") from None
    path = resolve_cue_set(cues, model)
    return CueSet.load(path), path


# -- calibrate ----------------------------------------------------------------------------------------
def check_cue_set_target(path: Path, overwrite: bool):
    """Claim the cue-set output ``path`` (:func:`~expertcast.utils.outdir.claim_output_file`): a new file, an
    existing cue set (replaced), anything else only with ``overwrite``; never a folder."""
    from expertcast.inference.saem.cues import CueSet
    from expertcast.utils.outdir import claim_output_file

    def is_cue_set(p: Path) -> bool:
        try:
            CueSet.load(p)
        except (UsageError, OSError):
            return False
        return True

    return claim_output_file(path, "--out", "stages calibrate", overwrite=overwrite, recognise=is_cue_set,
                             what="a cue set", hint="choose another --out or pass --overwrite")


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from expertcast.data.trace_split import split_by_hash
    from expertcast.inference.saem.cues import (
        CalibrationConfig,
        calibrate,
        load_candidates,
        sequences_from_traces,
    )
    from expertcast.inference.saem.stages import TokenDecoder
    from expertcast.utils.fitted_on import trace_set_model
    from expertcast.utils.io import print_table

    out = Path(args.out)
    check_cue_set_target(out, args.overwrite)
    meta, seqs = _load_traces(args.traces, args.max_sequences)
    if args.heldout > 0:  # the forecaster's hash split: held-out sequences never seed the cue set's statistics
        seqs, held = split_by_hash(seqs, args.heldout, seed=args.split_seed)
        print(f"calibrating on {len(seqs)} sequences; {len(held)} held out for `stages eval` (--heldout "
              f"{args.heldout}, seed {args.split_seed})")
        if not seqs:
            raise UsageError(f"--heldout {args.heldout} leaves no sequence of {args.traces} to calibrate on")
    tok, tok_name = _tokenizer(args.model, meta.model_id, "the traces' model")
    cands = load_candidates(args.candidates)
    cfg = CalibrationConfig(min_stage_tokens=args.min_stage_tokens, min_rate_per_1k=args.min_rate,
                            max_noise=args.max_noise, tcseq_tolerance=args.tcseq_tolerance, max_cues=args.max_cues,
                            ignore_case=args.ignore_case, control=args.control)
    cs = calibrate(sequences_from_traces(seqs), TokenDecoder(tok), meta.num_experts, cands, cfg,
                   model_id=meta.model_id, tokenizer_id=tok_name, progress=True,
                   model=trace_set_model(args.traces, meta.model_id))
    cs.calibration["traces"] = str(Path(args.traces).resolve())
    cs.calibration["split"] = {"method": "sha256(seed, sequence id)", "seed": args.split_seed,
                               "heldout_fraction": args.heldout}
    rows = [{"cue": c, **{k: v for k, v in s.items() if k != "kept"}, "kept": s["kept"]} for c, s in cs.scores.items()]
    rows.sort(key=lambda r: (not r["kept"], -r["rate_per_1k"]))
    print_table(rows, title=f"cue calibration on {len(seqs)} traces ({meta.model_id})")
    sel, full = cs.calibration["selected"], cs.calibration["all_candidates"]
    print_table([{"set": "calibrated", "cues": len(cs.cues), **sel}, {"set": "all candidates", "cues": len(cands), **full}],
                title="segmentation of the calibration traces",
                columns=["set", "cues", "stages", "stage_len_median", "stage_len_mean", "noise", "tcseq",
                         "tcseq_uniform", "tcseq_shuffled"])
    target = check_cue_set_target(out, args.overwrite)  # again: the file may have appeared while calibrating
    replacing = out.exists()
    cs.save(out)  # atomic
    target.written()
    print(("replaced the cue set" if replacing else "wrote") + f" {out} (per-candidate scores inside)")
    print(f"kept {len(cs.cues)} cues: {cs.cues}")
    return 0


# -- stats --------------------------------------------------------------------------------------------
def _cmd_stats(args: argparse.Namespace) -> int:
    from expertcast.inference.saem.cues import segmentation_stats, sequences_from_traces, stage_starts
    from expertcast.inference.saem.stages import StageDetector, TokenDecoder
    from expertcast.utils.fitted_on import trace_set_model
    from expertcast.utils.io import atomic_write_json, report
    from expertcast.utils.outdir import claim_output_dir

    meta, seqs = _load_traces(args.traces, args.max_sequences)
    cs, cue_path = _cue_set(args.cues, args.model or meta.model_id)
    cs.check_model(meta.model_id, f"cue set {cue_path}", f"the traces {args.traces}",
                   model=trace_set_model(args.traces, meta.model_id))
    cs.check_compatible(meta.num_layers, meta.num_experts)
    tok, _ = _tokenizer(args.model, cs.tokenizer or meta.model_id, "the cue set's tokenizer")
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
    summ = {"cues": "|".join(cs.cues), **st.summary()}
    layers = [{"layer": i, "tcseq": float(a), "tcseq_uniform": float(b), "tcseq_shuffled": float(c)}
              for i, (a, b, c) in enumerate(zip(st.tcseq_layer, st.tcseq_uniform_layer, st.tcseq_shuffled_layer,
                                                strict=True))]
    layers.append({"layer": "all", "tcseq": st.tcseq, "tcseq_uniform": st.tcseq_uniform,
                   "tcseq_shuffled": st.tcseq_shuffled})
    with claim_output_dir(args.out, "stages-stats", overwrite=args.overwrite) as out:
        report([{"statistic": k, "value": v} for k, v in summ.items()],
               title=f"stages of {len(cal)} traces with {len(cs.cues)} cues", csv_path=out.file("stage_stats.csv"))
        atomic_write_json(out.file("stage_stats.json"), summ)
        report(layers, title="TCseq per layer vs controls", json_path=out.file("tcseq_layers.json"),
               csv_path=out.file("tcseq_layers.csv"))
        _plot_stats(st, out.file("stage_stats.png"))
        print(f"wrote {out.path}")
    return 0


def _plot_stats(st: Any, path: Path) -> None:
    import os

    import matplotlib
    import numpy as np

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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# -- detect -------------------------------------------------------------------------------------------
def _cmd_detect(args: argparse.Namespace) -> int:
    from expertcast.inference.saem.cues import CueSet, load_candidates
    from expertcast.inference.saem.gold import load_gold, score_cues, score_positions, tokenize_traces
    from expertcast.inference.saem.stages import TokenDecoder
    from expertcast.utils.io import report
    from expertcast.utils.outdir import claim_output_dir

    if not Path(args.gold).is_file():
        raise UsageError(f"--gold {args.gold}: no such file (labelled traces, e.g. cot/labeled40.jsonl)")
    tols = _int_list(args.tolerances, "--tolerances", 0)
    cs = CueSet.load(args.cues) if args.cues else None
    tok, tok_name = _tokenizer(args.model, cs.tokenizer if cs is not None else None, "the cue set's tokenizer")
    dec = TokenDecoder(tok)
    gold = load_gold(args.gold)
    tk = tokenize_traces(gold, lambda s: tok.encode(s, add_special_tokens=False), dec)
    cands = cs.candidates if cs is not None and cs.candidates else load_candidates(args.candidates)
    sets: list[tuple[str, list[str], bool]] = []
    if cs is not None:
        sets.append((f"calibrated ({len(cs.cues)})", list(cs.cues), cs.ignore_case))
    sets.append((f"all candidates ({len(cands)})", list(cands), cs.ignore_case if cs else False))
    sets.append(("paper cues (3)", ["Alternatively", "Instead", "Another way"], False))
    rows = []
    for name, cues, ic in sets:
        rows += [s.row() for s in score_cues(name, cues, gold, tk, dec, tuple(tols), ignore_case=ic)]
    rows += [s.row() for s in score_positions("every chunk start (reference)", gold, tk,
                                              lambda g: g.chunk_starts[1:], tuple(tols))]
    unaligned = sum(g.unaligned for g in gold)
    with claim_output_dir(args.out, "stages-detect", overwrite=args.overwrite) as out:
        report(rows, title=f"detector vs gold stage changes ({len(gold)} traces, "
               f"{sum(len(g.gold_starts) for g in gold)} changes, {unaligned} unaligned chunks; tokenizer {tok_name})",
               json_path=out.file("detect_gold.json"), csv_path=out.file("detect_gold.csv"))
    return 0


# -- eval ---------------------------------------------------------------------------------------------
def _cmd_eval(args: argparse.Namespace) -> int:
    from expertcast.inference.cache.cost_model import QWEN3_30B_A3B_EXPERT_BYTES, CostConfig
    from expertcast.inference.saem.stages import TokenDecoder
    from expertcast.recipes.saem_eval import POLICIES
    from expertcast.utils.outdir import claim_output_dir

    batch_sizes = _int_list(args.batch_sizes, "--batch-sizes", 1)
    if args.capacity is None and args.slots is None:
        args.capacity = EVAL_CAPACITIES
    caps = capacities_from_args(args, multiple=True)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise UsageError(f"--policies: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(POLICIES)}")
    eb = args.expert_bytes or QWEN3_30B_A3B_EXPERT_BYTES
    cost = CostConfig(expert_bytes=int(eb), cpu_parallel=not args.cpu_serial)
    traces = cs = dec = None
    inputs: list[tuple[str, str, str | None]] = []
    guard = None
    if args.traces:
        meta, seqs = _load_traces(args.traces, args.max_sequences)
        cs, cue_path = _cue_set(args.cues, args.model or meta.model_id)
        seqs, guard = _held_out(args, cs, cue_path, meta, seqs)
        cs.check_compatible(meta.num_layers, meta.num_experts)
        tok, _ = _tokenizer(args.model, cs.tokenizer or meta.model_id, "the cue set's tokenizer")
        traces, dec = (meta, seqs), TokenDecoder(tok)
        inputs = [(args.traces, "traces", None), (str(cue_path), "cue_set", None)]  # W&B lineage (--wandb)
    elif not args.synthetic:
        raise UsageError("nothing to evaluate: give --traces (with a cue set) and/or --synthetic")
    tag = "cot" if args.max_sequences is None else f"cot{args.max_sequences}"
    with claim_output_dir(args.out, "stages-eval", overwrite=args.overwrite) as out:
        rows = evaluate_saem(batch_sizes=batch_sizes, capacities=[c.value for c in caps if c.kind == "fraction"],
                             slots=[c.value for c in caps if c.kind == "slots"], policies=policies, cost=cost,
                             traces=traces, tag=tag, cue_set=cs, decoder=dec, synthetic=args.synthetic,
                             partial=lambda t: out.file(f"partial-{t}.json"))
        note = None if guard is None else guard_note({"the cue set": guard})
        if note:
            print(f"stages eval: {note}")
        write_results(rows, out.file("saem_eval.json"), out.file("saem_eval.csv"), out.file("saem_eval.png"), eb,
                      note=note)
        if guard is not None:
            from expertcast.utils.io import atomic_write_json

            atomic_write_json(out.file("guard.json"), {"cue_set": guard})
        print(f"wrote {out.path}")
        if args.wandb:
            log_results(args.wandb_project, "stages-eval", f"stages-eval-{tag}", {k: v for k, v in vars(args).items()
                        if k != "fn"}, tables={"saem_eval": rows}, images={"saem_eval": out.path / "saem_eval.png"},
                        inputs=inputs)
    return 0


def _held_out(args: argparse.Namespace, cs: Any, cue_path: Path, meta: Any, seqs: list[Any]):
    """(sequences to evaluate, the guard's result): ``--split held-out`` keeps the sequences the cue set was not
    calibrated on; then :func:`~expertcast.utils.fitted_on.check_fitted_on` refuses an overlap (``--split all``, or
    a cue set recording no ids) unless ``--allow-overlap``, and another model's routing unless
    ``--allow-model-mismatch``."""
    from expertcast.utils.fitted_on import check_fitted_on, trace_set_model

    fitted = cs.fitted_on(f"the cue set {cue_path}")
    if args.split == "held-out" and fitted.ids is not None:
        kept = [s for s in seqs if s.seq_id not in fitted.ids]
        if not kept:
            raise UsageError(f"every sequence of {args.traces} was used to calibrate {cue_path} ({len(fitted.ids)} "
                             f"ids): calibrate with --heldout FRACTION, evaluate other traces, or pass --split all "
                             f"--allow-overlap")
        if len(kept) < len(seqs):
            print(f"stages eval: {len(kept)} held-out sequences of {args.traces} ({len(seqs) - len(kept)} calibrated "
                  f"the cue set)")
        seqs = kept
    guard = check_fitted_on(fitted, [s.seq_id for s in seqs], trace_set_model(args.traces, meta.model_id),
                            scored=f"the traces {args.traces}", allow_overlap=args.allow_overlap,
                            allow_model_mismatch=args.allow_model_mismatch,
                            mismatch_hint="calibrate a cue set on this model's traces (expertcast stages calibrate) "
                                          "or pass --allow-model-mismatch (reported in the output)")
    return seqs, guard


def evaluate_saem(*, batch_sizes: Sequence[int], capacities: Sequence[float] = (), slots: Sequence[int] = (),
                  policies: Sequence[str], cost: Any = None,
                  traces: tuple[Any, list[Any]] | None = None, tag: str = "cot", cue_set: Any = None,
                  decoder: Any = None, synthetic: bool = False,
                  partial: Callable[[str], Path] | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """SAEM evaluation rows (:mod:`expertcast.recipes.saem_eval`) on ``traces`` (with their
    ``cue_set`` and token ``decoder``) and/or the synthetic trace sets.

    Args:
        batch_sizes: sequences decoded in lockstep, one grid per value.
        capacities / slots: fractions of the experts / slot counts per layer.
        cost: the :class:`~expertcast.inference.cache.cost_model.CostConfig` of the simulator and the policies.
        tag: name of ``traces`` in the table.
        partial: the resume file of a trace set's tag (None: no resume).
    """
    from expertcast.inference.saem.cues import cue_set_calibration
    from expertcast.inference.saem.stages import synthetic_cue_decoder
    from expertcast.recipes.saem_eval import run_grid, synthetic_runs

    rows: list[dict[str, Any]] = []
    if traces is not None:
        freq, counts = cue_set_calibration(cue_set)
        rows += run_grid(tag, traces, list(cue_set.cues), decoder, freq, counts, list(batch_sizes), capacities,
                         cue_set.ignore_case, cost, list(policies), partial(tag) if partial else None, progress, slots)
    if synthetic:
        for name, syn, freq, cnt in synthetic_runs():
            rows += run_grid(name, (syn.meta, syn.sequences[4:]), ["Wait"], synthetic_cue_decoder(syn.cue_token),
                             freq, cnt, list(batch_sizes), capacities, False, cost, list(policies),
                             partial(name) if partial else None, progress, slots)
    if not rows:
        raise UsageError("nothing to evaluate: give --traces (with a cue set) and/or --synthetic")
    return rows


def write_results(rows: list[dict[str, Any]], json_path: Path, csv_path: Path, png_path: Path, expert_bytes: int,
                  note: str | None = None) -> None:
    """The table in the terminal, JSON, CSV and the plot of :func:`evaluate_saem`'s rows (``note``: the guard's
    allowed overlap or model mismatch, in the title)."""
    from expertcast.utils.io import report

    report(rows, title=f"SAEM: stage-aware vs LRU vs static (per-layer pools, decode-only; costs of a "
           f"{int(expert_bytes) / 1e6:.2f} MB expert)" + (f" [{note}]" if note else ""), json_path=json_path,
           csv_path=csv_path,
           columns=["traces", "batch", "capacity", "slots_per_layer", "policy", "hit", "cpu_share",
                    "transfers_per_token", "proactive_per_token", "speed_pct", "speedup_vs_lru", "oracle_eff_hit",
                    "oracle_eff_speed", "updates"])
    _plot_eval(rows, png_path)


def _plot_eval(rows: list[dict[str, Any]], path: Path) -> None:
    """Resident hit, modelled speed and transfers per token against capacity, per trace set and batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["traces"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(3, len(keys), figsize=(5 * len(keys), 10), squeeze=False)
    for j, (tr, bs) in enumerate(keys):
        sub = [r for r in rows if r["traces"] == tr and r["batch"] == bs]
        for pol in dict.fromkeys(r["policy"] for r in sub):
            pts = sorted((r["capacity"], r["hit"], r["speed_pct"], r["transfers_per_token"]) for r in sub
                         if r["policy"] == pol)
            x = [p[0] for p in pts]
            for i in range(3):
                axes[i, j].plot(x, [p[i + 1] for p in pts], "o-", label=pol)
        axes[0, j].set_title(f"{tr}, batch {bs}")
        axes[0, j].set_ylabel("resident hit")
        axes[1, j].set_ylabel("modelled % of full-load speed")
        axes[2, j].set_ylabel("transfers per decoded token")
        axes[2, j].set_xlabel("capacity (fraction of the experts)")
        caps = sorted({r["capacity"] for r in sub})
        for a in axes[:, j]:
            a.set_xscale("log")
            a.minorticks_off()
            a.set_xticks(caps)
            a.set_xticklabels([f"{c:g}" for c in caps])
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- parser -------------------------------------------------------------------------------------------
def build_parser() -> CommandParser:
    ap = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{calibrate,stats,detect,eval}",
                            parser_class=CommandParser)

    def model_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=None,
                       help="model whose tokenizer decodes the text: tiny-default, a preset, a model folder or a Hub "
                            "id; when omitted: the cue set's tokenizer, else the traces' model")

    def trace_args(p: argparse.ArgumentParser, required: bool) -> None:
        p.add_argument("--traces", required=required, help="routing-trace folder (expertcast collect)")
        p.add_argument("--max-sequences", type=positive_int, default=None, help="read only the first N sequences")
        p.add_argument("--min-stage-tokens", type=positive_int, default=32,
                       help="stages shorter than this many tokens count as segmentation noise")

    def out_args(p: argparse.ArgumentParser, cmd: str) -> None:
        p.add_argument("--out", default=f"runs/stages-{cmd}", help="output folder")
        p.add_argument("--overwrite", action="store_true", help="remove this command's earlier output in --out first")

    p = sub.add_parser("calibrate", help="score and prune candidate cues, save the cue set")
    trace_args(p, required=True)
    model_arg(p)
    p.add_argument("--candidates", default=None, help="extra candidate cues, one per line (# comments)")
    p.add_argument("--out", required=True, help="cue-set JSON file to write (e.g. <model dir>/cues.json)")
    p.add_argument("--overwrite", action="store_true", help="replace --out even when it is not a cue set")
    p.add_argument("--min-rate", type=nonneg_float, default=0.3, help="min occurrences per 1000 decode tokens")
    p.add_argument("--max-noise", type=unit_fraction, default=0.35, help="max share of too-short stages")
    p.add_argument("--tcseq-tolerance", type=nonneg_float, default=0.01,
                   help="allowed TCseq deficit against the control segmentation")
    p.add_argument("--max-cues", type=positive_int, default=12, help="largest calibrated cue set")
    p.add_argument("--ignore-case", action="store_true", help="match cues case-insensitively")
    p.add_argument("--control", choices=("uniform", "shuffled"), default="uniform",
                   help="segmentation a cue's TCseq is compared with (shuffled: same stage lengths)")
    p.add_argument("--heldout", type=below_one, default=0.0,
                   help="fraction of the sequences held out by a hash of their id (the forecaster's split), never "
                        "calibrated on: `stages eval` on the same traces scores only those")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the --heldout hash split")
    p.set_defaults(fn=_cmd_calibrate)

    p = sub.add_parser("stats", help="stage statistics and TCseq vs controls")
    trace_args(p, required=True)
    model_arg(p)
    p.add_argument("--cues", default=None, help="cue-set JSON; when omitted: cues.json in the model folder")
    out_args(p, "stats")
    p.set_defaults(fn=_cmd_stats)

    p = sub.add_parser("detect", help="detector precision/recall against labelled CoT traces")
    model_arg(p)
    p.add_argument("--gold", required=True, help="labelled traces (cot/labeled40.jsonl)")
    p.add_argument("--cues", default=None, help="calibrated cue-set JSON (compared with all candidates)")
    p.add_argument("--candidates", default=None, help="extra candidate cues file (when --cues is not given)")
    p.add_argument("--tolerances", default="0,4,16", help="comma list of match tolerances in tokens")
    out_args(p, "detect")
    p.set_defaults(fn=_cmd_detect)

    from expertcast.recipes.saem_eval import POLICIES

    p = sub.add_parser("eval", help="stage-aware vs LRU vs static in the simulator")
    trace_args(p, required=False)
    model_arg(p)
    p.add_argument("--cues", default=None, help="cue-set JSON; when omitted: cues.json in the model folder")
    p.add_argument("--batch-sizes", default="1,8", help="comma list of sequences decoded in lockstep")
    add_capacity_args(p, multiple=True)
    p.epilog = f"Without --capacity and --slots: --capacity {EVAL_CAPACITIES}."
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma list of the evaluated policies")
    p.add_argument("--expert-bytes", type=positive_int, default=None,
                   help="expert size for the cost model; when omitted: one Qwen3-30B-A3B expert, 9437184 bytes")
    p.add_argument("--cpu-serial", action="store_true",
                   help="CPU-executed experts start after the layer's transfers, not in parallel with them")
    p.add_argument("--synthetic", action="store_true", help="also run on synthetic traces with planted stages")
    p.add_argument("--split", choices=("held-out", "all"), default="held-out",
                   help="held-out: only the sequences of --traces the cue set was not calibrated on; all: every one "
                        "(an overlap needs --allow-overlap)")
    p.add_argument("--allow-overlap", action="store_true",
                   help="score sequences the cue set was calibrated on (or a cue set recording none); reported")
    p.add_argument("--allow-model-mismatch", action="store_true",
                   help="score another model's routing with this cue set; reported")
    out_args(p, "eval")
    add_wandb_args(p)
    p.set_defaults(fn=_cmd_eval)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(f"{PROG} {args.cmd}", lambda: args.fn(args))
