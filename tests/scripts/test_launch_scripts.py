"""The GPU-node launch examples, exercised on CPU as far as they can be: the SLURM script parses and runs the
command line the README shows; scripts/launch/torchrun.sh fits the tiny forecaster config with 2 CPU
processes (gloo DDP) into one shared run directory and resumes it (``--resume RUN_DIR``) when rerun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts/launch/slurm.sbatch"
TORCHRUN_SH = REPO / "scripts/launch/torchrun.sh"
BIN = Path(sys.executable).parent


def _readme_gpu_section() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("## On a GPU node")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _command_lines(script: Path, first_word: str) -> list[str]:
    return [ln.strip() for ln in script.read_text().splitlines() if ln.strip().startswith(first_word + " ")]


def test_launch_scripts_parse_and_the_readme_shows_their_commands():
    for script in (SBATCH, TORCHRUN_SH):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    readme = _readme_gpu_section()
    [srun] = _command_lines(SBATCH, "srun")
    assert srun in readme  # the README shows the exact line the batch script runs
    assert "sbatch scripts/launch/slurm.sbatch" in readme and "bash scripts/launch/torchrun.sh" in readme
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", SBATCH.read_text(), re.M))
    assert {"nodes", "gpus-per-node", "requeue", "signal", "time"} <= set(directives)


def _dry_run(run_dir: Path, **env: str) -> str:
    e = {**os.environ, "CONFIG": "configs/forecaster/qwen3-30b-a3b.yaml", "RUN_DIR": str(run_dir), "DRY_RUN": "1",
         **env}
    r = subprocess.run(["bash", str(TORCHRUN_SH), "--trainer.max_epochs", "3"], env=e, capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_torchrun_script_resumes_a_run_directory_that_holds_a_run(tmp_path):
    new = _dry_run(tmp_path / "run", NPROC="8")
    assert "--nproc_per_node 8" in new and "--trainer.devices 8" in new and "--resume" not in new
    assert new.split()[-2:] == ["--trainer.max_epochs", "3"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    again = _dry_run(tmp_path / "run", NPROC="8", NNODES="2", NODE_RANK="1", STRATEGY="fsdp")
    assert f"--resume {tmp_path / 'run'}" in again and "--nnodes 2 --node_rank 1" in again
    assert "--trainer.num_nodes 2 --trainer.strategy fsdp" in again
    own = _dry_run(tmp_path / "run", NPROC="8", STRATEGY="config")  # the config's strategy block (router: FSDP2)
    assert "--trainer.strategy" not in own and f"--resume {tmp_path / 'run'}" in own


@pytest.mark.slow
def test_torchrun_script_fits_the_tiny_config_on_two_cpu_processes(tmp_path):
    """The script itself with 2 CPU ranks and a few steps (the equality of a 2-process and a 1-process fit is
    tests/train/test_distributed_fit.py's)."""
    from expertcast.data.synthetic import ModeMarkovProcess
    from expertcast.data.traces import write_traces

    proc = ModeMarkovProcess.random(num_modes=6, num_layers=2, num_experts=8, top_k=2, seed=0)
    seqs, _ = proc.sample(16, 40, prompt_len=6, seed=1)
    traces = write_traces(tmp_path / "traces", proc.meta(), seqs)
    run_dir = tmp_path / "run"
    env = {**os.environ, "CONFIG": "configs/forecaster/tiny.yaml", "RUN_DIR": str(run_dir), "NPROC": "2",
           "TORCHRUN": str(BIN / "torchrun"), "EXPERTCAST": str(BIN / "expertcast"),
           "MASTER_PORT": str(29500 + os.getpid() % 1000), "OMP_NUM_THREADS": "1"}
    args = ["--data.init_args.traces", str(traces), "--trainer.max_epochs", "1", "--trainer.min_steps", "0", "--trainer.logger", "false",
            "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--model.init_args.hidden_size", "16",
            "--model.init_args.head_dim", "8", "--model.init_args.state_size", "8", "--model.init_args.num_blocks", "1",
            "--model.init_args.chunk_size", "16", "--data.init_args.window", "8", "--data.init_args.batch_size", "4"]
    r = subprocess.run(["bash", str(TORCHRUN_SH), *args], env=env, capture_output=True, text=True, cwd=REPO,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "finished" and info["global_step"] > 0
    assert (run_dir / "export" / "export_manifest.json").is_file() and (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert not [p for p in run_dir.parent.iterdir() if p.name != "run" and p.name != "traces"]  # one run directory
    # rerunning the same line (a requeue) continues this run directory from its last checkpoint
    assert f"--resume {run_dir}" in subprocess.run(["bash", str(TORCHRUN_SH), *args], env={**env, "DRY_RUN": "1"},
                                                   capture_output=True, text=True, cwd=REPO).stdout
