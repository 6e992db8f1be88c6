"""`expertcast router-eval`: cache-aware router adaptation, every mode through the offloading runtime.

Trains the study's runs on the default model (or takes ``--exports``) and runs each through the
runtime on its own greedy decoding of held-out benchmark prompts (``--benchmark``, arith by default),
paired with the full-load run of the same weights: Hit, AdjHit, MB/token, tokens/s and % of full-load
tokens/s, accuracy, held-out LM loss and greedy agreement with the LM-only run, for LRU, static (LM-only
run) and the run's live router policy (R sweep). Prompts and texts are held out (checked against every
export's training texts; ``--allow-overlap`` to evaluate anyway, reported in every row). Writes Table
2/3-style tables (CSV/JSON), a PNG, and logs the table to W&B with ``--wandb``. The study logic is
:mod:`expertcast.train.router_eval`.
"""

from __future__ import annotations

import argparse

from expertcast.commands.common import (
    CommandParser,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    resolve_model,
    run_command,
)
from expertcast.utils.errors import UsageError

PROG = "expertcast router-eval"


def heldout_fraction(text: str) -> float:
    """argparse type: a fraction in (0, 1)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text!r}") from None
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text} (texts are held out by a hash "
                                         f"of their id; a count is no longer accepted)")
    return v


def build_parser() -> CommandParser:
    p = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--model", default="default",
                   help="backbone of the runs trained here: tiny-default/default, a tiny preset or a model folder")
    p.add_argument("--out", default="runs/router-eval", help="output folder (exports, tables, plot); reused to resume")
    p.add_argument("--overwrite", action="store_true", help="remove this command's earlier output in --out first")
    p.add_argument("--exports", nargs="+", default=None, metavar="DIR",
                   help="evaluate these router-adaptation exports only (no training)")
    p.add_argument("--combine", nargs="+", default=None, metavar="STUDY",
                   help="no training or evaluation: combine finished router-eval outputs of different --seed values "
                        "into table2_seeds.csv (mean and spread of every metric) in --out")
    p.add_argument("--steps", type=positive_int, default=150, help="optimizer steps per training run")
    p.add_argument("--budget", type=positive_float, default=0.25,
                   help="per-layer router budget B of the base runs: a fraction of E (< 1) or a number of experts")
    p.add_argument("--budgets", type=positive_float, nargs="*", default=[],
                   help="B sweep (each value trains temporal and full runs)")
    p.add_argument("--sw", type=nonneg_float, default=0.1,
                   help="coverage-loss weight of the base runs (every mode: temporal, full, spatio_only, aux)")
    p.add_argument("--sw-sweep", type=nonneg_float, nargs="*", default=[0.3, 1.0, 2.0],
                   help="coverage-loss weights sw of the sweep (temporal and full runs)")
    p.add_argument("--R", type=positive_int, nargs="+", default=[2, 4, 6, 8],
                   help="top-R values of the full/spatio policies (values above B are skipped)")
    p.add_argument("--modes", nargs="*", default=None, help="train/evaluate only these run names; when omitted: every run of the study")
    p.add_argument("--tau", type=positive_float, default=0.02, help="temperature of the soft top-B coverage loss")
    p.add_argument("--lr", type=positive_float, default=5e-4, help="backbone learning rate")
    p.add_argument("--router-lr", type=positive_float, default=3e-3, help="learning rate of the cache routers")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="texts per batch (training and the held-out LM-loss pass)")
    p.add_argument("--decode-batch-size", type=positive_int, default=1,
                   help="prompts decoded together through the runtime; 1: each sequence owns the B slots of a "
                        "layer (the paper's setting); n > 1: a layer serves the union of n selections")
    p.add_argument("--max-length", type=positive_int, default=320, help="tokens per text (prompt + solution)")
    p.add_argument("--heldout", type=heldout_fraction, default=0.05,
                   help="fraction of the texts held out, chosen by a hash of each text's id (stable under --limit)")
    p.add_argument("--eval-limit", type=nonneg_int, default=96,
                   help="held-out LM loss on the first N held-out texts (0: all of them)")
    p.add_argument("--benchmark", default="arith",
                   help="benchmark whose test prompts every run decodes greedily (accuracy): arith, gsm8k, math500")
    p.add_argument("--prompts", type=positive_int, default=32, help="decode the first N test prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="generated tokens per prompt at most")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N texts of the source")
    p.add_argument("--source", default="gsm8k",
                   help="LM text source: gsm8k, math500, arith (the benchmark's train split), a datasets Hub id or a "
                        "local .json/.jsonl/.parquet/.txt file")
    p.add_argument("--data-dir", default=None, help="local benchmark folder; when omitted: $EXPERTCAST_DATA_DIR, else ../shared/data")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of training, data order and held-out split")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads; when omitted: torch's choice")
    p.add_argument("--allow-overlap", action="store_true",
                   help="evaluate even when an export was trained on evaluated texts (reported in every row)")
    p.add_argument("--progress", action="store_true", help="Lightning progress bars while training")
    p.add_argument("--wandb", action="store_true", help="log the tables to W&B")
    p.add_argument("--wandb-project", default="expertcast-router", help="W&B project")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        if args.combine:
            from pathlib import Path

            from expertcast.train.router_eval import combine_seeds, write_seed_table
            from expertcast.utils.outdir import claim_output_dir

            if len(args.combine) < 2:
                raise UsageError("--combine needs two or more router-eval outputs (one per seed)")
            studies = [Path(s) for s in args.combine]
            rows = combine_seeds(studies)  # bad input fails before the output folder is claimed
            with claim_output_dir(args.out, "router-eval-seeds", overwrite=args.overwrite) as out:
                write_seed_table(rows, studies, out)
            return 0
        import torch
        from expertcast.data.benchmarks import load_benchmark
        from expertcast.train.router_eval import StudyConfig, given_exports, run_study, select_runs
        from expertcast.utils.outdir import claim_output_dir

        cfg = StudyConfig(
            model=args.model, steps=args.steps, budget=args.budget, budgets=list(args.budgets),
            sw=args.sw, sw_sweep=list(args.sw_sweep), R=list(args.R), modes=args.modes or None, tau=args.tau, lr=args.lr,
            router_lr=args.router_lr, batch_size=args.batch_size,
            decode_batch_size=args.decode_batch_size, max_length=args.max_length, heldout=args.heldout,
            eval_limit=args.eval_limit or None, limit=args.limit, source=args.source, data_dir=args.data_dir,
            benchmark=args.benchmark, prompts=args.prompts, max_new_tokens=args.max_new_tokens, seed=args.seed,
            progress=args.progress, allow_overlap=args.allow_overlap, wandb=args.wandb,
            wandb_project=args.wandb_project)
        # input errors (exports, run names, model) fail before the output folder is claimed
        exports = given_exports(args.exports) if args.exports else None
        load_benchmark(args.benchmark, "test", data_dir=args.data_dir, limit=args.prompts)  # unknown/missing: exit 2
        if exports is None:
            select_runs(cfg)
            cfg.model = resolve_model(args.model)
        if args.threads:
            torch.set_num_threads(args.threads)
        with claim_output_dir(args.out, "router-eval", overwrite=args.overwrite) as out:
            run_study(cfg, out, exports=exports)
        return 0

    return run_command(PROG, body)
