"""CUDA path of the runtime (marker ``gpu``; skipped without CUDA): pinned host store, copies on a side
stream ordered by events, device memory holding only the slots and the non-expert weights, greedy
generations equal to the full-load model, and the benchmark script on CUDA (one summary line).

Self-contained: tiny presets built from transformers configs, no downloads.

    pytest -m gpu tests/inference/runtime/test_engine_cuda.py -q -s
"""

from __future__ import annotations

import json

import pytest
import torch
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.runtime.transfer import CudaTransferEngine
from expertcast.models.presets import build_tiny

pytestmark = pytest.mark.gpu


def _prompts(device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (2, 9), generator=g)
    am = torch.ones_like(ids)
    am[1, :3] = 0
    ids[1, :3] = 0
    return ids.to(device), am.to(device)


@pytest.mark.parametrize("preset", ["qwen3_moe-tiny", "gpt_oss-tiny"])
def test_cuda_offloaded_generation_equals_full_load(preset):
    dev = torch.device("cuda")
    full = build_tiny(preset, seed=0).to(dev)
    ids, am = _prompts(dev)
    ref = full.generate(ids, attention_mask=am, max_new_tokens=12, do_sample=False, eos_token_id=None,
                        pad_token_id=0)
    K = full.config.num_experts_per_tok
    del full
    torch.cuda.empty_cache()
    for name, pool in (("lru", "per-layer"), ("lfu", "shared")):
        model = build_tiny(preset, seed=0)  # built on the host: the experts never reach the device whole
        om = OffloadedModel(model, make_policy(name), K, pool=pool, device=dev)
        assert isinstance(om.transfer, CudaTransferEngine) and om.store.is_pinned
        out = om.generate(ids, am, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
        assert torch.equal(out.sequences, ref), (preset, name, pool)
        assert om.stats.D > 0 and om.transfer.transfers > 0
        m = om.memory_report()
        assert m.device_expert_param_bytes == 0
        # everything the device ever held: non-expert weights + slots + workspace + small activations/KV
        assert m.device_peak_allocated <= m.device_total + 4 * 2**20, m.to_dict()
        om.close()


def test_cuda_side_stream_copies_are_ordered():
    """A prefetch into a slot lands before the compute stream reads it, with no host sync in between."""
    dev = torch.device("cuda")
    eng = CudaTransferEngine(dev)
    src = torch.arange(1 << 22, dtype=torch.float32).pin_memory()
    dst = torch.zeros(1 << 22, device=dev)
    tr = eng.submit((0, 0), src, dst, slot=0)
    eng.wait(tr)  # the current stream waits for the event
    total = dst.sum()  # enqueued after the wait: sees the landed bytes
    assert float(total) == float(src.double().sum())
    assert eng.done(tr) and eng.bytes_moved == src.numel() * 4


def test_cuda_benchmark_line(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "scripts" / "bench_runtime.py"
    spec = importlib.util.spec_from_file_location("bench_runtime", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(["--device", "cuda", "--quick", "--tokens", "16", "--repeats", "1", "--policies", "lru", "static",
                     "--train-forecaster-epochs", "0", "--out", str(tmp_path)])
    assert rc == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["device"].startswith("cuda") and s["full_tokens_per_s"] > 0
    assert "bench_runtime cuda:" in capsys.readouterr().out
