"""Answer extraction and grading; the gold solutions of both benchmarks must grade 100%."""

from __future__ import annotations

import threading

import pytest
from expertcast.data.benchmarks import load_benchmark
from expertcast.data.grading import (
    extract_gsm8k_answer,
    grade,
    grade_gsm8k,
    grade_many,
    grade_math,
    last_boxed,
    parse_number,
)


def test_gsm8k_gold_solutions_score_100(data_dir):
    probs = load_benchmark("gsm8k", "test", data_dir=data_dir)
    ok, summary = grade_many("gsm8k", [p.solution for p in probs], [p.answer for p in probs])
    assert summary.total == 1319 and summary.accuracy == 1.0


def test_math500_gold_solutions_score_100(data_dir):
    probs = load_benchmark("math500", "test", data_dir=data_dir)
    ok, summary = grade_many("math500", [p.solution for p in probs], [p.answer for p in probs])
    failed = [p.id for p, o in zip(probs, ok, strict=True) if not o]
    assert summary.total == 500 and not failed


@pytest.mark.parametrize("completion,expected", [
    ("so she earns $18.\n#### 18", "18"),
    ("#### $1,000.", "$1,000"),
    ("The answer is 1,234 apples. Later 7 more... final: 5.", "5"),
    ("we get \\boxed{42} in the end, 3 times", "42"),
    ("She lost -3 dollars", "-3"),
    ("half is 1/2", "1/2"),
    ("<think>maybe 12 or 13</think> The answer is 14", "14"),
    ("no digits here", None),
])
def test_extract_gsm8k(completion, expected):
    assert extract_gsm8k_answer(completion) == expected


def test_grade_gsm8k_numeric_equality():
    assert grade_gsm8k("#### 18.00", "18")
    assert grade_gsm8k("The total is $1,000.", "1000")
    assert grade_gsm8k("\\boxed{0.5}", "1/2")
    assert grade_gsm8k("x = 0.5 so #### 0.5", "1/2")
    assert not grade_gsm8k("#### 17", "18")
    assert not grade_gsm8k("no answer", "18")
    assert not grade_gsm8k("#### 18 ... then 19 at the end", "19")  # '####' wins over the last number
    with pytest.raises(ValueError, match="not a number"):
        grade_gsm8k("#### 1", "eighteen")


def test_parse_number():
    assert parse_number("$1,234.50.") == parse_number("2469/2")
    assert parse_number("\\frac{3}{4}") == parse_number("0.75")
    assert parse_number("abc") is None and parse_number("1/0") is None


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("nothing") is None


def test_grade_math_equivalences():
    assert grade_math("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5")
    assert grade_math("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)")
    assert not grade_math("\\boxed{3}", "4")
    assert not grade_math("I do not know", "4")
    assert grade("math500", "<think>\\boxed{5}</think> final \\boxed{4}", "4")
    with pytest.raises(ValueError, match="no grader"):
        grade("aime", "1", "1")


def test_grade_math_off_the_main_thread():
    """math_verify's timeouts use signals (main thread only): off it, grading must still work."""
    results: list = []
    errors: list = []

    def work():
        try:
            results.append(grade_math("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"))
            results.append(grade_math("\\boxed{7}", "8"))
        except Exception as e:  # pragma: no cover - the failure we guard against
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors and results == [True, False]
