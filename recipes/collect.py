"""Routing traces by the two-pass method (SeqMoE 5.1; docs/design.md "Routing traces").

Pass 1 generates completions for a benchmark split in batches with LEFT padding (greedy, or sampled
with a seed that depends on the shard so a resumed run makes the same samples). Pass 2 runs one
teacher-forced forward over prompt + completion with the routers observed
(:func:`expertcast.models.routing.capture_routing`); sequences are sorted by length and batched with
RIGHT padding and an attention mask, so pads only ever come after a sequence's real tokens and never
change their routing. With ``completions`` pass 1 is skipped: the text someone else wrote (e.g. the
R1 chain-of-thought traces of ``../shared/data/cot/``) is tokenized and routed.

The command that drives it (output folder, shard plan, resume, sharded ranks, summary) is
:mod:`expertcast.commands.collect`; this module holds the pieces: the settings (:class:`CollectConfig`,
:func:`run_settings`), the inputs, the two passes and the trace metadata.

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
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.data.trace_format import TraceMeta
from expertcast.utils.errors import UsageError
from expertcast.utils.io import iter_jsonl

PRESET_INIT_SEED = 0
"""Seed of the random init of tiny presets (:func:`expertcast.models.backbone.load_moe_model`)."""


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class CollectItem:
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
class CompletionRow:
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


def eos_ids(model, tok) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tok):
        e = getattr(src, "eos_token_id", None)
        if e is None:
            continue
        ids.update([e] if isinstance(e, int) else list(e))
    return ids


# -- inputs --------------------------------------------------------------------------------------------
def use_chat_template(cfg: CollectConfig, tok) -> bool:
    from expertcast.data.prompts import has_chat_template

    if cfg.chat_template and not has_chat_template(tok):
        raise UsageError(f"--chat-template: the tokenizer of {cfg.model} has no chat template")
    return has_chat_template(tok) if cfg.chat_template is None else cfg.chat_template


def _encode_prompt(tok, text: str, templated: bool) -> list[int]:
    return list(tok(text, add_special_tokens=not templated)["input_ids"])


def benchmark_items(cfg: CollectConfig, tok, problems: list, templated: bool) -> list[CollectItem]:
    from expertcast.data.prompts import build_prompt

    items = []
    for p in problems:
        text = build_prompt(tok, p.question, cfg.benchmark, use_chat_template=templated)
        items.append(CollectItem(p.id, _encode_prompt(tok, text, templated), prompt_text=text, gold=p.answer))
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


def read_completion_rows(cfg: CollectConfig) -> list[CompletionRow]:
    """The first ``limit`` rows of the completions file, validated (JSON objects, text and prompt fields
    non-empty strings, unique sequence ids); UsageError naming ``file:line``."""
    path = Path(str(cfg.completions))
    if not path.is_file():
        raise FileNotFoundError(f"completions file {path} does not exist")
    rows: list[CompletionRow] = []
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
        rows.append(CompletionRow(ln, sid, prompt, row[cfg.text_field]))
    if not rows:
        raise UsageError(f"{path} holds no completions")
    return rows


def completion_items(cfg: CollectConfig, tok, rows: list[CompletionRow], templated: bool) -> list[CollectItem]:
    items: list[CollectItem] = []
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
        items.append(CollectItem(r.seq_id, prompt_ids, completion_ids=comp[:room], prompt_text=ptext))
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


