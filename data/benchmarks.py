"""GSM8K, MATH-500 and the synthetic ``arith`` task as uniform records.

GSM8K and MATH-500 come from a local directory of the public jsonl files or the Hub. Local layout (see ``../shared/data/README.md``): ``gsm8k/{train,test}.jsonl`` (fields question,
answer) and ``math500/test.jsonl`` (problem, solution, answer, subject, level, unique_id). Without a
local directory the loaders use ``datasets.load_dataset`` on the Hub ids ``openai/gsm8k`` (config
``main``) and ``HuggingFaceH4/MATH-500``. ``arith`` (:mod:`expertcast.data.arith`) is generated
from a fixed seed and needs no files: 2-digit +, - and x problems in GSM8K's ``#### N`` format, graded
exactly, whose ``test`` problems are held out of the default model's corpus.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from expertcast.utils.errors import UsageError
from expertcast.utils.io import read_jsonl
from expertcast.utils.paths import data_dir as _default_data_dir


class DatasetNotFoundError(FileNotFoundError):
    """A benchmark could not be found; the message is one line saying where it looked."""


@dataclass(frozen=True)
class BenchmarkSpec:
    """Where one benchmark lives locally and on the Hub."""

    name: str
    hub_id: str
    hub_config: str | None
    splits: tuple[str, ...]
    local_dir: str
    """Sub-directory of the data directory holding ``<split>.jsonl``."""
    generated: bool = False
    """Generated in code (no local files, no Hub)."""


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "gsm8k": BenchmarkSpec("gsm8k", "openai/gsm8k", "main", ("train", "test"), "gsm8k"),
    "math500": BenchmarkSpec("math500", "HuggingFaceH4/MATH-500", None, ("test",), "math500"),
    "arith": BenchmarkSpec("arith", "", None, ("train", "test"), "", generated=True),
}


@dataclass
class Problem:
    """One benchmark item in the form every consumer uses."""

    id: str
    """Stable id: ``gsm8k-test-00042``, MATH's ``unique_id`` (``test/algebra/1234.json``) or ``arith-test-00042``."""
    question: str
    answer: str
    """Gold final answer as a string (GSM8K, arith: the text after ``####``; MATH-500: the ``answer`` field)."""
    solution: str
    """Gold worked solution (GSM8K: the full ``answer`` field with ``#### N``; MATH: with ``\\boxed{}``)."""
    benchmark: str
    split: str
    extra: dict[str, Any] = field(default_factory=dict)
    """Other source fields (MATH-500: subject, level; arith: op, a, b)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)


def gsm8k_gold_answer(solution: str) -> str:
    """The text after the final ``####`` of a GSM8K solution, commas removed (``1,000`` -> ``1000``)."""
    m = _GSM8K_FINAL.search(solution)
    if not m:
        raise ValueError(f"GSM8K solution has no '#### answer' line: {solution[-80:]!r}")
    return m.group(1).replace(",", "").strip()


def _check(name: str, split: str) -> BenchmarkSpec:
    if name not in BENCHMARKS:
        raise UsageError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    if split not in spec.splits:
        raise UsageError(f"benchmark {name!r} has no split {split!r}; splits: {', '.join(spec.splits)}")
    return spec


def _to_problems(name: str, split: str, rows: Iterable[dict[str, Any]], where: str) -> list[Problem]:
    out: list[Problem] = []
    for i, r in enumerate(rows):
        try:
            if name == "gsm8k":
                sol = r["answer"]
                out.append(Problem(f"gsm8k-{split}-{i:05d}", r["question"], gsm8k_gold_answer(sol), sol, name, split))
            else:
                out.append(Problem(
                    str(r.get("unique_id") or f"math500-{split}-{i:05d}"), r["problem"], str(r["answer"]),
                    r["solution"], name, split,
                    {k: r[k] for k in ("subject", "level") if k in r},
                ))
        except KeyError as e:
            raise UsageError(f"{where}: row {i} has no field {e.args[0]!r}; is this the {name} release?") from None
    if not out:
        raise DatasetNotFoundError(f"{name} {split}: {where} holds no rows")
    return out


def load_benchmark(
    name: str,
    split: str = "test",
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
    use_hub: bool | None = None,
) -> list[Problem]:
    """Load ``name`` ("gsm8k" | "math500" | "arith") ``split`` as :class:`Problem` records.

    Looks in ``data_dir`` (else ``$EXPERTCAST_DATA_DIR``, else ``../shared/data``) for
    ``<local_dir>/<split>.jsonl``; when no local directory is configured (or ``use_hub=True``) it
    loads the Hub dataset. Raises :class:`DatasetNotFoundError` with one line naming where it looked.
    ``limit``: the first N problems (N >= 1; None = all). ``arith`` is generated (``data_dir`` and
    ``use_hub`` do not apply).
    """
    spec = _check(name, split)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise UsageError(f"--limit must be a positive integer (or absent for all problems), got {limit!r}")
    if spec.generated:
        return arith_benchmark(split, limit)
    root = _default_data_dir(data_dir)
    if use_hub is None:
        use_hub = root is None
    if not use_hub:
        assert root is not None
        path = root / spec.local_dir / f"{split}.jsonl"
        if not path.is_file():
            raise DatasetNotFoundError(
                f"{name} {split} not found: looked for {path} (set --data-dir or $EXPERTCAST_DATA_DIR to the "
                f"directory holding {spec.local_dir}/{split}.jsonl)"
            )
        problems = _to_problems(name, split, read_jsonl(path), str(path))
    else:
        problems = _to_problems(name, split, _load_hub(spec, split, local=root is not None), f"Hub dataset {spec.hub_id}")
    return problems[:limit] if limit is not None else problems


def arith_benchmark(split: str, limit: int | None = None) -> list[Problem]:
    """The first ``limit`` (at most ``SPLIT_SIZES[split]``) problems of the generated arith ``split``."""
    from expertcast.data.arith import SPLIT_SIZES, arith_problems

    n = SPLIT_SIZES[split] if limit is None else min(limit, SPLIT_SIZES[split])
    return [Problem(p.id, p.question, str(p.answer), p.solution, "arith", split, {"op": p.op, "a": p.a, "b": p.b})
            for p in arith_problems(split, n)]


def _load_hub(spec: BenchmarkSpec, split: str, local: bool = False) -> list[dict[str, Any]]:
    try:
        import datasets

        ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=split)
    except Exception as e:  # offline, missing, auth: all one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "" if local else "no local data directory (--data-dir / $EXPERTCAST_DATA_DIR) and "
        raise DatasetNotFoundError(
            f"{spec.name} {split} not found: {where}the Hub dataset {spec.hub_id}"
            f"{' config ' + spec.hub_config if spec.hub_config else ''} failed to load: {first}"
        ) from None
    return [dict(r) for r in ds]
