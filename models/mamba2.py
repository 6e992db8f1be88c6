"""The forecaster's Mamba-2 backbone, the project's own (docs/design.md "Forecaster").

A stack of pre-norm residual blocks on embedded inputs [B, T, d], then a final RMSNorm. Each block's mixer (the
Mamba-2 layer of mamba-ssm's ``Mamba2Simple``, without its fused paths):

    in_proj: d -> [z (inner) ; xBC (inner + 2·G·N) ; dt (H)]      inner = expand·d, H = inner / head_dim
    xBC -> causal depthwise conv (width k) -> SiLU -> x, B, C
    SSD scan with per-head A = -exp(A_log), dt = softplus(dt + dt_bias), skip D      (models/mamba_ssd.py)
    y -> RMSNorm(y · SiLU(z)) per group of inner / G channels -> out_proj: inner -> d

The recurrent state is the project's: per block the convolution window [B, inner + 2·G·N, k] (the last k inputs
of the conv) and the SSD state [B, H, head_dim, N] (:class:`~expertcast.models.forecaster_state.ForecasterState`
holds them). :meth:`Mamba2Backbone.forward` with a state continues from it and advances it in place: a window
computed in one call (the chunked scan) equals its elements fed one at a time (the one-step update). The
operations go through :mod:`expertcast.models.mamba_kernels` (kernels for CUDA tensors when installed).

Parameter names and shapes are those of the Mamba-2 layer of transformers (``layers.{i}.mixer.in_proj.weight``,
``conv1d.weight`` [C, 1, k], ``A_log`` / ``D`` / ``dt_bias`` [H], ...), so exports written when the forecaster ran
transformers' ``Mamba2Model`` load as they are (:func:`~expertcast.models.forecaster_export.load_forecaster` drops
only its unused token embedding). The initialisation is transformers' Mamba-2 initialisation, random draws in the same order.
"""

from __future__ import annotations

import math

import torch
from expertcast.models import mamba_kernels
from torch import nn

NORM_EPS = 1e-5
"""Epsilon of every RMSNorm of the backbone."""
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4
"""Initial time steps: log-uniform in [DT_MIN, DT_MAX], at least DT_FLOOR."""
IN_PROJ_STD = 0.1
"""Standard deviation of the initial in_proj weights."""


class RMSNorm(nn.Module):
    """x / rms(x) · weight over groups of ``group`` channels (all channels by default), computed in float32; with a
    gate, x · SiLU(gate) is normalized (the gated norm of a Mamba-2 mixer)."""

    def __init__(self, size: int, group: int | None = None, eps: float = NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group = group or size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        if gate is not None:
            h = h * nn.functional.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer (module docstring): [B, T, d] -> [B, T, d]."""

    def __init__(self, hidden_size: int, state_size: int, head_dim: int, expand: int, conv_kernel: int,
                 n_groups: int, chunk_size: int):
        super().__init__()
        self.inner = expand * hidden_size
        self.num_heads = self.inner // head_dim
        self.head_dim, self.state_size, self.n_groups = head_dim, state_size, n_groups
        self.conv_dim = self.inner + 2 * n_groups * state_size
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1)
        self.in_proj = nn.Linear(hidden_size, self.inner + self.conv_dim + self.num_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.norm = RMSNorm(self.inner, group=self.inner // n_groups)
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.out_proj = nn.Linear(self.inner, hidden_size, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """transformers' Mamba-2 initialisation: in_proj N(0, 0.1²); A = 1..H; D = 1; dt log-uniform; conv and
        out_proj Kaiming-uniform, conv bias 0; norm 1."""
        nn.init.normal_(self.conv1d.weight, std=IN_PROJ_STD)
        nn.init.zeros_(self.conv1d.bias)
        nn.init.normal_(self.in_proj.weight, std=IN_PROJ_STD)
        nn.init.ones_(self.norm.weight)
        nn.init.normal_(self.out_proj.weight, std=IN_PROJ_STD)
        self.A_log.copy_(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        nn.init.ones_(self.D)
        dt = torch.exp(torch.rand(self.num_heads) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
        dt = dt.clamp(min=DT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus
        nn.init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))
        nn.init.zeros_(self.conv1d.bias)
        nn.init.kaiming_uniform_(self.out_proj.weight, a=math.sqrt(5))

    def forward(self, h: torch.Tensor, conv_state: torch.Tensor | None = None,
                ssm_state: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, d] -> [B, T, d]; with the states (both or neither) the window continues from them and they
        are advanced in place."""
        Bsz, T, _ = h.shape
        dtype = h.dtype
        z, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        w, b = self.conv1d.weight.squeeze(1), self.conv1d.bias
        A = -torch.exp(self.A_log.float())
        G, N, H, P = self.n_groups, self.state_size, self.num_heads, self.head_dim
        if conv_state is not None and T == 1:  # one recurrent step
            xbc = mamba_kernels.conv_update(xbc[:, 0], conv_state, w, b)
            x, B, C = xbc.split([self.inner, G * N, G * N], dim=-1)
            y = mamba_kernels.state_update(ssm_state, x.view(Bsz, H, P), dt[:, 0], A, B.view(Bsz, G, N),
                                           C.view(Bsz, G, N), self.D, self.dt_bias).view(Bsz, 1, self.inner)
        else:
            xbc = mamba_kernels.conv(xbc.transpose(1, 2), w, b, conv_state).transpose(1, 2)
            x, B, C = xbc.split([self.inner, G * N, G * N], dim=-1)
            y, final = mamba_kernels.chunk_scan(x.reshape(Bsz, T, H, P), dt, A, B.reshape(Bsz, T, G, N),
                                                C.reshape(Bsz, T, G, N), self.D, self.dt_bias, self.chunk_size,
                                                ssm_state)
            if ssm_state is not None:
                ssm_state.copy_(final)
            y = y.reshape(Bsz, T, self.inner)
        return self.out_proj(self.norm(y, z).to(dtype))

    def step_macs(self) -> int:
        """Multiply-adds of one recurrent step at batch 1 (projections, conv, SSD update and read-out)."""
        lin = sum(m.in_features * m.out_features for m in (self.in_proj, self.out_proj))
        return lin + self.conv_dim * self.conv_kernel + 2 * self.num_heads * self.head_dim * self.state_size


class Mamba2Block(nn.Module):
    """x + mixer(RMSNorm(x)), the residual kept in float32."""

    def __init__(self, hidden_size: int, **mixer: int):
        super().__init__()
        self.norm = RMSNorm(hidden_size)
        self.mixer = Mamba2Mixer(hidden_size, **mixer)

    def forward(self, h: torch.Tensor, conv_state: torch.Tensor | None = None,
                ssm_state: torch.Tensor | None = None) -> torch.Tensor:
        return h.float() + self.mixer(self.norm(h.to(self.norm.weight.dtype)), conv_state, ssm_state)


class Mamba2Backbone(nn.Module):
    """``num_blocks`` :class:`Mamba2Block` and a final RMSNorm: embedded inputs [B, T, d] -> hidden states
    [B, T, d]."""

    def __init__(self, hidden_size: int, num_blocks: int, state_size: int, head_dim: int, expand: int,
                 conv_kernel: int, n_groups: int, chunk_size: int):
        super().__init__()
        # the random draws follow transformers' Mamba2Model (its unused token embedding drawn at construction and
        # again at initialisation), so a seeded forecaster starts from the weights it started from before
        torch.empty(hidden_size).normal_()
        self.layers = nn.ModuleList([
            Mamba2Block(hidden_size, state_size=state_size, head_dim=head_dim, expand=expand,
                        conv_kernel=conv_kernel, n_groups=n_groups, chunk_size=chunk_size)
            for _ in range(num_blocks)])
        self.norm_f = RMSNorm(hidden_size)
        torch.empty(hidden_size).normal_()
        for block in self.layers:
            block.mixer.reset_parameters()

    def state_shapes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per block, the shapes (without batch) of its conv window [C, k] and SSD state [H, P, N]."""
        return [((m.conv_dim, m.conv_kernel), (m.num_heads, m.head_dim, m.state_size))
                for m in (b.mixer for b in self.layers)]

    def forward(self, h: torch.Tensor, conv: list[torch.Tensor] | None = None,
                ssm: list[torch.Tensor] | None = None) -> torch.Tensor:
        """h [B, T, d] -> [B, T, d]; ``conv`` / ``ssm`` (one tensor per block, both or neither) are continued and
        advanced in place."""
        for i, block in enumerate(self.layers):
            h = block(h, conv[i] if conv is not None else None, ssm[i] if ssm is not None else None)
        return self.norm_f(h)

    def step_macs(self) -> int:
        return sum(b.mixer.step_macs() for b in self.layers)
