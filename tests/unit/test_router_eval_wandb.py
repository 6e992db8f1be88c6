"""`expertcast router-eval --wandb`, offline: the study's table (every row, in the order of all_rows.json) and
its plot reach the W&B run, read back from the offline run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from expertcast.commands.router_eval import main
from expertcast.train.router_data import split_heldout

LIMIT, HELDOUT = 40, 0.25
IDS = [f"gsm8k-train-{i:05d}" for i in range(LIMIT)]
TRAIN = [IDS[i] for i in split_heldout(IDS, HELDOUT, seed=0)[0]]
EVAL = ["--limit", str(LIMIT), "--heldout", str(HELDOUT), "--max-length", "64", "--eval-limit", "4",
        "--batch-size", "4", "--benchmark", "arith", "--prompts", "2", "--max-new-tokens", "4"]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """An LM-only export of an untrained tiny preset whose training block lists the train side of the split."""
    from expertcast.train.router_module import RouterAdaptationModule

    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("router_wandb") / "lm_only"
    module = RouterAdaptationModule(model="qwen3_moe-tiny", mode="lm_only", budget=6)
    module.export(d, training={"source": "gsm8k", "train_ids": sorted(TRAIN), "val_ids": []})
    return d




def test_router_eval_logs_its_table_and_plot_offline(export, tmp_path, wandb_dir, data_dir, offline_contents):
    out = tmp_path / "study"
    rc = main(["--exports", str(export), "--out", str(out), *EVAL, "--wandb", "--wandb-project", "t"])
    assert rc == 0
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # one run of the command
    got = offline_contents(runs[0], lambda c: any("table2" in Path(t).name for t in c["tables"]) and c["images"])
    [table] = [t for t in got["tables"] if "table2" in Path(t).name]
    logged = json.loads((runs[0] / table).read_text())
    rows = json.loads((out / "all_rows.json").read_text())
    cols = logged["columns"]
    assert {"run", "policy", "hit", "heldout_lm", "train_overlap"} <= set(cols)
    assert [r[cols.index("policy")] for r in logged["data"]] == [r["policy"] for r in rows] == ["lru", "static"]
    assert [r[cols.index("hit")] for r in logged["data"]] == pytest.approx([r["hit"] for r in rows])
    assert [r[cols.index("run")] for r in logged["data"]] == ["lm_only", "lm_only"]
    assert any(Path(i).name.startswith("router_eval") or "plot" in Path(i).name for i in got["images"]), got["images"]


def test_without_wandb_no_run_is_made(export, tmp_path, wandb_dir, data_dir):
    rc = main(["--exports", str(export), "--out", str(tmp_path / "study"), *EVAL])
    assert rc == 0
    assert not list((wandb_dir / "wandb").glob("offline-run-*")) if (wandb_dir / "wandb").exists() else True
