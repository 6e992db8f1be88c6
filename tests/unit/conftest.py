"""Fixtures shared by the forecaster unit tests: a tiny forecaster config and random activation vectors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from expertcast.models.forecaster import ForecasterConfig, activation_vector


@pytest.fixture
def tiny_forecaster_cfg() -> Callable[..., ForecasterConfig]:
    """``make(**overrides)`` -> a tiny :class:`ForecasterConfig` (L=3, E=8, K=2, d=32, 2 Mamba2 blocks)."""

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

    def make(B: int, T: int, L: int = 3, E: int = 8, K: int = 2, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)]).view(B, T, L, K)
        return activation_vector(ids, torch.rand(B, T, L, K, generator=g), E)

    return make
