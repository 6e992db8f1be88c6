"""Row copies of the graph decode path: expert rows of the host store into rows of the device slot pool, inside
the device computation (docs/design.md, "Graph-compatible decode path")."""

from __future__ import annotations

import torch


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
            from expertcast.inference.runtime.graph.triton import copy_rows

            self._kernel = copy_rows

    def copy(self, src_keys: torch.Tensor, dst_rows: torch.Tensor, mask: torch.Tensor) -> None:
        if self.cuda:
            self._kernel(self.src, self.dst, src_keys, dst_rows, mask)
        else:
            self.dst.index_copy_(0, dst_rows, self.src.index_select(0, src_keys))
