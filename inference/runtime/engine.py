"""OffloadedModel: run a transformers-5 MoE model with its routed experts offloaded to the host.

Build one from a model, a policy and a capacity; the model's fused expert weights move into a host
store (:mod:`.store`), the device keeps a fixed slot pool (:mod:`.slots`) bound to the shared
:class:`~expertcast.inference.cache.expert_cache.ExpertCache` slot table, transfers run on a side stream or a
transfer thread (:mod:`.transfer`, driven through :mod:`.residency`), and every experts module
dispatches to the offloaded implementation (:mod:`.experts`).

The policy is driven by :class:`expertcast.inference.cache.driver.Driver`, the same driver the simulator
uses (hook order in its module docstring), with the runtime's real transfers as its transport. So on
the routing recorded from a run (and the landings of its prefetches, ``record=True``) the simulator
reproduces the runtime's counters and resident set. Runtime specifics:

* steps are global across calls until :meth:`OffloadedModel.reset`; each batch has one prefill step
  per prompt position of the lockstep schedule, then one decode step per generated token that is
  fed back (:mod:`.run_state` keeps the book);
* the prompt itself is computed in one forward pass (experts served from resident slots, the rest
  streamed through temporary slots, uncounted); its routing is then replayed step by step through
  the driver (uncounted, no copies) and the resulting cache state is materialized with real copies
  before the first decode step;
* a decode layer is served by the driver (``serve``), computed (waiting for demand loads and late
  prefetches right before each expert's kernel), then closed by the driver (``finish``).

Sequences that already finished (EOS) are excluded from routing and expert compute, as they are from
the simulator's replay. Forced-routing replay (:meth:`OffloadedModel.replay`) substitutes recorded
routing for the model's own, so random-weight models of a real shape run under real routing patterns.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import expertcast.inference.runtime.experts as experts
import expertcast.inference.runtime.graph as graph
import numpy as np
import torch
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache.driver import CPU, SLOT, TEMP, Driver
from expertcast.inference.cache.expert_cache import Budget, CacheConfig, ExpertCache
from expertcast.inference.cache.policy import Policy, check_policy_compatible
from expertcast.inference.policies import spec_of
from expertcast.inference.runtime.disk_store import PREFETCH_CHUNK_KB, READERS
from expertcast.inference.runtime.residency import RuntimeTransport
from expertcast.inference.runtime.run_state import (
    GenerationResult,
    LivePrompt,
    Phase,
    RunState,
    check_replayable,
    left_padded_prompts,
)
from expertcast.inference.runtime.slots import SlotPool
from expertcast.inference.runtime.stats import MemoryReport, RuntimeStats, forecaster_counters
from expertcast.inference.runtime.store import (
    HostExpertStore,
    MoELayerRef,
    find_experts_modules,
    layout_of,
    release_model_experts,
)
from expertcast.inference.runtime.transfer import TransferEngine, make_transfer_engine
from expertcast.models.backbone import standard_lm_head_input
from expertcast.utils.errors import UsageError
from torch import nn

__all__ = ["OffloadedModel", "RuntimeStats", "MemoryReport", "GenerationResult", "LivePrompt",
           "check_policy_compatible"]


class OffloadedModel:
    """A MoE causal LM whose routed experts live on the host and are cached in device slots.

    Args:
        model: a transformers-5 MoE causal LM (fused experts). Its expert weights are moved into the
            host store and released from the modules (``restore()`` puts them back).
        policy: a :class:`~expertcast.inference.cache.policy.Policy` (e.g. ``make_policy("lru")``).
        capacity: the resident experts, a :class:`~expertcast.inference.cache.expert_cache.Budget` (or its
            number form, :meth:`Budget.parse`: a float is a fraction of all L*E experts, an int slots).
        pool: ``"per-layer"`` or ``"shared"``.
        device: compute device (default: the model's).
        link_gbps: CPU only: emulated host-device bandwidth for the transfer thread (None = memory speed).
        mmap_path: keep the host store in this safetensors file, memory-mapped.
        num_temp_slots: temporary slots (TEMP loads, prefill streaming, selections larger than a pool).
        future: oracles only: the access stream (``simulator.build_stream``) of the run to come.
        store: reuse the host store of an earlier OffloadedModel of this model (benchmarks: the model's
            experts were released by it and are not packed again).
        cpu_exec_ms: CPU-device emulation only: ``n_tokens -> ms`` (e.g. ``LatencyModel.cpu_ms``), the time
            an in-situ CPU execution of a cold expert takes at least. On a CPU-only machine the "device"
            and the host are the same processor, so without it CPU execution would cost no more than a
            resident expert; the link emulation (``link_gbps``) has the same max(real, modelled) rule.
        cpu_parallel: CPU-executed experts (SAEM) run on a host thread in parallel with the device's work
            on the layer's other experts (False: one after another inside the layer, the serial reference).
        measure_latency: time this machine's CPU expert execution and expert transfer at start-up
            (:meth:`measure_latency`) and give the measured :class:`~expertcast.inference.saem.cpu_exec.LatencyModel`
            to a policy that decides CPU vs transfer (``use_latency``); the figures are in
            :attr:`latency_measurement`.
        decode_path: ``"eager"`` (the reference), ``"graph"`` (the graph-compatible path of
            :mod:`.graph`; lru and seqmoe) or ``"auto"`` (graph where it can run); which path runs and
            why is in :attr:`decode_path` / :attr:`decode_path_reason` (printed unless ``"eager"`` was asked).
        readers, prefetch_chunk_kb: a disk store's reader pool (:class:`~.disk_store.ReaderPoolEngine`): its
            threads, and the KiB blocks in which prefetch reads yield the disk to demand reads (0: whole reads).
    """

    def __init__(self, model: nn.Module, policy: Policy, capacity: Budget | float | int, *, pool: str = "per-layer",
                 device: torch.device | str | None = None, link_gbps: float | None = None,
                 mmap_path: str | None = None, num_temp_slots: int = 2, future: Any = None,
                 store: HostExpertStore | None = None, cpu_exec_ms: Any = None, cpu_parallel: bool = True,
                 measure_latency: bool = False, decode_path: str = "eager", readers: int = READERS,
                 prefetch_chunk_kb: int = PREFETCH_CHUNK_KB):
        from expertcast.inference.runtime.disk_store import ReaderPoolEngine, is_disk_store

        self.model = standard_lm_head_input(model)  # no transient copy of the LM head per prefill
        self.refs: list[MoELayerRef] = find_experts_modules(model)  # unsupported architecture -> error
        mod0 = self.refs[0].module
        self.L = len(self.refs)
        self.E = int(mod0.num_experts)
        self.K = int(_top_k_of(model))
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        layout = store.layout if store is not None else layout_of(mod0)
        self.cache_config = CacheConfig(num_layers=self.L, num_experts=self.E, top_k=self.K, pool=pool,
                                        budget=Budget.parse(capacity),
                                        expert_bytes=layout.expert_bytes)  # capacity below top-K -> error
        what = f"model {getattr(model.config, '_name_or_path', '') or type(model).__name__}"
        check_policy_compatible(policy, self.L, self.E, self.K, what)  # exports for another model -> error
        self.policy = policy
        spec = spec_of(policy)
        if "future" in spec.needs and future is None:
            raise ValueError(f"policy {policy.name!r} is an oracle: pass future=build_stream(...) of the run (the "
                             "recorded routing), or use OffloadedModel.replay() on recorded traces")
        if not spec.runs_on("driver"):
            raise ValueError(f"policy {policy.name!r} runs only on the simulator's compiled engine, not in the runtime")
        self._future = future
        Driver.check_run(policy, self.cache_config, future)  # mismatches surface before the model is touched

        if store is None:
            store = HostExpertStore.from_model(model, pin_memory=self.device.type == "cuda", mmap_path=mmap_path,
                                               refs=self.refs)
        elif (store.num_layers, store.num_experts) != (self.L, self.E):
            raise ValueError(f"the given host store holds L={store.num_layers}, E={store.num_experts} experts but the "
                             f"model has L={self.L}, E={self.E}")
        self.store = store
        self.layout = self.store.layout
        disk = is_disk_store(store)
        if disk and link_gbps is not None:
            raise UsageError("link_gbps emulates a link; the disk store's reads are real (drop --link-gbps)")
        if disk and decode_path == "graph":
            raise UsageError("decode path 'graph' cannot run: its miss copies read host rows, the disk store has none")
        if self.layout.quantized and decode_path == "graph":
            raise UsageError(f"decode path 'graph' cannot run {self.layout.fmt} experts (its grouped GEMM reads bf16 slots)")
        release_model_experts(self.refs, self.layout)
        model.to(self.device)
        self.cache = ExpertCache(self.cache_config)
        self.decode_path, self.decode_path_reason = graph.choose_decode_path("eager" if disk or self.layout.quantized else decode_path, policy, self.device, link_gbps,
                                                                          self.store.is_pinned,
                                                                          modules=[r.module for r in self.refs],
                                                                          announce=True)
        if self.decode_path == "graph":
            plan_width = graph.device_program_of(policy).plan_width
            num_temp_slots = max(num_temp_slots, graph.GraphDecoder.scratch_rows(self.K, plan_width))
        if disk:  # a layer's temporary-slot reads (static's misses) fill the reader pool (docs/design.md, "Compute order")
            num_temp_slots = max(num_temp_slots, int(readers))
        self.pool = SlotPool(self.layout, self.cache.num_slots, self.device, num_temp=num_temp_slots,
                             io_stride_bytes=store.stride if disk else None)
        self.readers = int(readers) if disk else None
        self.transfer: TransferEngine = (ReaderPoolEngine(store, readers, self.device, prefetch_chunk_kb) if disk
                                         else make_transfer_engine(self.device, link_gbps))
        self.transport = RuntimeTransport(self.store, self.pool, self.transfer)
        self.stats = RuntimeStats(self.L, self.layout.expert_bytes)
        self.driver = Driver(policy, self.cache, self.transport, self.stats)
        self.workspace = experts.Workspace(self.device, self.layout.act_dtype)
        self.graph = graph.GraphDecoder(self) if self.decode_path == "graph" else None
        self.cpu_exec_ms = cpu_exec_ms
        self.cpu_parallel = bool(cpu_parallel)
        self._cpu_pool: ThreadPoolExecutor | None = None
        self.latency_measurement: dict[str, Any] | None = None
        for i, r in enumerate(self.refs):
            setattr(r.module, experts.RUNTIME_ATTR, self)
            setattr(r.module, experts.LAYER_ATTR, i)
        self._impl_before = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else None
        model.set_experts_implementation(experts.register())
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        self._run: RunState | None = None
        """D + late at the start of the current counted decode step (miss-free step count)."""
        self._io_busy0 = 0.0
        """The transfer engine's busy seconds when the call's decode began."""
        if measure_latency:
            self.use_measured_latency()
        self.reset()

    # ------------------------------------------------------------------------------------------ setup
    def reset(self) -> None:
        """Empty the cache, reset the policy (and its warm start) and the counters."""
        self.transport.reset()
        self.driver.reset(self._future)
        self.transport.materialize(self.cache)
        self.stats = RuntimeStats(self.L, self.layout.expert_bytes)
        self.driver.counters = self.stats
        self.transport.counters = self.stats
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def set_future(self, future: Any) -> None:
        """Give an oracle policy the access stream of the coming run (then :meth:`reset`)."""
        self._future = future
        self.driver.set_future(future)

    def close(self) -> None:
        """Stop the transfer thread and detach from the model (the expert weights stay released)."""
        self.transfer.synchronize()
        self.transfer.close()
        if self.graph is not None:
            self.graph.close()
        if self._cpu_pool is not None:
            self._cpu_pool.shutdown(wait=True)
            self._cpu_pool = None
        self._hook.remove()
        for r in self.refs:  # unbind: a closed runtime (its slots, its store buffers) must not live on in the model
            if getattr(r.module, experts.RUNTIME_ATTR, None) is self:
                setattr(r.module, experts.RUNTIME_ATTR, None)

    def restore(self) -> nn.Module:
        """Give the model its fused expert weights back (full load) and detach the runtime."""
        self.close()
        self.store.restore_into(self.refs)
        for r in self.refs:
            for a in (experts.RUNTIME_ATTR, experts.LAYER_ATTR):
                if hasattr(r.module, a):
                    delattr(r.module, a)
            for p in (self.layout.base or self.layout).parts:
                getattr(r.module, p.name).data = getattr(r.module, p.name).data.to(self.device)
        prev = (self._impl_before or {}).get("", None)
        prev = "grouped_mm" if prev in (None, experts.IMPLEMENTATION_NAME) else prev
        self.model.set_experts_implementation(prev)
        return self.model

    # ------------------------------------------------------------------------------------------ memory
    def memory_report(self) -> MemoryReport:
        """Bytes held on the host and the device (see :class:`MemoryReport`)."""
        return MemoryReport.measure(self)

    # ------------------------------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 32, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, record: bool = False, seq_ids: Sequence[str] | None = None,
                 **generate_kwargs: Any) -> GenerationResult:
        """Greedy generation of a left-padded batch ``input_ids`` [B, P] under offloading.

        Returns the sequences [B, P + new] and, with ``record=True``, the routing of every processed
        position per sequence as :class:`TraceSequence` (for the simulator and for replay) and the
        landings of the prefetches (``GenerationResult.landings``).
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        prompts = left_padded_prompts(input_ids, attention_mask)  # bad shapes or padding -> error
        B = len(prompts)
        gc = self.model.generation_config
        eos = eos_token_id if eos_token_id is not None else gc.eos_token_id
        eos_set = set([eos] if isinstance(eos, int) else (eos or []))
        sid = list(seq_ids) if seq_ids is not None else [f"seq{i}" for i in range(B)]
        rs = self._begin_call(RunState(prompts, sid, eos_set, record, self.device, self.L, self.K), None, record)
        t0 = time.perf_counter()
        try:
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                pad_token_id=pad_token_id if pad_token_id is not None else (gc.pad_token_id if gc.pad_token_id is not None
                                                                             else next(iter(eos_set), 0)),
                **generate_kwargs)
            self._end_call(rs)
        finally:
            self._run = None
        total = time.perf_counter() - t0
        self.stats.decode_seconds += max(total - rs.ttft - rs.warmup, 0.0)
        self.stats.prefill_seconds += rs.ttft
        self.stats.ttft_seconds.append(rs.ttft)
        self.stats.prefill_tokens += sum(len(p) for p in prompts)
        seqs = out.sequences if hasattr(out, "sequences") else out  # return_dict_in_generate=True
        landings = list(self.driver.landings) if record else None
        return GenerationResult(seqs, rs.traces() if record else None, rs.ttft, total, landings)

    # ------------------------------------------------------------------------------------------ replay
    @torch.no_grad()
    def replay(self, sequences: Sequence[TraceSequence], meta: TraceMeta | None = None,
               max_decode: int | None = None) -> RuntimeStats:
        """Forced-routing replay: run each recorded sequence (batch 1) with its recorded tokens and routing
        substituted for the model's, prefill then decode with the KV cache, under the runtime's
        policy and transfers. Returns the stats of this call (decode steps only)."""
        if meta is not None:
            meta.check_compatible(self.L, self.E, self.K, what="offloaded model")
        for s in sequences:
            check_replayable(s, self.L, self.E, self.K)
        vocab = self.model.get_input_embeddings().num_embeddings
        cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        before = self.stats.snapshot()
        for s in sequences:
            T = s.num_tokens if max_decode is None else min(s.num_tokens, s.prompt_len + max_decode)
            if T < s.num_tokens:
                s = TraceSequence(s.seq_id, s.token_ids[:T], s.prompt_len, s.expert_ids[:T], s.expert_weights[:T],
                                  None if s.router_probs is None else s.router_probs[:T])
            tok = np.asarray(s.token_ids[:T], dtype=np.int64) % vocab
            forced = (np.asarray(s.expert_ids[:T], np.int64), np.asarray(s.expert_weights[:T], np.float32))
            rs = RunState([tok[:s.prompt_len].astype(np.int32)], [s.seq_id], set(), False, self.device, self.L, self.K,
                          forced=forced)
            self._begin_call(rs, [s], False)
            t0 = time.perf_counter()
            try:
                ids = torch.as_tensor(tok[None, :s.prompt_len], device=self.device)
                out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
                out.logits[:, -1].argmax(-1).cpu()
                t1 = time.perf_counter()
                for pos in range(s.prompt_len, T):
                    ids = torch.as_tensor(tok[None, pos:pos + 1], device=self.device)
                    out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: _cache_of(out)})
                    out.logits[:, -1].argmax(-1).cpu()  # the step's token is consumed (host sync, as generation does)
                self._end_call(rs)
            finally:
                self._run = None
            t2 = time.perf_counter()
            self.stats.prefill_seconds += t1 - t0
            self.stats.ttft_seconds.append(t1 - t0)
            self.stats.decode_seconds += t2 - t1 - rs.warmup
            self.stats.prefill_tokens += s.prompt_len
        return self.stats.since(before)

    # ------------------------------------------------------------------------------------------ calls and steps
    def _begin_call(self, rs: RunState, members: list | None, record_landings: bool) -> RunState:
        """A generate()/replay() call starts: its batch opens in the driver (``members``: the recorded
        sequences of a replay, else the live prompts)."""
        self.driver.record_landings = record_landings
        self.driver.landings = []
        rs.forecaster_call0 = forecaster_counters(self.policy)  # a replay's tables are computed as its batch opens
        self.driver.begin_batch(members if members is not None else rs.members(), rs.schedule)
        self._run = rs
        return rs

    def _busy_now(self) -> float:
        busy = getattr(self.transfer, "busy_seconds", None)
        return busy() if busy is not None else 0.0

    def _end_call(self, rs: RunState) -> None:
        """The call ends: close the prefill if no decode step ran, else log the last step."""
        if rs.prefill_done:
            self.stats.read_busy_seconds += self._busy_now() - self._io_busy0
        if not rs.prefill_done:
            rs.close_prefill(no_decode=True)
            self._replay_prefill(rs)
        else:
            rs.flush_decode_log()
            if self.graph is not None and self.graph.active:
                self.graph.end_decode()
            self.stats.add_forecaster_cost(forecaster_counters(self.policy), getattr(rs, "forecaster0", None),
                                           getattr(rs, "forecaster_call0", None))

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        rs = self._run
        if rs is None:
            raise RuntimeError("the offloaded model runs through OffloadedModel.generate() or .replay(), not by "
                               "calling the wrapped model directly")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("the offloaded runtime needs input_ids (inputs_embeds are not supported)")
        phase = rs.begin_forward(ids)
        if phase is Phase.PREFILL:
            return
        if phase is Phase.FIRST_DECODE:
            rs.close_prefill()
            self._replay_prefill(rs)
            if self.graph is not None:
                self.graph.begin_decode(rs.B)
        else:  # the previous decode step ends with the tokens this forward feeds
            self.driver.end_step(rs.fed_tokens(self.driver.info))
            rs.flush_decode_log()
        info = self.driver.begin_step()
        rs.start_step(info)
        if self.graph is not None and self.graph.active:
            self.graph.begin_step(info.t, rs.active, [int(info.positions[i]) for i in rs.active])
        self.stats.decode_steps += 1
        self.stats.decoded_tokens += len(rs.active)

    def _replay_prefill(self, rs: RunState) -> None:
        """Replay the prompt routing through the driver step by step (uncounted, no copies), as the
        simulator's warm-up, then copy the resulting resident set into the slots."""
        t0 = time.perf_counter()
        self.transport.physical = False
        try:
            for _ in range(rs.schedule.prefill_steps):
                info = self.driver.begin_step()
                for layer in range(self.L):
                    ids, w = rs.prefill_routing(layer, info.positions)
                    sel, cnt = _selection_np(ids[info.active])
                    self.driver.run_layer(layer, sel, cnt, (ids, w) if self.driver.wants_routing else None)
                self.driver.end_step(rs.fed_tokens(info))
        finally:
            self.transport.physical = True
        self.transport.materialize(self.cache)
        self._io_busy0 = self._busy_now()
        rs.warmup = time.perf_counter() - t0
        self.stats.warmup_seconds += rs.warmup
        rs.forecaster0 = forecaster_counters(self.policy)  # decode's forecaster cost counts from here

    # ------------------------------------------------------------------------------------------ layers
    def forward_layer(self, module: nn.Module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
        """Called by the experts implementation: route, serve residency, compute. hidden [N, H]."""
        rs = self._run
        if rs is None:
            raise RuntimeError("the offloaded model runs through OffloadedModel.generate() or .replay()")
        rows = rs.active_rows  # LongTensor of token rows to process (None = all)
        if rs.forced is not None:
            top_k_index, top_k_weights = rs.forced_routing(layer, hidden)
        if rows is not None:
            out = torch.zeros_like(hidden)
            if rows.numel() == 0:
                return out
            h, idx, w = hidden[rows], top_k_index[rows], top_k_weights[rows]
        else:
            h, idx, w = hidden, top_k_index, top_k_weights
        if rs.record or rs.prefill:
            rs.log_routing(layer, idx, w)  # prefill: replayed through the policy before decoding
        y = self._prefill_layer(module, layer, h, idx, w) if rs.prefill else self._decode_layer(module, layer, h, idx, w)
        if rows is None:
            return y
        out[rows] = y
        return out

    def _decode_layer(self, module, layer, h, idx, w) -> torch.Tensor:
        if self.graph is not None and self.graph.active:
            return self.graph.decode_layer(module, layer, h, idx, w)
        rs = self._run
        grouping = experts.Grouping(idx, self.E)
        sel, cnt = grouping.selected, grouping.selected_counts
        routing = rs.member_routing(idx, w) if self.driver.wants_routing else None  # per member (forecaster input)
        self.transport.count_reads = self.driver.counted  # every counted load is one counted read
        try:
            d0 = int(self.stats.demand[layer])
            plan = self.driver.serve(layer, sel, cnt, routing)
            if self.driver.counted:
                self.stats.layer_execs.append((layer, len(sel), int(self.stats.demand[layer]) - d0))
            y = self._compute(module, layer, h, idx, w, grouping, plan, count_stall=True)
            self.driver.finish(layer, sel, cnt)
        finally:
            self.transport.count_reads = False
        return y

    def _prefill_layer(self, module, layer, h, idx, w) -> torch.Tensor:
        """Prompt compute: resident slots where the bytes are there, the rest streamed (uncounted)."""
        grouping = experts.Grouping(idx, self.E)
        plan = {}
        for e in grouping.active:
            s = self.cache.slot(layer, e)
            plan[e] = (SLOT, s) if self.transport.holds(s, layer, e) else (TEMP,)
        return self._compute(module, layer, h, idx, w, grouping, plan, count_stall=False)

    def _compute(self, module, layer, h, idx, w, grouping, plan, count_stall: bool) -> torch.Tensor:
        """The layer's expert compute in landing order (docs/design.md, "Compute order"): every expert whose
        bytes are there first, then the others as their reads land; it blocks only when nothing is ready."""
        tp, pool = self.transport, self.pool
        temps = [e for e in grouping.active if plan[e][0] == TEMP]
        temp_slot: dict[int, int] = {}
        free_temps = list(range(pool.num_slots, pool.num_slots + pool.num_temp))
        nxt = 0
        stall = 0.0
        cpu_start = 0.0

        def feed() -> None:  # keep up to num_temp temporary reads in flight (all of them are demand reads)
            nonlocal nxt
            while nxt < len(temps) and free_temps:
                e = temps[nxt]
                s = free_temps.pop(0)  # a temporary slot whose expert was computed (compute order != read order)
                tp.submit(s, layer, e, demand=True)
                temp_slot[e] = s
                nxt += 1

        def slot_of(e: int) -> int | None:
            kind = plan[e][0]
            return plan[e][1] if kind == SLOT else temp_slot.get(e) if kind == TEMP else None

        def next_expert(todo: list[int]) -> int:
            nonlocal stall
            while True:
                best, best_at = None, None
                for e in todo:
                    s = slot_of(e)
                    if s is None and plan[e][0] == TEMP:
                        continue  # its read is not submitted yet (no temporary slot free)
                    at = float("-inf") if s is None else tp.landed_at(s)
                    if at is not None and (best_at is None or at < best_at):
                        best, best_at = e, at
                if best is not None:
                    return best
                stall += tp.wait_any([s for s in map(slot_of, todo) if s is not None])

        def before(e: int) -> None:
            nonlocal stall, cpu_start
            kind = plan[e][0]
            if kind == SLOT:
                stall += tp.wait_slot(plan[e][1])
            elif kind == TEMP:
                stall += tp.wait_slot(temp_slot[e])
            else:
                cpu_start = time.perf_counter()

        def after(e: int) -> None:
            nonlocal stall
            if plan[e][0] == CPU and self.cpu_exec_ms is not None and self.device.type == "cpu":
                # emulation: the host CPU is slower than the device it stands in for
                left = self.cpu_exec_ms(grouping.counts[e]) * 1e-3 - (time.perf_counter() - cpu_start)
                if left > 0:
                    time.sleep(left)
                    stall += left
            if plan[e][0] == TEMP:
                tp.mark_compute()  # the temporary slot may be overwritten after this kernel
                free_temps.append(temp_slot.pop(e))
                feed()

        def weights_of(e: int):
            return pool.views(plan[e][1] if plan[e][0] == SLOT else temp_slot[e])

        feed()
        cpu = {e for e in grouping.active if plan[e][0] == CPU}
        waited = [0.0]
        y = experts.grouped_expert_compute(module, h, idx, w, weights_of, self.workspace, grouping=grouping,
                                     cpu_weights_of=lambda e: self.store.views(layer, e), cpu_experts=cpu,
                                     before_expert=before, after_expert=after,
                                     cpu_async=self._cpu_submitter(module, layer, waited) if cpu and self.cpu_parallel
                                     else None, next_expert=next_expert)
        tp.mark_compute()
        if count_stall:
            self.stats.stall_seconds += stall + waited[0]
        return y

    # ------------------------------------------------------------------------------------------ CPU execution
    def _cpu_submitter(self, module: nn.Module, layer: int, waited: list[float]):
        """``cpu_async`` of :func:`~.experts.grouped_expert_compute`: each CPU expert of the layer runs on the
        host thread while the device computes the others; the time the layer then waits for the host
        thread's results is added to ``waited[0]`` (stall)."""
        if self._cpu_pool is None:  # the host thread uses torch's intra-op thread count of the caller (OpenMP's
            # setting is per thread: without this the worker would spawn its own default-sized team)
            self._cpu_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertcast-cpu-exec",
                                                initializer=torch.set_num_threads,
                                                initargs=(torch.get_num_threads(),))

        def submit(e: int, xc: torch.Tensor):
            fut = self._cpu_pool.submit(self._cpu_expert, module, layer, e, xc)

            def result() -> torch.Tensor:
                t0 = time.perf_counter()
                out = fut.result()
                waited[0] += time.perf_counter() - t0
                return out
            return result
        return submit

    @torch.no_grad()
    def _cpu_expert(self, module: nn.Module, layer: int, e: int, xc: torch.Tensor) -> torch.Tensor:
        """One expert on its host copy: rows ``xc`` [n, H] (CPU) -> [n, H]. On a CPU "device" with
        ``cpu_exec_ms`` it takes at least the emulated time (the host stands in for a slower CPU)."""
        t0 = time.perf_counter()
        out = experts.expert_forward(module, xc, self.store.views(layer, e))
        if self.cpu_exec_ms is not None and self.device.type == "cpu":
            left = self.cpu_exec_ms(xc.shape[0]) * 1e-3 - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)
        return out

    def measure_link(self, reads: int | None = None, repeats: int = 5) -> dict[str, float]:
        """The disk store's link as this machine gives it, for a prefetcher's deadlines (docs/design.md, "Compute
        order"): ``bytes_per_s``, ``reads`` distinct expert rows read through the reader pool into scratch buffers
        (all in flight at once: the pool's queue depth), and ``layer_compute_ms``, the K experts of one token
        computed from a slot (median of ``repeats``; the layer's expert compute, attention not included, so the
        estimate errs towards prefetching earlier). Disk store only; the slots are not touched."""
        from expertcast.inference.runtime.disk_store import aligned_empty, is_disk_store

        if not is_disk_store(self.store):
            raise UsageError("measure_link reads the disk store; a RAM store's link is a memory copy")
        n = max(int(reads or 2 * (self.readers or 1)), 1)
        keys = [(i // self.E % self.L, i % self.E) for i in range(0, n * 7, 7)][:n]  # spread over the file
        bufs = [aligned_empty(self.store.stride) for _ in keys]
        self.transfer.synchronize()
        t0 = time.perf_counter()
        trs = [self.transfer.submit(k, self.store.row(*k), b, -1 - i, demand=True) for i, (k, b) in
               enumerate(zip(keys, bufs, strict=True))]
        for tr in trs:
            self.transfer.wait(tr)
        read_s = time.perf_counter() - t0
        mod = self.refs[0].module
        w = self.pool.views(self.pool.num_slots)  # a temporary slot: compute time does not depend on its bytes
        cfg = self.model.config
        H = int(getattr(cfg, "get_text_config", lambda: cfg)().hidden_size)
        x = torch.randn(1, H).to(self.layout.act_dtype).to(self.device)
        times = []
        for _ in range(repeats + 1):
            t1 = time.perf_counter()
            for _ in range(self.K):
                experts.expert_forward(mod, x, w)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t1)
        return {"bytes_per_s": n * self.layout.expert_bytes / read_s, "reads": n, "queue_depth": self.readers or 1,
                "layer_compute_ms": 1e3 * float(np.median(times[1:]))}

    def use_measured_link(self) -> dict[str, float] | None:
        """Give a policy with a link estimate (``link_bytes_per_s`` and ``layer_compute_ms``, e.g. seqmoe) the
        figures :meth:`measure_link` measures now, then :meth:`reset` (the policy derives its transfer time in
        layers from them). Returns the figures (None: the policy has no such estimate)."""
        if not (hasattr(self.policy, "link_bytes_per_s") and hasattr(self.policy, "layer_compute_ms")):
            return None
        fig = self.measure_link()
        self.policy.link_bytes_per_s = fig["bytes_per_s"]
        self.policy.layer_compute_ms = max(fig["layer_compute_ms"], 1e-3)
        self.reset()
        return fig

    def use_measured_latency(self) -> None:
        """Give a policy that decides CPU execution vs transfer (``use_latency``) the latency model measured
        now on this machine (:meth:`measure_latency`); the figures go to :attr:`latency_measurement`."""
        if hasattr(self.policy, "use_latency"):
            lat, self.latency_measurement = self.measure_latency()
            self.policy.use_latency(lat)

    def measure_latency(self, token_counts: Sequence[int] = (1, 2, 4, 8), repeats: int = 15
                        ) -> tuple[Any, dict[str, Any]]:
        """The CPU-vs-transfer :class:`~expertcast.inference.saem.cpu_exec.LatencyModel` measured on this machine:
        one expert of layer 0 executed on its host copy for each token count (a line fitted through the
        medians; at least the emulated ``cpu_exec_ms`` on a CPU device), one expert copied from the host
        store into a temporary slot through the transfer engine (the emulated link on a CPU device), and
        the device compute of the K experts of one token from a slot (``device_ms``). Returns the model
        and the measured figures (JSON-ready)."""
        from expertcast.inference.saem.cpu_exec import LatencyModel

        mod = self.refs[0].module
        cfg = self.model.config
        H = int(getattr(cfg, "get_text_config", lambda: cfg)().hidden_size)
        host_w = self.store.views(0, 0)
        dtype = self.layout.act_dtype
        g = torch.Generator().manual_seed(0)
        xs = {int(n): torch.randn(int(n), H, generator=g).to(dtype) for n in token_counts}
        emulate = self.cpu_exec_ms if self.device.type == "cpu" else None

        def cpu_run(n: int) -> None:
            experts.expert_forward(mod, xs[n], host_w)

        def copy_one() -> None:
            s = self.transport.temp_slot()
            self.transport.submit(s, 0, 0, demand=True)
            self.transport.wait_slot(s)
            self.transport.mark_compute()

        x1 = xs[min(xs)][:1].to(self.device)
        slot_w = self.pool.views(self.transport.temp_slot())

        def device_run() -> None:
            for _ in range(self.K):
                experts.expert_forward(mod, x1, slot_w)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        return LatencyModel.measure(cpu_run, copy_one, device_run, token_counts=token_counts, repeats=repeats,
                                    parallel=self.cpu_parallel, cpu_floor_ms=emulate,
                                    sync=(lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda"
                                    else None)


# ---------------------------------------------------------------------------------------------- helpers
def _top_k_of(model: nn.Module) -> int:
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    for name in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    raise ValueError(f"cannot find the top-K of {type(model).__name__}'s config (num_experts_per_tok)")


def _cache_of(out: Any) -> Any:
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def _selection_np(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of the rows' top-K in first-appearance order (row-major) and the tokens routed to each."""
    flat = idx.reshape(-1)
    uniq, first, counts = np.unique(flat, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    return uniq[order].astype(np.int64), counts[order].astype(np.int64)
