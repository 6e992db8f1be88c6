"""``expertcast sweep``: offloaded evaluation over policies x capacities x benchmarks, one table.

    expertcast sweep --model M --benchmarks gsm8k,math500 --policies lru,static:calibration=T,stage:cue_set=C \\
        --capacity 0.15,0.25,0.35,0.45 --limit 32 --max-new-tokens 128 --out DIR

Every cell (benchmark, policy, capacity) is an ``expertcast eval`` run (the same code) in its own folder
``DIR/cells/<benchmark>/<policy>@<capacity>/``: graded samples, Hit/AdjHit/MB per token/TTFT, and the speed
paired against the same runtime with every expert resident in the same run (``pct_full``: median of paired passes,
min-max; flagged, not reported, when the passes disagree), and the cell's own peak RSS. The
model is loaded once for the whole grid; the host expert store is built once and reused by every cell.

Everything cheap (flags, every policy and its options, every capacity against the model's shape,
artefacts made for another model, train/test overlap, the output folder) is checked for every cell
before the model loads. ``DIR`` is claimed (a second concurrent run exits 2). A rerun resumes each cell
by sample (eval's samples file) and reuses finished cells; a cell whose settings differ is refused,
naming the setting (``--overwrite`` starts the whole sweep over). Outputs: a table, ``sweep.json``,
``sweep.csv`` and ``sweep.png`` (hit and % of full speed vs capacity, one line per policy);
``--wandb`` logs the table and the plot.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expertcast.commands.common import (
    CommandParser,
    add_capacity_args,
    add_config_arg,
    capacities_from_args,
    config_record,
    parse_and_run,
)
from expertcast.commands.evaluate import add_run_args, add_store_args
from expertcast.data.benchmarks import BENCHMARKS
from expertcast.utils.errors import UsageError

if TYPE_CHECKING:
    from expertcast.inference.cache.expert_cache import Budget

PROG = "expertcast sweep"
SWEEP_CAPACITIES = "0.15,0.25,0.35,0.45"
"""``--capacity`` unless given (or ``--budget-gb`` is)."""


def build_parser() -> CommandParser:
    ap = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("--model", required=True, help="tiny preset name, 'tiny-default', local HF directory or Hub id")
    ap.add_argument("--benchmarks", default="gsm8k",
                    help=f"comma list of benchmarks to grade ({', '.join(BENCHMARKS)})")
    ap.add_argument("--policies", required=True,
                    help="comma list of cache policies, options as name:key=value,key=value "
                         "(e.g. lru,static:calibration=TRACES,seqmoe:forecaster=EXPORT,stage:cue_set=CUES.json)")
    add_capacity_args(ap, multiple=True, default=SWEEP_CAPACITIES, budget_gb=True)
    ap.add_argument("--out", required=True, help="output folder (claimed; cells resume when their settings match)")
    ap.add_argument("--overwrite", action="store_true", help="remove this folder's earlier sweep output and start over")
    add_store_args(ap)
    add_run_args(ap)
    add_config_arg(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), argv, PROG, sweep)


def benchmarks_of(text: str) -> list[str]:
    """The ``--benchmarks`` list, each known (UsageError naming the known ones)."""
    names = [b.strip() for b in str(text).split(",") if b.strip()]
    if not names:
        raise UsageError("--benchmarks: give at least one benchmark")
    for b in names:
        if b not in BENCHMARKS:
            raise UsageError(f"--benchmarks: unknown benchmark {b!r}; known: {', '.join(BENCHMARKS)}")
    if len(set(names)) < len(names):
        raise UsageError(f"--benchmarks {text}: a benchmark is given twice")
    return names


def cell_args(args: argparse.Namespace, benchmark: str, spec: str, cap: Budget, out: str) -> argparse.Namespace:
    """The ``expertcast eval`` arguments of one cell."""
    d = vars(args).copy()
    for k in ("benchmarks", "policies"):
        d.pop(k)
    d.update(benchmark=benchmark, policy=spec, capacity=None, slots=None, budget_gb=None, out=out, mmap_store=False,
             wandb=False)
    d[cap.flag[2:].replace("-", "_")] = cap.value_text
    return argparse.Namespace(**d)


def plan_cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every cell validated (eval's cheap checks), in benchmark, policy, capacity order."""
    from expertcast.commands.evaluate import prepare
    from expertcast.inference.cache.options import split_policy_list

    benches = benchmarks_of(args.benchmarks)
    specs = split_policy_list(args.policies)
    if len(set(specs)) < len(specs):
        raise UsageError(f"--policies {args.policies}: a policy is given twice")
    if args.budget_gb is not None and args.capacity == SWEEP_CAPACITIES:
        args.capacity = None  # --budget-gb in place of the default fractions (an explicit --capacity is refused)
    caps = capacities_from_args(args, multiple=True)
    if not caps:
        raise UsageError("give --capacity (fractions of all experts), --slots (slot counts) or --budget-gb (GB)")
    cells = []
    for b in benches:
        for spec in specs:
            for cap in caps:
                rel = cell_relpath(b, spec, cap)
                a = cell_args(args, b, spec, cap, rel)
                cells.append({"benchmark": b, "spec": spec, "cap": cap, "rel": rel, "args": a, "cell": prepare(a)})
    return cells


def sweep(args: argparse.Namespace) -> int:
    """Validate every cell, claim ``--out``, run (or resume) the cells, write the table."""
    from expertcast.commands.evaluate import run_cell, session_settings, set_threads
    from expertcast.inference.runtime.session import ModelSession
    from expertcast.utils.outdir import claim_output_dir

    cells = plan_cells(args)
    set_threads(args.threads)
    first = cells[0]["cell"]
    rows = []
    with claim_output_dir(args.out, "sweep", overwrite=args.overwrite) as out:
        session = ModelSession(session_settings(cells[0]["args"], first["info"]["model_path"], first["device"],
                                                out=args.out))
        for i, c in enumerate(cells):
            print(f"[{i + 1}/{len(cells)}] {c['benchmark']} {c['spec']} @ {c['cap'].value_text}", flush=True)
            summary = run_cell(c["args"], CellDir(out, c["rel"]), c["cell"], session)
            rows.append(table_row(c["benchmark"], c["spec"], c["cap"], summary))
        _write_outputs(args, out, rows, first["info"], cells)
    return 0


def _write_outputs(args: argparse.Namespace, out: Any, rows: list[dict[str, Any]], info: dict[str, Any],
                   cells: list[dict[str, Any]] = ()) -> None:
    from expertcast.utils.io import atomic_write_json, print_table, write_csv

    table = [{k: r[k] for k in TABLE_COLUMNS} for r in rows]
    title = f"expertcast sweep: {args.model}, {args.pool} pool, batch {args.batch_size}, {args.max_new_tokens} new tokens"
    print_table(table, title=title + " (decode-only; Hit: resident hits / accesses; % of full speed: against the "
                                     "runtime with every expert resident, median of paired passes, min-max; "
                                     "tokens/s: the paired offloaded passes; peak RSS: each cell's own)")
    settings = {k: v for k, v in sorted(vars(args).items()) if k != "config"}  # what the flags would give
    config = {"config": config_record(args)} if args.config else {}
    guard = {f"{c['benchmark']} {c['spec']}": c["cell"]["info"]["guard_note"] for c in cells
             if c["cell"]["info"].get("guard_note")}  # allowed overlaps and model mismatches, per cell
    for cell, note in guard.items():
        print(f"guard: {cell}: {note}")
    atomic_write_json(out.file("sweep.json"), {"model": args.model, "model_path": info["model_path"],
                                               "settings": settings, **config, "guard": guard,
                                               "expert_dtype": info.get("expert_dtype", "bfloat16"), "rows": rows})
    write_csv(out.file("sweep.csv"), table)
    plot_sweep(rows, out.file("sweep.png"), title)
    if args.wandb:
        _log_wandb(args, table, out.path / "sweep.png", cells)
    print(f"wrote {out.path / 'sweep.json'}, sweep.csv, sweep.png and {len(rows)} cells under {out.path / 'cells'}")


def _log_wandb(args: argparse.Namespace, table: list[dict[str, Any]], png: Any, cells: list[dict[str, Any]] = ()
               ) -> None:
    """The sweep table (a wandb.Table), its per-capacity series (one curve per benchmark and policy) and its
    plot in one W&B run, which declares the exports and cue sets of every cell's policy as its inputs."""
    from expertcast.commands.evaluate import wandb_inputs
    from expertcast.recipes.lineage import log_results

    config = {k: v for k, v in vars(args).items() if k not in ("wandb", "wandb_project")}
    inputs = [i for c in cells for i in wandb_inputs(c["args"], c["cell"]["info"]["artefacts"])]
    log_results(args.wandb_project, "sweep", f"sweep-{args.model}", config, tables={"sweep": table},
                images={"sweep_plot": png}, inputs=inputs,
                series=[(table, "capacity", ("benchmark", "policy"), SERIES_METRICS)])


# -- cell folders, the table and its plot ----------------------------------------------------------
CELLS = "cells"
TABLE_COLUMNS = ["benchmark", "policy", "capacity", "samples", "accuracy", "hit", "cpu_exec", "adj_hit",
                 "mb_per_token", "read_mb_per_token", "exposed_misses_per_token", "miss_free_token_frac",
                 "tokens_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
                 "pct_full", "pct_full_min", "pct_full_max", "speed_flag", "baseline", "proactive_per_token",
                 "prefetch_precision", "late_prefetches", "stall_ms_per_token", "peak_rss_gb", "rss_bound_gb"]
SERIES_METRICS = ("accuracy", "hit", "adj_hit", "mb_per_token", "tokens_per_s", "pct_full", "stall_ms_per_token")
"""Table columns logged to W&B as per-capacity series (``--wandb``)."""


def policy_slug(spec: str) -> str:
    """A folder-safe name of a ``--policy`` spec: the policy name, plus a short hash of its options when it
    has any (``stage:cue_set=/a/b.json`` -> ``stage-3f9a1c2b``)."""
    name, _, opts = spec.partition(":")
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in name.strip().lower())
    return name if not opts.strip() else f"{name}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}"


def cell_relpath(benchmark: str, spec: str, cap: Budget) -> str:
    """The cell's folder relative to the sweep's output folder."""
    return f"{CELLS}/{benchmark}/{policy_slug(spec)}@{cap.tag}"


class CellDir:
    """A cell's folder inside the sweep's claimed output folder, with the ``path`` / ``file`` / ``track``
    interface of :class:`~expertcast.utils.outdir.OutputDir` that ``eval``'s machinery writes through (the
    sweep folder records ``cells/`` as its own; the lock is the sweep's)."""

    def __init__(self, parent: Any, rel: str):
        parent.track(CELLS)
        self.path = Path(parent.path) / rel
        self.path.mkdir(parents=True, exist_ok=True)

    def track(self, *names: str | os.PathLike) -> None:
        """Everything under the cell folder is the sweep's already."""

    def file(self, name: str) -> Path:
        return self.path / name


def table_row(benchmark: str, spec: str, cap: Budget, summary: dict[str, Any]) -> dict[str, Any]:
    """One sweep row from a cell's eval summary (``capacity``: the budget's number, ``capacity_kind``: its
    :meth:`~expertcast.inference.cache.expert_cache.Budget.row` key)."""
    (kind, value), = cap.row().items()
    row = {"benchmark": benchmark, "policy": spec, "capacity": value}
    row.update({k: summary.get(k) for k in TABLE_COLUMNS if k not in row})
    row["capacity_kind"] = kind
    row["tokens_match"] = (summary.get("speed") or {}).get("tokens_match")
    row["latency_model"] = summary.get("latency_model")
    return row


def plot_sweep(rows: list[dict[str, Any]], path: str | os.PathLike, title: str) -> None:
    """PNG: decode hit rate (top) and % of full speed (against the runtime with every expert resident) with its
    min-max (bottom) vs capacity, one line per policy, one column per benchmark; a flagged ratio is not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from expertcast.utils.io import save_figure

    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    fig, axes = plt.subplots(2, len(benches), figsize=(max(7.5, 5.5 * len(benches)), 7.5), squeeze=False)
    for j, b in enumerate(benches):
        top, bottom = axes[0][j], axes[1][j]
        for pol in dict.fromkeys(r["policy"] for r in rows if r["benchmark"] == b):
            pts = sorted((r for r in rows if r["benchmark"] == b and r["policy"] == pol), key=lambda r: r["capacity"])
            xs = [100 * r["capacity"] if r["capacity_kind"] == "capacity" else r["capacity"] for r in pts]
            label = pol.split(":")[0] if len(pol) > 24 else pol
            top.plot(xs, [r["hit"] for r in pts], marker="o", label=label)
            speed = [r for r in pts if r.get("pct_full") is not None]
            if speed:
                sx = [xs[pts.index(r)] for r in speed]
                mid = [r["pct_full"] for r in speed]
                err = [[m - r["pct_full_min"] for m, r in zip(mid, speed, strict=True)],
                       [r["pct_full_max"] - m for m, r in zip(mid, speed, strict=True)]]
                bottom.errorbar(sx, mid, yerr=err, marker="o", capsize=3, label=label)
        unit = "capacity (% of all experts)" if all(r["capacity_kind"] == "capacity" for r in rows) else "capacity"
        top.set_title(b)
        top.set_ylabel("decode hit rate")
        top.set_ylim(0, 1.05)
        bottom.set_ylabel("% of full speed (all-resident runtime; median, min-max)")
        bottom.set_xlabel(unit)
        bottom.axhline(100, color="gray", ls="--", lw=0.8)
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
