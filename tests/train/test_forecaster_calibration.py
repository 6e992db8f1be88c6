"""The post-fit calibration's search (train/forecaster_calibration.py): the coarse-to-fine temperature search
against the exhaustive one it replaces."""

from __future__ import annotations

import itertools

import pytest
import torch
from expertcast.train.forecaster_calibration import TEMPERATURE_GRID_POINTS, fit_temperature, grid_argmin


def _exhaustive(values: list[float]) -> tuple[int, float]:
    i = min(range(len(values)), key=lambda k: (values[k], k))
    return i, values[i]


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9, 17, 49, 50])
def test_grid_argmin_is_the_exhaustive_first_minimum_of_a_unimodal_function(n):
    """Valleys at every position, steep or shallow, with flat bottoms (ties: the first index wins, as in a scan)."""
    for centre, width, shape in itertools.product(range(n), (0, 1, 3), ("v", "bowl")):
        def f(i, c=centre, w=width, s=shape):
            d = max(0, abs(i - c) - w)
            return float(d) if s == "v" else d * d / 7.0
        calls = []
        i, v = grid_argmin(lambda k, calls=calls, f=f: calls.append(k) or f(k), n)
        assert (i, v) == _exhaustive([f(k) for k in range(n)]), (n, centre, width, shape)
        assert len(calls) == len(set(calls)), "an index evaluated twice"
        if n == TEMPERATURE_GRID_POINTS:
            assert len(calls) <= 13


def test_grid_argmin_assumes_a_unimodal_function():
    """A dip narrower than the coarse stride, or a valley below a plateau the coarse points all fall on, is missed:
    the limit the docstring states (the exhaustive search finds it)."""
    values = [1.0] * 49
    values[3] = 0.0
    values[40] = 0.5
    i, v = grid_argmin(values.__getitem__, 49)
    assert (i, v) == (40, 0.5)
    assert _exhaustive(values) == (3, 0.0)
    plateau = [float(min(abs(k - 20), 4)) for k in range(49)]  # flat at 4 on every coarse point
    assert grid_argmin(plateau.__getitem__, 49) == (0, 4.0)
    assert _exhaustive(plateau) == (20, 0.0)


def test_grid_argmin_refuses_an_empty_grid():
    with pytest.raises(ValueError, match="empty grid"):
        grid_argmin(float, 0)


@pytest.mark.parametrize("seed", range(6))
def test_fit_temperature_coarse_to_fine_equals_the_exhaustive_search(seed):
    """Forecaster-like logits (true experts lifted by a signal of random strength, Gaussian noise, a random scale, so
    that the best temperature falls anywhere on the grid): the coarse-to-fine search returns the exhaustive one's
    temperature and loss."""
    g = torch.Generator().manual_seed(seed)
    N, L, E, K = 300, 4, 32, 4
    target = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N * L)]).view(N, L, K)
    member = torch.zeros(N, L, E).scatter_(-1, target, 1.0)
    signal = float(torch.rand(1, generator=g)) * 3
    scale = float(torch.exp(torch.empty(1).uniform_(-2.5, 2.5, generator=g)))
    logits = scale * (signal * member + torch.randn(N, L, E, generator=g))
    fast = fit_temperature(logits, target, K)
    slow = fit_temperature(logits, target, K, exhaustive=True)
    assert fast == slow, (seed, fast, slow)
