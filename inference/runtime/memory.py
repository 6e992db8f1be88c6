"""The memory side of an offloaded load (docs/design.md, "Runtime"): what the host and the device have free now,
the process's peak resident set, and the sizes of a load (:class:`LoadPlan`, from config.json and the checkpoint
headers) and what it took (:class:`LoadReport`). :mod:`expertcast.inference.runtime.loading` does the load and
re-exports these names."""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from expertcast.utils.errors import UsageError


def _proc_kib_field(path: str, name: str) -> int | None:
    """The ``name:  N kB`` line of a /proc file (``/proc/meminfo``, ``/proc/self/status``) in bytes; None
    where the file or the line is missing (not Linux)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (None where unknown)."""
    return _proc_kib_field("/proc/meminfo", "MemAvailable")


def device_free_bytes(device: torch.device) -> int | None:
    """Free bytes on ``device`` now: ``torch.cuda.mem_get_info`` on CUDA, host MemAvailable on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        return host_available_bytes()
    return None


def gb(n: int) -> str:
    """``n`` bytes as decimal gigabytes, for messages."""
    return f"{n / 1e9:.2f} GB"


@dataclass
class LoadPlan:
    """Sizes of an offloaded load, from config.json and the checkpoint headers (no weights read)."""

    model_dir: str
    device: str
    dtype: str
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    """Bytes of one routed expert (one store row / one slot) at the load dtype."""
    expert_bytes_total: int
    """L * E * expert_bytes: the host store."""
    non_expert_bytes: int
    """Parameters and buffers that stay on the device (attention, embeddings, norms, routers, shared
    experts, dense layers)."""
    num_slots: int
    num_temp_slots: int
    slot_bytes: int
    """Device bytes of the slot pool (resident + temporary slots)."""
    device_free: int | None
    host_available: int | None
    checkpoint_files: list[str] = field(default_factory=list)
    checkpoint_layout: str = ""
    """``per-expert`` (converted on load), ``fused`` or ``mixed``."""
    expert_format: str = "bfloat16"
    """The experts' format in the store and the slots (``expert_bytes`` is its row)."""

    @property
    def full_load_fits(self) -> bool:
        """The whole model (non-expert weights + all experts) fits the device's free memory now."""
        total = self.non_expert_bytes + self.expert_bytes_total
        return self.device_free is None or total <= self.device_free

    def check_fits(self, mmap: bool, capacity_flag: str = "--capacity/--slots") -> None:
        """Refuse (UsageError) when the slots do not fit the device or the experts do not fit the host."""
        dev = self.non_expert_bytes + self.slot_bytes
        if self.device_free is not None and self.device.startswith("cuda") and dev > self.device_free:
            raise UsageError(
                f"the slots do not fit {self.device}: {self.num_slots} slots + {self.num_temp_slots} temporary x "
                f"{self.expert_bytes / 1e6:.2f} MB = {gb(self.slot_bytes)} plus {gb(self.non_expert_bytes)} of "
                f"non-expert weights exceed the {gb(self.device_free)} free; lower {capacity_flag}")
        host = self.expert_bytes_total + (self.non_expert_bytes + self.slot_bytes if self.device == "cpu" else 0)
        if not mmap and self.host_available is not None and host > self.host_available:
            what = "the experts" if self.device != "cpu" else "the experts, the slots and the non-expert weights"
            raise UsageError(
                f"host memory cannot hold {what}: {gb(host)} needed ({self.num_layers} layers x "
                f"{self.num_experts} experts x {self.expert_bytes / 1e6:.2f} MB), {gb(self.host_available)} "
                f"available; memory-map the expert store (--mmap-store) or free memory")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "full_load_fits": self.full_load_fits}


@dataclass
class LoadReport:
    """What :func:`load_offloaded` did and the memory it took."""

    plan: LoadPlan
    load_seconds: float
    store_pinned: bool
    store_mmap: str | None
    unused_checkpoint_keys: list[str]
    """Checkpoint tensors the model has no place for (e.g. multi-token-prediction layers)."""
    peak_rss_bytes: int
    """:func:`peak_rss_bytes` right after loading: the process's resident-set high-water mark since it
    started, in bytes (the load's peak, plus whatever the process held before it)."""
    device_peak_bytes: int | None
    """torch.cuda.max_memory_allocated after loading (None on CPU)."""
    source: str = "checkpoint"
    """``checkpoint`` (streamed from safetensors) or ``host`` (a tiny preset or an adapter export, built in
    host memory first)."""
    store_kind: str = "ram"
    disk_path: str | None = None
    disk_io_mode: str | None = None
    """``direct`` (O_DIRECT) or ``buffered+dontneed`` (the file system refused O_DIRECT)."""
    readers: int | None = None
    prefetch_chunk_kb: int | None = None
    """Disk store: the block size in KiB of a prefetch read that yields to demand reads (0: whole reads)."""
    rss_bound_bytes: int | None = None
    """Disk store: the stated host RSS bound, slots (CPU) + non-expert weights + one MoE layer's rows (the
    writer's buffer; quantized experts: plus that layer's unquantized rows) + :data:`RSS_MARGIN_BYTES`,
    whatever the size of the expert file. A model built in
    host memory first (``source="host"``) held its experts in RAM once, beyond this bound."""

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "plan"}
        d["plan"] = self.plan.to_dict()
        d["unused_checkpoint_keys"] = self.unused_checkpoint_keys[:20]
        d["num_unused_checkpoint_keys"] = len(self.unused_checkpoint_keys)
        return d


RSS_MARGIN_BYTES = 1 << 30
"""The disk store's stated host RSS margin (1 GiB): interpreter, torch, transformers, workspace, KV cache."""


def peak_rss_bytes() -> int:
    """Peak resident set of this process, in bytes: ``VmHWM`` of /proc/self/status, the high-water mark of
    this program's own address space since it was exec'd (it never goes down: a measurement is the peak
    up to now, including imports and whatever the process held before the thing being measured).
    Without /proc, ``ru_maxrss`` (converted: KiB on Linux and the BSDs, bytes on macOS). ``ru_maxrss`` is not
    used on Linux because it is carried over ``execve``: a subprocess started by a large parent would report
    the parent's peak."""
    hwm = _proc_kib_field("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere
