"""`expertcast simulate --fit-traces`: the generalisation protocol's fit set calibrates the fitted baselines,
online policies run on the evaluated traces, shared ids are refused, --fit-sequences takes the nested subset."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from expertcast.commands.simulate import main
from expertcast.data.synthetic import zipf_traces
from expertcast.data.traces import write_traces
from expertcast.inference.policies import make_policy
from expertcast.inference.policies.static import selection_counts
from expertcast.inference.sim.simulator import simulate
from expertcast.train.forecaster_data import training_subset


def _set(tmp_path: Path, name: str, seed: int, prefix: str | None = None):
    tr = zipf_traces(5, 40, num_layers=2, num_experts=8, top_k=2, seed=seed)
    seqs = [dataclasses.replace(s, seq_id=f"{prefix}-{i}") for i, s in enumerate(tr.sequences)] if prefix \
        else list(tr.sequences)
    return write_traces(tmp_path / name, tr.meta, seqs), tr.meta, seqs


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_fit_set_calibrates_static_and_subsets_are_nested(tmp_path, capsys):
    ev_dir, meta, ev = _set(tmp_path, "eval", seed=5)
    fit_dir, _, fit = _set(tmp_path, "fit", seed=9, prefix="fit")
    out = tmp_path / "out"
    assert main(["--traces", str(ev_dir), "--fit-traces", str(fit_dir), "--fit-sequences", "2", "--policies",
                 "lru,static", "--capacity", "0.5", "--no-belady-fraction", "--out", str(out)]) == 0
    assert "generalisation protocol" in capsys.readouterr().out
    recs = {r["policy"]: r for r in json.loads((out / "simulate.json").read_text())}
    assert {r["fit_sequences"] for r in recs.values()} == {2}
    two = training_subset(fit, 2)
    assert {s.seq_id for s in two} <= {s.seq_id for s in training_subset(fit, 4)}
    counts = selection_counts(two, meta.num_layers, meta.num_experts)
    lib = simulate((meta, ev), [make_policy("static", calibration=counts), "lru"], [0.5], belady_fraction=False,
                   progress=False)
    assert recs["static"]["hit"] == lib[0]["hit"] and recs["lru"]["hit"] == lib[1]["hit"]


def test_fit_set_sharing_ids_with_the_evaluated_set_is_refused(tmp_path, capsys):
    ev_dir, _, _ = _set(tmp_path, "eval", seed=5)
    same_ids, _, _ = _set(tmp_path, "fit", seed=9)
    assert main(["--traces", str(ev_dir), "--fit-traces", str(same_ids), "--policies", "lru", "--capacity", "0.5",
                 "--out", str(tmp_path / "o")]) == 2
    assert "evaluated sequences were used to train the fit set" in _err(capsys)


@pytest.mark.parametrize("extra, message", [
    (["--fit-sequences", "3"], "--fit-sequences picks sequences of the fit set: give --fit-traces DIR"),
    (["--fit-traces", "FIT", "--calibration", "FIT"], "--fit-traces is the calibration of the fitted baselines"),
    (["--fit-traces", "FIT", "--fit-sequences", "50"], "the fit set"),
])
def test_fit_options_misuse_is_one_line(tmp_path, capsys, extra, message):
    ev_dir, _, _ = _set(tmp_path, "eval", seed=5)
    fit_dir, _, _ = _set(tmp_path, "fit", seed=9, prefix="fit")
    extra = [str(fit_dir) if a == "FIT" else a for a in extra]
    assert main(["--traces", str(ev_dir), "--policies", "lru", "--capacity", "0.5", "--out", str(tmp_path / "o"),
                 *extra]) == 2
    assert message in _err(capsys)
