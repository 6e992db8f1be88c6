"""The post-fit calibration (train/forecaster_calibration.py): the coarse-to-fine temperature search against the
exhaustive one it replaces; the selection's test (Student's t quantile, the clusters' standard error, the rule)."""

from __future__ import annotations

import itertools

import pytest
import torch
from expertcast.train.forecaster_calibration import (
    SELECT_BLOCK,
    TEMPERATURE_GRID_POINTS,
    PairedRecall,
    block_sums,
    choose_selection,
    fit_temperature,
    grid_argmin,
    t_cdf,
    t_quantile,
)


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


# ---------------------------------------------------------------------------------------------- the selection's test
@pytest.mark.parametrize("dof,q,exact", [(1, 0.975, 12.7062), (2, 0.975, 4.3027), (3, 0.975, 3.1824),
                                         (4, 0.975, 2.7764), (9, 0.975, 2.2622), (29, 0.975, 2.0452),
                                         (3, 0.99, 4.5407), (5, 0.95, 2.0150), (3, 0.999, 10.2145),
                                         (200, 0.975, 1.9719), (201, 0.975, 1.9718), (10**6, 0.975, 1.9600)])
def test_t_quantile_matches_the_tables(dof, q, exact):
    """Student's t quantiles as printed in statistical tables (4 decimals): exact up to T_EXACT_DOF degrees of
    freedom (the distribution function inverted), the expansion above."""
    assert t_quantile(q, dof) == pytest.approx(exact, abs=6e-5)
    assert t_cdf(1.0, 1) == pytest.approx(0.75) and t_cdf(-0.7, 6) == pytest.approx(1 - t_cdf(0.7, 6))
    with pytest.raises(ValueError):
        t_quantile(0.3, 4)
    with pytest.raises(ValueError):
        t_quantile(0.975, 0)


def _stats(per_target: torch.Tensor, cluster: torch.Tensor) -> PairedRecall:
    """per_target [n, N, L] recall of N candidates (one head), cluster [n] its cluster ids."""
    n, N, L = per_target.shape
    G = int(cluster.max()) + 1
    sums = torch.zeros(G, N, L, dtype=torch.float64).index_add_(0, cluster, per_target.double())
    counts = torch.bincount(cluster, minlength=G)
    st = PairedRecall(1, N, L)
    st.add(0, sums, counts)
    return st


def test_paired_recall_gives_the_cluster_robust_standard_error_of_a_difference():
    """The kept sums give mean recall and, for any two candidates, sqrt(G / (G - 1) * sum_s (D_s - n_s d)^2) / n
    computed directly from the per-target differences; inf with one cluster, 0 for a candidate against itself."""
    g = torch.Generator().manual_seed(0)
    n, N, L = 300, 4, 3
    x = torch.rand(n, N, L, generator=g)
    cluster = torch.randint(0, 17, (n,), generator=g)
    st = _stats(x, cluster)
    assert torch.allclose(st.recall()[0], x.double().mean(0))
    a = torch.tensor([[0, 1, 3]])
    b = torch.tensor([[2, 1, 0]])
    se = st.stderr(a, b)[0]
    for li in range(L):
        d = x[:, a[0, li], li].double() - x[:, b[0, li], li].double()
        mean = d.mean()
        G = int(cluster.unique().numel())
        ss = sum(float((d[cluster == k] - mean).sum()) ** 2 for k in cluster.unique())
        want = (G / (G - 1) * ss) ** 0.5 / n
        assert float(se[li]) == pytest.approx(want, rel=1e-9) if a[0, li] != b[0, li] else float(se[li]) == 0.0
    one = _stats(x, torch.zeros(n, dtype=torch.long))
    assert torch.isinf(one.stderr(a, b)[0, 0]) and float(one.stderr(a, b)[0, 1]) == 0.0


def test_block_sums_cut_each_row_into_runs_of_consecutive_targets():
    B, W, N, L = 2, 2 * SELECT_BLOCK + 5, 3, 2
    use = torch.zeros(B, W, dtype=torch.bool)
    use[0, :W] = True
    use[1, : SELECT_BLOCK - 1] = True
    r = torch.rand(B, W, N, L, dtype=torch.float64) * use.view(B, W, 1, 1)
    sums, counts = block_sums(r, use)
    assert sums.shape == (B * 3, N, L) and counts.tolist() == [SELECT_BLOCK, SELECT_BLOCK, 5, SELECT_BLOCK - 1, 0, 0]
    assert torch.allclose(sums[1], r[0, SELECT_BLOCK: 2 * SELECT_BLOCK].sum(0))
    assert torch.allclose(sums.sum(0), r.sum((0, 1)))
    # head j's slice [:, j:] of a wider batch, its width a multiple of the block (no padding): not a view's shape
    wide = torch.ones(B, 2 * SELECT_BLOCK + 1, dtype=torch.bool)
    sums, counts = block_sums(torch.ones(B, 2 * SELECT_BLOCK, N, L, dtype=torch.float64), wide[:, 1:])
    assert counts.tolist() == [SELECT_BLOCK] * 4 and float(sums.sum()) == B * 2 * SELECT_BLOCK * N * L


def _candidates(n_clusters: int, per_cluster: int, gain: float, noise: float, seed: int = 0,
                learned_gain: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target recall of 1 learned candidate then 3 components at 2 layers: component 0 is the best over both
    layers (the default); at layer 1 component 2 scores ``gain`` above it on average, with each cluster's own offset of
    sd ``noise`` (the clusters' own luck); the learned part is level with the default but ``learned_gain`` above it at
    layer 0."""
    g = torch.Generator().manual_seed(seed)
    n = n_clusters * per_cluster
    base = torch.full((n, 4, 2), 0.5, dtype=torch.float64)
    base[:, 1:, :] -= torch.tensor([[0.0, 0.2, 0.25]]).T.double()  # default, then two weaker components
    cl = torch.arange(n) // per_cluster
    luck = torch.randn(n_clusters, generator=g, dtype=torch.float64)[cl] * noise
    base[:, 3, 1] = 0.5 + gain + luck  # component 2 at layer 1
    base[:, 0, 0] = 0.5 + learned_gain
    return base.clamp(0, 1), cl


def test_one_cluster_never_leaves_the_head_default_component():
    """One held-out run of targets (granite's one validation prompt): however large a layer's gain there, no layer
    issues another component (confidence 0.975); with no test (0), each layer takes its best. The learned part, one
    alternative fixed in advance, is kept by the margin alone in both."""
    x, cl = _candidates(1, 60, gain=0.1, noise=0.0, learned_gain=0.05)
    st = _stats(x, cl)
    pick = choose_selection(st, alphas=1)
    assert pick["default"].tolist() == [0]
    assert pick["component"].tolist() == [[0, 0]] and pick["keep"].tolist() == [[True, False]]
    old = choose_selection(st, alphas=1, confidence=0)
    assert old["component"].tolist() == [[0, 2]] and old["keep"].tolist() == [[True, False]]
    x, cl = _candidates(1, 60, gain=0.1, noise=0.0, learned_gain=0.001)  # inside the margin: not kept
    assert not bool(choose_selection(_stats(x, cl), alphas=1)["keep"].any())


def test_a_component_switch_passes_the_test_where_the_clusters_agree_and_not_where_their_luck_explains_it():
    """20 clusters: a 4-point gain of component 2 at layer 1 with little spread across clusters leaves the default;
    the same gain under a cluster spread of 40 points (before clipping to [0, 1]) does not."""
    x, cl = _candidates(20, 30, gain=0.04, noise=0.01)
    pick = choose_selection(_stats(x, cl), alphas=1)
    assert pick["component"].tolist() == [[0, 2]] and not bool(pick["keep"].any())
    x, cl = _candidates(20, 30, gain=0.04, noise=0.4, seed=1)
    pick = choose_selection(_stats(x, cl), alphas=1)
    assert pick["component"].tolist() == [[0, 0]]
    assert choose_selection(_stats(x, cl), alphas=1, confidence=0)["component"].tolist() == [[0, 2]]
