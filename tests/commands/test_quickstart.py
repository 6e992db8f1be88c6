"""`expertcast quickstart` end to end on a tiny preset: real step counts, every step's outputs, reuse
announced only under the same settings, and a larger --limit that trains a new forecaster and scores
it only on sequences it never saw."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from expertcast.commands.quickstart import main
from expertcast.models.forecaster_export import training_ids

ARGS = ["--model", "qwen3_moe-tiny", "--max-new-tokens", "8", "--policies", "lru,belady", "--capacity", "0.5",
        "--forecaster-steps", "2"]


def _only(folder: Path) -> Path:
    subs = [p for p in folder.iterdir() if p.is_dir()]
    assert len(subs) == 1, subs
    return subs[0]


def _held_out_checked(out: Path, limit: int) -> None:
    """forecast-eval of the limit-N forecaster scored only sequences outside its training ids."""
    fc = next(p for p in (out / "forecaster").iterdir() if f"-n{limit}-" in p.name) / "export"
    fe = next(p for p in (out / "forecast-eval").iterdir() if f"-n{limit}-" in p.name)
    summary = json.loads((fe / "recall_summary.json").read_text())
    trained = training_ids(fc)
    assert trained and len(trained) + summary["sequences"] == limit
    assert not (summary.get("overlap") or {}).get("overlap")


@pytest.mark.slow  # three pipeline runs: collection, simulation, forecaster fit, offloaded generation (minutes)
def test_quickstart_runs_reuses_and_rekeys(tmp_path, capsys, data_dir):
    out = tmp_path / "qs"
    assert main([*ARGS, "--limit", "12", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.findall(r"=== \[(\d)/7\]", text) == ["1", "2", "3", "4", "5", "6", "7"]
    assert "trained 2 optimizer steps" in text
    sim = _only(out / "simulate")
    for name in ("simulate.json", "simulate.csv", "hit_vs_capacity.png"):
        assert (sim / name).is_file(), name
    evals = {p.name.split("-")[0]: json.loads((p / "summary.json").read_text()) for p in (out / "eval").iterdir()}
    assert set(evals) == {"gsm8k", "arith"}
    for ev in evals.values():
        assert {r["pool"] for r in json.loads((sim / "simulate.json").read_text())} == {ev["settings"]["pool"]}
    assert evals["arith"]["samples"] == 16 and evals["gsm8k"]["samples"] == 4
    assert re.search(r"offloaded run on arith \(.*\): accuracy \d\.\d\d on 16 problems", text)
    _held_out_checked(out, 12)
    assert "accuracy near 0 is expected" in text and "what the numbers mean" in text and "AdjHit" in text

    assert main([*ARGS, "--limit", "12", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for what in ("routing traces", "simulation", "forecaster", "forecast evaluation", "offloaded run on gsm8k",
                 "offloaded run on arith"):
        assert re.search(rf"reusing the {what} in \S+ \(same settings\)", text), what

    # a larger limit: new traces, a new forecaster, scored on its own held-out sequences only
    assert main([*ARGS, "--limit", "16", "--skip-offload", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.findall(r"=== \[(\d)/5\]", text) == ["1", "2", "3", "4", "5"]
    assert "reusing" not in text
    assert len(list((out / "forecaster").iterdir())) == 2 and len(list((out / "traces").iterdir())) == 2
    _held_out_checked(out, 16)


def test_the_default_models_banner_says_where_it_came_from():
    """The quickstart's model banner on the embedded default: shipped, verified, its recipe and build."""
    from expertcast.commands.quickstart import _default_provenance
    from expertcast.models.names import shipped_default_model
    from expertcast.recipes.tiny_default import load_report

    line = _default_provenance(shipped_default_model())
    rep = load_report(shipped_default_model())
    assert "shipped in the repository" in line and "sha256 of every file verified" in line
    assert f"recipe {rep['recipe_hash']}" in line and "Nothing is trained here" in line


@pytest.mark.parametrize("limit", [3, 4, 8, 16, 32, 64])
def test_the_forecasters_split_holds_out_a_problem_for_any_limit(limit):
    """--limit 8: every problem hashes into train or val under the config's seed (forecast-eval then had nothing to
    score, exit 2); the split seed is chosen so that every split holds a problem."""
    from collections import Counter

    from expertcast.commands.quickstart import FORECAST_TEST_FRACTION, held_out_seed
    from expertcast.utils.provenance import split_of

    ids = [f"gsm8k-test-{i:05d}" for i in range(limit)]
    seed = held_out_seed(ids, 0.2, FORECAST_TEST_FRACTION)
    got = Counter(split_of(i, 0.2, FORECAST_TEST_FRACTION, seed=seed) for i in ids)
    assert got["test"] >= 1 and got["train"] >= 1 and got["val"] >= 1
    if limit >= 16:  # the config's own seed already holds problems out: it is kept
        assert held_out_seed(ids[:limit], 0.2, FORECAST_TEST_FRACTION) == 0


def test_too_few_problems_for_the_forecaster_are_refused_up_front(tmp_path, capsys):
    assert main([*ARGS, "--limit", "2", "--out", str(tmp_path / "qs")]) == 2
    err = capsys.readouterr().err
    assert "--limit 2: the forecaster step needs at least 3 problems" in err
    assert not (tmp_path / "qs").exists()  # nothing ran, nothing written
