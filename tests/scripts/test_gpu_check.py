"""scripts/gpu_check.sh --dry-run on the CPU: every check resolves its inputs and runs its code at tiny sizes,
one PASS/FAIL/SKIP line each (the graph step is scripts/gpu_check_graph.py's, tested with it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKS = ["gpu-extra", "gpu-tests", "forecaster-epoch", "token-identity", "disk-cuda", "bench", "peak-memory", "eval-graph",
          "router-fsdp2"]
QUANT = ["quant-identity", "quant-int4-cuda", "quant-fp8-scaled-mm"]
"""scripts/gpu_check_quant.py's lines (its CUDA kernels skipped on the CPU)."""


@pytest.mark.slow
def test_gpu_check_dry_run_passes_every_step_on_cpu(tmp_path):
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--dry-run", "--out", str(tmp_path), "--skip",
                        "graph"], capture_output=True, text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, r.stdout + r.stderr
    assert [ln.split()[1] for ln in lines] == CHECKS + ["graph"] + QUANT
    assert all(ln.startswith("PASS ") for ln in lines[:len(CHECKS)]) and lines[len(CHECKS)].startswith("SKIP graph")
    assert lines[-3].startswith("PASS quant-identity") and all(ln.startswith("SKIP ") for ln in lines[-2:])
    assert "mamba path torch" in lines[2] and "seqmoe@45%" in lines[5]
    assert (tmp_path / "bench" / "residency.json").is_file() and (tmp_path / "bench" / "memory.json").is_file()


def test_gpu_check_quant_dry_run():
    """The expert-format step on the CPU: offloaded int8/int4 == full-load quantized; the CUDA kernels SKIP."""
    r = subprocess.run([sys.executable, str(REPO / "scripts/gpu_check_quant.py"), "--dry-run"], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in r.stdout.splitlines() if ln.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    assert r.returncode == 0, r.stdout + r.stderr
    assert [ln.split()[1] for ln in lines] == QUANT
    assert lines[0].startswith("PASS quant-identity") and lines[1].startswith("SKIP") and lines[2].startswith("SKIP")


def test_gpu_check_refuses_unknown_arguments():
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument --bogus" in r.stderr
