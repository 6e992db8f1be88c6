"""Answer extraction and grading: GSM8K and arith by the final number, MATH-500 by ``math_verify``.

GSM8K: the number after the last ``####`` (the dataset's convention), else the content of the last
``\\boxed{}``, else the last number in the completion; commas, ``$`` and trailing periods are
ignored and numbers compare exactly as fractions (``18.00 == 18``, ``1/2 == 0.5``).

MATH-500: ``math_verify.parse`` + ``math_verify.verify``. Their timeouts use ``signal.alarm``, which
only works in the main thread; off the main thread we pass ``parsing_timeout=None`` /
``timeout_seconds=None`` (no timeout) instead of crashing.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from fractions import Fraction

_THINK_END = "</think>"
# a number: optional sign and $, digits with optional thousands commas, optional decimals, or a fraction a/b
_NUM = re.compile(r"(?<![\w.])-?(?:\$\s?)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s?/\s?\d+(?:\.\d+)?)?")


def _final_part(completion: str) -> str:
    """Text after the last ``</think>`` (reasoning models), else the whole completion."""
    i = completion.rfind(_THINK_END)
    return completion[i + len(_THINK_END):] if i >= 0 else completion


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if none."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start:i - 1]
    return None


def parse_number(s: str) -> Fraction | None:
    """``"$1,234.50."`` -> Fraction(2469, 2); ``"-3/4"`` -> Fraction(-3, 4); None when not a number."""
    t = s.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    t = re.sub(r"\\(?:!|,|;|\s)", "", t)
    frac = re.fullmatch(r"\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", t)
    if frac:
        t = f"{frac.group(1)}/{frac.group(2)}"
    try:
        if "/" in t:
            a, b = t.split("/", 1)
            return Fraction(a) / Fraction(b)
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def _numbers(text: str) -> list[str]:
    return [m.group(0).strip() for m in _NUM.finditer(text)]


def extract_gsm8k_answer(completion: str) -> str | None:
    """The final numeric answer of a GSM8K completion as a string, or None when there is none."""
    text = _final_part(completion)
    if "####" in text:
        nums = _numbers(text[text.rfind("####") + 4:])
        if nums:
            return nums[0]
    boxed = last_boxed(text)
    if boxed is not None:
        if parse_number(boxed) is not None:
            return boxed
        nums = _numbers(boxed)
        if nums:
            return nums[-1]
    nums = _numbers(text)
    return nums[-1] if nums else None


def grade_gsm8k(completion: str, gold: str) -> bool:
    """True when the completion's final number equals ``gold`` numerically."""
    g = parse_number(gold)
    if g is None:
        raise ValueError(f"GSM8K gold answer {gold!r} is not a number")
    pred = extract_gsm8k_answer(completion)
    if pred is None:
        return False
    p = parse_number(pred)
    return p is not None and p == g


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def grade_math(completion: str, gold: str) -> bool:
    """True when ``math_verify`` finds the completion's answer equivalent to ``gold`` (a LaTeX answer).

    ``gold`` is wrapped in ``\\boxed{}`` (MATH-500's ``answer`` field has no delimiters). Safe off the
    main thread (timeouts are disabled there).
    """
    from math_verify import parse, verify

    main = _in_main_thread()
    ptimeout = 5 if main else None
    vtimeout = 5 if main else None
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=ptimeout)
    if not gold_parsed:
        gold_parsed = parse(f"${gold}$", parsing_timeout=ptimeout)
    pred_parsed = parse(_final_part(completion), parsing_timeout=ptimeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=vtimeout))


NUMERIC_BENCHMARKS = ("gsm8k", "arith")
"""Benchmarks graded by the final number (``#### N``); arith's golds are integers, so the match is exact."""


def grade(benchmark: str, completion: str, gold: str) -> bool:
    """Grade ``completion`` against ``gold`` with the benchmark's rule ("gsm8k" | "arith" | "math500")."""
    if benchmark in NUMERIC_BENCHMARKS:
        return grade_gsm8k(completion, gold)
    if benchmark == "math500":
        return grade_math(completion, gold)
    raise ValueError(f"no grader for benchmark {benchmark!r} (gsm8k, arith, math500)")


def extract_answer(benchmark: str, completion: str) -> str | None:
    """The answer string a grader would compare (GSM8K, arith: the number; MATH-500: the last boxed content)."""
    if benchmark in NUMERIC_BENCHMARKS:
        return extract_gsm8k_answer(completion)
    if benchmark == "math500":
        return last_boxed(_final_part(completion))
    raise ValueError(f"no answer extractor for benchmark {benchmark!r} (gsm8k, arith, math500)")


@dataclass
class GradeSummary:
    """Accuracy over a list of graded items."""

    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def grade_many(benchmark: str, completions: list[str], golds: list[str]) -> tuple[list[bool], GradeSummary]:
    """Per-item verdicts and the summary."""
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
    ok = [grade(benchmark, c, g) for c, g in zip(completions, golds, strict=True)]
    return ok, GradeSummary(sum(ok), len(ok))
