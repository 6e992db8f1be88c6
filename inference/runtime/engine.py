"""OffloadedModel: run a transformers-5 MoE model with its routed experts offloaded to the host.

Build one from a model, a policy and a capacity; the model's fused expert weights move into a host
store (:mod:`.store`), the device keeps a fixed slot pool (:mod:`.slots`) bound to the shared
:class:`~expertcast.inference.cache.ExpertCache` slot table, transfers run on a side stream or a
transfer thread (:mod:`.transfer`), and every experts module dispatches to the offloaded
implementation (:mod:`.experts`).

Policy driving mirrors the simulator's generic engine (:func:`expertcast.inference.simulator.replay`)
hook for hook, so that on the routing recorded from a run the runtime's counters equal the
simulator's:

* steps are global across calls: each batch first has one *prefill step per prompt position*, then
  one decode step per generated token that is fed back; ``begin_batch`` opens a batch, ``on_step(t)``
  opens a step, ``observe_tokens(t, ids)`` closes it with the tokens fed to the next step;
* the prompt itself is computed in one forward pass (experts served from resident slots, the rest
  streamed through temporary slots, uncounted); its routing is then replayed position by position
  through the policy (uncounted, as in the simulator's warm-up) and the resulting cache state is
  materialized with real copies before the first decode step;
* a decode layer-execution lands finished prefetches, issues ``before_layer`` loads, marks this
  layer's landed slots Used, serves the selection (the union of the active sequences' top-K in
  first-appearance order: hits, late prefetches, then misses through ``on_miss``/``choose_victim``),
  computes, then calls ``on_access`` and issues ``after_layer`` loads.

Sequences that already finished (EOS) are excluded from routing and expert compute, as they are from
the simulator's replay. Forced-routing replay (:meth:`OffloadedModel.replay`) substitutes recorded
routing for the model's own, so random-weight models of a real shape run under real routing patterns.
"""

from __future__ import annotations

import inspect
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache import CacheConfig, ExpertCache, SlotState, acquire_slot
from expertcast.inference.metrics import CacheMetricsMixin
from expertcast.inference.policy import MissAction, Policy
from expertcast.inference.runtime import experts as X
from expertcast.inference.runtime.slots import SlotPool
from expertcast.inference.runtime.store import (
    HostExpertStore,
    MoELayerRef,
    find_experts_modules,
    layout_of,
    release_model_experts,
)
from expertcast.inference.runtime.transfer import Transfer, TransferEngine, make_transfer_engine
from torch import nn


@dataclass
class LivePrompt:
    """What ``Policy.begin_batch`` receives for one sequence of a live generation: its id and prompt (the
    completion is not known yet, so unlike a :class:`TraceSequence` it has no ``token_ids``/``expert_ids``)."""

    seq_id: str
    prompt_ids: np.ndarray
    """int32 [P] prompt token ids."""
    prompt_len: int


@dataclass
class RuntimeStats(CacheMetricsMixin):
    """Counters of decode steps only (prefill is uncounted), per MoE layer int64 [L], plus timings.

    Same names and meaning as :class:`expertcast.inference.simulator.ReplayResult`.
    """

    num_layers: int
    expert_bytes: int
    accesses: np.ndarray = None  # type: ignore[assignment]
    hits: np.ndarray = None  # type: ignore[assignment]
    demand: np.ndarray = None  # type: ignore[assignment]
    temp: np.ndarray = None  # type: ignore[assignment]
    late: np.ndarray = None  # type: ignore[assignment]
    cpu: np.ndarray = None  # type: ignore[assignment]
    proactive: np.ndarray = None  # type: ignore[assignment]
    dropped: np.ndarray = None  # type: ignore[assignment]
    decoded_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    warmup_seconds: float = 0.0
    """Replaying the prompt routing through the policy and copying the post-prefill resident set
    (between the first token and the first decode step; in neither TTFT nor decode time)."""
    stall_seconds: float = 0.0
    """Host time blocked waiting for transfers (demand loads and late prefetches) in decode."""
    bytes_moved: int = 0
    """Bytes copied host->device in decode (demand, temporary and proactive loads)."""
    ttft_seconds: list[float] = field(default_factory=list)
    """Time to first token of each generate() call."""

    def __post_init__(self) -> None:
        for name in ("accesses", "hits", "demand", "temp", "late", "cpu", "proactive", "dropped"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.num_layers, np.int64))

    @property
    def tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def metrics(self) -> dict[str, Any]:
        return {
            **self.counter_metrics(),
            "adj_hit": self.adj_hit,
            "mb_per_token": self.mb_per_token,
            "decoded_tokens": self.decoded_tokens,
            "tokens_per_s": self.tokens_per_s,
            "ttft_s": float(np.mean(self.ttft_seconds)) if self.ttft_seconds else float("nan"),
            "warmup_s": self.warmup_seconds,
            "stall_ms_per_token": 1e3 * self.stall_seconds / max(self.decoded_tokens, 1),
            "transfer_mb": self.bytes_moved / 1e6,
        }


@dataclass
class MemoryReport:
    """Bytes held by the offloaded model (``expected_*`` = configured slots + non-expert weights)."""

    host_expert_bytes: int
    """Packed host copies of all experts (file-backed when memory-mapped)."""
    host_mmap: bool
    host_pinned: bool
    device_non_expert_bytes: int
    """Parameters and buffers left on the device (everything but the routed experts)."""
    device_slot_bytes: int
    """Slot pool: resident slots + temporary slots."""
    device_workspace_bytes: int
    num_slots: int
    num_temp_slots: int
    expert_bytes: int
    device_expert_param_bytes: int
    """Bytes of routed-expert parameters still held by the model's modules (must be 0)."""
    device_peak_allocated: int | None = None
    """torch.cuda.max_memory_allocated on CUDA (None on CPU)."""
    process_peak_rss: int | None = None

    @property
    def device_total(self) -> int:
        return self.device_non_expert_bytes + self.device_slot_bytes + self.device_workspace_bytes

    @property
    def expected_device(self) -> int:
        return self.device_non_expert_bytes + (self.num_slots + self.num_temp_slots) * self.expert_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["device_total"] = self.device_total
        d["expected_device_weights"] = self.expected_device
        return d


class OffloadedModel:
    """A MoE causal LM whose routed experts live on the host and are cached in device slots.

    Args:
        model: a transformers-5 MoE causal LM (fused experts). Its expert weights are moved into the
            host store and released from the modules (``restore()`` puts them back).
        policy: a :class:`~expertcast.inference.policy.Policy` (e.g. ``make_policy("lru")``).
        capacity: fraction of all L*E experts (float) or slots (int); see :class:`CacheConfig`.
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
    """

    def __init__(self, model: nn.Module, policy: Policy, capacity: float | int, *, pool: str = "per-layer",
                 device: torch.device | str | None = None, link_gbps: float | None = None,
                 mmap_path: str | None = None, num_temp_slots: int = 2, future: Any = None,
                 store: HostExpertStore | None = None, cpu_exec_ms: Any = None):
        self.model = model
        self.refs: list[MoELayerRef] = find_experts_modules(model)  # unsupported architecture -> error
        mod0 = self.refs[0].module
        self.L = len(self.refs)
        self.E = int(mod0.num_experts)
        self.K = int(_top_k_of(model))
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        layout = store.layout if store is not None else layout_of(mod0)
        kw = {"capacity": float(capacity)} if isinstance(capacity, float) else {"slots": int(capacity)}
        self.cache_config = CacheConfig(num_layers=self.L, num_experts=self.E, top_k=self.K, pool=pool,
                                        expert_bytes=layout.expert_bytes, **kw)  # capacity below top-K -> error
        what = f"model {getattr(model.config, '_name_or_path', '') or type(model).__name__}"
        check_policy_compatible(policy, self.L, self.E, self.K, what)  # exports for another model -> error
        self.policy = policy
        if policy.needs_future and future is None:
            raise ValueError(f"policy {policy.name!r} is an oracle: pass future=build_stream(...) of the run (the "
                             "recorded routing), or use OffloadedModel.replay() on recorded traces")
        if getattr(policy, "kernel_only", False):
            raise ValueError(f"policy {policy.name!r} runs only on the simulator's compiled engine, not in the runtime")
        self._future = future
        policy.reset(self.cache_config)  # policy/config mismatches surface before the model is touched
        if policy.needs_future:
            policy.set_future(future)
        policy.warm_start(ExpertCache(self.cache_config))

        if store is None:
            store = HostExpertStore.from_model(model, pin_memory=self.device.type == "cuda", mmap_path=mmap_path,
                                               refs=self.refs)
        elif (store.num_layers, store.num_experts) != (self.L, self.E):
            raise ValueError(f"the given host store holds L={store.num_layers}, E={store.num_experts} experts but the "
                             f"model has L={self.L}, E={self.E}")
        self.store = store
        self.layout = self.store.layout
        release_model_experts(self.refs, self.layout)
        model.to(self.device)
        self.cache = ExpertCache(self.cache_config)
        self.pool = SlotPool(self.layout, self.cache.num_slots, self.device, num_temp=num_temp_slots)
        self.transfer: TransferEngine = make_transfer_engine(self.device, link_gbps)
        self.workspace = X.Workspace(self.device, self.layout.dtype)
        self._phys = [(-1, -1)] * (self.cache.num_slots + self.pool.num_temp)
        """(layer, expert) whose bytes a slot holds (or will hold once its transfer lands)."""
        self._inflight: dict[int, Transfer] = {}
        """slot -> transfer not yet waited for."""
        self.cpu_exec_ms = cpu_exec_ms
        self._observe_routing = getattr(policy, "observe_routing", None)
        self._physical = True
        """False while the prefill routing is replayed through the policy (book-keeping only)."""
        for i, r in enumerate(self.refs):
            setattr(r.module, X.RUNTIME_ATTR, self)
            setattr(r.module, X.LAYER_ATTR, i)
        self._impl_before = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else None
        model.set_experts_implementation(X.register())
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        self.stats = RuntimeStats(self.L, self.layout.expert_bytes)
        self._t = -1
        self._run_state: _RunState | None = None
        self.reset()

    # ------------------------------------------------------------------------------------------ setup
    def reset(self) -> None:
        """Empty the cache, reset the policy (and its warm start) and the counters."""
        self.transfer.synchronize()
        self._inflight.clear()
        self.cache.reset()
        self.policy.reset(self.cache_config)
        if self.policy.needs_future:
            self.policy.set_future(self._future)
        for layer, expert in self.policy.warm_start(self.cache):
            slot = self.cache.take_free_slot(self.cache.pool_of(layer))
            if slot < 0:
                raise ValueError(f"{self.policy.name}: warm start places more experts than layer {layer}'s pool holds")
            self.cache.assign(slot, int(layer), int(expert), SlotState.USED)
        self._materialize()
        self._t = -1
        self.stats = RuntimeStats(self.L, self.layout.expert_bytes)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def set_future(self, future: Any) -> None:
        """Give an oracle policy the access stream of the coming run (then :meth:`reset`)."""
        self._future = future
        if self.policy.needs_future:
            self.policy.set_future(future)

    def close(self) -> None:
        """Stop the transfer thread and detach from the model (the expert weights stay released)."""
        self.transfer.synchronize()
        self.transfer.close()
        self._hook.remove()

    def restore(self) -> nn.Module:
        """Give the model its fused expert weights back (full load) and detach the runtime."""
        self.close()
        self.store.restore_into(self.refs)
        for r in self.refs:
            for a in (X.RUNTIME_ATTR, X.LAYER_ATTR):
                if hasattr(r.module, a):
                    delattr(r.module, a)
            for p in self.layout.parts:
                getattr(r.module, p.name).data = getattr(r.module, p.name).data.to(self.device)
        prev = (self._impl_before or {}).get("", None)
        prev = "grouped_mm" if prev in (None, X.IMPLEMENTATION_NAME) else prev
        self.model.set_experts_implementation(prev)
        return self.model

    # ------------------------------------------------------------------------------------------ memory
    def memory_report(self) -> MemoryReport:
        expert_param_ids = {id(getattr(r.module, p.name)) for r in self.refs for p in self.layout.parts}
        non_expert = 0
        expert_left = 0
        for p in self.model.parameters():
            if id(p) in expert_param_ids:
                expert_left += p.numel() * p.element_size()
            elif p.device.type == self.device.type:
                non_expert += p.numel() * p.element_size()
        for b in self.model.buffers():
            if b.device.type == self.device.type:
                non_expert += b.numel() * b.element_size()
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return MemoryReport(
            host_expert_bytes=self.store.nbytes, host_mmap=self.store.mmap_path is not None,
            host_pinned=self.store.is_pinned, device_non_expert_bytes=non_expert,
            device_slot_bytes=self.pool.nbytes, device_workspace_bytes=self.workspace.nbytes,
            num_slots=self.cache.num_slots, num_temp_slots=self.pool.num_temp, expert_bytes=self.layout.expert_bytes,
            device_expert_param_bytes=expert_left, device_peak_allocated=peak, process_peak_rss=rss)

    # ------------------------------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 32, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, record: bool = False, seq_ids: Sequence[str] | None = None,
                 **generate_kwargs: Any) -> GenerationResult:
        """Greedy generation of a left-padded batch ``input_ids`` [B, P] under offloading.

        Returns the sequences [B, P + new] and, with ``record=True``, the routing of every processed
        position per sequence as :class:`TraceSequence` (for the simulator and for replay).
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, P], got {tuple(input_ids.shape)}")
        B, P = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
        am = attention_mask.bool().cpu()
        lens = am.sum(1)
        if (lens == 0).any():
            raise ValueError("a prompt of the batch is empty")
        for i in range(B):  # left padding only: real tokens are the last lens[i] positions
            if not bool(am[i, P - int(lens[i]):].all()):
                raise ValueError("prompts must be left-padded (decoder-only generation)")
        gc = self.model.generation_config
        eos = eos_token_id if eos_token_id is not None else gc.eos_token_id
        eos_set = set([eos] if isinstance(eos, int) else (eos or []))
        ids_cpu = input_ids.cpu()
        prompts = [ids_cpu[i, P - int(lens[i]):].numpy().astype(np.int32) for i in range(B)]
        sid = list(seq_ids) if seq_ids is not None else [f"seq{i}" for i in range(B)]
        self._run_state = _RunState(self, prompts, sid, eos_set, record, forced=None)
        t0 = time.perf_counter()
        try:
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                pad_token_id=pad_token_id if pad_token_id is not None else (gc.pad_token_id if gc.pad_token_id is not None
                                                                             else next(iter(eos_set), 0)),
                **generate_kwargs)
            self._run_state.finish()
        finally:
            rs, self._run_state = self._run_state, None
        total = time.perf_counter() - t0
        self.stats.decode_seconds += max(total - rs.ttft - rs.warmup, 0.0)
        self.stats.prefill_seconds += rs.ttft
        self.stats.ttft_seconds.append(rs.ttft)
        self.stats.prefill_tokens += int(lens.sum())
        seqs = out.sequences if hasattr(out, "sequences") else out  # return_dict_in_generate=True
        return GenerationResult(seqs, rs.traces() if record else None, rs.ttft, total)

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
            if s.expert_ids.shape[1:] != (self.L, self.K):
                raise ValueError(f"sequence {s.seq_id}: routing {tuple(s.expert_ids.shape[1:])} does not match the "
                                 f"model's [L={self.L}, K={self.K}]: trace/model mismatch")
            if int(s.expert_ids.max()) >= self.E or int(s.expert_ids.min()) < 0:
                raise ValueError(f"sequence {s.seq_id}: expert id outside [0, E={self.E}): trace/model mismatch")
            if s.prompt_len < 1:
                raise ValueError(f"sequence {s.seq_id}: replay needs at least one prompt position")
        vocab = self.model.get_input_embeddings().num_embeddings
        cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        before = _snapshot(self.stats)
        for s in sequences:
            T = s.num_tokens if max_decode is None else min(s.num_tokens, s.prompt_len + max_decode)
            if T < s.num_tokens:
                s = TraceSequence(s.seq_id, s.token_ids[:T], s.prompt_len, s.expert_ids[:T], s.expert_weights[:T],
                                  None if s.router_probs is None else s.router_probs[:T])
            tok = np.asarray(s.token_ids[:T], dtype=np.int64) % vocab
            rs = _RunState(self, [tok[:s.prompt_len].astype(np.int32)], [s.seq_id], set(), False,
                           forced=(np.asarray(s.expert_ids[:T], np.int64), np.asarray(s.expert_weights[:T], np.float32)),
                           forced_tokens=tok, batch_info=[s])
            self._run_state = rs
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
                rs.finish()
            finally:
                self._run_state = None
            t2 = time.perf_counter()
            self.stats.prefill_seconds += t1 - t0
            self.stats.ttft_seconds.append(t1 - t0)
            self.stats.decode_seconds += t2 - t1 - rs.warmup
            self.stats.prefill_tokens += s.prompt_len
        return _diff(self.stats, before)

    # ------------------------------------------------------------------------------------------ hooks
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        rs = self._run_state
        if rs is None:
            raise RuntimeError("the offloaded model runs through OffloadedModel.generate() or .replay(), not by "
                               "calling the wrapped model directly")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("the offloaded runtime needs input_ids (inputs_embeds are not supported)")
        rs.begin_forward(ids)

    def forward_layer(self, module: nn.Module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
        """Called by the experts implementation: route, serve residency, compute. hidden [N, H]."""
        rs = self._run_state
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
        if rs.prefill:
            y = self._prefill_layer(module, layer, h, idx, w)
        else:
            if self._observe_routing is not None:  # per-member routing (forecaster input)
                self._observe_routing(rs.t, layer, *rs.member_routing(idx, w))
            y = self._decode_layer(module, layer, h, idx, w, rs.t)
        if rows is None:
            return y
        out[rows] = y
        return out

    # ------------------------------------------------------------------------------------------ residency
    def _submit(self, slot: int, layer: int, expert: int, demand: bool) -> Transfer:
        tr = self.transfer.submit((layer, expert), self.store.row(layer, expert), self.pool.row(slot), slot,
                                  demand=demand)
        self._phys[slot] = (layer, expert)
        self._inflight[slot] = tr
        return tr

    def _wait_slot(self, slot: int) -> float:
        tr = self._inflight.pop(slot, None)
        if tr is None:
            return 0.0
        if not self.transfer.done(tr):
            self.transfer.promote(tr)  # a late prefetch still queued goes ahead of the other prefetches
        return self.transfer.wait(tr)

    def _issue(self, t: int, items, counted: bool) -> None:
        """Proactive loads, as the simulator's ``issue``: skip residents, take a free slot or evict."""
        L, E, cache, policy = self.L, self.E, self.cache, self.policy
        for (pl, pe) in items:
            pl, pe = int(pl), int(pe)
            if not (0 <= pl < L and 0 <= pe < E):
                raise ValueError(f"{policy.name} asked to prefetch ({pl}, {pe}) outside L={L}, E={E}")
            if cache.contains(pl, pe):
                continue
            slot = acquire_slot(cache, policy, t, pl, cache.pool_of(pl))
            if slot < 0:
                if counted:
                    self.stats.dropped[pl] += 1
                continue
            cache.assign(slot, pl, pe, SlotState.FETCH, proactive=True)
            policy.on_insert(pl, pe, True)
            if self._physical:
                self._submit(slot, pl, pe, demand=False)
                if counted:
                    self.stats.bytes_moved += self.layout.expert_bytes
            if counted:
                self.stats.proactive[pl] += 1

    def _land(self) -> None:
        """FETCH slots whose transfer finished become COMPUTE (the simulator's ``link.advance``)."""
        cache = self.cache
        for s in cache.slots_in_state(SlotState.FETCH):
            s = int(s)
            tr = self._inflight.get(s)
            if tr is None or self.transfer.done(tr):
                cache.set_state(s, SlotState.COMPUTE)

    def _access(self, t: int, layer: int, sel: np.ndarray, cnt: np.ndarray, counted: bool) -> dict[int, tuple]:
        """One layer-execution's residency, hook for hook as ``simulator.replay``.

        Returns expert -> ("slot", s) | ("temp",) | ("cpu",) for the compute.
        """
        cache, policy, st = self.cache, self.policy, self.stats
        self._land()
        self._issue(t, policy.before_layer(t, layer, cache), counted)
        for s in cache.slots_in_state(SlotState.COMPUTE, layer):
            cache.set_state(int(s), SlotState.USED)
        pool = cache.pool_of(layer)
        plan: dict[int, tuple] = {}
        missing = []
        for e in sel:
            e = int(e)
            s = cache.slot(layer, e)
            if s < 0:
                missing.append(e)
                continue
            if cache.state[s] == SlotState.FETCH:
                cache.set_state(s, SlotState.COMPUTE)
                if counted:
                    st.late[layer] += 1
            elif counted:
                st.hits[layer] += 1
            cache.proactive[s] = False
            plan[e] = ("slot", s)
        cnt_of = dict(zip(sel.tolist(), cnt.tolist(), strict=True))
        for e in missing:
            action = MissAction(policy.on_miss(t, layer, e, cnt_of[e], cache))
            slot = -1
            if action == MissAction.LOAD:
                slot = acquire_slot(cache, policy, t, layer, pool, sel)
                if slot < 0:
                    action = MissAction.TEMP
            if action == MissAction.LOAD:
                cache.assign(slot, layer, e, SlotState.COMPUTE)
                policy.on_insert(layer, e, False)
                if self._physical:
                    self._submit(slot, layer, e, demand=True)
                plan[e] = ("slot", slot)
            elif action == MissAction.TEMP:
                plan[e] = ("temp",)
                if counted:
                    st.temp[layer] += 1
            else:
                plan[e] = ("cpu",)
                if counted:
                    st.cpu[layer] += 1
            if counted and action != MissAction.CPU:
                st.demand[layer] += 1
                st.bytes_moved += self.layout.expert_bytes
        if counted:
            st.accesses[layer] += len(sel)
        return plan

    def _after_compute(self, t: int, layer: int, sel: np.ndarray, cnt: np.ndarray, counted: bool) -> None:
        cache = self.cache
        for e in sel:
            s = cache.slot(layer, int(e))
            if s >= 0 and cache.state[s] == SlotState.COMPUTE:
                cache.set_state(s, SlotState.USED)
        self.policy.on_access(t, layer, sel, cnt, cache)
        self._issue(t, self.policy.after_layer(t, layer, cache), counted)

    # ------------------------------------------------------------------------------------------ compute
    def _decode_layer(self, module, layer, h, idx, w, t) -> torch.Tensor:
        grouping = X.Grouping(idx, self.E)
        sel, cnt = grouping.selected, grouping.selected_counts
        self._physical = True
        plan = self._access(t, layer, sel, cnt, counted=True)
        y = self._compute(module, layer, h, idx, w, grouping, plan, count_stall=True)
        self._after_compute(t, layer, sel, cnt, counted=True)
        return y

    def _prefill_layer(self, module, layer, h, idx, w) -> torch.Tensor:
        """Prompt compute: resident slots where the bytes are there, the rest streamed (uncounted)."""
        grouping = X.Grouping(idx, self.E)
        plan = {}
        for e in grouping.active:
            s = self.cache.slot(layer, e)
            ok = s >= 0 and self._phys[s] == (layer, e)
            plan[e] = ("slot", s) if ok else ("temp",)
        return self._compute(module, layer, h, idx, w, grouping, plan, count_stall=False)

    def _compute(self, module, layer, h, idx, w, grouping, plan, count_stall: bool) -> torch.Tensor:
        pool = self.pool
        temps = [e for e in grouping.active if plan[e][0] == "temp"]
        temp_slot: dict[int, int] = {}
        nxt = 0
        stall = 0.0

        def feed() -> None:  # keep up to num_temp temporary transfers in flight, in compute order
            nonlocal nxt
            while nxt < len(temps) and len(temp_slot) < pool.num_temp:
                e = temps[nxt]
                s = pool.temp_slot()
                self._submit(s, layer, e, demand=True)
                temp_slot[e] = s
                nxt += 1

        feed()

        cpu_start = 0.0

        def before(e: int) -> None:
            nonlocal stall, cpu_start
            kind = plan[e][0]
            if kind == "slot":
                stall += self._wait_slot(plan[e][1])
            elif kind == "temp":
                stall += self._wait_slot(temp_slot[e])
            else:
                cpu_start = time.perf_counter()

        def after(e: int) -> None:
            nonlocal stall
            if plan[e][0] == "cpu" and self.cpu_exec_ms is not None and self.device.type == "cpu":
                # emulation: the host CPU is slower than the device it stands in for
                left = self.cpu_exec_ms(grouping.counts[e]) * 1e-3 - (time.perf_counter() - cpu_start)
                if left > 0:
                    time.sleep(left)
                    stall += left
            if plan[e][0] == "temp":
                self.transfer.mark_compute()  # the temporary slot may be overwritten after this kernel
                del temp_slot[e]
                feed()

        def weights_of(e: int):
            kind = plan[e][0]
            return pool.views(plan[e][1] if kind == "slot" else temp_slot[e])

        cpu = {e for e in grouping.active if plan[e][0] == "cpu"}
        y = X.grouped_expert_compute(module, h, idx, w, weights_of, self.workspace, grouping=grouping,
                                     cpu_weights_of=lambda e: self.store.views(layer, e), cpu_experts=cpu,
                                     before_expert=before, after_expert=after)
        self.transfer.mark_compute()
        if count_stall:
            self.stats.stall_seconds += stall
        return y

    # ------------------------------------------------------------------------------------------ prefill replay
    def _replay_prefill(self, rs: _RunState) -> None:
        """Replay the prompt routing through the policy position by position (uncounted, no transfers),
        as the simulator's warm-up, then copy the resulting resident set into the slots."""
        self._physical = False
        maxp = max(len(p) for p in rs.prompts)
        for j in range(maxp):
            self._t += 1
            t = self._t
            self.policy.on_step(t)
            members = [i for i, p in enumerate(rs.prompts) if len(p) > j]
            for layer in range(self.L):
                idx = np.stack([rs.prefill_ids(i, layer, j) for i in members])
                if self._observe_routing is not None:
                    ids_b = np.zeros((rs.B, self.K), np.int64)
                    w_b = np.zeros((rs.B, self.K), np.float32)
                    for i in members:
                        ids_b[i] = rs.prefill_ids(i, layer, j)
                        w_b[i] = rs.prefill_weights(i, layer, j)
                    self._observe_routing(t, layer, ids_b, w_b)
                sel, cnt = _selection_np(idx)
                self._access(t, layer, sel, cnt, counted=False)
                self._after_compute(t, layer, sel, cnt, counted=False)
            if rs.trace_like:  # as the simulator: the next token of each member that goes on
                produced = []
                for i in members:
                    p = rs.prompts[i]
                    if j + 1 < len(p):
                        produced.append(int(p[j + 1]))
                    elif rs.consumes_first[i]:
                        produced.append(int(rs.first_token[i]))
                if produced:
                    self.policy.observe_tokens(t, produced)
            else:  # live generation: one entry per sequence, the generated token or None
                gen = [int(rs.first_token[i]) if (len(rs.prompts[i]) == j + 1 and rs.consumes_first[i]) else None
                       for i in range(rs.B)]
                if any(v is not None for v in gen):
                    self.policy.observe_tokens(t, gen)
        self._physical = True
        self._materialize()

    def _materialize(self) -> None:
        """Copy into every slot the expert the cache assigns it (where the bytes differ); waits."""
        cache = self.cache
        subs = []
        for s in range(cache.num_slots):
            want = (int(cache.slot_layer[s]), int(cache.slot_expert[s]))
            if want[0] < 0:
                continue
            if self._phys[s] != want or s in self._inflight:
                subs.append(self._submit(s, *want, demand=False))
        for tr in subs:
            self.transfer.wait(tr)
        self._inflight.clear()
        self.transfer.synchronize()


# ---------------------------------------------------------------------------------------------- run state
@dataclass
class GenerationResult:
    sequences: torch.Tensor
    """[B, P + new] token ids (left-padded prompts followed by the generated tokens)."""
    traces: list[TraceSequence] | None
    """Routing of every processed position per sequence (``record=True``)."""
    ttft_seconds: float
    seconds: float


class _RunState:
    """Book-keeping of one generate()/replay() call: phases, steps, active rows, recorded routing."""

    def __init__(self, rt: OffloadedModel, prompts: list[np.ndarray], seq_ids: list[str], eos: set[int], record: bool,
                 forced: tuple[np.ndarray, np.ndarray] | None, forced_tokens: np.ndarray | None = None,
                 batch_info: list | None = None):
        self.rt = rt
        self.prompts = prompts
        self.B = len(prompts)
        self.seq_ids = seq_ids
        self.eos = eos
        self.record = record
        self.forced = forced
        self.forced_tokens = forced_tokens
        self.prefill = True
        self.n_forward = 0
        self.decode_step = -1
        self.t = -1
        self.finished = np.zeros(self.B, np.bool_)
        self.active_rows: torch.Tensor | None = None
        self.first_token = np.full(self.B, -1, np.int64)
        self.consumes_first = np.zeros(self.B, np.bool_)
        self.prefill_done = False
        self.warmup = 0.0
        self._t_start = time.perf_counter()
        self.ttft = 0.0
        # routing logs: per sequence, per processed position: (ids [L, K], weights [L, K])
        self._prefill_log: list[list[np.ndarray]] = [[] for _ in range(rt.L)]  # per layer [Ntok, K]
        self._prefill_wlog: list[list[np.ndarray]] = [[] for _ in range(rt.L)]
        self._decode_log: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(self.B)]
        self._dec_ids = np.zeros((self.B, rt.L, rt.K), np.int64)
        self._dec_w = np.zeros((self.B, rt.L, rt.K), np.float32)
        self._dec_tokens: list[list[int]] = [[] for _ in range(self.B)]
        self._active_list: list[int] = list(range(self.B))
        self._pos_rows: np.ndarray | None = None
        self.trace_like = batch_info is not None
        # replay: the recorded sequences (as the simulator passes them); generation: the prompt token ids
        rt.policy.begin_batch(batch_info if batch_info is not None else
                              [LivePrompt(s, p.copy(), len(p)) for s, p in zip(seq_ids, prompts, strict=True)])

    # -- phases ------------------------------------------------------------------------------------
    def begin_forward(self, ids: torch.Tensor) -> None:
        rt = self.rt
        self.n_forward += 1
        if self.n_forward == 1:
            B, P = ids.shape
            if B != self.B:
                raise ValueError(f"forward got a batch of {B}, expected {self.B}")
            rows = []
            for i, p in enumerate(self.prompts):
                rows.extend(range(i * P + P - len(p), i * P + P))
            self.active_rows = None if len(rows) == B * P else torch.as_tensor(rows, device=rt.device)
            self.prefill = True
            return
        # a decode forward: the first consumes the prefill's token
        toks = ids.reshape(self.B, -1)[:, -1].cpu().numpy()
        if not self.prefill_done:
            self.ttft = time.perf_counter() - self._t_start
            self.first_token[:] = toks
            for i in range(self.B):
                if int(toks[i]) in self.eos:
                    self.finished[i] = True
            self.consumes_first = ~self.finished
            self._finish_prefill()
        else:
            newly = [i for i in self._active_list if int(toks[i]) in self.eos]
            for i in newly:
                self.finished[i] = True
            if self.trace_like:
                produced = [int(toks[i]) for i in self._active_list if not self.finished[i]]
                if produced:
                    rt.policy.observe_tokens(self.t, produced)
            else:
                gen = [int(toks[i]) if (i in self._active_list and not self.finished[i]) else None
                       for i in range(self.B)]
                if any(v is not None for v in gen):
                    rt.policy.observe_tokens(self.t, gen)
            self._flush_decode_log()
        self.prefill = False
        self._active_list = [i for i in range(self.B) if not self.finished[i]]
        self.active_rows = None if len(self._active_list) == self.B else \
            torch.as_tensor(self._active_list, device=rt.device)
        self.decode_step += 1
        rt._t += 1
        self.t = rt._t
        self._step_tokens = {i: int(toks[i]) for i in self._active_list}
        rt.policy.on_step(self.t)
        rt.stats.decode_steps += 1
        rt.stats.decoded_tokens += len(self._active_list)

    def _finish_prefill(self) -> None:
        if self.prefill_done:
            return
        self.prefill_done = True
        t0 = time.perf_counter()
        self.rt._replay_prefill(self)
        self.warmup = time.perf_counter() - t0
        self.rt.stats.warmup_seconds += self.warmup

    def finish(self) -> None:
        """End of the call: close the prefill if no decode step ran, flush the logs."""
        if not self.prefill_done:
            self.ttft = time.perf_counter() - self._t_start
            self.consumes_first[:] = False
            self._finish_prefill()
        else:
            self._flush_decode_log()

    # -- routing ----------------------------------------------------------------------------------
    def forced_routing(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, w = self.forced
        if self.prefill:
            P = len(self.prompts[0])
            sl = slice(0, P)
        else:
            pos = len(self.prompts[0]) + self.decode_step
            sl = slice(pos, pos + 1)
        dev = hidden.device
        return (torch.as_tensor(ids[sl, layer], device=dev),
                torch.as_tensor(w[sl, layer], device=dev).to(hidden.dtype))

    def log_routing(self, layer: int, idx: torch.Tensor, w: torch.Tensor) -> None:
        ids = idx.cpu().numpy().astype(np.int64)
        if self.prefill:
            self._prefill_log[layer].append(ids)
            self._prefill_wlog[layer].append(w.float().cpu().numpy())
            return
        ww = w.float().cpu().numpy()
        for r, i in enumerate(self._active_list):
            self._dec_ids[i, layer] = ids[r]
            self._dec_w[i, layer] = ww[r]

    def _flush_decode_log(self) -> None:
        if self.decode_step < 0:
            return
        for i in self._active_list:
            self._decode_log[i].append((self._dec_ids[i].copy(), self._dec_w[i].copy()))
            self._dec_tokens[i].append(self._step_tokens[i])

    def prefill_ids(self, i: int, layer: int, j: int) -> np.ndarray:
        """int [K] routing of prompt position ``j`` of sequence ``i`` at ``layer``."""
        off = sum(len(p) for p in self.prompts[:i])
        return self._prefill_cat(layer)[off + j]

    def prefill_weights(self, i: int, layer: int, j: int) -> np.ndarray:
        """float [K] routing weights of prompt position ``j`` of sequence ``i`` at ``layer``."""
        off = sum(len(p) for p in self.prompts[:i])
        if not hasattr(self, "_pwcat"):
            self._pwcat = [np.concatenate(self._prefill_wlog[layer_]) for layer_ in range(self.rt.L)]
        return self._pwcat[layer][off + j]

    def member_routing(self, idx: torch.Tensor, w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(ids int [B, K], weights float [B, K]) of this decode step, zeros for idle members."""
        ids_b = np.zeros((self.B, self.rt.K), np.int64)
        w_b = np.zeros((self.B, self.rt.K), np.float32)
        ids_b[self._active_list] = idx.cpu().numpy()
        w_b[self._active_list] = w.float().cpu().numpy()
        return ids_b, w_b

    def _prefill_cat(self, layer: int) -> np.ndarray:
        if not hasattr(self, "_pcat"):
            self._pcat = [np.concatenate(self._prefill_log[layer_]) for layer_ in range(self.rt.L)]
        return self._pcat[layer]

    def traces(self) -> list[TraceSequence]:
        """The recorded routing of every processed position, one :class:`TraceSequence` per sequence."""
        out = []
        L, K = self.rt.L, self.rt.K
        pw = [np.concatenate(self._prefill_wlog[layer]) for layer in range(L)]
        off = 0
        for i, p in enumerate(self.prompts):
            n = len(p)
            ids = np.stack([self._prefill_cat(layer)[off:off + n] for layer in range(L)], axis=1)
            ws = np.stack([pw[layer][off:off + n] for layer in range(L)], axis=1)
            off += n
            dec = self._decode_log[i]
            if dec:
                ids = np.concatenate([ids, np.stack([d[0] for d in dec])])
                ws = np.concatenate([ws, np.stack([d[1] for d in dec])])
            toks = np.concatenate([p, np.asarray(self._dec_tokens[i], np.int32)]).astype(np.int32)
            out.append(TraceSequence(self.seq_ids[i], toks, n, ids.reshape(-1, L, K).astype(np.int16),
                                     ws.reshape(-1, L, K).astype(np.float16)))
        return out


# ---------------------------------------------------------------------------------------------- helpers
def check_policy_compatible(policy: Policy, num_layers: int, num_experts: int, top_k: int, what: str) -> None:
    """Raise ValueError when ``policy`` (or an artifact it holds: forecaster export, router export, cue
    set...) was made for a model of another shape. Policies may define ``check_compatible(L, E, K, what)``;
    artifacts held as attributes are checked through their own ``check_compatible``."""
    objs = [policy] + [v for v in vars(policy).values() if v is not policy]
    for obj in objs:
        fn = getattr(obj, "check_compatible", None)
        if not callable(fn):
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # pragma: no cover
            params = {}
        if "top_k" in params:
            fn(num_layers, num_experts, top_k, what=what)
        elif "num_experts" in params:
            fn(num_layers, num_experts, what=what)


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


def _snapshot(st: RuntimeStats) -> dict:
    return {k: (v.copy() if isinstance(v, np.ndarray) else (list(v) if isinstance(v, list) else v))
            for k, v in st.__dict__.items()}


def _diff(st: RuntimeStats, before: dict) -> RuntimeStats:
    out = RuntimeStats(st.num_layers, st.expert_bytes)
    for k, v in st.__dict__.items():
        b = before[k]
        if isinstance(v, np.ndarray):
            setattr(out, k, v - b)
        elif isinstance(v, list):
            setattr(out, k, v[len(b):])
        elif isinstance(v, (int, float)) and k not in ("num_layers", "expert_bytes"):
            setattr(out, k, v - b)
    return out
