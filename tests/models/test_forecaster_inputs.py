"""The per-expert selection probabilities (:func:`activation_probs`): the Newton solve gives the probabilities of
the bisection it replaced (kept here only as the reference) up to float32 rounding, with the same top-K sets, on
flat, peaked, underflowing, tied and temperature-scaled logits."""

from __future__ import annotations

import pytest
import torch
from expertcast.models.forecaster_components import COMPONENT_SCALE
from expertcast.models.forecaster_inputs import LAMBDA_CAP, activation_probs

torch.set_num_threads(1)


def _bisection_probs(logits: torch.Tensor, top_k: int, temperature: float | torch.Tensor = 1.0,
                     iters: int = 40) -> torch.Tensor:
    """The former implementation: lambda grown (x4, at most 60 times) until the sum reaches K, then 40 bisection
    steps in float32; the upper end is the result."""
    w = torch.softmax(logits.float() / temperature, dim=-1)
    if top_k >= w.shape[-1]:
        return torch.ones_like(w)
    lo = torch.zeros(w.shape[:-1] + (1,))
    hi = torch.ones_like(lo)
    for _ in range(60):
        done = (1 - torch.exp(-hi * w)).sum(-1, keepdim=True) >= top_k
        if bool(done.all()):
            break
        hi = torch.where(done, hi, hi * 4)
    for _ in range(iters):
        mid = (lo + hi) / 2
        big = (1 - torch.exp(-mid * w)).sum(-1, keepdim=True) > top_k
        hi = torch.where(big, mid, hi)
        lo = torch.where(big, lo, mid)
    return 1 - torch.exp(-hi * w)


def _cases() -> dict[str, tuple[torch.Tensor, int, float | torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    cases: dict[str, tuple[torch.Tensor, int, float | torch.Tensor]] = {}
    for scale in (0.01, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0):  # flat to underflowing (w = 0 beyond ~104 apart)
        cases[f"randn x{scale:g}"] = (torch.randn(8, 8, 4, 32, generator=g) * scale, 4, 1.0)
    freq = torch.rand(8, 8, 4, 32, generator=g) * (torch.rand(8, 8, 4, 32, generator=g) < 0.3)
    freq = freq / freq.sum(-1, keepdim=True).clamp_min(1e-9)
    cases["component scores (ties, zeros)"] = (COMPONENT_SCALE * freq, 4, 1.0)
    prior = torch.log(torch.rand(8, 8, 4, 32, generator=g).clamp_min(1e-12))
    cases["component + log prior"] = (COMPONENT_SCALE * freq + prior, 4, 1.0)
    cases["per-head temperatures"] = (torch.randn(8, 8, 4, 32, generator=g) * 3,
                                      4, torch.tensor([0.3, 0.5, 1.0, 2.0, 3.0, 1.0, 1.0, 7.0]).view(8, 1, 1))
    cases["uniform"] = (torch.zeros(3, 8), 2, 1.0)
    cases["E = K + 1"] = (torch.randn(16, 5, generator=g) * 5, 4, 1.0)
    few = torch.full((4, 16), -1000.0)
    few[0, :2] = 0.0  # 2 experts of nonzero weight, K = 3: the sum never reaches K
    few[1, :3] = torch.tensor([0.0, -1.0, -2.0])  # exactly K
    few[2, :4] = torch.tensor([0.0, -1.0, -2.0, -3.0])  # K + 1
    few[3] = torch.randn(16, generator=g)
    cases["at most K nonzero"] = (few, 3, 1.0)
    return cases


@pytest.mark.parametrize("name", list(_cases()))
def test_activation_probs_equal_the_bisection_up_to_float32_rounding(name):
    logits, k, temp = _cases()[name]
    new = activation_probs(logits, k, temp)
    old = _bisection_probs(logits, k, temp)
    assert new.dtype == torch.float32 and new.shape == logits.shape
    assert (new - old).abs().max() <= 1e-6, name
    # the same top-K sets wherever the old K-th and (K+1)-th probabilities are not (nearly) tied
    srt = old.sort(-1, descending=True).values
    clear = (srt[..., k - 1] - srt[..., k]) > 1e-6 if k < logits.shape[-1] else torch.ones(logits.shape[:-1], dtype=bool)
    a = new.topk(k, dim=-1).indices.sort(-1).values
    b = old.topk(k, dim=-1).indices.sort(-1).values
    assert torch.equal(a[clear], b[clear]), name
    assert bool(clear.any()) or name == "uniform", name  # the comparison is not vacuous (uniform: all tied)


def test_activation_probs_sum_to_k_and_cap_layers_that_cannot():
    g = torch.Generator().manual_seed(1)
    lg = torch.randn(64, 4, 32, generator=g) * 8
    p = activation_probs(lg, 4)
    assert torch.allclose(p.sum(-1), torch.full((64, 4), 4.0), atol=2e-5)
    few = torch.full((1, 16), -1000.0)
    few[0, :2] = 0.0
    p = activation_probs(few, 3)  # lambda at LAMBDA_CAP: the two experts certain, the rest never
    assert torch.equal(p, (few > -1).float())
    assert LAMBDA_CAP == 4.0 ** 60


def test_activation_probs_converge_in_few_newton_steps():
    g = torch.Generator().manual_seed(2)
    for scale in (0.1, 1.0, 10.0):
        lg = torch.randn(8, 8, 4, 32, generator=g) * scale
        # 12 steps already give the converged answer (the bisection took up to 100 rounds)
        assert torch.equal(activation_probs(lg, 4, max_iters=12), activation_probs(lg, 4))


@pytest.mark.parametrize("name", list(_cases()))
def test_inclusion_probs_in_numpy_equal_activation_probs(name):
    """The numpy path (the re-plan's, on the host within a decode step) gives activation_probs's probabilities of
    the same weights up to float32 rounding: the same start, Newton steps and stop, every case of the reference."""
    import numpy as np
    from expertcast.models.forecaster_inputs import inclusion_probs

    logits, k, temp = _cases()[name]
    ref = activation_probs(logits, k, temp)
    w = torch.softmax(logits.float() / temp, dim=-1).numpy()
    got = inclusion_probs(w, k)
    assert got.dtype == np.float32 and got.shape == tuple(logits.shape)
    assert np.abs(got - ref.numpy()).max() <= 1e-6, name
    assert np.allclose(got.sum(-1), ref.numpy().sum(-1), atol=2e-5)
