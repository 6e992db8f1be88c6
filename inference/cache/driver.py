"""The one driver of cache policies, shared by the simulator and the offloading runtime (docs/design.md,
"Driver").

It owns the lockstep batch schedule (:class:`~expertcast.inference.cache.schedule.BatchSchedule`), the hook order, the serving of a
layer's selection and the counters. What moves the bytes is a :class:`Transport`: the cost model's
modelled link (:class:`~expertcast.inference.cache.cost_model.ModelledTransport`, simulator), the runtime's
real transfer engine (:class:`~expertcast.inference.runtime.residency.RuntimeTransport`) or the
landings recorded from a runtime run (:class:`RecordedTransport`, parity checks).

Schedule. A batch of B members (sequences) runs in lockstep. Local step ``j < P`` (P = the longest
prompt) is a *prefill step*: member ``i`` processes prompt position ``j`` if ``j < prompt_len_i``.
Local step ``j >= P`` is *decode step* ``d = j - P``: member ``i`` processes position
``prompt_len_i + d`` while that position exists (``< length_i``; a live generation learns
``length_i`` when the member emits EOS). A member without a position at a step is idle. Steps are
numbered globally: ``t`` runs on across batches (and across calls of the runtime) until a reset.
Prefill steps are replayed through the policy like decode steps but are not counted.

Hook order (what :class:`Driver` calls; the numbers are the order within a layer-execution)::

    reset:       cache emptied, policy.reset(config), policy.set_future(future) (oracles),
                 policy.warm_start(cache) placed uncounted (state Used), t = -1
    batch:       policy.begin_batch(members)            # TraceSequence objects, or LivePrompt
    step t:      t += 1; policy.on_step(t, info)        # info: StepInfo (local step, positions)
      layer l (layer-execution x = t * L + l, l = 0 .. L-1):
        0. policy.observe_routing(t, l, ids [B, K], weights [B, K])   # when the caller has it
        1. land: transport.begin_layer(x) lists the proactive transfers that finished; their slots
           go Fetch -> Compute
        2. issue policy.before_layer(t, l, cache)       # proactive loads, see "issue" below
        3. the slots of layer l in Compute (landed prefetches) whose deadline is x or earlier become Used
           (a load for a later execution of l stays Compute, never evicted, until its deadline)
        4. serve the selection (the union of the active members' top-K in first-appearance order,
           with the tokens routed to each), expert by expert in that order:
           resident (Used/Compute) -> hit; Fetch -> late prefetch (transport.late, slot -> Compute);
           the proactive flag of the slot is cleared (its first use: prefetch_used += 1 when the load
           was issued on a counted step). Then the non-resident ones, in that order:
           action = policy.on_miss(t, l, e, n_tokens, cache):
             LOAD: acquire_slot (an Empty slot of the pool, else policy.choose_victim among the
                   evictable residents, the selection protected; policy.on_evict) -> slot Compute,
                   policy.on_insert(l, e, False), transport.demand(slot); no slot -> TEMP
             TEMP: transport.demand(-1) (a temporary slot, not retained)
             CPU:  transport.cpu (executed on the host copy)
           counted steps: hits, late, demand (LOAD and TEMP), temp, cpu, accesses
        4b. issue policy.after_routing(t, l, selected, counts, cache)   # behind the demand loads, the
           running selection protected from eviction
        5. the layer computes (transport.compute for the modelled link; real compute in the runtime)
        6. the selection's slots in Compute become Used (a prefetch used before its deadline: at its deadline)
        7. policy.on_access(t, l, selected, counts, cache)
        8. issue policy.after_layer(t, l, cache)
      end of step: policy.observe_tokens(t, tokens)     # one entry per member: the token fed to its
                                                        # next position, None when it has none;
                                                        # skipped when every entry is None

    issue(items): for each (layer, expert) or (layer, expert, deadline) in order: outside [0, L) x [0, E)
        -> error; already holding a slot -> skipped; acquire_slot without protection (step 4b's: the running
        layer's selection protected) (-1 -> counted as dropped); slot Fetch (proactive), policy.on_insert(layer, expert, True),
        transport.prefetch(slot, deadline) with deadline = the layer-execution the load is for: the
        layer's next execution (this step if it has not run yet, else the next step), or the item's when
        later (an execution of that layer, else an error); counted steps: proactive += 1. The slot is
        not evictable before its deadline's execution starts, whenever the transfer lands (step 3).

Counters are the per-layer int64 [L] arrays ``accesses, hits, late, demand, temp, cpu, proactive,
dropped, prefetch_used`` of a :class:`~expertcast.inference.cache.counters.Counters` (the runtime passes its stats), with its
tallies ``evictions`` [L] (a resident replaced by ``acquire_slot``, on the layer of the load) and ``step_demand`` /
``step_late`` (one entry per counted step, opened at :meth:`Driver.begin_step`), incremented on counted
steps only (decode steps; a caller may say otherwise per step, e.g. a stream whose ``step_counted``
was edited). Step 0 happens only for policies that override ``observe_routing``
(:attr:`Driver.wants_routing`), and only when the caller passes the per-member routing (the
simulator from the traces, the runtime from the model's router, weights rounded to float16 as traces
record them). With ``record_landings`` the driver keeps the ``(x, layer, expert)`` of every landing of
step 1; :class:`RecordedTransport` lands exactly those, so the simulator replaying a runtime run
reaches the same cache states whatever the real transfer times were.

Callers: the simulator (:func:`expertcast.inference.sim.simulator.replay`) runs ``begin_batch``, then per
step ``begin_step``, ``run_layer`` for each layer and ``end_step``; the runtime
(:class:`expertcast.inference.runtime.engine.OffloadedModel`) replays the prompt's steps the same way
without copies, then per decode forward calls ``begin_step``, per layer ``serve`` / its real compute /
``finish``, and ``end_step`` when the next forward shows the fed tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from expertcast.inference.cache.counters import Counters
from expertcast.inference.cache.expert_cache import (
    COMPUTE,
    FETCH,
    USED,
    CacheConfig,
    ExpertCache,
    acquire_slot,
)
from expertcast.inference.cache.policy import MissAction, Policy
from expertcast.inference.cache.schedule import BatchSchedule, StepInfo

SLOT, TEMP, CPU = "slot", "temp", "cpu"
"""Kinds of a served expert in a layer plan: ``(SLOT, s)``, ``(TEMP,)``, ``(CPU,)``."""


# ------------------------------------------------------------------------------------------------
# Transports
# ------------------------------------------------------------------------------------------------
class Transport:
    """Where the driver's transfers go. The base moves nothing and lands nothing; every method is a
    notification the subclass may act on. ``stall_ms``/``compute_ms`` (modelled times) and
    ``timeline`` stay 0/None when a transport keeps no clock."""

    stall_ms: float = 0.0
    compute_ms: float = 0.0
    timeline: list | None = None

    def begin_layer(self, x: int) -> Iterable[tuple[int, int]]:
        """Layer-execution ``x`` starts: the (layer, expert) of proactive transfers landed since."""
        return ()

    def prefetch(self, slot: int, layer: int, expert: int, t: int, deadline: int) -> None:
        """A proactive load into ``slot`` (state Fetch), needed by layer-execution ``deadline``."""

    def late(self, slot: int, layer: int, expert: int, t: int) -> None:
        """The running layer needs the expert whose proactive transfer into ``slot`` has not landed."""

    def demand(self, slot: int, layer: int, expert: int, t: int) -> None:
        """A demand load into ``slot`` (``-1``: a temporary slot, not retained)."""

    def cpu(self, layer: int, expert: int, n_tokens: int, t: int) -> None:
        """The expert runs on the host for ``n_tokens`` tokens."""

    def compute(self, t: int, layer: int, counted: bool) -> None:
        """The layer computes (modelled transports advance their clock)."""


class RecordedTransport(Transport):
    """Lands exactly the transfers a recorded run landed, at the same layer-executions: a replay of the
    runtime's run through the simulator then reaches the same cache states (no clock: stall 0).

    Args:
        landings: ``(x, layer, expert)`` as recorded by a :class:`Driver` with ``record_landings``.
    """

    def __init__(self, landings: Iterable[tuple[int, int, int]]):
        self._at: dict[int, list[tuple[int, int]]] = {}
        for x, layer, expert in landings:
            self._at.setdefault(int(x), []).append((int(layer), int(expert)))

    def begin_layer(self, x: int) -> Iterable[tuple[int, int]]:
        return self._at.get(x, ())


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------
class Driver:
    """Calls a policy's hooks over a cache in the order of the module docstring.

    Args:
        policy: the cache policy.
        cache: the slot table it manages.
        transport: what moves the bytes (see :class:`Transport`).
        counters: the :class:`~expertcast.inference.cache.counters.Counters` it increments (default: new ones).
        record_landings: keep ``(x, layer, expert)`` of every landing (see :class:`RecordedTransport`).
    """

    def __init__(self, policy: Policy, cache: ExpertCache, transport: Transport, counters: Counters | None = None,
                 record_landings: bool = False):
        self.policy = policy
        self.cache = cache
        self.transport = transport
        self.L = cache.num_layers
        self.E = cache.num_experts
        self.counters = counters if counters is not None else Counters(self.L)
        self.record_landings = record_landings
        self.landings: list[tuple[int, int, int]] = []
        self.wants_routing = type(policy).observe_routing is not Policy.observe_routing
        """The policy reads per-member routing (callers then pass it to :meth:`serve`)."""
        self.t = -1
        self.schedule: BatchSchedule | None = None
        self.info: StepInfo | None = None
        self.counted = False
        """The current step's accesses are counted (decode steps)."""
        self._pf_counted = np.zeros(cache.num_slots, np.bool_)
        """Per slot: its proactive load was issued on a counted step (its first use counts as ``prefetch_used``)."""
        self._due = np.full(cache.num_slots, -1, np.int64)
        """Per slot: the layer-execution its proactive load is for (-1: a demand load); it stays Compute until then."""

    # -- run / batch / step ------------------------------------------------------------------------
    @classmethod
    def check_run(cls, policy: Policy, config: CacheConfig, future: Any = None) -> None:
        """The once-per-run calls of :meth:`reset` on a scratch cache of ``config``: a policy made for another
        model or cache, or a warm start larger than its pools, fails here, before a caller builds anything else
        (the runtime: before the model is touched)."""
        cls(policy, ExpertCache(config), Transport()).reset(future)

    def set_future(self, future: Any) -> None:
        """Give an oracle policy the accesses still to come (a no-op for the others); :meth:`reset` gives them
        again."""
        self.policy.set_future(future)

    def reset(self, future: Any = None) -> None:
        """Empty the cache, reset the policy (and give an oracle ``future``), place its warm start."""
        cache, policy = self.cache, self.policy
        cache.reset()
        policy.reset(cache.config)
        policy.set_future(future)  # a no-op but for oracles (their spec needs "future")
        for layer, expert in policy.warm_start(cache):
            slot = cache.take_free_slot(cache.pool_of(int(layer)))
            if slot < 0:
                raise ValueError(f"{policy.name}: warm start places more experts than layer {layer}'s pool holds")
            cache.assign(slot, int(layer), int(expert), USED)
        self.t = -1
        self.schedule = self.info = None
        self.counted = False
        self._pf_counted[:] = False
        self._due[:] = -1
        self.landings = []

    def begin_batch(self, members: Sequence[Any], schedule: BatchSchedule) -> None:
        """A batch starts: ``members`` (TraceSequence / LivePrompt objects) scheduled by ``schedule``."""
        if len(members) != schedule.size:
            raise ValueError(f"{len(members)} members for a schedule of {schedule.size}")
        self.schedule = schedule
        self._local = -1
        self.policy.begin_batch(list(members))

    def begin_step(self, counted: bool | None = None) -> StepInfo:
        """The next step of the batch begins (``policy.on_step``). ``counted``: whether its accesses are
        counted (default: decode steps are, prefill steps are not)."""
        assert self.schedule is not None, "begin_batch first"
        self.t += 1
        self._local += 1
        self.info = StepInfo(self.t, self._local, self.schedule, self.schedule.positions(self._local))
        self.counted = not self.info.prefill if counted is None else bool(counted)
        if self.counted:
            self.counters.open_step()
        self.policy.on_step(self.t, self.info)
        return self.info

    def end_step(self, tokens: Sequence[int | None]) -> None:
        """The step ends; ``tokens`` [B]: the token fed to each member's next position (None: none)."""
        if any(v is not None for v in tokens):
            self.policy.observe_tokens(self.t, list(tokens))

    # -- one layer-execution -----------------------------------------------------------------------
    def serve(self, layer: int, sel: np.ndarray, cnt: np.ndarray,
              routing: tuple[np.ndarray, np.ndarray] | None = None) -> dict[int, tuple]:
        """Steps 0-4 of the hook order for ``layer`` of the current step: ``sel`` int [S] the selection,
        ``cnt`` int [S] tokens routed to each, ``routing`` optional per-member (ids [B, K], weights
        [B, K]). Returns the plan: expert -> ``(SLOT, s)`` | ``(TEMP,)`` | ``(CPU,)``."""
        t, cache, policy, tr, c = self.t, self.cache, self.policy, self.transport, self.counters
        counted = self.counted
        if routing is not None and self.wants_routing:
            policy.observe_routing(t, layer, *routing)
        x = t * self.L + layer
        self._land(x)
        self._issue(layer, policy.before_layer(t, layer, cache), after=False)
        for s in cache.slots_in_state(COMPUTE, layer):
            if self._due[s] <= x:
                cache.set_state(int(s), USED)
        plan: dict[int, tuple] = {}
        missing = []
        for e in sel.tolist():
            s = cache.slot(layer, e)
            if s < 0:
                missing.append(e)
                continue
            if cache.state[s] == FETCH:
                tr.late(s, layer, e, t)
                cache.set_state(s, COMPUTE)
                if counted:
                    c.late[layer] += 1
                    c.step_late[-1] += 1
            elif counted:
                c.hits[layer] += 1
            if cache.proactive[s] and self._pf_counted[s]:  # first use of a counted proactive load
                c.prefetch_used[layer] += 1
            cache.proactive[s] = False
            plan[e] = (SLOT, s)
        if missing:
            cnt_of = dict(zip(sel.tolist(), cnt.tolist(), strict=True))
            for e in missing:
                plan[e] = self._miss(layer, e, cnt_of[e], sel, counted)
        if counted:
            c.accesses[layer] += len(sel)
        self._issue(layer, policy.after_routing(t, layer, sel, cnt, cache), after=True, protect=sel)
        return plan

    def _miss(self, layer: int, e: int, n_tokens: int, sel: np.ndarray, counted: bool) -> tuple:
        t, cache, policy, c = self.t, self.cache, self.policy, self.counters
        action = MissAction(policy.on_miss(t, layer, e, n_tokens, cache))
        slot = -1
        if action == MissAction.LOAD:
            slot = self._acquire(layer, counted, protect=(layer, sel))
            if slot < 0:
                action = MissAction.TEMP  # every slot holds a selected or in-flight expert
        if action == MissAction.CPU:
            self.transport.cpu(layer, e, n_tokens, t)
            if counted:
                c.cpu[layer] += 1
            return (CPU,)
        if counted:
            c.demand[layer] += 1
            c.step_demand[-1] += 1
        if action == MissAction.LOAD:
            cache.assign(slot, layer, e, COMPUTE)
            self._due[slot] = -1
            policy.on_insert(layer, e, False)
            self.transport.demand(slot, layer, e, t)
            return (SLOT, slot)
        self.transport.demand(-1, layer, e, t)
        if counted:
            c.temp[layer] += 1
        return (TEMP,)

    def finish(self, layer: int, sel: np.ndarray, cnt: np.ndarray) -> None:
        """Steps 6-8 of the hook order, after ``layer`` computed."""
        cache, x = self.cache, self.t * self.L + layer
        for e in sel.tolist():
            s = cache.slot(layer, e)
            if s >= 0 and cache.state[s] == COMPUTE and self._due[s] <= x:
                cache.set_state(s, USED)
        self.policy.on_access(self.t, layer, sel, cnt, cache)
        self._issue(layer, self.policy.after_layer(self.t, layer, cache), after=True)

    def run_layer(self, layer: int, sel: np.ndarray, cnt: np.ndarray,
                  routing: tuple[np.ndarray, np.ndarray] | None = None) -> dict[int, tuple]:
        """A whole layer-execution: :meth:`serve`, ``transport.compute``, :meth:`finish`."""
        plan = self.serve(layer, sel, cnt, routing)
        self.transport.compute(self.t, layer, self.counted)
        self.finish(layer, sel, cnt)
        return plan

    # -- internals ---------------------------------------------------------------------------------
    def _acquire(self, layer: int, counted: bool, protect: tuple[int, np.ndarray] | None = None) -> int:
        """:func:`acquire_slot` for an expert of ``layer`` (``protect`` = (the running layer, its selection), kept
        from eviction); a resident evicted for it on a counted step is tallied on ``layer``."""
        pool = self.cache.pool_of(layer)
        full = self.cache.free_count(pool) == 0
        slot = acquire_slot(self.cache, self.policy, self.t, layer, pool, protect)
        if full and slot >= 0 and counted:
            self.counters.evictions[layer] += 1
        return slot

    def _land(self, x: int) -> None:
        cache = self.cache
        for layer, expert in self.transport.begin_layer(x):
            s = cache.slot(layer, expert)
            if s >= 0 and cache.state[s] == FETCH:
                cache.set_state(s, COMPUTE)
                if self.record_landings:
                    self.landings.append((x, layer, expert))

    def _issue(self, cur_layer: int, items: Iterable[tuple[int, ...]], after: bool,
               protect: np.ndarray | None = None) -> None:
        """Step 2, 4b or 8's loads (``protect``: the running layer's selection, kept from eviction)."""
        t, cache, policy, L, E = self.t, self.cache, self.policy, self.L, self.E
        counted = self.counted
        for item in items:
            pl, pe = int(item[0]), int(item[1])
            if not (0 <= pl < L and 0 <= pe < E):
                raise ValueError(f"{policy.name} asked to prefetch ({pl}, {pe}) outside L={L}, E={E}")
            later = pl > cur_layer or (pl == cur_layer and not after)
            nxt = (t if later else t + 1) * L + pl
            due = max(int(item[2]), nxt) if len(item) > 2 else nxt  # a deadline passed: the next execution
            if (due - pl) % L:
                raise ValueError(f"{policy.name} asked to prefetch ({pl}, {pe}) for layer-execution {due}, not an "
                                 f"execution of layer {pl}")
            if cache.contains(pl, pe):
                continue
            slot = self._acquire(pl, counted, protect=None if protect is None else (cur_layer, protect))
            if slot < 0:
                if counted:
                    self.counters.dropped[pl] += 1
                continue
            cache.assign(slot, pl, pe, FETCH, proactive=True)
            self._pf_counted[slot] = counted
            self._due[slot] = due
            policy.on_insert(pl, pe, True)
            self.transport.prefetch(slot, pl, pe, t, due)
            if counted:
                self.counters.proactive[pl] += 1
