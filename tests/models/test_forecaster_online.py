"""The per-sequence scores of the online statistics (:func:`history_scores`, :meth:`OnlinePrior._scores`), all
horizons at once and their buffers newest first (the hedge keeping the kept frequencies' top-K, not the
frequencies): bit for bit the per-horizon loops they replaced (kept here only as the reference), over windows and
one element at a time, from the sequence start and from a state."""

from __future__ import annotations

import pytest
import torch
from expertcast.models.forecaster_online import OnlinePrior, ema_scan, history_scores

torch.set_num_threads(1)


def _history_scores_loop(x, top, saved, half_life, score):
    """The former :func:`history_scores`: one gather per head, buffer flipped to oldest first."""
    B, T, H, N, L, K = top.shape
    E = x.shape[-1] // L
    if saved is not None:
        buf, prev, seen = saved
    else:
        buf, prev, seen = top.new_zeros(B, H, H, N, L, K), None, x.new_zeros(B, 1, dtype=torch.float32)
    hist = torch.cat([buf.flip(1), top], dim=1)
    support = (x > 0).view(B, T, 1, L, E).expand(B, T, N, L, E)
    t_glob = seen + torch.arange(T, dtype=seen.dtype).view(1, T)
    r = torch.stack([score(support.gather(-1, hist[:, H - j - 1: H - j - 1 + T, j]).float())
                     * (t_glob - j - 1 >= 0).float().unsqueeze(-1) for j in range(H)], dim=2)
    F = r.shape[-1]
    d = 0.5 ** (1.0 / half_life)
    out = ema_scan(r.reshape(B, T, H * F), torch.tensor([d]),
                   None if prev is None else (prev * (1 - d)).view(B, 1, H * F))
    out = out[:, :, 0] / (1 - d)
    if saved is not None and T:
        buf.copy_(hist[:, -H:].flip(1))
        prev.copy_(out[:, -1])
        seen.add_(T)
    return out


def _scores_loop(prior, x, freq, state_hedge):
    """The former :meth:`OnlinePrior._scores`: one gather per horizon, buffer flipped to oldest first."""
    B, T, _ = x.shape
    M, L, E, K, H = prior.num_sources, prior.L, prior.E, prior.K, prior.heads
    if state_hedge is not None:
        buf, c_prev, seen = state_hedge
    else:
        buf, c_prev, seen = (x.new_zeros(B, H, M, L * E), x.new_zeros(B, H, M + 1), x.new_zeros(B, 1))
    top = torch.cat([buf.flip(1).reshape(B, H, M, L, E).topk(K, dim=-1).indices,
                     freq.reshape(B, T, M, L, E).topk(K, dim=-1).indices], dim=1)
    support = (x > 0).view(B, T, 1, L, E).expand(B, T, M, L, E)
    t_glob = seen + torch.arange(T, dtype=seen.dtype).view(1, T)
    r = x.new_zeros(B, T, H, M + 1)
    for j in range(H):
        src = top[:, H - j - 1: H - j - 1 + T]
        hit = support.gather(-1, src).float().mean(dim=(-1, -2))
        valid = (t_glob - j - 1 >= 0).float().unsqueeze(-1)
        r[:, :, j, :M] = hit * valid
        r[:, :, j, M] = (K / E) * valid[..., 0]
    d = prior.hedge_decay
    c = ema_scan(r.view(B, T, H * (M + 1)), torch.tensor([d]), (c_prev * (1 - d)).view(B, 1, H * (M + 1)))
    c = (c[:, :, 0] / (1 - d)).view(B, T, H, M + 1)
    if state_hedge is not None and T:
        buf.copy_(torch.cat([buf.flip(1), freq], dim=1)[:, -H:].flip(1) if T < H else freq[:, -H:].flip(1))
        c_prev.copy_(c[:, -1])
        seen.add_(T)
    return c


SCORES = {"per layer": lambda h: h.mean(-1).flatten(2),
          "gain": lambda h: (h.mean(dim=(-1, -2))[..., 0] - h.mean(dim=(-1, -2))[..., 1]).unsqueeze(-1)}


@pytest.mark.parametrize("score", list(SCORES))
@pytest.mark.parametrize("chunks", [(13,), (1,) * 13, (2, 1, 5, 1, 4), (6, 7)])
def test_history_scores_equal_the_per_head_loop(score, chunks, activation_inputs):
    B, H, N, L, E, K = 3, 4, 2, 3, 8, 2
    x = activation_inputs(B, sum(chunks), L=L, E=E, K=K, seed=3).flatten(-2)
    g = torch.Generator().manual_seed(4)
    top = torch.rand(B, sum(chunks), H, N, L, E, generator=g).topk(K, dim=-1).indices
    fn = SCORES[score]
    whole = history_scores(x, top, None, 4.0, fn)
    assert torch.equal(whole, _history_scores_loop(x, top, None, 4.0, fn))
    new = [torch.zeros(B, H, H, N, L, K, dtype=torch.long), torch.zeros(B, whole.shape[-1]),
           torch.zeros(B, 1)]
    ref = [t.clone() for t in new]
    a = 0
    for n in chunks:
        got = history_scores(x[:, a:a + n], top[:, a:a + n], new, 4.0, fn)
        want = _history_scores_loop(x[:, a:a + n], top[:, a:a + n], ref, 4.0, fn)
        assert torch.equal(got, want)
        assert all(torch.equal(p, q) for p, q in zip(new, ref, strict=True))
        a += n


@pytest.mark.parametrize("chunks", [(12,), (1,) * 12, (3, 1, 1, 7), (5, 7)])
def test_hedge_scores_equal_the_per_horizon_loop(chunks, activation_inputs):
    B, L, E, K, H = 2, 2, 8, 2, 3
    prior = OnlinePrior([0.0, 4.0, 16.0], L, E, heads=H, top_k=K, hedge_rate=1.0, hedge_half_life=8.0)
    T = sum(chunks)
    x = activation_inputs(B, T, L=L, E=E, K=K, seed=5).flatten(-2)
    with torch.no_grad():
        xs = torch.cat([x, torch.ones(B, T, 1)], -1)
        ema = ema_scan(xs, prior.decays)
        freq = (ema[..., :-1] / ema[..., -1:]).contiguous()
        assert torch.equal(prior._scores(x, freq, None), _scores_loop(prior, x, freq, None))
        new = prior.init_hedge(B, "cpu")  # the top-K of the kept frequencies, not the frequencies
        ref = [torch.zeros(B, H, prior.num_sources, L * E)] + [t.clone() for t in new[1:]]

        class _State:
            hedge = new

        a = 0
        for n in chunks:
            got = prior._scores(x[:, a:a + n], freq[:, a:a + n].contiguous(), _State)
            want = _scores_loop(prior, x[:, a:a + n], freq[:, a:a + n].contiguous(), ref)
            a += n
            assert torch.equal(got, want)
            assert all(torch.equal(p, q) for p, q in zip(new[1:], ref[1:], strict=True))
            kept = min(a, H)  # rows of elements seen so far (the rest: before the sequence start)
            ref_top = ref[0].view(B, H, prior.num_sources, L, E).topk(K, dim=-1).indices
            assert torch.equal(new[0][:, :kept], ref_top[:, :kept])
