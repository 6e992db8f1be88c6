"""Forced routing for the full-load model: the baseline of the runtime's replay benchmarks.

:meth:`OffloadedModel.replay` runs recorded routing through the offloaded runtime. To compare speeds
under the *same* routing, :class:`FullLoadReplayer` runs the plain model (all experts on the device,
transformers' own ``grouped_mm`` experts kernel) with the same recorded tokens and routing
substituted for its routers' choices, through the registered ``expertcast_forced`` implementation.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from expertcast.data.trace_format import TraceSequence
from expertcast.inference.runtime.store import find_experts_modules
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
        self.model = model
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
