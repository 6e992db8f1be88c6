"""The embedded default model's recipe: a tiny Qwen3-MoE and its byte-level BPE tokenizer, trained here.

The model is shipped in the repository (``models/shipped/tiny-default``, :func:`ship_default_model`); every
``--model tiny-default`` resolves to those files once their checksums are verified
(:func:`expertcast.models.names.shipped_default_model`) and never trains. ``expertcast build-default [--force]``
(:func:`ensure_default_model`) rebuilds it into the cache and says whether the rebuild is identical to the shipped
files; ``--ship`` replaces them. The recipe trains on GSM8K train solutions (as chat: question -> answer), the R1
chain-of-thought traces of ``cot/math153.jsonl`` (wrapped in ``<think>...</think>``) and the ``train`` split of the
synthetic arithmetic task, prompted as ``expertcast eval --benchmark arith`` prompts
(:mod:`~expertcast.recipes.tiny_default_corpus`), so that its routers behave like a trained model's and it answers
held-out ``arith`` problems well above chance (GSM8K stays at 0% for a model this size).

Reproducible: the recipe (:class:`TinyDefaultConfig`) fixes the optimizer steps, the seed and the torch threads;
the data order is drawn from the seed, so two builds of one recipe on one software stack give identical weights.
The cache key (:meth:`TinyDefaultConfig.key`) hashes the whole recipe, the sha256 of every data file and of the
generated arithmetic problems, and the code format (``RECIPE_VERSION``).

The result is saved in Hugging Face format under ``cache_dir()/tiny-default-v1/<key>``, written to a temporary
directory and renamed into place, with ``report.json`` (recipe, data hashes, the loss every ``LOSS_LOG_EVERY``
steps, training time, held-out GSM8K-test perplexity, greedy ``arith`` test accuracy, per-layer expert load balance
against the untrained init) and ``train_loss.png``. A changed recipe gets a new key; an unchanged one is reused. A
file lock makes concurrent callers wait for one build; an interrupted build resumes from its last checkpoint (every
``checkpoint_every_s``) and ends with the same weights. Plain PyTorch loop (no Lightning): AdamW, linear warm-up
then cosine decay over ``max_steps``, plus the config's load-balancing auxiliary loss.

A recipe (docs/design.md "Embedded default model", "Layout"): only ``expertcast build-default``
(:mod:`expertcast.commands.build_default`) and ``quickstart`` import it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.recipes.tiny_default_corpus import (
    PackedStream,
    arith_hash,
    arith_messages,
    arith_train_problems,
    cot_messages,
    data_hashes,
    data_rows,
    gsm8k_messages,
    recipe_files,
    tokenize_docs,
)
from expertcast.recipes.tiny_default_eval import heldout_arith_accuracy, routing_report
from expertcast.utils.errors import UsageError
from expertcast.utils.io import atomic_write_json, replace_dir
from expertcast.utils.locks import FileLock
from expertcast.utils.paths import cache_dir, display_path
from expertcast.utils.provenance import sha256_file

DEFAULT_NAME = "tiny-default-v1"
REPORT_FILE = "report.json"
RECIPE_VERSION = 6
"""Code format of the build (part of the cache key): 2 = a fixed number of steps on fixed threads;
3 = deterministic algorithms; 4 = the arithmetic task in the corpus; 5 = the tokenizer splits digits one
by one (recipe 4 scored 0% on arith: its BPE merged 2-3 digit numbers into single tokens); 6 = arith
solutions state their sum first, and the recipe trains 3000 steps at a quarter of the learning rate on twice
the arith chats (recipe 5 scored 0%: at lr 4e-3 the model never learned to copy a digit)."""
LOSS_LOG_EVERY = 10
"""``report.json`` records the training loss at step 1 and every this many steps."""
MAX_STEPS = 3000
"""Optimizer steps of the default recipe: about 23-32 minutes of training on 2 cores (0.45 s/step on an
idle 2-core machine, 0.64 s/step under load). Fewer steps do not teach arithmetic: see
``docs/design.md``, "Arithmetic in the corpus", for the measured accuracy against steps and learning rate."""


@dataclass
class TinyDefaultConfig:
    """Recipe of the embedded default model (every field is part of the cache key)."""

    # --- tokenizer
    vocab_size: int = 4096
    """Byte-level BPE vocabulary (control tokens + bytes + merges + ``<think>``/``</think>``)."""

    # --- model (transformers Qwen3MoeConfig)
    num_layers: int = 4
    """Decoder layers; every one is an MoE layer."""
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    moe_intermediate_size: int = 128
    """Intermediate size of one routed expert's SwiGLU MLP."""
    num_experts: int = 32
    top_k: int = 4
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    """Weight of the load-balancing auxiliary loss (Switch-style), added to the LM loss."""
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    # --- data
    seq_len: int = 512
    """Tokens per packed training block."""
    gsm8k_train_limit: int | None = None
    """Use only the first N GSM8K train rows (None: all 7473)."""
    cot_limit: int | None = None
    """Use only the first N math153 chain-of-thought traces (None: all 153)."""
    strip_calculator_notes: bool = True
    """Remove GSM8K's ``<<48/2=24>>`` calculator annotations from the solutions."""
    arith_train: int = 24000
    """The first N problems of the ``arith`` train split, as chats in the corpus (0: none)."""

    # --- optimisation
    batch_size: int = 4
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr`` (end of the cosine)."""
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    max_steps: int = MAX_STEPS
    """Optimizer steps: fixed, so every machine trains the same model (about 25 minutes on 2 cores)."""
    threads: int = 2
    """torch intra-op threads of the build. CPU kernels split their reductions by thread, so the thread
    count is part of the recipe: the same recipe on another count would give other weights."""
    seed: int = 0
    """Seed of the initialisation and of the data order."""

    # --- evaluation
    eval_gsm8k_test: int = 200
    """GSM8K test solutions for the held-out perplexity and routing statistics."""
    eval_cot: int = 8
    """Held-out chain-of-thought traces (cot/labeled40.jsonl) for the routing statistics."""
    eval_max_len: int = 1024
    """Truncate held-out sequences to this many tokens."""
    eval_arith: int = 200
    """Held-out ``arith`` test problems for the greedy accuracy in the report (0: none)."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "threads", "batch_size", "seq_len", "num_layers", "num_experts", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UsageError(f"tiny-default recipe: {name} must be a positive integer, got {v!r}")
        for name in ("arith_train", "eval_arith"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UsageError(f"tiny-default recipe: {name} must be a non-negative integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise UsageError(f"tiny-default recipe: top_k {self.top_k} exceeds num_experts {self.num_experts}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> TinyDefaultConfig:
        """Recipe from a YAML mapping of field names (unknown keys are an error)."""
        import yaml

        with open(path, encoding="utf-8") as f:
            try:
                d = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise UsageError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
        if not isinstance(d, dict):
            raise UsageError(f"{path}: expected a mapping of TinyDefaultConfig fields")
        if "time_budget_s" in d:
            raise UsageError(f"{path}: time_budget_s was removed: the default model trains a fixed number of "
                             f"optimizer steps (max_steps) so that every machine builds the same weights")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UsageError(f"{path}: unknown TinyDefaultConfig fields {unknown}")
        return cls(**d)

    def recipe_hash(self) -> str:
        """Hash of what the code trains, data files aside: every field, ``RECIPE_VERSION`` and the sha256 of
        the generated arithmetic problems. The shipped model's report records it, and a test checks it
        against the code's default recipe (a recipe change without a rebuild fails CI)."""
        payload = {"recipe_version": RECIPE_VERSION, "config": self.to_dict(), "arith": arith_hash(self.arith_train)}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def key(self, data_files: dict[str, Path]) -> str:
        """Cache key: a hash of the whole recipe (every field: sizes, data limits, optimisation,
        ``max_steps``, ``seed``, ``threads``), the code format ``RECIPE_VERSION``, the sha256 of
        every data file the build reads and of the generated arithmetic training problems."""
        payload = {"recipe_version": RECIPE_VERSION, "config": self.to_dict(), "data": data_hashes(data_files),
                   "arith": arith_hash(self.arith_train)}
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class _Corpus:
    train_chats: list[str]
    tokenizer_texts: list[str]
    eval_gsm8k: list[dict[str, Any]]
    eval_cot: list[dict[str, Any]]
    n_gsm8k: int
    n_cot: int
    n_arith: int


def _load_corpus(cfg: TinyDefaultConfig, files: dict[str, Path]) -> _Corpus:
    gsm = data_rows(files["gsm8k_train"], cfg.gsm8k_train_limit)
    cot = data_rows(files["cot_train"], cfg.cot_limit)
    arith = arith_train_problems(cfg.arith_train)
    chats = ([gsm8k_messages(r, cfg.strip_calculator_notes) for r in gsm] + [cot_messages(r) for r in cot]
             + [arith_messages(p) for p in arith])
    tok_texts = [m["content"] for c in chats for m in c]
    return _Corpus(
        train_chats=chats,  # type: ignore[arg-type]
        tokenizer_texts=tok_texts,
        eval_gsm8k=data_rows(files["gsm8k_test"], cfg.eval_gsm8k_test) if cfg.eval_gsm8k_test else [],
        eval_cot=data_rows(files["cot_heldout"], cfg.eval_cot) if cfg.eval_cot else [],
        n_gsm8k=len(gsm),
        n_cot=len(cot),
        n_arith=len(arith),
    )


# ---------------------------------------------------------------------------------------- model


def model_config(cfg: TinyDefaultConfig, tokenizer):
    """The transformers ``Qwen3MoeConfig`` of the recipe."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=4 * cfg.hidden_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        output_router_logits=False,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def _lr_at(cfg: TinyDefaultConfig, step: int) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from ``lr`` to ``min_lr_ratio * lr`` as
    ``step / max_steps`` goes 0 -> 1."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    p = min(1.0, max(0.0, step / cfg.max_steps))
    cos = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return cfg.lr * warm * cos


# ----------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_perplexity(model, tokenizer, rows: list[dict[str, Any]], cfg: TinyDefaultConfig,
                       batch_size: int = 16) -> dict[str, float]:
    """Perplexity of GSM8K solutions given their question: exp of the mean NLL over the answer
    tokens (the assistant turn including ``<|im_end|>``), teacher-forced after the chat prompt."""
    model.eval()
    seqs: list[tuple[list[int], int]] = []
    for r in rows:
        msgs = gsm8k_messages(r, cfg.strip_calculator_notes)
        prompt = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(msgs, tokenize=False)
        if not full.startswith(prompt):
            raise RuntimeError("chat template: the prompt is not a prefix of the full conversation")
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = p_ids + tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
        ids = ids[: cfg.eval_max_len]
        seqs.append((ids, len(p_ids)))
    nll, count = 0.0, 0
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        T = max(len(s) for s, _ in chunk)
        ids = torch.full((len(chunk), T), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), T), dtype=torch.long)
        tgt_mask = torch.zeros((len(chunk), T), dtype=torch.bool)
        for j, (s, p) in enumerate(chunk):
            ids[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = 1
            tgt_mask[j, p : len(s)] = True
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        tok_lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = tgt_mask[:, 1:]
        nll -= float(tok_lp[m].sum())
        count += int(m.sum())
    return {"perplexity": math.exp(nll / max(1, count)), "nll": nll / max(1, count), "tokens": count,
            "sequences": len(seqs)}


def _heldout_token_seqs(tokenizer, corpus: _Corpus, cfg: TinyDefaultConfig) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    if corpus.eval_gsm8k:
        chats = [gsm8k_messages(r, cfg.strip_calculator_notes) for r in corpus.eval_gsm8k]
        out["gsm8k_test"] = [d[: cfg.eval_max_len].tolist() for d in tokenize_docs(tokenizer, chats)]
    if corpus.eval_cot:
        chats = [cot_messages(r) for r in corpus.eval_cot]
        out["cot_heldout"] = [d[: cfg.eval_max_len].tolist() for d in tokenize_docs(tokenizer, chats)]
    return out


# ------------------------------------------------------------------------------------- training


def _save_checkpoint(path: Path, model, opt, stream: PackedStream, state: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "ckpt.pt.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "stream": stream.state(),
                "state": state}, tmp)
    os.replace(tmp, path / "ckpt.pt")


def _train(cfg: TinyDefaultConfig, model, stream: PackedStream, work: Path, progress: bool,
           checkpoint_every_s: float) -> dict[str, Any]:
    """``cfg.max_steps`` AdamW steps on ``stream`` (resumed from ``work/ckpt.pt`` when present).

    Returns the training state: step, tokens, elapsed_s (wall clock, informative only), loss_history
    (``[step, elapsed_s, lm_loss, aux_loss]`` at step 1 and every ``LOSS_LOG_EVERY`` steps), loss_ema.
    """
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n],
          "weight_decay": cfg.weight_decay},
         {"params": [p for n, p in model.named_parameters() if p.ndim < 2 or "norm" in n], "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=False)
    state: dict[str, Any] = {"step": 0, "elapsed_s": 0.0, "tokens": 0, "loss_history": [], "resumed": 0,
                             "loss_ema": None}
    ckpt = work / "ckpt.pt"
    if ckpt.is_file():
        # Our own checkpoint of an interrupted build (written below, in our cache dir).
        blob = torch.load(ckpt, weights_only=True)
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["opt"])
        stream.restore(blob["stream"])
        state = blob["state"]
        state["resumed"] = int(state.get("resumed", 0)) + 1
        print(f"build-default: resuming at step {state['step']} of {cfg.max_steps}")
    model.train()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=state["step"], unit="step", desc="build-default (train)",
                   dynamic_ncols=True, mininterval=1.0)
    start = time.perf_counter() - state["elapsed_s"]
    last_ckpt = time.perf_counter()
    aux_coef = cfg.router_aux_loss_coef
    while state["step"] < cfg.max_steps:
        lr = _lr_at(cfg, state["step"])
        for g in opt.param_groups:
            g["lr"] = lr
        x = stream.next_batch()
        out = model(input_ids=x, labels=x, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = float(out.aux_loss.detach()) if out.aux_loss is not None else 0.0
        lm = float(out.loss.detach()) - aux_coef * aux
        if not math.isfinite(lm):
            raise FloatingPointError(f"build-default: loss is {lm} at step {state['step']} (lr {lr:.2e})")
        state["step"] += 1
        state["tokens"] += x.numel()
        ema = state["loss_ema"]
        state["loss_ema"] = lm if ema is None else 0.95 * ema + 0.05 * lm
        now = time.perf_counter()
        state["elapsed_s"] = now - start
        if state["step"] % LOSS_LOG_EVERY == 0 or state["step"] == 1:
            state["loss_history"].append([state["step"], round(state["elapsed_s"], 2), round(lm, 4), round(aux, 4)])
        if bar is not None:
            bar.set_postfix(loss=f"{state['loss_ema']:.3f}", aux=f"{aux:.3f}",
                            tok_s=f"{state['tokens'] / max(state['elapsed_s'], 1e-9):.0f}", refresh=False)
            bar.update(1)
        if checkpoint_every_s > 0 and now - last_ckpt >= checkpoint_every_s and state["step"] < cfg.max_steps:
            _save_checkpoint(work, model, opt, stream, state)
            last_ckpt = now
    if bar is not None:
        bar.close()
    model.eval()
    return state


def _plot_loss(history: list[list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    h = np.asarray(history, dtype=float)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(h[:, 0], h[:, 2], label="LM loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("tiny-default training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------- public API


def default_model_dir(cfg: TinyDefaultConfig | None = None, data_root: str | os.PathLike | None = None) -> Path:
    """Where the model of recipe ``cfg`` is (or will be) cached: ``cache_dir()/tiny-default-v1/<key>``."""
    cfg = cfg or TinyDefaultConfig()
    return cache_dir() / DEFAULT_NAME / cfg.key(recipe_files(Path(data_root) if data_root else None))


def _is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json", REPORT_FILE))


def ensure_default_model(cfg: TinyDefaultConfig | None = None, *, force: bool = False, progress: bool = True,
                         data_root: str | os.PathLike | None = None, checkpoint_every_s: float = 60.0) -> Path:
    """Path of the built default model of recipe ``cfg`` in the cache (a Hugging Face directory: config,
    safetensors weights, tokenizer with chat template, ``report.json``). Trains it on the first call (or
    when ``force``), reuses the cached one afterwards. Only ``expertcast build-default`` calls it:
    ``tiny-default`` names the shipped model (:func:`expertcast.models.names.shipped_default_model`)."""
    cfg = cfg or TinyDefaultConfig()
    files = recipe_files(Path(data_root) if data_root else None)
    key = cfg.key(files)
    final = cache_dir() / DEFAULT_NAME / key
    if _is_complete(final) and not force:
        return final
    waiting = f"build-default: another process is building {key}; waiting for it"
    with FileLock(final.parent / f"{key}.lock", on_wait=lambda: print(waiting)):
        if _is_complete(final) and not force:  # built by the process we waited for
            return final
        if final.exists() and not _is_complete(final) and not force:
            raise UsageError(f"cached default model at {final} is incomplete (missing files); "
                             f"rebuild it with `expertcast build-default --force`")
        build_default_model(cfg, final, files=files, progress=progress, checkpoint_every_s=checkpoint_every_s)
    return final


def build_default_model(cfg: TinyDefaultConfig, out_dir: Path, *, files: dict[str, Path] | None = None,
                        progress: bool = True, checkpoint_every_s: float = 60.0) -> dict[str, Any]:
    """Train tokenizer and model of recipe ``cfg`` and save them atomically into ``out_dir``
    (replacing it). Returns the report (also written to ``out_dir/report.json``)."""
    files = files or recipe_files()
    out_dir = Path(out_dir)
    work = out_dir.parent / f".{out_dir.name}.partial"  # checkpoints survive an interruption here
    work.mkdir(parents=True, exist_ok=True)
    prev_threads = torch.get_num_threads()
    prev_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(cfg.threads)
    # With more than one thread, CPU index_add_ (the experts' scatter of their outputs) accumulates in a
    # thread-dependent order unless deterministic algorithms are on: two builds then drift apart after ~20
    # steps (measured: identical loss to step 20, different weights at step 40, in separate processes).
    torch.use_deterministic_algorithms(True)
    t_all = time.perf_counter()
    try:
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        from expertcast.models.tokenizer import train_bpe_tokenizer

        corpus = _load_corpus(cfg, files)
        t0 = time.perf_counter()
        tokenizer = train_bpe_tokenizer(corpus.tokenizer_texts, cfg.vocab_size,
                                        model_max_length=cfg.max_position_embeddings)
        tok_time = time.perf_counter() - t0
        docs = tokenize_docs(tokenizer, corpus.train_chats)
        stream = PackedStream(docs, cfg.seq_len, cfg.batch_size, cfg.seed)

        from expertcast.models.presets import build_from_config

        mcfg = model_config(cfg, tokenizer)
        init_model = build_from_config(mcfg, seed=cfg.seed)
        model = build_from_config(mcfg, seed=cfg.seed)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"build-default: {n_params / 1e6:.2f}M parameters, {cfg.num_layers} MoE layers x "
              f"{cfg.num_experts} experts (top-{cfg.top_k}), vocab {len(tokenizer)}; corpus "
              f"{stream.total_tokens} tokens ({corpus.n_gsm8k} GSM8K + {corpus.n_cot} CoT + {corpus.n_arith} "
              f"arith chats); "
              f"{cfg.max_steps} steps on {cfg.threads} threads")
        state = _train(cfg, model, stream, work, progress, checkpoint_every_s)

        t_eval = time.perf_counter()
        ppl = heldout_perplexity(model, tokenizer, corpus.eval_gsm8k, cfg) if corpus.eval_gsm8k else None
        ppl_init = heldout_perplexity(init_model, tokenizer, corpus.eval_gsm8k, cfg) if corpus.eval_gsm8k else None
        arith = heldout_arith_accuracy(model, tokenizer, cfg.eval_arith) if cfg.eval_arith else None
        seqs = _heldout_token_seqs(tokenizer, corpus, cfg)
        routing = routing_report(model, seqs, cfg.num_experts) if seqs else {}
        routing_init = routing_report(init_model, seqs, cfg.num_experts) if seqs else {}
        eval_time = time.perf_counter() - t_eval

        from expertcast.models.spec import MoESpec

        spec = MoESpec.from_model(model)
        report = {
            "name": DEFAULT_NAME,
            "key": cfg.key(files),
            "recipe_hash": cfg.recipe_hash(),
            "recipe": cfg.to_dict(),
            "recipe_version": RECIPE_VERSION,
            "data_files": {k: display_path(p) for k, p in files.items()},  # no machine's folders in a shipped file
            "data_sha256": data_hashes(files),
            "spec": spec.to_dict(),
            "parameters": n_params,
            "threads": cfg.threads,
            "corpus_tokens": stream.total_tokens,
            "corpus_chats": {"gsm8k_train": corpus.n_gsm8k, "cot_math153": corpus.n_cot, "arith_train": corpus.n_arith},
            "arith_sha256": arith_hash(cfg.arith_train),
            "epochs": stream.epoch + (stream._pos * cfg.seq_len) / max(1, stream.total_tokens),
            "tokenizer_train_s": tok_time,
            "train_time_s": state["elapsed_s"],
            "steps": state["step"],
            "tokens_seen": state["tokens"],
            "tokens_per_s": state["tokens"] / max(state["elapsed_s"], 1e-9),
            "step_time_s": state["elapsed_s"] / max(state["step"], 1),
            "final_train_loss_ema": state.get("loss_ema"),
            "resumed": state.get("resumed", 0),
            "heldout_gsm8k_test": ppl,
            "heldout_gsm8k_test_init": ppl_init,
            "heldout_arith_test": arith,
            "routing": routing,
            "routing_init": routing_init,
            "uniform_overlap": cfg.top_k / cfg.num_experts,
            "eval_time_s": eval_time,
            "total_time_s": None,
            "loss_log_every": LOSS_LOG_EVERY,
            "loss_history": state["loss_history"],
            "torch": torch.__version__,
        }

        import transformers

        report["transformers"] = transformers.__version__
        # Write everything into a temporary directory, then rename it into place.
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        model.config.architectures = ["Qwen3MoeForCausalLM"]
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _plot_loss(state["loss_history"], tmp / "train_loss.png")
        report["total_time_s"] = time.perf_counter() - t_all
        atomic_write_json(tmp / REPORT_FILE, report)
        replace_dir(tmp, out_dir)
        shutil.rmtree(work, ignore_errors=True)
        return report
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_deterministic)


SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "train_loss.png")
"""What a build ships (those of them it has): the model, its tokenizer, and the loss curve; plus ``report.json``."""


def ship_default_model(build: str | os.PathLike, dest: str | os.PathLike | None = None) -> Path:
    """Copy the build in ``build`` into the shipped folder (``dest``, default
    :data:`expertcast.models.names.SHIPPED_DEFAULT_DIR`), its report extended with ``shipped_files`` (the sha256
    and size of every file copied); written beside ``dest`` and renamed into place."""
    from expertcast.models.names import SHIPPED_DEFAULT_DIR

    build = Path(build)
    if not _is_complete(build):
        raise UsageError(f"{build} is not a complete default-model build (config, weights, tokenizer, report)")
    dest = Path(dest) if dest is not None else SHIPPED_DEFAULT_DIR
    report = load_report(build)
    if "recipe_hash" not in report:  # a build by code that predates the field: the hash of its recorded recipe
        if report.get("recipe_version") != RECIPE_VERSION:
            raise UsageError(f"{build} was built by recipe format {report.get('recipe_version')}, this code is "
                             f"{RECIPE_VERSION}: rebuild it with `expertcast build-default --force`")
        report["recipe_hash"] = TinyDefaultConfig(**report["recipe"]).recipe_hash()
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    listed = {}
    for name in SHIPPED_FILES:
        if (build / name).is_file():
            shutil.copyfile(build / name, tmp / name)
            listed[name] = {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
    report["shipped_files"] = listed
    atomic_write_json(tmp / REPORT_FILE, report)
    replace_dir(tmp, dest)
    return dest


def load_report(path: str | os.PathLike) -> dict[str, Any]:
    """The ``report.json`` of a built default model directory."""
    return json.loads((Path(path) / REPORT_FILE).read_text())


__all__ = [
    "TinyDefaultConfig", "ensure_default_model", "default_model_dir", "build_default_model", "load_report",
    "ship_default_model", "SHIPPED_FILES",
    "model_config", "heldout_perplexity",
]
