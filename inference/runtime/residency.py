"""The runtime's transport for the driver: real host-to-device copies of expert rows into slots.

:class:`RuntimeTransport` is the :class:`~expertcast.inference.cache.driver.Transport` of
:class:`~expertcast.inference.runtime.engine.OffloadedModel`. Proactive loads are submitted to the
:class:`~expertcast.inference.runtime.transfer.TransferEngine` when the driver issues them and land
(Fetch -> Compute) at the first layer start that finds their copy finished; demand loads are submitted
at once and waited for right before the expert's kernel (so are late prefetches, promoted ahead of
the queued ones); temporary-slot loads are streamed by the compute itself. While ``physical`` is off
(the prompt's routing replayed through the policy after the prefill forward) nothing is copied and
every proactive load lands at the next layer start; :meth:`materialize` then copies the resulting
resident set.
"""

from __future__ import annotations

import time

from expertcast.inference.cache.driver import Transport
from expertcast.inference.cache.expert_cache import ExpertCache
from expertcast.inference.runtime.slots import SlotPool
from expertcast.inference.runtime.store import HostExpertStore
from expertcast.inference.runtime.transfer import Transfer, TransferEngine


class RuntimeTransport(Transport):
    """Copies into the slot pool through ``engine``; slot ``s`` of the cache is row ``s`` of ``pool``."""

    def __init__(self, store: HostExpertStore, pool: SlotPool, engine: TransferEngine):
        self.store = store
        self.pool = pool
        self.engine = engine
        self.physical = True
        """False: book-keeping only (no copies; proactive loads land at the next layer start)."""
        self._holds = [(-1, -1)] * (pool.num_slots + pool.num_temp)
        """(layer, expert) whose bytes each slot holds (or will hold once its copy lands)."""
        self._inflight: dict[int, Transfer] = {}
        """slot -> copy not waited for yet."""
        self._fetching: dict[int, tuple[int, int]] = {}
        """slot -> (layer, expert) of proactive loads not landed yet (the cache's Fetch slots)."""
        self.counters = None
        """The run's Counters: its ``read_*`` fields count the copies submitted while ``count_reads``."""
        self.count_reads = False
        """On during counted (decode) layer-executions: each copy submitted is one of the driver's counted loads."""

    # -- driver notifications ----------------------------------------------------------------------
    def begin_layer(self, x: int) -> list[tuple[int, int]]:
        landed = []
        for slot, key in list(self._fetching.items()):
            tr = self._inflight.get(slot)
            if tr is None or self.engine.done(tr):
                del self._fetching[slot]
                landed.append(key)
        return landed

    def prefetch(self, slot: int, layer: int, expert: int, t: int, deadline: int) -> None:
        self._fetching[slot] = (layer, expert)
        if self.physical:
            self.submit(slot, layer, expert, demand=False)

    def late(self, slot: int, layer: int, expert: int, t: int) -> None:
        self._fetching.pop(slot, None)  # waited for before the expert's kernel
        tr = self._inflight.get(slot)
        if tr is not None and self.physical and not self.engine.done(tr):
            self.engine.promote(tr)  # needed by this layer: ahead of the queued prefetches, now (not at its wait)

    def demand(self, slot: int, layer: int, expert: int, t: int) -> None:
        if slot >= 0 and self.physical:  # temporary slots are streamed by the compute
            self.submit(slot, layer, expert, demand=True)

    # -- copies ------------------------------------------------------------------------------------
    def submit(self, slot: int, layer: int, expert: int, demand: bool) -> Transfer:
        """Copy expert (layer, expert) into ``slot`` (a resident or a temporary slot)."""
        c = self.counters if self.count_reads else None
        self.engine.sink = c  # the engine adds the read's duration to c.read_seconds when it finishes
        tr = self.engine.submit((layer, expert), self.store.row(layer, expert), self.pool.read_target(slot), slot,
                                demand=demand)
        self.engine.sink = None
        if c is not None:
            c.reads += 1
            c.read_bytes += tr.nbytes
            if demand:
                c.read_demand += 1
            else:
                c.read_prefetch += 1
        self._holds[slot] = (layer, expert)
        self._inflight[slot] = tr
        return tr

    def wait_slot(self, slot: int) -> float:
        """Make the compute wait for the copy into ``slot`` (if any); returns the host seconds blocked."""
        tr = self._inflight.pop(slot, None)
        if tr is None:
            return 0.0
        if not self.engine.done(tr):
            self.engine.promote(tr)  # a late prefetch still queued goes ahead of the other prefetches
            if self.count_reads and self.counters is not None:
                self.counters.read_exposed += 1
        return self.engine.wait(tr)

    def landed_at(self, slot: int) -> float | None:
        """When the copy into ``slot`` landed (-inf: no copy pending, the bytes were there), or None while it
        is still in flight: the compute order of a layer (docs/design.md, "Compute order")."""
        tr = self._inflight.get(slot)
        if tr is None:
            return float("-inf")
        if not self.engine.done(tr):
            return None
        return tr.finished if tr.finished is not None else time.perf_counter()

    def wait_any(self, slots: list[int]) -> float:
        """Block until one of the copies into ``slots`` lands (nothing else the layer needs is there); counts
        one exposed read. Returns the host seconds blocked."""
        trs = [self._inflight[s] for s in slots if s in self._inflight]
        if not trs:
            return 0.0
        for tr in trs:
            if not self.engine.done(tr):
                self.engine.promote(tr)
        blocked = self.engine.wait_any(trs)
        if blocked > 0 and self.count_reads and self.counters is not None:
            self.counters.read_exposed += 1
        return blocked

    def holds(self, slot: int, layer: int, expert: int) -> bool:
        """``slot``'s bytes are those of (layer, expert) (or will be once its copy lands)."""
        return slot >= 0 and self._holds[slot] == (layer, expert)

    def materialize(self, cache: ExpertCache) -> None:
        """Copy into every slot the expert the cache assigns it (where the bytes differ); waits."""
        subs = []
        for s in range(cache.num_slots):
            want = (int(cache.slot_layer[s]), int(cache.slot_expert[s]))
            if want[0] < 0:
                continue
            if self._holds[s] != want or s in self._inflight:
                subs.append(self.submit(s, *want, demand=False))
        for tr in subs:
            self.engine.wait(tr)
        self._inflight.clear()
        self.engine.synchronize()

    def reset(self) -> None:
        """Wait for every copy and forget the pending ones (the cache is being emptied)."""
        self.engine.synchronize()
        self._inflight.clear()
        self._fetching.clear()

    def mark_compute(self) -> None:
        """A layer's kernels were issued (later slot overwrites are ordered after them)."""
        self.engine.mark_compute()

    def temp_slot(self) -> int:
        return self.pool.temp_slot()

    def set_holdings(self, holdings: list[tuple[int, int]]) -> None:
        """The (layer, expert) whose bytes each resident slot holds after copies made outside this transport
        (the graph decode path, :mod:`.graph_decode`)."""
        self._holds[:len(holdings)] = list(holdings)


__all__ = ["RuntimeTransport"]
