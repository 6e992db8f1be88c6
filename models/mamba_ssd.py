"""The Mamba-2 operations in plain PyTorch: the reference the kernels are held to (docs/design.md "Forecaster").

Every function here is the definition; :mod:`expertcast.models.mamba_kernels` sends CUDA tensors to mamba-ssm's /
causal-conv1d's kernels when they are installed and everything else here, and the tests hold the two equal.

SSD (the state-space dual form of the selective scan), per head h with scalar decay A_h < 0:
``dt_t = softplus(dt_raw_t + dt_bias)``, ``S_t = exp(dt_t·A)·S_{t-1} + dt_t·x_t ⊗ B_t`` (S [head_dim, N]),
``y_t = S_t·C_t + D·x_t``. B and C are shared by the heads of a group (G groups). :func:`ssd_scan` computes a whole
window in chunks (quadratic within a chunk, the recurrence between chunks); :func:`ssd_step` one element; both
start from and return the state S, so a window and its elements one at a time compute the same thing.

The causal depthwise convolution keeps the last ``k`` inputs as its window [B, channels, k] (the state
:func:`conv_step` and :func:`causal_conv` continue from).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., T] -> [..., T, T]: entry (i, j) the sum of a over (j, i] for i >= j, -inf above the diagonal (so its
    exp is the decay from j to i, zero where j is in i's future). Built from masked cumulative sums: no difference
    of two long sums, so no cancellation."""
    T = a.shape[-1]
    rep = a.unsqueeze(-1).expand(*a.shape, T)  # [..., i, j] = a_i
    below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(rep.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~keep, -torch.inf)


def _chunks(t: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """[B, T, ...] -> [B, T/chunk, chunk, ...] after zero-padding T by ``pad``."""
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Raw time steps [..., H] -> softplus(dt + dt_bias) in float32."""
    return F.softplus(dt.float() + dt_bias.float())


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
             dt_bias: torch.Tensor, chunk_size: int, initial_state: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A window of SSD.

    Args:
        x: [B, T, H, P]; dt: raw time steps [B, T, H]; A: [H] (negative); B, C: [B, T, G, N]; D: [H];
        dt_bias: [H]; chunk_size: elements per chunk; initial_state: [B, H, P, N] the state before x[:, 0] (None:
        zeros).
    Returns:
        (y [B, T, H, P] float32, the state after the last element [B, H, P, N] float32).
    """
    Bsz, T, H, P = x.shape
    rep = H // B.shape[2]
    x = x.float()
    dt = discretize(dt, dt_bias)
    Bh = B.float().repeat_interleave(rep, dim=2)  # [B, T, H, N]
    Ch = C.float().repeat_interleave(rep, dim=2)
    pad = (chunk_size - T % chunk_size) % chunk_size
    xs = _chunks(x * dt.unsqueeze(-1), pad, chunk_size)  # [B, c, l, H, P]: the inputs times their time step
    a = _chunks(A.float() * dt, pad, chunk_size).permute(0, 3, 1, 2)  # [B, H, c, l]: log decays
    Bc, Cc = _chunks(Bh, pad, chunk_size), _chunks(Ch, pad, chunk_size)
    acum = torch.cumsum(a, dim=-1)
    # within a chunk: y_l = sum_{s <= l} (C_l . B_s) decay(s -> l) x_s
    decay = torch.exp(segment_sums(a))  # [B, H, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bclsh", Cc, Bc) * decay.permute(0, 2, 3, 4, 1)
    y = torch.einsum("bclsh,bcshp->bclhp", scores, xs)
    # each chunk's own contribution to the state at its end
    to_end = torch.exp(acum[..., -1:] - acum)  # [B, H, c, l]
    own = torch.einsum("bclhn,bclhp->bchpn", Bc * to_end.permute(0, 2, 3, 1).unsqueeze(-1), xs)
    # the state entering each chunk: the recurrence between chunk ends
    start = (initial_state.float() if initial_state is not None else own.new_zeros(Bsz, H, P, own.shape[-1]))
    own = torch.cat([start.unsqueeze(1), own], dim=1)  # [B, c + 1, H, P, N]
    carry = torch.exp(segment_sums(F.pad(acum[..., -1], (1, 0))))  # [B, H, c + 1, c + 1]
    states = torch.einsum("bhzc,bchpn->bzhpn", carry, own)
    entering, final = states[:, :-1], states[:, -1]
    # the entering state read out at every element, decayed from the chunk start
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cc, entering) * torch.exp(acum).permute(0, 2, 3, 1).unsqueeze(-1)
    y = y.reshape(Bsz, -1, H, P)[:, :T] + D.float().view(1, 1, H, 1) * x
    return y, final


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """One element of SSD, the state advanced in place.

    Args:
        state: [B, H, P, N]; x: [B, H, P]; dt: raw [B, H]; A, D, dt_bias: [H]; B, C: [B, G, N].
    Returns:
        y [B, H, P] float32.
    """
    H = x.shape[1]
    rep = H // B.shape[1]
    dt = discretize(dt, dt_bias)  # [B, H]
    Bh = B.float().repeat_interleave(rep, dim=1)  # [B, H, N]
    Ch = C.float().repeat_interleave(rep, dim=1)
    x = x.float()
    new = state.float() * torch.exp(dt * A.float()).view(*dt.shape, 1, 1) \
        + (dt.unsqueeze(-1) * x).unsqueeze(-1) * Bh.unsqueeze(2)
    state.copy_(new)
    return torch.einsum("bhpn,bhn->bhp", new, Ch) + D.float().view(1, H, 1) * x


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                window: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution + SiLU of a window.

    Args:
        x: [B, D, T]; weight: [D, k]; bias: [D] or None; window: [B, D, k] the last k inputs before x (None: zeros),
            replaced in place by the last k inputs of [window ; x].
    Returns:
        [B, D, T] in x's dtype.
    """
    k = weight.shape[-1]
    T = x.shape[-1]
    if window is None:
        full = F.pad(x.to(weight.dtype), (k - 1, 0))
    else:
        full = torch.cat([window.to(weight.dtype), x.to(weight.dtype)], dim=-1)
        window.copy_(full[..., -window.shape[-1]:])
        full = full[..., -(T + k - 1):]
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=x.shape[1])
    return F.silu(out).to(x.dtype)


def conv_step(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One element of :func:`causal_conv`: x [B, D] -> [B, D]; the window [B, D, k] advanced in place."""
    return causal_conv(x.unsqueeze(-1), weight, bias, window)[..., 0]
