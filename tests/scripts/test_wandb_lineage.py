"""`scripts/wandb_lineage.py`: the lineage table of offline W&B runs (the listing itself, of an `eval` run that
consumed a forecaster export: tests/utils/test_tracking.py); a folder holding no run is one line, exit 2."""

from __future__ import annotations

import importlib.util
import re
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


def test_edge_fit_export_eval_in_two_offline_runs(tmp_path, wandb_dir, offline_contents, capsys):
    """`fit` logs its export as one artifact named by its export hash, with its files, and declares its trace set
    (by fingerprint) as its input; `forecast-eval` uses that very artifact by name (same W&B digest): the graph
    has the edge fit -> export -> eval. A resumed fit continues the same W&B run (its id in the run directory)."""
    import json

    import torch
    from expertcast.commands import fit as fit_cmd
    from expertcast.commands.forecast_eval import main as forecast_eval
    from expertcast.data.synthetic import ModeMarkovProcess
    from expertcast.data.trace_format import sequences_fingerprint
    from expertcast.data.traces import load_traces, write_traces

    torch.set_num_threads(1)
    proc = ModeMarkovProcess.random(num_modes=4, num_layers=2, num_experts=8, top_k=2, seed=0)
    seqs, _ = proc.sample(24, 40, prompt_len=6, seed=1)
    traces = write_traces(tmp_path / "traces", proc.meta(), seqs)
    logger = json.dumps({"class_path": "lightning.pytorch.loggers.WandbLogger",
                         "init_args": {"project": "t", "offline": True}})
    repo = SCRIPT.parents[1]
    args = ["--config", str(repo / "configs/forecaster/tiny.yaml"), "--data.init_args.traces", str(traces),
            "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.logger", logger,
            "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--model.init_args.hidden_size", "16",
            "--model.init_args.head_dim", "8", "--model.init_args.state_size", "8", "--model.init_args.num_blocks",
            "1", "--model.init_args.direct_horizons", "2", "--model.init_args.chunk_size", "16",
            "--data.init_args.window", "8", "--data.init_args.batch_size", "8", "--data.init_args.test_fraction",
            "0.25"]
    assert fit_cmd.main([*args, "--trainer.max_steps", "2"]) == 0
    first = fit_cmd.last_result
    assert fit_cmd.main([*args, "--trainer.max_steps", "4", "--resume", str(first.run_dir)]) == 0
    res = fit_cmd.last_result
    assert res.run_dir == first.run_dir
    fit_runs = sorted(res.run_dir.glob("wandb/offline-run-*"))
    run_id = (res.run_dir / "wandb_run_id").read_text().strip()
    # one W&B run, resumed: both folders carry its id (wandb suffixes "-1" when the resume starts in the same second)
    assert len(fit_runs) == 2 and all(re.search(rf"-{re.escape(run_id)}(-\d+)?$", r.name) for r in fit_runs), fit_runs

    assert forecast_eval(["--forecaster", str(res.export_dir), "--traces", str(traces), "--horizons", "2",
                          "--mlp-steps", "0", "--out", str(tmp_path / "fe"), "--wandb", "--wandb-project", "t"]) == 0
    [ev_run] = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    fit = offline_contents(fit_runs[-1], lambda c: len(c["artifacts"]) >= 2)
    ev = offline_contents(ev_run, lambda c: any(a["used"] for a in c["artifacts"]))
    [logged] = [a for a in fit["artifacts"] if not a["used"] and a["type"] == "forecaster-export"]
    [fit_input] = [a for a in fit["artifacts"] if a["used"]]
    [used] = [a for a in ev["artifacts"] if a["used"] and a["type"] == "forecaster-export"]
    assert logged["name"] == used["name"] == f"forecaster-export-{res.export_hash[:16]}"
    assert logged["digest"] and logged["digest"] == used["digest"] and logged["sha256"] == used["sha256"] == res.export_hash
    assert {"forecaster.json", "forecaster.safetensors", "export_manifest.json"} <= set(logged["files"])
    assert fit_input["type"] == "trace-set" and fit_input["sha256"] == sequences_fingerprint(load_traces(traces)[1])

    capsys.readouterr()
    assert _load().main([str(fit_runs[-1]), str(ev_run)]) == 0
    out = capsys.readouterr().out
    assert f"{fit_runs[-1].name} -> {logged['name']} -> {ev_run.name}" in out
