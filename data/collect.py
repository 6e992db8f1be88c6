"""Routing traces by the two-pass method (SeqMoE 5.1; docs/design.md "Routing traces").

Pass 1 generates completions for a benchmark split in batches with LEFT padding (greedy, or sampled
with a seed that depends on the shard so a resumed run makes the same samples). Pass 2 runs one
teacher-forced forward over prompt + completion with the routers observed
(:func:`expertcast.models.routing.capture_routing`); sequences are sorted by length and batched with
RIGHT padding and an attention mask, so pads only ever come after a sequence's real tokens and never
change their routing. With ``completions`` pass 1 is skipped: the text someone else wrote (e.g. the
R1 chain-of-thought traces of ``../shared/data/cot/``) is tokenized and routed.

Shards of ``shard_size`` input items are written atomically by
:class:`expertcast.data.traces.TraceWriter` into an output folder claimed with
:func:`expertcast.utils.outdir.claim_output_dir`. Rerunning the same command resumes: only when every
setting that changes the traces matches exactly (:func:`run_settings`; the model by
:func:`expertcast.models.backbone.model_identity`).
``limit`` is the one setting a resume may change, and only upwards: shard i always holds input items
[i*S, (i+1)*S), so every full shard already written is exactly what the larger run would write (its
sequence ids and per-item input digests are checked); a partial last shard is redone; a smaller
limit is refused.

Sharded collection (``shard=(i, n)``: ``expertcast collect --shard i/n``, or torchrun's RANK/WORLD_SIZE)
splits the same shard plan over n processes: rank i writes the shards s with ``s % n == i`` into its
own part ``out/parts/rank-i-of-n/`` (a trace set of its own, with its own lock), then merges every
part no process is writing any more into ``out`` (the shard folders are moved, the manifest entries
and their sha256 kept). The rank that finishes last therefore leaves ``out`` a complete trace set,
shard for shard what one process would have written (same items, batches and sampling seeds), which
``traces stats``, ``simulate`` and ``fit`` read as usual. Ranks need no process group: they only share
the folder (a shared file system across nodes), and a rerun of any rank resumes as above.

Sequence ids are identities: a benchmark problem keeps its id; a completions row uses its ``id``
field, else ``sha256-`` + the first 16 hex digits of the sha256 of its prompt and completion text.

A trace position is every token of prompt + completion (the completion includes its end-of-sequence
token when one was generated). During real decoding the last generated token is never fed back, so
its routing is the only one here that decoding would not have observed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.data.traces import OUTPUT_KIND, TraceWriter, read_manifest, shard_name
from expertcast.utils.errors import OutputDirError, UsageError
from expertcast.utils.io import iter_jsonl
from expertcast.utils.outdir import OutputDir

PRESET_INIT_SEED = 0
"""Seed of the random init of tiny presets (:func:`expertcast.models.backbone.load_moe_model`)."""
PARTS_DIR = "parts"
"""Sub-folder of a sharded collection's output holding each rank's part until it is merged."""


@dataclass
class CollectConfig:
    """Settings of one trace collection."""

    model: str
    """Preset name (e.g. ``qwen3_moe-tiny``), local model directory or Hub id (already resolved: see
    :func:`expertcast.commands.common.resolve_model`)."""
    out: str
    """Output trace directory."""
    benchmark: str = "gsm8k"
    """A benchmark of :data:`expertcast.data.benchmarks.BENCHMARKS` (``gsm8k``, ``math500``, ``arith``);
    ignored with ``completions``."""
    split: str = "test"
    limit: int | None = None
    """Use only the first N items (benchmark problems or completion rows); None = all."""
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
    shard: tuple[int, int] | None = None
    """(rank i, ranks n): write only the shards s with s % n == i, then merge (see the module doc)."""

    def validate(self) -> None:
        """UsageError naming the first setting out of range."""
        checks = [("limit", self.limit is None or (_is_int(self.limit) and self.limit >= 1), "a positive integer"),
                  ("max_new_tokens", _is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "a positive integer"),
                  ("batch_size", _is_int(self.batch_size) and self.batch_size >= 1, "a positive integer"),
                  ("route_batch_tokens", _is_int(self.route_batch_tokens) and self.route_batch_tokens >= 1,
                   "a positive integer"),
                  ("shard_size", _is_int(self.shard_size) and self.shard_size >= 1, "a positive integer"),
                  ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "a positive integer"),
                  ("seed", _is_int(self.seed) and self.seed >= 0, "a non-negative integer"),
                  ("temperature", math.isfinite(self.temperature) and self.temperature > 0, "a finite number > 0"),
                  ("top_p", math.isfinite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]")]
        for name, ok, what in checks:
            if not ok:
                raise UsageError(f"--{name.replace('_', '-')} must be {what}, got {getattr(self, name)!r}")
        if self.shard is not None:
            i, n = self.shard
            if not (_is_int(i) and _is_int(n) and 0 <= i < n):
                raise UsageError(f"--shard must be i/n with 0 <= i < n, got {i}/{n}")
            if self.overwrite:
                raise UsageError("--overwrite cannot be combined with --shard (the ranks would delete each other's "
                                 "shards): remove the folder or choose another --out")


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class CollectResult:
    """What a collection did (this invocation; skipped shards are counted apart)."""

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
    """Given (completions mode) or generated by pass 1."""
    prompt_text: str | None = None
    gold: str | None = None
    input_sha256: str = ""
    """sha256 of the inputs, fixed at creation: id, prompt ids and the given completion ids (what
    :meth:`expertcast.data.traces.TraceWriter.reconcile` compares on resume)."""

    def __post_init__(self) -> None:
        blob = json.dumps([self.seq_id, self.prompt_ids, self.completion_ids], separators=(",", ":"))
        self.input_sha256 = hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class _Row:
    """One validated row of a completions file (read before the model loads)."""

    line: int
    seq_id: str
    prompt: str | None
    text: str


# -- model ---------------------------------------------------------------------------------------------
def load_model(name: str, device: str = "auto", dtype: str | None = None):
    """(model, tokenizer) for a preset name, local directory or Hub id
    (:func:`expertcast.models.backbone.load_moe_model`), in eval mode on ``device``."""
    from expertcast.models.backbone import load_moe_model
    from expertcast.utils.devices import resolve_device

    return load_moe_model(name, dtype=dtype or "auto", device=resolve_device(device), seed=PRESET_INIT_SEED)


def run_settings(cfg: CollectConfig, model, templated: bool) -> dict[str, Any]:
    """Everything that changes the traces (a resumed run must match it exactly), except ``limit``
    (see the module doc). Batch sizes and the device are included: on GPUs in low precision they
    change the numbers."""
    from expertcast.models.backbone import model_identity
    from expertcast.utils.provenance import sha256_file

    param = next(model.parameters())
    d: dict[str, Any] = {
        "model": model_identity(cfg.model, init_seed=PRESET_INIT_SEED, model=model), "dtype": str(param.dtype),
        "device": param.device.type,
        "shard_size": cfg.shard_size, "router_probs": cfg.router_probs, "route_batch_tokens": cfg.route_batch_tokens,
        "chat_template": templated,
    }
    if cfg.completions:
        d.update(completions_sha256=sha256_file(cfg.completions), text_field=cfg.text_field,
                 prompt_field=cfg.prompt_field, completion_prefix=cfg.completion_prefix, max_tokens=cfg.max_tokens)
    else:
        d.update(benchmark=cfg.benchmark, split=cfg.split, max_new_tokens=cfg.max_new_tokens,
                 batch_size=cfg.batch_size, do_sample=cfg.do_sample,
                 temperature=cfg.temperature if cfg.do_sample else None,
                 top_p=cfg.top_p if cfg.do_sample else None, seed=cfg.seed if cfg.do_sample else None)
    return d


def _eos_ids(model, tok) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tok):
        e = getattr(src, "eos_token_id", None)
        if e is None:
            continue
        ids.update([e] if isinstance(e, int) else list(e))
    return ids


# -- inputs --------------------------------------------------------------------------------------------
def _use_chat_template(cfg: CollectConfig, tok) -> bool:
    from expertcast.data.prompts import has_chat_template

    if cfg.chat_template and not has_chat_template(tok):
        raise UsageError(f"--chat-template: the tokenizer of {cfg.model} has no chat template")
    return has_chat_template(tok) if cfg.chat_template is None else cfg.chat_template


def _encode_prompt(tok, text: str, templated: bool) -> list[int]:
    return list(tok(text, add_special_tokens=not templated)["input_ids"])


def _benchmark_items(cfg: CollectConfig, tok, problems: list, templated: bool) -> list[_Item]:
    from expertcast.data.prompts import build_prompt

    items = []
    for p in problems:
        text = build_prompt(tok, p.question, cfg.benchmark, use_chat_template=templated)
        items.append(_Item(p.id, _encode_prompt(tok, text, templated), prompt_text=text, gold=p.answer))
    return items


def _row_id(row: dict[str, Any], prompt: str | None, text: str, where: str) -> str:
    """The row's ``id`` (a non-empty string or an integer), else a sha256 of prompt and completion."""
    if "id" in row:
        v = row["id"]
        if (_is_int(v)) or (isinstance(v, str) and v.strip()):
            return str(v)
        raise UsageError(f"{where}: field 'id' must be a non-empty string or an integer, got {json.dumps(v)}")
    digest = hashlib.sha256(json.dumps([prompt, text]).encode()).hexdigest()
    return f"sha256-{digest[:16]}"


def read_completion_rows(cfg: CollectConfig) -> list[_Row]:
    """The first ``limit`` rows of the completions file, validated (JSON objects, text and prompt fields
    non-empty strings, unique sequence ids); UsageError naming ``file:line``."""
    path = Path(str(cfg.completions))
    if not path.is_file():
        raise FileNotFoundError(f"completions file {path} does not exist")
    rows: list[_Row] = []
    seen: dict[str, int] = {}
    for ln, row in iter_jsonl(path, limit=cfg.limit):
        where = f"{path}:{ln}"
        if not isinstance(row, dict):
            raise UsageError(f"{where}: expected a JSON object")
        fields = [cfg.text_field] + ([cfg.prompt_field] if cfg.prompt_field else [])
        for name in fields:
            if name not in row:
                raise UsageError(f"{where}: no field {name!r} (fields: {', '.join(row)})")
            if not isinstance(row[name], str) or not row[name].strip():
                raise UsageError(f"{where}: field {name!r} must be a non-empty string")
        prompt = row[cfg.prompt_field] if cfg.prompt_field else None
        sid = _row_id(row, prompt, row[cfg.text_field], where)
        if sid in seen:
            raise UsageError(f"{where}: sequence id {sid!r} repeats line {seen[sid]} (ids must be unique)")
        seen[sid] = ln
        rows.append(_Row(ln, sid, prompt, row[cfg.text_field]))
    if not rows:
        raise UsageError(f"{path} holds no completions")
    return rows


def _completion_items(cfg: CollectConfig, tok, rows: list[_Row], templated: bool) -> list[_Item]:
    items: list[_Item] = []
    skipped = []
    for r in rows:
        prompt_ids: list[int] = []
        ptext = r.prompt
        if ptext is not None:
            if templated:
                ptext = tok.apply_chat_template([{"role": "user", "content": ptext}], tokenize=False,
                                                add_generation_prompt=True)
            prompt_ids = _encode_prompt(tok, ptext, templated)
        text = cfg.completion_prefix + r.text
        comp = list(tok(text, add_special_tokens=not prompt_ids, verbose=False)["input_ids"])
        room = cfg.max_tokens - len(prompt_ids)
        if room < 1:
            skipped.append(r.line)
            continue
        items.append(_Item(r.seq_id, prompt_ids, completion_ids=comp[:room], prompt_text=ptext))
    if skipped:
        warnings.warn(f"{len(skipped)} rows of {cfg.completions} skipped (lines {', '.join(map(str, skipped[:5]))}"
                      f"{' ...' if len(skipped) > 5 else ''}): their prompt alone exceeds --max-tokens {cfg.max_tokens}",
                      stacklevel=2)
    if not items:
        raise UsageError(f"{cfg.completions}: no usable completion (every prompt exceeds --max-tokens {cfg.max_tokens})")
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
def make_meta(model, cfg: CollectConfig, templated: bool | None = None) -> TraceMeta:
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
               "chat_template": cfg.chat_template if templated is None else templated}
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
            res.rows = _summary_rows(res, cfg)
            if todo or not writer.manifest.get("complete"):  # a finished run keeps its summary
                writer.finalize(collect=res.rows, limit=cfg.limit, sequences=len(items))
    return res


def _plan(cfg: CollectConfig, tok, rows: list[_Row] | None, problems: list | None
          ) -> tuple[bool, list[_Item], list[list[_Item]]]:
    """(chat template used, input items, shard plan): shard i holds items [i*S, (i+1)*S)."""
    templated = _use_chat_template(cfg, tok)
    items = (_completion_items(cfg, tok, rows, templated) if rows is not None
             else _benchmark_items(cfg, tok, problems, templated))
    return templated, items, [items[s:s + cfg.shard_size] for s in range(0, len(items), cfg.shard_size)]


def _plan_keys(plan: list[list[_Item]]) -> list[list[tuple[str, str]]]:
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


def _collect_rank(cfg: CollectConfig, rows: list[_Row] | None, problems: list | None, model, tok,
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


def _run_shards(cfg: CollectConfig, model, tok, writer: TraceWriter, plan: list[list[_Item]], todo: list[int],
                res: CollectResult, on_shard: Callable[[int, Path], None] | None) -> None:
    """Generate (benchmark mode), route and write the shards ``todo`` of ``plan``, counting into ``res``."""
    from tqdm.auto import tqdm

    eos = _eos_ids(model, tok)
    bar = tqdm(total=sum(len(plan[s]) for s in todo), desc="collect", unit="seq", disable=not cfg.progress,
               dynamic_ncols=True)
    for s in todo:
        chunk = plan[s]
        if not cfg.completions:
            _generate_shard(cfg, model, tok, chunk, s, eos, res, bar)
        bar.set_postfix_str(f"shard {s}: routing")
        t0 = time.perf_counter()
        full = [it.prompt_ids + list(it.completion_ids or []) for it in chunk]
        routed = route_sequences(model, full, cfg.router_probs, cfg.route_batch_tokens)
        res.route_seconds += time.perf_counter() - t0
        seqs = [TraceSequence(it.seq_id, np.asarray(toks, dtype=np.int32), len(it.prompt_ids), e, w, p)
                for it, toks, (e, w, p) in zip(chunk, full, routed, strict=True)]
        res.tokens += sum(len(t) for t in full)
        _grade(cfg, tok, chunk, res)
        path = writer.write_shard(s, seqs, inputs=[it.input_sha256 for it in chunk])
        res.shards_written += 1
        res.sequences += len(seqs)
        if cfg.completions:
            bar.update(len(chunk))
        if on_shard is not None:
            on_shard(s, path)
    bar.close()


def _generate_shard(cfg: CollectConfig, model, tok, chunk: list[_Item], shard: int, eos: set[int],
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


def _grade(cfg: CollectConfig, tok, chunk: list[_Item], res: CollectResult) -> None:
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
