"""A synthetic arithmetic task in GSM8K's answer format: the CPU-scale accuracy signal.

Problems are 2-digit addition, 2-digit subtraction (non-negative results) and 2-digit x 1-digit
multiplication, asked plainly ("What is 47 + 38?") or as one-line word problems. Each gold solution
first states the sum it works (the word problem's numbers in the order the operation takes them), then
works it digit by digit, GSM8K style, and ends with ``#### N``::

    47 + 38: 7 + 8 = 15, 4 + 3 + 1 = 8, so 47 + 38 = 85.
    #### 85

Stating the sum first puts every digit the steps need a few tokens back, in one fixed layout, instead of
somewhere in a question whose wording varies: the tiny default model learns to copy at a fixed offset
long before it learns to find numbers in free text (``docs/design.md``, "Arithmetic in the corpus").

Held-out by construction: the operation and its operands (``add:47:38``) are split by a hash (10%
test, :data:`TEST_FRACTION`), so a test problem's sum never appears in the training problems under any
wording. Both splits are streams drawn from a seed: the first N problems of a split are the same for
every N (``--limit`` takes a prefix), and the default model's corpus is the first
``arith_train`` problems of the ``train`` split. See ``docs/design.md``, "Embedded default model".
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from expertcast.utils.provenance import split_of

TEST_FRACTION = 0.1
"""Share of the (operation, operands) pairs held out for the ``test`` split."""
SPLIT_SEED = 0
"""Seed of the hash that splits the pairs (fixed: the split is part of the benchmark)."""
STREAM_SEEDS = {"train": 1, "test": 2}
"""Seed of each split's problem stream (which pairs and wordings, in which order)."""
SPLIT_SIZES = {"train": 20000, "test": 1000}
"""Problems of each split as a benchmark (``load_benchmark("arith", split)``)."""
OP_WEIGHTS = (("add", 0.4), ("sub", 0.3), ("mul", 0.3))
"""Mix of the operations in both splits."""
SYMBOL = {"add": "+", "sub": "-", "mul": "x"}

_NAMES = ("Tom", "Ana", "Ben", "Mia", "Sam", "Lea", "Max", "Zoe")
_ITEMS = ("apples", "books", "coins", "pens", "stamps", "cards", "shells", "marbles")
_TEMPLATES = {
    "add": ("What is {a} + {b}?", "Compute {a} + {b}.",
            "{n} has {a} {i}. {n} gets {b} more {i}. How many {i} does {n} have now?",
            "A shop sold {a} {i} in the morning and {b} {i} in the afternoon. How many {i} did it sell?"),
    "sub": ("What is {a} - {b}?", "Compute {a} - {b}.",
            "{n} has {a} {i} and gives away {b} {i}. How many {i} are left?",
            "A box held {a} {i}. {b} {i} were taken out. How many {i} are still in the box?"),
    "mul": ("What is {a} x {b}?", "Compute {a} x {b}.",
            "{n} has {b} bags with {a} {i} in each bag. How many {i} does {n} have?",
            "A shelf has {b} rows of {a} {i}. How many {i} are on the shelf?"),
}


@dataclass(frozen=True)
class ArithProblem:
    """One problem: ``question``, the worked ``solution`` (ending ``#### answer``), the integer ``answer``."""

    id: str
    op: str
    a: int
    b: int
    question: str
    solution: str
    answer: int

    @property
    def key(self) -> str:
        """The (operation, operands) pair that decides the split, e.g. ``add:47:38``."""
        return pair_key(self.op, self.a, self.b)


def pair_key(op: str, a: int, b: int) -> str:
    return f"{op}:{a}:{b}"


def pair_split(op: str, a: int, b: int) -> str:
    """``"train"`` or ``"test"`` of an (operation, operands) pair, by hash."""
    return split_of(f"arith-{pair_key(op, a, b)}", val_fraction=0.0, test_fraction=TEST_FRACTION, seed=SPLIT_SEED)


def _pairs(op: str) -> list[tuple[int, int]]:
    if op == "add":
        return [(a, b) for a in range(10, 100) for b in range(10, 100)]
    if op == "sub":
        return [(a, b) for a in range(10, 100) for b in range(10, a + 1)]
    return [(a, b) for a in range(10, 100) for b in range(2, 10)]


def _ones_tens(x: int) -> tuple[int, int]:
    return x % 10, x // 10


def worked_solution(op: str, a: int, b: int) -> tuple[str, int]:
    """The digit-by-digit solution text and the answer of ``a op b`` (a, b as :func:`_pairs` draws them)."""
    a1, a10 = _ones_tens(a)
    if op == "add":
        b1, b10 = _ones_tens(b)
        ones = a1 + b1
        carry = ones // 10
        tens = f"{a10} + {b10} + {carry} = {a10 + b10 + carry}" if carry else f"{a10} + {b10} = {a10 + b10}"
        steps, ans = f"{a1} + {b1} = {ones}, {tens}", a + b
    elif op == "sub":
        b1, b10 = _ones_tens(b)
        borrow = int(a1 < b1)
        ones = f"{a1 + 10 * borrow} - {b1} = {a1 + 10 * borrow - b1}"
        tens = (f"{a10} - 1 - {b10} = {a10 - 1 - b10}" if borrow else f"{a10} - {b10} = {a10 - b10}")
        steps, ans = f"{ones}, {tens}", a - b
    elif op == "mul":
        ones = a1 * b
        carry = ones // 10
        tens = (f"{a10} x {b} = {a10 * b}, {a10 * b} + {carry} = {a10 * b + carry}" if carry
                else f"{a10} x {b} = {a10 * b}")
        steps, ans = f"{a1} x {b} = {ones}, {tens}", a * b
    else:
        raise ValueError(f"unknown arithmetic operation {op!r} (add, sub, mul)")
    expr = f"{a} {SYMBOL[op]} {b}"
    return f"{expr}: {steps}, so {expr} = {ans}.\n#### {ans}", ans


def _question(op: str, a: int, b: int, rng: random.Random) -> str:
    template = rng.choice(_TEMPLATES[op])
    return template.format(a=a, b=b, n=rng.choice(_NAMES), i=rng.choice(_ITEMS))


def arith_stream(split: str) -> Iterator[ArithProblem]:
    """Endless stream of ``split``'s problems (``arith-<split>-<index>``), pairs drawn with replacement."""
    if split not in STREAM_SEEDS:
        raise ValueError(f"arith has no split {split!r} (train, test)")
    pools = {op: [p for p in _pairs(op) if pair_split(op, *p) == split] for op, _ in OP_WEIGHTS}
    ops, weights = zip(*OP_WEIGHTS, strict=True)
    rng = random.Random(STREAM_SEEDS[split])
    i = 0
    while True:
        op = rng.choices(ops, weights)[0]
        a, b = rng.choice(pools[op])
        solution, ans = worked_solution(op, a, b)
        yield ArithProblem(f"arith-{split}-{i:05d}", op, a, b, _question(op, a, b, rng), solution, ans)
        i += 1


def arith_problems(split: str, n: int) -> list[ArithProblem]:
    """The first ``n`` problems of ``split``'s stream."""
    stream = arith_stream(split)
    return [next(stream) for _ in range(n)]


__all__ = ["ArithProblem", "arith_problems", "arith_stream", "worked_solution", "pair_split", "pair_key",
           "TEST_FRACTION", "SPLIT_SIZES"]
