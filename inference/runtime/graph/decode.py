"""Graph-compatible offloaded decoding: the MoE layer as a fixed-shape device computation (docs/design.md,
"Runtime", graph-compatible decode path).

The eager decode path (:class:`~expertcast.inference.runtime.engine.OffloadedModel` with the driver) copies
each layer's selection to the host, decides hits and misses in Python and launches one GEMM per expert. The
graph path keeps the residency on the device and does every per-layer decision with tensor operations of
fixed shape, so the per-layer function has no host synchronisation and no data-dependent Python: it
compiles with ``torch.compile(fullgraph=True)`` and can be captured in a CUDA Graph.

Device state (:class:`DeviceResidency`), flat keys ``k = layer * E + expert`` with one sink entry at the end
that masked writes go to:

* ``table`` int64 [L*E + 1]: slot of each key, or -1;
* ``slot_key`` int64 [N + 1]: key held by each slot of the shared slot pool, or -1 (empty);
* ``pool_slots`` int64 [pools, S]: the slots of each pool (ascending, padded with N), ``layer_pool`` [L] the
  pool of each layer, ``slot_pool`` [N] the pool of each slot;
* ``recency`` float64 [L*E + 1]: LRU access clock (lru) / last layer-execution (seqmoe) of each key;
* seqmoe only: ``before`` / ``after`` float32 [L*E + 1] (the policy's CacheScore before and after the
  key's next execution), ``first_exec`` int64 [L], ``plan`` int64 [L, P] (proactive loads, -1 padded);
* ``counters`` int64 [6, L]: accesses, hits, demand, temp, proactive, dropped.

One layer (:meth:`GraphDecoder.layer_fn`, M = T*K (token, choice) pairs): keys -> slots through the table;
the first occurrence of each key is an access; hits are resident; every miss takes the next victim of the
layer's pool (its S slots only, not all N) in eviction order (the order of a stable sort of the policy's
keys: empty slots first, then the lowest score, ties to the lowest slot; slots holding the layer's
selection are protected), found by M successive argmins rather than a sort; a miss with no evictable slot
left is served from a scratch row (temporary, not retained). The table is updated with
masked scatters, the miss rows are copied from the host store into their slots on the device
(:class:`RowCopier`: on CUDA a Triton kernel reading pinned, device-mapped host memory, rows of non-missing
pairs masked off; on CPU an ``index_copy_`` of all M rows, the non-missing ones into their own scratch
rows), and the experts run as gathered batched matmuls of fixed shape over the slot pool (transformers'
``batched_mm`` arithmetic, so greedy tokens equal the full-load model's).

Compiled, the layer is one fixed-shape function: ``torch.compile(fullgraph=True)`` (no graph break) or, on the
CPU, :class:`AOTLayer` (AOTInductor: fused C++ kernels, no guards, no Python wrapper per layer call),
which is what makes the per-layer host time a small fraction of the eager path's (docs/design.md, "Runtime",
graph-compatible decode path; ``scripts/bench_runtime.py --overhead``).

Policies: ``lru`` (eviction key: the access clock; hits first, then misses, in selection order, as the
host LRU ticks) and ``seqmoe`` (key: the forecast CacheScore, ties to the least recent layer-execution).
SeqMoE's forecaster runs on a host thread (:class:`ForecastPlanner`): at every step boundary the step's
routing (logged on the device) is handed to it; it publishes score tables and a proactive plan (top
``max_tasks_per_layer`` experts per layer above ``min_confidence``) that the engine copies to the device
tables at a later step boundary; each layer then admits the plan of the next layer (a load is issued when a
slot is free or its score beats the victim's). Counters equal the eager path's and the simulator's for lru,
and for seqmoe without prefetch when its trigger layer is the last one (the step boundary is then the
trigger); otherwise seqmoe's differ by construction: a forecast triggered at layer p < L-1 applies at the
step boundary, plans are admitted one layer ahead in the compute stream (no EDF scheduler, no late
prefetches: on CUDA they do not yet overlap the compute of the layer before).
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from expertcast.inference.cache.expert_cache import USED
from expertcast.utils.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.runtime.engine import OffloadedModel

DECODE_PATHS = ("eager", "graph", "auto")
COUNTERS = ("accesses", "hits", "demand", "temp", "proactive", "dropped")
ACC, HIT, DEM, TMP, PRO, DROP = range(len(COUNTERS))
COMPILE_BACKENDS = ("none", "aot_eager", "inductor", "aoti")
MAX_BATCH = 4
"""Decode batches up to this size run on the graph path (the scratch rows are sized for MAX_BATCH * K)."""


# ---------------------------------------------------------------------------------------------- path choice
def policy_kind(policy: Any) -> str | None:
    """``"lru"`` / ``"seqmoe"`` when the policy has a device implementation, else None."""
    from expertcast.inference.policies.classic import LRUPolicy
    from expertcast.inference.policies.seqmoe import SeqMoEPolicy

    if type(policy) is LRUPolicy:
        return "lru"
    if type(policy) is SeqMoEPolicy:
        return "seqmoe"
    return None


def choose_decode_path(requested: str, policy: Any, device: torch.device, link_gbps: float | None,
                       pinned_store: bool, modules: list[torch.nn.Module] = (), announce: bool = False
                       ) -> tuple[str, str]:
    """(path, reason): which decode path runs and why. ``requested="graph"`` raises UsageError when the
    graph path cannot run; ``"auto"`` falls back to the eager path. ``modules``: the model's experts modules.
    ``announce``: print the choice (on stderr) unless the eager path was asked for."""
    if requested not in DECODE_PATHS:
        raise UsageError(f"decode path must be one of {DECODE_PATHS}, got {requested!r}")
    if requested == "eager":
        return "eager", "the eager path was asked for"
    why_not = None
    if policy_kind(policy) is None:
        why_not = f"policy {policy.name!r} decides on the host (the graph path covers lru and seqmoe)"
    elif link_gbps is not None:
        why_not = "an emulated host-device link (link_gbps) throttles host-driven transfers only"
    elif device.type == "cuda" and not (_has_triton() and pinned_store):
        why_not = "device-side miss copies on CUDA need Triton and a pinned (not memory-mapped) host store"
    elif any(getattr(m, "has_post_expert_norm", False) for m in modules):
        why_not = "the experts apply a per-layer post-expert norm (one layer function serves every layer)"
    elif device.type not in ("cpu", "cuda"):
        why_not = f"device {device.type} is not supported by the graph path"
    if why_not is not None and requested == "graph":
        raise UsageError(f"decode path 'graph' cannot run: {why_not}")
    path = "eager" if why_not else "graph"
    reason = why_not or f"policy {policy.name} keeps its residency and eviction scores on the device"
    if announce:
        print(f"decode path: {path} ({reason})", file=sys.stderr)
    return path, reason


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- row copies
class RowCopier:
    """Copies expert rows of the host store into rows of the device pool, inside the device computation.

    ``copy(src_keys [M], dst_rows [M], mask [M])``: row ``src_keys[i]`` of the store goes to pool row
    ``dst_rows[i]`` where ``mask[i]``. CPU: the store is host memory already; every row is copied (the caller
    points unmasked pairs at their own scratch rows, so the shape stays fixed). CUDA: a Triton kernel reads the
    pinned store through its device-mapped address (unified addressing) and copies the masked rows only.
    """

    def __init__(self, store_rows: torch.Tensor, pool_buffer: torch.Tensor):
        self.src = store_rows.reshape(-1, store_rows.shape[-1])  # [L*E, row_numel]
        self.dst = pool_buffer  # [R, row_numel]
        self.cuda = pool_buffer.device.type == "cuda"
        if self.cuda:
            from expertcast.inference.runtime.graph import triton as _graph_triton

            self._kernel = _graph_triton.copy_rows

    def copy(self, src_keys: torch.Tensor, dst_rows: torch.Tensor, mask: torch.Tensor) -> None:
        if self.cuda:
            self._kernel(self.src, self.dst, src_keys, dst_rows, mask)
        else:
            self.dst.index_copy_(0, dst_rows, self.src.index_select(0, src_keys))


# ---------------------------------------------------------------------------------------------- AOT compiled
AOTI_CONFIG = {"aot_inductor.allow_stack_allocation": True}
"""Inductor options of :class:`AOTLayer`: the intermediates of a call live on the C++ stack (a layer makes a few
dozen tiny buffers; a tensor object and a malloc per buffer cost more than the layer's fused kernel)."""


class AOTLayer:
    """:meth:`GraphDecoder._layer` compiled ahead of time by AOTInductor (CPU), one artefact per batch size T.

    ``torch.compile`` pays, at every call, dynamo's guard evaluation and the compiled graph's Python wrapper
    (AOTAutograd runtime wrappers, input mutation bookkeeping): hundreds of microseconds per layer on a CPU,
    more than the layer's kernels. Here the layer is exported once (``torch.export``, the device state, the
    pool buffer and the host store as inputs that the function mutates in place), compiled into a shared
    library whose C++ wrapper launches the fused kernels, and called through the package loader's ``run``:
    no guards, one Python-to-C++ call per layer. The shapes are fixed per artefact (the state's, and T x K of
    the selection): a new batch size compiles a new artefact (seconds, on first use). CPU only: on CUDA the
    host cost is removed by capturing the decode step in a CUDA Graph instead.

    Call: ``(layer int64 [] , h [T, H], idx int64 [T, K], w [T, K]) -> y [T, H]`` like ``_layer``.
    """

    def __init__(self, decoder: GraphDecoder):
        if decoder.device.type != "cpu":
            raise UsageError("the AOTInductor-compiled layer function runs on the CPU (CUDA: capture a CUDA Graph)")
        self.decoder = decoder
        self.fields = [f.name for f in dataclasses.fields(DeviceResidency)]
        self.runners: dict[tuple, Any] = {}
        """(T, dtypes of h, idx, w) -> the loaded artefact's runner."""
        self.compile_seconds: dict[int, float] = {}
        self._args: list[torch.Tensor] = []
        """The call's inputs: 4 per call, then the store, the pool buffer and the state tensors (bound once)."""
        self._bound: DeviceResidency | None = None

    def __call__(self, layer: torch.Tensor, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h, idx, w = h.contiguous(), idx.contiguous(), w.contiguous()
        key = (h.shape[0], h.dtype, idx.dtype, w.dtype)
        run = self.runners.get(key)
        if run is None:
            run = self.runners[key] = self._build(layer, h, idx, w)
        d = self.decoder
        if self._bound is not d.state:  # the argument list holds the state's tensors
            self._bind()
        a = self._args
        a[0], a[1], a[2], a[3] = layer, h, idx, w
        return run(a)[0]

    def _bind(self) -> None:
        d = self.decoder
        self._args = [d.layer_ids[0]] * 4 + [d.copier.src, d.copier.dst, *(getattr(d.state, f) for f in self.fields)]
        self._bound = d.state

    def _build(self, layer: torch.Tensor, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> Any:
        import os
        import tempfile
        import time

        t0 = time.perf_counter()
        self._bind()
        args = (layer, h, idx, w, *self._args[4:])
        with torch.no_grad():
            ep = torch.export.export(_BoundLayer(self.decoder, self.fields), args, strict=False)
            with tempfile.TemporaryDirectory(prefix="expertcast-aoti-") as tmp:
                pkg = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, "layer.pt2"),
                                                               inductor_configs=AOTI_CONFIG)
                compiled = torch._inductor.aoti_load_package(pkg)
        self.compile_seconds[h.shape[0]] = time.perf_counter() - t0
        loader = getattr(compiled, "loader", None)
        return loader.run if loader is not None else (lambda a: [compiled(*a)])


class _BoundLayer(torch.nn.Module):
    """``GraphDecoder._layer`` as a module whose inputs are every tensor it reads or writes (for torch.export):
    ``forward(layer, h, idx, w, store_rows, pool_buffer, *state_fields)``. While it runs, the decoder's state,
    pool views and row copier point at the inputs."""

    def __init__(self, decoder: GraphDecoder, fields: list[str]):
        super().__init__()
        self.decoder = decoder  # not a Module: not registered, no parameters or buffers
        self.fields = fields

    def forward(self, layer, h, idx, w, store_rows, pool_buffer, *state):
        d = self.decoder
        saved = d.state, d.weights, d.copier.src, d.copier.dst
        d.state = DeviceResidency(**dict(zip(self.fields, state, strict=True)))
        d.weights = d._weight_views(pool_buffer)
        d.copier.src, d.copier.dst = store_rows, pool_buffer
        try:
            return d._layer(layer, h, idx, w)
        finally:
            d.state, d.weights, d.copier.src, d.copier.dst = saved


# ---------------------------------------------------------------------------------------------- device state
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
                   pool_slots=torch.as_tensor(_pool_slots(slot_pool, N), device=device),
                   recency=torch.zeros(LE + 1, dtype=torch.float64, **z),
                   clock=torch.zeros(1, dtype=torch.float64, **z), step=torch.zeros(1, dtype=torch.long, **z),
                   before=torch.zeros(LE + 1, **z), after=torch.zeros(LE + 1, **z),
                   first_exec=torch.full((L,), -1, dtype=torch.long, **z),
                   plan=torch.full((L, max(plan_width, 1)), -1, dtype=torch.long, **z),
                   counters=torch.zeros((len(COUNTERS), L), dtype=torch.long, **z))


# ---------------------------------------------------------------------------------------------- the decoder
class GraphDecoder:
    """The graph-compatible decode path of an :class:`OffloadedModel` (see the module docstring).

    Args:
        om: the offloaded model (its cache, slot pool, host store, policy and stats are shared).
        kind: ``"lru"`` or ``"seqmoe"``.
        blocking: seqmoe only: wait at each step boundary for the forecast of the step before (deterministic;
            default: the planner runs beside decoding and its plans apply when they are ready).
    """

    def __init__(self, om: OffloadedModel, kind: str, blocking: bool = False):
        self.om = om
        self.kind = kind
        self.L, self.E, self.K = om.L, om.E, om.K
        self.N = om.cache.num_slots
        self.device = om.device
        self.scratch = om.pool.num_temp
        self.prefetch = kind == "seqmoe" and bool(om.policy.prefetch)
        self.P = int(om.policy.max_tasks) if self.prefetch else 0
        self.state = DeviceResidency.empty(self.L, self.E, self.N, om.cache.slot_pool, om.cache_config.pool_of_layer,
                                           self.P, self.device)
        self.copier = RowCopier(om.store.rows, om.pool.buffer)
        self.weights = self._weight_views(om.pool.buffer)
        """Named weight stacks [R, ...] over every pool row (views of the pool buffer, slot = row)."""
        self.layer_ids = [torch.tensor(i, dtype=torch.long, device=self.device) for i in range(self.L)]
        self.arange = torch.arange(max(self.scratch, 1), device=self.device)
        self.layer_range = torch.arange(self.L, device=self.device)
        self.planner = ForecastPlanner(om.policy, self.L, self.E, self.P, blocking) if kind == "seqmoe" else None
        self.routing_ids = torch.zeros((self.L, MAX_BATCH, self.K), dtype=torch.long, device=self.device)
        self.routing_w = torch.zeros((self.L, MAX_BATCH, self.K), dtype=torch.float32, device=self.device)
        self.template = om.refs[0].module
        """Gate and activation of every layer's experts (the same config): one function serves all layers."""
        self.layer_fn = self._layer
        """The per-layer decode function ``(layer, h, idx, w) -> y`` (``torch.compile(decoder._layer,
        fullgraph=True)`` compiles it once for every layer: the layer is a device tensor)."""
        self.active = False
        self._step: tuple[int, list[int], list[int]] | None = None
        """(t, members, positions) of the running decode step (its routing goes to the planner next)."""

    def _weight_views(self, pool_buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named weight stacks [R, ...] of the pool buffer [R, row_numel] (views)."""
        return {p.name: pool_buffer[:, p.offset:p.offset + p.numel].view(-1, *p.shape) for p in self.om.layout.parts}

    def compile(self, backend: str) -> None:
        """Compile the per-layer function (``layer_fn``). ``backend``: ``"none"`` (eager tensor ops),
        ``"aot_eager"`` / ``"inductor"`` (``torch.compile(fullgraph=True)``: dynamo guards and the compiled
        wrapper run in Python at every call) or ``"aoti"`` (CPU: :class:`AOTLayer`, compiled ahead of time by
        AOTInductor for each batch size met, called without guards through its C++ runner)."""
        if backend not in COMPILE_BACKENDS:
            raise UsageError(f"compile backend must be one of {COMPILE_BACKENDS}, got {backend!r}")
        if backend == "none":
            self.layer_fn = self._layer
        elif backend == "aoti":
            self.layer_fn = AOTLayer(self)
        else:
            self.layer_fn = torch.compile(self._layer, fullgraph=True, backend=backend)

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
            self.planner.begin(self.om.policy)
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
    def _layer(self, layer: torch.Tensor, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
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
        c = torch.stack([first.sum(), hit.sum(), miss.sum(), (miss & ~load).sum()])
        self._count(layer, ACC, c)
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
        if self.kind == "lru":
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
        first, valid = _first_in_order(k1, None if self.kind == "lru" else k2, m)
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
        if self.kind == "lru":  # one tick per access: hits first, then misses, in selection order
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
        c = torch.stack([admit.sum(), (want & ~got).sum()])
        self._count(layer, PRO, c)

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
        """Host cache and policy state -> device tables (once per call, after the prefill)."""
        om, st, E = self.om, self.state, self.E
        cache, pol = om.cache, om.policy
        occ = cache.slot_layer >= 0
        keys = np.where(occ, cache.slot_layer.astype(np.int64) * E + cache.slot_expert, -1)
        st.slot_key[:self.N].copy_(torch.as_tensor(keys))
        table = np.append(cache.slot_of.reshape(-1).astype(np.int64), -1)
        st.table.copy_(torch.as_tensor(table))
        if self.kind == "lru":
            st.recency[:-1].copy_(torch.as_tensor(pol.k1))
            st.clock.fill_(float(pol.clock))
        else:
            st.recency[:-1].copy_(torch.as_tensor(pol.last_use.reshape(-1)))
            self._publish(_Published(-1, pol.score_before, pol.score_after, pol.first_exec,
                                     np.full(tuple(st.plan.shape), -1, np.int64)))

    def _store_to_host(self) -> None:
        """Device tables -> host cache, policy keys, transport holdings and decode counters."""
        om, st, E = self.om, self.state, self.E
        cache, pol = om.cache, om.policy
        keys = st.slot_key[:self.N].cpu().numpy()
        _rebuild_cache(cache, keys, E)
        om.transport.set_holdings([(int(k) // E, int(k) % E) if k >= 0 else (-1, -1) for k in keys])
        rec = st.recency[:-1].cpu().numpy()
        if self.kind == "lru":
            pol.k1[:] = rec
            pol.k2[:] = 0.0
            pol.clock = float(st.clock.item())
        else:
            pol.last_use = rec.reshape(self.L, self.E).copy()
        cnt = st.counters.cpu().numpy()
        for i, name in enumerate(COUNTERS):
            getattr(om.stats, name)[:] += cnt[i]
        st.counters.zero_()

    def _publish(self, pub: _Published | None) -> None:
        """Copy the planner's latest result into the device tables (host, between steps)."""
        if pub is None:
            return
        st, nb = self.state, self.device.type == "cuda"
        st.before[:-1].copy_(torch.as_tensor(np.asarray(pub.before, np.float32).reshape(-1)), non_blocking=nb)
        st.after[:-1].copy_(torch.as_tensor(np.asarray(pub.after, np.float32).reshape(-1)), non_blocking=nb)
        st.first_exec.copy_(torch.as_tensor(np.asarray(pub.first_exec, np.int64)), non_blocking=nb)
        st.plan.copy_(torch.as_tensor(pub.plan), non_blocking=nb)
        pol = self.om.policy
        pol.score_before, pol.score_after = np.asarray(pub.before), np.asarray(pub.after)
        pol.first_exec = np.asarray(pub.first_exec, np.int64)
        pol.has_forecast = pub.t >= 0 or pol.has_forecast


def _pool_slots(slot_pool: np.ndarray, N: int) -> np.ndarray:
    """int64 [pools, S]: the slots of each pool id (``slot_pool`` [N]: pool of each slot), ascending, padded with
    N; S is the largest pool."""
    slot_pool = np.asarray(slot_pool, np.int64)
    pools = int(slot_pool.max()) + 1 if slot_pool.size else 1
    members = [np.flatnonzero(slot_pool == p) for p in range(pools)]
    out = np.full((pools, max(1, *(len(m) for m in members))), N, np.int64)
    for p, m in enumerate(members):
        out[p, :len(m)] = m
    return out


def _first_in_order(k1: torch.Tensor, k2: torch.Tensor | None, m: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def _combine(per_member: list[np.ndarray]) -> np.ndarray:
    """P(active for any member) = 1 - prod_b (1 - P_b) of per-member [H, L, E] probabilities."""
    miss = np.ones_like(per_member[0])
    for pm in per_member:
        miss *= 1.0 - np.clip(pm, 0.0, 1.0)
    return 1.0 - miss


def _record_event(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


# ---------------------------------------------------------------------------------------------- the planner
@dataclass
class _Published:
    """One result of the planner: forecast after step ``t`` (scores [L, E], first executions [L], plan [L, P])."""

    t: int
    before: np.ndarray
    after: np.ndarray
    first_exec: np.ndarray
    plan: np.ndarray


class ForecastPlanner:
    """SeqMoE's forecaster on a host thread: consumes each decode step's routing, publishes scores and a plan.

    The forecaster state continues from the policy's (which consumed the prompt during the prefill replay);
    the element of step t is the policy's (layers <= p of step t, layers > p of step t-1), so the forecasts
    equal the online policy's. They are issued at the step boundary after step t instead of after layer p.
    """

    def __init__(self, policy: Any, L: int, E: int, P: int, blocking: bool):
        self.policy, self.L, self.E, self.P = policy, L, E, P
        self.blocking = blocking
        self.jobs: queue.Queue = queue.Queue()
        self._latest: _Published | None = None
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.stats = {"forecasts": 0, "published": 0}
        self.thread = threading.Thread(target=self._run, name="expertcast-graph-planner", daemon=True)
        self.thread.start()

    def begin(self, policy: Any) -> None:
        self.policy = policy
        with self._lock:
            self._latest = None

    def submit(self, t: int, members: list[int], positions: list[int], ids: torch.Tensor, w: torch.Tensor,
               event: Any) -> None:
        """Routing of step ``t``: ids / w [L, n, K] of the active ``members`` at ``positions`` (copies in flight
        until ``event``)."""
        self.jobs.put((t, members, positions, ids, w, event))
        if self.blocking:
            self.drain()

    def drain(self) -> None:
        """Wait until every submitted step was forecast."""
        self.jobs.join()
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"graph planner failed: {err}") from err

    def take(self) -> _Published | None:
        """The newest result not taken yet (None when there is none)."""
        with self._lock:
            pub, self._latest = self._latest, None
        return pub

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)

    def _run(self) -> None:
        torch.set_num_threads(1)
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                pub = self._plan(*job)
                if pub is not None:
                    with self._lock:
                        self._latest = pub
                    self.stats["published"] += 1
            except BaseException as e:  # surfaced to the decoding thread in drain()
                self.error = e
            finally:
                self.jobs.task_done()

    @torch.no_grad()
    def _plan(self, t: int, members: list[int], positions: list[int], ids: torch.Tensor, w: torch.Tensor,
              event: Any) -> _Published | None:
        if event is not None:
            event.synchronize()
        pol, L, E = self.policy, self.L, self.E
        p = pol.p
        ids_np = ids.numpy().transpose(1, 0, 2)  # [n, L, K]
        w_np = w.numpy().astype(np.float16).astype(np.float32).transpose(1, 0, 2)  # rounded as traces record
        act = np.zeros((len(members), L, E), np.float32)
        for r in range(len(members)):
            for layer in range(L):
                np.add.at(act[r, layer], ids_np[r, layer], w_np[r, layer])
        act /= np.maximum(act.sum(-1, keepdims=True), 1e-9)
        if pol._traced and pol.precompute:  # forecasts precomputed from the recorded routing (replay)
            F = self._from_tables(members, positions)
        else:
            lat = pol._latest
            lat[members, :p + 1] = act[:, :p + 1]
            F = self._forecast([b for b, pos in zip(members, positions, strict=True) if pos - pol.s >= 0])
            lat[members, p + 1:] = act[:, p + 1:]
        if F is None:
            return None
        self.stats["forecasts"] += 1
        H = F.shape[0]
        d = pol.disc[:H]
        before = np.einsum("h,hle->le", d, F)
        after = np.einsum("h,hle->le", d[:H - 1], F[1:]) if H > 1 else np.zeros_like(F[0])
        layers = np.arange(L)
        first_exec = np.where(layers > p, t * L + layers, (t + 1) * L + layers)
        nxt = F[0].copy()
        if H > 1:
            nxt[p + 1:] = F[1][p + 1:]  # layers > p already ran in step t: their next execution is element 2
        return _Published(t, before, after, first_exec, self._tasks(nxt, pol.min_confidence))

    def _forecast(self, rows: list[int]) -> np.ndarray | None:
        """[H, L, E] combined probabilities of the next elements of members ``rows`` (the policy's online forecast)."""
        pol = self.policy
        if not rows:
            return None
        sub = pol._state.select(rows)
        x = torch.from_numpy(pol._latest[rows]).to(pol.device)
        logits, _ = pol.model.step(x, sub, all_horizons=True)
        roll = pol.model.rollout(logits, sub, pol.horizon)
        pol._state.put_rows(rows, sub)
        probs = pol.model.probs(roll).cpu().numpy().astype(np.float16).astype(np.float32)
        return _combine(list(probs))

    def _from_tables(self, members: list[int], positions: list[int]) -> np.ndarray | None:
        """The policy's precomputed forecasts of the members at ``positions`` (replay of recorded routing)."""
        pol = self.policy
        per = []
        for b, pos in zip(members, positions, strict=True):
            tab, el = pol._row_tables[b], pos - pol.s
            if tab is not None and 0 <= el < len(tab):
                per.append(tab[el].astype(np.float32))
        return _combine(per) if per else None

    def _tasks(self, probs: np.ndarray, min_conf: float) -> np.ndarray:
        """int64 [L, P] keys of the most likely experts of each layer's next execution (-1: none)."""
        if self.P == 0:  # no prefetch: the plan stays empty
            return np.full((self.L, 1), -1, np.int64)
        top = np.argsort(-probs, axis=1, kind="stable")[:, :self.P]
        conf = np.take_along_axis(probs, top, axis=1)
        keys = np.arange(self.L)[:, None] * self.E + top
        return np.where((conf >= min_conf) & (conf > 0), keys, -1).astype(np.int64)
