"""W&B lineage (recipes/lineage.py): the exports, trace sets and cue sets a command consumed become used artifacts
of its run, named by the hash its outputs record; read back from the offline run directory."""

from __future__ import annotations

from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _runs(d: Path) -> list[Path]:
    return sorted((d / "wandb").glob("offline-run-*"))


# -- lineage: the inputs a command consumed, as used artifacts of its run ------------------------------------
def _used(contents: dict) -> dict[str, dict]:
    """``{artifact type: artifact}`` of the run's used (input) artifacts."""
    return {a["type"]: a for a in contents["artifacts"] if a["used"]}


def _forecaster(path: Path, num_layers: int, num_experts: int, top_k: int, model_id: str = "synthetic", **kw) -> Path:
    """An untrained forecaster export whose training block lists no sequence of the tests' (fitted, it says, on
    the routing of ``model_id``)."""
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
    from expertcast.models.forecaster_export import save_forecaster

    torch.manual_seed(0)
    cfg = ForecasterConfig(num_layers=num_layers, num_experts=num_experts, top_k=top_k, hidden_size=16, head_dim=8,
                           state_size=4, num_blocks=1, direct_horizons=2, **kw)
    return Path(save_forecaster(ExpertForecaster(cfg).eval(), path, source={"model_id": model_id},
                                training={"train_ids": ["other-0"], "val_ids": []}))


def test_simulate_declares_its_traces_and_forecaster(tmp_path, wandb_dir, offline_contents):
    from expertcast.commands.simulate import main
    from expertcast.data.synthetic import zipf_traces
    from expertcast.data.trace_format import sequences_fingerprint
    from expertcast.data.traces import write_traces
    from expertcast.models.forecaster_export import verify_export

    tr = zipf_traces(4, 40, num_layers=2, num_experts=8, top_k=2, seed=5)
    traces = write_traces(tmp_path / "tr", tr.meta, tr.sequences)
    exp = _forecaster(tmp_path / "exp", 2, 8, 2, model_id=tr.meta.model_id)
    assert main(["--traces", str(traces), "--policies", f"lru,seqmoe:forecaster={exp},horizon=2", "--capacity",
                 "0.25,0.5", "--pool", "shared", "--out", str(tmp_path / "sim"), "--wandb", "--wandb-project", "t"]) == 0
    [run] = _runs(wandb_dir)
    got = offline_contents(run, lambda c: len(_used(c)) == 2 and c["tables"])
    used = _used(got)
    assert used["forecaster-export"]["sha256"] == verify_export(exp)
    assert used["forecaster-export"]["path"] == str(exp.resolve())
    assert used["forecaster-export"]["name"] == f"forecaster-export-{verify_export(exp)[:16]}"
    assert sorted(used["forecaster-export"]["files"]) == sorted(p.name for p in exp.iterdir() if p.is_file())
    assert used["trace-set"]["sha256"] == sequences_fingerprint(tr.sequences)
    assert sorted(used["trace-set"]["files"]) == ["manifest.json", "trace_meta.json"]
    # per-capacity series, one curve per policy, plotted over the capacity
    hit = {k.split("(")[0]: v for k, v in got["step_axes"].items() if k.endswith("/hit")}
    assert hit == {"lru/hit": "capacity", "seqmoe": "capacity"}


def test_commands_without_wandb_start_no_run(tmp_path, wandb_dir):
    from expertcast.commands.simulate import main

    assert main(["--synthetic", "zipf", "--synthetic-shape", "2,8,2,3,24", "--policies", "lru", "--capacity", "0.5",
                 "--out", str(tmp_path / "sim")]) == 0
    assert not (wandb_dir / "wandb").exists()


def test_eval_declares_the_forecaster_export_it_consumed(tmp_path, wandb_dir, offline_contents, data_dir, capsys):
    """The must-show: the lineage of an `eval` run read back from its offline run files names the forecaster
    export by its export hash; the per-batch series are plotted over the batch id."""
    from expertcast.commands.evaluate import main
    from expertcast.models.forecaster_export import verify_export

    exp = _forecaster(tmp_path / "fc", 4, 16, 4, model_id="qwen3_moe-tiny", chunk_size=16)
    assert main(["--model", "qwen3_moe-tiny", "--benchmark", "gsm8k", "--policy", f"seqmoe:forecaster={exp},horizon=2",
                 "--capacity", "0.5", "--limit", "1", "--max-new-tokens", "2", "--no-progress", "--device", "cpu",
                 "--baseline", "none", "--out", str(tmp_path / "o"), "--wandb", "--wandb-project", "t"]) == 0
    [run] = _runs(wandb_dir)
    got = offline_contents(run, lambda c: _used(c) and c["step_axes"].get("tokens_per_s"))
    [art] = [a for a in got["artifacts"] if a["used"]]
    assert art["type"] == "forecaster-export" and art["sha256"] == verify_export(exp)
    assert art["name"] == f"forecaster-export-{verify_export(exp)[:16]}" and art["path"] == str(exp.resolve())
    assert got["step_axes"]["tokens_per_s"] == "batch"
    import importlib.util

    spec = importlib.util.spec_from_file_location("wandb_lineage", SCRIPTS / "wandb_lineage.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    assert script.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "forecaster-export" in out and verify_export(exp) in out and "used" in out


def test_eval_declares_the_router_export_it_runs(tmp_path, wandb_dir, offline_contents, data_dir):
    """`eval --model EXPORT --policy router-*`: the router-adaptation export is the run's input, by its export
    hash."""
    from expertcast.commands.evaluate import main
    from expertcast.train.router_module import RouterAdaptationModule
    from expertcast.utils.provenance import verify_export_manifest

    export = Path(RouterAdaptationModule(model="qwen3_moe-tiny", mode="temporal", init="random", seed=1)
                  .export(tmp_path / "temporal"))
    assert main(["--model", str(export), "--policy", "router-temporal", "--benchmark", "arith", "--limit", "1",
                 "--max-new-tokens", "2", "--slots", "6", "--no-progress", "--device", "cpu", "--baseline", "none",
                 "--out", str(tmp_path / "o"), "--wandb", "--wandb-project", "t"]) == 0
    [run] = _runs(wandb_dir)
    [art] = [a for a in offline_contents(run, _used)["artifacts"] if a["used"]]
    assert art["type"] == "router-export" and art["sha256"] == verify_export_manifest(export)
