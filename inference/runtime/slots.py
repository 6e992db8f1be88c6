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

    def __init__(self, layout: ExpertLayout, num_slots: int, device: torch.device | str, num_temp: int = 2):
        if num_slots < 1:
            raise ValueError(f"slot pool needs at least one slot, got {num_slots}")
        if num_temp < 1:
            raise ValueError(f"slot pool needs at least one temporary slot, got {num_temp}")
        self.layout = layout
        self.num_slots = int(num_slots)
        self.num_temp = int(num_temp)
        self.device = torch.device(device)
        self.buffer = torch.zeros((self.num_slots + self.num_temp, layout.row_numel), dtype=layout.dtype,
                                  device=self.device)
        self._views = [layout.views(self.buffer[i]) for i in range(self.buffer.shape[0])]
        self._next_temp = 0

    @property
    def nbytes(self) -> int:
        """Device bytes held by the pool (resident + temporary slots)."""
        return self.buffer.numel() * self.buffer.element_size()

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
