"""``expertcast sweep``: offloaded evaluation over policies x capacities x benchmarks, one table.

    expertcast sweep --model M --benchmarks gsm8k,math500 --policies lru,static:calibration=T,stage:cue_set=C \\
        --capacity 0.15,0.25,0.35,0.45 --limit 32 --max-new-tokens 128 --out DIR

Every cell (benchmark, policy, capacity) is an ``expertcast eval`` run (the same code) in its own folder
``DIR/cells/<benchmark>/<policy>@<capacity>/``: graded samples, Hit/AdjHit/MB per token/TTFT, and the speed
paired against the full-load model in the same run (``pct_full``: median of paired passes, min-max). The
model is loaded once for the whole grid; the host expert store is built once and reused by every cell.

Everything cheap (flags, every policy and its options, every capacity against the model's shape,
artefacts made for another model, train/test overlap, the output folder) is checked for every cell
before the model loads. ``DIR`` is claimed (a second concurrent run exits 2). A rerun resumes each cell
by sample (eval's samples file) and reuses finished cells; a cell whose settings differ is refused,
naming the setting (``--overwrite`` starts the whole sweep over). Outputs: a table, ``sweep.json``,
``sweep.csv`` and ``sweep.png`` (hit and % of full-load tokens/s vs capacity, one line per policy);
``--wandb`` logs the table and the plot.
"""

from __future__ import annotations

import argparse
from typing import Any

from expertcast.commands.common import CommandParser, add_capacity_args, capacities_from_args, parse_and_run
from expertcast.commands.evaluate import add_run_args
from expertcast.data.benchmarks import BENCHMARKS
from expertcast.utils.errors import UsageError

PROG = "expertcast sweep"


def build_parser() -> CommandParser:
    ap = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("--model", required=True, help="tiny preset name, 'tiny-default', local HF directory or Hub id")
    ap.add_argument("--benchmarks", default="gsm8k",
                    help=f"comma list of benchmarks to grade ({', '.join(BENCHMARKS)})")
    ap.add_argument("--policies", required=True,
                    help="comma list of cache policies, options as name:key=value,key=value "
                         "(e.g. lru,static:calibration=TRACES,seqmoe:forecaster=EXPORT,stage:cue_set=CUES.json)")
    add_capacity_args(ap, multiple=True, default="0.15,0.25,0.35,0.45")
    ap.add_argument("--out", required=True, help="output folder (claimed; cells resume when their settings match)")
    ap.add_argument("--overwrite", action="store_true", help="remove this folder's earlier sweep output and start over")
    add_run_args(ap)
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


def cell_args(args: argparse.Namespace, benchmark: str, spec: str, cap: dict[str, Any], out: str) -> argparse.Namespace:
    """The ``expertcast eval`` arguments of one cell."""
    d = vars(args).copy()
    for k in ("benchmarks", "policies"):
        d.pop(k)
    d.update(benchmark=benchmark, policy=spec, capacity=None, slots=None, out=out, mmap_store=False, wandb=False)
    d["capacity" if "capacity" in cap else "slots"] = str(next(iter(cap.values())))
    return argparse.Namespace(**d)


def plan_cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every cell validated (eval's cheap checks), in benchmark, policy, capacity order."""
    from expertcast.commands.evaluate import prepare
    from expertcast.inference.cache.options import split_policy_list
    from expertcast.inference.runtime.sweep_run import cell_relpath

    benches = benchmarks_of(args.benchmarks)
    specs = split_policy_list(args.policies)
    if len(set(specs)) < len(specs):
        raise UsageError(f"--policies {args.policies}: a policy is given twice")
    caps = capacities_from_args(args, multiple=True)
    if not caps:
        raise UsageError("give --capacity (fractions of all experts) or --slots (slot counts)")
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
    from expertcast.commands.evaluate import ModelSession, run_cell, set_threads
    from expertcast.inference.runtime.sweep_run import CellDir, table_row
    from expertcast.utils.outdir import claim_output_dir

    cells = plan_cells(args)
    set_threads(args.threads)
    first = cells[0]["cell"]
    rows = []
    with claim_output_dir(args.out, "sweep", overwrite=args.overwrite) as out:
        session = ModelSession(cells[0]["args"], first["info"]["model_path"], first["device"])
        for i, c in enumerate(cells):
            print(f"[{i + 1}/{len(cells)}] {c['benchmark']} {c['spec']} @ {next(iter(c['cap'].values()))}", flush=True)
            summary = run_cell(c["args"], CellDir(out, c["rel"]), c["cell"], session)
            rows.append(table_row(c["benchmark"], c["spec"], c["cap"], summary))
        _write_outputs(args, out, rows, first["info"])
    return 0


def _write_outputs(args: argparse.Namespace, out: Any, rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    from expertcast.inference.runtime.sweep_run import TABLE_COLUMNS, plot_sweep
    from expertcast.utils.io import atomic_write_json, print_table, write_csv

    table = [{k: r[k] for k in TABLE_COLUMNS} for r in rows]
    title = f"expertcast sweep: {args.model}, {args.pool} pool, batch {args.batch_size}, {args.max_new_tokens} new tokens"
    print_table(table, title=title + " (decode-only; % of full-load: median of paired passes, min-max)")
    atomic_write_json(out.file("sweep.json"), {"model": args.model, "model_path": info["model_path"],
                                               "settings": {k: v for k, v in sorted(vars(args).items())},
                                               "rows": rows})
    write_csv(out.file("sweep.csv"), table)
    plot_sweep(rows, out.file("sweep.png"), title)
    if args.wandb:
        _log_wandb(args, table, out.path / "sweep.png")
    print(f"wrote {out.path / 'sweep.json'}, sweep.csv, sweep.png and {len(rows)} cells under {out.path / 'cells'}")


def _log_wandb(args: argparse.Namespace, table: list[dict[str, Any]], png: Any) -> None:
    """The sweep table (a wandb.Table) and its plot in one W&B run."""
    from expertcast.utils.tracking import log_results

    config = {k: v for k, v in vars(args).items() if k not in ("wandb", "wandb_project")}
    log_results(args.wandb_project, "sweep", f"sweep-{args.model}", config, tables={"sweep": table},
                images={"sweep_plot": png})
