"""SeqMoE expert-activation forecaster (SeqMoE 3.1, 5.2, 5.3; docs/design.md "Forecaster").

The forecaster reads, per decode step, the activation vector of all MoE layers (size L·E: the
normalized top-K weights at the active experts, zeros elsewhere; :mod:`expertcast.models.forecaster_inputs` builds
them and the trigger-layer elements), runs it through the project's own Mamba-2 backbone
(:class:`~expertcast.models.mamba2.Mamba2Backbone`) and emits per-layer expert logits for the next element.

Recurrent state: :class:`~expertcast.models.forecaster_state.ForecasterState` holds the conv window and SSD state of
every Mamba-2 block as explicit tensors, the layout the project defines; :meth:`ExpertForecaster.step` is the
backbone's one-step update (mamba-ssm's / causal-conv1d's kernels for CUDA tensors when installed, never for CPU
tensors: :mod:`expertcast.models.mamba_kernels`), and it computes what a whole window computes.
:meth:`ExpertForecaster.rollout` saves the state, feeds its own predictions back for several steps and
restores the state, so a rollout never disturbs the next one-step prediction (SeqMoE 5.3).

The inputs' helpers, the state and the online statistics live in their own modules and are importable from here
too (``__all__``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from expertcast.models.forecaster_components import (
    COMPONENT_SCALE,
    ExactComponents,
    check_cross_recent,
    component_names,
    decay_of,
)
from expertcast.models.forecaster_inputs import (
    activation_probs,
    activation_vector,
    predictions_to_input,
    trigger_offset,
    trigger_sequence,
)
from expertcast.models.forecaster_online import OnlinePrior, ema_scan, history_scores
from expertcast.models.forecaster_state import ForecasterState
from expertcast.models.mamba2 import Mamba2Backbone
from torch import nn

__all__ = ["BACKBONES", "ExpertForecaster", "ForecasterConfig", "ForecasterState", "OnlinePrior", "activation_probs",
           "activation_vector", "check_backbone", "ema_scan", "history_scores", "predictions_to_input", "scaled_width",
           "trigger_offset", "trigger_sequence", "untrained_forecaster"]

BACKBONES = ("mamba2",)
"""The backbones a forecaster can have: the project's own Mamba-2 (:mod:`expertcast.models.mamba2`)."""
RETIRED_KEYS = {"use_mambapy": False}
"""Config keys of earlier exports that no longer exist, with the only value they may hold (anything else is a
forecaster this expertcast cannot build)."""


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
    """``mamba2``: the project's Mamba-2 (:class:`~expertcast.models.mamba2.Mamba2Backbone`), the only one."""
    hidden_size: int = 128
    """Width d of the backbone."""
    num_blocks: int = 2
    """Mamba blocks in the backbone."""
    state_size: int = 32
    """SSM state size N per head."""
    head_dim: int = 32
    """Head dimension; expand·d must be divisible by it."""
    expand: int = 2
    """Inner width multiplier of the Mamba-2 mixers."""
    conv_kernel: int = 4
    """Width of the causal depthwise convolution."""
    n_groups: int = 1
    """B/C groups (must divide the number of heads)."""
    chunk_size: int = 64
    """SSD scan chunk length."""
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
    component_cross_layer: bool = False
    """With components: also the cross-layer component (docs/design.md "Exact components"), the fit set's map from
    the trigger layer's experts to every layer's of the next element (the later layers of the same token), indexed
    after the recent-count ones. False: without it (every export before it: no ``components.cross`` tensor, same
    component indices)."""
    component_cross_recent: bool = False
    """With the cross-layer component: also cross-x-recent (docs/design.md "Exact components"), the cross-layer scores
    times the sequence's recent-freq at half-life 16 (which ``component_half_lives`` must hold) over the fit set's
    frequency, indexed after cross-layer. False: without it (every export before it: same component indices)."""
    within_token_table: bool = False
    """With components: also carry the fit set's within-token table ``components.within`` [L, E, E] (layer l - 1's
    experts to layer l's of the same token, :func:`~expertcast.models.forecaster_components.fit_within_token`),
    which seqmoe's ``replan`` reads to refine a forecast later in the token (docs/design.md, "Prefetch"). Not a
    component: no index, no selection. False: without it (every export before it: no such tensor)."""
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
    skip_hidden: int = 0
    """s > 0: the per-element branch (docs/design.md "Forecaster"): the learned logits are the backbone's head plus
    an MLP over the current element and its recent frequency, [x_t ; m_t] (2·L·E, m the moving average of the
    elements at half-life :data:`SKIP_HALF_LIFE`) -> s (ReLU) -> H_d·L·E, the MLP reference's form, so what one
    element shows (e.g. layer p's experts, which predict the later layers of the same token) reaches the logits
    without passing the backbone's width and head rank. Its moving average is recurrent state. 0: none (every
    export before it)."""
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
        if self.component_cross_layer and self.component_half_lives is None:
            raise ValueError("component_cross_layer needs the exact components (component_half_lives)")
        if self.component_cross_recent:
            check_cross_recent(self.component_half_lives, self.component_cross_layer)
        if self.within_token_table and self.component_half_lives is None:
            raise ValueError("within_token_table needs the exact components (component_half_lives)")
        if self.selection is not None:
            n = len(component_names(self.component_half_lives, self.component_cross_layer,
                                    self.component_cross_recent)) \
                if self.component_half_lives is not None else 0
            sel = self.selection
            if len(sel) != self.direct_horizons or any(len(r) != self.num_layers for r in sel) or \
                    any(not -1 <= int(v) < n for r in sel for v in r):
                raise ValueError(f"selection must be [direct_horizons={self.direct_horizons}][L={self.num_layers}] "
                                 f"values in [-1, {n - 1}] (components: {n}), got {sel}")
        if not self.switch_half_life >= 0:
            raise ValueError(f"switch_half_life must be >= 0, got {self.switch_half_life}")
        if self.head_rank < 0:
            raise ValueError(f"head_rank must be >= 0, got {self.head_rank}")
        if self.skip_hidden < 0:
            raise ValueError(f"skip_hidden must be >= 0, got {self.skip_hidden}")
        check_backbone(self.backbone)
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
        ``residual_scale``) take their defaults, so a format-1 export is a forecaster without online statistics.
        Retired keys (:data:`RETIRED_KEYS`) are dropped when they hold their only value."""
        d = dict(d)
        for key, only in RETIRED_KEYS.items():
            if key in d and (value := d.pop(key)) != only:
                raise ValueError(f"{key}={value!r} is not supported (a Mamba-1 option)")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown forecaster config keys: {sorted(unknown)}")
        d["online_half_lives"] = [float(h) for h in d.get("online_half_lives") or []]
        if d.get("residual_scale") is not None:
            d["residual_scale"] = [float(a) for a in d["residual_scale"]]
        if d.get("component_half_lives") is not None:
            d["component_half_lives"] = [float(h) for h in d["component_half_lives"]]
        if d.get("selection") is not None:
            d["selection"] = [[int(v) for v in r] for r in d["selection"]]
        return cls(**d)


def check_backbone(name: str) -> None:
    """Refuse a backbone other than :data:`BACKBONES`, Mamba-1 by name (one line)."""
    if name == "mamba":
        raise ValueError("backbone 'mamba' (Mamba-1) is not supported: the forecaster's backbone is the project's "
                         "own Mamba-2 (backbone: mamba2)")
    if name not in BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; choose one of {BACKBONES}")


def scaled_width(num_layers: int, num_experts: int) -> int:
    """Backbone width for an L x E input: L·E / 8 rounded to a multiple of 64, within [64, 1024] (26 x 64 -> 192,
    48 x 128 -> 768)."""
    return int(min(1024, max(64, 64 * round(num_layers * num_experts / 8 / 64))))


SKIP_HALF_LIFE = 16.0
"""Half-life (elements) of the recent frequency the per-element branch reads (the MLP reference's and the recent-freq
baseline's)."""


class ElementBranch(nn.Module):
    """The per-element branch (:attr:`ForecasterConfig.skip_hidden`): [x_t ; m_t] -> hidden (ReLU) -> H_d·L·E logits,
    m_t = d·m_{t-1} + (1-d)·x_t the moving average of the elements (d = 0.5^(1/:data:`SKIP_HALF_LIFE`), zero before a
    sequence's first element), as the MLP reference reads them."""

    def __init__(self, input_size: int, hidden: int, outputs: int):
        super().__init__()
        self.hidden = nn.Linear(2 * input_size, hidden)
        self.out = nn.Linear(hidden, outputs)
        self.register_buffer("decay", decay_of(SKIP_HALF_LIFE), persistent=False)

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, L·E]; prev [B, 1, L·E] the moving average before x[:, 0] (None: zeros); the first ``rows``
        outputs -> (logits [B, T, rows], the moving average after x[:, -1] [B, 1, L·E])."""
        m = ema_scan(x, self.decay.to(x.dtype), prev)[:, :, 0]
        h = torch.relu(self.hidden(torch.cat([x, m], dim=-1)))
        return nn.functional.linear(h, self.out.weight[:rows], self.out.bias[:rows]), m[:, -1:]


class ExpertForecaster(nn.Module):
    """Input projection -> Mamba-2 backbone -> per-layer expert logits (+ the :class:`ElementBranch` when
    ``skip_hidden`` is set, + the :class:`OnlinePrior` term when ``online_half_lives`` is set).

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
        self.backbone = Mamba2Backbone(c.hidden_size, c.num_blocks, c.state_size, c.head_dim, c.expand, c.conv_kernel,
                                       c.n_groups, c.chunk_size)
        if c.head_rank:  # factored per-layer heads: d -> H_d·L·r, then a per-layer [r, E] table
            self.head = nn.Linear(c.hidden_size, c.num_layers * c.head_rank * c.direct_horizons)
            self.head_experts = nn.Parameter(torch.randn(c.num_layers, c.head_rank, c.num_experts) / c.head_rank ** 0.5)
        else:
            self.head = nn.Linear(c.hidden_size, c.input_size * c.direct_horizons)
        self.skip: ElementBranch | None = None
        if c.skip_hidden:
            self.skip = ElementBranch(c.input_size, c.skip_hidden, c.input_size * c.direct_horizons)
        self.components: ExactComponents | None = None
        if c.component_half_lives is not None:
            self.components = ExactComponents(c.num_layers, c.num_experts, c.component_half_lives,
                                              c.component_cross_layer, c.p, c.component_cross_recent,
                                              c.within_token_table)
        self.online: OnlinePrior | None = None
        if c.online_half_lives:
            self.online = OnlinePrior(c.online_half_lives, c.num_layers, c.num_experts, c.direct_horizons, c.top_k,
                                      c.online_hedge_rate, c.online_hedge_half_life)
            # the learned part starts at zero: the first forecasts are the online prior's
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
            if self.skip is not None:
                nn.init.zeros_(self.skip.out.weight)
                nn.init.zeros_(self.skip.out.bias)

    # --- state ---
    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> ForecasterState:
        """Zero recurrent state for ``batch_size`` sequences (float32, on the model's device by default)."""
        device = device or self.head.weight.device
        shapes = self.backbone.state_shapes()
        conv = [torch.zeros(batch_size, *cs, device=device) for cs, _ in shapes]
        ssm = [torch.zeros(batch_size, *ss, device=device) for _, ss in shapes]
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
        skip = torch.zeros(batch_size, 1, self.config.input_size, device=device) if self.skip is not None else None
        return ForecasterState(conv, ssm, online=online, hedge=hedge or None, components=comp, switch=switch,
                               skip=skip)

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
        return self.forward_from_parts(x, learned, prior, state, all_horizons)

    def forward_from_parts(self, x: torch.Tensor, learned: torch.Tensor, prior: torch.Tensor | None,
                           state: ForecasterState | None = None, all_horizons: bool = False) -> torch.Tensor:
        """The rest of :meth:`forward` from :meth:`forward_parts`' terms of the same ``x`` (every head): the
        ``residual_scale``, the learned gate, the selection; ``learned`` and ``prior`` are left unchanged, so that
        one backbone pass serves several settings (the post-fit selection's residual scales)."""
        c = self.config
        gate = c.learned_gate_rate > 0 and self.online is not None
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
        chosen = sorted({int(v) for row in c.selection[:H] for v in row if v >= 0}) if sel is not None else []
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
        if self.skip is not None:  # the per-element branch adds to the head's logits
            sk, last = self.skip(x, state.skip if state is not None else None, heads * c.input_size)
            learned = learned + sk.view(B, T, heads, c.num_layers, c.num_experts)
            if state is not None:
                state.skip.copy_(last)
        prior = self.online(x, state, heads) if self.online is not None else None
        if state is not None:
            state.steps += T
        return learned, prior

    def _backbone(self, h: torch.Tensor, state: ForecasterState | None) -> torch.Tensor:
        """Embedded inputs h [B, T, d] -> last hidden states [B, T, d] (the state advanced in place)."""
        if state is None:
            return self.backbone(h)
        return self.backbone(h, state.conv, state.ssm)

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
        macs += self.backbone.step_macs()
        if self.skip is not None:  # moving average, hidden layer, every head's outputs
            macs += c.input_size + 2 * c.input_size * c.skip_hidden + c.skip_hidden * c.input_size * H
        if self.online is not None:  # moving averages + mixture and gate of every head
            M = self.online.num_sources
            macs += M * (c.input_size + 1) + c.direct_horizons * c.input_size * (M + 2)
            if self.online.rate > 0:  # top-K of the sources and their scores at every horizon
                macs += M * c.input_size + c.direct_horizons * M * c.num_layers * c.top_k
        if self.components is not None:  # moving averages; the transition / cross-layer tables for the heads that
            # select them (the cross-layer one: the trigger layer through [L, E, E], then the transition table)
            macs += 4 * len(self.components.half_lives) * c.input_size
            sel = c.selection or []
            trans_heads = max([j + 1 for j, row in enumerate(sel) if 2 in row] or [0])
            macs += trans_heads * c.input_size * c.num_experts
            x, xr = self.components.cross_index, self.components.cross_recent_index
            if x is not None:  # the leader computes it at every head (cross-x-recent needs it too)
                cross_heads = c.direct_horizons if self.leads else max([j + 1 for j, row in enumerate(sel)
                                                                        if x in row or xr in row] or [0])
                macs += cross_heads * c.input_size * c.num_experts
                if xr is not None:  # the recent / frequency ratio, then one product per head that issues it
                    prod_heads = c.direct_horizons if self.leads else max([j + 1 for j, row in enumerate(sel)
                                                                           if xr in row] or [0])
                    macs += (c.input_size if prod_heads else 0) + prod_heads * c.input_size
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
