"""History-based demand policies: LRU, FIFO, LFU, LRFU.

All four rank residents by a key and evict the smallest (see :mod:`expertcast.inference.policies.kernels` for
the shared rules, which the compiled kernels follow bit for bit). Time is one access clock that
advances once per accessed expert: within a layer-execution the hits are touched first, in selection
order, then the misses, in selection order (libcachesim's LRU sees the same order when fed each step's
resident experts first).

* LRU: evict the least recently accessed.
* FIFO: evict the earliest inserted; hits do not refresh.
* LFU: evict the smallest access count; ties go to the least recently accessed. A count is the number
  of layer-executions that selected the expert (not tokens). ``history="perfect"`` (default) keeps the
  counts of evicted experts (and counts accesses served from a temporary slot), ``"in-cache"`` restarts
  an expert's count at 1 when it is inserted again.
* LRFU (Lee et al., 2001): CRF = sum over past accesses of (1/2)^(lam * age), age in access-clock
  ticks; evict the smallest CRF, ties to the least recent. ``lam=0`` is LFU, ``lam=1`` is LRU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from expertcast.inference.cache.options import PolicyOptions, option
from expertcast.inference.cache.policy import Policy
from expertcast.inference.cache.spec import PolicySpec
from expertcast.inference.policies import kernels
from expertcast.inference.policies.device import EVICT_RECENCY, DeviceKeys, DeviceProgram, overrides_any

HISTORIES = ("perfect", "in-cache")


class KeyedPolicy(Policy):
    """Base of policies that evict the resident with the smallest (key1, key2).

    Subclasses implement :meth:`_touch` (update the keys of one accessed expert). Keys live in float64
    arrays indexed by ``layer * E + expert``.
    """

    demand_only = True
    kernel_kind: int | None = None
    perfect_history = True

    def reset(self, config) -> None:
        super().reset(config)
        n = config.num_layers * config.num_experts
        self.E = config.num_experts
        self.L = config.num_layers
        self.k1 = np.zeros(n)
        self.k2 = np.zeros(n)
        self.last = np.zeros(n)
        self.count = np.zeros(n)
        self.logc = np.zeros(n)
        self.hist = np.zeros(n, np.bool_)
        self.clock = 0.0
        self._inserted: set[int] = set()

    def kernel_params(self) -> dict | None:
        """Arguments of the compiled fast path, or None when this policy has none."""
        if self.kernel_kind is None:
            return None
        return {"kind": self.kernel_kind, "lam": 0.0, "horizon": -1, "perfect_history": self.perfect_history}

    def on_insert(self, layer: int, expert: int, proactive: bool) -> None:
        if not proactive:
            self._inserted.add(layer * self.E + expert)
        else:
            self._proactive_insert(layer * self.E + expert)

    def _proactive_insert(self, item: int) -> None:
        """A prefetch put ``item`` in the cache (prefetching subclasses): LRU and FIFO rank it as used
        just after the latest access; counting policies leave its history alone."""

    def on_evict(self, layer: int, expert: int) -> None:
        if not self.perfect_history:
            it = layer * self.E + expert
            self.count[it] = 0.0
            self.logc[it] = 0.0
            self.hist[it] = False

    def on_access(self, t, layer, selected, counts, cache) -> None:
        base = layer * self.E
        sel = [int(e) for e in selected]
        items = [base + e for e in sel]
        resident = [cache.is_resident(layer, e) for e in sel]
        hits = [(i, it) for i, it in enumerate(items) if resident[i] and it not in self._inserted]
        hit_set = {it for _, it in hits}
        rest = [(i, it) for i, it in enumerate(items) if it not in hit_set]
        for i, it in hits + rest:
            self.clock += 1.0
            self._touch(t, layer, i, it, resident[i], it in hit_set)
        self._inserted.clear()

    def _touch(self, t: int, layer: int, index: int, item: int, resident: bool, hit: bool) -> None:
        raise NotImplementedError

    def keys_of(self, t: int, layer: int, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Eviction keys (key1 [N], key2 [N]) of ``items`` (layer * E + expert) at step ``t``."""
        return self.k1[items], self.k2[items]

    def choose_victim(self, t, layer, candidates, cache) -> int:
        items = candidates[:, 0].astype(np.int64) * self.E + candidates[:, 1]
        k1, k2 = self.keys_of(t, layer, items)
        return int(np.lexsort((k2, k1))[0])


class LRUPolicy(KeyedPolicy):
    """Least recently used."""

    name = "lru"
    kernel_kind = kernels.KIND_LRU

    def _proactive_insert(self, item):
        self.k1[item] = self.clock
        self.k2[item] = 1.0

    def _touch(self, t, layer, index, item, resident, hit):
        if resident:
            self.k1[item] = self.clock
            self.k2[item] = 0.0

    def device_program(self) -> DeviceProgram | None:
        """LRU on the device engine (:mod:`~expertcast.inference.policies.device`): the access clock as the
        eviction key, demand only. None for a subclass that redefines a decision hook."""
        if overrides_any(self, LRUPolicy, _LRU_DEVICE_HOOKS):
            return None
        return DeviceProgram(EVICT_RECENCY, 0, read_keys=lambda: DeviceKeys(self.k1.copy(), float(self.clock)),
                             write_keys=self._set_device_keys)

    def _set_device_keys(self, keys: DeviceKeys) -> None:
        self.k1[:] = keys.recency
        self.k2[:] = 0.0
        self.clock = float(keys.clock)


_LRU_DEVICE_HOOKS = ("on_access", "_touch", "keys_of", "choose_victim", "on_insert", "_proactive_insert", "on_evict",
                     "on_miss", "before_layer", "after_layer")
"""The hooks :meth:`LRUPolicy.device_program` reproduces on the device."""


class FIFOPolicy(KeyedPolicy):
    """First in, first out: hits do not refresh."""

    name = "fifo"
    kernel_kind = kernels.KIND_FIFO

    def _proactive_insert(self, item):
        self.k1[item] = self.clock
        self.k2[item] = 1.0

    def _touch(self, t, layer, index, item, resident, hit):
        if resident and not hit:
            self.k1[item] = self.clock
            self.k2[item] = 0.0


class LFUPolicy(KeyedPolicy):
    """Least frequently used; ties to the least recently used."""

    @dataclass
    class Options(PolicyOptions):
        """Least frequently used."""

        history: str = option("perfect", "access counts kept for every expert (perfect) or only while resident "
                              "(in-cache)", choices=HISTORIES)

    name = "lfu"
    kernel_kind = kernels.KIND_LFU

    def __init__(self, options: Options | None = None):
        super().__init__(options)
        self.history = self.options.history
        self.perfect_history = self.history == "perfect"

    def _touch(self, t, layer, index, item, resident, hit):
        if not resident and not self.perfect_history:
            return
        self.count[item] += 1.0
        self.last[item] = self.clock
        if resident:
            self.k1[item] = self.count[item]
            self.k2[item] = self.clock


class LRFUPolicy(KeyedPolicy):
    """LRFU with decay ``lam`` in [0, 1]: 0 = LFU, 1 = LRU."""

    @dataclass
    class Options(PolicyOptions):
        """LRFU: combined recency and frequency with exponential decay."""

        lam: float = option(0.01, "decay per access in [0, 1]: 0 = LFU, 1 = LRU", low=0.0, high=1.0)
        history: str = option("perfect", "access history kept for every expert (perfect) or only while resident "
                              "(in-cache)", choices=HISTORIES)

    name = "lrfu"
    kernel_kind = kernels.KIND_LRFU

    def __init__(self, options: Options | None = None):
        super().__init__(options)
        self.lam = float(self.options.lam)
        self.history = self.options.history
        self.perfect_history = self.history == "perfect"

    def kernel_params(self):
        p = super().kernel_params()
        p["lam"] = self.lam
        return p

    def _touch(self, t, layer, index, item, resident, hit):
        if not resident and not self.perfect_history:
            return
        self.logc[item] = kernels.lrfu_log_crf(self.logc[item], self.last[item], self.clock, self.lam, bool(self.hist[item]))
        self.last[item] = self.clock
        self.hist[item] = True
        if resident:
            self.k1[item] = self.logc[item] + self.lam * self.clock
            self.k2[item] = self.clock


_KEYED = frozenset({"driver", "kernel"})
SPECS = (
    PolicySpec("lru", LRUPolicy, PolicyOptions, engines=_KEYED | {"device"}, help="least recently used"),
    PolicySpec("fifo", FIFOPolicy, PolicyOptions, engines=_KEYED, help="first in, first out"),
    PolicySpec("lfu", LFUPolicy, LFUPolicy.Options, engines=_KEYED, help="least frequently used"),
    PolicySpec("lrfu", LRFUPolicy, LRFUPolicy.Options, engines=_KEYED, help="recency and frequency with decay"),
)
