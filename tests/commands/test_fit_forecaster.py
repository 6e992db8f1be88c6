"""`expertcast fit --config configs/forecaster/tiny.yaml` end to end on synthetic traces: W&B offline logging in
the run directory, explicit resume (--resume), export, then `expertcast forecast-eval` on the held-out sequences."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from expertcast.data.synthetic import ModeMarkovProcess
from expertcast.data.traces import write_traces
from expertcast.models.forecaster_export import load_forecaster

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def traces(tmp_path) -> Path:
    proc = ModeMarkovProcess.random(num_modes=6, num_layers=2, num_experts=8, top_k=2, seed=0)
    seqs, _ = proc.sample(40, 40, prompt_len=6, seed=1)
    return write_traces(tmp_path / "traces", proc.meta(), seqs)


def _config(tmp_path: Path, traces: Path, epochs: int) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "forecaster" / "tiny.yaml").read_text())
    cfg["trainer"].update(max_epochs=epochs, min_steps=0, default_root_dir=str(tmp_path / "runs"), check_val_every_n_epoch=1,
                          log_every_n_steps=1, enable_progress_bar=False)
    cfg["model"]["init_args"].update(hidden_size=32, head_dim=16, state_size=8)
    # a test split the export never sees: forecast-eval scores only sequences outside train and val
    cfg["data"]["init_args"].update(test_fraction=0.2)
    cfg["data"]["init_args"].update(traces=str(traces), window=39, batch_size=8)
    path = tmp_path / f"tiny-{epochs}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_fit_resume_export_and_eval(tmp_path, traces, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    from expertcast.cli import main
    from expertcast.commands import fit

    assert main(["fit", "--config", str(_config(tmp_path, traces, 2))]) == 0
    run = fit.last_result.run_dir
    assert run.parent == tmp_path / "runs"
    last = run / "checkpoints" / "last.ckpt"
    assert last.exists()
    step1 = torch.load(last, weights_only=True, map_location="cpu")["global_step"]
    assert list(run.glob("wandb/offline-run-*")), "W&B offline run directory missing"
    import wandb

    assert wandb.run is None, "the fit left its W&B run open: a later run in this process would log into it"
    assert list(run.glob("checkpoints/epoch=*.ckpt")), "the configured best checkpoint is not in the run directory"
    # more epochs: --resume continues the run from its last.ckpt
    with caplog.at_level(logging.INFO):
        assert main(["fit", "--config", str(_config(tmp_path, traces, 3)), "--resume", str(run)]) == 0
    assert f"Restoring states from the checkpoint path at {last}" in caplog.text
    assert fit.last_result.run_dir == run
    ck = torch.load(last, weights_only=True, map_location="cpu")
    assert ck["global_step"] == step1 * 3 // 2
    assert ck["hyper_parameters"]["shape"]["num_experts"] == 8

    exp = load_forecaster(run / "export")
    assert exp.config.num_layers == 2 and exp.source["model_id"] == "synthetic/mode-markov"
    assert exp.extra["split"]["val_fraction"] == 0.2 and exp.config.temperature > 0
    assert exp.config.component_cross_layer and exp.config.component_cross_recent  # the recipe's
    assert exp.model.components.names[-2:] == ["cross-layer", "cross-x-recent"]

    out = tmp_path / "eval"
    assert main(["forecast-eval", "--forecaster", str(run / "export"), "--traces", str(traces), "--horizons", "3",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "recall_summary.json").read_text())
    assert summary["split"] == "held-out" and summary["sequences"] >= 3
    assert summary["sequences"] == len(exp.training["test_ids"])
    names = {r["predictor"] for r in summary["rows"]}
    assert names == {"forecaster", "repeat-last", "frequency", "transition", "recent-freq", "recent-freq-h4",
                     "recent-freq-h64", "recent-count", "recent-count-h4", "recent-count-h64", "cross-layer",
                     "cross-x-recent", "mlp-reference"}  # the shipped half-lives, the cross-layer two, the MLP
    assert (out / "recall.png").stat().st_size > 1000 and (out / "recall.csv").exists()
    # a forecaster for another model is refused with a clear message
    other = ModeMarkovProcess.random(num_modes=3, num_layers=3, num_experts=8, top_k=2, seed=2)
    oseqs, _ = other.sample(4, 10, seed=3)
    odir = write_traces(tmp_path / "other", other.meta(), oseqs)
    assert main(["forecast-eval", "--forecaster", str(run / "export"), "--traces", str(odir)]) == 2
