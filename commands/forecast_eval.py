"""``expertcast forecast-eval``: recall@K of a forecaster export by horizon against the online baselines (recent-freq
at the export's component half-lives too) and the reference MLP predictor (``--mlp-steps``, fitted like the
baselines; its parameters, FLOPs per step and fit time go into ``recall_summary.json`` beside the forecaster's).

    expertcast forecast-eval --forecaster runs/forecaster/tiny/export --traces runs/traces/gsm8k

Evaluates, by default (``--split auto``), only the sequences of ``--traces`` the export never saw:
the export records its training and validation sequence ids (``expertcast fit``). Whatever is
evaluated (``--split val|test|all`` too) is checked against those ids: an overlap is an error unless
``--allow-overlap``, which reports it in the table title and in ``recall_summary.json``. The baselines
are fitted on the export's training sequences (or ``--fit-traces``, checked the same way).

Generalisation protocol (:mod:`expertcast.train.generalisation`): train on one trace set with
``expertcast fit ... --data.init_args.train_sequences N`` (10 / 50 / all: data efficiency) and evaluate
on another with ``--traces``: the baselines' fitted parts then come from the export's N training
sequences, the online ones (repeat-last, recent-freq) from the evaluated sequences.

Writes ``recall.csv`` (per predictor, horizon and layer), ``recall_summary.json`` and ``recall.png``
into ``--out`` (claimed for this command: a concurrent run on it fails at once).

The recipe of the job in one place: which sequences are evaluated (:func:`evaluation_split`), what the
baselines are fitted on, the run, the tables, the plot. The predictors and the recall tables are the
library :mod:`expertcast.models.forecaster_recall`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expertcast.commands.common import CommandParser, parse_and_run, positive_int, resolve_device
from expertcast.recipes.lineage import log_results
from expertcast.utils.errors import UsageError
from expertcast.utils.tracking import add_wandb_args

if TYPE_CHECKING:
    from expertcast.data.trace_format import TraceSequence
    from expertcast.models.forecaster_recall import RecallTable

PROG = "expertcast forecast-eval"
SPLIT_CHOICES = ("auto", "val", "test", "all")
"""``--split``: ``auto`` (the sequences the export never saw), ``val`` / ``test`` (the export's split of
``--traces``), ``all``."""

log = logging.getLogger(__name__)


def build_parser() -> CommandParser:
    ap = CommandParser(prog=PROG, description="Recall@K of a forecaster export by horizon vs baselines.",
                       epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--forecaster", required=True, help="forecaster export directory (written by `expertcast fit`)")
    ap.add_argument("--traces", required=True, help="trace directory to evaluate on")
    ap.add_argument("--split", default="auto", choices=SPLIT_CHOICES,
                    help="auto: the sequences the export never saw; val/test: the export's split of --traces; "
                         "all: every sequence (overlap with the export's training ids needs --allow-overlap)")
    ap.add_argument("--allow-overlap", action="store_true",
                    help="evaluate even sequences the export was trained or validated on (reported)")
    ap.add_argument("--allow-model-mismatch", action="store_true",
                    help="evaluate on another model's routing than the export was fitted on (reported)")
    ap.add_argument("--fit-traces", default=None,
                    help="traces to fit the baselines on (unset: the export's training sequences)")
    ap.add_argument("--horizons", type=positive_int, default=8, help="forecast steps ahead to score")
    ap.add_argument("--batch-size", type=positive_int, default=32, help="sequences per forecaster batch")
    ap.add_argument("--max-sequences", type=positive_int, default=None, help="evaluate at most N sequences")
    ap.add_argument("--mlp-steps", type=int, default=300,
                    help="training steps of the reference MLP predictor, fitted on the baselines' sequences (0: none)")
    ap.add_argument("--mlp-hidden", type=positive_int, default=256, help="hidden width of the reference MLP")
    ap.add_argument("--reach-distances", type=positive_int, nargs="*", default=[1, 2, 4, 8],
                    help="within-token reach: score layer l's routing from layer l - d of the same token for these d "
                         "(tables fitted on the baselines' sequences), beside the trigger layer's; none: skip")
    ap.add_argument("--device", default="cpu", help="device of the forecaster: cpu, cuda[:N] or auto")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (unset: torch's choice)")
    ap.add_argument("--out", default=None, help="output folder (unset: runs/forecast-eval/<export folder name>)")
    ap.add_argument("--write-heldout", default=None,
                    help="also write the evaluated sequences as a trace set here (e.g. for `expertcast simulate`)")
    add_wandb_args(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), argv, PROG, run)


def split_info(exp) -> dict[str, Any]:
    """The export's split settings (``split_seed``, ``val_fraction``, ``test_fraction``, ``traces``)."""
    t = exp.training or {}
    if isinstance(t.get("split"), dict):
        s = t["split"]
        return {"split_seed": s.get("seed", 0), "val_fraction": s.get("val_fraction", 0.1),
                "test_fraction": s.get("test_fraction", 0.0), "traces": t.get("traces")}
    return dict((exp.extra or {}).get("split") or {})


def evaluation_split(seqs: Sequence[TraceSequence], split: str, trained: set[str] | None,
                     split_info: dict[str, Any] | None) -> tuple[list[TraceSequence], str]:
    """(sequences to evaluate, name of the split) for ``split`` in :data:`SPLIT_CHOICES`.

    ``auto`` takes the sequences the export never saw (``trained`` = its train + val ids); for an export
    that records no ids it falls back to the split settings written into it. ``val`` / ``test`` re-derive
    the export's split of these sequences from those settings; ``all`` takes every sequence. The caller
    checks what is returned against ``trained`` (:func:`expertcast.utils.provenance.check_overlap`).
    """
    if split not in SPLIT_CHOICES:
        raise ValueError(f"split must be one of {SPLIT_CHOICES}, got {split!r}")
    if split == "auto" and trained is not None:
        return [s for s in seqs if s.seq_id not in trained], "held-out"
    info = split_info or {}
    if split == "auto":
        split = ("test" if info.get("test_fraction", 0) > 0 else "val") if info else "all"
    if split == "all":
        return list(seqs), "all"
    from expertcast.train.forecaster_data import split_sequences

    if not info:
        log.warning("the export records no split settings: using the defaults (seed 0, val 0.1)")
    parts = split_sequences(seqs, int(info.get("split_seed", 0)), float(info.get("val_fraction", 0.1)),
                            float(info.get("test_fraction", 0.0)))
    return parts[split], split


def _load(paths, flag: str):
    from expertcast.train.forecaster_data import load_trace_dirs

    try:
        return load_trace_dirs(paths)
    except ValueError as e:  # a trace dir of another model among several
        raise UsageError(f"{flag} {paths}: {e}") from None


def baseline_sequences(args, exp, seqs, trained: set[str] | None, evaluated_split: str) -> tuple[list, str]:
    """(sequences the baselines are fitted on, where they come from)."""
    if args.fit_traces:
        return _load(args.fit_traces, "--fit-traces")[1], str(args.fit_traces)
    if trained is not None:
        mine = [s for s in seqs if s.seq_id in trained]
        if mine:
            return mine, f"the export's training sequences in {args.traces}"
        recorded = split_info(exp).get("traces")
        if recorded and all(Path(r).is_dir() for r in (recorded if isinstance(recorded, list) else [recorded])):
            return [s for s in _load(recorded, "recorded traces")[1] if s.seq_id in trained], f"{recorded}"
        return [], ""
    from expertcast.train.forecaster_data import split_sequences

    info = split_info(exp)
    parts = split_sequences(seqs, int(info.get("split_seed", 0)), float(info.get("val_fraction", 0.1)),
                            float(info.get("test_fraction", 0.0)))
    return (parts["train"], f"the training split of {args.traces}") if evaluated_split != "all" else ([], "")


def run(args) -> int:
    import time

    import torch
    from expertcast.models.forecaster_export import load_forecaster, training_ids
    from expertcast.models.forecaster_recall import (
        baseline_half_lives,
        evaluate,
        fit_baselines,
        fit_mlp_reference,
        within_token_reach,
    )
    from expertcast.utils.provenance import check_overlap

    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    exp = load_forecaster(args.forecaster, device=device)
    trained = training_ids(args.forecaster)
    meta, seqs = _load(args.traces, "--traces")
    try:
        exp.check_compatible(meta.num_layers, meta.num_experts, meta.top_k, what=f"trace set {args.traces}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    evals, split = evaluation_split(seqs, args.split, trained, split_info(exp))
    if args.max_sequences:
        evals = evals[: args.max_sequences]
    if not evals:
        raise UsageError(_nothing_to_evaluate(args, split, trained))
    ids = [s.seq_id for s in evals]
    from expertcast.models.forecaster_export import forecaster_fitted_on
    from expertcast.utils.fitted_on import check_fitted_on, trace_set_model

    overlap = {"forecaster": check_fitted_on(forecaster_fitted_on(args.forecaster), ids,
                                             trace_set_model(_first(args.traces), meta.model_id),
                                             scored=f"the traces {args.traces}", allow_overlap=args.allow_overlap,
                                             allow_model_mismatch=args.allow_model_mismatch)}
    train, train_src = baseline_sequences(args, exp, seqs, trained, split)
    if not train:
        raise UsageError("no sequences to fit the baselines on (the export's training traces are not at hand); "
                         "pass --fit-traces")
    overlap["baselines"] = check_overlap(ids, [s.seq_id for s in train], what=f"the baselines (fitted on {train_src})",
                                         allow_overlap=args.allow_overlap)
    from expertcast.utils.outdir import claim_output_dir

    out_path = Path(args.out or Path("runs") / "forecast-eval" / Path(args.forecaster).resolve().name)
    with claim_output_dir(out_path, "forecast-eval") as out:
        if args.write_heldout:
            from expertcast.data.traces import write_traces

            write_traces(args.write_heldout, meta, evals, run={"source": "forecast-eval", "split": split,
                                                               "forecaster": str(args.forecaster)})
            print(f"wrote the {len(evals)} {split} sequences to {args.write_heldout}")
        baselines = fit_baselines(train, meta, exp.config.p, baseline_half_lives(exp.config.component_half_lives))
        cost = {"forecaster": {"parameters": exp.model.num_parameters(), "step_flops": exp.model.step_flops()}}
        if args.mlp_steps > 0:
            t0 = time.perf_counter()
            mlp = fit_mlp_reference(train, meta, exp.config.p, horizons=args.horizons, hidden=args.mlp_hidden,
                                    steps=args.mlp_steps)
            baselines.append(mlp)
            cost[mlp.name] = {"parameters": mlp.num_parameters(), "step_flops": mlp.step_flops(),
                              "fit_s": round(time.perf_counter() - t0, 2), "steps": args.mlp_steps}
        for name, cst in cost.items():
            print(f"{name}: {cst['parameters']:,} parameters, {cst['step_flops']:,} FLOPs per decode step"
                  + (f", fitted in {cst['fit_s']} s" if "fit_s" in cst else ""))
        print(f"evaluating {len(evals)} sequences of {args.traces} (split: {split}; baselines fitted on {len(train)} "
              f"sequences of {train_src}), L={meta.num_layers} E={meta.num_experts} K={meta.top_k} "
              f"trigger layer p={exp.config.p}")
        tables = evaluate(exp.model, evals, meta, baselines, horizons=args.horizons, batch_size=args.batch_size,
                          device=device)
        reach = within_token_reach(train, evals, meta, exp.config.p, args.reach_distances) \
            if args.reach_distances else None
        _write(out, args, exp, meta, split, evals, tables, overlap, cost, reach)
    return 0


def _first(paths: Any) -> Any:
    return paths[0] if isinstance(paths, (list, tuple)) else paths


def _nothing_to_evaluate(args, split: str, trained: set[str] | None) -> str:
    if split == "held-out":
        return (f"every sequence of {args.traces} was used to train or validate {args.forecaster} "
                f"({len(trained or ())} ids): evaluate on other traces, train with a test split "
                f"(data.test_fraction), or pass --split val --allow-overlap")
    return f"the {split} split of {args.traces} holds no sequences"


def overlap_note(overlap: dict[str, dict[str, Any]]) -> str | None:
    """One line naming each allowed overlap, or None."""
    parts = []
    for who, o in overlap.items():
        if o.get("overlap") is None and o.get("allowed"):
            parts.append(f"the {who} records no training ids (--allow-overlap)")
        elif o.get("overlap"):
            parts.append(f"{who} trained on {o['overlap']} of the {o['evaluated']} evaluated sequences "
                         f"(--allow-overlap)")
        if o.get("model_match") is False:
            from expertcast.utils.fitted_on import describe_model

            parts.append(f"{who} fitted on model {describe_model(o.get('fitted_model'), True)}, evaluated on "
                         f"{describe_model(o.get('scored_model'), True)} (--allow-model-mismatch)")
    return "; ".join(parts) or None


def _write(out, args, exp, meta, split, evals, tables, overlap, cost, reach=None) -> None:
    from expertcast.utils.io import atomic_write_json, print_table, write_csv

    rows = summary_rows(tables)
    shown = ["predictor"] + [f"R@K h{h}" for h in (1, 2, 4, 8) if h <= args.horizons] + \
        [f"R@K+3 h{h}" for h in (1, 8) if h <= args.horizons] + ["targets h1"]
    note = overlap_note(overlap)
    if note:
        print(f"note: {note}")
    title = f"forecast recall ({split} sequences, decode targets)" + (f"; {note}" if note else "")
    print_table(rows, title=title, columns=shown)
    write_csv(out.file("recall.csv"), long_rows(tables))
    if reach and reach["rows"]:
        first, last = reach["layers"]
        positions = reach["targets"] // (last - first + 1)
        print_table(reach["rows"], title=f"within-token reach: layers {first}-{last} of {positions} decode positions "
                    f"({reach['targets']} targets) from the same token's earlier layers",
                    columns=["predictor", "R@K", "R@K+3"])
        write_csv(out.file("reach.csv"), [dict(r, layers=f"{first}-{last}") for r in reach["rows"]])
    atomic_write_json(out.file("recall_summary.json"), {
        "split": split, "traces": str(args.traces), "forecaster": str(args.forecaster),
        "export_hash": exp.export_hash, "sequences": len(evals), "overlap": overlap, "cost": cost,
        "selection": exp.config.selection, "rows": rows, "reach": reach})
    plot(tables, out.file("recall.png"), f"forecast recall by horizon ({meta.model_id}, {split})"
         + (f"; {note}" if note else ""), reach)
    print(f"wrote {out.path / 'recall.csv'}, {out.path / 'recall_summary.json'}, {out.path / 'recall.png'}"
          + (f", {out.path / 'reach.csv'}" if reach and reach["rows"] else ""))
    if args.wandb:
        inputs = [(args.forecaster, "forecaster", exp.export_hash), (args.traces, "traces", None)]
        if args.fit_traces:
            inputs.append((args.fit_traces, "traces", None))
        tidy = long_rows(tables)
        log_results(args.wandb_project, "forecast-eval", f"forecast-eval-{Path(args.forecaster).name}", vars(args),
                    tables={"recall": rows, "recall_by_layer": tidy}, images={"recall": out.path / "recall.png"},
                    inputs=inputs, series=[([r for r in tidy if r["layer"] == "all"], "horizon", "predictor",
                                            ("recall@K", "recall@K+3"))])


def summary_rows(tables: dict[str, RecallTable]) -> list[dict[str, Any]]:
    """One row per predictor: recall@K and @K+3 for each horizon."""
    rows = []
    for name, t in tables.items():
        row: dict[str, Any] = {"predictor": name}
        rk, rk3 = t.recall("k"), t.recall("k3")
        for h in range(t.horizons):
            row[f"R@K h{h + 1}"] = float(rk[h])
        for h in range(t.horizons):
            row[f"R@K+3 h{h + 1}"] = float(rk3[h])
        row["targets h1"] = int(t.count[0].sum() / max(t.num_layers, 1))
        rows.append(row)
    return rows


def long_rows(tables: dict[str, RecallTable]) -> list[dict[str, Any]]:
    """Tidy rows: predictor, horizon, layer ('all' for overall), recall@K, recall@K+3, targets."""
    rows = []
    for name, t in tables.items():
        rk, rk3 = t.recall_per_layer("k"), t.recall_per_layer("k3")
        for h in range(t.horizons):
            rows.append({"predictor": name, "horizon": h + 1, "layer": "all", "recall@K": float(t.recall("k")[h]),
                         "recall@K+3": float(t.recall("k3")[h]), "targets": int(t.count[h].sum())})
            for layer in range(t.num_layers):
                rows.append({"predictor": name, "horizon": h + 1, "layer": layer, "recall@K": float(rk[h, layer]),
                             "recall@K+3": float(rk3[h, layer]), "targets": int(t.count[h, layer])})
    return rows


def plot(tables: dict[str, RecallTable], path: str | os.PathLike, title: str, reach: dict | None = None) -> None:
    """PNG at ``path``: recall@K (solid) and @K+3 (dashed) per predictor by horizon; with ``reach`` rows, a second
    panel of the within-token reach (recall@K per predictor)."""
    import textwrap

    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from expertcast.utils.io import save_figure
    from matplotlib.ticker import MaxNLocator

    with_reach = bool(reach and reach["rows"])
    fig, axes = plt.subplots(1, 2 if with_reach else 1, figsize=(12 if with_reach else 7, 4.2), squeeze=False)
    ax = axes[0, 0]
    from expertcast.utils.io import series_colors

    for (name, t), color in zip(tables.items(), series_colors(len(tables)), strict=True):
        hs = np.arange(1, t.horizons + 1)
        style = "o" if t.horizons == 1 else "-o"
        ax.plot(hs, 100 * t.recall("k"), style, color=color, label=f"{name} top-K")
        ax.plot(hs, 100 * t.recall("k3"), "x" if t.horizons == 1 else "--", color=color, alpha=0.6,
                label=f"{name} top-(K+3)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("horizon (steps ahead)")
    ax.set_ylabel("recall of true top-K (%)")
    ax.set_title(textwrap.fill(title, 70), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    if with_reach:
        rx = axes[0, 1]
        names = [r["predictor"] for r in reach["rows"]]
        rx.barh(np.arange(len(names)), [100 * r["R@K"] for r in reach["rows"]], color="tab:blue")
        rx.set_yticks(np.arange(len(names)), names, fontsize=7)
        rx.invert_yaxis()
        rx.set_xlabel("recall of true top-K (%)")
        first, last = reach["layers"]
        rx.set_title(f"within-token reach, layers {first}-{last}", fontsize=10)
        rx.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    save_figure(fig, path)
