"""Forecast tables: every forecast of a recorded sequence computed up front (docs/design.md, "Forecaster").

When the batch's sequences are known in advance (simulator replay), the ``seqmoe`` policy computes each
sequence's forecasts at every position once (sequential steps, rollouts batched over positions) and reuses them
across capacities; the results equal the online path's. :func:`combine_members` merges the per-member forecasts
of a batch: P = 1 - prod_b (1 - P_b).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from expertcast.models.forecaster import (
    ExpertForecaster,
    ForecasterState,
    activation_vector,
    trigger_sequence,
)


@torch.no_grad()
def precompute_forecasts(model: ExpertForecaster, expert_ids: np.ndarray, expert_weights: np.ndarray, horizon: int,
                         chunk: int = 256) -> np.ndarray:
    """Activation probabilities of every forecast of one sequence.

    Args:
        expert_ids / expert_weights: [T, L, K] routing of the sequence.
    Returns:
        float32 [T', H, L, E]: entry [i, j] is P(active) of element i+1+j forecast after element i
        (T' = number of elements, see :func:`~expertcast.models.forecaster.trigger_sequence`).
    """
    c = model.config
    dev = model.head.weight.device
    ids = torch.from_numpy(np.asarray(expert_ids, dtype=np.int64))
    w = torch.from_numpy(np.asarray(expert_weights, dtype=np.float32))
    el = trigger_sequence(activation_vector(ids, w, c.num_experts), c.p).to(dev)  # [T', L, E]
    n = el.shape[0]
    out = np.zeros((n, horizon, c.num_layers, c.num_experts), np.float32)
    state = model.init_state(1)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        states, logits = [], []
        for i in range(a, b):
            lg, _ = model.step(el[i:i + 1], state, all_horizons=True)
            states.append(state.clone())
            logits.append(lg)
        batch_state = ForecasterState.cat(states)
        roll = model.rollout(torch.cat(logits), batch_state, horizon)  # [b-a, H, L, E]
        out[a:b] = model.probs(roll).cpu().numpy()
    return out


@torch.no_grad()
def precompute_forecasts_many(model: ExpertForecaster, routing: Sequence[tuple[np.ndarray, np.ndarray]], horizon: int,
                              chunk_rows: int = 1024) -> list[np.ndarray]:
    """:func:`precompute_forecasts` for many sequences at once: one batched recurrent step per element index
    (all sequences together, shorter ones padded and their padded outputs discarded) and rollouts batched over
    (sequence, element) rows, ``chunk_rows`` at a time. The Python/launch overhead of a step is then paid once
    per element index instead of once per element of every sequence (the replay's profile was dominated by it).

    Args:
        routing: per sequence (expert_ids [T, L, K], expert_weights [T, L, K]).
    Returns:
        per sequence float32 [T', H, L, E], as :func:`precompute_forecasts` (equal up to float rounding of
        batched matrix products).
    """
    c = model.config
    dev = model.head.weight.device
    if not routing:
        return []
    els = []
    for ids, w in routing:
        ids_t = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        w_t = torch.from_numpy(np.asarray(w, dtype=np.float32))
        els.append(trigger_sequence(activation_vector(ids_t, w_t, c.num_experts), c.p))
    if c.direct_horizons >= horizon:
        return _precompute_direct(model, els, horizon)
    lengths = np.array([len(e) for e in els])
    B, n_max = len(els), int(lengths.max())
    x = torch.zeros(B, n_max, c.num_layers, c.num_experts)
    for b, e in enumerate(els):
        x[b, : len(e)] = e
    x = x.to(dev)
    outs = [np.zeros((int(n), horizon, c.num_layers, c.num_experts), np.float32) for n in lengths]
    state = model.init_state(B, dev)
    per_chunk = max(1, chunk_rows // B)
    for a in range(0, n_max, per_chunk):
        b_end = min(n_max, a + per_chunk)
        states, logits, rows = [], [], []
        for i in range(a, b_end):
            lg, _ = model.step(x[:, i], state, all_horizons=True)
            live = np.flatnonzero(lengths > i)
            states.append(state.select(live.tolist()))
            logits.append(lg[torch.from_numpy(live).to(dev)])
            rows.extend((int(s), i) for s in live)
        roll = model.rollout(torch.cat(logits), ForecasterState.cat(states), horizon)  # [rows, H, L, E]
        probs = model.probs(roll).cpu().numpy()
        for r, (s, i) in enumerate(rows):
            outs[s][i] = probs[r]
    return outs


@torch.no_grad()
def _precompute_direct(model: ExpertForecaster, els: list[torch.Tensor], horizon: int,
                       max_rows: int = 16384) -> list[np.ndarray]:
    """:func:`precompute_forecasts_many` when the direct heads cover ``horizon``: no rollout, so every forecast of
    a sequence comes from one parallel (chunked-scan) forward pass over its elements ``els`` ([T', L, E] each),
    equal to the recurrent steps up to float rounding. Sequences are batched up to ``max_rows`` padded elements
    (causal: padding at the end never changes earlier outputs)."""
    c = model.config
    dev = model.head.weight.device
    outs: list[np.ndarray] = [np.zeros((0,))] * len(els)
    order = sorted(range(len(els)), key=lambda i: len(els[i]))
    a = 0
    while a < len(order):
        b = a + 1
        while b < len(order) and len(els[order[b]]) * (b - a + 1) <= max_rows:
            b += 1
        group = order[a:b]
        n_max = max(len(els[i]) for i in group)
        x = torch.zeros(len(group), n_max, c.num_layers, c.num_experts)
        for r, i in enumerate(group):
            x[r, : len(els[i])] = els[i]
        logits = model(x.to(dev), all_horizons=True)[:, :, :horizon]  # [G, n, H, L, E]
        probs = model.probs(logits).cpu().numpy()
        for r, i in enumerate(group):
            outs[i] = np.ascontiguousarray(probs[r, : len(els[i])])
        a = b
    return outs


@torch.no_grad()
def online_forecast(model: ExpertForecaster, state: ForecasterState, rows: Sequence[int], x: np.ndarray, horizon: int,
                    rollout: bool = True, device: str | torch.device = "cpu") -> tuple[np.ndarray | None, int]:
    """One online forecaster step: members ``rows`` of ``state`` consume element ``x`` float32 [len(rows), L, E] (the
    state advanced in place); with ``rollout``, also the [H, L, E] combined activation probabilities of their next
    ``horizon`` elements (float16-rounded per member, as the tables store them), else None. ``x`` may also be a window
    of T elements in order, [len(rows), T, L, E]: they are consumed in one parallel (chunked-scan) pass, equal to T
    steps up to float rounding, and the forecast is made after the last (a worker that fell behind catches up at the
    cost of one call, docs/design.md "Graph-compatible decode path"). Returns (that, the forecaster steps it took: the
    elements consumed plus any recursive rollout beyond the direct heads). The one online step of the package: the
    ``seqmoe`` hooks, its worker thread and its worker process run it."""
    rows = list(rows)
    every = rows == list(range(state.batch_size))  # every row in order: advanced in place, no copy out and back
    sub = state if every else state.select(rows)
    xt = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    if xt.dim() < 4:  # one element ([rows, L, E], or flat [rows, L·E]): a window of one
        xt = xt.unsqueeze(1)
    logits = model(xt, sub, all_horizons=True)[:, -1]  # the last element's forecasts
    steps = xt.shape[1] + (max(horizon - logits.shape[1], 0) if rollout else 0)
    F = None
    if rollout:
        probs = model.probs(model.rollout(logits, sub, horizon)).cpu().numpy().astype(np.float16)
        F = combine_members([pm.astype(np.float32) for pm in probs])
    if not every:
        state.put_rows(rows, sub)
    return F, steps


def combine_members(per_member: Sequence[np.ndarray]) -> np.ndarray:
    """P(active for any member) = 1 - prod_b (1 - P_b) of per-member [H, L, E] probabilities."""
    miss = np.ones_like(per_member[0])
    for pm in per_member:
        miss *= 1.0 - np.clip(pm, 0.0, 1.0)
    return 1.0 - miss


PRECOMPUTE_CHUNK_MB = 128.0
"""Float32 forecasts computed at once when tables are precomputed (:meth:`ForecastTables.prepare`): the sequences go
in groups of at most this many MB of [elements, H, L, E] outputs (one sequence at least), each group's tables stored
in float16 before the next is computed, so the transient memory does not grow with the trace."""


class ForecastTables:
    """The float16 forecast tables of replayed sequences, least recently used first out, at most ``budget_bytes``
    (one table at least). ``one(seq)`` computes one sequence's float32 [T', H, L, E] table, ``many(seqs)`` those of
    a group; ``store(key, table)`` is where every computed table goes (default :meth:`put`; a holder may route it
    through its own hook). ``per_element`` is the float16 bytes of one element's [H, L, E] forecasts."""

    def __init__(self, budget_bytes: int, one: Callable[[Any], np.ndarray],
                 many: Callable[[Sequence[Any]], list[np.ndarray]], per_element: Callable[[], int],
                 store: Callable[[str, np.ndarray], np.ndarray] | None = None):
        self.budget_bytes = int(budget_bytes)
        self.one, self.many, self.per_element = one, many, per_element
        self.store = store or self.put
        self.tables: OrderedDict[str, np.ndarray] = OrderedDict()
        self.nbytes = 0
        self.replayed: list[Any] = []  # the replay's sequences, in order (streaming)
        self.upcoming: dict[str, int] = {}  # table key -> its index in replayed

    @staticmethod
    def key(seq: Any) -> str:
        return f"{getattr(seq, 'seq_id', id(seq))}:{len(seq.expert_ids)}"

    def put(self, key: str, tab: np.ndarray) -> np.ndarray:
        tab = tab.astype(np.float16)
        self.tables[key] = tab
        self.nbytes += tab.nbytes
        while self.nbytes > self.budget_bytes and len(self.tables) > 1:
            _, old = self.tables.popitem(last=False)
            self.nbytes -= old.nbytes
        return tab

    def table_for(self, seq: Any) -> np.ndarray:
        key = self.key(seq)
        tab = self.tables.get(key)
        if tab is None and key in self.upcoming:  # streamed: this sequence and the next ones, as many as fit
            self.compute(self.replayed[self.upcoming[key]:])
            tab = self.tables.get(key)
        if tab is None:
            tab = self.store(key, self.one(seq))
        else:
            self.tables.move_to_end(key)
        return tab

    def prepare(self, sequences: Sequence[Any]) -> None:
        """All sequences of the replay are known up front, so their forecast tables are computed together (``many``,
        in groups of :data:`PRECOMPUTE_CHUNK_MB`), as many as fit the budget. The rest stream: when the replay reaches
        a sequence without a table, :meth:`table_for` computes it and the following ones the same way, the least
        recently used tables making room (so a replay holds at most the budget of tables, whatever the trace's
        length). Sequences already cached (an earlier capacity) are skipped."""
        traced = [s for s in sequences if hasattr(s, "expert_ids") and hasattr(s, "expert_weights")]
        self.replayed = traced
        self.upcoming = {self.key(s): i for i, s in enumerate(traced)}
        self.compute(traced, evict=False)

    def compute(self, seqs: Sequence[Any], evict: bool = True) -> None:
        """Tables of the first of ``seqs`` without one and of those after it, as many as the budget holds (the first
        always; ``evict``: least recently used tables make room, else only the free room is used), computed and
        stored group by group (:data:`PRECOMPUTE_CHUNK_MB`)."""
        todo = [s for s in seqs if self.key(s) not in self.tables]
        per_elem = self.per_element()
        room = self.budget_bytes - (0 if evict else self.nbytes)
        fit, used = [], 0
        for s in todo:
            used += len(s.expert_ids) * per_elem
            if used > room and (fit or not evict):
                break
            fit.append(s)
        chunk = PRECOMPUTE_CHUNK_MB * 2**20 / 2  # float16 bytes of the float32 outputs of one group
        a = 0
        while a < len(fit):
            b, size = a, 0
            while b < len(fit) and (b == a or size + len(fit[b].expert_ids) * per_elem <= chunk):
                size += len(fit[b].expert_ids) * per_elem
                b += 1
            group = fit[a:b]
            tabs = self.many(group)
            for s, tab in zip(group, tabs, strict=True):
                self.store(self.key(s), tab)
            del tabs
            a = b


@dataclass
class ForecastScores:
    """What one forecast sets (SeqMoE 7.1): ``before`` / ``after`` [L, E] the CacheScore of each expert before
    and after its next execution, ``first_exec`` int [L] the layer-execution index of each layer's next
    execution, ``first_probs`` [L, E] P(active) at that execution (the prefetch input); ``second_probs``
    [L, E] P(active) at the execution after it (None when the horizon is 1)."""

    before: np.ndarray
    after: np.ndarray
    first_exec: np.ndarray
    first_probs: np.ndarray
    second_probs: np.ndarray | None = None
