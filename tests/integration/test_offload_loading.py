"""Loading straight to the host store holds no second copy of the model (CPU-measurable proof).

A random-weight Qwen3-MoE whose routed experts total >= 1 GiB (fp32, 3 layers x 60 experts x 6.3 MB)
is saved with ``save_pretrained`` to a temporary folder. In one subprocess it is offloaded at 25%
with :func:`~expertcast.inference.runtime.loading.load_offloaded`; in another it is loaded whole
(``from_pretrained``) as the full-load reference. The offloaded process's peak RSS (``VmHWM``: Linux
carries ``ru_maxrss`` over ``execve``, so a child of the large test process would report its parent's peak)
stays below its RSS before loading + non-expert weights + experts + slots + 300 MB, so no second
full copy of the experts (nor the checkpoint's pages) ever existed, its runtime memory report
matches the plan, and its greedy tokens equal the full-load run's.

The peak RSS both reports give (``LoadReport.peak_rss_bytes``, ``MemoryReport.process_peak_rss``) is the
process's own: a process exec'd by one that had touched 1 GiB reports its own peak, not the inherited
``ru_maxrss``.

The ``gpu`` test does the same on CUDA under ``torch.cuda.set_per_process_memory_fraction`` set below
the model's size: the model does not fit the device and still runs, token-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from expertcast.inference.runtime.loading import build_skeleton
from expertcast.models.presets import get_config
from expertcast.models.tokenizer import byte_level_tokenizer

MB = 1 << 20
BIG = dict(hidden_size=512, moe_intermediate_size=1024, num_experts=60, num_hidden_layers=3)
"""3 MoE layers x 60 experts x (3 x 512 x 1024 fp32 = 6.29 MB) = 1.13 GB of routed experts."""

CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.loading import load_offloaded, peak_rss_bytes as rss
from expertcast.models.backbone import load_moe_model
import transformers.models.qwen3_moe.modeling_qwen3_moe  # imported before the baseline RSS is read

mode, model_dir, device = sys.argv[1], sys.argv[2], sys.argv[3]
ids = torch.tensor([[0, 0, 0, 17, 99, 250, 31, 77, 140], [12, 45, 300, 5, 88, 61, 203, 19, 7]], device=device)
am = (torch.arange(9, device=device) >= torch.tensor([[3], [0]], device=device)).long()
out = {"base_rss": rss()}
if mode == "full":
    model, _ = load_moe_model(model_dir, device=device)
    seq = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
else:
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(float(sys.argv[4]))
    om, _, report = load_offloaded(model_dir, make_policy("lru"), 0.25, device=device)
    seq = om.generate(ids, am, max_new_tokens=6, eos_token_id=None, pad_token_id=0).sequences
    out["report"] = report.to_dict()
    out["memory"] = om.memory_report().to_dict()
    out["misses"] = int(om.stats.D)
out["tokens"] = seq.tolist()
out["peak_rss"] = rss()
print("RESULT " + json.dumps(out))
"""


EXEC_PARENT = r"""
import os, sys
big = b"\x01" * int(sys.argv[1])  # touched: resident
del big
os.execv(sys.executable, [sys.executable, "-c", sys.argv[2]])
"""

EXEC_CHILD = r"""
import json, resource, torch
torch.set_num_threads(1)
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.loading import load_offloaded
om, _, report = load_offloaded("qwen3_moe-tiny", make_policy("lru"), 0.5)
print("RESULT " + json.dumps({"load": report.peak_rss_bytes, "memory": om.memory_report().process_peak_rss,
                              "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_peak_rss_is_the_process_own_not_an_exec_parents():
    parent_peak = 1 << 30
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", EXEC_PARENT, str(parent_peak), EXEC_CHILD], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT "))
    assert r["ru_maxrss"] >= parent_peak  # the premise: Linux carried the parent's peak over execve
    assert 0 < r["load"] <= r["memory"] < parent_peak, r  # both reports give the child's own high-water mark


def _write_big_checkpoint(d: Path) -> None:
    """save_pretrained of a random-weight model of BIG's sizes (a random block tiled into every
    matrix: writing 1.1 GB of normal samples would dominate the test's time)."""
    model = build_skeleton(get_config("qwen3_moe-tiny", **BIG), torch.float32)
    model.to_empty(device="cpu")
    block = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.05
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            flat = p.view(-1)
            if p.ndim == 1:
                flat.fill_(1.0)  # norms
                continue
            start = (i * 7919) % 4096
            done = 0
            while done < flat.numel():
                n = min(flat.numel() - done, block.numel() - start)
                flat[done:done + n].copy_(block[start:start + n])
                done, start = done + n, 0
    model.save_pretrained(d)
    byte_level_tokenizer(model_max_length=512).save_pretrained(d)


def _run_children(model_dir: Path, runs: list[list[str]]) -> list[dict]:
    """Run the CHILD script once per argument list, concurrently; their parsed RESULT lines."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, a[0], str(model_dir), *a[1:]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in runs]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
    return results


@pytest.fixture(scope="module")
def big_checkpoint():
    d = Path(tempfile.mkdtemp(prefix="expertcast-big-", dir="/tmp" if Path("/tmp").is_dir() else None))
    try:
        _write_big_checkpoint(d)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _check_offloaded(off: dict, full: dict) -> dict:
    """Assertions shared by the CPU and CUDA runs; returns the figures."""
    plan, mem = off["report"]["plan"], off["memory"]
    experts, non_expert, slots = plan["expert_bytes_total"], plan["non_expert_bytes"], plan["slot_bytes"]
    assert experts >= 1 << 30, experts
    assert plan["checkpoint_layout"] == "per-expert"
    assert plan["num_slots"] == round(0.25 * 3 * 60)
    assert mem["device_expert_param_bytes"] == 0 and mem["host_expert_bytes"] == experts
    assert mem["device_non_expert_bytes"] == non_expert and mem["device_slot_bytes"] == slots
    assert off["misses"] > 0
    bound = off["base_rss"] + non_expert + experts + slots + 300 * MB
    assert off["peak_rss"] < bound, (off["peak_rss"] / MB, bound / MB)
    assert off["tokens"] == full["tokens"]
    return {"expert_bytes": experts, "non_expert_bytes": non_expert, "slots": plan["num_slots"],
            "slot_bytes": slots, "base_rss": off["base_rss"], "peak_rss": off["peak_rss"],
            "peak_rss_minus_base": off["peak_rss"] - off["base_rss"], "bound": bound,
            "device_peak_bytes": off["report"]["device_peak_bytes"], "full_load_peak_rss": full["peak_rss"]}


def test_offload_of_1gb_model_holds_one_host_copy_and_matches_full_load(big_checkpoint):
    full, off = _run_children(big_checkpoint, [["full", "cpu"], ["offload", "cpu"]])
    figures = _check_offloaded(off, full)
    # the full load holds at least the whole model: the offloaded peak is well below base + 2 copies
    assert off["peak_rss"] - off["base_rss"] < 2 * figures["expert_bytes"]
    print("FIGURES " + json.dumps(figures))


@pytest.mark.gpu
def test_offload_on_cuda_below_model_size(big_checkpoint):
    """The device may hold less than the model: non-expert weights + slots + 512 MB of workspace, KV cache
    and CUDA context. Offloading still runs, token-identical to a full load (on the unconstrained device)."""
    full, = _run_children(big_checkpoint, [["full", "cuda"]])
    from expertcast.inference.runtime.loading import plan_offload

    plan = plan_offload(big_checkpoint, 0.25, device="cuda")
    allowed = plan.non_expert_bytes + plan.slot_bytes + 512 * MB
    model_bytes = plan.non_expert_bytes + plan.expert_bytes_total
    assert allowed < model_bytes
    total = torch.cuda.get_device_properties(0).total_memory
    off, = _run_children(big_checkpoint, [["offload", "cuda", str(allowed / total)]])
    figures = _check_offloaded(off, full)
    device_peak = max(figures["device_peak_bytes"], off["memory"]["device_peak_allocated"])  # load, generate
    assert device_peak <= allowed, (device_peak / MB, allowed / MB)
    assert off["memory"]["host_pinned"]
    print("FIGURES " + json.dumps({**figures, "device_peak_bytes": device_peak, "device_allowed_bytes": allowed,
                                   "model_bytes": model_bytes}))
