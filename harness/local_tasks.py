"""The lm-evaluation-harness tasks that read the local benchmark files (docs/design.md, "Harnesses").

``tasks/`` holds ``gsm8k.yaml`` and ``minerva_math500.yaml``, the harness's own task definitions (same task
name, prompt, few-shot, stop sequences, filters and metrics; ``tests/harness`` checks them against the
installed harness) with one change: ``custom_dataset`` names a loader below, which reads
``$EXPERTCAST_DATA_DIR`` (:func:`~expertcast.utils.paths.data_dir`) instead of the Hub. Given as an
``--include_path``, they override the harness's tasks of the same name. ``expertcast_arith.yaml`` is the
project's ``arith`` benchmark as a harness task, prompted and graded as ``expertcast eval --benchmark arith``
(so its accuracy is comparable with the project's own).

The loaders are called by the harness as ``custom_dataset(**metadata, **dataset_kwargs)``; they take the
``data_dir`` key when given (``--metadata '{"data_dir": DIR}'``) and ignore the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
"""The folder to pass as the harness's ``--include_path``."""
LOCAL_TASKS = ("gsm8k", "minerva_math500", "expertcast_arith")
"""Task names defined in :data:`TASKS_DIR`."""


def _local_splits(benchmark: str, data_dir: Any) -> Any:
    """A ``datasets.DatasetDict`` of ``benchmark``'s local jsonl files, one split each, rows as released."""
    import datasets
    from expertcast.data.benchmarks import BENCHMARKS, DatasetNotFoundError
    from expertcast.utils.io import read_jsonl
    from expertcast.utils.paths import data_dir as find_data_dir

    spec = BENCHMARKS[benchmark]
    root = find_data_dir(data_dir)
    if root is None:
        raise DatasetNotFoundError(f"{benchmark}: no local data directory ($EXPERTCAST_DATA_DIR, or data_dir in "
                                   f"--metadata) for the expertcast harness task")
    out = {}
    for split in spec.splits:
        path = Path(root) / spec.local_dir / f"{split}.jsonl"
        if not path.is_file():
            raise DatasetNotFoundError(f"{benchmark} {split} not found: looked for {path} (set $EXPERTCAST_DATA_DIR "
                                       f"to the directory holding {spec.local_dir}/{split}.jsonl)")
        out[split] = datasets.Dataset.from_list(list(read_jsonl(path)))
    return datasets.DatasetDict(out)


def gsm8k(data_dir: str | None = None, **_: Any) -> Any:
    """GSM8K's train and test splits from ``gsm8k/{train,test}.jsonl`` (fields question, answer)."""
    return _local_splits("gsm8k", data_dir)


def math500(data_dir: str | None = None, **_: Any) -> Any:
    """MATH-500's test split from ``math500/test.jsonl`` (problem, solution, answer, subject, level, unique_id)."""
    return _local_splits("math500", data_dir)


def arith(**_: Any) -> Any:
    """The generated ``arith`` test split (:func:`~expertcast.data.benchmarks.arith_benchmark`): id, question,
    answer."""
    import datasets
    from expertcast.data.benchmarks import arith_benchmark

    rows = [{"id": p.id, "question": p.question, "answer": p.answer} for p in arith_benchmark("test")]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def arith_text(doc: dict[str, Any]) -> str:
    """The user turn of ``expertcast eval --benchmark arith`` (:func:`~expertcast.data.prompts.user_message`);
    with ``--apply_chat_template`` the harness wraps it exactly as the project's prompt, without it the text is
    sent as is."""
    from expertcast.data.prompts import user_message

    return user_message(doc["question"], "arith")["content"]


def arith_results(doc: dict[str, Any], results: list[str]) -> dict[str, int]:
    """``exact_match``: the project's arith grader (:func:`~expertcast.data.grading.grade`) on the completion."""
    from expertcast.data.grading import grade

    return {"exact_match": int(grade("arith", results[0], str(doc["answer"])))}
