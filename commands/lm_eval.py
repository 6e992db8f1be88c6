"""``expertcast lm-eval``: lm-evaluation-harness's command line with the ``expertcast`` model and the local tasks.

    expertcast lm-eval --model_args model=M,policy=lru,capacity=0.25 --tasks gsm8k --limit 2

The arguments are lm_eval's (``lm_eval run --help``); this command registers the harness model
``expertcast`` (:mod:`expertcast.harness.lm_eval_adapter`: offloaded greedy generation, the cache metrics in
the results JSON's ``config.expertcast`` and printed beside the harness's table), adds ``--model expertcast``
when no ``--model`` is given, ``--device auto`` when no ``--device`` is, and ``--include_path`` the local task files (:mod:`expertcast.harness.local_tasks`:
``gsm8k`` and ``minerva_math500`` read ``$EXPERTCAST_DATA_DIR``; ``expertcast_arith``), then runs lm_eval's CLI.
lm-eval 0.4.13 discovers no model outside its own tree, hence this command; a harness with entry-point
discovery (the ``lm_eval.models`` group, which the package declares) finds ``--model expertcast`` by itself.
Needs the ``lmeval`` extra (``pip install -e '.[lmeval]'``).
"""

from __future__ import annotations

import sys

from expertcast.commands.common import run_command
from expertcast.utils.errors import UsageError

PROG = "expertcast lm-eval"


def harness_argv(argv: list[str]) -> list[str]:
    """lm_eval's arguments for ``argv``: ``--model expertcast`` unless a model is named, ``--device auto`` unless a
    device is (lm_eval's default is ``cuda:0``), and the local tasks' ``--include_path`` (lm-eval 0.4 takes one
    folder, so a second one is refused)."""
    from expertcast.harness.local_tasks import TASKS_DIR

    if any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        raise UsageError(f"--include_path: {PROG} includes its own task folder ({TASKS_DIR}) and lm-eval 0.4 takes "
                         f"one; copy your task files there or call lm_eval.simple_evaluate")
    out = list(argv)
    if not any(a == "--model" or a.startswith("--model=") for a in out):
        out += ["--model", "expertcast"]
    if not any(a == "--device" or a.startswith("--device=") for a in out):
        out += ["--device", "auto"]  # lm_eval's own default is cuda:0
    return [*out, "--include_path", str(TASKS_DIR)]


def unknown_tasks_message(e: ValueError) -> str:
    """One line for lm_eval's ``Tasks not found`` error, naming the local tasks."""
    from expertcast.harness.local_tasks import LOCAL_TASKS

    first = " ".join(str(e).split(". Try")[0].split())
    return (f"--tasks: {first} (local tasks: {', '.join(LOCAL_TASKS)}; the harness's own: lm_eval ls tasks)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0

    def body() -> int:
        try:
            import expertcast.harness.lm_eval_adapter  # noqa: F401  (registers --model expertcast)
            from lm_eval.__main__ import cli_evaluate
        except ImportError as e:
            raise UsageError(f"lm-evaluation-harness is not installed ({e}): pip install -e '.[lmeval]'") from None
        saved = sys.argv
        sys.argv = ["lm_eval", *harness_argv(argv)]
        try:
            cli_evaluate()
        except SystemExit as e:  # lm_eval's argparse errors and --help
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        except ValueError as e:  # lm_eval's "Tasks not found: ..." (a traceback otherwise)
            if not str(e).startswith("Tasks not found"):
                raise
            raise UsageError(unknown_tasks_message(e)) from None
        finally:
            sys.argv = saved
        return 0

    return run_command(PROG, body)
