"""The benchmark scripts run end to end on CPU at a tiny size and write what they print (summary line, JSON,
CSV): the figures themselves are produced by running the scripts at full size, not by tests."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_bench_runtime_cpu_paired_grid(tmp_path, capsys):
    bench = _load("bench_runtime")
    rc = bench.main(["--device", "cpu", "--synthetic", "--hidden", "128", "--moe-intermediate", "128",
                     "--experts", "16", "--layers", "2", "--sequences", "2", "--tokens", "6", "--repeats", "2",
                     "--residency", "0.25", "0.5", "--ratios", "2.0", "--policies", "lru", "belady",
                     "--grid-repeats", "2", "--train-forecaster-epochs", "0", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "bench_runtime cpu:" in out and "paired ratios" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["full_tokens_per_s"] > 0
    over = json.loads((tmp_path / "overhead.json").read_text())
    assert len(over[1]["paired_ratios"]) == 2
    with open(tmp_path / "residency.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["policy"], float(r["residency"])) for r in rows} == {("lru", 0.25), ("lru", 0.5), ("belady", 0.25),
                                                                     ("belady", 0.5)}
    for r in rows:  # median of the two repeats, each against its own paired full-load run
        assert int(r["repeats"]) == 2
        assert float(r["pct_full_min"]) <= float(r["pct_full"]) <= float(r["pct_full_max"])
        assert float(r["paired_full_tokens_per_s"]) > 0
    assert (tmp_path / "residency.png").is_file()


@pytest.mark.slow
def test_bench_forecaster_cpu(tmp_path, capsys):
    bench = _load("bench_forecaster")
    rc = bench.main(["--reps", "8", "--horizon", "4", "--model", "", "--train-steps", "8", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "step.json").read_text())
    heads = {(r["config"], r["heads"]) for r in rows}
    assert heads == {("tiny", 1), ("tiny", 4), ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 4)}
    by = {(r["config"], r["heads"]): r for r in rows}
    # direct heads covering the horizon need no rollout steps: fewer FLOPs per forecast than the recursive one
    assert by[("qwen3-30b-a3b", 4)]["fraction_of_qwen3_step"] < by[("qwen3-30b-a3b", 1)]["fraction_of_qwen3_step"]
    train = json.loads((tmp_path / "train.json").read_text())
    assert train[0]["windows_per_s"] > 0 and train[0]["peak_memory_mb"] > 0


def test_bench_simulator_small(tmp_path, capsys):
    bench = _load("bench_simulator")
    rc = bench.main(["--steps", "400", "--sequences", "2", "--python-steps", "50", "--policies", "lru,belady",
                     "--json", str(tmp_path / "sim.json")])
    assert rc in (0, None)
    rows = json.loads((tmp_path / "sim.json").read_text())
    assert rows and capsys.readouterr().out


def test_bench_stages_small(tmp_path, capsys, data_dir):
    bench = _load("bench_stages")
    rc = bench.main(["--n", "2", "--batch", "2", "--out", str(tmp_path)])
    assert rc in (0, None)
    assert list(tmp_path.glob("*.json")) and list(tmp_path.glob("*.csv"))
