"""The synthetic ``arith`` task: every worked solution is right step by step, the split holds its test
problems out of the default model's corpus, the stream is a prefix-stable function of the seed, the
benchmark loads and grades exactly, and the corpus prompts it exactly as ``eval`` does."""

from __future__ import annotations

import re

import pytest
from expertcast.data import arith
from expertcast.data.benchmarks import gsm8k_gold_answer, load_benchmark
from expertcast.data.grading import extract_answer, grade
from expertcast.utils.errors import UsageError

_STEP = re.compile(r"(\d+) ([-+x]) (\d+)(?: ([-+]) (\d+))? = (\d+)")
_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "x": lambda x, y: x * y}


def _check_steps(text: str) -> int:
    """Every ``x op y [op z] = w`` in ``text`` is true; returns how many there are."""
    steps = _STEP.findall(text)
    for x, op, y, op2, z, w in steps:
        v = _OPS[op](int(x), int(y))
        if op2:
            v = _OPS[op2](v, int(z))
        assert v == int(w), (text, x, op, y, op2, z, w)
    return len(steps)


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_every_worked_solution_is_right_step_by_step(op):
    expected = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}[op]
    for a, b in arith._pairs(op):
        text, ans = arith.worked_solution(op, a, b)
        assert ans == expected(a, b) >= 0
        expr = f"{a} {arith.SYMBOL[op]} {b}"
        assert text.startswith(f"{expr}: ") and text.endswith(f"so {expr} = {ans}.\n#### {ans}")
        assert gsm8k_gold_answer(text) == str(ans)
        assert _check_steps(text) >= 3  # ones, tens, the whole


def test_worked_solution_known_values():
    assert arith.worked_solution("add", 47, 38) == (
        "47 + 38: 7 + 8 = 15, 4 + 3 + 1 = 8, so 47 + 38 = 85.\n#### 85", 85)
    assert arith.worked_solution("sub", 52, 47) == (
        "52 - 47: 12 - 7 = 5, 5 - 1 - 4 = 0, so 52 - 47 = 5.\n#### 5", 5)
    assert arith.worked_solution("mul", 23, 7) == (
        "23 x 7: 3 x 7 = 21, 2 x 7 = 14, 14 + 2 = 16, so 23 x 7 = 161.\n#### 161", 161)
    with pytest.raises(ValueError, match="div"):
        arith.worked_solution("div", 4, 2)


def test_split_holds_out_a_tenth_of_every_operation():
    for op in ("add", "sub", "mul"):
        pairs = arith._pairs(op)
        test = [p for p in pairs if arith.pair_split(op, *p) == "test"]
        assert abs(len(test) / len(pairs) - arith.TEST_FRACTION) < 0.03, (op, len(test), len(pairs))


def test_streams_are_deterministic_prefix_stable_and_disjoint():
    a, b = arith.arith_problems("train", 300), arith.arith_problems("train", 120)
    assert a[:120] == b and [p.id for p in b[:2]] == ["arith-train-00000", "arith-train-00001"]
    test = arith.arith_problems("test", 300)
    assert all(arith.pair_split(p.op, p.a, p.b) == "test" for p in test)
    assert all(arith.pair_split(p.op, p.a, p.b) == "train" for p in a)
    assert {p.op for p in test} == {"add", "sub", "mul"}
    assert len({p.question for p in test}) > 250  # varied wordings and operands
    with pytest.raises(ValueError, match="no split 'val'"):
        next(arith.arith_stream("val"))


def test_benchmark_loads_as_problems_and_grades_exactly():
    probs = load_benchmark("arith", "test", limit=5)
    assert [p.id for p in probs] == [f"arith-test-{i:05d}" for i in range(5)]
    assert load_benchmark("arith", "test", data_dir="/nonexistent") == load_benchmark("arith", "test")[:1000]
    assert len(load_benchmark("arith", "test")) == arith.SPLIT_SIZES["test"]
    assert len(load_benchmark("arith", "test", limit=10**6)) == arith.SPLIT_SIZES["test"]
    for p in probs:
        assert p.benchmark == "arith" and p.split == "test" and set(p.extra) == {"op", "a", "b"}
        assert gsm8k_gold_answer(p.solution) == p.answer
        assert grade("arith", p.solution, p.answer)  # the gold solution passes its own grader
        assert not grade("arith", p.solution.replace(f"#### {p.answer}", f"#### {int(p.answer) + 1}"), p.answer)
    assert grade("arith", "so it is 85.\n#### 85", "85") and extract_answer("arith", "#### 85") == "85"
    assert not grade("arith", "#### 850", "85") and not grade("arith", "no number", "85")
    with pytest.raises(UsageError, match="no split 'validation'"):
        load_benchmark("arith", "validation")


def test_training_chat_is_prompted_exactly_as_eval_prompts():
    from expertcast.data.prompts import build_prompt
    from expertcast.models.tokenizer import byte_level_tokenizer
    from expertcast.recipes.tiny_default_corpus import arith_messages

    tok = byte_level_tokenizer()
    (p,) = load_benchmark("arith", "train", limit=1)
    (gen,) = arith.arith_problems("train", 1)
    chat = tok.apply_chat_template(arith_messages(gen), tokenize=False)
    prompt = build_prompt(tok, p.question, "arith")
    assert chat.startswith(prompt) and chat[len(prompt):].startswith(p.solution)


def _template_regex(template: str) -> re.Pattern:
    """A template of :mod:`expertcast.data.arith` as a regex matching any of its questions."""
    alts = {"a": r"\d+", "b": r"\d+", "n": "|".join(arith._NAMES), "i": "|".join(arith._ITEMS)}
    seen: set[str] = set()

    def field(m: re.Match) -> str:
        name = m.group(1)
        if name in seen:
            return f"(?P={name})"
        seen.add(name)
        return f"(?P<{name}>{alts[name]})"

    return re.compile(re.sub(r"\\\{(\w)\\\}", field, re.escape(template)))


def test_test_problems_never_appear_in_the_default_corpus(data_dir):
    """The default recipe's corpus (GSM8K train, CoT, the arith train problems): no held-out arith test
    problem's operands appear among its arith problems, and no test question appears anywhere in it
    (every question any template can word is found in the corpus text; none is a test question)."""
    from expertcast.recipes import tiny_default as td
    from expertcast.recipes.tiny_default_corpus import arith_train_problems, recipe_files

    cfg = td.TinyDefaultConfig()
    assert cfg.arith_train > 0
    corpus = td._load_corpus(cfg, recipe_files(data_dir))
    assert corpus.n_arith == cfg.arith_train
    train = arith_train_problems(cfg.arith_train)
    test = load_benchmark("arith", "test")
    assert not {arith.pair_key(p.extra["op"], p.extra["a"], p.extra["b"]) for p in test} & {p.key for p in train}
    text = "\n".join(m["content"] for chat in corpus.train_chats for m in chat)
    found = {m.group(0) for ts in arith._TEMPLATES.values() for t in ts for m in _template_regex(t).finditer(text)}
    assert {p.question for p in train} <= found  # the scan sees every arith question of the corpus
    assert not {p.question for p in test} & found
    # and the benchmark's train split is the corpus's arith problems, in order
    assert [p.question for p in load_benchmark("arith", "train", limit=50)] == [p.question for p in train[:50]]
