"""Prompt leakage of a router-adaptation export: were the evaluated prompts in its training data?

A router-adaptation export records, in ``export.json``'s ``training`` block, where its texts came from
(``source``, ``dataset_split``/``limit``, ...) and the exact ``train_ids`` (and ``val_ids``). A prompt
leaks into an evaluation when

- its id is one of those ids (the same problem under the same id), or
- its question text occurs in one of the recorded training texts (the same problem under another id:
  e.g. a local ``.jsonl`` source holding benchmark test items, whose ids are content hashes).

The second test reloads the recorded source and keeps the texts whose id the export lists (so texts the
export never trained on do not count), then searches each prompt's question, whitespace-normalised and
lower-cased, in them (a whole question, punctuation included: "what is 21 x 7?" found in a training text is
that problem with its answer nearby). Questions shorter than :data:`MIN_QUESTION_CHARS` characters are
compared by id only (too short to name a problem).

:func:`check_prompt_leakage` refuses leakage (:class:`~expertcast.utils.errors.OverlapError`, exit 2 in a
command) unless ``allow_overlap``, and then returns the flagged prompt ids for the output to report.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from expertcast.utils.errors import OverlapError

MIN_QUESTION_CHARS = 12
"""Questions shorter than this are checked by id only."""

_WS = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Lower-cased text with every whitespace run as one space (and none at the ends)."""
    return _WS.sub(" ", text).strip().lower()


def recorded_training(export_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``training`` block of a router-adaptation export (verified by its manifest), None when absent."""
    from expertcast.models.router_export import read_adaptation_export

    block = read_adaptation_export(export_dir).get("training")
    return block if isinstance(block, dict) and "train_ids" in block else None


def training_texts(training: dict[str, Any], data_dir: str | None = None, tokenizer: Any = None) -> list[str]:
    """The recorded training texts (prompt + completion) of a ``training`` block: its source reloaded, only
    the texts whose id it lists in ``train_ids``/``val_ids``. Raises FileNotFoundError / ValueError when the
    source cannot be loaded, ValueError when it names none."""
    from expertcast.train.router_data import load_texts

    source = training.get("source")
    if not source:
        raise ValueError("the export's training block names no text source")
    split = training.get("dataset_split") or "train"
    ids = set(training.get("train_ids") or []) | set(training.get("val_ids") or [])
    texts = load_texts(str(source), str(split), text_field=training.get("text_field"),
                       dataset_config=training.get("dataset_config"), chat_format=tokenizer is not None,
                       tokenizer=tokenizer, data_dir=data_dir, limit=training.get("limit"))
    return [t.prompt + "\n" + t.completion for t in texts if t.text_id in ids]


def leaked_prompts(problems: Sequence[Any], training: dict[str, Any], texts: Sequence[str]) -> list[str]:
    """Ids of the ``problems`` (``.id``, ``.question``) whose id is a recorded training id or whose question
    (at least :data:`MIN_QUESTION_CHARS` characters once normalised) occurs in one of ``texts``."""
    ids = set(training.get("train_ids") or []) | set(training.get("val_ids") or [])
    corpus = "\0".join(normalise(t) for t in texts)
    out = []
    for p in problems:
        q = normalise(p.question)
        if p.id in ids or (len(q) >= MIN_QUESTION_CHARS and q in corpus):
            out.append(p.id)
    return out


def check_prompt_leakage(problems: Sequence[Any], export_dir: str | os.PathLike, *, allow_overlap: bool = False,
                         data_dir: str | None = None, tokenizer: Any = None,
                         texts: Sequence[str] | None = None) -> dict[str, Any]:
    """Check the evaluated ``problems`` against ``export_dir``'s recorded training data.

    Returns ``{"prompt_overlap": n | None, "leaked_prompts": [ids], "allowed": bool}`` (``None``: the
    export records no training data, only accepted with ``allow_overlap``). Raises
    :class:`OverlapError` naming the export and the first leaked prompts unless ``allow_overlap``.
    ``texts``: the training texts when the caller already loaded them (:func:`training_texts`).
    """
    where = Path(export_dir)
    training = recorded_training(where)
    if training is None:
        if not allow_overlap:
            raise OverlapError(f"export {where} records no training data, so the evaluated prompts cannot be checked "
                               f"for leakage; retrain it with this expertcast or pass --allow-overlap")
        return {"prompt_overlap": None, "leaked_prompts": [], "allowed": True}
    if texts is None:
        try:
            texts = training_texts(training, data_dir=data_dir, tokenizer=tokenizer)
        except (FileNotFoundError, ValueError) as e:
            if not allow_overlap:
                raise OverlapError(f"the training data of export {where} cannot be reloaded to check the prompts for "
                                   f"leakage ({e}); pass --allow-overlap to evaluate anyway") from None
            texts = []
    leaked = leaked_prompts(problems, training, texts)
    if leaked and not allow_overlap:
        ex = ", ".join(leaked[:3]) + (" ..." if len(leaked) > 3 else "")
        raise OverlapError(f"{len(leaked)} of the {len(problems)} evaluated prompts are in the training data of "
                           f"export {where} ({ex}); evaluate on other prompts or pass --allow-overlap (reported in "
                           f"the output)")
    return {"prompt_overlap": len(leaked), "leaked_prompts": leaked, "allowed": bool(allow_overlap)}
