"""Test-suite settings (offline hub and W&B, the shared data directory, GPU tests skipped without CUDA) and the
shared fixtures: a tiny forecaster config, random activation vectors, an offline W&B folder with a reader of its
runs, and a runner of `expertcast router-eval`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported lazily: huggingface_hub reads HF_HUB_OFFLINE when it is first imported
    import torch
    from expertcast.models.forecaster import ForecasterConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
if "EXPERTCAST_DATA_DIR" not in os.environ and (REPO.parent / "shared" / "data").is_dir():
    os.environ["EXPERTCAST_DATA_DIR"] = str(REPO.parent / "shared" / "data")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def data_dir() -> Path:
    d = os.environ.get("EXPERTCAST_DATA_DIR")
    if not d or not Path(d).is_dir():
        pytest.fail("benchmark data not found: set EXPERTCAST_DATA_DIR or keep ../shared/data beside the repo")
    return Path(d)



@pytest.fixture
def tiny_forecaster_cfg() -> Callable[..., ForecasterConfig]:
    """``make(**overrides)`` -> a tiny :class:`ForecasterConfig` (L=3, E=8, K=2, d=32, 2 Mamba2 blocks)."""

    from expertcast.models.forecaster import ForecasterConfig

    def make(**kw) -> ForecasterConfig:
        base = dict(num_layers=3, num_experts=8, top_k=2, hidden_size=32, head_dim=16, state_size=8, chunk_size=8,
                    num_blocks=2)
        base.update(kw)
        return ForecasterConfig(**base)

    return make


@pytest.fixture
def activation_inputs() -> Callable[..., torch.Tensor]:
    """``make(B, T, L=3, E=8, K=2, seed=0)`` -> float [B, T, L, E] activation vectors of random top-K routing
    (distinct experts per layer, random weights), the same for the same arguments."""

    import torch
    from expertcast.models.forecaster import activation_vector

    def make(B: int, T: int, L: int = 3, E: int = 8, K: int = 2, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)]).view(B, T, L, K)
        return activation_vector(ids, torch.rand(B, T, L, K, generator=g), E)

    return make


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch) -> Path:
    """An empty folder that W&B (offline, silent) writes its runs, cache and data into for this test."""
    d = tmp_path / "wb"
    d.mkdir()
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(d), "WANDB_SILENT": "true",
                 "WANDB_CACHE_DIR": str(d / "cache"), "WANDB_DATA_DIR": str(d / "data")}.items():
        monkeypatch.setenv(k, v)
    return d


@pytest.fixture
def offline_contents() -> Callable[..., dict]:
    """``read(run_dir, ready)`` -> the offline run's contents (``offline_run_contents``) once ``ready(contents)``
    holds, or after 60 s (wandb's service may still be writing its log on a loaded machine)."""
    from expertcast.utils.tracking import offline_run_contents

    def read(run: Path, ready: Callable[[dict], object]) -> dict:
        for _ in range(240):
            got = offline_run_contents(run)
            if ready(got):
                break
            time.sleep(0.25)
        return got

    return read


@pytest.fixture
def run_router_eval(capsys) -> Callable[[list[str]], tuple[int, list[str]]]:
    """``run(argv)`` -> (exit status, stderr lines) of ``expertcast router-eval argv`` in this process (an argparse
    exit counts as its status)."""
    from expertcast.commands.router_eval import main

    def run(argv: list[str]) -> tuple[int, list[str]]:
        capsys.readouterr()
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        return rc, capsys.readouterr().err.strip().splitlines()

    return run


@pytest.fixture(scope="session")
def write_tiled_checkpoint() -> Callable[..., None]:
    """``write(d, **sizes)``: ``save_pretrained`` (model + byte-level tokenizer) of a random-weight qwen3_moe-tiny of
    ``sizes``, one random block tiled into every matrix (norms 1): writing a GB of normal samples would dominate a
    test's time."""

    def write(d: Path, **sizes) -> None:
        import torch
        from expertcast.inference.runtime.loading import build_skeleton
        from expertcast.models.presets import get_config
        from expertcast.models.tokenizer import byte_level_tokenizer

        model = build_skeleton(get_config("qwen3_moe-tiny", **sizes), torch.float32)
        model.to_empty(device="cpu")
        block = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.05
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                flat = p.view(-1)
                if p.ndim == 1:
                    flat.fill_(1.0)  # norms
                    continue
                done, start = 0, (i * 7919) % 4096
                while done < flat.numel():
                    n = min(flat.numel() - done, block.numel() - start)
                    flat[done:done + n].copy_(block[start:start + n])
                    done, start = done + n, 0
        model.save_pretrained(d)
        byte_level_tokenizer(model_max_length=512).save_pretrained(d)

    return write


@pytest.fixture(scope="session")
def load_script() -> Callable[[str], object]:
    """``load_script("bench_disk")``: the module of ``scripts/bench_disk.py`` (scripts are not a package), loaded
    fresh."""
    import importlib.util

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"{name}_script", REPO / "scripts" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load
