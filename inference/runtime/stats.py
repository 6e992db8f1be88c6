"""What the offloading runtime reports: decode counters and timings (:class:`RuntimeStats`) and the
memory it holds (:class:`MemoryReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from expertcast.inference.cache.counters import Counters
from expertcast.inference.runtime.memory import peak_rss_bytes


@dataclass
class RuntimeStats(Counters):
    """The :class:`~expertcast.inference.cache.counters.Counters` of decode steps only (prefill is
    uncounted), which the driver (:class:`expertcast.inference.cache.driver.Driver`) writes, plus timings.

    Same counters and metrics as :class:`expertcast.inference.sim.simulator.ReplayResult`.
    """

    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    warmup_seconds: float = 0.0
    """Replaying the prompt routing through the policy and copying the post-prefill resident set
    (between the first token and the first decode step; in neither TTFT nor decode time)."""
    stall_seconds: float = 0.0
    """Host time blocked waiting for transfers (demand loads and late prefetches) in decode."""
    ttft_seconds: list[float] = field(default_factory=list)
    """Time to first token of each generate() call."""
    forecaster: bool = False
    """The policy runs a forecaster (the ``forecaster_*`` fields below are its decode-time cost)."""
    forecaster_seconds: float = 0.0
    """Time of the forecaster's steps (and rollouts) in decode, on whichever thread ran them (wall time)."""
    forecaster_cpu_seconds: float = 0.0
    """CPU time of the thread that ran those steps, over the same calls: below the wall time by what the thread
    waited for a core (or, on CUDA, for the device)."""
    forecaster_path_seconds: float = 0.0
    """Time the decoding thread spent on forecasting (the steps themselves when they run inline; handing elements
    to the worker and installing its forecasts when asynchronous)."""
    forecaster_calls: int = 0
    forecaster_flops: int = 0
    forecasts_dropped: int = 0
    """Forecasts that did not arrive by their deadline (too stale, superseded, or abandoned with their batch)."""
    forecaster_precompute_seconds: float = 0.0
    """Time the forecaster spent computing a replay's forecast tables before its decode (forced routing is known
    ahead): not in the decode time, so not in tokens/s; reported beside it."""
    forecaster_precompute_elements: int = 0
    forecaster_precompute_flops: int = 0

    @property
    def io_overlap(self) -> float:
        """Share of the decode's read-busy time the compute did not wait for: 1 - stall / read busy (NaN
        without reads)."""
        if self.read_busy_seconds <= 0:
            return float("nan")
        return max(0.0, 1.0 - self.stall_seconds / self.read_busy_seconds)

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
            **self.read_metrics(),
            "miss_free_token_frac": self.steps_without_miss / max(len(self.step_demand), 1),
            "io_overlap": self.io_overlap,
            **self.forecaster_metrics(),
        }

    def forecaster_metrics(self) -> dict[str, Any]:
        """:func:`forecaster_cost` of this run's decode ({} without a forecaster)."""
        if not self.forecaster:
            return {}
        return forecaster_cost({k: getattr(self, f) for k, f in FORECASTER_FIELDS.items()}, self.decode_steps,
                               self.decode_seconds)

    def add_forecaster_cost(self, now: dict[str, float] | None, before: dict[str, float] | None,
                            call_before: dict[str, float] | None = None) -> None:
        """Add the policy's forecaster counters accumulated between ``before`` and ``now``
        (:func:`forecaster_counters` readings; nothing when the policy has no forecaster); the precompute counters
        from ``call_before`` (the call's start: tables are computed when its batch opens), else from ``before``."""
        if now is None:
            return
        self.forecaster = True
        for k, f in FORECASTER_FIELDS.items():
            b = call_before if k in PRECOMPUTE_KEYS and call_before is not None else before
            setattr(self, f, getattr(self, f) + now[k] - (b[k] if b is not None else 0))

    def snapshot(self) -> dict:
        """A copy of every field (for :meth:`since`)."""
        return {k: (v.copy() if isinstance(v, np.ndarray) else (list(v) if isinstance(v, list) else v))
                for k, v in self.__dict__.items()}

    def since(self, before: dict) -> RuntimeStats:
        """The stats accumulated after ``before`` (a :meth:`snapshot`)."""
        out = RuntimeStats(self.num_layers, self.expert_bytes)
        for k, v in self.__dict__.items():
            b = before[k]
            if isinstance(v, np.ndarray):
                setattr(out, k, v - b)
            elif isinstance(v, list):
                setattr(out, k, v[len(b):])
            elif isinstance(v, (int, float)) and k not in ("num_layers", "expert_bytes", "forecaster"):
                setattr(out, k, v - b)
        out.forecaster = self.forecaster
        return out


FORECASTER_FIELDS = {"forecast_seconds": "forecaster_seconds", "forecast_cpu_seconds": "forecaster_cpu_seconds",
                     "forecast_path_seconds": "forecaster_path_seconds",
                     "forecast_calls": "forecaster_calls", "forecast_flops": "forecaster_flops",
                     "dropped": "forecasts_dropped", "precompute_seconds": "forecaster_precompute_seconds",
                     "precompute_elements": "forecaster_precompute_elements",
                     "precompute_flops": "forecaster_precompute_flops"}
"""A forecasting policy's ``stats`` keys (:func:`forecaster_counters`) and the :class:`RuntimeStats` fields they
add to."""
PRECOMPUTE_KEYS = ("precompute_seconds", "precompute_elements", "precompute_flops")
"""The keys of :data:`FORECASTER_FIELDS` counted when a replay's batch opens (its forecast tables), not in decode."""


def forecaster_counters(policy: Any) -> dict[str, float] | None:
    """The forecaster's running counters in ``policy.stats`` (keys of :data:`FORECASTER_FIELDS`), None when the
    policy runs no forecaster."""
    st = getattr(policy, "stats", None)
    if not isinstance(st, dict) or "forecast_calls" not in st:
        return None
    return {k: st.get(k, 0) for k in FORECASTER_FIELDS}


def forecaster_cost(totals: dict[str, float], steps: int, decode_seconds: float) -> dict[str, Any]:
    """The forecaster's cost per decode step from its totals over ``steps`` decode steps of ``decode_seconds``
    (keys of :data:`FORECASTER_FIELDS`): its time (ms and share of the step; wall, and the CPU time of the thread
    that ran it), the decoding thread's share of it
    (``path``: what the decode waited for), calls and FLOPs per step, forecasts dropped."""
    n = max(int(steps), 1)

    def share(s: float) -> float:
        return s / decode_seconds if decode_seconds > 0 else float("nan")

    return {"forecaster_ms_per_step": 1e3 * totals["forecast_seconds"] / n,
            "forecaster_share": share(totals["forecast_seconds"]),
            "forecaster_cpu_ms_per_step": 1e3 * totals["forecast_cpu_seconds"] / n,
            "forecaster_path_ms_per_step": 1e3 * totals["forecast_path_seconds"] / n,
            "forecaster_path_share": share(totals["forecast_path_seconds"]),
            "forecaster_calls_per_step": totals["forecast_calls"] / n,
            "forecaster_flops_per_step": totals["forecast_flops"] / n,
            "forecasts_dropped": int(totals["dropped"]),
            **precompute_cost(totals)}


def precompute_cost(totals: dict[str, float]) -> dict[str, Any]:
    """The forecast tables a replay computed before its decode (:data:`PRECOMPUTE_KEYS` of ``totals``): elements,
    seconds, ms and FLOPs per element ({} when none were computed in the run)."""
    n = int(totals.get("precompute_elements", 0))
    if n <= 0:
        return {}
    return {"forecaster_precomputed_elements": n, "forecaster_precompute_s": totals["precompute_seconds"],
            "forecaster_precompute_ms_per_element": 1e3 * totals["precompute_seconds"] / n,
            "forecaster_precompute_flops_per_element": totals["precompute_flops"] / n}


def forecaster_line(m: dict[str, Any]) -> str | None:
    """One printed line of :func:`forecaster_cost`'s metrics ``m`` (None without them)."""
    if m.get("forecaster_ms_per_step") is None:
        return None
    return (f"forecaster: {m['forecaster_ms_per_step']:.3f} ms/step ({100 * m['forecaster_share']:.1f}% of the decode "
            f"step; CPU {m['forecaster_cpu_ms_per_step']:.3f} ms/step), on the decode path "
            f"{m['forecaster_path_ms_per_step']:.3f} ms/step "
            f"({100 * m['forecaster_path_share']:.1f}%), {m['forecaster_calls_per_step']:.2f} calls/step, "
            f"{m['forecaster_flops_per_step'] / 1e6:.3f} MFLOP/step, {m['forecasts_dropped']} forecasts dropped"
            + (f"; tables precomputed before the decode (not in tokens/s): {m['forecaster_precomputed_elements']} "
               f"elements in {m['forecaster_precompute_s']:.2f} s, {m['forecaster_precompute_ms_per_element']:.3f} "
               f"ms and {m['forecaster_precompute_flops_per_element'] / 1e6:.3f} MFLOP per element"
               if m.get("forecaster_precomputed_elements") else ""))


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
    store_kind: str = "ram"
    """``ram`` (host store) or ``disk`` (the experts in a disk store file: none in host RAM)."""
    disk_store_bytes: int = 0
    """Disk store: bytes of the packed (4096-padded) rows in its file."""
    process_peak_rss: int | None = None
    """:func:`peak_rss_bytes` when measured: the process's resident-set
    high-water mark in bytes since it started (``VmHWM``), so it includes everything the process held
    before (imports, an earlier model), not the offloaded model alone."""

    @property
    def device_total(self) -> int:
        return self.device_non_expert_bytes + self.device_slot_bytes + self.device_workspace_bytes

    @property
    def expected_device(self) -> int:
        return self.device_non_expert_bytes + (self.num_slots + self.num_temp_slots) * self.expert_bytes

    @classmethod
    def measure(cls, om: Any) -> MemoryReport:
        """The report of an :class:`~expertcast.inference.runtime.engine.OffloadedModel` now."""
        import torch

        expert_param_ids = {id(getattr(r.module, p.name)) for r in om.refs for p in (om.layout.base or om.layout).parts}
        non_expert = expert_left = 0
        for p in om.model.parameters():
            if id(p) in expert_param_ids:
                expert_left += p.numel() * p.element_size()
            elif p.device.type == om.device.type:
                non_expert += p.numel() * p.element_size()
        for b in om.model.buffers():
            if b.device.type == om.device.type:
                non_expert += b.numel() * b.element_size()
        peak = torch.cuda.max_memory_allocated(om.device) if om.device.type == "cuda" else None
        disk = getattr(om, "readers", None) is not None
        return cls(host_expert_bytes=0 if disk else om.store.nbytes, store_kind="disk" if disk else "ram",
                   disk_store_bytes=om.store.nbytes if disk else 0, host_mmap=om.store.mmap_path is not None,
                   host_pinned=om.store.is_pinned, device_non_expert_bytes=non_expert,
                   device_slot_bytes=om.pool.nbytes, device_workspace_bytes=om.workspace.nbytes,
                   num_slots=om.cache.num_slots, num_temp_slots=om.pool.num_temp, expert_bytes=om.layout.expert_bytes,
                   device_expert_param_bytes=expert_left, device_peak_allocated=peak,
                   process_peak_rss=peak_rss_bytes())

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["device_total"] = self.device_total
        d["expected_device_weights"] = self.expected_device
        return d


# -- per-row memory ---------------------------------------------------------------------------------------
def release_memory() -> None:
    """Collect, and hand freed heap back to the OS (glibc ``malloc_trim``), so that the next run's slots do not
    stack on the last one's in the RSS."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (``/proc/self/clear_refs`` 5), so that ``VmHWM`` then reads the
    peak of what follows; False where the kernel refuses."""
    from pathlib import Path

    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class RowPeak:
    """The peak RSS of one row of a command that runs several (policies, capacities): entering it releases what
    the last row freed and resets the process's high-water mark (:func:`reset_peak_rss`); :attr:`bytes` then
    reads ``VmHWM``, the peak since (``scope`` ``row``), or the process's peak since it started where the kernel
    refuses the reset (``scope`` ``process``)."""

    def __enter__(self) -> RowPeak:
        release_memory()
        self.scope = "row" if reset_peak_rss() else "process"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bytes = peak_rss_bytes()
