"""Graph-compatible offloaded decoding: the MoE layer as a fixed-shape device computation (docs/design.md,
"Runtime", graph-compatible decode path). The policy is the same as the eager driver's, compiled: its public
device step (:class:`~expertcast.inference.policies.device.DeviceProgram`) says which eviction rule runs here.

The eager decode path (:class:`~expertcast.inference.runtime.engine.OffloadedModel` with the driver) copies
each layer's selection to the host, decides hits and misses in Python and launches one GEMM per expert. The
graph path keeps the residency on the device and does every per-layer decision with tensor operations of
fixed shape, so the per-layer function has no host synchronisation and no data-dependent Python: it
compiles with ``torch.compile(fullgraph=True)`` and is captured in CUDA Graphs on CUDA
(:mod:`.cuda_graph`). The device state is :class:`~.state.DeviceResidency` (:mod:`.state`).

One layer (:meth:`GraphDecoder.layer_fn`, M = T*K (token, choice) pairs): keys -> slots through the table;
the first occurrence of each key is an access; hits are resident; every miss takes the next victim of the
layer's pool (its S slots only, not all N) in eviction order (the order of a stable sort of the policy's
keys: empty slots first, then the lowest score, ties to the lowest slot; slots holding the layer's
selection are protected), found by M successive argmins rather than a sort; a miss with no evictable slot
left is served from a scratch row (temporary, not retained). The table is updated with
masked scatters, the miss rows are copied from the host store into their slots on the device
(:class:`~.copier.RowCopier`), and the experts run as gathered batched matmuls of fixed shape over the slot pool
(transformers' ``batched_mm`` arithmetic, so greedy tokens equal the full-load model's).

Compiled, the layer is one fixed-shape function: ``torch.compile(fullgraph=True)`` (no graph break), on the
CPU :class:`~.aot.AOTLayer` (AOTInductor: fused C++ kernels, no guards, no Python wrapper per layer call),
on CUDA :class:`~.cuda_graph.CudaGraphLayer` (the default there: one graph launch per layer), which is what
makes the per-layer host time a small fraction of the eager path's (docs/design.md, "Runtime",
graph-compatible decode path; ``scripts/bench_runtime.py --overhead``).

Eviction rules (:data:`~expertcast.inference.policies.device.EVICTION_RULES`): ``recency`` (LRU: the access
clock; hits first, then misses, in selection order, as the host LRU ticks) and ``forecast`` (SeqMoE: the
forecast CacheScore, ties to the least recent layer-execution). A forecast-rule policy's forecaster runs on
the package's one background forecasting thread (:mod:`.planner`): at every step boundary the step's routing
(logged on the device) is handed to it; it publishes score tables and a proactive plan (the policy's
``plan_keys``) that the decoder copies to the device tables at a later step boundary; each layer then admits
the plan of the next layer (a load is issued when a slot is free or its score beats the victim's).

Counters are the driver's :class:`~expertcast.inference.cache.driver.Counters` (``late`` and ``cpu`` stay 0).
They equal the eager path's and the simulator's whenever the decisions match: always for lru; for seqmoe when
both paths evict by the same forecasts at the same times, which holds without prefetch and with the trigger at
the last layer (the step boundary is then the trigger). With a trigger p < L-1 the graph path's forecast
applies at the step boundary, and with prefetch its plans are admitted one layer ahead in the compute stream
(no EDF scheduler, no late prefetches), so those decisions differ from the eager driver's.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from expertcast.inference.cache.counters import COUNTER_NAMES
from expertcast.inference.cache.expert_cache import USED
from expertcast.inference.policies.device import EVICT_RECENCY, DeviceKeys, DeviceProgram
from expertcast.inference.runtime.graph.copier import RowCopier
from expertcast.inference.runtime.graph.path import DECODE_PATHS, choose_decode_path, device_program_of
from expertcast.inference.runtime.graph.planner import GraphPlanner, Published
from expertcast.inference.runtime.graph.state import ACC, DEM, PRO, DeviceResidency, first_in_order
from expertcast.utils.errors import UsageError

__all__ = ["COMPILE_BACKENDS", "DECODE_PATHS", "MAX_BATCH", "GraphDecoder", "choose_decode_path", "device_program_of"]
"""``DECODE_PATHS`` and ``choose_decode_path`` live in :mod:`.path`; importable from here too."""

COMPILE_BACKENDS = ("none", "aot_eager", "inductor", "aoti", "cuda-graph")
MAX_BATCH = 4
"""Decode batches up to this size run on the graph path (the scratch rows are sized for MAX_BATCH * K)."""


class GraphDecoder:
    """The graph-compatible decode path of an :class:`~expertcast.inference.runtime.engine.OffloadedModel` (see the
    module docstring).

    Args:
        om: the offloaded model (its cache, slot pool, host store, policy and stats are shared).
        blocking: forecast rule only: wait at each step boundary for the forecast of the step before
            (deterministic; default: the planner runs beside decoding and its plans apply when they are ready).

    The policy's device step is ``device_program_of(om.policy)``; nothing else of the policy is read.
    """

    def __init__(self, om: Any, blocking: bool = False):
        program = device_program_of(om.policy)
        if program is None:
            raise UsageError(f"policy {om.policy.name!r} has no device step: the graph decode path cannot run it")
        self.om = om
        self.program: DeviceProgram = program
        self.recency_rule = program.eviction == EVICT_RECENCY
        self.L, self.E, self.K = om.L, om.E, om.K
        self.N = om.cache.num_slots
        self.device = om.device
        self.scratch = om.pool.num_temp
        self.P = int(program.plan_width)
        self.prefetch = self.P > 0
        self.state = DeviceResidency.empty(self.L, self.E, self.N, om.cache.slot_pool, om.cache_config.pool_of_layer,
                                           self.P, self.device)
        self.copier = RowCopier(om.store.rows, om.pool.buffer)
        self.weights = self.weight_views(om.pool.buffer)
        """Named weight stacks [R, ...] over every pool row (views of the pool buffer, slot = row)."""
        self.layer_ids = [torch.tensor(i, dtype=torch.long, device=self.device) for i in range(self.L)]
        self.arange = torch.arange(max(self.scratch, 1), device=self.device)
        self.layer_range = torch.arange(self.L, device=self.device)
        self.planner = None if program.forecaster is None else GraphPlanner(program, self.L, self.E, blocking)
        self.routing_ids = torch.zeros((self.L, MAX_BATCH, self.K), dtype=torch.long, device=self.device)
        self.routing_w = torch.zeros((self.L, MAX_BATCH, self.K), dtype=torch.float32, device=self.device)
        self.template = om.refs[0].module
        """Gate and activation of every layer's experts (the same config): one function serves all layers."""
        self.layer_fn: Any = self.run_layer
        """The per-layer decode function ``(layer, h, idx, w) -> y`` (``torch.compile(decoder.run_layer,
        fullgraph=True)`` compiles it once for every layer: the layer is a device tensor). On CUDA it is
        captured in CUDA Graphs (:meth:`compile` ``"cuda-graph"``), on the CPU uncompiled by default."""
        self.active = False
        self._step: tuple[int, list[int], list[int]] | None = None
        """(t, members, positions) of the running decode step (its routing goes to the planner next)."""
        if self.device.type == "cuda":
            self.compile("cuda-graph")

    def weight_views(self, pool_buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named weight stacks [R, ...] of the pool buffer [R, row_numel] (views)."""
        return {p.name: pool_buffer[:, p.offset:p.offset + p.numel].view(-1, *p.shape) for p in self.om.layout.parts}

    def compile(self, backend: str) -> None:
        """Compile the per-layer function (``layer_fn``). ``backend``: ``"none"`` (eager tensor ops),
        ``"aot_eager"`` / ``"inductor"`` (``torch.compile(fullgraph=True)``: dynamo guards and the compiled
        wrapper run in Python at every call), ``"aoti"`` (CPU: :class:`~.aot.AOTLayer`, compiled ahead of time
        by AOTInductor for each batch size met, called without guards through its C++ runner) or
        ``"cuda-graph"`` (CUDA: :class:`~.cuda_graph.CudaGraphLayer`, captured once per batch size and
        replayed; the default on CUDA)."""
        if backend not in COMPILE_BACKENDS:
            raise UsageError(f"compile backend must be one of {COMPILE_BACKENDS}, got {backend!r}")
        if backend == "none":
            self.layer_fn = self.run_layer
        elif backend == "aoti":
            from expertcast.inference.runtime.graph.aot import AOTLayer

            self.layer_fn = AOTLayer(self)
        elif backend == "cuda-graph":
            from expertcast.inference.runtime.graph.cuda_graph import CudaGraphLayer

            self.layer_fn = CudaGraphLayer(self)
        else:
            self.layer_fn = torch.compile(self.run_layer, fullgraph=True, backend=backend)

    @staticmethod
    def scratch_rows(top_k: int, plan_width: int) -> int:
        """Pool rows beyond the slots that the graph path needs (one per (token, choice) pair of the largest
        batch, and one per plan entry)."""
        return max(MAX_BATCH * top_k, plan_width)

    # ------------------------------------------------------------------------------------------ calls
    def begin_decode(self, rows: int) -> bool:
        """The prefill of a call is closed (host cache materialized): load the host state onto the device.
        Returns False (eager path for this call, printed) when ``rows`` token rows exceed the scratch rows."""
        if rows * self.K > self.scratch:
            print(f"decode path: eager for this call: a batch of {rows} exceeds the graph path's {MAX_BATCH}",
                  file=sys.stderr)
            self.active = False
            return False
        if self.active:  # the previous call ended early (an error): its state goes back to the host first
            self._store_to_host()
        self.om.transport.reset()  # materialized: nothing in flight
        self._load_from_host()
        self.state.counters.zero_()
        if self.planner is not None:
            self.planner.begin()
        self.active = True
        return True

    def begin_step(self, t: int, members: list[int], positions: list[int]) -> None:
        """Host, between decode steps: hand the last step's routing to the planner, publish its ready
        results to the device tables, set the step counter. ``members`` / ``positions``: the active members
        of step ``t`` and the position each processes."""
        if self.planner is not None:
            self._submit_last_step()
            self._publish(self.planner.take())
        self._step = (t, list(members), list(positions))
        self.state.step.fill_(t)

    def _submit_last_step(self) -> None:
        if self._step is None:
            return
        t, members, positions = self._step
        nb = self.device.type == "cuda"
        ids = self.routing_ids[:, :len(members)].to("cpu", non_blocking=nb)
        w = self.routing_w[:, :len(members)].to("cpu", non_blocking=nb)
        self.planner.submit(t, members, positions, ids, w, _record_event(self.device))
        self._step = None

    def end_decode(self) -> None:
        """The call ends: wait for the planner, write the device state back into the host cache, policy,
        transport and counters."""
        if self.planner is not None:
            self._submit_last_step()
            self.planner.drain()
            self._publish(self.planner.take())
        self._store_to_host()
        self.active = False

    def close(self) -> None:
        """Stop the planner thread."""
        if self.planner is not None:
            self.planner.close()

    def decode_layer(self, module: torch.nn.Module, layer: int, h: torch.Tensor, idx: torch.Tensor,
                     w: torch.Tensor) -> torch.Tensor:
        """One MoE layer of a decode step: hidden ``h`` [T, H], routing ``idx`` / ``w`` [T, K] -> [T, H]."""
        if self.planner is not None:
            self.routing_ids[layer, :idx.shape[0]].copy_(idx)
            self.routing_w[layer, :idx.shape[0]].copy_(w)
        return self.layer_fn(self.layer_ids[layer], h, idx, w)

    # ------------------------------------------------------------------------------------------ the layer
    def run_layer(self, layer: torch.Tensor, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Residency, miss loads, compute and eviction keys of one layer; every shape depends on T*K only."""
        st, N, E = self.state, self.N, self.E
        T, K = idx.shape
        M = T * K
        ar = self.arange[:M]
        key = layer * E + idx.reshape(-1).long()  # [M]
        same = key[:, None] == key[None, :]
        first = ~(same & (ar[None, :] < ar[:, None])).any(1)  # first occurrence of each key: one access
        first_of = torch.where(same, ar[None, :], M).amin(1)  # [M] index of each key's first occurrence
        slot = st.table[key]
        hit = first & (slot >= 0)
        miss = first & (slot < 0)
        cand = self._candidates(layer)  # [S] the slots of the layer's pool
        protect = (cand[:, None] == torch.where(hit, slot, -1)[None, :]).any(1)  # [S] they hold a hit
        k1, k2 = self._evict_keys(layer, cand, phase=1)
        dst, load, v, _ = self._take_slots(want=miss, k1=k1, k2=k2, cand=cand, protect=protect)
        self._assign(key, load, v)
        self.copier.copy(key, torch.where(miss, dst, N + ar), miss)
        resolved = torch.where(hit, slot, dst)
        y = self._compute(h, w, resolved[first_of])
        self._touch(layer, key, first, hit, miss, load)
        self._count(layer, ACC, torch.stack([first.sum(), hit.sum()]))  # accesses, hits
        self._count(layer, DEM, torch.stack([miss.sum(), (miss & ~load).sum()]))  # demand, temp
        if self.prefetch:
            self._admit_plan((layer + 1) % self.L)
        return y

    def _candidates(self, layer: torch.Tensor) -> torch.Tensor:
        """int64 [S]: the slots of ``layer``'s pool, ascending, padded with N (the sink slot; S: the largest
        pool). A per-layer pool makes every per-layer pass over S = N/L slots instead of N."""
        st = self.state
        return st.pool_slots.index_select(0, st.layer_pool.index_select(0, layer.view(1))).squeeze(0)

    def _count(self, layer: torch.Tensor, first: int, c: torch.Tensor) -> None:
        """counters[first:first+len(c), layer] += c (a dense masked add: no scatter)."""
        st = self.state
        onehot = (self.layer_range == layer).long()  # [L]
        st.counters[first:first + c.shape[0]] += c[:, None] * onehot[None, :]

    def _evict_keys(self, layer: torch.Tensor, cand: torch.Tensor, phase: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(primary, secondary) eviction keys [S] of the slots ``cand`` [S] (lowest evicted first), empty -inf."""
        st, LE = self.state, self.L * self.E
        held = st.slot_key[cand]
        k = torch.where(held >= 0, held, LE)
        rec = st.recency[k]
        if self.recency_rule:
            k1, k2 = rec, torch.zeros_like(rec)
        else:  # seqmoe: CacheScore of the key's next execution, ties to the least recent layer-execution
            x_now = st.step * self.L + layer
            fx = st.first_exec[torch.div(k, self.E, rounding_mode="floor").clamp(max=self.L - 1)]
            ahead = (fx > x_now) | ((fx == x_now) & (phase == 0))
            k1, k2 = torch.where(ahead, st.before[k], st.after[k]).double(), rec
        return torch.where(held >= 0, k1, -torch.inf), k2

    def _take_slots(self, want: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, cand: torch.Tensor,
                    protect: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Victims among the slots ``cand`` [S] (keys ``k1`` / ``k2`` [S], ``protect`` [S]: never evicted) for
        the ``want`` [M] pairs in eviction order. Returns (dst rows [M]: the victim slot, else a scratch row;
        load [M]: got a slot; v [M]: the victim slot of each pair's rank; kv [M]: its primary key)."""
        N, M = self.N, want.shape[0]
        k1 = torch.where((cand < N) & ~protect, k1, torch.inf)
        m = min(M, cand.shape[0])
        first, valid = first_in_order(k1, None if self.recency_rule else k2, m)
        rank = self._count_upto(want) - 1
        rc = rank.clamp(0, m - 1)
        j = first[rc]
        v = cand[j]
        load = want & (rank < m) & valid[rc]
        return torch.where(load, v, N + self.arange[:M]), load, v, k1[j]

    def _count_upto(self, flags: torch.Tensor) -> torch.Tensor:
        """Inclusive running count of the bool ``flags`` [M] (int64 [M]): a masked [M, M] sum, which compiles
        into one fused kernel (M <= the scratch rows, a few dozen)."""
        ar = self.arange[:flags.shape[0]]
        return (flags[None, :] & (ar[None, :] <= ar[:, None])).sum(1)

    def _assign(self, key: torch.Tensor, load: torch.Tensor, v: torch.Tensor) -> None:
        """Evict the victims' keys and give their slots to the loaded keys (masked scatters)."""
        st, LE, N = self.state, self.L * self.E, self.N
        old = st.slot_key[v]
        st.table[torch.where(load & (old >= 0), old, LE)] = -1
        st.table[torch.where(load, key, LE)] = v
        st.slot_key[torch.where(load, v, N)] = key
        st.table[LE] = -1
        st.slot_key[N] = -1

    def _touch(self, layer: torch.Tensor, key: torch.Tensor, first: torch.Tensor, hit: torch.Tensor,
               miss: torch.Tensor, load: torch.Tensor) -> None:
        """Update the eviction keys after the layer ran (the host policies' ``on_access``)."""
        st, LE = self.state, self.L * self.E
        if self.recency_rule:  # one tick per access: hits first, then misses, in selection order
            n_hit = hit.sum()
            tick = torch.where(hit, self._count_upto(hit), n_hit + self._count_upto(miss))
            st.recency[torch.where(hit | load, key, LE)] = st.clock + tick.double()
            st.clock.add_(first.sum().double())
        else:
            st.recency[torch.where(first, key, LE)] = (st.step * self.L + layer).double()

    def _admit_plan(self, layer: torch.Tensor) -> None:
        """SeqMoE proactive loads for ``layer``'s next execution: plan entries not resident take a free slot,
        or the lowest-score victim when their score beats it."""
        st, N = self.state, self.N
        pk = st.plan.index_select(0, layer.view(1)).squeeze(0)  # [P]
        P = pk.shape[0]
        valid = pk >= 0
        key = torch.where(valid, pk, 0)
        want = valid & (st.table[key] < 0)
        cand = self._candidates(layer)
        k1, k2 = self._evict_keys(layer, cand, phase=2)
        nothing = torch.zeros_like(cand, dtype=torch.bool)
        dst, got, v, kv = self._take_slots(want=want, k1=k1, k2=k2, cand=cand, protect=nothing)
        admit = got & (kv < st.before[key].double())
        self._assign(key, admit, v)
        self.copier.copy(key, torch.where(admit, dst, N + self.arange[:P]), admit)
        self._count(layer, PRO, torch.stack([admit.sum(), (want & ~got).sum()]))  # proactive, dropped

    def _compute(self, h: torch.Tensor, w: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Gathered batched matmuls of the M (token, choice) pairs with the weights of ``slots`` [M] (the
        arithmetic of transformers' ``batched_mm`` experts)."""
        T, K = w.shape
        W, module = self.weights, self.template
        x = h.to(W["down_proj"].dtype).repeat_interleave(K, dim=0)  # [M, H]
        up = "gate_up_proj" if module.has_gate else "up_proj"
        z = _batched_linear(x, W[up][slots], W.get(f"{up}_bias"), slots, module.is_transposed)
        z = module._apply_gate(z) if module.has_gate else module.act_fn(z)
        y = _batched_linear(z, W["down_proj"][slots], W.get("down_proj_bias"), slots, module.is_transposed)
        y = y * w.reshape(-1).to(y.dtype).unsqueeze(-1)
        return y.view(T, K, -1).sum(dim=1).to(h.dtype)

    # ------------------------------------------------------------------------------------------ host sync
    def _load_from_host(self) -> None:
        """Host cache and policy keys -> device tables (once per call, after the prefill)."""
        om, st, E = self.om, self.state, self.E
        cache = om.cache
        occ = cache.slot_layer >= 0
        keys = np.where(occ, cache.slot_layer.astype(np.int64) * E + cache.slot_expert, -1)
        st.slot_key[:self.N].copy_(torch.as_tensor(keys))
        table = np.append(cache.slot_of.reshape(-1).astype(np.int64), -1)
        st.table.copy_(torch.as_tensor(table))
        pk = self.program.read_keys()
        st.recency[:-1].copy_(torch.as_tensor(np.asarray(pk.recency, np.float64).reshape(-1)))
        st.clock.fill_(float(pk.clock))
        if self.planner is not None:
            self._copy_scores(self.program.forecaster.current_scores(),
                              np.full(tuple(st.plan.shape), -1, np.int64))

    def _store_to_host(self) -> None:
        """Device tables -> host cache, policy keys, transport holdings and decode counters."""
        om, st, E = self.om, self.state, self.E
        keys = st.slot_key[:self.N].cpu().numpy()
        _rebuild_cache(om.cache, keys, E)
        om.transport.set_holdings([(int(k) // E, int(k) % E) if k >= 0 else (-1, -1) for k in keys])
        self.program.write_keys(DeviceKeys(st.recency[:-1].cpu().numpy(), float(st.clock.item())))
        cnt = st.take_counters()
        for name in COUNTER_NAMES:
            getattr(om.stats, name)[:] += getattr(cnt, name)

    def _publish(self, pub: Published | None) -> None:
        """Copy the planner's latest result into the device tables and install its scores in the policy (host,
        between steps)."""
        if pub is None:
            return
        self._copy_scores(pub.scores, pub.plan)
        self.program.forecaster.install_scores(pub.scores)

    def _copy_scores(self, sc: Any, plan: np.ndarray) -> None:
        st, nb = self.state, self.device.type == "cuda"
        st.before[:-1].copy_(torch.as_tensor(np.asarray(sc.before, np.float32).reshape(-1)), non_blocking=nb)
        st.after[:-1].copy_(torch.as_tensor(np.asarray(sc.after, np.float32).reshape(-1)), non_blocking=nb)
        st.first_exec.copy_(torch.as_tensor(np.asarray(sc.first_exec, np.int64)), non_blocking=nb)
        st.plan.copy_(torch.as_tensor(plan), non_blocking=nb)


def _batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor,
                    transposed: bool) -> torch.Tensor:
    """x [M, in] with per-pair weights [M, out, in] ([M, in, out] when transposed) -> [M, out]."""
    out = torch.bmm(x.unsqueeze(1), weight).squeeze(1) if transposed else torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1)
    return out if bias is None else out + bias[slots]


def _rebuild_cache(cache: Any, slot_keys: np.ndarray, E: int) -> None:
    """Make the host :class:`ExpertCache` hold ``slot_keys`` [N] (key or -1 per slot), every occupied slot Used."""
    cache.reset()
    taken = [[s for s in iter(lambda p=p: cache.take_free_slot(p), -1)] for p in range(len(cache.pool_start) - 1)]
    for slots in taken:
        for s in sorted(slots, reverse=True):
            k = int(slot_keys[s])
            if k < 0:
                cache.release(s)  # released highest first: the lowest free slot is taken first
            else:
                cache.assign(s, k // E, k % E, USED)


def _record_event(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev
