"""The sequence's own running statistics inside the forecaster (docs/design.md "Online statistics").

:func:`ema_scan` (several moving averages at once, chunked), :func:`history_scores` (the discounted per-sequence
scores of the forecasts issued so far, for the learned gate and the per-sequence leader) and :class:`OnlinePrior`
(the statistics as a log-prior on every head).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from expertcast.models.forecaster_state import ForecasterState
from torch import nn


def ema_scan(x: torch.Tensor, decays: torch.Tensor, prev: torch.Tensor | None = None, chunk: int = 64
             ) -> torch.Tensor:
    """Exponential moving averages e_t = d·e_{t-1} + (1-d)·x_t for several decays at once.

    Args:
        x: [B, T, F]; decays: [M] in [0, 1) (0: e_t = x_t); prev: [B, M, F] averages before x[:, 0]
            (None: zeros); chunk: elements per parallel block (memory B·chunk·M·F).
    Returns:
        [B, T, M, F].
    """
    B, T, F = x.shape
    M = decays.shape[0]
    e = x.new_zeros(B, M, F) if prev is None else prev.to(x.dtype)
    d = decays.to(x.dtype)
    if T == 1:  # one recurrent step
        return (d.view(1, M, 1) * e + (1 - d).view(1, M, 1) * x).unsqueeze(1)
    outs = []
    for a in range(0, T, chunk):
        xc = x[:, a:a + chunk]
        n = xc.shape[1]
        t = torch.arange(n, device=x.device, dtype=x.dtype)
        lag = t.view(n, 1) - t.view(1, n)  # [n, n]: t - s
        w = torch.where(lag >= 0, d.view(M, 1, 1) ** lag.clamp_min(0), torch.zeros((), dtype=x.dtype,
                                                                                   device=x.device))
        carry = d.view(M, 1) ** (t + 1).view(1, n)  # [M, n]
        ec = torch.einsum("mts,bsf->btmf", w * (1 - d).view(M, 1, 1), xc) + \
            carry.t().view(1, n, M, 1) * e.unsqueeze(1)
        outs.append(ec)
        e = ec[:, -1]
    return torch.cat(outs, dim=1) if outs else x.new_zeros(B, 0, M, F)


def history_scores(x: torch.Tensor, top: torch.Tensor, saved: list[torch.Tensor] | None, half_life: float,
                   score: Any) -> torch.Tensor:
    """Per-sequence scores of the forecasts a forecaster issued, discounted as their targets arrive (the learned gate
    and the per-sequence leader of :class:`ExpertForecaster`).

    Args:
        x: [B, T, L·E] the elements (an expert is selected where x > 0).
        top: long [B, T, H, N, L, K] the top-K each head issued at each element, for N candidate forecasts.
        saved: the state's [buf [B, H, H, N, L, K] (the last H elements' ``top``, newest first), prev [B, H·F] (the
            discounted sums), seen [B, 1] (elements consumed)], advanced in place; None: from the sequence start.
        half_life: discount half-life in elements.
        score: hits float [B, T, N, L, K] (1 where an issued expert was selected) -> [B, T, F].
    Returns:
        [B, T, H·F]: per head j, the discounted sum of ``score`` over the forecasts that elements up to t resolved
        (head j's issued at element t-j-1; none before the sequence start).
    """
    B, T, H, N, L, K = top.shape
    E = x.shape[-1] // L
    if saved is not None:
        buf, prev, seen = saved
    else:
        buf, prev, seen = top.new_zeros(B, H, H, N, L, K), None, x.new_zeros(B, 1, dtype=torch.float32)
    hist = torch.cat([top.flip(1) if T > 1 else top, buf], dim=1)  # [B, T + H, H, N, L, K], newest first
    support = (x > 0).view(B, T, 1, L, E).expand(B, T, N, L, E)
    t_glob = seen + torch.arange(T, device=x.device, dtype=seen.dtype).view(1, T)
    # every head at once: head j's forecasts of element t were issued at element t-j-1, hist index T - t + j
    j = torch.arange(H, device=x.device)
    src = hist[:, (T - torch.arange(T, device=x.device)).view(T, 1) + j, j]  # [B, T, H, N, L, K]
    hits = support.unsqueeze(2).expand(B, T, H, N, L, E).gather(-1, src).float()
    r = score(hits.reshape(B, T * H, N, L, K)).view(B, T, H, -1) \
        * (t_glob.unsqueeze(-1) - j - 1 >= 0).float().unsqueeze(-1)  # [B, T, H, F]
    F = r.shape[-1]
    d = 0.5 ** (1.0 / half_life)
    out = ema_scan(r.reshape(B, T, H * F), torch.tensor([d], device=x.device),
                   None if prev is None else (prev * (1 - d)).view(B, 1, H * F))
    out = out[:, :, 0] / (1 - d)  # [B, T, H·F]: the discounted sums
    if saved is not None and T:
        buf.copy_(hist[:, :H])
        prev.copy_(out[:, -1])
        seen.add_(T)
    return out


class OnlinePrior(nn.Module):
    """The sequence's own running statistics as a log-prior on every head (docs/design.md "Online statistics").

    Per layer, M moving averages of the activation vectors (half-lives ``half_lives`` elements; 0 is the
    last element itself) are divided by the moving average of a constant 1 (their mass), so right after
    a state reset they average what was seen so far. Head j, layer l mixes them and the uniform
    distribution with weights softmax(``mix[j, l]`` + eta_j · C_j) [M+1] into a distribution ``prior`` over
    the E experts and contributes ``gate[j, l] · log prior``. Parameters: ``mix`` [H_d, L, M+1] (zeros: equal
    shares) and ``gate`` [H_d, L] (ones).

    Per-sequence weighting (``hedge_rate`` > 0): C_j [M+1] is, per sequence, the discounted sum (half-life
    ``hedge_half_life`` elements) of each source's recall@K at horizon j+1: when element t arrives, the top-K
    of source m's frequencies at element t-j-1 is scored against element t's experts (mean over layers; the
    uniform source scores K/E). Exponential weights over the sources: the prior moves, within the sequence,
    towards whichever statistic has been forecasting this sequence best at that horizon, whatever the fit
    set preferred. The rate eta = ``hedge_rate`` is fixed, not learned: what it guards against (routing unlike
    the fit set's) is exactly what the fit set cannot show. The scores are data (no gradient flows through them).
    """

    def __init__(self, half_lives: list[float], num_layers: int, num_experts: int, heads: int, top_k: int = 1,
                 hedge_rate: float = 0.0, hedge_half_life: float = 64.0):
        super().__init__()
        decays = [0.0 if h == 0 else 0.5 ** (1.0 / h) for h in half_lives]
        self.register_buffer("decays", torch.tensor(decays), persistent=False)
        self.L, self.E, self.K, self.heads = num_layers, num_experts, top_k, heads
        self.mix = nn.Parameter(torch.zeros(heads, num_layers, len(decays) + 1))
        self.gate = nn.Parameter(torch.ones(heads, num_layers))
        self.rate = float(hedge_rate)
        self.hedge_decay = 0.5 ** (1.0 / hedge_half_life)

    @property
    def num_sources(self) -> int:
        return self.decays.shape[0]

    @torch.no_grad()
    def start_on(self, source: int, share: float = 0.9) -> None:
        """Set every head's mixture to put ``share`` on source ``source`` (index into the half-lives) and the rest
        in equal parts on the others and the uniform distribution: the prior then starts as that statistic."""
        if not 0 <= source < self.num_sources or not 0 < share < 1:
            raise ValueError(f"start_on needs a source in [0, {self.num_sources - 1}] and a share in (0, 1), got "
                             f"{source}, {share}")
        self.mix.zero_()
        self.mix[..., source] = math.log(share * self.num_sources / (1 - share))

    def init_state(self, batch_size: int, device: torch.device | str) -> torch.Tensor:
        """Zero averages and mass: [B, M, L·E + 1]."""
        return torch.zeros(batch_size, self.num_sources, self.L * self.E + 1, device=device)

    def init_hedge(self, batch_size: int, device: torch.device | str) -> list[torch.Tensor] | None:
        """Zero hedge state (None without per-sequence weighting): the top-K of the sources' frequencies at the
        last H_d elements [B, H_d, M, L, K] (long, newest first), scores [B, H_d, M+1], elements seen [B, 1]."""
        if self.rate <= 0:
            return None
        M, H = self.num_sources, self.heads
        return [torch.zeros(batch_size, H, M, self.L, self.K, dtype=torch.long, device=device),
                torch.zeros(batch_size, H, M + 1, device=device), torch.zeros(batch_size, 1, device=device)]

    def forward(self, x: torch.Tensor, state: ForecasterState | None, heads: int) -> torch.Tensor:
        """x [B, T, L·E] (the inputs) -> log-prior terms [B, T, heads, L, E] of the first ``heads`` heads;
        ``state.online`` / ``state.hedge`` (when given) are continued and advanced in place."""
        B, T, _ = x.shape
        M, L, E = self.num_sources, self.L, self.E
        with torch.no_grad():
            xs = torch.cat([x.float(), x.new_ones(B, T, 1, dtype=torch.float32)], dim=-1)
            prev = state.online if state is not None else None
            ema = ema_scan(xs, self.decays, prev)  # [B, T, M, L·E + 1]
            if state is not None and T:
                state.online.copy_(ema[:, -1])
            freq = ema[..., :-1] / ema[..., -1:].clamp_min(1e-6)  # [B, T, M, L·E]
            score = self._scores(x, freq, state) if self.rate > 0 else None  # [B, T, H_d, M+1]
        logit_w = self.mix[:heads].float().view(1, 1, heads, L, M + 1)
        if score is not None:
            logit_w = logit_w + self.rate * score[:, :, :heads].unsqueeze(3)
        w = torch.softmax(logit_w, dim=-1)  # [B or 1, T or 1, H, L, M+1]
        prior = torch.einsum("btmle,bthlm->bthle", freq.view(B, T, M, L, E), w[..., :-1].expand(B, T, -1, -1, -1)) \
            + (w[..., -1:] / E)
        return self.gate[:heads].view(1, 1, heads, L, 1) * torch.log(prior.clamp_min(1e-12))

    def _scores(self, x: torch.Tensor, freq: torch.Tensor, state: ForecasterState | None) -> torch.Tensor:
        """Discounted per-sequence recall@K of every source at every horizon: x [B, T, L·E], freq [B, T, M, L·E]
        -> C [B, T, H_d, M+1] (C at t includes the forecasts that element t resolves); advances ``state.hedge``."""
        B, T, _ = x.shape
        M, L, E, K, H = self.num_sources, self.L, self.E, self.K, self.heads
        if state is not None:
            buf, c_prev, seen = state.hedge[:3]
        else:
            buf, c_prev, seen = (x.new_zeros(B, H, M, L, K, dtype=torch.long), x.new_zeros(B, H, M + 1),
                                 x.new_zeros(B, 1))
        # the top-K of the new frequencies and the kept top-K of the last H elements', newest first: a row's top-K
        # depends on that row alone, so it is taken once, when the row is new; the zero rows before the sequence
        # start are never scored (valid = 0 below)
        fresh = freq.flip(1) if T > 1 else freq
        top = torch.cat([fresh.reshape(B, T, M, L, E).topk(K, dim=-1).indices, buf], dim=1)  # [B, T + H, M, L, K]
        support = (x > 0).view(B, T, 1, L, E).expand(B, T, M, L, E)
        t_glob = seen + torch.arange(T, device=x.device, dtype=seen.dtype).view(1, T)  # [B, T] index of element t
        # every horizon at once: horizon j's forecasts of element t were issued at element t-j-1 (top index T-t+j)
        j = torch.arange(H, device=x.device)
        src = top[:, (T - torch.arange(T, device=x.device)).view(T, 1) + j]  # [B, T, H, M, L, K]
        hit = support.unsqueeze(2).expand(B, T, H, M, L, E).gather(-1, src).float().mean(dim=(-1, -2))  # [B, T, H, M]
        valid = (t_glob.unsqueeze(-1) - j - 1 >= 0).float().unsqueeze(-1)  # [B, T, H, 1]
        r = torch.cat([hit * valid, (K / E) * valid], dim=-1)  # [B, T, H, M+1]
        d = self.hedge_decay
        dec = torch.tensor([d], device=x.device)
        c = ema_scan(r.view(B, T, H * (M + 1)), dec, (c_prev * (1 - d)).view(B, 1, H * (M + 1)))
        c = (c[:, :, 0] / (1 - d)).view(B, T, H, M + 1)
        if state is not None and T:
            buf.copy_(top[:, :H])
            c_prev.copy_(c[:, -1])
            seen.add_(T)
        return c
