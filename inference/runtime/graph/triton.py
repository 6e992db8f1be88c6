"""CUDA miss copies of the graph decode path (:mod:`.decode`): a Triton kernel that copies expert rows
from pinned host memory, addressed on the device through unified virtual addressing (pinned host memory is
device-mapped at the same address), into rows of the device slot pool. Rows whose mask is 0 move no bytes.
Imported only on CUDA devices with Triton installed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _copy_rows_kernel(src_addr, dst_ptr, src_idx_ptr, dst_idx_ptr, mask_ptr, row_numel, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    on = tl.load(mask_ptr + i) != 0
    src_row = tl.load(src_idx_ptr + i).to(tl.int64)
    dst_row = tl.load(dst_idx_ptr + i).to(tl.int64)
    offs = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = (offs < row_numel) & on
    src = src_addr.to(tl.pointer_type(dst_ptr.dtype.element_ty))
    v = tl.load(src + src_row * row_numel + offs, mask=m)
    tl.store(dst_ptr + dst_row * row_numel + offs, v, mask=m)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
              mask: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] where mask[i]; src: pinned host [S, n], dst: device [R, n]."""
    if not src.is_pinned():
        raise ValueError("the host store must be pinned for device-side copies")
    n = src.shape[1]
    grid = (src_rows.numel(), triton.cdiv(n, BLOCK))
    _copy_rows_kernel[grid](src.data_ptr(), dst, src_rows, dst_rows, mask.to(torch.int8), n, BLOCK=BLOCK)
