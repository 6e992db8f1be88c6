"""Detector precision/recall against sentence-labelled chain-of-thought traces (labeled40.jsonl).

Gold: each row's ``chunks`` are the sentences of ``thinking`` in order, each with
``function_tags``. A gold stage change is a chunk (not the first) whose function differs from the
previous chunk's and is one of :data:`STAGE_FUNCTIONS`. Chunks are located in ``thinking`` by a
whitespace-insensitive sequential search (the chunk texts have newlines folded into spaces); chunks
that cannot be located are counted and skipped.

Matching: texts are tokenized with the model's tokenizer and fed to the streaming detector token by
token. A gold change sits at the token holding its chunk's first character; a detected boundary at the
token holding its cue's first character. A detection matches a gold change when they are at most
``tolerance`` tokens apart (default 4: room for a short lead-in such as "Hmm, okay, so" or a cue that
opens the sentence's second clause). Matching is one-to-one, closest pairs first. Precision = matched
detections / detections, recall = matched gold changes / gold changes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.inference.saem.stages import StageDetector
from expertcast.utils.io import iter_jsonl

STAGE_FUNCTIONS = ("plan_generation", "uncertainty_management", "self_checking")


@dataclass
class GoldTrace:
    """One labelled trace: its text, the character offsets of all located chunk starts, of the gold
    stage changes, and how many chunks could not be located."""

    trace_id: str
    text: str
    chunk_starts: list[int]
    gold_starts: list[int]
    unaligned: int


def _normalize(text: str) -> tuple[str, list[int]]:
    """Whitespace runs collapsed to one space; returns the text and the original offset of each char."""
    out, idx = [], []
    prev_space = False
    for i, ch in enumerate(text):
        if ch.isspace():
            if prev_space:
                continue
            out.append(" ")
            idx.append(i)
            prev_space = True
        else:
            out.append(ch)
            idx.append(i)
            prev_space = False
    return "".join(out), idx


def load_gold(path: str | os.PathLike, functions: Sequence[str] = STAGE_FUNCTIONS) -> list[GoldTrace]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"gold file {p} does not exist (labeled40.jsonl of the shared data, cot/)")
    out = []
    for n, row in iter_jsonl(p):
        if not isinstance(row, dict) or "thinking" not in row or "chunks" not in row:
            raise ValueError(f"{p} line {n}: a gold row needs 'thinking' and 'chunks' (sentence labels)")
        text = row["thinking"]
        norm, idx = _normalize(text)
        pos, starts, gold, unaligned, prev_tag = 0, [], [], 0, None
        for k, ch in enumerate(row["chunks"]):
            tags = ch.get("function_tags") or []
            tag = tags[0] if tags else None
            needle = re.sub(r"\s+", " ", ch.get("text", "")).strip()
            j = norm.find(needle, pos) if needle else -1
            if j < 0:
                unaligned += 1
                prev_tag = tag
                continue
            start = idx[j]
            starts.append(start)
            if k > 0 and tag != prev_tag and tag in functions:
                gold.append(start)
            pos = j + len(needle)
            prev_tag = tag
        out.append(GoldTrace(str(row.get("id", n)), text, starts, gold, unaligned))
    if not out:
        raise ValueError(f"{p} holds no labelled traces")
    return out


def _token_of_char(offsets: np.ndarray, char: int) -> int:
    """Index of the token holding character ``char`` given token start offsets [T] (non-decreasing)."""
    return int(np.searchsorted(offsets, char, side="right") - 1)


def match(detected: Sequence[int], gold: Sequence[int], tolerance: int) -> int:
    """Size of a one-to-one matching of positions within ``tolerance`` (closest pairs first)."""
    pairs = sorted((abs(d - g), i, j) for i, d in enumerate(detected) for j, g in enumerate(gold)
                   if abs(d - g) <= tolerance)
    used_d, used_g, n = set(), set(), 0
    for _, i, j in pairs:
        if i in used_d or j in used_g:
            continue
        used_d.add(i)
        used_g.add(j)
        n += 1
    return n


@dataclass
class DetectionScore:
    name: str
    tolerance: int
    detections: int
    gold: int
    matched_detections: int
    matched_gold: int

    @property
    def precision(self) -> float:
        return self.matched_detections / self.detections if self.detections else 0.0

    @property
    def recall(self) -> float:
        return self.matched_gold / self.gold if self.gold else 0.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    def row(self) -> dict[str, Any]:
        return {"cue_set": self.name, "tolerance_tokens": self.tolerance, "detections": self.detections,
                "gold_changes": self.gold, "precision": self.precision, "recall": self.recall, "f1": self.f1}


def tokenize_traces(traces: Sequence[GoldTrace], encode: Callable[[str], list[int]],
                    decoder: Callable[[int], bytes]) -> list[tuple[list[int], np.ndarray]]:
    """Token ids of each trace and the character offset [T] where each token's text starts."""
    import codecs

    out = []
    for tr in traces:
        ids = list(encode(tr.text))
        offs, pos = np.zeros(len(ids), dtype=np.int64), 0
        u = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for k, t in enumerate(ids):
            offs[k] = pos
            pos += len(u.decode(decoder(t)))
        out.append((ids, offs))
    return out


def score_cues(name: str, cues: Sequence[str], traces: Sequence[GoldTrace], tokenized: Sequence[tuple[list[int], np.ndarray]],
               decoder: Callable[[int], bytes], tolerances: Sequence[int] = (0, 4, 16),
               ignore_case: bool = False) -> list[DetectionScore]:
    """Precision/recall of the streaming detector with ``cues`` at each tolerance."""
    det = StageDetector(cues, decoder, batch_size=1, ignore_case=ignore_case)
    per: list[tuple[list[int], list[int]]] = []
    for tr, (ids, offs) in zip(traces, tokenized, strict=True):
        det.reset(1)
        ev = []
        for t in ids:
            ev += det.feed_token(0, t)
        ev += det.flush(0)
        d = [e.start_token for e in ev]
        g = [_token_of_char(offs, c) for c in tr.gold_starts]
        per.append((d, g))
    return [_score(name, per, tol) for tol in tolerances]


def score_positions(name: str, traces: Sequence[GoldTrace], tokenized: Sequence[tuple[list[int], np.ndarray]],
                    starts_of: Callable[[GoldTrace], Sequence[int]], tolerances: Sequence[int]) -> list[DetectionScore]:
    """Precision/recall of boundaries given as character offsets (reference rows, e.g. every chunk start)."""
    per = []
    for tr, (_, offs) in zip(traces, tokenized, strict=True):
        per.append(([_token_of_char(offs, c) for c in starts_of(tr)], [_token_of_char(offs, c) for c in tr.gold_starts]))
    return [_score(name, per, tol) for tol in tolerances]


def _score(name: str, per: Sequence[tuple[list[int], list[int]]], tol: int) -> DetectionScore:
    n_d = sum(len(d) for d, _ in per)
    n_g = sum(len(g) for _, g in per)
    m = sum(match(d, g, tol) for d, g in per)
    return DetectionScore(name, tol, n_d, n_g, m, m)
