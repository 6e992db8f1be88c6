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
transformers' own recurrent decode path (and mamba-ssm's kernels on CUDA when installed; transformers
resolves them lazily, nothing here imports ``mamba_ssm``). :meth:`ExpertForecaster.rollout` saves the
state, feeds its own predictions back for several steps and restores the state, so a rollout never
disturbs the next one-step prediction (SeqMoE 5.3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
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
        """Inverse of :meth:`to_dict`; keys added after format version 1 (``direct_horizons``) take their defaults."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown forecaster config keys: {sorted(unknown)}")
        return cls(**d)


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
    """Recurrent state of the backbone: per block a conv state and an SSM state.

    Shapes (B = batch): Mamba2 conv [B, expand·d + 2·G·N, k], ssm [B, H, head_dim, N];
    Mamba conv [B, expand·d, k], ssm [B, expand·d, N]. ``steps`` counts the elements consumed.

    The object implements the part of transformers' linear-attention cache protocol that the Mamba
    mixers call (get/update conv and recurrent state), so it can be passed as their ``cache``.
    State tensors are updated in place; use :meth:`clone` / :meth:`copy_` to save and restore.
    """

    def __init__(self, conv: list[torch.Tensor], ssm: list[torch.Tensor], steps: int = 0):
        if len(conv) != len(ssm):
            raise ValueError("conv and ssm state lists differ in length")
        self.conv = conv
        self.ssm = ssm
        self.steps = steps

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

    def clone(self) -> ForecasterState:
        return ForecasterState([c.clone() for c in self.conv], [s.clone() for s in self.ssm], self.steps)

    def copy_(self, other: ForecasterState) -> ForecasterState:
        """Overwrite this state in place with ``other`` (same shapes)."""
        for a, b in zip(self.conv + self.ssm, other.conv + other.ssm, strict=True):
            a.copy_(b)
        self.steps = other.steps
        return self

    @staticmethod
    def cat(states: list[ForecasterState]) -> ForecasterState:
        """Concatenate states along the batch dimension (e.g. to roll out from many positions at once)."""
        if not states:
            raise ValueError("no states to concatenate")
        n = len(states[0].conv)
        return ForecasterState([torch.cat([s.conv[i] for s in states]) for i in range(n)],
                               [torch.cat([s.ssm[i] for s in states]) for i in range(n)], states[0].steps)

    def put_rows(self, rows: torch.Tensor | list[int], other: ForecasterState) -> None:
        """Write ``other`` (batch = len(rows)) into batch rows ``rows`` of this state."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.conv[0].device)
        for a, b in zip(self.conv + self.ssm, other.conv + other.ssm, strict=True):
            a.index_copy_(0, idx, b.to(a.dtype))

    def select(self, index: torch.Tensor | list[int]) -> ForecasterState:
        """A new state holding the batch rows ``index``."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.conv[0].device)
        return ForecasterState([c.index_select(0, idx) for c in self.conv], [s.index_select(0, idx) for s in self.ssm],
                               self.steps)

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Zero the state of batch rows ``rows`` (a new sequence starts there)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.conv[0].device)
        for t in self.conv + self.ssm:
            t.index_fill_(0, idx, 0.0)


# ----------------------------------------------------------------------------------------------
# the model


class ExpertForecaster(nn.Module):
    """Input projection -> Mamba backbone -> per-layer expert logits.

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
        self.head = nn.Linear(c.hidden_size, c.input_size * c.direct_horizons)

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
        return ForecasterState(conv, ssm)

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
        """x [B, T, L, E] or [B, T, L·E] -> logits [B, T, L, E] (or [B, T, H_d, L, E] with ``all_horizons``)."""
        x = self._flat(x)
        B, T, _ = x.shape
        h = self.in_proj(x)
        if state is None:
            out = self.backbone(inputs_embeds=h, use_cache=False).last_hidden_state
        else:
            if state.batch_size != B:
                raise ValueError(f"state holds {state.batch_size} sequences but the input has batch {B}")
            if self.config.backbone == "mamba" and T > 1:
                # Mamba-1's scan cannot start from a non-zero state: advance one element at a time.
                outs = [self.backbone(inputs_embeds=h[:, i:i + 1], cache=state, use_cache=True).last_hidden_state
                        for i in range(T)]
                out = torch.cat(outs, dim=1)
            else:
                out = self.backbone(inputs_embeds=h, cache=state, use_cache=True).last_hidden_state
            state.steps += T
        c = self.config
        if all_horizons:
            return self.head(out).view(B, T, c.direct_horizons, c.num_layers, c.num_experts)
        n = c.input_size  # only the next-element rows of the head
        return nn.functional.linear(out, self.head.weight[:n], self.head.bias[:n]).view(B, T, c.num_layers,
                                                                                          c.num_experts)

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
        """Calibrated per-expert selection probabilities [..., L, E] from logits (see :func:`activation_probs`)."""
        return activation_probs(logits, self.config.top_k, self.config.temperature)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def step_flops(self) -> int:
        """Approximate multiply-add FLOPs (2 per MAC) of one :meth:`step` at batch 1 (linear layers + SSM update)."""
        c = self.config
        macs = c.input_size * c.hidden_size * (1 + c.direct_horizons)  # in_proj + head
        for block in self.backbone.layers:
            m = block.mixer
            for mod in m.modules():
                if isinstance(mod, nn.Linear):
                    macs += mod.in_features * mod.out_features
            if c.backbone == "mamba2":
                macs += m.conv_dim * m.conv_kernel_size + 2 * m.num_heads * m.head_dim * m.ssm_state_size
            else:
                macs += m.intermediate_size * (m.conv_kernel_size + 2 * m.ssm_state_size)
        return 2 * macs
