"""The graph decode path's layer function captured in CUDA Graphs (docs/design.md, "Graph-compatible decode
path"): on CUDA the host cost of a decode step's MoE part is one graph launch per layer instead of dozens of
kernel launches.

The layer function has fixed shapes for a batch size T and reads its layer from a device tensor, so one graph
per (T, dtypes) serves every layer. The first ``warmup`` calls of a shape run uncaptured on a side stream (they
are real calls of the decode: Triton compiles, the allocator settles, and their results are used); the next call
captures the graph over static input buffers (layer, h, idx, w) and a static output, then replays it; every
later call copies its inputs into the static buffers and replays. The device state, the pool buffer and the
host store are the decoder's own tensors, updated in place, so a replay reads and writes them as the uncaptured
call does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from expertcast.utils.errors import UsageError


@dataclass
class _Captured:
    graph: Any
    layer: torch.Tensor
    h: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor
    out: torch.Tensor


class CudaGraphLayer:
    """``(layer int64 [], h [T, H], idx int64 [T, K], w [T, K]) -> y [T, H]`` like the decoder's layer function,
    replayed from a CUDA Graph per shape (see the module docstring).

    Args:
        decoder: the graph decoder (its uncaptured layer function is captured).
        warmup: uncaptured calls of each shape before it is captured.
    """

    def __init__(self, decoder: Any, warmup: int = 2):
        if decoder.device.type != "cuda":
            raise UsageError("CUDA Graph capture of the decode layer needs a CUDA device (CPU: compile 'aoti')")
        self.fn = decoder.run_layer
        self.device = decoder.device
        self.warmup = int(warmup)
        self.graphs: dict[tuple, _Captured] = {}
        self.calls: dict[tuple, int] = {}
        self.replays = 0
        self._side: torch.cuda.Stream | None = None

    def __call__(self, layer: torch.Tensor, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        key = (tuple(h.shape), tuple(idx.shape), h.dtype, idx.dtype, w.dtype)
        cap = self.graphs.get(key)
        if cap is None:
            n = self.calls.get(key, 0)
            self.calls[key] = n + 1
            if n < self.warmup:
                return self._run_on_side_stream(layer, h, idx, w)
            cap = self.graphs[key] = self._capture(layer, h, idx, w)
        cap.layer.copy_(layer)
        cap.h.copy_(h)
        cap.idx.copy_(idx)
        cap.w.copy_(w)
        cap.graph.replay()
        self.replays += 1
        return cap.out.clone()

    def _run_on_side_stream(self, layer, h, idx, w) -> torch.Tensor:
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        cur = torch.cuda.current_stream(self.device)
        self._side.wait_stream(cur)
        with torch.cuda.stream(self._side):
            y = self.fn(layer, h, idx, w)
        cur.wait_stream(self._side)
        y.record_stream(cur)
        return y

    def _capture(self, layer, h, idx, w) -> _Captured:
        """Capture the layer function over static copies of the inputs (nothing runs during the capture)."""
        static = [t.clone() for t in (layer, h, idx, w)]
        torch.cuda.current_stream(self.device).synchronize()
        graph = torch.cuda.CUDAGraph()
        # a memory pool of its own (graphs of different shapes replay in any order); thread-local capture: the
        # planner's thread may wait on a routing-copy event meanwhile (docs/design.md, "Graph-compatible decode
        # path")
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self.fn(*static)
        return _Captured(graph, *static, out)
