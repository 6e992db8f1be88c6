"""`expertcast eval` end to end on MATH-500 (read from the shared data folder) and on the generated
`arith` task, on a tiny preset: the problems and gold answers it evaluates, the grader's verdict on
every sample, the summary, and resume (the pipeline, not the accuracy of a random-init model)."""

from __future__ import annotations

import json

from expertcast.commands.evaluate import SAMPLES, main, read_samples
from expertcast.data.grading import extract_answer, grade

BASE = ["--model", "qwen3_moe-tiny", "--policy", "lru", "--capacity", "0.5", "--max-new-tokens", "6",
        "--no-progress", "--device", "cpu", "--baseline", "none"]


def _math500_rows(data_dir, n: int) -> list[dict]:
    with open(data_dir / "math500" / "test.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line, _ in zip(f, range(n), strict=False)]


def _check_graded(rows: list[dict], benchmark: str) -> None:
    """Each sample's verdict and extracted answer are the grader's on its own completion."""
    for r in rows:
        assert r["correct"] == grade(benchmark, r["completion"], r["gold"]), r["id"]
        assert r["answer"] == extract_answer(benchmark, r["completion"]), r["id"]


def test_math500_through_eval_end_to_end_and_resume(tmp_path, capsys, data_dir):
    out = tmp_path / "math500"
    gold = _math500_rows(data_dir, 3)
    assert main([*BASE, "--benchmark", "math500", "--limit", "2", "--out", str(out)]) == 0
    assert "on math500" in capsys.readouterr().out
    rows = read_samples(out / SAMPLES)
    assert [r["id"] for r in rows] == [g["unique_id"] for g in gold[:2]]
    assert [r["gold"] for r in rows] == [str(g["answer"]) for g in gold[:2]]
    _check_graded(rows, "math500")
    # the grader eval uses accepts each gold worked solution and refuses another problem's answer
    assert all(grade("math500", g["solution"], str(g["answer"])) for g in gold)
    assert not grade("math500", gold[0]["solution"], str(gold[1]["answer"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples"] == 2 and summary["settings"]["benchmark"] == "math500"
    assert summary["accuracy"] == sum(r["correct"] for r in rows) / 2

    # resume: the same settings with a larger limit generate only the missing problem
    assert main([*BASE, "--benchmark", "math500", "--limit", "3", "--out", str(out)]) == 0
    assert "resuming" in capsys.readouterr().out
    again = read_samples(out / SAMPLES)
    assert [r["id"] for r in again] == [g["unique_id"] for g in gold] and again[:2] == rows
    _check_graded(again[2:], "math500")
    assert json.loads((out / "summary.json").read_text())["samples"] == 3


def test_arith_through_eval(tmp_path, capsys):
    from expertcast.data.benchmarks import load_benchmark

    out = tmp_path / "arith"
    assert main([*BASE, "--benchmark", "arith", "--limit", "2", "--out", str(out)]) == 0
    assert "on arith" in capsys.readouterr().out
    rows = read_samples(out / SAMPLES)
    probs = load_benchmark("arith", "test", limit=2)
    assert [r["id"] for r in rows] == ["arith-test-00000", "arith-test-00001"]
    assert [r["gold"] for r in rows] == [p.answer for p in probs]
    _check_graded(rows, "arith")
    assert json.loads((out / "summary.json").read_text())["settings"]["benchmark"] == "arith"
