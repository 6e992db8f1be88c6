"""Distributed `expertcast fit` on CPU (gloo, 2 processes; docs/design.md "Fit runs"):

* the router recipe (``configs/router/tiny.yaml``, LoRA) under DDP with Lightning's own launcher: one shared
  run directory, one export (rank 0, after a barrier) that ``load_moe_model`` loads and that generates;
* the forecaster recipe (``configs/forecaster/tiny.yaml``) under ``torchrun --nproc_per_node 2``: its export
  equals a 1-process run's. The global batch is kept equal (16 = 2 ranks x 8 = 1 process x 16) and the
  data-parallel sampler hands rank r the positions r, r+2, ... of the 1-process epoch order, so every optimizer
  step averages the gradients of the same 16 windows. Every window is full (the traces' length fills them),
  so the mean of the two per-rank token means is the 1-process token mean; scheduled sampling (random) is off;
* FSDP2, the shipped real-size strategy: ``configs/router/qwen3-30b-a3b.yaml`` as shipped (its strategy block,
  :class:`~expertcast.train.router_module.DecoderLayerFSDP2Strategy`, a Lightning ModelParallelStrategy; bf16-true;
  LoRA kept as an adapter) on 2 CPU processes (gloo) with the tiny preset: every decoder layer sharded, sharded
  checkpoints from both ranks, one export that loads and generates. Lightning's FSDPStrategy (FSDP1) cannot run
  on CPU in torch 2.13 ("FSDP needs a non-CPU accelerator device"), which is why the recipe ships FSDP2;
* the sharded module directly (``fully_shard``): RouterTap on a model whose router weights are sharded, the
  full-state gather equal to the unsharded model, and the export written once.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ATOL = 1e-5
"""DDP vs 1 process after 5 AdamW steps: only the order of float reductions differs (measured: 9.5e-7)."""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **extra}


def _run(cmd: list[str], log: Path, **env: str) -> None:
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(**env), cwd=log.parent, timeout=300).returncode
    assert rc == 0, log.read_text()[-3000:]


def test_ddp_router_fit_writes_one_export_that_loads_and_generates(tmp_path):
    from expertcast.models.backbone import load_moe_model
    from expertcast.models.router_export import read_adaptation_export

    root = tmp_path / "runs"
    _run([sys.executable, "-m", "expertcast.cli", "fit", "--config", str(REPO / "configs/router/tiny.yaml"),
          "--model.init_args.model", "qwen3_moe-tiny", "--model.init_args.budget", "6",
          "--model.init_args.lora", '{"r": 4, "alpha": 8}',
          "--data.init_args.limit", "32", "--data.init_args.heldout", "0.25", "--data.init_args.max_length", "64",
          "--data.init_args.batch_size", "4", "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
          "--trainer.limit_val_batches", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
          "--trainer.enable_model_summary", "false", "--trainer.devices", "2", "--trainer.strategy", "ddp",
          "--trainer.default_root_dir", str(root)], tmp_path / "fit.log")
    log = (tmp_path / "fit.log").read_text()
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log and log.count("router export written to") == 1
    (run_dir,) = list(root.iterdir())  # both ranks used rank 0's run directory
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "finished" and run["global_step"] == 3
    assert run["host"]["heap_held"] is (platform.libc_ver()[0] == "glibc")  # the console script held the fit's heap
    export = run_dir / "export"
    info = read_adaptation_export(export)  # the manifest covers every file
    assert info["model_dir"] == "model" and info["base"]["preset"] == "qwen3_moe-tiny"
    assert str(info["training"]["config"]["trainer"]["devices"]) == "2"
    model, tok = load_moe_model(export)
    ids = torch.tensor([tok.encode("2 + 3 =")])
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 6)


SHIPPED_ROUTER = REPO / "configs/router/qwen3-30b-a3b.yaml"


def _shipped_router_fit(root: Path, max_steps: int) -> list[str]:
    """``expertcast fit`` of the shipped real-size router YAML with its strategy block, precision and LoRA as
    shipped; only the backbone (tiny preset), the data size, the device (2 CPU processes) and the step counts
    are this machine's."""
    return [sys.executable, "-m", "expertcast.cli", "fit", "--config", str(SHIPPED_ROUTER),
            "--model.init_args.model", "qwen3_moe-tiny", "--model.init_args.budget", "4",
            "--data.init_args.limit", "24", "--data.init_args.heldout", "0.25", "--data.init_args.max_length", "48",
            "--data.init_args.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--trainer.max_steps", str(max_steps), "--trainer.accumulate_grad_batches", "1",
            "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.default_root_dir", str(root)]


@pytest.fixture(scope="module")
def shipped_fsdp2_run(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory, fit log) of a 2-step fit of the shipped real-size router recipe on 2 CPU processes."""
    tmp = tmp_path_factory.mktemp("shipped_fsdp2")
    _run(_shipped_router_fit(tmp / "runs", 2), tmp / "fit.log")
    (run_dir,) = list((tmp / "runs").iterdir())
    return run_dir, tmp / "fit.log"


def test_shipped_real_size_router_strategy_runs_fsdp2_on_two_cpu_processes(shipped_fsdp2_run):
    from expertcast.models.backbone import load_moe_model
    from expertcast.models.router_export import load_routers, read_adaptation_export

    run_dir, log_file = shipped_fsdp2_run
    log = log_file.read_text()
    layers = load_moe_model("qwen3_moe-tiny")[0].config.num_hidden_layers
    assert log.count(f"FSDP2: {layers} Qwen3MoeDecoderLayer units sharded over 2 processes") == 1, log[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log and log.count("router export written to") == 1
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "finished" and run["global_step"] == 2
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_dir() and len(list(last.glob("*.distcp"))) == 2  # a distributed checkpoint: both ranks' shards
    export = run_dir / "export"
    info = read_adaptation_export(export)  # gathered to rank 0, written once; the manifest covers every file
    assert info["adapter_dir"] == "adapter" and info["base"]["preset"] == "qwen3_moe-tiny"
    assert info["training"]["config"]["trainer"]["strategy"]["class_path"].endswith("DecoderLayerFSDP2Strategy")
    model, tok = load_moe_model(export)  # the recorded base + the adapter
    routers, _ = load_routers(export / "routers", model=model)
    assert all(torch.isfinite(v).all() for v in routers.state_dict().values())
    ids = torch.tensor([tok.encode("2 + 3 =")])
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 4)


@pytest.mark.slow
def test_shipped_real_size_router_fit_resumes_from_its_sharded_checkpoint(shipped_fsdp2_run, tmp_path):
    run_dir, _ = shipped_fsdp2_run
    _run([*_shipped_router_fit(run_dir.parent, 3), "--resume", str(run_dir)], tmp_path / "resume.log")
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "finished" and run["global_step"] == 3
    assert [r["step"] for r in run["resumes"]] == [2]  # read from the folder's meta.pt: settings checked, step 2


@pytest.fixture(scope="module")
def full_window_traces(tmp_path_factory) -> Path:
    from expertcast.data.synthetic import ModeMarkovProcess
    from expertcast.data.traces import write_traces

    proc = ModeMarkovProcess.random(num_modes=6, num_layers=2, num_experts=8, top_k=2, seed=0)
    seqs, _ = proc.sample(24, 42, prompt_len=6, seed=1)  # 42 tokens: every window of 8 has 8 targets
    return write_traces(tmp_path_factory.mktemp("dist_traces") / "traces", proc.meta(), seqs)


def _forecaster_args(traces: Path, root: Path, batch_size: int) -> list[str]:
    return ["--config", str(REPO / "configs/forecaster/tiny.yaml"), "--data.init_args.traces", str(traces),
            "--trainer.default_root_dir", str(root), "--trainer.max_steps", "5", "--trainer.logger", "false",
            "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--model.init_args.hidden_size", "16",
            "--model.init_args.head_dim", "8", "--model.init_args.state_size", "8", "--model.init_args.num_blocks", "1",
            "--model.init_args.direct_horizons", "2", "--model.init_args.chunk_size", "16",
            "--model.init_args.max_sampling_rate", "0", "--data.init_args.window", "8",
            "--data.init_args.batch_size", str(batch_size)]


def test_torchrun_forecaster_fit_equals_one_process(full_window_traces, tmp_path):
    from expertcast.commands import fit as fit_cmd
    from expertcast.models.forecaster_export import load_forecaster

    torch.set_num_threads(1)
    assert fit_cmd.main(_forecaster_args(full_window_traces, tmp_path / "one", 16)) == 0
    one = fit_cmd.last_result
    shared = tmp_path / "two" / "run"
    _run([*TORCHRUN, "-m", "expertcast.cli", "fit", *_forecaster_args(full_window_traces, tmp_path / "two", 8),
          "--trainer.devices", "2", "--trainer.strategy", "ddp_find_unused_parameters_true"],
         tmp_path / "torchrun.log", EXPERTCAST_FIT_RUN_DIR=str(shared))
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["run"]  # one run directory for both ranks
    assert json.loads((shared / "run.json").read_text())["global_step"] == one.global_step == 5
    a, b = load_forecaster(one.export_dir), load_forecaster(shared / "export")
    assert a.training["train_ids"] == b.training["train_ids"]
    wa, wb = a.model.state_dict(), b.model.state_dict()
    assert wa.keys() == wb.keys()
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert diff <= ATOL, f"2-process export differs from the 1-process one by {diff}"


def test_fsdp_sharded_router_module_taps_gathers_and_exports(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from expertcast.models.backbone import load_moe_model
    from expertcast.models.router_export import load_routers
    from fsdp_export_worker import batch, make_module

    _run([*TORCHRUN, str(Path(__file__).parent / "fsdp_export_worker.py"), str(tmp_path)], tmp_path / "fsdp.log")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rep in reports:  # the gate's 16 router rows are split 8 + 8, and the taps saw the same losses
        assert rep["sharded"] and rep["gate_local_rows"] == 8
        assert rep["lm"][0] == pytest.approx(rep["lm"][1], abs=1e-6)
        assert rep["cov"][0] == pytest.approx(rep["cov"][1], abs=1e-6)
    assert [rep["wrote"] for rep in reports] == [True, False]
    torch.set_num_threads(1)
    ref = make_module().eval()
    model, _ = load_moe_model(tmp_path / "export")
    ids = batch()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref.backbone(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    routers, _ = load_routers(tmp_path / "export" / "routers", model=model)
    for k, v in ref.routers.state_dict().items():
        torch.testing.assert_close(routers.state_dict()[k], v)
