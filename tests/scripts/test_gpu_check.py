"""scripts/gpu_check.sh --dry-run on the CPU: every check resolves its inputs and runs its code at tiny sizes,
one PASS/FAIL/SKIP line each (the graph step is scripts/gpu_check_graph.py's, tested with it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKS = ["gpu-extra", "gpu-tests", "forecaster-epoch", "token-identity", "disk-cuda", "bench", "peak-memory", "eval-graph",
          "router-fsdp2"]


@pytest.mark.slow
def test_gpu_check_dry_run_passes_every_step_on_cpu(tmp_path):
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--dry-run", "--out", str(tmp_path), "--skip",
                        "graph"], capture_output=True, text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, r.stdout + r.stderr
    assert [ln.split()[1] for ln in lines] == CHECKS + ["graph"]
    assert all(ln.startswith("PASS ") for ln in lines[:-1]) and lines[-1].startswith("SKIP graph")
    assert "mamba path torch" in lines[2] and "seqmoe@45%" in lines[5]
    assert (tmp_path / "bench" / "residency.json").is_file() and (tmp_path / "bench" / "memory.json").is_file()


def test_gpu_check_refuses_unknown_arguments():
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument --bogus" in r.stderr
