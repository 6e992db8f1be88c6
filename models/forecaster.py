"""SeqMoE expert-activation forecaster (SeqMoE 3.1, 5.2, 5.3; docs/design.md "Forecaster").

The forecaster reads, per decode step, the activation vector of all MoE layers (size L·E: the
normalized top-K weights at the active experts, zeros elsewhere), runs it through a Mamba backbone
(transformers' ``Mamba2Model`` by default, ``MambaModel`` as an option, both driven through
``inputs_embeds``) and emits per-layer expert logits for the next element.

Trigger layer ``p`` (docs/design.md "Forecaster"): the element for step t holds layers <= p of step t and layers > p
of step t-1; its target holds layers > p of step t and layers <= p of step t+1, i.e. the target of
element t is element t+1. :func:`trigger_sequence` builds these elements from a [T, L, E] activation
tensor, so that the model itself only ever does next-element prediction; ``p = L-1`` is plain
next-step forecasting.

Recurrent state: :class:`ForecasterState` holds the conv and SSM states of every Mamba block as
explicit tensors. It is handed to the transformers mixers as their ``cache`` (it implements the
small part of the linear-attention cache protocol they call), so :meth:`ExpertForecaster.step` is
transformers' own recurrent decode path (and mamba-ssm's kernels on CUDA when installed, never on CPU
tensors: :mod:`expertcast.models.mamba_kernels`; nothing here imports ``mamba_ssm``).
:meth:`ExpertForecaster.rollout` saves the state, feeds its own predictions back for several steps and
restores the state, so a rollout never disturbs the next one-step prediction (SeqMoE 5.3).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from expertcast.models.forecaster_components import COMPONENT_SCALE, ExactComponents, component_names
from torch import nn

BACKBONES = ("mamba2", "mamba")


@dataclass
class ForecasterConfig:
    """Shape and backbone hyper-parameters of an :class:`ExpertForecaster`."""

    num_layers: int
    """L: MoE layers of the served model."""
    num_experts: int
    """E: routed experts per MoE layer."""
    top_k: int
    """K: experts selected per token per layer."""
    trigger_layer: int | None = None
    """p in [0, L-1]: the forecast is issued once layer p has routed; None means L-1 (next step)."""
    backbone: str = "mamba2"
    """``mamba2`` (transformers' Mamba2Model, parallel chunked scan) or ``mamba`` (MambaModel)."""
    hidden_size: int = 128
    """Width d of the backbone."""
    num_blocks: int = 2
    """Mamba blocks in the backbone."""
    state_size: int = 32
    """SSM state size N per head (Mamba2) or per channel (Mamba)."""
    head_dim: int = 32
    """Mamba2 head dimension; expand·d must be divisible by it."""
    expand: int = 2
    """Inner width multiplier of the Mamba mixers."""
    conv_kernel: int = 4
    """Width of the causal depthwise convolution."""
    n_groups: int = 1
    """Mamba2 B/C groups (must divide the number of heads)."""
    chunk_size: int = 64
    """Mamba2 scan chunk length (PyTorch path)."""
    use_mambapy: bool = False
    """Mamba-1 only: use the ``mambapy`` parallel scan in training when that package is installed."""
    temperature: float = 1.0
    """Calibration of :func:`activation_probs` (fitted on held-out data after training; ranking unaffected)."""
    direct_horizons: int = 1
    """H_d: elements ahead predicted directly by the output head from one hidden state (head j predicts
    element i+j). 1 is the paper's forecaster: every horizon beyond the first comes from recursive
    rollout. With H_d > 1, horizons 1..H_d need no rollout and longer ones roll out from head H_d."""
    online_half_lives: list[float] = field(default_factory=list)
    """Half-lives (in elements) of the online expert frequencies :class:`OnlinePrior` reads; 0 is the last
    selection. Empty: no online statistics (the paper's forecaster; every format-1 export)."""
    online_hedge_rate: float = 0.0
    """Rate eta of the per-sequence weighting of the online sources (:class:`OnlinePrior`): each head's mixture
    logits get + eta · C, C the sequence's own discounted recall@K of each source at that horizon so far, so the
    prior moves towards the statistic that has been forecasting this sequence best (fixed, not learned). 0: no
    per-sequence weighting (the mixture is fixed per head and layer; every earlier format-2 export)."""
    online_hedge_half_life: float = 64.0
    """Half-life (elements) of the discount of the per-sequence scores (sources and learned gate)."""
    learned_gate_rate: float = 0.0
    """Rate kappa of the per-sequence gate on the learned logits: per head j, g_j = exp(kappa · min(D_j, 0)) with
    D_j the sequence's discounted recall@K of (scaled learned + prior) minus that of the prior alone at horizon
    j+1 so far. 1 while the learned part helps on this sequence, falling towards 0 where it hurts (routing
    unlike the fit set's). 0: off. Needs online statistics."""
    learned_gate_half_life: float = 8.0
    """Half-life (elements) of the discount of D: short, so credit banked where the learned part helped (e.g. in
    the prompt) cannot hold the gate open for long once it starts to cost recall (e.g. in the decode)."""
    component_half_lives: list[float] | None = None
    """Half-lives of the recent-freq and recent-count components (docs/design.md "Exact components"): with a list
    (may be empty), the forecaster carries the online baselines repeat-last, frequency, transition, then
    recent-freq and recent-count at these half-lives as exact components (:class:`~expertcast.models.forecaster_components.ExactComponents`) that
    ``selection`` can pick. None: no components (every export before format 3)."""
    selection: list[list[int]] | None = None
    """Per direct head j and layer l, what issues the logits: -1 the learned part plus the online prior, c >= 0
    component c (``component_names`` order), exactly. Chosen on held-out elements after training
    (``select_components`` in the training code). None: -1 everywhere."""
    switch_half_life: float = 0.0
    """Per-sequence leader (docs/design.md "Exact components"): where ``selection`` keeps the learned part, head j at
    layer l issues, element by element, whichever of the learned forecast and the components has the best
    discounted recall@K (this half-life, in elements) at horizon j+1 on this sequence's targets so far (ties: the
    learned forecast, then component order). The selection is made on the fit set's validation split; routing
    unlike the fit set's (a domain shift) then costs at most what the leader takes to notice. Selected components
    are left as they are. 0: off."""
    head_temperatures: list[float] | None = None
    """Per direct head j, the temperature of head j's probabilities (:meth:`ExpertForecaster.probs`; forecasts
    beyond the direct heads use the last), fitted on held-out targets j elements ahead after the component selection
    (``select_components`` in the training code), so that the probabilities match the logits the export issues: a
    selected component's logits are scaled scores, whose sharpness has nothing to do with the learned part's
    (docs/design.md, "Exact components"). None: ``temperature`` for every head."""
    head_rank: int = 0
    """0: one dense output head d -> H_d·L·E. r > 0: factored per-layer heads, d -> H_d·L·r then a per-layer
    [r, E] expert table (scales to wide L x E: d·H_d·L·r + L·r·E weights instead of d·H_d·L·E)."""
    residual_scale: list[float] | None = None
    """Per direct head j, the factor alpha_j in [0, 1] on the learned logits (logits = alpha_j · learned + online
    prior term). Fitted after training on held-out elements (:func:`fit_residual_scale` in the training code,
    like ``temperature``): 0 where the learned part does not beat the online prior there. None: 1 everywhere."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def p(self) -> int:
        """The trigger layer as an index (``trigger_layer`` or L-1)."""
        return self.num_layers - 1 if self.trigger_layer is None else int(self.trigger_layer)

    @property
    def input_size(self) -> int:
        return self.num_layers * self.num_experts

    def validate(self) -> None:
        if self.num_layers < 1 or self.num_experts < 2:
            raise ValueError(f"forecaster needs L >= 1 and E >= 2, got L={self.num_layers}, E={self.num_experts}")
        if not 1 <= self.top_k < self.num_experts:
            raise ValueError(f"top_k must be in [1, E-1={self.num_experts - 1}], got {self.top_k}")
        if self.trigger_layer is not None and not 0 <= self.trigger_layer < self.num_layers:
            raise ValueError(f"trigger_layer must be in [0, L-1={self.num_layers - 1}], got {self.trigger_layer}")
        if self.direct_horizons < 1:
            raise ValueError(f"direct_horizons must be >= 1, got {self.direct_horizons}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if any(not h >= 0 for h in self.online_half_lives) or len(set(self.online_half_lives)) != len(
                self.online_half_lives):
            raise ValueError(f"online_half_lives must be distinct and >= 0, got {self.online_half_lives}")
        if self.online_hedge_rate < 0 or not self.online_hedge_half_life > 0:
            raise ValueError(f"online_hedge_rate must be >= 0 and online_hedge_half_life > 0, got "
                             f"{self.online_hedge_rate}, {self.online_hedge_half_life}")
        if self.online_hedge_rate > 0 and not self.online_half_lives:
            raise ValueError("online_hedge_rate needs online statistics (online_half_lives)")
        if not self.learned_gate_half_life > 0:
            raise ValueError(f"learned_gate_half_life must be > 0, got {self.learned_gate_half_life}")
        if self.learned_gate_rate < 0 or (self.learned_gate_rate > 0 and not self.online_half_lives):
            raise ValueError(f"learned_gate_rate must be >= 0 and needs online statistics, got {self.learned_gate_rate}")
        if self.head_temperatures is not None and (len(self.head_temperatures) != self.direct_horizons or any(
                not float(t) > 0 for t in self.head_temperatures)):
            raise ValueError(f"head_temperatures must hold direct_horizons={self.direct_horizons} positive values, "
                             f"got {self.head_temperatures}")
        if self.residual_scale is not None:
            rs = self.residual_scale
            if len(rs) != self.direct_horizons or any(not 0 <= a <= 1 for a in rs):
                raise ValueError(f"residual_scale must hold direct_horizons={self.direct_horizons} values in [0, 1], "
                                 f"got {rs}")
        if self.component_half_lives is not None and (any(not h > 0 for h in self.component_half_lives)
                                                       or len(set(self.component_half_lives))
                                                       != len(self.component_half_lives)):
            raise ValueError(f"component_half_lives must be distinct and > 0, got {self.component_half_lives}")
        if self.selection is not None:
            n = len(component_names(self.component_half_lives)) if self.component_half_lives is not None else 0
            sel = self.selection
            if len(sel) != self.direct_horizons or any(len(r) != self.num_layers for r in sel) or \
                    any(not -1 <= int(v) < n for r in sel for v in r):
                raise ValueError(f"selection must be [direct_horizons={self.direct_horizons}][L={self.num_layers}] "
                                 f"values in [-1, {n - 1}] (components: {n}), got {sel}")
        if not self.switch_half_life >= 0:
            raise ValueError(f"switch_half_life must be >= 0, got {self.switch_half_life}")
        if self.head_rank < 0:
            raise ValueError(f"head_rank must be >= 0, got {self.head_rank}")
        if self.backbone not in BACKBONES:
            raise ValueError(f"unknown backbone {self.backbone!r}; choose one of {BACKBONES}")
        if self.backbone == "mamba2":
            inner = self.expand * self.hidden_size
            if inner % self.head_dim:
                raise ValueError(f"expand*hidden_size={inner} is not divisible by head_dim={self.head_dim}")
            if (inner // self.head_dim) % self.n_groups:
                raise ValueError(f"n_groups={self.n_groups} must divide the number of heads {inner // self.head_dim}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ForecasterConfig:
        """Inverse of :meth:`to_dict`; keys added later (``direct_horizons``, ``online_half_lives``,
        ``residual_scale``) take their defaults, so a format-1 export is a forecaster without online statistics."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown forecaster config keys: {sorted(unknown)}")
        d = dict(d)
        d["online_half_lives"] = [float(h) for h in d.get("online_half_lives") or []]
        if d.get("residual_scale") is not None:
            d["residual_scale"] = [float(a) for a in d["residual_scale"]]
        if d.get("component_half_lives") is not None:
            d["component_half_lives"] = [float(h) for h in d["component_half_lives"]]
        if d.get("selection") is not None:
            d["selection"] = [[int(v) for v in r] for r in d["selection"]]
        return cls(**d)


def scaled_width(num_layers: int, num_experts: int) -> int:
    """Backbone width for an L x E input: L·E / 8 rounded to a multiple of 64, within [64, 1024] (26 x 64 -> 192,
    48 x 128 -> 768)."""
    return int(min(1024, max(64, 64 * round(num_layers * num_experts / 8 / 64))))


# ----------------------------------------------------------------------------------------------
# activation vectors and trigger-layer elements


def activation_vector(expert_ids: torch.Tensor, expert_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Scatter top-K routing into dense per-layer weight vectors.

    Args:
        expert_ids: int [..., L, K] selected experts (any integer dtype).
        expert_weights: float [..., L, K] their router weights (renormalized here to sum to 1 per layer).
        num_experts: E.
    Returns:
        float32 [..., L, E] with the normalized top-K weights at active experts and zeros elsewhere.
    """
    if expert_ids.shape != expert_weights.shape:
        raise ValueError(f"expert_ids {tuple(expert_ids.shape)} and expert_weights {tuple(expert_weights.shape)} differ")
    ids = expert_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"expert ids outside [0, {num_experts}) (range {int(ids.min())}..{int(ids.max())})")
    w = expert_weights.float().clamp_min(0)
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-9)
    out = torch.zeros(*ids.shape[:-1], num_experts, dtype=torch.float32, device=ids.device)
    return out.scatter_add_(-1, ids, w)


def trigger_sequence(acts: torch.Tensor, p: int) -> torch.Tensor:
    """Forecaster elements for trigger layer ``p``.

    Args:
        acts: [..., T, L, E] per-step activation vectors.
        p: trigger layer.
    Returns:
        [..., T', L, E] with element i holding layers <= p of step i+s and layers > p of step i+s-1,
        where s = 0 (T' = T) for p = L-1 and s = 1 (T' = T-1) otherwise. Element i+1 is the target of
        element i.
    """
    L = acts.shape[-2]
    if not 0 <= p < L:
        raise ValueError(f"trigger layer {p} outside [0, {L - 1}]")
    if p == L - 1:
        return acts
    return torch.cat([acts[..., 1:, : p + 1, :], acts[..., :-1, p + 1 :, :]], dim=-2)


def trigger_offset(num_layers: int, p: int) -> int:
    """Step index of the first element of :func:`trigger_sequence` (0 for p = L-1, else 1)."""
    return 0 if p == num_layers - 1 else 1


def predictions_to_input(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Turn per-layer logits into an input-format activation vector (for rollout and scheduled sampling).

    Args:
        logits: [..., L, E].
    Returns:
        [..., L, E] float: softmax probabilities of the predicted top-K, renormalized to sum 1 per layer,
        zeros elsewhere (the format of :func:`activation_vector`).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_i = probs.topk(top_k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True).clamp_min(1e-9)
    return torch.zeros_like(probs).scatter_(-1, top_i, top_w)


def activation_probs(logits: torch.Tensor, top_k: int, temperature: float = 1.0, iters: int = 40) -> torch.Tensor:
    """Per-expert probability of being among a layer's K selected experts, from logits [..., L, E].

    The selection is modelled as K draws without replacement in proportion to w = softmax(logits / T)
    (Plackett-Luce). Its inclusion probabilities follow from the exponential-clocks view of that
    sampling, approximated with a per-layer time lambda: P(e) = 1 - exp(-lambda * w_e), with lambda
    solved (bisection) so that the probabilities sum to K, as a K-subset's inclusion probabilities do.
    ``temperature`` T is the calibration fitted on held-out data (:attr:`ForecasterConfig.temperature`).
    """
    w = torch.softmax(logits.float() / temperature, dim=-1)
    E = w.shape[-1]
    if top_k >= E:
        return torch.ones_like(w)
    target = float(top_k)
    lo = torch.zeros(w.shape[:-1] + (1,), device=w.device)
    hi = torch.ones_like(lo)
    for _ in range(60):  # grow hi until the sum reaches K (w_min > 0 so it always does)
        done = (1 - torch.exp(-hi * w)).sum(-1, keepdim=True) >= target
        if bool(done.all()):
            break
        hi = torch.where(done, hi, hi * 4)
    for _ in range(iters):
        mid = (lo + hi) / 2
        big = (1 - torch.exp(-mid * w)).sum(-1, keepdim=True) > target
        hi = torch.where(big, mid, hi)
        lo = torch.where(big, lo, mid)
    return 1 - torch.exp(-hi * w)


# ----------------------------------------------------------------------------------------------
# explicit recurrent state


class ForecasterState:
    """Recurrent state of the backbone: per block a conv state and an SSM state, plus the online statistics.

    Shapes (B = batch): Mamba2 conv [B, expand·d + 2·G·N, k], ssm [B, H, head_dim, N];
    Mamba conv [B, expand·d, k], ssm [B, expand·d, N]; ``online`` [B, M, L·E + 1] (the M moving averages
    of :class:`OnlinePrior`, last column their mass) or None without online statistics; ``hedge`` (with
    ``online_hedge_rate`` > 0): the sources' frequencies of the last H_d elements [B, H_d, M, L·E]
    (newest first), their discounted per-head scores [B, H_d, M+1] and the elements each row has seen [B, 1];
    then (with ``learned_gate_rate`` > 0) the top-K of the last H_d forecasts with and without the learned part
    [B, H_d, H_d, 2, L, K] (long, newest first), their discounted recall difference [B, H_d] and the elements
    seen [B, 1]. None when neither is on. ``components`` [B, M', L, E]: the moving averages of the exact recent-freq
    components (:class:`~expertcast.models.forecaster_components.ExactComponents`), or None without components.
    ``switch`` (with components and ``switch_half_life`` > 0): the top-K of the last H_d forecasts of the selected
    forecast and of every component [B, H_d, H_d, 1 + C, L, K] (long, newest first), their discounted recall
    [B, H_d·(1 + C)·L] and the elements seen [B, 1]; None otherwise.
    ``steps`` counts the elements consumed.

    The object implements the part of transformers' linear-attention cache protocol that the Mamba
    mixers call (get/update conv and recurrent state), so it can be passed as their ``cache``.
    State tensors are updated in place; use :meth:`clone` / :meth:`copy_` to save and restore.
    """

    def __init__(self, conv: list[torch.Tensor], ssm: list[torch.Tensor], steps: int = 0,
                 online: torch.Tensor | None = None, hedge: list[torch.Tensor] | None = None,
                 components: torch.Tensor | None = None, switch: list[torch.Tensor] | None = None):
        if len(conv) != len(ssm):
            raise ValueError("conv and ssm state lists differ in length")
        if hedge is not None and online is None:
            raise ValueError("a hedge state needs the online statistics")
        self.conv = conv
        self.ssm = ssm
        self.steps = steps
        self.online = online
        self.hedge = hedge
        self.components = components
        self.switch = switch

    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor (batch first): conv, ssm, then the online statistics, hedge state, components'
        moving averages and switch state when present."""
        return self.conv + self.ssm + ([self.online] if self.online is not None else []) + list(self.hedge or []) \
            + ([self.components] if self.components is not None else []) + list(self.switch or [])

    # --- transformers cache protocol (Mamba2Mixer / MambaMixer) ---
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv[layer_idx]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.ssm[layer_idx]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        """Window update: returns [previous k inputs ; new inputs] and keeps the last k."""
        prev = self.conv[layer_idx]
        full = torch.cat([prev.to(conv_states.dtype), conv_states], dim=-1)
        prev.copy_(full[..., -prev.shape[-1]:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        self.ssm[layer_idx].copy_(recurrent_states)
        return self.ssm[layer_idx]

    # --- save / restore ---
    @property
    def batch_size(self) -> int:
        return self.conv[0].shape[0]

    def _like(self, tensors: list[torch.Tensor]) -> ForecasterState:
        """A state of the same layout holding ``tensors`` (in :meth:`tensors` order)."""
        n = len(self.conv)
        rest = list(tensors[2 * n:])
        switch = None
        if self.switch is not None:
            switch, rest = rest[len(rest) - len(self.switch):], rest[:len(rest) - len(self.switch)]
        comp = rest.pop() if self.components is not None else None
        online = rest[0] if self.online is not None else None
        hedge = rest[1:] if self.hedge is not None else None
        return ForecasterState(tensors[:n], tensors[n:2 * n], self.steps, online, hedge, comp, switch)

    def clone(self) -> ForecasterState:
        return self._like([t.clone() for t in self.tensors()])

    def copy_(self, other: ForecasterState) -> ForecasterState:
        """Overwrite this state in place with ``other`` (same shapes)."""
        for a, b in zip(self.tensors(), other.tensors(), strict=True):
            a.copy_(b)
        self.steps = other.steps
        return self

    @staticmethod
    def cat(states: list[ForecasterState]) -> ForecasterState:
        """Concatenate states along the batch dimension (e.g. to roll out from many positions at once)."""
        if not states:
            raise ValueError("no states to concatenate")
        parts = [s.tensors() for s in states]
        return states[0]._like([torch.cat(ts) for ts in zip(*parts, strict=True)])

    def put_rows(self, rows: torch.Tensor | list[int], other: ForecasterState) -> None:
        """Write ``other`` (batch = len(rows)) into batch rows ``rows`` of this state."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.conv[0].device)
        for a, b in zip(self.tensors(), other.tensors(), strict=True):
            a.index_copy_(0, idx, b.to(a.dtype))

    def select(self, index: torch.Tensor | list[int]) -> ForecasterState:
        """A new state holding the batch rows ``index``."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.conv[0].device)
        return self._like([t.index_select(0, idx) for t in self.tensors()])

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Zero the state of batch rows ``rows`` (a new sequence starts there)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.conv[0].device)
        for t in self.tensors():
            t.index_fill_(0, idx, 0.0)


# ----------------------------------------------------------------------------------------------
# online statistics


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
    hist = torch.cat([buf.flip(1), top], dim=1)  # [B, H + T, H, N, L, K], oldest first
    support = (x > 0).view(B, T, 1, L, E).expand(B, T, N, L, E)
    t_glob = seen + torch.arange(T, device=x.device, dtype=seen.dtype).view(1, T)
    r = torch.stack([score(support.gather(-1, hist[:, H - j - 1: H - j - 1 + T, j]).float())
                     * (t_glob - j - 1 >= 0).float().unsqueeze(-1) for j in range(H)], dim=2)  # [B, T, H, F]
    F = r.shape[-1]
    d = 0.5 ** (1.0 / half_life)
    out = ema_scan(r.reshape(B, T, H * F), torch.tensor([d], device=x.device),
                   None if prev is None else (prev * (1 - d)).view(B, 1, H * F))
    out = out[:, :, 0] / (1 - d)  # [B, T, H·F]: the discounted sums
    if saved is not None and T:
        buf.copy_(hist[:, -H:].flip(1))
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
        """Zero hedge state (None without per-sequence weighting): frequencies of the last H_d elements
        [B, H_d, M, L·E], scores [B, H_d, M+1], elements seen [B, 1]."""
        if self.rate <= 0:
            return None
        M, H = self.num_sources, self.heads
        return [torch.zeros(batch_size, H, M, self.L * self.E, device=device),
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
            buf, c_prev, seen = (x.new_zeros(B, H, M, L * E, dtype=torch.float32), x.new_zeros(B, H, M + 1),
                                 x.new_zeros(B, 1))
        # top-K of the kept and the new frequencies, oldest first (indices are cat, not the [.., L·E] frequencies)
        top = torch.cat([buf.flip(1).reshape(B, H, M, L, E).topk(K, dim=-1).indices,
                         freq.reshape(B, T, M, L, E).topk(K, dim=-1).indices], dim=1)  # [B, H + T, M, L, K]
        support = (x > 0).view(B, T, 1, L, E).expand(B, T, M, L, E)
        t_glob = seen + torch.arange(T, device=x.device, dtype=seen.dtype).view(1, T)  # [B, T] index of element t
        r = x.new_zeros(B, T, H, M + 1, dtype=torch.float32)
        for j in range(H):
            src = top[:, H - j - 1: H - j - 1 + T]  # forecasts issued at element t-j-1
            hit = support.gather(-1, src).float().mean(dim=(-1, -2))  # [B, T, M]
            valid = (t_glob - j - 1 >= 0).float().unsqueeze(-1)
            r[:, :, j, :M] = hit * valid
            r[:, :, j, M] = (K / E) * valid[..., 0]
        d = self.hedge_decay
        dec = torch.tensor([d], device=x.device)
        c = ema_scan(r.view(B, T, H * (M + 1)), dec, (c_prev * (1 - d)).view(B, 1, H * (M + 1)))
        c = (c[:, :, 0] / (1 - d)).view(B, T, H, M + 1)
        if state is not None and T:
            buf.copy_(torch.cat([buf.flip(1), freq], dim=1)[:, -H:].flip(1) if T < H else freq[:, -H:].flip(1))
            c_prev.copy_(c[:, -1])
            seen.add_(T)
        return c


# ----------------------------------------------------------------------------------------------
# the model


class ExpertForecaster(nn.Module):
    """Input projection -> Mamba backbone -> per-layer expert logits (+ the :class:`OnlinePrior` term when
    ``online_half_lives`` is set).

    ``forward(x)``: x [B, T, L, E] (or [B, T, L·E]) -> logits [B, T, L, E], where logits[:, i] predict
    element i+1 (see :func:`trigger_sequence`). With ``all_horizons=True`` it returns
    [B, T, H_d, L, E], entry [:, i, j] predicting element i+1+j (the direct heads,
    :attr:`ForecasterConfig.direct_horizons`). With ``state`` the window continues from it and the
    state is advanced in place (inference; no autograd through the state).
    """

    def __init__(self, config: ForecasterConfig):
        super().__init__()
        self.config = config
        c = config
        from expertcast.models.mamba_kernels import install

        install()  # mamba-ssm kernels only for CUDA tensors: a CPU-resident forecaster runs PyTorch
        self.in_proj = nn.Linear(c.input_size, c.hidden_size)
        if c.backbone == "mamba2":
            from transformers import Mamba2Config, Mamba2Model

            inner = c.expand * c.hidden_size
            bcfg = Mamba2Config(
                vocab_size=1, hidden_size=c.hidden_size, num_hidden_layers=c.num_blocks, state_size=c.state_size,
                expand=c.expand, head_dim=c.head_dim, num_heads=inner // c.head_dim, n_groups=c.n_groups,
                conv_kernel=c.conv_kernel, chunk_size=c.chunk_size, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                use_cache=False,
            )
            self.backbone = Mamba2Model(bcfg)
        else:
            from transformers import MambaConfig, MambaModel

            bcfg = MambaConfig(
                vocab_size=1, hidden_size=c.hidden_size, num_hidden_layers=c.num_blocks, state_size=c.state_size,
                expand=c.expand, conv_kernel=c.conv_kernel, use_mambapy=c.use_mambapy, pad_token_id=0,
                bos_token_id=0, eos_token_id=0, use_cache=False,
            )
            self.backbone = MambaModel(bcfg)
        if c.head_rank:  # factored per-layer heads: d -> H_d·L·r, then a per-layer [r, E] table
            self.head = nn.Linear(c.hidden_size, c.num_layers * c.head_rank * c.direct_horizons)
            self.head_experts = nn.Parameter(torch.randn(c.num_layers, c.head_rank, c.num_experts) / c.head_rank ** 0.5)
        else:
            self.head = nn.Linear(c.hidden_size, c.input_size * c.direct_horizons)
        self.components: ExactComponents | None = None
        if c.component_half_lives is not None:
            self.components = ExactComponents(c.num_layers, c.num_experts, c.component_half_lives)
        self.online: OnlinePrior | None = None
        if c.online_half_lives:
            self.online = OnlinePrior(c.online_half_lives, c.num_layers, c.num_experts, c.direct_horizons, c.top_k,
                                      c.online_hedge_rate, c.online_hedge_half_life)
            # the learned part starts at zero: the first forecasts are the online prior's
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    # --- state ---
    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> ForecasterState:
        """Zero recurrent state for ``batch_size`` sequences (float32, on the model's device by default)."""
        device = device or self.head.weight.device
        conv, ssm = [], []
        for block in self.backbone.layers:
            m = block.mixer
            k = m.conv_kernel_size
            if self.config.backbone == "mamba2":
                conv.append(torch.zeros(batch_size, m.conv_dim, k, device=device))
                ssm.append(torch.zeros(batch_size, m.num_heads, m.head_dim, m.ssm_state_size, device=device))
            else:
                conv.append(torch.zeros(batch_size, m.intermediate_size, k, device=device))
                ssm.append(torch.zeros(batch_size, m.intermediate_size, m.ssm_state_size, device=device))
        online = self.online.init_state(batch_size, device) if self.online is not None else None
        hedge = (self.online.init_hedge(batch_size, device) or []) if self.online is not None else []
        if self.config.learned_gate_rate > 0:
            c = self.config
            H = c.direct_horizons
            hedge += [torch.zeros(batch_size, H, H, 2, c.num_layers, c.top_k, dtype=torch.long, device=device),
                      torch.zeros(batch_size, H, device=device), torch.zeros(batch_size, 1, device=device)]
        comp = self.components.init_state(batch_size, device) if self.components is not None else None
        switch = None
        if comp is not None and self.config.switch_half_life > 0:
            c = self.config
            H = c.direct_horizons
            n = 1 + self.components.num_components
            switch = [torch.zeros(batch_size, H, H, n, c.num_layers, c.top_k, dtype=torch.long, device=device),
                      torch.zeros(batch_size, H * n * c.num_layers, device=device),
                      torch.zeros(batch_size, 1, device=device)]
        return ForecasterState(conv, ssm, online=online, hedge=hedge or None, components=comp, switch=switch)

    # --- compute ---
    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if x.dim() == 4:
            if tuple(x.shape[-2:]) != (c.num_layers, c.num_experts):
                raise ValueError(f"forecaster input must be [B, T, L={c.num_layers}, E={c.num_experts}], got "
                                 f"{tuple(x.shape)}")
            x = x.flatten(-2)
        if x.dim() != 3 or x.shape[-1] != c.input_size:
            raise ValueError(f"forecaster input must be [B, T, L·E={c.input_size}] or [B, T, L, E], got {tuple(x.shape)}")
        return x.to(self.in_proj.weight.dtype)

    def forward(self, x: torch.Tensor, state: ForecasterState | None = None, all_horizons: bool = False
                ) -> torch.Tensor:
        """x [B, T, L, E] or [B, T, L·E] -> logits [B, T, L, E] (or [B, T, H_d, L, E] with ``all_horizons``):
        ``residual_scale`` · learned logits + the online prior term."""
        c = self.config
        gate = c.learned_gate_rate > 0 and self.online is not None
        # the learned gate and the leader keep every head's forecasts in their state: all heads are computed
        learned, prior = self.forward_parts(x, state,
                                            all_horizons=True if (all_horizons or gate or self.leads) else None)
        rs = self.config.residual_scale
        if rs is not None:
            a = torch.tensor(rs[: learned.shape[2]], dtype=learned.dtype, device=learned.device)
            learned = learned * a.view(1, 1, -1, 1, 1)
        if gate:
            learned = learned * self._learned_gate(self._flat(x), learned, prior, state).unsqueeze(-1).unsqueeze(-1)
        logits = learned if prior is None else learned + prior
        if self.components is not None:
            logits = self._select(self._flat(x), logits, state)
        return logits if all_horizons else logits[:, :, 0]

    @property
    def leads(self) -> bool:
        """The per-sequence leader is on (:attr:`ForecasterConfig.switch_half_life`): the selection keeps the learned
        part at some head and layer. It replaces only the learned part: a selected component is a baseline itself,
        chosen on more elements than one sequence gives (switching among components per sequence chases noise)."""
        c = self.config
        return (self.components is not None and c.switch_half_life > 0 and c.selection is not None
                and any(v < 0 for row in c.selection for v in row))

    def _select(self, x: torch.Tensor, logits: torch.Tensor, state: ForecasterState | None) -> torch.Tensor:
        """Put the selected components' scores (times :data:`COMPONENT_SCALE`, exact) in place of the logits of the
        (head, layer) pairs ``selection`` gives them; advances the components' state. x [B, T, L·E]."""
        c = self.config
        B, T, H = logits.shape[:3]
        L = c.num_layers
        sel = torch.tensor(c.selection, dtype=torch.long, device=logits.device)[:H] if c.selection is not None \
            else None
        chosen = sorted({int(v) for v in sel.flatten().tolist() if v >= 0}) if sel is not None else []
        leader = self.leads
        used = list(range(self.components.num_components)) if leader else chosen
        if not used and state is None:
            return logits
        scores = self.components.scores(x.view(B, T, L, c.num_experts), H, used,
                                        state.components if state is not None else None)
        for k in chosen:
            logits = torch.where((sel == k).view(1, 1, H, L, 1), scores[k].to(logits.dtype) * COMPONENT_SCALE,
                                 logits)
        if leader:
            cands = [logits] + [scores[k].to(logits.dtype) * COMPONENT_SCALE for k in used]
            pick = self._leader(x, cands, state).masked_fill((sel >= 0).view(1, 1, H, L), 0)  # [B, T, H, L]
            for k in range(1, len(cands)):
                logits = torch.where((pick == k).unsqueeze(-1), cands[k], logits)
        return logits

    def _leader(self, x: torch.Tensor, cands: list[torch.Tensor], state: ForecasterState | None) -> torch.Tensor:
        """The per-sequence leader (:attr:`ForecasterConfig.switch_half_life`): x [B, T, L·E] and N candidate
        logits [B, T, H_d, L, E] (the selected forecast first) -> long [B, T, H_d, L], the candidate issued for
        element t's forecast: the best discounted recall@K over the forecasts that elements up to t resolved (ties:
        the lowest index); advances the switch's state."""
        c = self.config
        B, T, H = cands[0].shape[:3]
        L, K, N = c.num_layers, c.top_k, len(cands)
        with torch.no_grad():
            top = torch.stack([cd.float().topk(K, dim=-1).indices for cd in cands], dim=3)  # [B, T, H, N, L, K]
            saved = state.switch if state is not None else None
            sc = history_scores(x, top, saved, c.switch_half_life, lambda h: h.mean(-1).flatten(2)).view(B, T, H, N, L)
            # first maximum; a tie with the selected forecast keeps it (differences below float noise are ties)
            pick = sc.argmax(dim=3)
            keep = sc[:, :, :, 0] >= sc.max(dim=3).values - 1e-6
            return torch.where(keep, torch.zeros_like(pick), pick)

    def _learned_gate(self, x: torch.Tensor, learned: torch.Tensor, prior: torch.Tensor,
                      state: ForecasterState | None) -> torch.Tensor:
        """Per-sequence gate on the learned logits (:attr:`ForecasterConfig.learned_gate_rate`): x [B, T, L·E],
        learned (scaled) / prior [B, T, H_d, L, E] -> g [B, T, H_d] in (0, 1]; advances the gate's state."""
        c = self.config
        K = c.top_k
        with torch.no_grad():
            # top-K of each candidate, then stacked (stacking the [B, T, H, L, E] candidates first copies both)
            top = torch.stack([(learned.float() + prior.float()).topk(K, dim=-1).indices,
                               prior.float().topk(K, dim=-1).indices], dim=3)  # [B, T, H, 2, L, K]

            def gain(h: torch.Tensor) -> torch.Tensor:  # hits [B, T, 2, L, K] -> recall with minus without [B, T, 1]
                m = h.mean(dim=(-1, -2))
                return (m[..., 0] - m[..., 1]).unsqueeze(-1)

            saved = state.hedge[-3:] if state is not None else None
            dsum = history_scores(x, top, saved, c.learned_gate_half_life, gain)  # [B, T, H]
            return torch.exp(c.learned_gate_rate * dsum.clamp_max(0)).to(learned.dtype)

    def forward_parts(self, x: torch.Tensor, state: ForecasterState | None = None, all_horizons: bool | None = True
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The two terms of the logits before ``residual_scale``: (learned [B, T, H, L, E], online prior term
        [B, T, H, L, E] or None without online statistics); H = H_d (``all_horizons``) or 1 (None/False).
        The state, when given, is advanced in place as by :meth:`forward`."""
        x = self._flat(x)
        B, T, _ = x.shape
        if state is not None and state.batch_size != B:
            raise ValueError(f"state holds {state.batch_size} sequences but the input has batch {B}")
        out = self._backbone(self.in_proj(x), state)
        c = self.config
        heads = c.direct_horizons if all_horizons else 1
        if c.head_rank:
            n = c.num_layers * c.head_rank * heads
            z = nn.functional.linear(out, self.head.weight[:n], self.head.bias[:n]).view(
                B, T, heads, c.num_layers, c.head_rank)
            learned = torch.einsum("bthlr,lre->bthle", z, self.head_experts)
        else:
            n = c.input_size * heads  # only the rows of the heads asked for
            learned = nn.functional.linear(out, self.head.weight[:n], self.head.bias[:n]).view(
                B, T, heads, c.num_layers, c.num_experts)
        prior = self.online(x, state, heads) if self.online is not None else None
        if state is not None:
            state.steps += T
        return learned, prior

    def _backbone(self, h: torch.Tensor, state: ForecasterState | None) -> torch.Tensor:
        """Embedded inputs h [B, T, d] -> last hidden states [B, T, d] (the state advanced in place)."""
        if state is None:
            return self.backbone(inputs_embeds=h, use_cache=False).last_hidden_state
        if self.config.backbone == "mamba" and h.shape[1] > 1:
            # Mamba-1's scan cannot start from a non-zero state: advance one element at a time.
            outs = [self.backbone(inputs_embeds=h[:, i:i + 1], cache=state, use_cache=True).last_hidden_state
                    for i in range(h.shape[1])]
            return torch.cat(outs, dim=1)
        return self.backbone(inputs_embeds=h, cache=state, use_cache=True).last_hidden_state

    @torch.no_grad()
    def step(self, x_t: torch.Tensor, state: ForecasterState, all_horizons: bool = False
             ) -> tuple[torch.Tensor, ForecasterState]:
        """One element: x_t [B, L, E] or [B, L·E] -> (logits [B, L, E] for the next element, or [B, H_d, L, E]
        for the next H_d with ``all_horizons``; the state advanced in place)."""
        if x_t.dim() == 3:
            x_t = x_t.unsqueeze(1)
        elif x_t.dim() == 2:
            x_t = x_t.unsqueeze(1)
        else:
            raise ValueError(f"step input must be [B, L, E] or [B, L·E], got {tuple(x_t.shape)}")
        return self.forward(x_t, state, all_horizons=all_horizons)[:, 0], state

    @torch.no_grad()
    def rollout(self, logits: torch.Tensor, state: ForecasterState, horizon: int) -> torch.Tensor:
        """Multi-step forecast (SeqMoE 5.3).

        Args:
            logits: the prediction just returned by :meth:`step`: [B, L, E] (next element only) or
                [B, H_d, L, E] (``step(..., all_horizons=True)``: every direct head).
            state: the state after that step; saved before and restored after, so it is unchanged.
            horizon: number of future elements H >= 1.
        Returns:
            logits [B, H, L, E]. Entries [0, D) are the given heads (D = 1 or H_d); entry j >= D comes from
            feeding the next-element predictions of the previous entries back as inputs (recursive rollout)
            and reading the last direct head, so with D = 1 this is the paper's recursive rollout.
        """
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        c = self.config
        if logits.dim() == 3:
            logits = logits.unsqueeze(1)
        if logits.dim() != 4 or tuple(logits.shape[-2:]) != (c.num_layers, c.num_experts):
            raise ValueError(f"rollout needs logits [B, L, E] or [B, D, L, E], got {tuple(logits.shape)}")
        D = logits.shape[1]
        if D not in (1, c.direct_horizons):
            raise ValueError(f"rollout got {D} heads; the forecaster has 1 or {c.direct_horizons}")
        if horizon <= D:
            return logits[:, :horizon]
        out = list(logits.unbind(1))
        saved = state.clone()
        try:
            cur = logits
            for _ in range(horizon - D):
                cur, _ = self.step(predictions_to_input(cur[:, 0], c.top_k), state, all_horizons=True)
                out.append(cur[:, D - 1])
        finally:
            state.copy_(saved)
        return torch.stack(out, dim=1)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Calibrated per-expert selection probabilities [..., H, L, E] from logits [..., H, L, E] (the horizon
        axis third from last, as :meth:`rollout` and ``forward(all_horizons=True)`` give them; see
        :func:`activation_probs`): horizon h at the temperature of direct head min(h, H_d - 1) when
        ``head_temperatures`` is set, else at ``temperature``."""
        c = self.config
        if not c.head_temperatures or logits.dim() < 3:
            return activation_probs(logits, c.top_k, c.temperature)
        H, ts = logits.shape[-3], c.head_temperatures
        T = torch.tensor([float(ts[min(h, len(ts) - 1)]) for h in range(H)], device=logits.device).view(H, 1, 1)
        return activation_probs(logits, c.top_k, T)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def step_flops(self) -> int:
        """Approximate multiply-add FLOPs (2 per MAC) of one :meth:`step` at batch 1 (linear layers + SSM update)."""
        c = self.config
        macs = c.input_size * c.hidden_size  # in_proj
        H = c.direct_horizons
        macs += (c.hidden_size + c.num_experts) * c.num_layers * c.head_rank * H if c.head_rank else \
            c.input_size * c.hidden_size * H  # head
        for block in self.backbone.layers:
            m = block.mixer
            for mod in m.modules():
                if isinstance(mod, nn.Linear):
                    macs += mod.in_features * mod.out_features
            if c.backbone == "mamba2":
                macs += m.conv_dim * m.conv_kernel_size + 2 * m.num_heads * m.head_dim * m.ssm_state_size
            else:
                macs += m.intermediate_size * (m.conv_kernel_size + 2 * m.ssm_state_size)
        if self.online is not None:  # moving averages + mixture and gate of every head
            M = self.online.num_sources
            macs += M * (c.input_size + 1) + c.direct_horizons * c.input_size * (M + 2)
            if self.online.rate > 0:  # top-K of the sources and their scores at every horizon
                macs += M * c.input_size + c.direct_horizons * M * c.num_layers * c.top_k
        if self.components is not None:  # moving averages; the transition table for the heads that select it
            macs += 4 * len(self.components.half_lives) * c.input_size
            sel = c.selection or []
            trans_heads = max([j + 1 for j, row in enumerate(sel) if 2 in row] or [0])
            macs += trans_heads * c.input_size * c.num_experts
            if self.leads:  # the leader: every component at every head, the top-K of each and its running score
                n = 1 + self.components.num_components
                macs += n * c.direct_horizons * (c.input_size + c.num_layers * c.top_k)
                macs += c.direct_horizons * c.input_size * c.num_experts if trans_heads < c.direct_horizons else 0
        return 2 * macs


def untrained_forecaster(num_layers: int, num_experts: int, top_k: int, seed: int = 0):
    """A small randomly initialised :class:`ExpertForecaster` (eval mode) of the
    given routing shape: a deterministic stand-in for checks that exercise SeqMoE's mechanics, not its quality."""
    torch.manual_seed(seed)
    return ExpertForecaster(ForecasterConfig(num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                                             hidden_size=32, num_blocks=1, state_size=8, head_dim=16,
                                             chunk_size=16)).eval()
