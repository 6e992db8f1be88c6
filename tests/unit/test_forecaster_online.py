"""Online statistics inside the forecaster: the moving-average scan, recurrent == windowed, state rows, the
zero-learned-part forecaster ranking experts exactly like the online baselines, and the per-sequence weighting of
the sources (hedge): its scores, and that it follows each sequence's better source."""

from __future__ import annotations

import pytest
import torch
from expertcast.models.forecaster import (
    ExpertForecaster,
    ForecasterConfig,
    ForecasterState,
    OnlinePrior,
    activation_vector,
    ema_scan,
)

torch.set_num_threads(1)


@pytest.fixture
def online_cfg(tiny_forecaster_cfg):
    """The tiny config with one block and online statistics of half-lives 0, 2 and 8 (overridable)."""

    def make(**kw):
        return tiny_forecaster_cfg(**{"num_blocks": 1, "online_half_lives": [0.0, 2.0, 8.0], **kw})

    return make


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


@pytest.mark.parametrize("backbone,hedge,gate", [("mamba2", 0.0, 0.0), ("mamba", 0.0, 0.0), ("mamba2", 1.5, 0.0),
                                                 ("mamba2", 0.0, 2.0), ("mamba", 1.5, 2.0)])
def test_online_window_forward_equals_recurrent_steps(backbone, hedge, gate, online_cfg, activation_inputs):
    m = ExpertForecaster(online_cfg(backbone=backbone, direct_horizons=2, online_hedge_rate=hedge, online_hedge_half_life=4.0,
                                    learned_gate_rate=gate))
    torch.nn.init.normal_(m.head.weight, std=0.1)  # a non-zero learned part too
    with torch.no_grad():
        m.online.mix.normal_()
    m.eval()
    x = activation_inputs(2, 11)
    with torch.no_grad():
        full = m(x, all_horizons=True)
        st = m.init_state(2)
        stepped = torch.stack([m.step(x[:, i], st, all_horizons=True)[0] for i in range(11)], dim=1)
        assert torch.allclose(stepped, full, atol=1e-4)
        st2 = m.init_state(2)
        a, b = m(x[:, :5], st2, all_horizons=True), m(x[:, 5:], st2, all_horizons=True)
        assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-4)
        assert torch.allclose(st2.online, st.online, atol=1e-6)
        for a, b in zip(st2.hedge or [], st.hedge or [], strict=True):
            assert torch.allclose(a, b, atol=1e-5)


def test_online_statistics_travel_with_state_rows(online_cfg, activation_inputs):
    m = ExpertForecaster(online_cfg(online_hedge_rate=1.0, learned_gate_rate=1.0)).eval()
    x = activation_inputs(3, 5)
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
    assert not st.online[0].any() and not any(t[0].any() for t in st.hedge)
    assert ForecasterState.cat([st, sub]).online.shape[0] == 5
    assert [t.shape[0] for t in ForecasterState.cat([st, sub]).hedge] == [5] * 6
    # rollout restores the online statistics too
    lg, _ = m.step(x[:, 1], st)
    saved = [t.clone() for t in [st.online] + st.hedge]
    m.rollout(lg, st, horizon=4)
    assert all(torch.equal(a, b) for a, b in zip([st.online] + st.hedge, saved, strict=True))


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.topk(k, dim=-1).indices.sort(-1).values


def test_zero_learned_part_ranks_like_the_online_baselines(online_cfg, activation_inputs):
    """At initialisation (learned head zero) the forecast is the online prior: with its mixture on the last
    selection it is repeat-last; on one moving average it ranks like that sequence's recent frequency."""
    m = ExpertForecaster(online_cfg(top_k=3)).eval()
    x = activation_inputs(2, 9, K=3, seed=3)
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


def test_online_config_is_validated_and_old_configs_load_without_it(online_cfg):
    with pytest.raises(ValueError, match="online_half_lives"):
        online_cfg(online_half_lives=[2.0, 2.0])
    with pytest.raises(ValueError, match="online_half_lives"):
        online_cfg(online_half_lives=[-1.0])
    old = online_cfg().to_dict()
    old.pop("online_half_lives")
    assert ForecasterConfig.from_dict(old).online_half_lives == []
    assert ExpertForecaster(ForecasterConfig.from_dict(old)).online is None


def _support_recall(scores: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """Share of target's experts (> 0) in the top-k of scores: [..., L, E] x2 -> [...] (mean over layers)."""
    top = scores.topk(k, dim=-1).indices
    return (target > 0).gather(-1, top).float().sum(-1).div(k).mean(-1)


def test_hedge_scores_are_each_sources_discounted_recall_so_far(activation_inputs):
    L, E, K, H = 2, 8, 2, 3
    prior = OnlinePrior([0.0, 4.0], L, E, heads=H, top_k=K, hedge_rate=1.0, hedge_half_life=8.0)
    x = activation_inputs(2, 12, L=L, E=E, K=K, seed=5).flatten(-2)  # [B, T, L·E]
    with torch.no_grad():
        xs = torch.cat([x, torch.ones(2, 12, 1)], -1)
        ema = ema_scan(xs, prior.decays)
        freq = ema[..., :-1] / ema[..., -1:]
        got = prior._scores(x, freq, None)  # [B, T, H, M+1]
    d = 0.5 ** (1 / 8)
    want = torch.zeros_like(got)
    for t in range(12):
        for j in range(H):
            for s in range(j + 1, t + 1):  # element s resolves the forecast issued at s-j-1
                for m in range(2):
                    r = _support_recall(freq[:, s - j - 1, m].view(2, L, E), x[:, s].view(2, L, E), K)
                    want[:, t, j, m] += d ** (t - s) * r
                want[:, t, j, 2] += d ** (t - s) * K / E
    assert torch.allclose(got, want, atol=1e-5)


def _two_kinds(T: int, seed: int = 0) -> torch.Tensor:
    """[2, T, 1, 8] (K=2): row 0 a fixed pair {0, 1} with a random other pair 30% of the time (its long average
    forecasts it best), row 1 blocks of 6 steps on one random pair (the last selection forecasts it best)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(2, T, 1, 2, dtype=torch.long)
    for t in range(T):
        noisy = bool(torch.rand(1, generator=g) < 0.3)
        ids[0, t, 0] = 2 + torch.randperm(6, generator=g)[:2] if noisy else torch.tensor([0, 1])
        if t % 6 == 0:
            block = torch.randperm(8, generator=g)[:2]
        ids[1, t, 0] = block
    return activation_vector(ids, torch.ones(2, T, 1, 2), 8)


def test_hedge_moves_each_sequence_to_the_source_that_forecasts_it():
    """Equal mixture of the last selection and a half-life-32 average: without per-sequence weighting one fixed
    blend serves both kinds of sequence; with it each sequence's prior follows its own better source, so its
    recall after a warm-up reaches the better single source's and beats the fixed blend."""
    T, warm = 160, 40
    x = _two_kinds(T).flatten(-2)
    rec = {}
    for name, rate in {"fixed": 0.0, "hedge": 4.0}.items():
        prior = OnlinePrior([0.0, 32.0], 1, 8, heads=1, top_k=2, hedge_rate=rate)
        with torch.no_grad():
            lp = prior(x, None, 1)[:, :, 0]  # [2, T, 1, 8]
        rec[name] = _support_recall(lp[:, warm:-1], x[:, warm + 1:].view(2, -1, 1, 8), 2).mean(1)  # [2]
    with torch.no_grad():
        xs = torch.cat([x, torch.ones(2, T, 1)], -1)
        ema = ema_scan(xs, torch.tensor([0.0, 0.5 ** (1 / 32)]))
        freq = (ema[..., :-1] / ema[..., -1:]).view(2, T, 2, 1, 8)
    single = torch.stack([_support_recall(freq[:, warm:-1, m], x[:, warm + 1:].view(2, -1, 1, 8), 2).mean(1)
                          for m in range(2)], -1)  # [2 rows, 2 sources]
    best = single.max(-1).values
    assert single[0, 1] > single[0, 0] + 0.1 and single[1, 0] > single[1, 1] + 0.1  # the two kinds differ
    assert (rec["hedge"] >= best - 0.03).all(), (rec, single)
    assert rec["hedge"].mean() > rec["fixed"].mean() + 0.03, (rec, single)
