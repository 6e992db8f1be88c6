"""Device slot pool: fixed expert buffers addressed by the slot indices of the shared ExpertCache.

The pool is one tensor [num_slots + num_temp, row_numel] allocated once on the compute device; slot
``s`` holds one packed expert row (layout: :class:`~expertcast.inference.runtime.store.ExpertLayout`)
and exposes named weight views of it. The cache's slot table (:class:`expertcast.inference.cache.expert_cache.
ExpertCache`) decides which expert lives in which slot; the pool only owns the bytes. ``num_temp``
extra slots at the end serve ``MissAction.TEMP`` loads and selections larger than the pool (a batch
or a prefill routing to more experts than fit): they are used once and never hold a resident expert.
"""

from __future__ import annotations

import torch
from expertcast.inference.runtime.store import ExpertLayout


class SlotPool:
    """Fixed device buffers for ``num_slots`` resident experts plus ``num_temp`` temporary slots.

    Attributes:
        buffer: tensor [num_slots + num_temp, row_numel] on ``device``.
    """

    def __init__(self, layout: ExpertLayout, num_slots: int, device: torch.device | str, num_temp: int = 2,
                 io_stride_bytes: int | None = None, io_align: int = 4096):
        if num_slots < 1:
            raise ValueError(f"slot pool needs at least one slot, got {num_slots}")
        if num_temp < 1:
            raise ValueError(f"slot pool needs at least one temporary slot, got {num_temp}")
        self.layout = layout
        self.num_slots = int(num_slots)
        self.num_temp = int(num_temp)
        self.device = torch.device(device)
        n = self.num_slots + self.num_temp
        self.io_stride_bytes = None
        if io_stride_bytes is not None and self.device.type == "cpu":
            # disk store on the CPU: each slot starts on an io_align boundary and owns io_stride_bytes, so that
            # a direct read lands straight in the slot (docs/design.md, "Disk tier")
            itemsize = torch.empty((), dtype=layout.dtype).element_size()
            if io_stride_bytes % io_align or io_stride_bytes < layout.row_numel * itemsize:
                raise ValueError(f"slot stride {io_stride_bytes} must be a multiple of {io_align} holding a row")
            raw = torch.zeros(n * io_stride_bytes + io_align, dtype=torch.uint8)
            off = (-raw.data_ptr()) % io_align
            self._io = raw[off:off + n * io_stride_bytes].view(n, io_stride_bytes)
            self._raw = raw
            self.buffer = self._io.view(layout.dtype)[:, :layout.row_numel]
            self.io_stride_bytes = int(io_stride_bytes)
        else:
            self.buffer = torch.zeros((n, layout.row_numel), dtype=layout.dtype, device=self.device)
        self._views = [layout.views(self.buffer[i]) for i in range(self.buffer.shape[0])]
        self._next_temp = 0

    @property
    def nbytes(self) -> int:
        """Device bytes held by the pool (resident + temporary slots)."""
        if self.io_stride_bytes is not None:
            return self._raw.numel()
        return self.buffer.numel() * self.buffer.element_size()

    def read_target(self, slot: int) -> torch.Tensor:
        """Where a disk read into ``slot`` goes: the slot's whole aligned ``io_stride_bytes`` (uint8) when the
        pool was laid out for direct reads, else its packed row."""
        if self.io_stride_bytes is not None:
            return self._io[slot]
        return self.buffer[slot]

    def row(self, slot: int) -> torch.Tensor:
        """Packed row [row_numel] of ``slot`` (a view)."""
        return self.buffer[slot]

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        """Named weight views of the expert held by ``slot``."""
        return self._views[slot]

    def temp_slot(self) -> int:
        """Index of the next temporary slot (round robin over the ``num_temp`` reserved ones)."""
        s = self.num_slots + self._next_temp
        self._next_temp = (self._next_temp + 1) % self.num_temp
        return s
