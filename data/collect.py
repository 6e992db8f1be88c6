"""``expertcast collect``: routing traces by the two-pass method (SeqMoE 5.1; DESIGN.md "Routing traces").

Pass 1 generates completions for a benchmark split in batches with LEFT padding (greedy, or sampled
with a seed that depends on the shard so a resumed run makes the same samples). Pass 2 runs one
teacher-forced forward over prompt + completion with the routers observed
(:func:`expertcast.models.routing.capture_routing`); sequences are sorted by length and batched with
RIGHT padding and an attention mask, so pads only ever come after a sequence's real tokens and never
change their routing. With ``--completions FILE`` pass 1 is skipped: the text someone else wrote
(e.g. the R1 chain-of-thought traces of ``../shared/data/cot/``) is tokenized and routed.

Shards of ``--shard-size`` input items are written atomically by
:class:`expertcast.data.traces.TraceWriter`; rerunning the same command skips finished shards.

A trace position is every token of prompt + completion (the completion includes its end-of-sequence
token when one was generated). During real decoding the last generated token is never fed back, so
its routing is the only one here that decoding would not have observed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.data.traces import TraceWriter


@dataclass
class CollectConfig:
    """Settings of one trace collection."""

    model: str
    """Preset name (e.g. ``qwen3_moe-tiny``), local model directory or Hub id."""
    out: str
    """Output trace directory."""
    benchmark: str = "gsm8k"
    """``gsm8k`` or ``math500`` (ignored with ``completions``)."""
    split: str = "test"
    limit: int | None = None
    """Use only the first N items (benchmark problems or completion rows)."""
    max_new_tokens: int = 256
    batch_size: int = 8
    """Sequences per generation batch (pass 1)."""
    route_batch_tokens: int = 4096
    """Pass 2 packs length-sorted sequences into batches of at most this many padded tokens."""
    shard_size: int = 64
    """Input items per shard."""
    router_probs: bool = False
    """Also store the full router distribution [T, L, E]."""
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    completions: str | None = None
    """JSONL of completions someone else wrote: route them, no generation."""
    text_field: str = "thinking"
    prompt_field: str | None = None
    completion_prefix: str = ""
    """Text put between prompt and completion in completions mode (e.g. ``"<think>\\n"``)."""
    max_tokens: int = 4096
    """Completions mode: sequences (prompt + completion) are truncated to this many tokens."""
    data_dir: str | None = None
    chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template (None: when it has one)."""
    device: str = "auto"
    dtype: str | None = None
    """Model dtype (``float32``, ``bfloat16``...); None keeps the loader's default."""
    overwrite: bool = False
    progress: bool = True

    def run_settings(self) -> dict[str, Any]:
        """Settings that change the traces (a resumed run must match them); batch sizes do not."""
        keep = ("model", "benchmark", "split", "limit", "max_new_tokens", "shard_size", "router_probs", "do_sample",
                "temperature", "top_p", "seed", "completions", "text_field", "prompt_field", "completion_prefix",
                "max_tokens", "chat_template", "dtype")
        d = {k: v for k, v in asdict(self).items() if k in keep}
        if self.completions:
            for k in ("benchmark", "split", "max_new_tokens", "do_sample", "temperature", "top_p", "seed"):
                d.pop(k)
            d["completions"] = str(Path(self.completions).resolve())
        else:
            for k in ("completions", "text_field", "prompt_field", "completion_prefix", "max_tokens"):
                d.pop(k)
        return d


@dataclass
class CollectResult:
    """What a collection did (this invocation; skipped shards are counted apart)."""

    out: Path
    shards_written: int = 0
    shards_skipped: int = 0
    sequences: int = 0
    tokens: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    route_seconds: float = 0.0
    correct: int = 0
    graded: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def generate_tokens_per_s(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0

    @property
    def route_tokens_per_s(self) -> float:
        return self.tokens / self.route_seconds if self.route_seconds else 0.0


@dataclass
class _Item:
    seq_id: str
    prompt_ids: list[int]
    completion_ids: list[int] | None = None
    completion_text: str | None = None
    prompt_text: str | None = None
    gold: str | None = None


# -- model ---------------------------------------------------------------------------------------------
def load_model(name: str, device: str = "auto", dtype: str | None = None):
    """(model, tokenizer) for a preset name, ``tiny-default``, local directory or Hub id
    (:func:`expertcast.models.backbone.load_moe_model`), in eval mode on ``device``."""
    from expertcast.models.backbone import load_moe_model

    return load_moe_model(name, dtype=dtype or "auto", device=resolve_device(device))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _eos_ids(model, tok) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tok):
        e = getattr(src, "eos_token_id", None)
        if e is None:
            continue
        ids.update([e] if isinstance(e, int) else list(e))
    return ids


# -- inputs --------------------------------------------------------------------------------------------
def _encode_prompt(tok, text: str, templated: bool) -> list[int]:
    return list(tok(text, add_special_tokens=not templated)["input_ids"])


def _benchmark_items(cfg: CollectConfig, tok, problems: list) -> list[_Item]:
    from expertcast.data.prompts import build_prompt, has_chat_template

    templated = has_chat_template(tok) if cfg.chat_template is None else cfg.chat_template
    items = []
    for p in problems:
        text = build_prompt(tok, p.question, cfg.benchmark, use_chat_template=templated)
        items.append(_Item(p.id, _encode_prompt(tok, text, templated), prompt_text=text, gold=p.answer))
    return items


def _completion_items(cfg: CollectConfig, tok) -> list[_Item]:
    from expertcast.data.prompts import has_chat_template

    path = Path(cfg.completions)
    if not path.is_file():
        raise FileNotFoundError(f"completions file {path} does not exist")
    templated = has_chat_template(tok) if cfg.chat_template is None else cfg.chat_template
    items: list[_Item] = []
    seen: set[str] = set()
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            if cfg.limit is not None and len(items) + skipped >= cfg.limit:
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not valid JSON ({e.msg})") from None
            if cfg.text_field not in row:
                raise ValueError(f"{path}:{ln}: no field {cfg.text_field!r} (fields: {', '.join(row)})")
            prompt_ids: list[int] = []
            ptext = None
            if cfg.prompt_field:
                if cfg.prompt_field not in row:
                    raise ValueError(f"{path}:{ln}: no field {cfg.prompt_field!r} (fields: {', '.join(row)})")
                ptext = str(row[cfg.prompt_field])
                if templated:
                    ptext = tok.apply_chat_template([{"role": "user", "content": ptext}], tokenize=False,
                                                    add_generation_prompt=True)
                prompt_ids = _encode_prompt(tok, ptext, templated)
            text = cfg.completion_prefix + str(row[cfg.text_field])
            comp = list(tok(text, add_special_tokens=not prompt_ids, verbose=False)["input_ids"])
            room = cfg.max_tokens - len(prompt_ids)
            if room < 1:
                skipped += 1
                continue
            sid = str(row.get("id", f"{path.stem}-{ln - 1:05d}"))
            if sid in seen:  # keep sequence ids unique
                sid = f"{sid}#line{ln}"
            seen.add(sid)
            items.append(_Item(sid, prompt_ids, completion_ids=comp[:room], completion_text=text, prompt_text=ptext))
    if skipped:
        warnings.warn(f"{skipped} rows of {path} skipped: their prompt alone exceeds --max-tokens {cfg.max_tokens}",
                      stacklevel=2)
    if not items:
        raise ValueError(f"{path} holds no usable completions")
    return items


# -- passes --------------------------------------------------------------------------------------------
@torch.inference_mode()
def generate_batch(model, tok, prompts: Sequence[list[int]], cfg: CollectConfig, eos: set[int]) -> list[list[int]]:
    """Pass 1: completions (token ids, cut after the first EOS) of a batch of prompts, left-padded."""
    dev = next(model.parameters()).device
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(eos) if eos else 0)
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, T - len(p):] = 1
    kw: dict[str, Any] = dict(max_new_tokens=cfg.max_new_tokens, pad_token_id=pad, do_sample=cfg.do_sample)
    if cfg.do_sample:
        kw.update(temperature=cfg.temperature, top_p=cfg.top_p)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    if eos:
        kw["eos_token_id"] = sorted(eos)
    out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **kw)
    new = out[:, T:].tolist()
    result = []
    for row in new:
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        result.append(row[:cut])
    return result


def route_sequences(model, seqs: Sequence[list[int]], router_probs: bool = False,
                    batch_tokens: int = 4096) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Pass 2: per sequence (expert_ids int16 [T, L, K], weights float16 [T, L, K], probs float16 [T, L, E] | None).

    Sequences are sorted by length and packed into right-padded batches of at most ``batch_tokens``
    padded tokens (one sequence alone when it is longer); no mask is passed to an unpadded batch.
    """
    from expertcast.models.routing import capture_routing

    dev = next(model.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[Any] = [None] * len(seqs)
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j + 1 - i) * len(seqs[order[j]]) <= batch_tokens:
            j += 1
        batch = [order[k] for k in range(i, j)]
        T = max(len(seqs[b]) for b in batch)
        ids = torch.zeros((len(batch), T), dtype=torch.long)
        mask = torch.zeros((len(batch), T), dtype=torch.long)
        for r, b in enumerate(batch):
            n = len(seqs[b])
            if n == 0:
                raise ValueError("cannot route an empty sequence")
            ids[r, :n] = torch.tensor(seqs[b], dtype=torch.long)
            mask[r, :n] = 1
        padded = bool((mask == 0).any())
        cap = capture_routing(model, ids.to(dev), mask.to(dev) if padded else None, router_probs=router_probs)
        e = cap.expert_ids.cpu().numpy()
        w = cap.expert_weights.cpu().numpy()
        p = cap.router_probs.cpu().numpy() if cap.router_probs is not None else None
        for r, b in enumerate(batch):
            n = len(seqs[b])
            out[b] = (e[r, :n].astype(np.int16), w[r, :n].astype(np.float16),
                      p[r, :n].astype(np.float16) if p is not None else None)
        i = j
    return out


# -- driver --------------------------------------------------------------------------------------------
def make_meta(model, cfg: CollectConfig) -> TraceMeta:
    """Trace metadata from the model's routers, cross-checked against its :class:`MoESpec`."""
    from expertcast.models.routing import find_routers
    from expertcast.models.spec import MoESpec

    sites = find_routers(model)
    spec = MoESpec.from_model(model)
    mine = ([s.layer_idx for s in sites], sites[0].num_experts, sites[0].top_k)
    if mine != (spec.moe_layers, spec.num_experts, spec.top_k):
        raise ValueError(f"routers found at layers {mine[0]} with E={mine[1]}, K={mine[2]} but the model's MoESpec "
                         f"says {spec.moe_layers}, E={spec.num_experts}, K={spec.top_k}")
    gen: dict[str, Any]
    if cfg.completions:
        gen = {"source": "completions", "file": str(cfg.completions), "text_field": cfg.text_field,
               "prompt_field": cfg.prompt_field, "completion_prefix": cfg.completion_prefix,
               "max_tokens": cfg.max_tokens}
    else:
        gen = {"source": "generate", "max_new_tokens": cfg.max_new_tokens, "do_sample": cfg.do_sample,
               "temperature": cfg.temperature if cfg.do_sample else None,
               "top_p": cfg.top_p if cfg.do_sample else None, "seed": cfg.seed if cfg.do_sample else None,
               "chat_template": cfg.chat_template}
    return TraceMeta(
        model_id=cfg.model,
        revision=getattr(getattr(model, "config", None), "_commit_hash", None),
        num_layers=len(sites), num_experts=sites[0].num_experts, top_k=sites[0].top_k,
        expert_bytes=int(spec.expert_bytes), moe_layers=[s.layer_idx for s in sites],
        dataset=Path(cfg.completions).name if cfg.completions else cfg.benchmark,
        split=None if cfg.completions else cfg.split,
        generation=gen, has_router_probs=cfg.router_probs,
    )


def collect_traces(cfg: CollectConfig, model=None, tokenizer=None,
                   on_shard: Callable[[int, Path], None] | None = None) -> CollectResult:
    """Run a collection (resuming a partial one in ``cfg.out``); ``on_shard(index, path)`` after each shard."""
    from tqdm.auto import tqdm

    if cfg.shard_size < 1 or cfg.batch_size < 1:
        raise ValueError(f"--shard-size and --batch-size must be >= 1 (got {cfg.shard_size}, {cfg.batch_size})")
    if not cfg.completions and cfg.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    problems = None
    if not cfg.completions:  # fail fast on a missing dataset, before loading the model
        from expertcast.data.benchmarks import load_benchmark

        problems = load_benchmark(cfg.benchmark, cfg.split, data_dir=cfg.data_dir, limit=cfg.limit)
    elif not Path(cfg.completions).is_file():
        raise FileNotFoundError(f"completions file {cfg.completions} does not exist")
    if model is None or tokenizer is None:
        model, tokenizer = load_model(cfg.model, cfg.device, cfg.dtype)
    model.eval()
    meta = make_meta(model, cfg)
    items = _completion_items(cfg, tokenizer) if cfg.completions else _benchmark_items(cfg, tokenizer, problems)
    writer = TraceWriter(cfg.out, meta, run=cfg.run_settings(), overwrite=cfg.overwrite)
    n_shards = math.ceil(len(items) / cfg.shard_size)
    res = CollectResult(Path(cfg.out))
    eos = _eos_ids(model, tokenizer)
    for s in range(n_shards):
        if writer.is_done(s):
            writer.check_done_shard(s, [it.seq_id for it in items[s * cfg.shard_size:(s + 1) * cfg.shard_size]])
    todo = [s for s in range(n_shards) if not writer.is_done(s)]
    res.shards_skipped = n_shards - len(todo)
    n_todo_items = sum(len(items[s * cfg.shard_size:(s + 1) * cfg.shard_size]) for s in todo)
    bar = tqdm(total=n_todo_items, desc="collect", unit="seq", disable=not cfg.progress, dynamic_ncols=True)
    for s in todo:
        chunk = items[s * cfg.shard_size:(s + 1) * cfg.shard_size]
        if not cfg.completions:
            if cfg.do_sample:
                torch.manual_seed(cfg.seed * 1_000_003 + s)
            t0 = time.perf_counter()
            for b in range(0, len(chunk), cfg.batch_size):
                batch = chunk[b:b + cfg.batch_size]
                comps = generate_batch(model, tokenizer, [it.prompt_ids for it in batch], cfg, eos)
                for it, c in zip(batch, comps, strict=True):
                    it.completion_ids = c
                    res.generated_tokens += len(c)
                bar.update(len(batch))  # benchmark mode: the bar follows generation, the slow pass
                bar.set_postfix_str(f"shard {s}: generating")
            res.generate_seconds += time.perf_counter() - t0
        bar.set_postfix_str(f"shard {s}: routing")
        t0 = time.perf_counter()
        full = [it.prompt_ids + list(it.completion_ids or []) for it in chunk]
        routed = route_sequences(model, full, cfg.router_probs, cfg.route_batch_tokens)
        res.route_seconds += time.perf_counter() - t0
        seqs = []
        for it, toks, (e, w, p) in zip(chunk, full, routed, strict=True):
            seqs.append(TraceSequence(it.seq_id, np.asarray(toks, dtype=np.int32), len(it.prompt_ids), e, w, p))
            res.tokens += len(toks)
            if it.gold is not None and not cfg.completions:
                from expertcast.data.grading import grade

                text = tokenizer.decode(it.completion_ids or [], skip_special_tokens=True)
                res.graded += 1
                res.correct += int(grade(cfg.benchmark, text, it.gold))
        path = writer.write_shard(s, seqs)
        res.shards_written += 1
        res.sequences += len(seqs)
        if cfg.completions:
            bar.update(len(chunk))
        if on_shard is not None:
            on_shard(s, path)
    bar.close()
    res.rows = _summary_rows(res, cfg)
    writer.finalize(collect=res.rows)
    return res


def _summary_rows(res: CollectResult, cfg: CollectConfig) -> list[dict[str, Any]]:
    rows = []
    if not cfg.completions:
        rows.append({"pass": "1 generate", "sequences": res.sequences, "tokens": res.generated_tokens,
                     "seconds": round(res.generate_seconds, 3), "tokens_per_s": round(res.generate_tokens_per_s, 1)})
    rows.append({"pass": "2 route (teacher-forced)", "sequences": res.sequences, "tokens": res.tokens,
                 "seconds": round(res.route_seconds, 3), "tokens_per_s": round(res.route_tokens_per_s, 1)})
    return rows


# -- CLI -----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expertcast collect", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="preset name, local model directory or Hub id")
    p.add_argument("--out", required=True, help="output trace directory (resumed when it exists)")
    p.add_argument("--benchmark", default="gsm8k", choices=["gsm8k", "math500"])
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=None, help="first N items only")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per generation batch")
    p.add_argument("--route-batch-tokens", type=int, default=4096, help="padded tokens per teacher-forced batch")
    p.add_argument("--shard-size", type=int, default=64, help="items per shard")
    p.add_argument("--router-probs", action="store_true", help="also store the full router distribution")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--completions", default=None, help="JSONL of completions to route (no generation)")
    p.add_argument("--text-field", default="thinking")
    p.add_argument("--prompt-field", default=None)
    p.add_argument("--completion-prefix", default="", help="text between prompt and completion (e.g. '<think>\\n')")
    p.add_argument("--max-tokens", type=int, default=4096, help="completions mode: truncate sequences to N tokens")
    p.add_argument("--data-dir", default=None, help="local benchmark directory (else $EXPERTCAST_DATA_DIR or the Hub)")
    tpl = p.add_mutually_exclusive_group()
    tpl.add_argument("--chat-template", dest="chat_template", action="store_true", default=None)
    tpl.add_argument("--no-chat-template", dest="chat_template", action="store_false")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--overwrite", action="store_true", help="delete an existing trace set in --out first")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    p.add_argument("--csv", default=None, help="also write the summary as CSV here")
    return p


def main(argv: list[str] | None = None) -> int:
    from expertcast.data.benchmarks import DatasetNotFoundError
    from expertcast.data.traces import TraceFormatError
    from expertcast.utils.io import report

    a = build_parser().parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = CollectConfig(
        model=a.model, out=a.out, benchmark=a.benchmark, split=a.split, limit=a.limit,
        max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, route_batch_tokens=a.route_batch_tokens,
        shard_size=a.shard_size, router_probs=a.router_probs, do_sample=a.sample, temperature=a.temperature,
        top_p=a.top_p, seed=a.seed, completions=a.completions, text_field=a.text_field,
        prompt_field=a.prompt_field, completion_prefix=a.completion_prefix, max_tokens=a.max_tokens,
        data_dir=a.data_dir, chat_template=a.chat_template, device=a.device, dtype=a.dtype,
        overwrite=a.overwrite, progress=not a.no_progress,
    )
    try:
        res = collect_traces(cfg)
    except (DatasetNotFoundError, TraceFormatError, FileNotFoundError, ValueError) as e:
        print(f"expertcast collect: error: {e}", file=sys.stderr)
        return 2
    title = f"collect {cfg.model} -> {cfg.out} ({res.shards_written} shards written, {res.shards_skipped} resumed)"
    rows = res.rows
    report(rows, title=title, json_path=a.json, csv_path=a.csv)
    if res.graded:
        print(f"accuracy of the generated completions: {res.correct}/{res.graded} = {res.correct / res.graded:.3f}")
    return 0
