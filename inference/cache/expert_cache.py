"""The expert cache: a slot table shared by the simulator and the offloading runtime (docs/design.md, "Cache
semantics"; slot states of SeqMoE 7.2).

The cache holds no weights. It maps ``(layer, expert)`` to a slot index and tracks each slot's state;
the runtime keeps the weights of slot ``i`` at index ``i`` of its device buffer, the simulator keeps
nothing. Slots are grouped in pools: one pool per MoE layer (``pool="per-layer"``: B slots per layer,
as in SAEM and the cache-aware routers) or one pool for all layers (``pool="shared"``: SeqMoE). An
expert can only take a slot of its own layer's pool.

Capacity rule (checked when the config is resolved):
* per-layer pool: every layer's budget must hold one token's selection, ``B_l >= K``, and ``B_l <= E``
  (``allow_below_top_k`` relaxes this to ``B_l >= 1`` for policies that serve the excess elsewhere);
* shared pool: ``K <= slots <= L * E`` (the running layer's selection must fit; other layers' experts
  are evictable between layers).
When a batch's union at one layer is larger than the free and evictable slots of its pool, the excess
misses are served from a temporary slot (a transfer that is used once and not retained, counted as a
demand miss): no policy can keep more experts than the pool has slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
from expertcast.utils.errors import UsageError


class SlotState(IntEnum):
    """State of one cache slot (SeqMoE 7.2)."""

    EMPTY = 0
    """Free; allocation prefers these."""
    USED = 1
    """Holds a resident expert that may be evicted (unless it is in the running layer's selection)."""
    FETCH = 2
    """A transfer into the slot is in flight (or queued); never evicted."""
    COMPUTE = 3
    """The weights landed and are needed by a layer that has not run yet; never evicted."""


POOLS = ("per-layer", "shared")

# plain ints for the hot paths (IntEnum attribute access is slow)
EMPTY, USED, FETCH, COMPUTE = (int(s) for s in SlotState)


@dataclass(frozen=True)
class Budget:
    """How many experts a cache keeps resident, with its unit: a fraction of all experts
    (:meth:`fraction`), a slot count (:meth:`slots`: per layer, or in total for a shared pool), explicit
    per-layer slot counts (:meth:`per_layer`) or the bytes of expert weights it may hold (:meth:`bytes`, resolved
    with the cache's ``expert_bytes``, whatever the experts' format). Parsed once where a number or a flag enters (:meth:`parse`,
    ``commands.common.capacities_from_args``) and carried typed to the cache; :meth:`row`, :attr:`requested`,
    :attr:`tag` and :attr:`label` are how outputs and messages name it."""

    kind: str
    """``fraction``, ``slots``, ``per-layer`` or ``bytes``."""
    value: float | int | tuple[int, ...]

    KINDS = ("fraction", "slots", "per-layer", "bytes")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise UsageError(f"budget kind must be one of {self.KINDS}, got {self.kind!r}")

    @classmethod
    def fraction(cls, f: float) -> Budget:
        """``f`` of all L*E experts: ``round(f * E)`` slots per layer, or ``round(f * L * E)`` shared slots."""
        return cls("fraction", float(f))

    @classmethod
    def slots(cls, n: int) -> Budget:
        """``n`` slots per layer (per-layer pool) or in total (shared pool)."""
        return cls("slots", int(n))

    @classmethod
    def bytes(cls, n: int) -> Budget:
        """``n`` bytes of resident expert weights: ``n // expert_bytes`` slots in all, shared, or split evenly over
        the layers of a per-layer pool (each ``n // (L * expert_bytes)``)."""
        if int(n) < 1:
            raise UsageError(f"a byte budget is a positive number of bytes, got {n}")
        return cls("bytes", int(n))

    @classmethod
    def per_layer(cls, counts: Sequence[int]) -> Budget:
        """Explicit per-layer slot counts [L] (per-layer pool only)."""
        return cls("per-layer", tuple(int(v) for v in counts))

    @classmethod
    def parse(cls, value: Budget | float | int | Sequence[int]) -> Budget:
        """A :class:`Budget` from the number form of the library API: a float is a fraction, an int a slot
        count, a list per-layer counts (a Budget passes through)."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, (list, tuple, np.ndarray)):
            return cls.per_layer(value)
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return cls.slots(int(value))
        if isinstance(value, (float, np.floating)):
            return cls.fraction(float(value))
        raise UsageError(f"a cache budget is a fraction (float), a slot count (int) or per-layer counts, got {value!r}")

    @classmethod
    def gb(cls, g: float) -> Budget:
        """``g`` decimal gigabytes (1 GB = 1e9 bytes) of resident expert weights (``--budget-gb``): :meth:`bytes`."""
        if not 0 < float(g) < float("inf"):
            raise UsageError(f"--budget-gb is a positive number of gigabytes, got {g}")
        return cls.bytes(int(round(float(g) * 1e9)))

    ROW_KEYS = {"capacity": "fraction", "slots": "slots", "budget_gb": "bytes"}
    """The one-key form of a budget in output rows and resume keys (:meth:`row`) and the kind each key names."""

    def row(self) -> dict[str, float | int]:
        """The budget as outputs and resume keys record it: ``{"capacity": f}``, ``{"slots": n}`` or
        ``{"budget_gb": g}`` (:meth:`from_row` reads it back)."""
        if self.kind == "fraction":
            return {"capacity": self.value}  # type: ignore[dict-item]
        if self.kind == "slots":
            return {"slots": self.value}  # type: ignore[dict-item]
        if self.kind == "bytes":
            return {"budget_gb": self.value / 1e9}  # type: ignore[operator]
        raise UsageError("per-layer slot counts have no one-key row form")

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Budget:
        """The Budget of a :meth:`row` (an earlier output's ``{"capacity": f}``, ``{"slots": n}`` or
        ``{"budget_gb": g}``)."""
        if len(row) == 1 and next(iter(row)) in cls.ROW_KEYS:
            key, v = next(iter(row.items()))
            return cls.fraction(v) if key == "capacity" else cls.slots(v) if key == "slots" else cls.gb(v)
        raise UsageError(f"a capacity row is {{'capacity': fraction}}, {{'slots': count}} or {{'budget_gb': g}}, "
                         f"got {dict(row)!r}")

    @property
    def value_text(self) -> str:
        """The budget's number as the user gave it (``0.25``, ``8``, ``1.5`` GB): messages and progress lines."""
        return str(next(iter(self.row().values()))) if self.kind != "per-layer" else self.tag

    @property
    def flag(self) -> str:
        """The command-line flag that gives this budget: ``--capacity``, ``--slots`` or ``--budget-gb``."""
        return {"fraction": "--capacity", "slots": "--slots", "bytes": "--budget-gb"}.get(self.kind, "--slots")

    @property
    def requested(self) -> float | int | list[int]:
        """The budget as outputs record it (``capacity_requested``): the fraction, the count or the list."""
        return list(self.value) if self.kind == "per-layer" else self.value  # type: ignore[arg-type]

    @property
    def tag(self) -> str:
        """A short folder-safe name for output paths: ``c0.25``, ``s8``, ``p2-4-3`` or ``b1073741824``."""
        if self.kind == "fraction":
            return f"c{self.value:g}"
        if self.kind == "bytes":
            return f"b{self.value}"
        return f"s{self.value}" if self.kind == "slots" else "p" + "-".join(map(str, self.value))  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        """``capacity 0.25``, ``slots=8``, ``slots_per_layer`` or ``budget 1.5 GB``: how messages name it."""
        if self.kind == "fraction":
            return f"capacity {self.value:g}"
        if self.kind == "bytes":
            return f"budget {self.value / 1e9:.4g} GB"
        return f"slots={self.value}" if self.kind == "slots" else "slots_per_layer"


@dataclass
class CacheConfig:
    """Shape and capacity of an expert cache."""

    num_layers: int
    """L: MoE layers."""
    num_experts: int
    """E: routed experts per layer."""
    top_k: int
    """K: experts selected per token per layer (the capacity rule's lower bound)."""
    pool: str = "per-layer"
    """``per-layer`` (one pool of B_l slots per layer) or ``shared`` (one pool for all layers)."""
    budget: Budget | None = None
    """The resident experts (:class:`Budget`; required)."""
    expert_bytes: int = 0
    """Bytes of one expert's weights (for MB/token and the cost model)."""
    allow_below_top_k: bool = False
    """Per-layer pool only: accept budgets 1 <= B_l < K (SAEM's 3.125% expert-cache ratio). The part of a
    layer's selection that does not fit is served from the temporary slot or on the CPU, by whatever the
    policy asks; policies that demand-load then hold at most B_l of the selection."""

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise UsageError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if min(self.num_layers, self.num_experts, self.top_k) < 1:
            raise UsageError(f"L, E and K must be positive, got L={self.num_layers}, E={self.num_experts}, "
                             f"K={self.top_k}")
        if self.top_k > self.num_experts:
            raise UsageError(f"top-K {self.top_k} exceeds the number of experts {self.num_experts}")
        if not isinstance(self.budget, Budget):
            raise UsageError(f"give the cache budget as a Budget (fraction, slots or per-layer), got {self.budget!r}")
        self._budgets = self._resolve()

    def _resolve(self) -> np.ndarray:
        L, E, K = self.num_layers, self.num_experts, self.top_k
        b = self.budget
        assert b is not None
        what = b.label
        if b.kind == "fraction":
            c = float(b.value)  # type: ignore[arg-type]
            if not 0.0 < c <= 1.0:
                raise UsageError(f"capacity is a fraction of all experts in (0, 1], got {c}")
            n = int(round(c * (E if self.pool == "per-layer" else L * E)))
            what = f"{what} of {'E=' + str(E) if self.pool == 'per-layer' else 'L*E=' + str(L * E)}"
            budgets = np.full(L, n, np.int32) if self.pool == "per-layer" else np.array([n], np.int32)
        elif b.kind == "slots":
            n = int(b.value)  # type: ignore[arg-type]
            budgets = np.full(L, n, np.int32) if self.pool == "per-layer" else np.array([n], np.int32)
        elif b.kind == "bytes":
            if self.expert_bytes < 1:
                raise UsageError(f"{what}: a byte budget needs the size of one expert (expert_bytes)")
            total = int(b.value) // int(self.expert_bytes)  # type: ignore[arg-type]
            what = f"{what} of {self.expert_bytes}-byte experts"
            budgets = np.full(L, total // L, np.int32) if self.pool == "per-layer" else np.array([total], np.int32)
        else:
            if self.pool != "per-layer":
                raise UsageError("slots_per_layer needs pool='per-layer'")
            budgets = np.asarray(b.value, dtype=np.int32)
            if budgets.shape != (L,):
                raise UsageError(f"slots_per_layer must list {L} budgets (one per MoE layer), got {budgets.shape[0]}")
        if self.pool == "per-layer":
            low = int(budgets.min())
            if self.allow_below_top_k and low < 1:
                raise UsageError(f"{what} gives {low} slots per layer: even below top-K every layer needs a slot "
                                 f"(raise the capacity to at least 1/{E} = {1 / E:.4f})")
            if low < K and not self.allow_below_top_k:
                raise UsageError(
                    f"{what} gives {low} slots per layer, below top-K={K}: a layer's selection must fit in its "
                    f"pool (raise the capacity to at least {K}/{E} = {K / E:.4f}, or set allow_below_top_k for "
                    "policies that serve the excess on the CPU / from a temporary slot)")
            if int(budgets.max()) > E:
                raise UsageError(f"{what} gives {int(budgets.max())} slots per layer, more than E={E} experts")
        else:
            n = int(budgets[0])
            if n < K:
                raise UsageError(
                    f"{what} gives {n} shared slots, below top-K={K}: the running layer's selection must fit "
                    f"(raise the capacity to at least {K}/{L * E} = {K / (L * E):.5f})")
            if n > L * E:
                raise UsageError(f"{what} gives {n} shared slots, more than L*E={L * E} experts")
        return budgets

    @property
    def pool_capacities(self) -> np.ndarray:
        """int32 [P] slots of each pool (P = L per-layer, 1 shared)."""
        return self._budgets.copy()

    @property
    def pool_of_layer(self) -> np.ndarray:
        """int32 [L] pool index of each layer."""
        if self.pool == "per-layer":
            return np.arange(self.num_layers, dtype=np.int32)
        return np.zeros(self.num_layers, np.int32)

    @property
    def total_slots(self) -> int:
        return int(self._budgets.sum())

    @property
    def fraction(self) -> float:
        """Resident fraction of all L*E experts actually realized (after rounding)."""
        return self.total_slots / (self.num_layers * self.num_experts)

    @property
    def uniform_slots_per_layer(self) -> int | None:
        """B when every layer has the same budget (per-layer pool), else None."""
        if self.pool != "per-layer" or int(self._budgets.min()) != int(self._budgets.max()):
            return None
        return int(self._budgets[0])

    def describe(self) -> str:
        b = self.uniform_slots_per_layer
        if self.pool == "shared":
            return f"shared pool of {self.total_slots} slots ({self.fraction:.1%} of L*E)"
        if b is not None:
            return f"per-layer pools of {b} slots ({self.fraction:.1%} of L*E)"
        return f"per-layer pools of {self.total_slots} slots in all ({self.fraction:.1%} of L*E)"


class ExpertCache:
    """Slot table: ``(layer, expert) -> slot`` and a state per slot.

    Slots of pool ``p`` are the contiguous range ``pool_start[p] .. pool_start[p+1]-1``.
    Arrays: ``slot_of`` int32 [L, E] (-1 when absent), ``slot_layer`` / ``slot_expert`` int32 [N]
    (-1 when empty), ``state`` int8 [N] (:class:`SlotState`), ``ready_at`` float64 [N] (time a
    Fetch lands, for drivers that keep a clock), ``proactive`` bool [N] (filled by a prefetch and not
    accessed since).
    """

    def __init__(self, config: CacheConfig):
        self.config = config
        self.num_layers = config.num_layers
        self.num_experts = config.num_experts
        caps = config.pool_capacities
        self.pool_start = np.concatenate([[0], np.cumsum(caps)]).astype(np.int64)
        self._pool_of_layer = config.pool_of_layer
        self.num_slots = int(self.pool_start[-1])
        self.slot_pool = np.repeat(np.arange(len(caps)), caps).astype(np.int32)
        self._bounds = [(int(self.pool_start[p]), int(self.pool_start[p + 1])) for p in range(len(caps))]
        self.reset()

    def reset(self) -> None:
        """Empty every slot."""
        N = self.num_slots
        self.slot_of = np.full((self.num_layers, self.num_experts), -1, np.int32)
        self.slot_layer = np.full(N, -1, np.int32)
        self.slot_expert = np.full(N, -1, np.int32)
        self.state = np.zeros(N, np.int8)
        self.ready_at = np.zeros(N, np.float64)
        self.proactive = np.zeros(N, np.bool_)
        # free slots per pool, lowest index first
        self._free = [list(range(int(self.pool_start[p + 1]) - 1, int(self.pool_start[p]) - 1, -1))
                      for p in range(len(self.pool_start) - 1)]

    # -- queries ----------------------------------------------------------------------------------
    def pool_of(self, layer: int) -> int:
        return int(self._pool_of_layer[layer])

    def slot(self, layer: int, expert: int) -> int:
        """Slot index of ``(layer, expert)`` or -1."""
        return int(self.slot_of[layer, expert])

    def state_of(self, layer: int, expert: int) -> SlotState:
        s = self.slot_of[layer, expert]
        return SlotState.EMPTY if s < 0 else SlotState(int(self.state[s]))

    def is_resident(self, layer: int, expert: int) -> bool:
        """True when the expert's weights are on the device (state Used or Compute)."""
        s = self.slot_of[layer, expert]
        if s < 0:
            return False
        st = self.state[s]
        return st == USED or st == COMPUTE

    def contains(self, layer: int, expert: int) -> bool:
        """True when the expert holds a slot in any state (Fetch included)."""
        return bool(self.slot_of[layer, expert] >= 0)

    def resident_experts(self, layer: int) -> np.ndarray:
        """int [n] experts of ``layer`` holding a slot (any state), ascending."""
        return np.flatnonzero(self.slot_of[layer] >= 0)

    def occupied(self, pool: int | None = None) -> int:
        """Slots not Empty (in ``pool``, or in all pools)."""
        if pool is None:
            return int((self.state != EMPTY).sum())
        a, b = self.pool_start[pool], self.pool_start[pool + 1]
        return int((self.state[a:b] != EMPTY).sum())

    def free_count(self, pool: int) -> int:
        return len(self._free[pool])

    def capacity_of_pool(self, pool: int) -> int:
        return int(self.pool_start[pool + 1] - self.pool_start[pool])

    def eviction_candidates(self, pool: int, protect_layer: int = -1,
                            protect: np.ndarray | None = None) -> np.ndarray:
        """int [N, 2] (layer, expert) of the pool's Used slots that may be evicted: not Fetch/Compute and
        not in the selection ``protect`` of the running layer ``protect_layer``. Ordered by slot."""
        a, b = self._bounds[pool]
        ok = self.state[a:b] == USED
        if protect is not None and protect_layer >= 0 and len(protect):
            prot = self.slot_of[protect_layer][protect] - a
            ok[prot[(prot >= 0) & (prot < b - a)]] = False
        idx = ok.nonzero()[0] + a
        out = np.empty((len(idx), 2), np.int64)
        out[:, 0] = self.slot_layer[idx]
        out[:, 1] = self.slot_expert[idx]
        return out

    def slots_in_state(self, state: SlotState, layer: int | None = None) -> np.ndarray:
        """int [n] slot indices in ``state`` (holding experts of ``layer`` when given)."""
        m = self.state == state
        if layer is not None:
            m &= self.slot_layer == layer
        return np.flatnonzero(m)

    # -- updates ----------------------------------------------------------------------------------
    def take_free_slot(self, pool: int) -> int:
        """Pop an Empty slot of ``pool`` (lowest index first) or return -1."""
        free = self._free[pool]
        return free.pop() if free else -1

    def assign(self, slot: int, layer: int, expert: int, state: SlotState, proactive: bool = False) -> None:
        """Put ``(layer, expert)`` into ``slot`` (Empty, taken by :meth:`take_free_slot` or freed by
        :meth:`evict`) with ``state``."""
        if self.slot_of[layer, expert] >= 0:
            raise ValueError(f"expert ({layer}, {expert}) already holds slot {self.slot_of[layer, expert]}")
        if self.slot_layer[slot] >= 0:
            raise ValueError(f"slot {slot} still holds ({self.slot_layer[slot]}, {self.slot_expert[slot]})")
        if self.slot_pool[slot] != self._pool_of_layer[layer]:
            raise ValueError(f"slot {slot} belongs to pool {self.slot_pool[slot]}, not to layer {layer}'s pool")
        self.slot_of[layer, expert] = slot
        self.slot_layer[slot] = layer
        self.slot_expert[slot] = expert
        self.state[slot] = state
        self.proactive[slot] = proactive

    def evict(self, layer: int, expert: int) -> int:
        """Remove ``(layer, expert)``; return its slot, now Empty but *not* returned to the free list
        (the caller reuses it at once). Fetch/Compute slots cannot be evicted."""
        s = int(self.slot_of[layer, expert])
        if s < 0:
            raise KeyError(f"expert ({layer}, {expert}) is not in the cache")
        if self.state[s] in (FETCH, COMPUTE):
            raise ValueError(f"expert ({layer}, {expert}) is in state {SlotState(int(self.state[s])).name}: "
                             "in-flight or about-to-run experts are never evicted")
        self.slot_of[layer, expert] = -1
        self.slot_layer[s] = -1
        self.slot_expert[s] = -1
        self.state[s] = EMPTY
        self.proactive[s] = False
        return s

    def release(self, slot: int) -> None:
        """Return an Empty slot (freed by :meth:`evict` and not reused) to its pool's free list."""
        if self.slot_layer[slot] >= 0:
            raise ValueError(f"slot {slot} is not empty")
        self._free[int(self.slot_pool[slot])].append(slot)

    def set_state(self, slot: int, state: SlotState) -> None:
        self.state[slot] = state

    def resident_set(self) -> set[tuple[int, int]]:
        """{(layer, expert)} of every occupied slot (tests, debugging)."""
        idx = np.flatnonzero(self.slot_layer >= 0)
        return {(int(self.slot_layer[i]), int(self.slot_expert[i])) for i in idx}


def acquire_slot(cache: ExpertCache, policy, t: int, layer: int, pool: int,
                 protect: tuple[int, np.ndarray] | None = None) -> int:
    """A slot for a new expert of ``layer`` (the one step both the simulator and the runtime take for
    demand and proactive loads): an Empty slot of ``pool`` if there is one, else the slot of the
    resident the policy chooses among the evictable ones (``policy.on_evict`` is called). ``protect`` =
    (the running layer, its selection) keeps that selection (a demand load, or a load issued while the layer
    runs). Returns -1 when
    no slot can be freed (every slot holds a protected or in-flight expert)."""
    slot = cache.take_free_slot(pool)
    if slot >= 0:
        return slot
    cands = cache.eviction_candidates(pool) if protect is None else cache.eviction_candidates(pool, *protect)
    if len(cands) == 0:
        return -1
    v = int(policy.choose_victim(t, layer, cands, cache))
    if not 0 <= v < len(cands):
        raise ValueError(f"{policy.name}.choose_victim returned index {v} for {len(cands)} candidates")
    vl, ve = int(cands[v][0]), int(cands[v][1])
    slot = cache.evict(vl, ve)
    policy.on_evict(vl, ve)
    return slot
