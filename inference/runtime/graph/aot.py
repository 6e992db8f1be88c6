"""The graph decode path's layer function compiled ahead of time by AOTInductor (CPU; docs/design.md,
"Graph-compatible decode path")."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from expertcast.inference.runtime.graph.state import DeviceResidency
from expertcast.utils.errors import UsageError

AOTI_CONFIG = {"aot_inductor.allow_stack_allocation": True}
"""Inductor options of :class:`AOTLayer`: the intermediates of a call live on the C++ stack (a layer makes a few
dozen tiny buffers; a tensor object and a malloc per buffer cost more than the layer's fused kernel)."""


class AOTLayer:
    """:meth:`GraphDecoder.run_layer` compiled ahead of time by AOTInductor (CPU), one artefact per batch size T.

    ``torch.compile`` pays, at every call, dynamo's guard evaluation and the compiled graph's Python wrapper
    (AOTAutograd runtime wrappers, input mutation bookkeeping): hundreds of microseconds per layer on a CPU,
    more than the layer's kernels. Here the layer is exported once (``torch.export``, the device state, the
    pool buffer and the host store as inputs that the function mutates in place), compiled into a shared
    library whose C++ wrapper launches the fused kernels, and called through the package loader's ``run``:
    no guards, one Python-to-C++ call per layer. The shapes are fixed per artefact (the state's, and T x K of
    the selection): a new batch size compiles a new artefact (seconds, on first use). CPU only: on CUDA the
    host cost is removed by capturing the decode step in a CUDA Graph instead.

    Call: ``(layer int64 [] , h [T, H], idx int64 [T, K], w [T, K]) -> y [T, H]`` like ``run_layer``.
    """

    def __init__(self, decoder: Any):
        if decoder.device.type != "cpu":
            raise UsageError("the AOTInductor-compiled layer function runs on the CPU (CUDA: capture a CUDA Graph)")
        self.decoder = decoder
        self.fields = [f.name for f in dataclasses.fields(DeviceResidency)]
        self.runners: dict[tuple, Any] = {}
        """(T, dtypes of h, idx, w) -> the loaded artefact's runner."""
        self.compile_seconds: dict[int, float] = {}
        self._args: list[torch.Tensor] = []
        """The call's inputs: 4 per call, then the store, the pool buffer and the state tensors (bound once)."""
        self._bound: DeviceResidency | None = None

    def __call__(self, layer: torch.Tensor, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h, idx, w = h.contiguous(), idx.contiguous(), w.contiguous()
        key = (h.shape[0], h.dtype, idx.dtype, w.dtype)
        run = self.runners.get(key)
        if run is None:
            run = self.runners[key] = self._build(layer, h, idx, w)
        d = self.decoder
        if self._bound is not d.state:  # the argument list holds the state's tensors
            self._bind()
        a = self._args
        a[0], a[1], a[2], a[3] = layer, h, idx, w
        return run(a)[0]

    def _bind(self) -> None:
        d = self.decoder
        self._args = [d.layer_ids[0]] * 4 + [d.copier.src, d.copier.dst, *(getattr(d.state, f) for f in self.fields)]
        self._bound = d.state

    def _build(self, layer: torch.Tensor, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> Any:
        import os
        import tempfile
        import time

        t0 = time.perf_counter()
        self._bind()
        args = (layer, h, idx, w, *self._args[4:])
        with torch.no_grad():
            ep = torch.export.export(_BoundLayer(self.decoder, self.fields), args, strict=False)
            with tempfile.TemporaryDirectory(prefix="expertcast-aoti-") as tmp:
                pkg = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, "layer.pt2"),
                                                               inductor_configs=AOTI_CONFIG)
                compiled = torch._inductor.aoti_load_package(pkg)
        self.compile_seconds[h.shape[0]] = time.perf_counter() - t0
        loader = getattr(compiled, "loader", None)
        return loader.run if loader is not None else (lambda a: [compiled(*a)])


class _BoundLayer(torch.nn.Module):
    """``GraphDecoder.run_layer`` as a module whose inputs are every tensor it reads or writes (for torch.export):
    ``forward(layer, h, idx, w, store_rows, pool_buffer, *state_fields)``. While it runs, the decoder's state,
    pool views and row copier point at the inputs."""

    def __init__(self, decoder: Any, fields: list[str]):
        super().__init__()
        self.decoder = decoder  # not a Module: not registered, no parameters or buffers
        self.fields = fields

    def forward(self, layer, h, idx, w, store_rows, pool_buffer, *state):
        d = self.decoder
        saved = d.state, d.weights, d.copier.src, d.copier.dst
        d.state = DeviceResidency(**dict(zip(self.fields, state, strict=True)))
        d.weights = d.weight_views(pool_buffer)
        d.copier.src, d.copier.dst = store_rows, pool_buffer
        try:
            return d.run_layer(layer, h, idx, w)
        finally:
            d.state, d.weights, d.copier.src, d.copier.dst = saved
