"""LM data for cache-aware router adaptation (docs/design.md "Data flow").

Default: GSM8K train solutions, chat-formatted (the question as the user turn, through
:func:`expertcast.data.prompts.build_prompt`, the gold worked solution as the assistant turn). Any
``datasets`` text source works by config: a Hub id (``source="wikitext"``, ``dataset_config``,
``text_field``) or a local ``.json``/``.jsonl``/``.parquet``/``.txt`` file.

Every text has a stable id (the benchmark problem id, e.g. ``gsm8k-train-00042``; for ``datasets``
sources ``text-`` + the first 16 hex digits of the sha256 of the text), and the held-out split is
made by a hash of that id (:func:`expertcast.utils.provenance.split_of`, fraction ``heldout``): a text
is held out or not whatever ``limit`` is, so a study run with another ``--limit`` never evaluates on
texts an earlier run trained on. The held-out texts feed validation and ``expertcast router-eval``;
:meth:`RouterLMDataModule.train_ids` / :meth:`RouterLMDataModule.heldout_ids` list both sides.

Each example is ``(prompt_ids, completion_ids)``; the LM loss covers the completion tokens only
(the whole text for plain text sources, whose prompt is empty). Batches (right-padded):
``input_ids`` int64 [B, T], ``attention_mask`` int64 [B, T], ``labels`` int64 [B, T] (-100 on the
prompt and padding), ``prompt_len`` int64 [B].
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import lightning as pl
import torch
from expertcast.utils.errors import UsageError
from expertcast.utils.provenance import split_of
from torch.utils.data import DataLoader


class LMText(NamedTuple):
    """One text of a source: its stable id, the prompt (not trained on) and the completion."""

    text_id: str
    prompt: str
    completion: str


@dataclass
class LMExample:
    """One tokenised text: ``prompt_ids`` (not trained on) then ``completion_ids``; ``seq_id`` is the
    text's stable id (:class:`LMText`)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    seq_id: str = ""

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def _eos_text(tokenizer: Any) -> str:
    """End-of-turn text appended to completions (ChatML ``<|im_end|>`` or the tokenizer's EOS)."""
    eos = getattr(tokenizer, "eos_token", None)
    return eos or ""


def text_id(text: str) -> str:
    """Stable id of a plain text (``datasets`` sources): ``text-`` + 16 hex digits of its sha256."""
    return "text-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def load_texts(source: str, split: str = "train", *, text_field: str | None = None,
               dataset_config: str | None = None, chat_format: bool = True, tokenizer: Any = None,
               data_dir: str | None = None, limit: int | None = None) -> list[LMText]:
    """The texts of ``source`` (the first ``limit`` when given), each with its stable id.

    A benchmark name (``gsm8k``/``math500``/``arith``, :data:`expertcast.data.benchmarks.BENCHMARKS`):
    chat-formatted question + gold solution (plain "Question/Answer" format
    when ``chat_format`` is False or the tokenizer has no chat template), id = the problem id.
    Anything else is loaded with ``datasets``; each row's ``text_field`` (default ``text``) becomes a
    completion with an empty prompt, id = :func:`text_id`. Raises FileNotFoundError / ValueError
    naming the problem.
    """
    from expertcast.data.benchmarks import BENCHMARKS, load_benchmark

    if source in BENCHMARKS:  # the benchmark registry: question -> worked solution
        from expertcast.data.prompts import build_prompt

        problems = load_benchmark(source, split, data_dir=data_dir, limit=limit)
        eos = _eos_text(tokenizer)
        return [
            LMText(str(p.id), build_prompt(tokenizer, p.question, source, use_chat_template=None if chat_format else False),
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
    return [LMText(text_id(r), "", r) for r in rows]


def tokenize_pairs(tokenizer: Any, texts: list[LMText], max_length: int) -> list[LMExample]:
    """Tokenise texts without special tokens, truncated to ``max_length`` tokens in all (the prompt
    keeps at most ``max_length - 1``); empty completions are dropped."""
    out = []
    for tid, prompt, completion in texts:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        c = tokenizer(completion, add_special_tokens=False)["input_ids"]
        p = p[: max_length - 1]
        c = c[: max_length - len(p)]
        if c:
            out.append(LMExample(list(p), list(c), tid))
    return out


def check_heldout_fraction(heldout: float) -> float:
    """``heldout`` as a float in (0, 1), else a UsageError saying why."""
    if isinstance(heldout, bool) or not isinstance(heldout, (int, float)) or not 0 < heldout < 1:
        raise UsageError(f"heldout must be a fraction of the texts in (0, 1), e.g. 0.05, got {heldout!r} (texts are "
                         f"held out by a hash of their id, so the split does not depend on limit)")
    return float(heldout)


def split_heldout(ids: list[str], heldout: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) index lists of texts with ids ``ids``: text i is held out when
    ``split_of(ids[i], heldout, seed=seed) == "val"``, a function of its id alone."""
    frac = check_heldout_fraction(heldout)
    tr, ho = [], []
    for i, sid in enumerate(ids):
        (ho if split_of(sid, frac, seed=seed) == "val" else tr).append(i)
    if not tr or not ho:
        raise UsageError(f"held-out fraction {heldout} of {len(ids)} texts leaves no "
                         f"{'training' if not tr else 'held-out'} text; use more texts (limit) or another heldout")
    return tr, ho


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

    ``heldout``: fraction of the texts held out, by a hash of each text's id (seeded by ``seed``).
    The tokenizer is the training module's (``trainer.lightning_module.tokenizer``) unless
    ``tokenizer`` (a local directory) is given.
    """

    def __init__(self, source: str = "gsm8k", split: str = "train", text_field: str | None = None,
                 dataset_config: str | None = None, chat_format: bool = True, max_length: int = 256,
                 batch_size: int = 8, heldout: float = 0.05, limit: int | None = None, seed: int = 0,
                 num_workers: int = 0, data_dir: str | None = None, tokenizer: str | None = None):
        super().__init__()
        check_heldout_fraction(heldout)
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
        texts = load_texts(hp.source, hp.split, text_field=hp.text_field, dataset_config=hp.dataset_config,
                           chat_format=hp.chat_format, tokenizer=self.tokenizer, data_dir=hp.data_dir,
                           limit=hp.limit)
        examples = tokenize_pairs(self.tokenizer, texts, hp.max_length)
        tr, ho = split_heldout([e.seq_id for e in examples], hp.heldout, hp.seed)
        self.train_set = [examples[i] for i in tr]
        self.heldout_set = [examples[i] for i in ho]

    def train_ids(self) -> list[str]:
        """Sorted ids of the training texts (after :meth:`setup`)."""
        return self._ids(self.train_set)

    def heldout_ids(self) -> list[str]:
        """Sorted ids of the held-out texts (after :meth:`setup`)."""
        return self._ids(self.heldout_set)

    def _ids(self, data: list[LMExample]) -> list[str]:
        if not self.train_set:
            raise RuntimeError("RouterLMDataModule: call setup() before asking for text ids")
        return sorted({e.seq_id for e in data})

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

