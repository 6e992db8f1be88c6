"""The forecaster's recurrent state as explicit tensors (docs/design.md "Forecaster").

The project defines it: per Mamba-2 block the convolution window and the SSD state
(:class:`~expertcast.models.mamba2.Mamba2Backbone`), then the online statistics, the exact components' moving
averages and the per-sequence scores, all batch first, so rows can be selected, written, reset, saved and restored.
"""

from __future__ import annotations

import torch


class ForecasterState:
    """Recurrent state of the forecaster: per Mamba-2 block a conv window and an SSD state, plus the online
    statistics.

    Shapes (B = batch): ``conv`` per block [B, expand·d + 2·G·N, k] (the last k inputs of the block's causal
    convolution), ``ssm`` per block [B, H, head_dim, N] (the SSD state); ``online`` [B, M, L·E + 1] (the M moving averages
    of :class:`~expertcast.models.forecaster_online.OnlinePrior`, last column their mass) or None without online statistics; ``hedge`` (with
    ``online_hedge_rate`` > 0): the top-K of the sources' frequencies at the last H_d elements [B, H_d, M, L, K]
    (long, newest first), their discounted per-head scores [B, H_d, M+1] and the elements each row has seen [B, 1];
    then (with ``learned_gate_rate`` > 0) the top-K of the last H_d forecasts with and without the learned part
    [B, H_d, H_d, 2, L, K] (long, newest first), their discounted recall difference [B, H_d] and the elements
    seen [B, 1]. None when neither is on. ``components`` [B, M', L, E]: the moving averages of the exact recent-freq
    components (:class:`~expertcast.models.forecaster_components.ExactComponents`), or None without components.
    ``switch`` (with components and ``switch_half_life`` > 0): the top-K of the last H_d forecasts of the selected
    forecast and of every component [B, H_d, H_d, 1 + C, L, K] (long, newest first), their discounted recall
    [B, H_d·(1 + C)·L] and the elements seen [B, 1]; None otherwise.
    ``skip`` [B, 1, L·E]: the moving average the per-element branch reads (:class:`~expertcast.models.forecaster.ElementBranch`),
    or None without it. ``steps`` counts the elements consumed.

    :class:`~expertcast.models.mamba2.Mamba2Backbone` reads and advances ``conv`` / ``ssm``; the forecaster's other
    parts the rest. State tensors are updated in place; use :meth:`clone` / :meth:`copy_` to save and restore.
    """

    def __init__(self, conv: list[torch.Tensor], ssm: list[torch.Tensor], steps: int = 0,
                 online: torch.Tensor | None = None, hedge: list[torch.Tensor] | None = None,
                 components: torch.Tensor | None = None, switch: list[torch.Tensor] | None = None,
                 skip: torch.Tensor | None = None):
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
        self.skip = skip

    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor (batch first): conv, ssm, then the online statistics, hedge state, components'
        moving averages, switch state and the per-element branch's moving average when present."""
        return self.conv + self.ssm + ([self.online] if self.online is not None else []) + list(self.hedge or []) \
            + ([self.components] if self.components is not None else []) + list(self.switch or []) \
            + ([self.skip] if self.skip is not None else [])

    # --- save / restore ---
    @property
    def batch_size(self) -> int:
        return self.conv[0].shape[0]

    def _like(self, tensors: list[torch.Tensor]) -> ForecasterState:
        """A state of the same layout holding ``tensors`` (in :meth:`tensors` order)."""
        n = len(self.conv)
        rest = list(tensors[2 * n:])
        skip = rest.pop() if self.skip is not None else None
        switch = None
        if self.switch is not None:
            switch, rest = rest[len(rest) - len(self.switch):], rest[:len(rest) - len(self.switch)]
        comp = rest.pop() if self.components is not None else None
        online = rest[0] if self.online is not None else None
        hedge = rest[1:] if self.hedge is not None else None
        return ForecasterState(tensors[:n], tensors[n:2 * n], self.steps, online, hedge, comp, switch, skip)

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
