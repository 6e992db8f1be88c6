"""expertcast collect: generate completions and record their routing traces (two passes).

    expertcast collect --model M --benchmark gsm8k --limit 256 --out traces/gsm8k
    expertcast collect --model M --completions cot.jsonl --text-field thinking --out traces/cot
    torchrun --nproc_per_node 8 --no-python expertcast collect --model M ... --out traces/gsm8k   (or --shard i/n)

The output folder is claimed (a foreign or protected folder is refused, a concurrent run on it fails
fast); rerunning the same command resumes by shard, and only when every setting matches.

The recipe, step by step: read the inputs (benchmark problems or a completions file; every check before
the output folder is claimed, the folder claimed before the model loads), plan the shards, generate and
route each missing shard (the two passes of :mod:`expertcast.recipes.collect`), write it, summarize.

Shards of ``shard_size`` input items are written atomically by
:class:`expertcast.data.traces.TraceWriter` into an output folder claimed with
:func:`expertcast.utils.outdir.claim_output_dir`. Rerunning the same command resumes: only when every
setting that changes the traces matches exactly (:func:`~expertcast.recipes.collect.run_settings`; the model is identified by
preset name + init seed, the content hash of a local directory, or a Hub id + resolved commit).
``limit`` is the one setting a resume may change, and only upwards: shard i always holds input items
[i*S, (i+1)*S), so every full shard already written is exactly what the larger run would write (its
sequence ids and per-item input digests are checked); a partial last shard is redone; a smaller
limit is refused.

Sharded collection (``shard=(i, n)``: ``--shard i/n``, or torchrun's RANK/WORLD_SIZE)
splits the same shard plan over n processes: rank i writes the shards s with ``s % n == i`` into its
own part ``out/parts/rank-i-of-n/`` (a trace set of its own, with its own lock), then merges every
part no process is writing any more into ``out`` (the shard folders are moved, the manifest entries
and their sha256 kept). The rank that finishes last therefore leaves ``out`` a complete trace set,
shard for shard what one process would have written (same items, batches and sampling seeds), which
``traces stats``, ``simulate`` and ``fit`` read as usual. Ranks need no process group: they only share
the folder (a shared file system across nodes), and a rerun of any rank resumes as above.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
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
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.data.traces import OUTPUT_KIND, TraceWriter, read_manifest, shard_name
from expertcast.recipes.collect import (
    CollectConfig,
    CollectItem,
    CompletionRow,
    benchmark_items,
    completion_items,
    eos_ids,
    generate_batch,
    load_model,
    make_meta,
    read_completion_rows,
    route_sequences,
    run_settings,
    use_chat_template,
)
from expertcast.utils.errors import OutputDirError, UsageError
from expertcast.utils.outdir import OutputDir

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
    from expertcast.utils.io import report
    from expertcast.utils.outdir import claim_output_file

    a.json, a.csv = (claim_output_file(p, flag, f"collect {flag}") if p else None
                     for flag, p in (("--json", a.json), ("--csv", a.csv)))

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


# -- the recipe ------------------------------------------------------------------------------------
PARTS_DIR = "parts"
"""Sub-folder of a sharded collection's output holding each rank's part until it is merged."""



def launch_shard(text: str | None, env: dict[str, str] | None = None) -> tuple[int, int] | None:
    """The (rank, ranks) of a sharded collection: ``--shard i/n`` when given, else torchrun's
    ``RANK``/``WORLD_SIZE`` when WORLD_SIZE > 1, else None (one process collects everything)."""
    if text is not None:
        try:
            i, n = (int(x) for x in str(text).split("/"))
        except ValueError:
            raise UsageError(f"--shard must be i/n (e.g. 0/8), got {text!r}") from None
        return i, n
    env = os.environ if env is None else env
    try:
        world, rank = int(env.get("WORLD_SIZE") or 1), int(env.get("RANK") or 0)
    except ValueError:
        raise UsageError(f"RANK={env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r} are not integers") from None
    return (rank, world) if world > 1 else None



SHARD_STATS = ("sequences", "tokens", "generated_tokens", "generate_seconds", "route_seconds", "correct", "graded")
"""The figures of one shard recorded in its manifest entry (``stats``); a result sums them over the set."""


@dataclass
class CollectResult:
    """What a collection holds: the shard counts are this invocation's (written, resumed, redone); the
    figures (:data:`SHARD_STATS`) and ``rows`` cover the whole trace set, resumed shards included (summed
    from their manifest entries; ``unrecorded`` counts shards whose entry has no figures)."""

    out: Path
    shards_written: int = 0
    shards_skipped: int = 0
    shards_redone: int = 0
    sequences: int = 0
    tokens: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    route_seconds: float = 0.0
    correct: int = 0
    graded: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = True
    """Sharded: whether the merged trace set is complete (False while other ranks are still writing)."""
    unrecorded: int = 0
    """Finished shards whose manifest entry records no figures (written by an older expertcast)."""

    def add_set(self, manifest: dict[str, Any], shards: Sequence[int]) -> None:
        """Set the figures to the sums over ``shards`` of ``manifest`` (a trace manifest)."""
        for k in SHARD_STATS:
            setattr(self, k, type(getattr(self, k))(0))
        self.unrecorded = 0
        for s in shards:
            st = manifest["shards"][f"{s:05d}"].get("stats")
            if not isinstance(st, dict):
                self.unrecorded += 1
                continue
            for k in SHARD_STATS:
                v = st.get(k, 0)
                setattr(self, k, getattr(self, k) + (v if isinstance(v, (int, float)) else 0))

    @property
    def generate_tokens_per_s(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0

    @property
    def route_tokens_per_s(self) -> float:
        return self.tokens / self.route_seconds if self.route_seconds else 0.0



def collect_traces(cfg: CollectConfig, model=None, tokenizer=None,
                   on_shard: Callable[[int, Path], None] | None = None) -> CollectResult:
    """Run a collection (resuming a partial one in ``cfg.out``); ``on_shard(index, path)`` after each shard.

    Inputs are validated before the output folder is claimed, and the folder is claimed before the
    model loads, so a wrong flag, a foreign folder or a concurrent run fails in seconds.
    """
    from expertcast.utils.outdir import claim_output_dir

    cfg.validate()
    problems = rows = None
    if cfg.completions:
        rows = read_completion_rows(cfg)
    else:
        from expertcast.data.benchmarks import load_benchmark

        problems = load_benchmark(cfg.benchmark, cfg.split, data_dir=cfg.data_dir, limit=cfg.limit)
    if model is None:
        from expertcast.models.backbone import check_local_weights

        check_local_weights(cfg.model)  # a config-only folder fails before the output folder is claimed
    if cfg.shard is not None:
        return _collect_rank(cfg, rows, problems, model, tokenizer, on_shard)
    with claim_output_dir(cfg.out, OUTPUT_KIND, overwrite=cfg.overwrite) as out:
        _refuse_parts(out.path)
        if model is None or tokenizer is None:
            model, tokenizer = load_model(cfg.model, cfg.device, cfg.dtype)
        model.eval()
        templated, items, plan = _plan(cfg, tokenizer, rows, problems)
        with TraceWriter(out, make_meta(model, cfg, templated), run=run_settings(cfg, model, templated)) as writer:
            res = CollectResult(Path(cfg.out))
            res.shards_redone = len(writer.reconcile(_plan_keys(plan)))
            todo = [s for s in range(len(plan)) if not writer.is_done(s)]
            res.shards_skipped = len(plan) - len(todo)
            _run_shards(cfg, model, tokenizer, writer, plan, todo, res, on_shard)
            res.add_set(writer.manifest, range(len(plan)))
            res.rows = _summary_rows(res, cfg)
            if todo or not writer.manifest.get("complete"):  # a finished run keeps its summary
                writer.finalize(collect=res.rows, limit=cfg.limit, sequences=len(items))
    return res


def _plan(cfg: CollectConfig, tok, rows: list[CompletionRow] | None, problems: list | None
          ) -> tuple[bool, list[CollectItem], list[list[CollectItem]]]:
    """(chat template used, input items, shard plan): shard i holds items [i*S, (i+1)*S)."""
    templated = use_chat_template(cfg, tok)
    items = (completion_items(cfg, tok, rows, templated) if rows is not None
             else benchmark_items(cfg, tok, problems, templated))
    return templated, items, [items[s:s + cfg.shard_size] for s in range(0, len(items), cfg.shard_size)]


def _plan_keys(plan: list[list[CollectItem]]) -> list[list[tuple[str, str]]]:
    """(sequence id, input digest) of every item of every planned shard (what resumes compare)."""
    return [[(it.seq_id, it.input_sha256) for it in chunk] for chunk in plan]


# -- sharded collection ----------------------------------------------------------------------------------
def part_name(rank: int, ranks: int) -> str:
    return f"rank-{rank:05d}-of-{ranks:05d}"


def _refuse_parts(root: Path) -> None:
    """A one-process collect must not run over the unmerged parts of a sharded one."""
    parts = root / PARTS_DIR
    if parts.is_dir() and any(parts.iterdir()):
        raise UsageError(f"{root} holds unmerged parts of a sharded collect ({parts}): finish it with --shard i/n "
                         f"or start over with --overwrite")


def claim_waiting(path: str | os.PathLike, timeout: float = 900.0) -> OutputDir:
    """Claim the trace folder ``path``, waiting (up to ``timeout`` s) while another rank holds it."""
    from expertcast.utils.locks import FileLock
    from expertcast.utils.outdir import LOCK, claim_output_dir

    deadline = time.monotonic() + timeout
    while True:
        try:
            return claim_output_dir(path, OUTPUT_KIND)
        except OutputDirError:
            if not FileLock(Path(path) / LOCK).held_elsewhere() or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _check_parts(root: Path, ranks: int) -> None:
    """UsageError when ``root`` holds parts of a collect over another number of ranks."""
    parts = root / PARTS_DIR
    other = sorted(p.name for p in parts.iterdir() if not p.name.endswith(f"-of-{ranks:05d}")) if parts.is_dir() else []
    if other:
        raise UsageError(f"{root} holds unmerged parts of a collect over another number of ranks ({other[0]}): "
                         f"finish it with that --shard i/n or start over with --overwrite (without --shard)")


def _collect_rank(cfg: CollectConfig, rows: list[CompletionRow] | None, problems: list | None, model, tok,
                  on_shard: Callable[[int, Path], None] | None) -> CollectResult:
    """Rank i of n: write its shards into its part, then merge every finished part into ``cfg.out``."""
    from expertcast.utils.outdir import claim_output_dir

    rank, ranks = cfg.shard or (0, 1)
    root = Path(cfg.out)
    with claim_waiting(root) as out:
        out.track(PARTS_DIR)
        _check_parts(root, ranks)
    with claim_output_dir(root / PARTS_DIR / part_name(rank, ranks), OUTPUT_KIND) as part:
        if model is None or tok is None:
            model, tok = load_model(cfg.model, cfg.device, cfg.dtype)
        model.eval()
        templated, items, plan = _plan(cfg, tok, rows, problems)
        meta, run, keys = make_meta(model, cfg, templated), run_settings(cfg, model, templated), _plan_keys(plan)
        with claim_waiting(root) as out, TraceWriter(out, meta, run=run) as merged:
            merged.reconcile(keys)
            merged_done = merged.finished_shards
        mine = [s for s in range(len(plan)) if s % ranks == rank and s not in merged_done]
        with TraceWriter(part, meta, run=run) as writer:
            res = CollectResult(root)
            res.shards_redone = len(writer.reconcile(keys))
            todo = [s for s in mine if not writer.is_done(s)]
            res.shards_skipped = len(range(rank, len(plan), ranks)) - len(todo)
            _run_shards(cfg, model, tok, writer, plan, todo, res, on_shard)
            res.add_set(writer.manifest, mine)  # this rank's share of the set
            res.rows = _summary_rows(res, cfg)
    res.complete = merge_parts(root, meta, run, keys, ranks, limit=cfg.limit, sequences=len(items), shards_of=ranks)
    return res


def merge_parts(root: Path, meta: TraceMeta, run: dict[str, Any], planned: list[list[tuple[str, str]]],
                ranks: int, **summary: Any) -> bool:
    """Move the shards of every part of ``root`` that no rank is writing into ``root`` itself; mark the set
    complete once every planned shard is there. Returns whether it is complete."""
    with claim_waiting(root) as out, TraceWriter(out, meta, run=run) as merged:
        merged.reconcile(planned)
        parts = root / PARTS_DIR
        for part_dir in sorted(parts.glob(f"rank-*-of-{ranks:05d}")) if parts.is_dir() else []:
            _absorb_part(merged, part_dir, planned)
        if parts.is_dir() and not any(parts.iterdir()):
            parts.rmdir()
        complete = len(merged.finished_shards) == len(planned)
        if complete and not merged.manifest.get("complete"):
            merged.finalize(**summary)
    return complete


def _absorb_part(merged: TraceWriter, part_dir: Path, planned: list[list[tuple[str, str]]]) -> None:
    """Adopt the planned shards of one rank's part into ``merged`` and delete the part; a part whose rank is
    still writing (its lock is held) is left for that rank to merge."""
    from expertcast.utils.outdir import claim_output_dir
    from expertcast.utils.provenance import check_resume

    try:
        part = claim_output_dir(part_dir, OUTPUT_KIND)
    except OutputDirError:
        return
    with part:
        manifest = read_manifest(part_dir)
        if manifest.get("run") is not None:
            check_resume(manifest["run"], merged.run, part_dir)
        for key, entry in sorted(manifest["shards"].items()):
            idx = int(key)
            fits = idx < len(planned) and [tuple(x) for x in zip(entry["seq_ids"], entry.get("inputs") or [],
                                                                  strict=False)] == [tuple(x) for x in planned[idx]]
            if fits and not merged.is_done(idx):
                merged.adopt_shard(idx, part_dir / shard_name(idx), entry)
        shutil.rmtree(part_dir)


def _run_shards(cfg: CollectConfig, model, tok, writer: TraceWriter, plan: list[list[CollectItem]], todo: list[int],
                res: CollectResult, on_shard: Callable[[int, Path], None] | None) -> None:
    """Generate (benchmark mode), route and write the shards ``todo`` of ``plan``, counting into ``res``."""
    from tqdm.auto import tqdm

    eos = eos_ids(model, tok)
    bar = tqdm(total=sum(len(plan[s]) for s in todo), desc="collect", unit="seq", disable=not cfg.progress,
               dynamic_ncols=True)
    for s in todo:
        chunk = plan[s]
        shard = CollectResult(res.out)  # this shard's figures (SHARD_STATS), recorded in its manifest entry
        if not cfg.completions:
            _generate_shard(cfg, model, tok, chunk, s, eos, shard, bar)
        bar.set_postfix_str(f"shard {s}: routing")
        t0 = time.perf_counter()
        full = [it.prompt_ids + list(it.completion_ids or []) for it in chunk]
        routed = route_sequences(model, full, cfg.router_probs, cfg.route_batch_tokens)
        shard.route_seconds += time.perf_counter() - t0
        seqs = [TraceSequence(it.seq_id, np.asarray(toks, dtype=np.int32), len(it.prompt_ids), e, w, p)
                for it, toks, (e, w, p) in zip(chunk, full, routed, strict=True)]
        shard.tokens += sum(len(t) for t in full)
        _grade(cfg, tok, chunk, shard)
        shard.sequences += len(seqs)
        path = writer.write_shard(s, seqs, inputs=[it.input_sha256 for it in chunk],
                                  stats={k: getattr(shard, k) for k in SHARD_STATS})
        res.shards_written += 1
        if cfg.completions:
            bar.update(len(chunk))
        if on_shard is not None:
            on_shard(s, path)
    bar.close()


def _generate_shard(cfg: CollectConfig, model, tok, chunk: list[CollectItem], shard: int, eos: set[int],
                    res: CollectResult, bar) -> None:
    """Pass 1 for one shard: fills ``completion_ids`` of ``chunk`` (sampling seeded by shard index)."""
    if cfg.do_sample:
        torch.manual_seed(cfg.seed * 1_000_003 + shard)
    t0 = time.perf_counter()
    for b in range(0, len(chunk), cfg.batch_size):
        batch = chunk[b:b + cfg.batch_size]
        comps = generate_batch(model, tok, [it.prompt_ids for it in batch], cfg, eos)
        for it, c in zip(batch, comps, strict=True):
            it.completion_ids = c
            res.generated_tokens += len(c)
        bar.update(len(batch))  # benchmark mode: the bar follows generation, the slow pass
        bar.set_postfix_str(f"shard {shard}: generating")
    res.generate_seconds += time.perf_counter() - t0


def _grade(cfg: CollectConfig, tok, chunk: list[CollectItem], res: CollectResult) -> None:
    if cfg.completions:
        return
    from expertcast.data.grading import grade

    for it in chunk:
        if it.gold is not None:
            text = tok.decode(it.completion_ids or [], skip_special_tokens=True)
            res.graded += 1
            res.correct += int(grade(cfg.benchmark, text, it.gold))


def _summary_rows(res: CollectResult, cfg: CollectConfig) -> list[dict[str, Any]]:
    rows = []
    if not cfg.completions:
        rows.append({"pass": "1 generate", "sequences": res.sequences, "tokens": res.generated_tokens,
                     "seconds": round(res.generate_seconds, 3), "tokens_per_s": round(res.generate_tokens_per_s, 1)})
    rows.append({"pass": "2 route (teacher-forced)", "sequences": res.sequences, "tokens": res.tokens,
                 "seconds": round(res.route_seconds, 3), "tokens_per_s": round(res.route_tokens_per_s, 1)})
    return rows
