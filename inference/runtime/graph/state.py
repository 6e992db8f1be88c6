"""The device state of the graph decode path (docs/design.md, "Graph-compatible decode path").

Flat keys ``k = layer * E + expert`` with one sink entry at the end that masked writes go to:

* ``table`` int64 [L*E + 1]: slot of each key, or -1;
* ``slot_key`` int64 [N + 1]: key held by each slot of the shared slot pool, or -1 (empty);
* ``pool_slots`` int64 [pools, S]: the slots of each pool (ascending, padded with N), ``layer_pool`` [L] the
  pool of each layer, ``slot_pool`` [N] the pool of each slot;
* ``recency`` float64 [L*E + 1]: the access clock (recency rule) / last layer-execution (forecast rule) of each
  key, ``clock`` [1] the access clock, ``step`` [1] the decode step;
* forecast rule only: ``before`` / ``after`` float32 [L*E + 1] (the policy's CacheScore before and after the
  key's next execution), ``first_exec`` int64 [L], ``plan`` int64 [L, P] (proactive loads, -1 padded);
* ``counters`` int64 [len(COUNTER_NAMES), L]: the driver's counters (:class:`~expertcast.inference.cache.driver.
  Counters`), one row per name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from expertcast.inference.cache.counters import COUNTER_NAMES, Counters

ACC, HIT, DEM, TMP, PRO, DROP = (COUNTER_NAMES.index(n) for n in
                                 ("accesses", "hits", "demand", "temp", "proactive", "dropped"))
"""Rows of :attr:`DeviceResidency.counters` the device step writes (``late`` and ``cpu`` stay 0: no late
prefetches, no CPU execution on the device path)."""


@dataclass
class DeviceResidency:
    """The residency table and the policy's keys on the device (shapes in the module docstring)."""

    table: torch.Tensor
    slot_key: torch.Tensor
    slot_pool: torch.Tensor
    layer_pool: torch.Tensor
    pool_slots: torch.Tensor
    recency: torch.Tensor
    clock: torch.Tensor
    step: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor
    first_exec: torch.Tensor
    plan: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def empty(cls, L: int, E: int, num_slots: int, slot_pool: np.ndarray, layer_pool: np.ndarray, plan_width: int,
              device: torch.device) -> DeviceResidency:
        LE, N = L * E, num_slots
        z = dict(device=device)
        return cls(table=torch.full((LE + 1,), -1, dtype=torch.long, **z),
                   slot_key=torch.full((N + 1,), -1, dtype=torch.long, **z),
                   slot_pool=torch.as_tensor(slot_pool, dtype=torch.long, device=device),
                   layer_pool=torch.as_tensor(layer_pool, dtype=torch.long, device=device),
                   pool_slots=torch.as_tensor(pool_slots(slot_pool, N), device=device),
                   recency=torch.zeros(LE + 1, dtype=torch.float64, **z),
                   clock=torch.zeros(1, dtype=torch.float64, **z), step=torch.zeros(1, dtype=torch.long, **z),
                   before=torch.zeros(LE + 1, **z), after=torch.zeros(LE + 1, **z),
                   first_exec=torch.full((L,), -1, dtype=torch.long, **z),
                   plan=torch.full((L, max(plan_width, 1)), -1, dtype=torch.long, **z),
                   counters=torch.zeros((len(COUNTER_NAMES), L), dtype=torch.long, **z))

    def take_counters(self) -> Counters:
        """The counters the device step accumulated, as the driver's :class:`Counters` (then zeroed)."""
        cnt = self.counters.cpu().numpy()
        out = Counters(cnt.shape[1])
        for i, name in enumerate(COUNTER_NAMES):
            getattr(out, name)[:] = cnt[i]
        self.counters.zero_()
        return out


def pool_slots(slot_pool: np.ndarray, N: int) -> np.ndarray:
    """int64 [pools, S]: the slots of each pool id (``slot_pool`` [N]: pool of each slot), ascending, padded with
    N; S is the largest pool."""
    slot_pool = np.asarray(slot_pool, np.int64)
    pools = int(slot_pool.max()) + 1 if slot_pool.size else 1
    members = [np.flatnonzero(slot_pool == p) for p in range(pools)]
    out = np.full((pools, max(1, *(len(m) for m in members))), N, np.int64)
    for p, m in enumerate(members):
        out[p, :len(m)] = m
    return out


def first_in_order(k1: torch.Tensor, k2: torch.Tensor | None, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``m`` slots in eviction order: ascending ``k1`` [N], ties by ``k2`` [N] (when given), then by the
    lowest slot: the order of a stable sort by k2 then by k1, found as ``m`` successive argmins (argmin returns
    the first of equal values), O(m*N) elementwise work that compiles into fused loops instead of a sort of N.
    Returns (slots int64 [m], valid bool [m]: the slot's k1 is finite, i.e. it may be evicted)."""
    taken = torch.zeros_like(k1, dtype=torch.bool)
    slots, valid = [], []
    for _ in range(m):
        k = torch.where(taken, torch.inf, k1)
        lo = k.min()
        s = k.argmin() if k2 is None else torch.where(k == lo, k2, torch.inf).argmin()
        valid.append(lo < torch.inf)
        slots.append(s)
        taken = taken.index_fill(0, s.view(1), True)
    return torch.stack(slots), torch.stack(valid)
