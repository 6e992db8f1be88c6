"""Test-suite settings: offline hub and W&B, the shared data directory, GPU tests skipped without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
