"""``expertcast fit``: train the SeqMoE forecaster or the cache-aware routers from a YAML (LightningCLI).

    expertcast fit --config configs/forecaster/tiny.yaml --data.init_args.traces runs/traces/gsm8k
    expertcast fit --config configs/router/tiny.yaml --trainer.max_steps 50
    expertcast fit --config configs/forecaster/tiny.yaml --resume runs/forecaster/tiny/forecaster-tiny-20250101-120000-1a2b3c4d

Every run gets its own directory ``<root>/<run-name>-<YYYYmmdd-HHMMSS>-<8 hex>`` (root:
``trainer.default_root_dir``, else ``runs/<task>/<config name>``; the hex digits hash the settings
that decide what is learned and the data fingerprint), printed at the start. It holds ``run.json``,
the resolved ``config.yaml``, ``checkpoints/`` (``last.ckpt`` and ``last-prev.ckpt``, plus any
configured ModelCheckpoint), the logger's files and ``export/`` (or the export goes to an explicit
``--model.init_args.export_dir``, claimed for this run). The export is written once, after training
finished, with the traces, their fingerprint, the split and the exact train/val sequence ids.

A run never continues another by itself: ``--resume RUN_DIR_OR_CKPT`` (or ``--ckpt_path``)
continues one, only when its settings and data fingerprint match (``max_steps``/``max_epochs`` may
grow); a truncated ``last.ckpt`` falls back to ``last-prev.ckpt`` with a warning. SIGTERM/SIGINT
save a checkpoint after the running step and exit with 143/130 without writing an export; the
message says how to resume. Every other option is LightningCLI's (``--trainer.*``, ``--model.init_args.*``,
``--data.init_args.*``, ``--print_config``; ``--lightning-help`` lists them).

A W&B logger (``trainer.logger``, as in the shipped configs) gets the export as an artifact; with
``--wandb-checkpoints`` also the run's checkpoints (type ``model-checkpoint``), offline runs included.
"""

from __future__ import annotations

import sys
from typing import Any

from expertcast.commands.common import CommandParser, positive_int, run_command
from expertcast.utils.errors import UsageError

PROG = "expertcast fit"

last_result: Any = None
"""The :class:`~expertcast.train.cli.FitResult` of the latest :func:`main` call in this process."""


def build_parser() -> CommandParser:
    ap = CommandParser(prog=PROG, usage=f"{PROG} --config CONFIG.yaml [options] [LightningCLI options]",
                       description="Train the forecaster or the cache routers from a YAML (LightningCLI).",
                       epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False)
    ap.add_argument("-c", "--config", action="append", default=[], metavar="CONFIG.yaml",
                    help="LightningCLI config (e.g. configs/forecaster/tiny.yaml); later options override it")
    ap.add_argument("--resume", metavar="RUN_DIR_OR_CKPT", default=None,
                    help="continue this run directory (or checkpoint) when settings and data match")
    ap.add_argument("--run-name", default=None,
                    help="first part of the run directory name (unset: <task>-<config name>, e.g. forecaster-tiny)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier export in an explicit model.init_args.export_dir once this run finishes")
    ap.add_argument("--checkpoint-every", type=positive_int, default=100, metavar="STEPS",
                    help="optimizer steps between resumable checkpoints (also at every epoch end, at the end "
                         "and on SIGTERM/SIGINT)")
    ap.add_argument("--wandb-checkpoints", action="store_true",
                    help="once training finished, log the run's checkpoints to its W&B logger (trainer.logger) as an "
                         "artifact; works offline too")
    ap.add_argument("--lightning-help", action="store_true", help="print every LightningCLI option and exit")
    return ap


def resolve_config(name: str) -> str:
    """A config path as given when it exists; else a shipped config of the package: ``forecaster/tiny``,
    ``forecaster/tiny.yaml`` or ``configs/forecaster/tiny.yaml`` from any working directory."""
    from pathlib import Path

    from expertcast.utils.paths import REPO_ROOT

    p = Path(name).expanduser()
    if p.exists():
        return str(p)
    rel = Path(*p.parts[1:]) if p.parts and p.parts[0] == "configs" else p
    for cand in (REPO_ROOT / "configs" / rel, (REPO_ROOT / "configs" / rel).with_suffix(".yaml")):
        if cand.is_file():
            print(f"config: shipped {cand.relative_to(REPO_ROOT)}", file=sys.stderr)
            return str(cand)
    shipped = sorted(str(c.relative_to(REPO_ROOT / "configs").with_suffix(""))
                     for c in (REPO_ROOT / "configs").rglob("*.yaml"))
    raise UsageError(f"--config {name}: no such file, and no shipped config of that name ({', '.join(shipped)})")


HOLDS_HEAP = True
"""The console script holds this process's heap (:func:`expertcast.utils.heap.hold_heap`): a fit's steps allocate
and free the same large tensors over and over (docs/results.md, "Fit time: a held heap")."""


def parse(argv: list[str]) -> tuple[Any, list[str]]:
    """(expertcast options, LightningCLI arguments); a leading ``fit`` is accepted and dropped."""
    argv = list(argv)
    if argv and argv[0] == "fit":
        argv = argv[1:]
    args, rest = build_parser().parse_known_args(argv)
    lightning = [x for c in args.config for x in ("--config", resolve_config(c))] + rest
    if args.lightning_help:
        lightning.append("--help")
    elif not args.config and not any(a.startswith(("--model", "--print_config")) for a in rest):
        raise UsageError("give --config CONFIG.yaml (e.g. configs/forecaster/tiny.yaml)")
    return args, lightning


def run_fit(argv: list[str]):
    """Train per ``argv`` (this command's options and LightningCLI's) in-process; returns the
    :class:`~expertcast.train.cli.FitResult` (run dir, status, export dir and hash, exit code). User
    mistakes raise :class:`~expertcast.utils.errors.UsageError`."""
    from expertcast.train.cli import FitOptions, fit

    args, lightning = parse(argv)
    return fit(lightning, FitOptions(resume=args.resume, run_name=args.run_name, overwrite=args.overwrite,
                                     checkpoint_every=args.checkpoint_every, log_checkpoints=args.wandb_checkpoints))


def main(argv: list[str] | None = None) -> int:
    """``expertcast fit``; returns the exit status (never calls sys.exit): 0 finished, 2 usage error,
    143/130 interrupted by SIGTERM/SIGINT (checkpoint saved, no export)."""
    global last_result
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        global last_result
        last_result = run_fit(argv)
        return last_result.exit_code

    last_result = None
    try:
        return run_command(PROG, body)
    except SystemExit as e:  # --help, --print_config, parse errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
