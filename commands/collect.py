"""expertcast collect: generate completions and record their routing traces (two passes).

    expertcast collect --model M --benchmark gsm8k --limit 256 --out traces/gsm8k
    expertcast collect --model M --completions cot.jsonl --text-field thinking --out traces/cot
    torchrun --nproc_per_node 8 --no-python expertcast collect --model M ... --out traces/gsm8k   (or --shard i/n)

The output folder is claimed (a foreign or protected folder is refused, a concurrent run on it fails
fast); rerunning the same command resumes by shard, and only when every setting matches.
The library behind it is ``expertcast.data.collect``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from expertcast.commands.common import (
    CommandParser,
    nonneg_int,
    positive_float,
    positive_int,
    resolve_device,
    resolve_model,
    run_command,
)
from expertcast.data.benchmarks import BENCHMARKS

PROG = "expertcast collect"


def build_parser() -> CommandParser:
    p = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="preset name, 'tiny-default', local model directory or Hub id")
    p.add_argument("--out", required=True,
                   help="output trace folder: new, empty, or one this command wrote (then the run resumes)")
    p.add_argument("--benchmark", default="gsm8k", choices=list(BENCHMARKS), help="benchmark to generate on")
    p.add_argument("--split", default="test", help="benchmark split")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="first N benchmark problems or completion rows (None = all); a resume may raise it")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="generation length limit (pass 1)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per generation batch")
    p.add_argument("--route-batch-tokens", type=positive_int, default=4096,
                   help="padded tokens per teacher-forced routing batch (pass 2)")
    p.add_argument("--shard-size", type=positive_int, default=64, help="input items per shard (the resume unit)")
    p.add_argument("--router-probs", action="store_true", help="also store the full router distribution [T, L, E]")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature (with --sample)")
    p.add_argument("--top-p", type=positive_float, default=1.0, help="nucleus sampling mass in (0, 1] (with --sample)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="sampling seed (shard i uses a seed derived from it and i)")
    p.add_argument("--completions", default=None, help="JSONL of completions to route instead of generating")
    p.add_argument("--text-field", default="thinking", help="completions mode: field holding the completion text")
    p.add_argument("--prompt-field", default=None, help="completions mode: field holding the prompt (None = no prompt)")
    p.add_argument("--completion-prefix", default="", help="text between prompt and completion (e.g. '<think>\\n')")
    p.add_argument("--max-tokens", type=positive_int, default=4096,
                   help="completions mode: truncate prompt + completion to N tokens")
    p.add_argument("--data-dir", default=None, help="local benchmark folder (None = $EXPERTCAST_DATA_DIR, "
                                                    "../shared/data, else the Hub)")
    tpl = p.add_mutually_exclusive_group()
    tpl.add_argument("--chat-template", dest="chat_template", action="store_true", default=None,
                     help="wrap prompts in the tokenizer's chat template (None = when it has one)")
    tpl.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                     help="plain-text prompts even when the tokenizer has a chat template")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model dtype (None = the checkpoint's)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="collect only shard i of n (0-based) into --out, merged with the other ranks' shards; "
                        "None = torchrun's RANK/WORLD_SIZE when WORLD_SIZE > 1, else everything")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (None = torch's choice)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over: delete what expertcast wrote in --out (never foreign files)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (collection and model loading)")
    p.add_argument("--json", default=None, help="also write the summary rows as JSON here")
    p.add_argument("--csv", default=None, help="also write the summary rows as CSV here")
    return p


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Turn SIGTERM into SystemExit(143) so cleanup runs (scratch files, the folder lock); the trace set
    on disk stays resumable either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run(a) -> int:
    import torch
    from expertcast.data.collect import CollectConfig, collect_traces, launch_shard
    from expertcast.utils.io import report

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the weight-loading bar too
    cfg = CollectConfig(
        model=resolve_model(a.model), out=a.out, benchmark=a.benchmark, split=a.split, limit=a.limit,
        max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, route_batch_tokens=a.route_batch_tokens,
        shard_size=a.shard_size, router_probs=a.router_probs, do_sample=a.sample, temperature=a.temperature,
        top_p=a.top_p, seed=a.seed, completions=a.completions, text_field=a.text_field,
        prompt_field=a.prompt_field, completion_prefix=a.completion_prefix, max_tokens=a.max_tokens,
        data_dir=a.data_dir, chat_template=a.chat_template, device=resolve_device(a.device), dtype=a.dtype,
        overwrite=a.overwrite, progress=not a.no_progress, shard=launch_shard(a.shard),
    )
    with _sigterm_exits():
        res = collect_traces(cfg)
    report(res.rows, title=f"collect {cfg.model} -> {cfg.out}", json_path=a.json, csv_path=a.csv)
    print(f"{res.shards_written} shards written, {res.shards_skipped} resumed"
          f"{f', {res.shards_redone} redone' if res.shards_redone else ''} -> {cfg.out}")
    if cfg.shard is not None:
        print(f"rank {cfg.shard[0]}/{cfg.shard[1]}: " + ("trace set complete" if res.complete else
                                                          "other ranks still writing (the last one merges)"))
    if res.graded:
        print(f"accuracy of the generated completions: {res.correct}/{res.graded} = {res.correct / res.graded:.3f}"
              + (" (this rank's shards)" if cfg.shard is not None else " (the whole trace set)"))
    if res.unrecorded:
        print(f"note: {res.unrecorded} resumed shards record no figures (written by an older expertcast): the rows "
              f"and accuracy above leave them out")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: _run(args))
