"""Deadline-aware prefetch scheduling (SeqMoE 6; docs/design.md "Forecaster", Prefetch).

Time is counted in *layer-executions*: execution ``x = step * L + layer`` starts at time ``x`` and
ends at ``x + 1``. A prefetch task for expert ``(layer, expert)`` has a confidence (the forecast
probability that the expert is selected, its expected hit contribution, SeqMoE 6.1) and a deadline
(the execution that needs it: it must land before that execution starts). Transfers are serialized
on one link and take ``tau`` layer-executions each, estimated online by an exponential moving
average (:class:`TransferEstimator`).

Selection (SeqMoE 6.2): unit-length jobs with deadlines form a scheduling matroid, so the greedy that
takes tasks by descending confidence and keeps a task only if the chosen set stays feasible under
Earliest-Deadline-First is optimal for the total confidence. Transfers are then started in EDF order;
tasks whose deadline passed expire, and when the link slows down (``tau`` grows) the retained set is
re-selected, which drops the lowest-confidence tasks that no longer fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from expertcast.inference.cache.expert_cache import SlotState

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.cache.expert_cache import ExpertCache


@dataclass
class PrefetchTask:
    """One candidate transfer."""

    layer: int
    expert: int
    confidence: float
    """Probability that the expert is selected at ``deadline`` (expected hit contribution)."""
    deadline: float
    """Layer-execution index that needs the expert (it must land before that execution starts)."""
    victim: int = -1
    """:func:`plan_within_headroom`: the index, in its pool's ``victims``, of the slot this load takes (-1 elsewhere)."""

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer, self.expert)


def generate_tasks(probs: np.ndarray, deadlines: np.ndarray, skip: np.ndarray | None = None, max_per_layer: int = 1,
                   min_confidence: float = 0.0, value: np.ndarray | None = None) -> list[PrefetchTask]:
    """Up to ``max_per_layer`` tasks per layer from first-step probabilities (SeqMoE 6.1).

    Args:
        probs: float [L, E] probability that (layer, expert) is selected at its next execution.
        deadlines: float [L] layer-execution index of each layer's next execution.
        skip: bool [L, E] experts that need no transfer (resident or already in flight).
        max_per_layer: tasks per layer (K in the paper).
        min_confidence: tasks below this probability are not generated.
        value: optional float [L, E] expected benefit of loading each expert (e.g. its discounted expected uses
            minus those of the resident it would displace, :func:`expected_benefit`). When given, a task's
            confidence is its value, tasks with value <= 0 are not generated, and the top ``max_per_layer`` of a
            layer are taken by value: the scheduler then keeps the EDF-feasible set of largest total benefit.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or deadlines.shape != (probs.shape[0],):
        raise ValueError(f"probs must be [L, E] and deadlines [L]; got {probs.shape} and {deadlines.shape}")
    p = probs.copy()
    if skip is not None:
        p[skip] = -1.0
    conf = p
    if value is not None:
        conf = np.where((p >= min_confidence) & (p > 0.0), np.asarray(value, dtype=np.float64), -1.0)
    tasks = []
    k = min(max_per_layer, p.shape[1])
    top = np.argsort(-conf, axis=1, kind="stable")[:, :k]
    for layer in range(p.shape[0]):
        for e in top[layer]:
            c = conf[layer, e]
            if p[layer, e] < 0 or p[layer, e] < min_confidence or c <= 0.0:
                continue
            tasks.append(PrefetchTask(layer, int(e), float(c), float(deadlines[layer])))
    return tasks


def expected_benefit(scores: np.ndarray, displaced: np.ndarray) -> np.ndarray:
    """Expected benefit [L, E] of loading each expert now: its discounted expected uses ``scores`` [L, E] minus
    ``displaced`` [L], the score of the resident a load into that layer's pool would evict (0 when the pool has a
    free slot). Positive only where the load is expected to gain more hits than the eviction loses; this replaces a
    fixed probability floor when forecasts are spread thin over many experts (docs/design.md, "Forecaster")."""
    return np.asarray(scores, dtype=np.float64) - np.asarray(displaced, dtype=np.float64)[:, None]


def displaced_scores(cache: ExpertCache, scores: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """float [L]: the score of the resident a load into each layer's pool would evict now (:func:`expected_benefit`'s
    ``displaced``): the lowest ``scores(layers, experts)`` of the pool's evictable residents when it is full, 0 with
    a free slot."""
    low: dict[int, float] = {}
    out = np.zeros(cache.num_layers)
    for layer in range(cache.num_layers):
        pool = cache.pool_of(layer)
        if pool not in low:
            cands = cache.eviction_candidates(pool)
            full = cache.free_count(pool) == 0 and len(cands)
            low[pool] = float(scores(cands[:, 0].astype(np.int64), cands[:, 1].astype(np.int64)).min()) \
                if full else 0.0
        out[layer] = low[pool]
    return out


def chance_level(num_experts: int, top_k: int) -> float:
    """Probability that an arbitrary expert is among a layer's top-K under uniform routing (K / E): a forecast at
    or below it carries no information about that expert."""
    return float(top_k) / float(num_experts)


def demand_probability(probs: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    """float [L]: P(a layer's next execution has at least one demand miss) = 1 - prod_e (1 - P(l, e)) over the
    experts holding no slot (``skip`` False), treating the experts as independent."""
    p = np.clip(np.asarray(probs, dtype=np.float64), 0.0, 1.0)
    if skip is not None:
        p = np.where(skip, 0.0, p)
    return 1.0 - np.prod(1.0 - p, axis=1)


class PoolRows(Sequence):
    """Per pool, its rows of one flat array: ``rows[pool]`` = ``flat[offsets[pool]:offsets[pool + 1]]`` (a view),
    so that :func:`pool_victims` builds every pool's list with a few array operations and a caller that visits a
    few pools slices only those."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat = flat
        off = offsets.tolist()
        self._rows = [flat[a:b] for a, b in zip(off[:-1], off[1:], strict=True)]  # the views, made once: the plan
        # reads a pool's row for each of its candidate rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, pool: int) -> np.ndarray:
        return self._rows[pool]


def pool_victims(cache: ExpertCache, value: np.ndarray, order: Callable[[np.ndarray, np.ndarray], np.ndarray]
                 ) -> tuple[PoolRows, PoolRows]:
    """:func:`plan_within_headroom`'s ``victims`` for ``cache``'s pools: per pool, the ``value`` [L, E] (P(needed at
    its next execution)) of the slot each successive load into it takes, free slots first (as zeros), then the
    evictable residents in ``order(layers, experts)`` (indices: the policy's eviction order); and, per pool, int
    [n, 2] the (layer, expert) each load evicts ((-1, -1) for a free slot). ``order`` is called once, over every
    pool's evictable slots (an order by per-expert keys ranks each pool's slots as a call per pool would)."""
    ok = np.flatnonzero(cache.state == SlotState.USED)  # every pool's evictable slots, ranked in one call
    cl, ce = cache.slot_layer[ok].astype(np.int64), cache.slot_expert[ok].astype(np.int64)
    idx = order(cl, ce) if len(ok) else np.zeros(0, np.int64)
    npools = len(cache.config.pool_capacities)
    pools = cache.slot_pool[ok][idx].astype(np.int64)
    by_pool = np.argsort(pools, kind="stable")  # grouped by pool, each in its own order
    idx, pools = idx[by_pool], pools[by_pool]
    free = np.array([cache.free_count(p) for p in range(npools)], np.int64)
    evictable = np.bincount(pools, minlength=npools)
    offsets = np.concatenate([[0], np.cumsum(free + evictable)])
    first = np.concatenate([[0], np.cumsum(evictable)])[:-1]  # each pool's first entry in the grouped order
    pos = offsets[pools] + free[pools] + (np.arange(len(pools)) - first[pools])  # after the pool's free slots
    val = np.zeros(int(offsets[-1]))
    keys = np.full((int(offsets[-1]), 2), -1, np.int64)
    val[pos] = value[cl[idx], ce[idx]]
    keys[pos, 0], keys[pos, 1] = cl[idx], ce[idx]
    return PoolRows(val, offsets), PoolRows(keys, offsets)


def execution_rows(first_probs: np.ndarray, first_exec: np.ndarray, skip: np.ndarray,
                   second_probs: np.ndarray | None = None, executions: int = 1
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The executions :func:`plan_within_headroom` plans, as its ``(probs, deadlines, skip)``: each layer's next one
    (``first_probs`` [L, E] at ``first_exec`` [L]); with ``executions`` 2 and ``second_probs`` also the one after
    (rows L..2L-1, at ``first_exec + L``), with P(needed there and not at the next one, whose load would serve
    both) = ``second_probs * (1 - first_probs)`` (docs/design.md, "Prefetch")."""
    if executions > 1 and second_probs is not None:
        return (np.concatenate([first_probs, second_probs * (1.0 - first_probs)]),
                np.concatenate([first_exec, first_exec + len(first_exec)]), np.concatenate([skip, skip]))
    return first_probs, first_exec, skip


def headroom_may_issue(probs: np.ndarray, skip: np.ndarray | None, net_scale: float | np.ndarray = 1.0,
                       min_net: float = 0.0) -> bool:
    """Whether :func:`plan_within_headroom` can issue any load for these ``probs`` [R, E], ``skip`` and ``net_scale``
    (its arguments): a load's ``net`` is at most ``net_scale * q`` (the victim's ``v`` is at least 0, the scale at
    least 0), and it is issued only where ``net`` is positive and at least ``min_net``. False means no load at any
    victims, so a caller may skip ranking its victims (exact: the same plan, empty)."""
    q = np.asarray(probs, dtype=np.float64)
    if skip is not None:
        q = np.where(skip, 0.0, q)
    if not q.size:
        return False
    best = np.broadcast_to(np.asarray(net_scale, dtype=np.float64), (q.shape[0],)) * q.max(axis=1)
    return bool(np.any((best > 0.0) & (best >= min_net)))


def plan_within_headroom(probs: np.ndarray, deadlines: np.ndarray, skip: np.ndarray | None, pool_of: np.ndarray,
                         victims: Sequence[np.ndarray], now: int, compute_ms: np.ndarray, transfer_ms: float,
                         backlog: int = 0, max_per_layer: int = 1, min_net: float = 0.0,
                         net_scale: float | np.ndarray = 1.0, num_layers: int | None = None) -> list[PrefetchTask]:
    """The proactive loads worth issuing now: expected hit gain against the link's headroom per layer
    (docs/design.md, "Prefetch").

    The link is idle during each layer-execution's compute (its demand loads run before it, in the stall), so
    layer-execution ``x`` offers ``compute_ms[x % L]`` of free link time; the ``backlog`` transfers already queued
    take the first of it. Candidates (the ``max_per_layer`` likeliest experts of each row holding no slot, none
    already planned for an earlier execution of its layer), in
    deadline order, then most likely first, are placed one after another on the link (one transfer takes
    ``transfer_ms``). A transfer's part inside the free windows costs nothing; a part that reaches the start of
    execution ``x`` delays that layer's demand loads (probability ``rho_x``, :func:`demand_probability`) by as much:
    cost ``rho_x * remainder``, the rest, ``(1 - rho_x) * remainder``, taking the start of ``x``'s window. A load
    is issued when it lands before its deadline's execution starts and its gain ``(q - v) * transfer_ms`` exceeds
    its cost: ``q`` = P(needed at its deadline) (a loaded expert is not evicted before that), ``v`` = P(the resident
    it displaces is needed at its own next execution) (0 with a free slot), a needed expert sparing one exposed
    demand transfer. With no free window left every load costs ``rho * transfer_ms >= gain`` on a layer that
    surely misses: none is issued on a saturated link.

    Args:
        probs: float [L, E] P(active) at each layer's next execution; or [R, E] rows of later executions too
            (``num_layers`` L: row r is an execution of layer r mod L, e.g. the next two of every layer).
        deadlines: int [L] (or [R]) layer-execution index of each row's execution (>= ``now``, distinct).
        skip: bool [L, E] experts holding a slot (resident or in flight); None: none.
        pool_of: int [L] the pool of each layer; victims: per pool, float [n] the ``v`` of the loads into it in
            eviction order (free slots first, as zeros); a pool runs out after n loads.
        now: the layer-execution that starts next (its compute window is the first).
        compute_ms: float [L] compute time of each layer; transfer_ms: one transfer's time.
        num_layers: L when ``probs`` has rows of later executions (None: its row count).
        backlog: transfers already queued or in flight (placed first, their delays sunk).
        min_net: a load is issued only where ``q - v`` (the expected demand misses it spares) is at least this. The
            AdjHit break-even: with ``min_net`` = the running (A - D) / (A + P), no load lowers AdjHit in expectation.
        net_scale: the factor on every ``q - v`` (:class:`SparedMissCalibration`'s realised/expected ratio), one for
            all rows or float [R] per row; the product is capped at 1, the one demand miss a load can spare.
    Returns:
        the tasks in issue (EDF) order; ``confidence`` = gain - cost in ms, ``victim`` = the index in its pool's
        ``victims`` of the slot it takes.
    """
    probs = np.asarray(probs, dtype=np.float64)
    R, E = probs.shape
    L = int(num_layers or R)
    scale = np.broadcast_to(np.asarray(net_scale, dtype=np.float64), (R,))
    deadlines = np.asarray(deadlines, dtype=np.int64)
    comp = np.asarray(compute_ms, dtype=np.float64)
    q = probs if skip is None else np.where(skip, -1.0, probs)
    rho_at = dict(zip(deadlines.tolist(), demand_probability(probs, skip).tolist(), strict=True))  # by execution
    k = min(max_per_layer, E)
    top = np.argsort(-q, axis=1, kind="stable")[:, :k]
    q_top = np.take_along_axis(q, top, axis=1)
    # a row none of whose candidates can pass (net <= scale x q, the victim's v >= 0) is passed over without its
    # victims: the same plan, fewer steps (most rows of a re-plan)
    bound = scale * q_top[:, 0] if R else np.zeros(0)
    live = ((bound > 0.0) & (bound >= min_net)).tolist()
    top_l, q_l, scale_l, dl = top.tolist(), q_top.tolist(), scale.tolist(), deadlines.tolist()
    pool_l = np.asarray(pool_of, dtype=np.int64).tolist()
    taken = [0] * len(victims)
    x, used = int(now), 0.0
    last = int(deadlines.max()) if R else int(now)

    def place(x: int, used: float, dur: float) -> tuple[int, float, float]:
        """Where a transfer of ``dur`` ms put on the link at (execution ``x``, ``used`` ms of its window) ends, and
        its expected delay of demand loads (past the last deadline nothing is planned: the walk stops there)."""
        cost = 0.0
        while dur > comp[x % L] - used + 1e-12 and x <= last:
            dur -= max(comp[x % L] - used, 0.0)
            x, used = x + 1, 0.0
            r = rho_at.get(x, 0.0)
            cost += r * dur
            dur *= 1.0 - r
        return x, used + dur, cost

    for _ in range(int(backlog)):
        x, used, _ = place(x, used, transfer_ms)
    out: list[PrefetchTask] = []
    planned: set[tuple[int, int]] = set()  # a load for a layer's next execution serves its later ones too
    probe = None  # place(x, used, transfer_ms): the next load's landing and cost, the same until a load is placed
    for row in np.argsort(deadlines, kind="stable").tolist():
        if not live[row]:
            continue
        d = dl[row]
        layer = row % L
        pool = pool_l[layer]
        vic = victims[pool]
        for e, qe in zip(top_l[row], q_l[row], strict=True):
            if (layer, e) in planned:
                continue
            if qe <= 0.0 or taken[pool] >= len(vic):
                break
            net = min(scale_l[row] * (qe - float(vic[taken[pool]])), 1.0)  # a load spares one miss at most
            gain = net * transfer_ms
            if gain <= 0.0 or net < min_net:
                break
            if probe is None:
                probe = place(x, used, transfer_ms)
            nx, nused, cost = probe
            if nx >= d or gain <= cost:  # the row's later candidates land there too, at no more gain
                break
            x, used, probe = nx, nused, None
            out.append(PrefetchTask(layer, e, gain - cost, float(d), victim=taken[pool]))
            planned.add((layer, e))
            taken[pool] += 1
    return out


class SparedMissCalibration:
    """Realised against expected demand misses spared by the proactive loads issued so far (docs/design.md,
    "Prefetch"): the factor that scales a forecast's ``q - v`` before the headroom rule weighs it.

    Each issued load is expected to spare ``q - v`` demand misses: +1 if its expert is needed (and was not demand
    missed) at the execution it was loaded for, -1 if the resident it displaced is demand missed at its own next
    execution. Both outcomes are resolved as those executions run (:meth:`resolve`), with nothing but routing
    already seen. ``scale`` = (realised + PRIOR) / (expected + PRIOR), floored at 0, with both sums discounted by
    ``half_life`` decode steps (:meth:`step`): a forecast that is over-confident on this routing (a domain shift)
    issues fewer loads, and once its evidence has decayed the prior lets a few loads test it again.
    """

    PRIOR = 4.0
    """Expected spared misses of pseudo-evidence at ratio 1 (about eight loads at q - v = 0.5)."""

    def __init__(self, half_life: float):
        self.enabled = half_life > 0
        self.decay = 0.5 ** (1.0 / half_life) if self.enabled else 1.0
        self.realised = 0.0
        self.expected = 0.0
        self.resolved = 0
        self._due: dict[int, list[tuple[int, float, float]]] = {}

    @property
    def scale(self) -> float:
        """The factor on ``q - v`` (1 without calibration or evidence)."""
        if not self.enabled:
            return 1.0
        return max(0.0, (self.realised + self.PRIOR) / (self.expected + self.PRIOR))

    def expect(self, load_exec: int, expert: int, net: float, victim: tuple[int, int] | None = None) -> None:
        """An issued load of ``expert`` for layer-execution ``load_exec`` with expected spared misses ``net``
        (``q - v``); ``victim``: (its next layer-execution, its expert), or None for a free slot."""
        if not self.enabled:
            return
        self._due.setdefault(int(load_exec), []).append((int(expert), 1.0, float(net)))
        if victim is not None:
            self._due.setdefault(int(victim[0]), []).append((int(victim[1]), -1.0, 0.0))

    def resolve(self, x: int, selected: np.ndarray, missed: Iterable[int]) -> None:
        """Layer-execution ``x`` ran ``selected`` experts, demand missing ``missed``: settle the outcomes due at
        ``x`` (and drop any left from earlier executions)."""
        if not self._due:
            return
        sel, miss = set(np.asarray(selected).tolist()), set(missed)
        for key in [k for k in self._due if k <= x]:
            for expert, sign, net in self._due.pop(key):
                if key < x:  # an execution that never reported (the sequence ended): no outcome
                    continue
                if sign > 0:
                    self.realised += float(expert in sel and expert not in miss)
                    self.expected += net
                    self.resolved += 1
                else:
                    self.realised -= float(expert in miss)

    def step(self) -> None:
        """One decode step passed: discount the evidence."""
        self.realised *= self.decay
        self.expected *= self.decay

    def clear_pending(self) -> None:
        """A new batch: outcomes of the previous one are never resolved (the evidence stays)."""
        self._due.clear()


def edf_feasible(deadlines: Sequence[float], now: float, tau: float, backlog: float = 0.0) -> bool:
    """Whether unit transfers of ``tau`` each, started after ``backlog`` transfers already queued, all land by their
    deadlines when served in EDF order starting at ``now``."""
    d = np.sort(np.asarray(deadlines, dtype=np.float64))
    finish = now + (backlog + np.arange(1, len(d) + 1)) * tau
    return bool((finish <= d + 1e-9).all())


def select_feasible(tasks: Iterable[PrefetchTask], now: float, tau: float, backlog: float = 0.0) -> list[PrefetchTask]:
    """Weighted matroid greedy: by descending confidence, keep a task when the kept set stays EDF-feasible.

    Returns the kept tasks in EDF order (deadline, then higher confidence first).
    """
    order = sorted(tasks, key=lambda t: (-t.confidence, t.deadline, t.layer, t.expert))
    kept: list[PrefetchTask] = []
    dl = np.empty(0)
    slack = np.empty(0)  # slack[i] = dl[i] - (now + (backlog + i + 1) * tau)
    for t in order:
        k = int(np.searchsorted(dl, t.deadline, side="right"))
        own = t.deadline - (now + (backlog + k + 1) * tau)
        if own < -1e-9 or (k < len(slack) and slack[k:].min() < tau - 1e-9):
            continue
        dl = np.insert(dl, k, t.deadline)
        slack = np.insert(slack, k, own)
        slack[k + 1:] -= tau
        kept.insert(k, t)
    return kept


class TransferEstimator:
    """EMA of the link's transfer time in layer-executions.

    The driver does not tell a policy when a transfer lands, but a policy sees its prefetches leave the
    Fetch state: :meth:`observe_window` takes, per layer-execution, how many landed while the link was
    busy the whole time (some of our transfers were still in flight at the end), and updates the rate.
    """

    def __init__(self, tau: float = 1.0, alpha: float = 0.2, max_tau: float = 1e6, min_tau: float = 0.0):
        if tau <= 0:
            raise ValueError(f"initial transfer time must be positive, got {tau}")
        if not 0 < alpha <= 1:
            raise ValueError(f"EMA alpha must be in (0, 1], got {alpha}")
        self.rate = 1.0 / tau
        self.alpha = alpha
        self.max_tau = max_tau
        self.min_tau = min_tau
        self.samples = 0

    @property
    def tau(self) -> float:
        """The estimate, within [``min_tau``, ``max_tau``]: a link's declared rate bounds what a window sample may
        claim (a transfer that finishes while a layer waits for its demand loads lands inside that layer's window
        without taking its compute time, so window samples read fast; on granite at the disk tier's ratio they read
        23% fast and the headroom walk queued 67 transfers where 2 fit:
        docs/results.md, "Re-planning within the token")."""
        return min(max(1.0 / max(self.rate, 1e-12), self.min_tau), self.max_tau)

    def observe_duration(self, duration: float) -> None:
        """A directly measured transfer time (runtime with timestamps), in layer-executions."""
        if duration > 0:
            self.rate = (1 - self.alpha) * self.rate + self.alpha / duration
            self.samples += 1

    def observe_window(self, landed: int, span: float = 1.0) -> None:
        """``landed`` transfers completed during ``span`` layer-executions of a saturated link."""
        self.rate = (1 - self.alpha) * self.rate + self.alpha * (landed / span)
        self.samples += 1


class PrefetchScheduler:
    """The retained task set, its EDF-feasible selection and the next transfers to start.

    Usage per forecast: :meth:`submit` new tasks (they supersede older tasks of the same expert); at each
    point where transfers may start: :meth:`expire` then :meth:`next_transfers`.
    """

    def __init__(self, estimator: TransferEstimator | None = None, lookahead: float = 2.0):
        self.estimator = estimator or TransferEstimator()
        self.lookahead = lookahead
        self.tasks: dict[tuple[int, int], PrefetchTask] = {}
        self.dropped = 0
        """Tasks removed because they could not be scheduled in time (expired or infeasible)."""

    def clear(self) -> None:
        self.tasks.clear()

    def submit(self, tasks: Iterable[PrefetchTask]) -> None:
        for t in tasks:
            self.tasks[t.key] = t

    def expire(self, now: float, done: Iterable[tuple[int, int]] = ()) -> None:
        """Drop tasks whose deadline is not after ``now`` and tasks of experts already resident/in flight."""
        for k in list(done):
            self.tasks.pop(k, None)
        for k, t in list(self.tasks.items()):
            if t.deadline <= now:
                del self.tasks[k]
                self.dropped += 1

    def select(self, now: float, backlog: float = 0.0) -> list[PrefetchTask]:
        """The feasible selection in EDF order; tasks that do not fit are dropped from the retained set."""
        kept = select_feasible(self.tasks.values(), now, self.estimator.tau, backlog)
        if len(kept) < len(self.tasks):
            keep = {t.key for t in kept}
            for k in [k for k in self.tasks if k not in keep]:
                del self.tasks[k]
                self.dropped += 1
        return kept

    def next_transfers(self, now: float, backlog: float = 0.0) -> list[PrefetchTask]:
        """Tasks to start now, in EDF order: enough to keep the link busy for ``lookahead`` layer-executions
        given ``backlog`` transfers already queued. They leave the retained set."""
        plan = self.select(now, backlog)
        tau = self.estimator.tau
        room = int(np.floor(self.lookahead / tau - backlog + 1e-9)) if tau > 0 else len(plan)
        out = plan[: max(room, 0)]
        for t in out:
            self.tasks.pop(t.key, None)
        return out
