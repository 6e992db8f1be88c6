"""The data of the embedded default model's recipe (:mod:`expertcast.recipes.tiny_default`): the files it reads
and their hashes, the chats of its corpus (GSM8K solutions, R1 chain-of-thought traces, the ``arith`` train split),
and the packed token stream the training loop draws from (docs/design.md "Embedded default model")."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.utils.errors import UsageError
from expertcast.utils.io import read_jsonl
from expertcast.utils.paths import DATA_DIR_ENV, data_dir
from expertcast.utils.provenance import sha256_file


@functools.lru_cache(maxsize=8)
def arith_hash(n: int) -> str:
    """sha256 of the first ``n`` arith train problems (their chats, as the corpus holds them)."""
    from expertcast.utils.provenance import sha256_json

    return sha256_json([arith_messages(p) for p in arith_train_problems(n)])


def data_hashes(files: dict[str, Path]) -> dict[str, str]:
    """sha256 of each data file of the recipe, by role (``gsm8k_train``, ...)."""
    return {k: _digest(str(p), *_stamp(p)) for k, p in sorted(files.items())}


def _stamp(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=32)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file, computed once per (path, size, mtime) in a process."""
    return sha256_file(path)


# ----------------------------------------------------------------------------------------- data


def recipe_files(root: Path | None = None) -> dict[str, Path]:
    """Paths of the files the recipe reads; a one-line FileNotFoundError naming where it looked."""
    base = data_dir(root)
    if base is None:
        from expertcast.utils.paths import REPO_ROOT

        raise FileNotFoundError(
            f"tiny-default training data not found: ${DATA_DIR_ENV} is unset and "
            f"{REPO_ROOT.parent / 'shared' / 'data'} does not exist"
        )
    files = {
        "gsm8k_train": base / "gsm8k" / "train.jsonl",
        "gsm8k_test": base / "gsm8k" / "test.jsonl",
        "cot_train": base / "cot" / "math153.jsonl",
        "cot_heldout": base / "cot" / "labeled40.jsonl",
    }
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"tiny-default training data not found: missing {', '.join(missing)} "
                                f"(looked in {base}; set ${DATA_DIR_ENV})")
    return files


def data_rows(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` rows of a data file of the recipe (:func:`~expertcast.utils.io.read_jsonl`); it must
    hold one at least."""
    rows = read_jsonl(path, limit=limit)
    if not rows:
        raise UsageError(f"{path}: no rows")
    return rows


def _clean_gsm8k(answer: str, strip: bool) -> str:
    import re

    return re.sub(r"<<[^>]*>>", "", answer) if strip else answer


def gsm8k_messages(row: dict[str, Any], strip_calculator_notes: bool = True) -> list[dict[str, str]]:
    """Chat of one GSM8K row: the question as the user turn, the worked solution as the answer."""
    return [{"role": "user", "content": row["question"].strip()},
            {"role": "assistant", "content": _clean_gsm8k(row["answer"].strip(), strip_calculator_notes)}]


def cot_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """Chat of one R1 trace: the problem, then ``<think>\\n{thinking}\\n</think>\\n\\n{final response}``."""
    final = (row.get("final_response") or "").strip()
    content = f"<think>\n{row['thinking'].strip()}\n</think>\n\n{final}"
    return [{"role": "user", "content": row["problem"].strip()}, {"role": "assistant", "content": content}]


def arith_train_problems(n: int) -> list:
    """The first ``n`` problems of the arith ``train`` split (:class:`~expertcast.data.arith.ArithProblem`)."""
    from expertcast.data.arith import arith_problems

    return arith_problems("train", n) if n else []


def arith_messages(problem) -> list[dict[str, str]]:
    """Chat of one arith problem: the user turn exactly as ``eval --benchmark arith`` prompts it
    (question + instruction), the worked solution as the answer."""
    from expertcast.data.prompts import user_message

    return [user_message(problem.question, "arith"), {"role": "assistant", "content": problem.solution}]


def tokenize_docs(tokenizer, chats: list[list[dict[str, str]]]) -> list[np.ndarray]:
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in chats]
    # The backend tokenizer directly: documents longer than model_max_length are fine here (they are
    # packed into seq_len blocks), so skip the wrapper's length warning.
    enc = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return [np.asarray(e.ids + [eot], dtype=np.int32) for e in enc]


class PackedStream:
    """Documents shuffled per epoch, concatenated and cut into [batch, seq_len] blocks."""

    def __init__(self, docs: list[np.ndarray], seq_len: int, batch_size: int, seed: int):
        total = sum(len(d) for d in docs)
        if total < seq_len * batch_size:
            raise ValueError(f"training corpus has {total} tokens, fewer than one batch ({batch_size}x{seq_len})")
        self.docs, self.seq_len, self.batch_size, self.seed = docs, seq_len, batch_size, seed
        self.epoch = 0
        self.total_tokens = total
        self._blocks: np.ndarray | None = None
        self._pos = 0

    def _new_epoch(self) -> None:
        order = np.random.default_rng(self.seed + self.epoch).permutation(len(self.docs))
        stream = np.concatenate([self.docs[i] for i in order])
        n = len(stream) // self.seq_len
        self._blocks = stream[: n * self.seq_len].reshape(n, self.seq_len)
        self._pos = 0

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self._pos}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._new_epoch()
        self._pos = int(state["pos"])

    def next_batch(self) -> torch.Tensor:
        """[batch_size, seq_len] int64 token ids."""
        if self._blocks is None:
            self._new_epoch()
        assert self._blocks is not None
        if self._pos + self.batch_size > len(self._blocks):
            self.epoch += 1
            self._new_epoch()
        b = self._blocks[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return torch.from_numpy(b.astype(np.int64))
