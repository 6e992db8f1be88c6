"""Forced routing for the full-load model: the baseline of the runtime's replay benchmarks.

:meth:`OffloadedModel.replay` runs recorded routing through the offloaded runtime. To compare speeds
under the *same* routing, :class:`FullLoadReplayer` runs the plain model (all experts on the device,
transformers' own ``grouped_mm`` experts kernel) with the same recorded tokens and routing
substituted for its routers' choices, through the registered ``expertcast_forced`` implementation.

:func:`map_trace_to_model` lays any trace (collected here, imported, synthetic) onto a model of another
shape (:class:`TraceMapping` states how: layers identity / cycled / first, the K highest-weight experts, ids
kept), so random-weight models of real shapes replay real routing (docs/design.md, "Real shapes").
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.runtime.store import find_experts_modules
from expertcast.models.backbone import standard_lm_head_input
from torch import nn

FORCED_NAME = "expertcast_forced"
_ATTR = "_expertcast_forced"


def _forced_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    src = getattr(self, _ATTR, None)
    if src is None:
        raise RuntimeError(f"{type(self).__name__} uses {FORCED_NAME!r} but no FullLoadReplayer is bound to it")
    idx, w = src(hidden_states)
    return ALL_EXPERTS_FUNCTIONS[src.inner](self, hidden_states, idx, w)


def register() -> str:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(FORCED_NAME, _forced_forward)
    return FORCED_NAME


@dataclass
class ReplayTiming:
    decoded_tokens: int
    decode_seconds: float
    prefill_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


class _Source:
    """Routing for the current forward of one experts module: ids [T, L, K] sliced by position."""

    def __init__(self, owner: FullLoadReplayer, layer: int, inner: str):
        self.owner, self.layer, self.inner = owner, layer, inner

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.owner._span
        ids = self.owner._ids[a:b, self.layer]
        w = self.owner._w[a:b, self.layer].to(hidden.dtype)
        return ids, w


class FullLoadReplayer:
    """The plain full-load model driven by recorded tokens and routing (batch 1, KV cache)."""

    def __init__(self, model: nn.Module, inner: str | None = None):
        self.model = standard_lm_head_input(model)  # as the runtime's: no transient LM-head copy per prefill
        self.refs = find_experts_modules(model)
        self.device = next(model.parameters()).device
        before = model.get_experts_implementation().get("", None)
        from expertcast.inference.runtime.experts import IMPLEMENTATION_NAME

        own = (None, "eager", FORCED_NAME, IMPLEMENTATION_NAME)
        self.inner = inner or (before if before not in own else "grouped_mm")
        for i, r in enumerate(self.refs):
            setattr(r.module, _ATTR, _Source(self, i, self.inner))
        self._before = before
        model.set_experts_implementation(register())
        self._span = (0, 0)
        self._ids = self._w = None

    def close(self) -> nn.Module:
        for r in self.refs:
            delattr(r.module, _ATTR)
        self.model.set_experts_implementation(self._before or "grouped_mm")
        return self.model

    @torch.no_grad()
    def replay(self, sequences: Sequence[TraceSequence], max_decode: int | None = None) -> ReplayTiming:
        vocab = self.model.get_input_embeddings().num_embeddings
        cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        n = dec = pre = 0.0
        for s in sequences:
            T = s.num_tokens if max_decode is None else min(s.num_tokens, s.prompt_len + max_decode)
            tok = np.asarray(s.token_ids[:T], dtype=np.int64) % vocab
            self._ids = torch.as_tensor(np.asarray(s.expert_ids[:T], np.int64), device=self.device)
            self._w = torch.as_tensor(np.asarray(s.expert_weights[:T], np.float32), device=self.device)
            P = s.prompt_len
            t0 = time.perf_counter()
            self._span = (0, P)
            out = self.model(input_ids=torch.as_tensor(tok[None, :P], device=self.device), use_cache=True,
                             logits_to_keep=1)
            out.logits[:, -1].argmax(-1).cpu()
            t1 = time.perf_counter()
            for pos in range(P, T):
                self._span = (pos, pos + 1)
                cache = getattr(out, "cache", None)
                cache = cache if cache is not None else out.past_key_values
                out = self.model(input_ids=torch.as_tensor(tok[None, pos:pos + 1], device=self.device), use_cache=True,
                                 logits_to_keep=1, **{cache_kw: cache})
                out.logits[:, -1].argmax(-1).cpu()  # the step's token is consumed (host sync, as generation does)
            t2 = time.perf_counter()
            pre += t1 - t0
            dec += t2 - t1
            n += T - P
        return ReplayTiming(int(n), dec, pre)


# --------------------------------------------------------------------------------------------- trace -> model
@dataclass(frozen=True)
class TraceMapping:
    """How a trace's routing (L_t, E_t, K_t) is laid onto a model's MoE layers (L, E, K) for forced routing
    (docs/design.md, "Real shapes"). Every field says what was done; :meth:`lines` states it in words."""

    trace_shape: tuple[int, int, int]
    model_shape: tuple[int, int, int]
    layer_of: tuple[int, ...]
    """``layer_of[l]``: the trace layer that MoE layer ``l`` of the model replays."""
    layers: str
    """``identity`` (L_t = L), ``cycled`` (L_t < L: MoE layer l replays trace layer l mod L_t) or ``first``
    (L_t > L, allowed with ``truncate_layers``: the first L trace layers)."""
    top_k: str
    """``identity`` (K_t = K) or ``top-weights`` (K_t > K: each token's K highest-weight experts of the
    trace, their recorded weights kept)."""
    unused_experts: int
    """Experts per layer that no trace id can name (E - E_t; ids are kept as they are)."""
    prompt_positions_added: int
    """Sequences whose trace has no prefill position (phase unknown) replay their first position as the
    prompt."""
    absent_token_ids: int
    """Positions whose token id the trace lacks (-1); the replay feeds ``vocab - 1`` there (ids are taken
    modulo the vocabulary)."""

    def lines(self) -> list[str]:
        (Lt, Et, Kt), (L, E, K) = self.trace_shape, self.model_shape
        layers = {"identity": f"trace layer l -> MoE layer l (L={L})",
                  "cycled": f"MoE layer l replays trace layer l mod {Lt} (the trace has {Lt} layers, the model {L})",
                  "first": f"the first {L} of the trace's {Lt} layers -> MoE layers 0..{L - 1} (--truncate-trace)"}
        topk = {"identity": f"K={K} as recorded",
                "top-weights": f"each token's {K} highest-weight of the trace's {Kt} experts (recorded weights kept)"}
        out = [f"mapping: {layers[self.layers]}",
               f"mapping: experts: trace id e -> model expert e ({Et} of {E} per layer named"
               + (f"; {self.unused_experts} never routed)" if self.unused_experts else ")"),
               f"mapping: top-K: {topk[self.top_k]}"]
        if self.prompt_positions_added:
            out.append(f"mapping: {self.prompt_positions_added} sequences have no prefill position (phase unknown): "
                       f"their first position is the prompt")
        if self.absent_token_ids:
            out.append(f"mapping: {self.absent_token_ids} positions have no token id in the trace: they feed the "
                       f"last vocabulary id")
        return out

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def map_trace_to_model(meta: TraceMeta, sequences: Sequence[TraceSequence], num_layers: int, num_experts: int,
                       top_k: int, *, truncate_layers: bool = False) -> tuple[TraceMeta, list[TraceSequence], TraceMapping]:
    """The trace's routing laid onto a model with ``num_layers`` MoE layers, ``num_experts`` experts and top-K
    ``top_k`` (rules in :class:`TraceMapping`), as (meta, sequences) of the model's shape that
    :meth:`OffloadedModel.replay <expertcast.inference.runtime.engine.OffloadedModel.replay>` and
    :class:`FullLoadReplayer` take. Raises ValueError (one line) when the trace names more experts than the
    model has, holds more layers (unless ``truncate_layers``), or selects fewer experts per token than the
    model computes (K_t < K: the replay cannot invent the missing choices)."""
    from dataclasses import replace

    Lt, Et, Kt = int(meta.num_layers), int(meta.num_experts), int(meta.top_k)
    L, E, K = int(num_layers), int(num_experts), int(top_k)
    where = f"trace of {meta.model_id!r} (L={Lt}, E={Et}, K={Kt}) onto the model (L={L}, E={E}, K={K})"
    if Et > E:
        raise ValueError(f"{where}: the trace names {Et} experts per layer, the model has {E}")
    if Lt > L and not truncate_layers:
        raise ValueError(f"{where}: the trace has {Lt} MoE layers, the model {L} (--truncate-trace replays the "
                         f"first {L})")
    if Kt < K:
        raise ValueError(f"{where}: the trace selects {Kt} experts per token, the model computes {K}")
    layers = "identity" if Lt == L else ("cycled" if Lt < L else "first")
    layer_of = tuple(range(L)) if Lt >= L else tuple(i % Lt for i in range(L))
    out: list[TraceSequence] = []
    added = absent = 0
    li = np.asarray(layer_of)
    for s in sequences:
        ids = np.asarray(s.expert_ids)[:, li]
        w = np.asarray(s.expert_weights)[:, li]
        if Kt > K:  # the K highest weights of each (token, layer), ties in router order
            order = np.argsort(-w.astype(np.float32), axis=-1, kind="stable")[..., :K]
            ids = np.take_along_axis(ids, order, axis=-1)
            w = np.take_along_axis(w, order, axis=-1)
        probs = None
        if s.router_probs is not None:
            rp = np.asarray(s.router_probs)[:, li]
            probs = np.pad(rp, ((0, 0), (0, 0), (0, E - Et))) if E > Et else rp
        tok = np.asarray(s.token_ids)
        absent += int((tok < 0).sum())
        P = s.prompt_len
        if P < 1:
            P, added = 1, added + 1
        out.append(replace(s, expert_ids=np.ascontiguousarray(ids), expert_weights=np.ascontiguousarray(w),
                           router_probs=probs, prompt_len=P))
    new_meta = replace(meta, num_layers=L, num_experts=E, top_k=K, moe_layers=None,
                       has_router_probs=meta.has_router_probs)
    mapping = TraceMapping((Lt, Et, Kt), (L, E, K), layer_of, layers, "identity" if Kt == K else "top-weights",
                           E - Et, added, absent)
    return new_meta, out, mapping
