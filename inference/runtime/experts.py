"""The offloaded experts implementation, registered in transformers' ``ExpertsInterface``.

``model.set_experts_implementation("expertcast_offload")`` routes every fused experts module to
:func:`offloaded_experts_forward`, which hands the layer to the runtime bound to the module
(:class:`~expertcast.inference.runtime.engine.OffloadedModel`). The runtime decides residency (policy,
cache, transfers) and then calls :func:`grouped_expert_compute`, which does the arithmetic:

1. expert-aligned repacking: the (token, k) pairs are sorted by expert and their hidden states
   gathered into a contiguous workspace, so that each expert runs one GEMM per projection;
2. per expert, the weights come from a device slot, a temporary slot, or (cold experts executed
   in situ, SAEM) the host store on the CPU;
3. outputs are weighted and reduced over the K choices in the same order as transformers'
   ``grouped_mm`` path, so greedy generations match the full-load model.

The workspace is allocated once and reused; it only grows when a longer batch (prefill) arrives.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from expertcast.inference.runtime.quant import QWeight
from torch import nn

IMPLEMENTATION_NAME = "expertcast_offload"
RUNTIME_ATTR = "_expertcast_runtime"
LAYER_ATTR = "_expertcast_layer"


class Workspace:
    """Reusable flat buffers keyed by name on one device and dtype."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = torch.device(device)
        self.dtype = dtype
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor of ``shape`` backed by the named buffer (grown when too small, never shrunk)."""
        n = 1
        for s in shape:
            n *= s
        dt = dtype or self.dtype
        key = f"{name}:{dt}"
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=dt, device=self.device)
            self._bufs[key] = buf
        return buf[:n].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def _project(x: torch.Tensor, W: torch.Tensor | QWeight, transposed: bool, out: torch.Tensor | None) -> torch.Tensor:
    """``x`` through one projection: a weight tensor ([N, K], or [K, N] when ``transposed``), or a quantized
    :class:`~.quant.QWeight` (its calibrated kernel; docs/design.md, "Expert formats")."""
    if isinstance(W, QWeight):
        return W.mm(x, out=out)
    W = W if transposed else W.t()
    return torch.mm(x, W, out=out) if out is not None else torch.mm(x, W)


def _expert_mlp(module: nn.Module, x: torch.Tensor, w: dict[str, torch.Tensor | QWeight], out: torch.Tensor,
                gate_up_out: torch.Tensor | None) -> None:
    """One expert on rows ``x`` [n, H] with weights ``w``; writes ``out`` [n, H]."""
    t = module.is_transposed
    if module.has_gate:
        W1, b1 = w["gate_up_proj"], w.get("gate_up_proj_bias")
    else:
        W1, b1 = w["up_proj"], w.get("up_proj_bias")
    h = _project(x, W1, t, gate_up_out)
    if b1 is not None:
        h.add_(b1)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    _project(h, w["down_proj"], t, out)
    b2 = w.get("down_proj_bias")
    if b2 is not None:
        out.add_(b2)


def expert_forward(module: nn.Module, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """One expert of ``module`` on rows ``x`` [n, H] with weights ``w`` (on ``x``'s device) -> [n, H]."""
    out = torch.empty_like(x)
    _expert_mlp(module, x, w, out, None)
    return out


class Grouping:
    """The (token, k) pairs of one layer-execution grouped by expert (expert-aligned repacking).

    Attributes:
        flat: list [T*K] of expert ids (router order, token-major).
        perm: int64 tensor [T*K] on the compute device: flattened index of each sorted row (by expert,
            stable).
        counts: list [E] rows routed to each expert.
        active: experts with at least one row, ascending (the row order of the repacked workspace).
        selected / selected_counts: the union in first-appearance order and the tokens routed to each
            (the policy's ``selected`` and ``counts``).
    """

    __slots__ = ("flat", "perm", "counts", "active", "selected", "selected_counts")

    def __init__(self, top_k_index: torch.Tensor, num_experts: int):
        flat = top_k_index.reshape(-1).tolist()  # one host sync per layer: the runtime needs the routing
        counts = [0] * num_experts
        for e in flat:
            counts[e] += 1
        self.flat = flat
        self.counts = counts
        order = sorted(range(len(flat)), key=flat.__getitem__)  # stable
        self.perm = torch.tensor(order, dtype=torch.long, device=top_k_index.device)
        self.active = [e for e in range(num_experts) if counts[e]]
        first = list(dict.fromkeys(flat))
        self.selected = np.asarray(first, dtype=np.int64)
        self.selected_counts = np.asarray([counts[e] for e in first], dtype=np.int64)


def group_by_expert(top_k_index: torch.Tensor, num_experts: int) -> Grouping:
    """Group the flattened (token, k) pairs of ``top_k_index`` int [T, K] by expert."""
    return Grouping(top_k_index, num_experts)


def grouped_expert_compute(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights_of: Callable[[int], dict[str, torch.Tensor]],
    workspace: Workspace,
    grouping: Grouping | None = None,
    cpu_weights_of: Callable[[int], dict[str, torch.Tensor]] | None = None,
    cpu_experts: frozenset[int] | set[int] = frozenset(),
    before_expert: Callable[[int], None] | None = None,
    after_expert: Callable[[int], None] | None = None,
    cpu_async: Callable[[int, torch.Tensor], Callable[[], torch.Tensor]] | None = None,
    next_expert: Callable[[list[int]], int] | None = None,
) -> torch.Tensor:
    """Mixture output of the routed experts with weights supplied per expert.

    Args:
        hidden_states: [T, H]; top_k_index: int [T, K]; top_k_weights: [T, K].
        weights_of: expert -> named weight views on the compute device (a slot).
        cpu_weights_of / cpu_experts: experts computed on the CPU from their host copies.
        before_expert: called with each expert right before its GEMMs (the runtime waits for the
            expert's transfer there, so other experts compute while later transfers land).
        after_expert: called with each expert once its kernels were issued.
        cpu_async: CPU experts in parallel with the device's: called with each CPU expert and its
            repacked rows [n, H] (on the CPU) before any device expert runs; returns a function that
            gives the rows' output [n, H] (waiting for the host thread), collected after the device
            experts. ``before_expert``/``after_expert`` are not called for these experts.
        next_expert: the compute order: called with the experts still to compute (ascending) and returns
            the one to compute next (the runtime: an expert whose bytes are there, else the first read to
            land; docs/design.md, "Compute order"). None: ascending expert id. Each expert writes only its
            own rows and the combine below runs in a fixed order, so the output does not depend on it.
    Returns:
        [T, H] in ``hidden_states.dtype``.
    """
    T, H = hidden_states.shape
    K = top_k_index.shape[-1]
    S = T * K
    g = grouping if grouping is not None else Grouping(top_k_index, module.num_experts)
    perm, cnt, active = g.perm, g.counts, g.active
    dtype = workspace.dtype
    x = workspace.get("x", S, H)
    torch.index_select(hidden_states.to(dtype), 0, perm // K, out=x)
    y = workspace.get("y", S, H)
    gu_width = None
    offsets = np.cumsum([0] + [cnt[e] for e in active]).tolist()
    pending = {}  # CPU expert -> (start, end, result getter): run on a host thread beside the loop below
    if cpu_async is not None:
        for i, e in enumerate(active):
            if e in cpu_experts:
                s0, s1 = offsets[i], offsets[i + 1]
                pending[e] = (s0, s1, cpu_async(e, x[s0:s1].to("cpu")))
    span = {e: (offsets[i], offsets[i + 1]) for i, e in enumerate(active)}
    todo = [e for e in active if e not in pending]
    while todo:
        e = todo[0] if next_expert is None else next_expert(todo)
        todo.remove(e)
        start, end = span[e]
        n = end - start
        if before_expert is not None:
            before_expert(e)
        if e in cpu_experts:
            w = cpu_weights_of(e)
            xc = x[start:end].to("cpu")
            yc = torch.empty((n, H), dtype=xc.dtype)
            _expert_mlp(module, xc, w, yc, None)
            y[start:end].copy_(yc, non_blocking=False)
        else:
            w = weights_of(e)
            if gu_width is None:
                W1 = w["gate_up_proj" if module.has_gate else "up_proj"]
                gu_width = W1.N if isinstance(W1, QWeight) else W1.shape[1] if module.is_transposed else W1.shape[0]
            gu = workspace.get("gu", S, gu_width)[start:end]
            _expert_mlp(module, x[start:end], w, y[start:end], gu)
        if after_expert is not None:
            after_expert(e)
    for s0, s1, result in pending.values():
        y[s0:s1].copy_(result(), non_blocking=False)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    sw = top_k_weights.reshape(-1)[perm].to(y.dtype)
    weighted = y * sw.unsqueeze(-1)
    unsorted = workspace.get("u", S, H)
    unsorted[perm] = weighted
    return unsorted.view(T, K, H).sum(dim=1).to(hidden_states.dtype)


def offloaded_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """``ExpertsInterface`` entry point: delegate to the runtime bound to this experts module."""
    runtime = getattr(self, RUNTIME_ATTR, None)
    if runtime is None:
        raise RuntimeError(
            f"{type(self).__name__} uses the {IMPLEMENTATION_NAME!r} experts implementation but is not bound to "
            "an OffloadedModel; build one with expertcast.inference.runtime.engine.OffloadedModel")
    return runtime.forward_layer(self, getattr(self, LAYER_ATTR), hidden_states, top_k_index, top_k_weights)


QUANTIZED_NAME = "expertcast_quantized"
"""The full-load quantized experts implementation: every expert resident in its format, no runtime."""
QROWS_ATTR = "_expertcast_qrows"


def quantized_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """``ExpertsInterface`` entry point of a model quantized with :func:`quantize_model_experts`: the same
    grouped compute and kernels as the offloaded runtime, on rows that are all resident."""
    lay, rows, ws = getattr(self, QROWS_ATTR)
    views = [lay.views(rows[e]) for e in range(lay.num_experts)]
    return grouped_expert_compute(self, hidden_states, top_k_index, top_k_weights, views.__getitem__, ws)


def quantize_model_experts(model: nn.Module, fmt: str) -> nn.Module:
    """Full-load reference of a model whose experts are stored in ``fmt`` (docs/design.md, "Expert formats"):
    each experts module's fused weights are replaced by its packed rows in the format (on the module's
    device) and computed by :func:`quantized_experts_forward`. Returns ``model``."""
    from expertcast.inference.runtime.store import (
        _pack_layer,
        find_experts_modules,
        layout_of,
        quantized_layout,
        release_model_experts,
    )
    from transformers.integrations.moe import ExpertsInterface

    refs = find_experts_modules(model)
    for r in refs:
        base = layout_of(r.module)
        lay = quantized_layout(base, fmt)
        dev = getattr(r.module, base.parts[0].name).device
        rows = torch.empty((lay.num_experts, lay.row_numel), dtype=lay.dtype)
        _pack_layer(r.module, lay, rows)
        release_model_experts([r], base)
        setattr(r.module, QROWS_ATTR, (lay, rows.to(dev), Workspace(dev, lay.act_dtype)))
    ExpertsInterface.register(QUANTIZED_NAME, quantized_experts_forward)
    model.set_experts_implementation(QUANTIZED_NAME)
    return model


def register() -> str:
    """Register the implementation with transformers (idempotent) and return its name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, offloaded_experts_forward)
    return IMPLEMENTATION_NAME
