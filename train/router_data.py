"""LM data for cache-aware router adaptation (DESIGN.md data flow: "LM text -> joint router adaptation").

Default: GSM8K train solutions, chat-formatted (the question as the user turn, through
:func:`expertcast.data.prompts.build_prompt`, the gold worked solution as the assistant turn). Any
``datasets`` text source works by config: a Hub id (``source="wikitext"``, ``dataset_config``,
``text_field``) or a local ``.json``/``.jsonl``/``.parquet``/``.txt`` file. A deterministic held-out
split (``heldout``: a count or a fraction) feeds validation and ``expertcast router-eval``.

Each example is ``(prompt_ids, completion_ids)``; the LM loss covers the completion tokens only
(the whole text for plain text sources, whose prompt is empty). Batches (right-padded):
``input_ids`` int64 [B, T], ``attention_mask`` int64 [B, T], ``labels`` int64 [B, T] (-100 on the
prompt and padding), ``prompt_len`` int64 [B].
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as pl
import torch
from torch.utils.data import DataLoader


@dataclass
class LMExample:
    """One tokenised text: ``prompt_ids`` (not trained on) then ``completion_ids``."""

    prompt_ids: list[int]
    completion_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def _eos_text(tokenizer: Any) -> str:
    """End-of-turn text appended to completions (ChatML ``<|im_end|>`` or the tokenizer's EOS)."""
    eos = getattr(tokenizer, "eos_token", None)
    return eos or ""


def load_texts(source: str, split: str = "train", *, text_field: str | None = None,
               dataset_config: str | None = None, chat_format: bool = True, tokenizer: Any = None,
               data_dir: str | None = None, limit: int | None = None) -> list[tuple[str, str]]:
    """(prompt, completion) text pairs of ``source``.

    ``gsm8k``/``math500``: chat-formatted question + gold solution (plain "Question/Answer" format
    when ``chat_format`` is False or the tokenizer has no chat template). Anything else is loaded
    with ``datasets``; each row's ``text_field`` (default ``text``) becomes a completion with an
    empty prompt. Raises FileNotFoundError / ValueError naming the problem.
    """
    if source in ("gsm8k", "math500"):
        from expertcast.data.benchmarks import load_benchmark
        from expertcast.data.prompts import build_prompt

        problems = load_benchmark(source, split, data_dir=data_dir, limit=limit)
        eos = _eos_text(tokenizer)
        return [
            (build_prompt(tokenizer, p.question, source, use_chat_template=None if chat_format else False),
             " " + p.solution.strip() + eos if not chat_format else p.solution.strip() + eos)
            for p in problems
        ]
    import datasets

    field = text_field or "text"
    path = Path(source)
    try:
        if path.suffix in (".json", ".jsonl", ".parquet", ".txt", ".csv"):
            if not path.is_file():
                raise FileNotFoundError(f"LM text source {source} not found")
            kind = {".jsonl": "json", ".txt": "text"}.get(path.suffix, path.suffix[1:])
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(source, dataset_config, split=split)
    except FileNotFoundError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FileNotFoundError(f"LM text source {source!r} (split {split!r}) could not be loaded: {first}") from None
    if field not in ds.column_names:
        raise ValueError(f"LM text source {source!r} has no field {field!r}; fields: {ds.column_names}")
    rows = [r for r in ds[field] if isinstance(r, str) and r.strip()]
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise ValueError(f"LM text source {source!r} holds no non-empty {field!r} rows")
    return [("", r) for r in rows]


def tokenize_pairs(tokenizer: Any, pairs: list[tuple[str, str]], max_length: int) -> list[LMExample]:
    """Tokenise (prompt, completion) pairs without special tokens, truncated to ``max_length``
    tokens in all (the prompt keeps at most ``max_length - 1``); empty completions are dropped."""
    out = []
    for prompt, completion in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        c = tokenizer(completion, add_special_tokens=False)["input_ids"]
        p = p[: max_length - 1]
        c = c[: max_length - len(p)]
        if c:
            out.append(LMExample(list(p), list(c)))
    return out


def split_heldout(n: int, heldout: float | int, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train, held-out) index lists; ``heldout`` < 1 is a fraction, else a count."""
    k = int(round(heldout * n)) if heldout < 1 else int(heldout)
    if not 0 < k < n:
        raise ValueError(f"held-out split of {heldout} leaves no train or no held-out example out of {n}")
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    return sorted(idx[k:]), sorted(idx[:k])


def collate(examples: list[LMExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch (module docstring)."""
    T = max(len(e.ids) for e in examples)
    B = len(examples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    am = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    plen = torch.zeros(B, dtype=torch.long)
    for i, e in enumerate(examples):
        x = e.ids
        ids[i, : len(x)] = torch.tensor(x)
        am[i, : len(x)] = 1
        labels[i, len(e.prompt_ids) : len(x)] = torch.tensor(e.completion_ids)
        plen[i] = len(e.prompt_ids)
    return {"input_ids": ids, "attention_mask": am, "labels": labels, "prompt_len": plen}


class RouterLMDataModule(pl.LightningDataModule):
    """GSM8K (default) or any `datasets` text as LM batches with a held-out split.

    The tokenizer is the training module's (``trainer.lightning_module.tokenizer``) unless
    ``tokenizer`` (a local directory) is given.
    """

    def __init__(self, source: str = "gsm8k", split: str = "train", text_field: str | None = None,
                 dataset_config: str | None = None, chat_format: bool = True, max_length: int = 256,
                 batch_size: int = 8, heldout: float = 64, limit: int | None = None, seed: int = 0,
                 num_workers: int = 0, data_dir: str | None = None, tokenizer: str | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.train_set: list[LMExample] = []
        self.heldout_set: list[LMExample] = []
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.hparams.tokenizer:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.hparams.tokenizer, trust_remote_code=False)
            elif self.trainer is not None and getattr(self.trainer.lightning_module, "tokenizer", None) is not None:
                self._tokenizer = self.trainer.lightning_module.tokenizer
            else:
                raise ValueError("RouterLMDataModule needs a tokenizer: pass tokenizer=<dir> or attach it to a "
                                 "trainer whose module has one")
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tok) -> None:
        self._tokenizer = tok

    def setup(self, stage: str | None = None) -> None:
        if self.train_set:
            return
        hp = self.hparams
        pairs = load_texts(hp.source, hp.split, text_field=hp.text_field, dataset_config=hp.dataset_config,
                           chat_format=hp.chat_format, tokenizer=self.tokenizer, data_dir=hp.data_dir,
                           limit=hp.limit)
        examples = tokenize_pairs(self.tokenizer, pairs, hp.max_length)
        tr, ho = split_heldout(len(examples), hp.heldout, hp.seed)
        self.train_set = [examples[i] for i in tr]
        self.heldout_set = [examples[i] for i in ho]

    @property
    def pad_id(self) -> int:
        pid = getattr(self.tokenizer, "pad_token_id", None)
        return int(pid) if pid is not None else 0

    def _loader(self, data: list[LMExample], shuffle: bool) -> DataLoader:
        pad = self.pad_id
        # the shuffle has its own generator seeded by ``seed``: every training mode sees the same batches
        # in the same order, whatever the global RNG went through before (building the auxiliary routers
        # draws from it), so LM-loss differences between modes are not data-order noise
        gen = torch.Generator().manual_seed(int(self.hparams.seed)) if shuffle else None
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=shuffle, generator=gen,
                          num_workers=self.hparams.num_workers, collate_fn=lambda b: collate(b, pad),
                          persistent_workers=self.hparams.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.heldout_set, shuffle=False)

