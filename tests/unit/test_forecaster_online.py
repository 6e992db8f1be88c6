"""Online statistics inside the forecaster: the moving-average scan, recurrent == windowed, state rows, and the
zero-learned-part forecaster ranking experts exactly like the online baselines."""

from __future__ import annotations

import pytest
import torch
from expertcast.models.forecaster import (
    ExpertForecaster,
    ForecasterConfig,
    ForecasterState,
    activation_vector,
    ema_scan,
)

torch.set_num_threads(1)


def _cfg(**kw) -> ForecasterConfig:
    base = dict(num_layers=3, num_experts=8, top_k=2, hidden_size=32, head_dim=16, state_size=8, chunk_size=8,
                num_blocks=1, online_half_lives=[0.0, 2.0, 8.0])
    base.update(kw)
    return ForecasterConfig(**base)


def _inputs(B: int, T: int, L: int = 3, E: int = 8, K: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)]).view(B, T, L, K)
    return activation_vector(ids, torch.rand(B, T, L, K, generator=g), E)


def test_ema_scan_matches_the_recurrence_across_chunks_and_from_a_state():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 13, 5, generator=g)
    decays = torch.tensor([0.0, 0.5, 0.9])
    prev = torch.rand(2, 3, 5, generator=g)
    out = ema_scan(x, decays, prev, chunk=4)
    e = prev.clone()
    for t in range(13):
        e = decays.view(1, 3, 1) * e + (1 - decays).view(1, 3, 1) * x[:, t].unsqueeze(1)
        assert torch.allclose(out[:, t], e, atol=1e-5)
    assert torch.equal(out[:, :, 0], x)  # decay 0: the last element itself


@pytest.mark.parametrize("backbone", ["mamba2", "mamba"])
def test_online_window_forward_equals_recurrent_steps(backbone):
    m = ExpertForecaster(_cfg(backbone=backbone, direct_horizons=2))
    torch.nn.init.normal_(m.head.weight, std=0.1)  # a non-zero learned part too
    with torch.no_grad():
        m.online.mix.normal_()
    m.eval()
    x = _inputs(2, 11)
    with torch.no_grad():
        full = m(x, all_horizons=True)
        st = m.init_state(2)
        stepped = torch.stack([m.step(x[:, i], st, all_horizons=True)[0] for i in range(11)], dim=1)
        assert torch.allclose(stepped, full, atol=1e-4)
        st2 = m.init_state(2)
        a, b = m(x[:, :5], st2, all_horizons=True), m(x[:, 5:], st2, all_horizons=True)
        assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-4)
        assert torch.allclose(st2.online, st.online, atol=1e-6)


def test_online_statistics_travel_with_state_rows():
    m = ExpertForecaster(_cfg()).eval()
    x = _inputs(3, 5)
    st = m.init_state(3)
    for i in range(5):
        m.step(x[:, i], st)
    sub = st.select([2, 0])
    assert torch.equal(sub.online, st.online[[2, 0]])
    nxt, _ = m.step(x[[2, 0], 0], sub)
    ref, _ = m.step(x[:, 0], st.clone())
    assert torch.allclose(nxt, ref[[2, 0]], atol=1e-6)
    st.put_rows([1], sub.select([0]))
    assert torch.equal(st.online[1], sub.online[0])
    st.reset_rows([0])
    assert not st.online[0].any()
    assert ForecasterState.cat([st, sub]).online.shape[0] == 5
    # rollout restores the online statistics too
    lg, _ = m.step(x[:, 1], st)
    saved = st.online.clone()
    m.rollout(lg, st, horizon=4)
    assert torch.equal(st.online, saved)


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.topk(k, dim=-1).indices.sort(-1).values


def test_zero_learned_part_ranks_like_the_online_baselines():
    """At initialisation (learned head zero) the forecast is the online prior: with its mixture on the last
    selection it is repeat-last; on one moving average it ranks like that sequence's recent frequency."""
    m = ExpertForecaster(_cfg(top_k=3)).eval()
    x = _inputs(2, 9, K=3, seed=3)
    with torch.no_grad():
        m.online.mix.zero_()
        m.online.mix[..., 0] = 30.0  # the last selection
        lg = m(x)
        assert torch.equal(_top(lg, 3), _top(x, 3))
        m.online.mix.zero_()
        m.online.mix[..., 2] = 30.0  # the half-life-8 moving average
        lg = m(x)
    d = 0.5 ** (1 / 8)
    ema = torch.zeros(2, 3, 8)
    for t in range(9):
        ema = d * ema + (1 - d) * x[:, t]
        assert torch.equal(_top(lg[:, t], 3), _top(ema, 3))


def test_online_config_is_validated_and_old_configs_load_without_it():
    with pytest.raises(ValueError, match="online_half_lives"):
        _cfg(online_half_lives=[2.0, 2.0])
    with pytest.raises(ValueError, match="online_half_lives"):
        _cfg(online_half_lives=[-1.0])
    old = _cfg().to_dict()
    old.pop("online_half_lives")
    assert ForecasterConfig.from_dict(old).online_half_lives == []
    assert ExpertForecaster(ForecasterConfig.from_dict(old)).online is None
