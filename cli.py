"""The `expertcast` console script: one subcommand per job.

Each subcommand lives in its own module and exposes ``main(argv: list[str] | None) -> int``; the
module is imported only when its subcommand runs, so `expertcast --help` stays fast and a CPU-only
machine never imports training code it does not use.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help). Modules expose main(argv) -> int | None.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("expertcast.commands.quickstart", "run the whole pipeline on the embedded default model (CPU)"),
    "build-default": ("expertcast.commands.build_default", "train (or load the cached) embedded default MoE model"),
    "collect": ("expertcast.commands.collect", "generate completions and record routing traces (two-pass)"),
    "traces": ("expertcast.commands.traces", "routing trace tools: import | stats | card | synth"),
    "simulate": ("expertcast.commands.simulate", "trace-driven expert-cache simulation"),
    "fit": ("expertcast.commands.fit", "LightningCLI training (forecaster or router adaptation) from a YAML"),
    "forecast-eval": ("expertcast.commands.forecast_eval", "recall@K of the forecaster vs baselines by horizon"),
    "router-eval": ("expertcast.commands.router_eval", "cache-aware router adaptation: hit rate vs quality"),
    "stages": ("expertcast.commands.stages", "SAEM stages: calibrate | stats | detect | eval"),
    "eval": ("expertcast.commands.evaluate", "offloaded inference on GSM8K / MATH-500"),
    "sweep": ("expertcast.commands.sweep", "offloaded eval over policies x capacities x benchmarks, one table"),
    "lm-eval": ("expertcast.commands.lm_eval", "lm-evaluation-harness with the offloaded model (model expertcast)"),
    "build-shape": ("expertcast.commands.build_shape", "write a random-weight checkpoint of a real MoE configuration"),
    "replay": ("expertcast.commands.replay", "forced-routing replay of a trace through the offloaded runtime"),
}


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: expertcast <command> [options]", "", "commands:"]
    lines += [f"  {n.ljust(width)}  {h}" for n, (_, h) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    console = argv is None  # the console script (or python -m expertcast.cli): this process exists for the job
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"expertcast: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    from expertcast.utils.provenance import pin_code_version

    pin_code_version()  # the code this process loaded, read before the command runs (outputs record it)
    if console and getattr(module, "HOLDS_HEAP", False):  # its process ends with the job: freed memory stays held
        # (never in a caller's process, e.g. a test session calling main(argv))
        from expertcast.utils.heap import hold_heap

        hold_heap()
    rc = module.main(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
