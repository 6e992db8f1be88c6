"""The README's pipeline block, run verbatim in a fresh folder with tiny sizes: every command must read
what the one before it wrote (issue: "the README pipeline does not chain")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = {"M": "qwen3_moe-tiny", "N": "16", "NT": "8", "T": "16", "STEPS": "4", "EVAL_N": "4", "COT_N": "4"}


def pipeline_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- pipeline:begin -->\s*```bash\n(.*?)```\s*<!-- pipeline:end -->", text, re.S)
    assert m, "README.md has no pipeline block between <!-- pipeline:begin --> and <!-- pipeline:end -->"
    return m.group(1)


def test_readme_states_the_tiny_sizes_this_test_uses():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert " ".join(f"{k}={v}" for k, v in TINY.items()) in text


@pytest.mark.slow
def test_readme_pipeline_runs_verbatim_in_a_fresh_folder(tmp_path, data_dir):
    block = pipeline_block()
    env = {**os.environ, **TINY, "EXPERTCAST_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 0, f"README pipeline failed (exit {r.returncode}):\n{r.stderr[-4000:]}"
    # each later step consumed an earlier step's output
    assert (tmp_path / "exports/forecaster/export_manifest.json").is_file()
    fc = json.loads((tmp_path / "exports/forecaster/forecaster.json").read_text())
    assert len(fc["training"]["train_ids"]) + len(fc["training"]["val_ids"]) == 16  # N sequences of GSM8K train
    recall = json.loads((tmp_path / "runs/forecast-eval/recall_summary.json").read_text())
    assert recall["overlap"]["forecaster"]["overlap"] == 0 and recall["overlap"]["forecaster"]["evaluated"] == 8
    sim = json.loads((tmp_path / "runs/simulate-seqmoe/simulate.json").read_text())
    assert {r["policy"].split("(")[0] for r in sim} >= {"lru", "belady", "seqmoe"}
    assert (tmp_path / "exports/router/export_manifest.json").is_file()
    assert (tmp_path / "runs/router-eval/table2.csv").is_file()
    assert json.loads((tmp_path / "runs/cues.json").read_text())["cues"]
    cues = json.loads((tmp_path / "runs/cues.json").read_text())
    guard = json.loads((tmp_path / "runs/stages/guard.json").read_text())["cue_set"]
    assert guard["overlap"] == 0 and guard["evaluated"] + len(cues["calibration"]["sequence_ids"]) == 4  # COT_N
    summary = json.loads((tmp_path / "runs/eval/summary.json").read_text())
    assert summary
