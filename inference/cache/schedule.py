"""The lockstep batch schedule the driver runs (docs/design.md, "Driver"): which member of a batch processes
which position at each step, and what a policy learns of it at every step (:class:`StepInfo`).

A batch of B members (sequences) runs in lockstep. Local step ``j < P`` (P = the longest prompt) is a *prefill
step*: member ``i`` processes prompt position ``j`` if ``j < prompt_len_i``. Local step ``j >= P`` is *decode step*
``d = j - P``: member ``i`` processes position ``prompt_len_i + d`` while that position exists (``< length_i``; a
live generation learns ``length_i`` when the member emits EOS). A member without a position at a step is idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

OPEN = np.int64(1) << np.int64(40)
"""Length of a member whose end is not known yet (live generation before EOS)."""


class BatchSchedule:
    """Which member of a batch processes which position at each local step (see the module docstring).

    Args:
        prompt_lens: int [B] prompt length of each member.
        lengths: int [B] positions of each member (prompt + decoded), or None when unknown (live
            generation: :meth:`end_member` records each end).
    """

    def __init__(self, prompt_lens: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray | None = None):
        self.prompt_lens = np.asarray(prompt_lens, dtype=np.int64).reshape(-1)
        if lengths is None:
            self.lengths = np.full(len(self.prompt_lens), OPEN, np.int64)
        else:
            self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1).copy()
        if self.lengths.shape != self.prompt_lens.shape:
            raise ValueError(f"{len(self.lengths)} lengths for {len(self.prompt_lens)} prompts")
        if (self.prompt_lens < 0).any() or (self.lengths < self.prompt_lens).any():
            raise ValueError("every member needs 0 <= prompt_len <= length")

    @property
    def size(self) -> int:
        """B: members of the batch."""
        return len(self.prompt_lens)

    @property
    def prefill_steps(self) -> int:
        """P: the longest prompt."""
        return int(self.prompt_lens.max()) if self.size else 0

    @property
    def num_steps(self) -> int:
        """Local steps of the batch (needs every length)."""
        if (self.lengths >= OPEN).any():
            raise ValueError("the schedule of a live batch has no known length yet")
        return self.prefill_steps + (int((self.lengths - self.prompt_lens).max()) if self.size else 0)

    def _positions(self, js: np.ndarray) -> np.ndarray:
        """int64 [len(js), B]: position of every member at local steps ``js`` (-1 = idle)."""
        j = np.asarray(js, dtype=np.int64)[:, None]
        P = self.prefill_steps
        pre = np.where(j < self.prompt_lens[None, :], j, -1)
        dec = self.prompt_lens[None, :] + j - P
        dec = np.where(dec < self.lengths[None, :], dec, -1)
        return np.where(j < P, pre, dec)

    def positions(self, j: int) -> np.ndarray:
        """int64 [B]: position processed by each member at local step ``j`` (-1 = idle)."""
        return self._positions(np.array([j]))[0]

    def all_positions(self) -> np.ndarray:
        """int64 [num_steps, B]: :meth:`positions` of every local step."""
        return self._positions(np.arange(self.num_steps))

    def has_next(self, j: int) -> np.ndarray:
        """bool [B]: members active at local step ``j`` whose next position exists (its input token is
        the one the member produced at ``j``)."""
        pos = self.positions(j)
        return (pos >= 0) & (pos + 1 < self.lengths)

    def span(self, i: int, j0: int, j1: int) -> tuple[int, int]:
        """Positions ``a .. b-1`` processed by member ``i`` during local steps ``j0 .. j1-1`` (a contiguous
        range; ``a == b`` when none)."""
        pos = self._positions(np.arange(j0, max(j0, j1)))[:, i] if j1 > j0 else np.zeros(0, np.int64)
        pos = pos[pos >= 0]
        return (int(pos.min()), int(pos.max()) + 1) if len(pos) else (0, 0)

    def end_member(self, i: int, length: int) -> None:
        """Live generation: member ``i`` ended after ``length`` positions (it emitted EOS)."""
        if length < self.prompt_lens[i]:
            raise ValueError(f"member {i} cannot end at {length} positions inside its prompt")
        self.lengths[i] = length


def stream_schedule(prompt_lens: np.ndarray, lengths: np.ndarray, batches: Sequence[Sequence[int]]
                    ) -> tuple[list[BatchSchedule], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The schedule of a run of batches as arrays (what the compiled stream builder consumes).

    Args:
        prompt_lens, lengths: int [N] per sequence; batches: sequence indices of each batch, in order.
    Returns:
        (schedules, step_batch int32 [S], step_counted bool [S], step_seq int64 [S, Bmax] (sequence
        index of each member slot, -1 idle), step_pos int64 [S, Bmax] (its position, -1 idle)).
    """
    scheds = [BatchSchedule(prompt_lens[list(b)], lengths[list(b)]) for b in batches]
    n_steps = sum(s.num_steps for s in scheds)
    bmax = max((len(b) for b in batches), default=1)
    step_batch = np.zeros(n_steps, np.int32)
    step_counted = np.zeros(n_steps, np.bool_)
    step_seq = np.full((n_steps, bmax), -1, np.int64)
    step_pos = np.full((n_steps, bmax), -1, np.int64)
    s0 = 0
    for b, (members, sch) in enumerate(zip(batches, scheds, strict=True)):
        pos = sch.all_positions()
        n = len(pos)
        step_batch[s0:s0 + n] = b
        step_counted[s0:s0 + n] = np.arange(n) >= sch.prefill_steps
        step_pos[s0:s0 + n, :len(members)] = pos
        step_seq[s0:s0 + n, :len(members)] = np.where(pos >= 0, np.asarray(members, np.int64)[None, :], -1)
        s0 += n
    return scheds, step_batch, step_counted, step_seq, step_pos


@dataclass(frozen=True)
class StepInfo:
    """What a policy learns at :meth:`Policy.on_step`: where every member of the batch is."""

    t: int
    """Global step."""
    local: int
    """Step within the batch (prefill steps first)."""
    schedule: BatchSchedule
    positions: np.ndarray
    """int64 [B]: position processed by each member (-1 = idle)."""

    @property
    def prefill(self) -> bool:
        return self.local < self.schedule.prefill_steps

    @property
    def active(self) -> np.ndarray:
        """int [n] members processing a position now."""
        return np.flatnonzero(self.positions >= 0)
