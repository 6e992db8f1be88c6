"""`scripts/wandb_lineage.py`: the lineage table of offline W&B runs (the listing itself, of an `eval` run that
consumed a forecaster export: tests/utils/test_tracking.py); a folder holding no run is one line, exit 2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "wandb_lineage.py"


def _load():
    spec = importlib.util.spec_from_file_location("wandb_lineage", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_folder_without_runs_is_one_line(tmp_path, capsys):
    assert _load().main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no offline W&B run" in err[0]


def test_runs_are_found_below_the_wandb_folder(tmp_path):
    runs = [tmp_path / "wandb" / f"offline-run-2026010{i}_000000-x{i}" for i in (1, 2)]
    for r in runs:
        r.mkdir(parents=True)
        (r / f"run-{r.name[-2:]}.wandb").write_bytes(b"")
    mod = _load()
    assert mod.run_dirs(tmp_path) == runs and mod.run_dirs(runs[0]) == [runs[0]]
    assert mod.lineage_rows(runs[0]) == []
