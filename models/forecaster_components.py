"""The online statistics as exact forecaster components (docs/design.md "Exact components").

One implementation of each statistic, shared by the forecaster (:class:`ExactComponents`, a part of
:class:`~expertcast.models.forecaster.ExpertForecaster`) and the baselines of ``expertcast forecast-eval``
(:mod:`expertcast.models.forecaster_recall`), so that a forecaster whose gate selects a component issues the
baseline's scores bit for bit (same float32 operations in the same order) and its top-K, ties included, is the
baseline's:

- ``repeat-last``: element i's weights, ties broken by the fit set's expert frequency (``1e-3 · freq / max``);
- ``frequency``: the fit set's per-layer expert frequency;
- ``transition``: the fit set's first-order per-layer transition table (add-0.01 smoothing), applied h times to
  the current element's weights for horizon h, ``+ 1e-6 · freq`` for ties. "Online" for it means: the table is
  fitted once on the fit sequences and stored in the export (``components.trans``), the per-sequence input is
  the current element;
- ``recent-freq`` at each half-life h (``recent-freq`` is h = 16, the others ``recent-freq-h{h}``): the
  sequence's own moving average ``e_t = e_{t-1}·d + v_t·(1-d)``, ``d = 0.5^(1/h)``, from zero at the sequence's
  start, scored ``e_t + (0.05·(1-d))·freq``, ``v_t`` the element's router weights (normalized);
- ``recent-count`` at each half-life h (``recent-count`` is h = 16, the others ``recent-count-h{h}``): the same
  moving average of the element's *membership* (1/K for each selected expert, router weights ignored): what the
  cache needs, and the LFU key as h grows (a sequence's favourites are selected with weights that vary; the
  weighted average mixes that noise into the ranking);
- ``cross-layer`` (last, where the forecaster carries it): the fit set's table from the trigger layer p's experts
  of element i to layer l's of element i+1, C_l[e, e'] = #(e at layer p in element i, e' at layer l in element
  i+1) + 0.01, rows normalized. For l > p element i+1's layer l is the same token as element i's layer p, so this is
  the within-token map from the freshly routed trigger layer to the later layers (C_p is the transition table's
  layer p). Horizon 1 is element i's layer-p weights (normalized) through C_l for every layer l; horizon h >= 2
  pushes horizon h-1 through the transition table; ``+ 1e-6 · freq`` for ties;
- ``cross-x-recent`` (after cross-layer, where the forecaster carries it): the cross-layer scores times the
  sequence's recent-freq (half-life 16) over the fit set's frequency, a naive-Bayes product of the two signals the
  MLP reference reads (the current element and the sequence's recent usage): P(e | trigger layer) x P(e | this
  sequence) / P(e), the within-token map reweighted by the experts this sequence favours.

The fitted tables (``freq`` [L, E], ``trans`` [L, E, E], ``cross`` [L, E, E]) are buffers of the export: a
forecaster reproduces the baselines exactly when forecast-eval fits them on the same sequences (the export's train +
val ids, its default).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from expertcast.models.forecaster_inputs import inclusion_probs, trigger_sequence
from torch import nn

RECENT_PRIOR = 0.05
"""Weight of the fit-set frequency in the recent-freq score (times 1 - d)."""
TRANSITION_ALPHA = 0.01
"""Add-alpha smoothing of the transition counts."""
COMPONENT_SCALE = 64.0
"""A selected component's logits are this power of two times its scores: exact (no rounding), so its top-K is the
component's, and a softmax over them is not flat."""


def recent_name(half_life: float) -> str:
    """Name of the recent-freq component / baseline at ``half_life`` (16 is the plain ``recent-freq``)."""
    return "recent-freq" if float(half_life) == 16.0 else f"recent-freq-h{float(half_life):g}"


def count_name(half_life: float) -> str:
    """Name of the recent-count component / baseline at ``half_life`` (16 is the plain ``recent-count``)."""
    return "recent-count" if float(half_life) == 16.0 else f"recent-count-h{float(half_life):g}"


CROSS_LAYER = "cross-layer"
"""Name of the cross-layer component / baseline."""
CROSS_RECENT = "cross-x-recent"
"""Name of the cross-layer x recent-freq component / baseline."""
CROSS_RECENT_HALF_LIFE = 16.0
"""Half-life of the recent-freq average the cross-x-recent component reweights by."""


def component_names(half_lives: Sequence[float], cross_layer: bool = False, cross_recent: bool = False) -> list[str]:
    """The components in their index order (the values of ``ForecasterConfig.selection``): the three fitted /
    last-element ones, recent-freq at each half-life, recent-count at each half-life, then (``cross_layer``)
    cross-layer, then (``cross_recent``) cross-x-recent. Each appended last, so that no earlier component's index
    depends on it (exports written without it keep their indices)."""
    return (["repeat-last", "frequency", "transition"] + [recent_name(h) for h in half_lives]
            + [count_name(h) for h in half_lives] + ([CROSS_LAYER] if cross_layer else [])
            + ([CROSS_RECENT] if cross_recent else []))


def check_cross_recent(half_lives: Sequence[float] | None, cross_layer: bool) -> None:
    """Raise ValueError unless the cross-x-recent component has its inputs: the cross-layer component and the
    recent-freq average of half-life ``CROSS_RECENT_HALF_LIFE`` among ``half_lives``."""
    if not (cross_layer and CROSS_RECENT_HALF_LIFE in [float(h) for h in half_lives or []]):
        raise ValueError(f"component_cross_recent ({CROSS_RECENT}) needs component_cross_layer and "
                         f"{CROSS_RECENT_HALF_LIFE:g} among component_half_lives")


def decay_of(half_life: float) -> torch.Tensor:
    """float32 [1] decay ``0.5^(1/h)`` of a half-life (h > 0)."""
    return torch.tensor([0.5 ** (1.0 / float(half_life))], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- fitted tables
def fit_frequency(seqs: Sequence, num_layers: int, num_experts: int) -> torch.Tensor:
    """Per-layer expert frequency of the sequences' selections: float32 [L, E] (rows sum to 1)."""
    freq = torch.zeros(num_layers, num_experts, dtype=torch.float64)
    for sq in seqs:
        ids = torch.from_numpy(np.asarray(sq.expert_ids, dtype=np.int64))
        flat = ids.permute(1, 0, 2).reshape(num_layers, -1)
        freq.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float64))
    return (freq / freq.sum(-1, keepdim=True).clamp_min(1)).float()


def _pair_table(seqs: Sequence, num_layers: int, num_experts: int, p: int, alpha: float, cross: bool) -> torch.Tensor:
    """float32 [L, E, E] of #(e at the source layer in element i, e' at layer l in element i+1) + alpha, rows
    normalized, over forecaster elements of trigger layer ``p``; the source layer is l itself, or p (``cross``)."""
    L, E = num_layers, num_experts
    counts = torch.full((L, E, E), alpha, dtype=torch.float64)
    for sq in seqs:
        ids = trigger_sequence(torch.from_numpy(np.asarray(sq.expert_ids, dtype=np.int64)), p)  # [T', L, K]
        if ids.shape[0] < 2:
            continue
        a, b = ids[:-1], ids[1:]
        if cross:
            a = a[:, p:p + 1].expand_as(b)
        K = a.shape[-1]
        src = a.unsqueeze(-1).expand(-1, -1, K, K)
        dst = b.unsqueeze(-2).expand(-1, -1, K, K)
        lidx = torch.arange(L).view(1, L, 1, 1).expand_as(src)
        flat = (lidx * E * E + src * E + dst).reshape(-1)
        counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
    return (counts / counts.sum(-1, keepdim=True)).float()


def fit_transition(seqs: Sequence, num_layers: int, num_experts: int, p: int,
                   alpha: float = TRANSITION_ALPHA) -> torch.Tensor:
    """First-order per-layer transition table over forecaster elements of trigger layer ``p``: float32 [L, E, E],
    T_l[e, e'] = #(e in element i, e' in element i+1) + alpha, rows normalized."""
    return _pair_table(seqs, num_layers, num_experts, p, alpha, cross=False)


def fit_cross_layer(seqs: Sequence, num_layers: int, num_experts: int, p: int,
                    alpha: float = TRANSITION_ALPHA) -> torch.Tensor:
    """Cross-layer table over forecaster elements of trigger layer ``p``: float32 [L, E, E],
    C_l[e, e'] = #(e at layer p in element i, e' at layer l in element i+1) + alpha, rows normalized (C_p is
    :func:`fit_transition`'s layer p)."""
    return _pair_table(seqs, num_layers, num_experts, p, alpha, cross=True)


def fit_within_token(seqs: Sequence, num_layers: int, num_experts: int, sources: Sequence[int],
                     alpha: float = TRANSITION_ALPHA) -> torch.Tensor:
    """Within-token table from a chosen source layer to each layer, over every position (token) of the sequences:
    float32 [L, E, E], W_l[e, e'] = #(e at layer ``sources[l]``, e' at layer l, same position) + alpha, rows
    normalized; a layer whose source is negative (or not below it) keeps uniform rows. ``sources[l] = p`` for every
    l > p is the cross-layer table's within-token part (:func:`fit_cross_layer`, counted on tokens instead of
    forecaster elements); ``sources[l] = l - d``: the map from the layer d before (docs/design.md, "Generalisation
    protocol", within-token reach)."""
    L, E = num_layers, num_experts
    counts = torch.full((L, E, E), alpha, dtype=torch.float64)
    src_of = [int(s) for s in sources]
    if len(src_of) != L:
        raise ValueError(f"sources names {len(src_of)} layers, expected {L}")
    pairs = [(layer, s) for layer, s in enumerate(src_of) if 0 <= s < layer]
    tl = torch.tensor([layer for layer, _ in pairs], dtype=torch.long)
    sl = torch.tensor([s for _, s in pairs], dtype=torch.long)
    for sq in seqs if pairs else ():
        ids = torch.from_numpy(np.asarray(sq.expert_ids, dtype=np.int64))  # [T, L, K]
        if ids.shape[0] == 0:
            continue
        a, b = ids[:, sl], ids[:, tl]  # [T, P, K]
        K = a.shape[-1]
        src = a.unsqueeze(-1).expand(-1, -1, K, K)
        dst = b.unsqueeze(-2).expand(-1, -1, K, K)
        lidx = tl.view(1, -1, 1, 1).expand_as(src)
        flat = (lidx * E * E + src * E + dst).reshape(-1)
        counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
    return (counts / counts.sum(-1, keepdim=True)).float()


# ---------------------------------------------------------------------------------------------- the statistics
def repeat_last_scores(x: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """x [..., L, E] -> [..., L, E]: the current weights, ties broken by the fit-set frequency."""
    return x + 1e-3 * freq / freq.max().clamp_min(1e-9)


def transition_scores(x: torch.Tensor, trans: torch.Tensor, freq: torch.Tensor, horizons: int) -> torch.Tensor:
    """x [N, L, E] -> [N, H, L, E]: the current weights pushed h = 1..H steps through the transition table."""
    v = x / x.sum(-1, keepdim=True).clamp_min(1e-9)
    tie = 1e-6 * freq
    out = []
    for _ in range(horizons):
        v = torch.einsum("ble,lef->blf", v, trans)
        out.append(v + tie)
    return torch.stack(out, dim=1)


def cross_layer_scores(x: torch.Tensor, cross: torch.Tensor, trans: torch.Tensor, freq: torch.Tensor, p: int,
                       horizons: int) -> torch.Tensor:
    """x [N, L, E] -> [N, H, L, E]: the trigger layer ``p``'s weights through the cross-layer table (horizon 1), then
    pushed h - 1 steps through the transition table."""
    v = x[:, p] / x[:, p].sum(-1, keepdim=True).clamp_min(1e-9)
    tie = 1e-6 * freq
    s = torch.einsum("be,lef->blf", v, cross)
    out = [s + tie]
    for _ in range(horizons - 1):
        s = torch.einsum("ble,lef->blf", s, trans)
        out.append(s + tie)
    return torch.stack(out, dim=1)


def cross_recent_scores(cross: torch.Tensor, recent: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """cross-x-recent: the cross-layer scores [..., H, L, E] times the recent-freq scores [..., L, E] (half-life 16,
    :func:`recent_scores`) over the fit set's frequency [L, E]."""
    return cross * (recent / freq.clamp_min(1e-6)).unsqueeze(-3)


def within_token_chain(v: np.ndarray, within: np.ndarray, first: int, last: int) -> np.ndarray:
    """What layer ``first - 1``'s routing v [E] (weights, any scale) tells of layers ``first .. last`` of the same
    token through the within-token table [L, E, E] (layer l - 1 to layer l), pushed layer by layer:
    float32 [last - first + 1, E], each row a distribution (numpy: a policy's re-plan runs it within a decode step)."""
    v = np.asarray(v, dtype=np.float32)
    u = v / max(float(v.sum()), 1e-9)
    out = np.empty((max(last - first + 1, 0), v.shape[-1]), np.float32)
    for i, layer in enumerate(range(first, last + 1)):
        u = u @ within[layer]
        out[i] = u
    return out


def within_token_posterior(prior: np.ndarray, told: np.ndarray, freq: np.ndarray, top_k: int) -> np.ndarray:
    """A forecast's inclusion probabilities ``prior`` [..., E] (each row sums to K:
    :func:`~expertcast.models.forecaster_inputs.activation_probs`'s ``1 - exp(-lambda w)``) refined by what the same
    token's earlier layer tells, ``told`` [..., E] (a distribution, :func:`within_token_chain`), a naive-Bayes
    product as cross-x-recent's: the prior's weights ``w = -log(1 - prior)`` times ``told / freq`` (``freq`` the fit
    set's frequency of the same layers), back to inclusion probabilities summing to K
    (:func:`~expertcast.models.forecaster_inputs.inclusion_probs`, numpy). ``told`` equal to ``freq`` returns the
    prior (up to rounding). float32 [..., E]."""
    w = -np.log1p(-np.clip(np.asarray(prior, np.float64), 0.0, 1.0 - 1e-7))
    logits = np.log(np.maximum(w, 1e-300)) + np.log(np.maximum(np.asarray(told, np.float64), 1e-300)) \
        - np.log(np.maximum(np.asarray(freq, np.float64), 1e-6))
    z = np.exp(logits - logits.max(-1, keepdims=True))  # the softmax activation_probs takes of its logits
    return inclusion_probs(z / z.sum(-1, keepdims=True), top_k)


def membership(x: torch.Tensor) -> torch.Tensor:
    """x [..., L, E] (an element's weights) -> [..., L, E]: 1/n for each of the n selected experts (weight > 0)."""
    m = (x > 0).to(x.dtype)
    return m / m.sum(-1, keepdim=True).clamp_min(1)


def recent_update(ema: torch.Tensor, x: torch.Tensor, decay: torch.Tensor, counts: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """One element into the moving averages, in place: ema [N, M, L, E], x [N, L, E], decay [M] -> ema.
    ``counts`` bool [M]: the averages of the element's membership (recent-count) instead of its weights (None:
    weights only)."""
    v = (x / x.sum(-1, keepdim=True).clamp_min(1e-9)).unsqueeze(1)
    if counts is not None:
        v = torch.where(counts.view(1, -1, 1, 1), membership(x).unsqueeze(1), v)
    d = decay.view(1, -1, 1, 1)
    return ema.mul_(d).add_(v * (1 - d))


def recent_scores(ema: torch.Tensor, freq: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """ema [N, M, L, E] -> recent-freq scores [N, M, L, E]."""
    return ema + (RECENT_PRIOR * (1 - decay)).view(1, -1, 1, 1) * freq


# ---------------------------------------------------------------------------------------------- the module
class ExactComponents(nn.Module):
    """The components of a forecaster: fitted tables ``freq`` / ``trans`` (and ``cross`` with ``cross_layer``,
    ``within`` with ``within_token``; buffers, in the export) and the recent-freq decays; the per-sequence moving averages live in
    ``ForecasterState.components``. ``p``: the trigger layer (the cross-layer table's source; None: L - 1)."""

    def __init__(self, num_layers: int, num_experts: int, half_lives: Sequence[float], cross_layer: bool = False,
                 p: int | None = None, cross_recent: bool = False, within_token: bool = False):
        super().__init__()
        self.L, self.E = num_layers, num_experts
        self.p = num_layers - 1 if p is None else int(p)
        self.half_lives = [float(h) for h in half_lives]
        if cross_recent:
            check_cross_recent(self.half_lives, cross_layer)
        self.names = component_names(self.half_lives, cross_layer, cross_recent)
        self.cross_index = self.names.index(CROSS_LAYER) if cross_layer else None
        """Index of the cross-layer component (None without it)."""
        self.cross_recent_index = self.names.index(CROSS_RECENT) if cross_recent else None
        """Index of the cross-x-recent component (None without it)."""
        self._recent16 = 3 + self.half_lives.index(CROSS_RECENT_HALF_LIFE) if cross_recent else None
        self.register_buffer("freq", torch.zeros(num_layers, num_experts))
        self.register_buffer("trans", torch.zeros(num_layers, num_experts, num_experts))
        # None without the component (a None buffer is not in the state dict: exports written without it match)
        self.register_buffer("cross", torch.zeros(num_layers, num_experts, num_experts) if cross_layer else None)
        # the within-token table (layer l - 1 to layer l of the same token) for a policy's re-plan; not a component
        self.register_buffer("within", torch.zeros(num_layers, num_experts, num_experts) if within_token else None)
        # the moving averages: recent-freq at each half-life, then recent-count at each (names 3 .. 3 + 2M - 1)
        d = torch.cat([decay_of(h) for h in self.half_lives] * 2) if self.half_lives else torch.zeros(0)
        self.register_buffer("decays", d, persistent=False)
        M = len(self.half_lives)
        self.register_buffer("counts", torch.arange(2 * M) >= M, persistent=False)

    @property
    def num_components(self) -> int:
        return len(self.names)

    @torch.no_grad()
    def fit(self, seqs: Sequence, p: int) -> None:
        """Fit ``freq``, ``trans`` (and ``cross``, ``within``) on ``seqs`` (forecaster elements of trigger layer
        ``p``; ``within`` on their tokens)."""
        if p != self.p:
            raise ValueError(f"components of trigger layer {self.p} cannot be fitted at trigger layer {p}")
        self.freq.copy_(fit_frequency(seqs, self.L, self.E))
        self.trans.copy_(fit_transition(seqs, self.L, self.E, p))
        if self.cross is not None:
            self.cross.copy_(fit_cross_layer(seqs, self.L, self.E, p))
        if self.within is not None:
            self.within.copy_(fit_within_token(seqs, self.L, self.E, [layer - 1 for layer in range(self.L)]))

    def init_state(self, batch_size: int, device: torch.device | str) -> torch.Tensor:
        """Zero moving averages [B, 2M, L, E] (recent-freq, then recent-count, at each half-life)."""
        return torch.zeros(batch_size, 2 * len(self.half_lives), self.L, self.E, device=device)

    @torch.no_grad()
    def scores(self, x: torch.Tensor, heads: int, used: Sequence[int], ema: torch.Tensor | None = None
               ) -> dict[int, torch.Tensor]:
        """Scores of the components ``used`` (indices into :attr:`names`): x [B, T, L, E] -> {c: [B, T, heads, L, E]}.

        ``ema`` [B, M, L, E] (the state's moving averages, advanced in place) or None (from zero). Elements go
        through the moving averages one at a time, in order, as the recent-freq baseline takes them."""
        B, T, L, E = x.shape
        x = x.float()
        out: dict[int, torch.Tensor] = {}
        M = 2 * len(self.half_lives)
        product = self.cross_recent_index is not None and self.cross_recent_index in used
        # the product's factors, computed once and dropped from the answer where not asked for
        asked = set(used)
        used = sorted(asked | ({self.cross_index, self._recent16} if product else set()))
        recent = [c for c in used if 3 <= c < 3 + M]
        if M and (ema is not None or recent):
            e = ema if ema is not None else x.new_zeros(B, M, L, E)
            hist = []
            for t in range(T):
                recent_update(e, x[:, t], self.decays, self.counts)
                if recent:
                    hist.append(recent_scores(e, self.freq, self.decays))
            if recent:
                s = torch.stack(hist, dim=1)  # [B, T, M, L, E]
                for c in recent:
                    out[c] = s[:, :, c - 3].unsqueeze(2).expand(B, T, heads, L, E)
        if 0 in used:
            out[0] = repeat_last_scores(x, self.freq).unsqueeze(2).expand(B, T, heads, L, E)
        if 1 in used:
            out[1] = self.freq.expand(B, T, heads, L, E)
        if 2 in used:
            out[2] = transition_scores(x.reshape(B * T, L, E), self.trans, self.freq, heads).view(B, T, heads, L, E)
        if self.cross_index is not None and self.cross_index in used:
            out[self.cross_index] = cross_layer_scores(x.reshape(B * T, L, E), self.cross, self.trans, self.freq,
                                                       self.p, heads).view(B, T, heads, L, E)
        if product:
            out[self.cross_recent_index] = cross_recent_scores(out[self.cross_index], out[self._recent16][:, :, 0],
                                                               self.freq)
        return {c: v for c, v in out.items() if c in asked}
