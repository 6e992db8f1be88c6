"""Cost model of a decode step with expert offloading: one host-device link, per-layer compute, CPU
execution of cold experts.

Model (per layer-execution, in ms):
* A layer starts when the previous one ends. Transfers use one link, one at a time (serialized, never
  preempted). Proactive loads (prefetches) are queued when issued and start whenever the link is free,
  in FIFO (issue order) or EDF (earliest deadline: the step/layer that needs them) order, so they
  overlap compute.
* At the layer's start the selected experts must be on the device. A demand miss is transferred at
  once, ahead of the queued prefetches but after the transfer on the wire; its transfer time is
  exposed. A late prefetch (the access finds its transfer still queued or in flight) waits for it:
  the remaining transfer time is stall, and a still-queued one is promoted like a demand transfer.
  Stall of the layer = (end of the last transfer it waits for) - (layer start).
* CPU-executed experts (``MissAction.CPU``) run one after another on the host, in parallel with the
  layer's device compute: ``cpu_ms(n) = cpu_expert_ms + n * cpu_token_ms`` for an expert routed ``n``
  tokens; the part of the CPU time beyond the layer's compute time is stall. With ``cpu_parallel`` they
  start at the layer's start, also in parallel with its transfers.
* Layer time = stall + max(compute, CPU time); full-load time = compute alone (every expert
  resident), so ``pct_full_speed = 100 * compute / (compute + stall)`` over the counted (decode) steps.

:class:`ModelledTransport` is this model as the transport of the policy driver
(:mod:`expertcast.inference.cache.driver`) in the simulator.

Defaults (documented assumptions):
* ``bandwidth_gbps = 25``: effective host-to-device copy rate of PCIe 4.0 x16 from pinned memory
  (31.5 GB/s theoretical; measured ``cudaMemcpy`` H2D rates are typically 24-26 GB/s).
* ``expert_bytes = 9_437_184``: one Qwen3-30B-A3B expert in bf16 (gate, up, down projections of
  hidden 2048 x moe_intermediate 768: 3 * 2048 * 768 * 2 bytes = 9.44 MB). Traces carry their own
  expert size, which takes precedence.
* ``layer_compute_ms = 0.15``: an assumption for Qwen3-30B-A3B decode at batch 1 on an A100/H100-class
  GPU with every expert resident: ~7 ms per token (~140 tokens/s, the order reported for bf16 serving
  of this model) over 48 MoE layers. Give measured per-layer times (the runtime measures them) to
  replace it.
* ``cpu_expert_ms = 0.19``: reading one 9.44 MB expert from host DRAM at ~50 GB/s (memory-bound GEMV);
  ``cpu_token_ms = 0.01`` per routed token (9.4 MFLOP at ~1 TFLOP/s of a many-core AVX-512 host).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from expertcast.data.trace_format import QWEN3_30B_A3B_EXPERT_BYTES  # noqa: F401  (the default expert size)
from expertcast.inference.cache.driver import Transport


@dataclass
class CostConfig:
    """Parameters of the cost model (defaults: PCIe 4.0 x16 host link, Qwen3-30B-A3B-sized experts)."""

    bandwidth_gbps: float = 25.0
    """Effective host-to-device link bandwidth in GB/s (1e9 bytes/s)."""
    layer_compute_ms: float | list[float] = 0.15
    """Device compute time of one MoE layer-execution with all experts resident, in ms: one value for
    every layer or a list [L] (e.g. measured by the runtime)."""
    expert_bytes: int | None = None
    """Bytes per expert; None takes the trace's value (or the Qwen3-30B-A3B default)."""
    queue: str = "fifo"
    """Order of queued proactive transfers: ``fifo`` (issue order) or ``edf`` (earliest deadline)."""
    cpu_expert_ms: float = 0.19
    """Fixed CPU time of executing one expert (reading its weights from host memory), ms."""
    cpu_token_ms: float = 0.01
    """CPU time per token routed to a CPU-executed expert, ms."""
    cpu_parallel: bool = False
    """CPU-executed experts start with the layer, in parallel with its transfers and device compute (SAEM
    IV-2: the GPU-bound and CPU-bound token groups run in parallel and are merged before the next layer):
    layer time = max(transfers + compute, CPU time). False: they start once the layer's transfers have
    landed, beside the device compute only: layer time = transfers + max(compute, CPU time)."""

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"bandwidth_gbps must be positive, got {self.bandwidth_gbps}")
        if self.queue not in ("fifo", "edf"):
            raise ValueError(f"queue must be 'fifo' or 'edf', got {self.queue!r}")
        lc = np.atleast_1d(np.asarray(self.layer_compute_ms, dtype=np.float64))
        if (lc < 0).any():
            raise ValueError("layer_compute_ms must be non-negative")

    def transfer_ms(self, expert_bytes: int) -> float:
        """Time to move one expert over the link, ms."""
        return expert_bytes / (self.bandwidth_gbps * 1e9) * 1e3

    def compute_ms(self, num_layers: int) -> np.ndarray:
        """float64 [L] per-layer compute time."""
        lc = np.atleast_1d(np.asarray(self.layer_compute_ms, dtype=np.float64))
        if lc.size == 1:
            return np.full(num_layers, float(lc[0]))
        if lc.size != num_layers:
            raise ValueError(f"layer_compute_ms lists {lc.size} layers but the trace has L={num_layers}")
        return lc

    def cpu_ms(self, n_tokens: int) -> float:
        """CPU time of one expert routed ``n_tokens`` tokens."""
        return self.cpu_expert_ms + n_tokens * self.cpu_token_ms


@dataclass
class Event:
    """One entry of the per-step timeline (times in ms from the start of the replay)."""

    step: int
    layer: int
    kind: str
    """``prefetch`` (a proactive transfer on the wire; ``step`` is the step that issued it), ``demand``, ``temp`` (demand
    into a temporary slot), ``late`` (waiting on a prefetch), ``cpu``, ``compute`` (the layer),
    ``stall`` (exposed wait before the layer computes)."""
    expert: int
    start: float
    end: float


@dataclass
class _Transfer:
    slot: int
    layer: int
    expert: int
    issue: float
    deadline: int
    seq: int
    step: int = -1
    start: float = -1.0
    end: float = -1.0


@dataclass
class Link:
    """A single serialized host-device link with a queue of proactive transfers.

    Times are ms. ``free_at`` is when the transfer on the wire (or the last committed one) ends.
    """

    transfer_ms: float
    queue: str = "fifo"
    free_at: float = 0.0
    pending: list[_Transfer] = field(default_factory=list)
    inflight: list[_Transfer] = field(default_factory=list)
    timeline: list[Event] | None = None
    _seq: int = 0

    def issue_prefetch(self, slot: int, layer: int, expert: int, now: float, deadline: int,
                       step: int = -1) -> _Transfer:
        """Queue a proactive transfer issued at ``now`` (during ``step``) for the layer-execution
        ``deadline``."""
        tr = _Transfer(slot, layer, expert, now, deadline, self._seq, step)
        self._seq += 1
        self.pending.append(tr)
        return tr

    def _next_pending(self, at: float) -> _Transfer | None:
        ready = [t for t in self.pending if t.issue <= at]
        if not ready:
            return None
        if self.queue == "edf":
            return min(ready, key=lambda t: (t.deadline, t.seq))
        return min(ready, key=lambda t: t.seq)

    def advance(self, now: float) -> list[_Transfer]:
        """Start every queued transfer whose start time is before ``now``; return the transfers that
        have landed by ``now`` (removed from the in-flight list)."""
        while self.pending:
            at = self.free_at
            tr = self._next_pending(at)
            if tr is None:
                at = min(t.issue for t in self.pending)
                tr = self._next_pending(at)
            start = max(at, tr.issue)
            if start >= now:
                break
            self._start(tr, start, "prefetch")
        landed = [t for t in self.inflight if t.end <= now]
        self.inflight = [t for t in self.inflight if t.end > now]
        return landed

    def _start(self, tr: _Transfer, start: float, kind: str) -> None:
        self.pending.remove(tr)
        tr.start = start
        tr.end = start + self.transfer_ms
        self.free_at = tr.end
        self.inflight.append(tr)
        if self.timeline is not None:
            self.timeline.append(Event(tr.step, tr.layer, kind, tr.expert, tr.start, tr.end))

    def wait_for(self, tr: _Transfer, now: float) -> float:
        """End time of a prefetch the running layer needs now (promoting it if still queued)."""
        if tr in self.pending:
            self._start(tr, max(now, self.free_at), "prefetch")
        return tr.end

    def demand(self, layer: int, expert: int, now: float, step: int = -1, kind: str = "demand") -> float:
        """Transfer an expert needed now, ahead of the queued prefetches; return its end time."""
        start = max(now, self.free_at)
        end = start + self.transfer_ms
        self.free_at = end
        if self.timeline is not None:
            self.timeline.append(Event(step, layer, kind, expert, start, end))
        return end


class ModelledTransport(Transport):
    """The driver's transport in the simulator: the :class:`Link` above with the layer clock of this
    module (a layer starts when the previous one ends; it waits for its demand and late transfers;
    CPU experts run beside its compute).

    Args:
        cost: the cost-model parameters; num_layers: L; expert_bytes: bytes per transfer.
        record_timeline: keep every :class:`Event`.
    """

    def __init__(self, cost: CostConfig, num_layers: int, expert_bytes: int, record_timeline: bool = False):
        self.cost = cost
        self.layer_ms = cost.compute_ms(num_layers)
        self.link = Link(cost.transfer_ms(expert_bytes), cost.queue, timeline=[] if record_timeline else None)
        self.timeline = self.link.timeline
        self.clock = 0.0
        """End of the last computed layer (ms)."""
        self.stall_ms = 0.0
        self.compute_ms = 0.0
        self._start = 0.0
        self._wait = 0.0
        self._cpu: list[tuple[int, float]] = []
        self._fetch: dict[int, _Transfer] = {}

    def begin_layer(self, x: int) -> list[tuple[int, int]]:
        self._start = self._wait = self.clock
        self._cpu = []
        out = []
        for tr in self.link.advance(self.clock):
            if self._fetch.get(tr.slot) is tr:
                del self._fetch[tr.slot]
                out.append((tr.layer, tr.expert))
        return out

    def prefetch(self, slot: int, layer: int, expert: int, t: int, deadline: int) -> None:
        self._fetch[slot] = self.link.issue_prefetch(slot, layer, expert, self.clock, deadline, t)

    def late(self, slot: int, layer: int, expert: int, t: int) -> None:
        tr = self._fetch.pop(slot)
        self._wait = max(self._wait, self.link.wait_for(tr, self._start))
        self.link.inflight.remove(tr)
        if self.timeline is not None:
            self.timeline.append(Event(t, layer, "late", expert, self._start, tr.end))

    def demand(self, slot: int, layer: int, expert: int, t: int) -> None:
        kind = "demand" if slot >= 0 else "temp"
        self._wait = max(self._wait, self.link.demand(layer, expert, self._start, t, kind=kind))

    def cpu(self, layer: int, expert: int, n_tokens: int, t: int) -> None:
        self._cpu.append((expert, self.cost.cpu_ms(n_tokens)))

    def compute(self, t: int, layer: int, counted: bool) -> None:
        now, begin, comp = self._start, self._wait, float(self.layer_ms[layer])
        cpu_ms = sum(c for _, c in self._cpu)
        if self.timeline is not None:
            if begin > now:
                self.timeline.append(Event(t, layer, "stall", -1, now, begin))
            cur = now if self.cost.cpu_parallel else begin
            for e, c in self._cpu:  # CPU experts run one after another beside the device work
                self.timeline.append(Event(t, layer, "cpu", e, cur, cur + c))
                cur += c
            self.timeline.append(Event(t, layer, "compute", -1, begin, begin + comp))
        if self.cost.cpu_parallel:  # CPU experts start with the layer, beside its transfers and compute
            self.clock = max(begin + comp, now + cpu_ms)
        else:
            self.clock = begin + max(comp, cpu_ms)
        if counted:
            self.stall_ms += self.clock - now - comp
            self.compute_ms += comp
