"""Forecaster placement: a CPU-resident forecaster is never handed the Mamba CUDA kernels, even when
mamba-ssm and causal-conv1d are importable.

No real mamba-ssm runs on a CPU machine, so "importable" is simulated: a subprocess puts fake
``mamba_ssm``/``causal_conv1d`` packages first on its path whose every kernel raises when called.
transformers resolves them as the kernels (the test checks it did), so this tests the dispatch of
:mod:`expertcast.models.mamba_kernels`, not the kernels themselves (scripts/gpu_check.sh runs those).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

KERNELS = {
    "mamba_ssm/ops/triton/ssd_combined.py": ["mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined"],
    "mamba_ssm/ops/triton/selective_state_update.py": ["selective_state_update"],
    "mamba_ssm/ops/selective_scan_interface.py": ["mamba_inner_fn", "selective_scan_fn"],
    "causal_conv1d/__init__.py": ["causal_conv1d_fn", "causal_conv1d_update"],
}

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from unit.test_forecaster_placement import forecaster_outputs
    from expertcast.models import mamba_kernels
    outs = {{b: forecaster_outputs(b) for b in ("mamba2", "mamba")}}
    torch.save(outs, {out!r})
    print(json.dumps({{"status": mamba_kernels.install(), "calls": mamba_kernels.calls()}}))
""")


def forecaster_outputs(backbone: str) -> dict[str, torch.Tensor]:
    """Training forward, eval forward, one recurrent step and a rollout of a seeded tiny forecaster on CPU."""
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig

    torch.manual_seed(0)
    cfg = ForecasterConfig(num_layers=3, num_experts=8, top_k=2, hidden_size=32, head_dim=16, state_size=8,
                           chunk_size=8, num_blocks=2, backbone=backbone)
    m = ExpertForecaster(cfg)
    x = torch.rand(2, 6, 3, 8)
    m.train()
    out = {"train": m(x).detach()}
    m.eval()
    with torch.no_grad():
        out["eval"] = m(x)
        state = m.init_state(2)
        logits, _ = m.step(x[:, 0], state, all_horizons=True)
        out["step"], out["rollout"] = logits, m.rollout(logits, state, 3)
    return out


def _fake_kernels(root) -> None:
    for rel, names in KERNELS.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        for d in [f.parent, *f.parent.parents]:
            if d == root:
                break
            (d / "__init__.py").touch()
        body = "".join(f"def {n}(*args, **kwargs):\n    raise RuntimeError('CUDA kernel {n} called')\n" for n in names)
        f.write_text(f.read_text() + body if f.exists() else body)


def test_cpu_forecaster_with_kernels_importable_equals_without(tmp_path):
    import json

    fake = tmp_path / "site"
    _fake_kernels(fake)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests, out=str(tmp_path / "out.pt"))], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    # the fakes were taken for kernels (else this test would prove nothing) ...
    assert report["status"]["modeling_mamba2.mamba2_chunk_scan"] and report["status"]["modeling_mamba.mamba_selective_scan"]
    assert report["status"]["modeling_mamba2.causal_conv1d_fn"]
    # ... and never called: every call of the CPU forecaster took the PyTorch path
    assert report["calls"] and not [k for k in report["calls"] if k.endswith(":kernel")]
    with_kernels = torch.load(tmp_path / "out.pt")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for backbone, outs in with_kernels.items():
            ref = forecaster_outputs(backbone)
            for name, t in outs.items():
                assert torch.equal(t, ref[name]), (backbone, name)
    finally:
        torch.set_num_threads(n)


def test_dispatch_counts_the_torch_path_here():
    from expertcast.models import mamba_kernels

    status = mamba_kernels.install()
    assert status and set(status) >= {"modeling_mamba2.mamba2_chunk_scan", "modeling_mamba.mamba_selective_scan"}
    mamba_kernels.reset_calls()
    forecaster_outputs("mamba2")
    calls = mamba_kernels.calls()
    assert calls.get("mamba2_chunk_scan:torch", 0) > 0 and calls.get("mamba2_selective_state_update:torch", 0) > 0
    assert mamba_kernels.install() == status  # idempotent: wrapped once


@pytest.mark.gpu
def test_cuda_forecaster_uses_the_kernels_when_installed():
    """On CUDA with mamba-ssm installed every dispatched call is a kernel call; outputs match the CPU's."""
    from expertcast.models import mamba_kernels
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig

    status = mamba_kernels.install()
    if not status["modeling_mamba2.mamba2_chunk_scan"]:
        pytest.skip("mamba-ssm is not installed (pip install -e '.[gpu]')")
    torch.manual_seed(0)
    cfg = ForecasterConfig(num_layers=3, num_experts=8, top_k=2, hidden_size=64, head_dim=32, state_size=16,
                           chunk_size=8, num_blocks=2)
    m = ExpertForecaster(cfg).eval()
    x = torch.rand(2, 16, 3, 8)
    with torch.no_grad():
        ref = m(x)
        mamba_kernels.reset_calls()
        got = m.cuda()(x.cuda()).cpu()
    calls = mamba_kernels.calls()
    assert calls.get("mamba2_chunk_scan:kernel", 0) > 0 and not calls.get("mamba2_chunk_scan:torch")
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)


def test_worker_stream_only_on_cuda():
    from expertcast.inference.policies.async_forecast import forecaster_stream

    with forecaster_stream("cpu") as s:
        assert s is None


@pytest.mark.gpu
def test_worker_stream_is_its_own_on_cuda():
    from expertcast.inference.policies.async_forecast import forecaster_stream

    with forecaster_stream("cuda") as s:
        assert s is not None and torch.cuda.current_stream() == s and s != torch.cuda.default_stream()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
