"""Routing capture: which experts each MoE layer selects, read from the model's own routers.

transformers 5 MoE blocks all call a router module that returns ``(router_logits, top_k_weights,
top_k_index)`` and pass the last two, unchanged, to the fused experts module
(``Qwen3MoeSparseMoeBlock.forward``, ``Qwen2MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``,
``OlmoeSparseMoeBlock``, ``DeepseekV3MoE``, ``GptOssMLP``). A forward hook on the router therefore
sees exactly the selection and the weights the model uses, whatever the family computes inside:

- Qwen3-MoE / Qwen2-MoE / OLMoE: softmax over E, top-K, renormalised when ``norm_topk_prob``.
- Mixtral: softmax over E, top-K, always renormalised.
- DeepSeek-V3: sigmoid scores; the top-K is chosen on ``scores + e_score_correction_bias`` inside the
  ``topk_group`` best groups, the weights are the (bias-free) scores of the chosen experts,
  renormalised, times ``routed_scaling_factor``. We divide that constant factor out, so the stored
  weights are the normalised gate values (they sum to 1 when ``norm_topk_prob``).
- GPT-OSS: top-K of the logits (with bias), then a softmax over those K logits.

The "full native distribution" ``router_probs`` [.., E] is softmax(logits) for the softmax routers
(for GPT-OSS this is the distribution whose renormalised top-K equals its weights) and, for the
sigmoid routers (DeepSeek-V3 family), the sigmoid scores normalised to sum to 1.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

_ROUTER_NAME = re.compile(r"(Top[kK]|Top1|TokenChoice)?Router$")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class RouterSite:
    """One MoE layer's router module."""

    layer_idx: int
    """Decoder-layer index of this MoE layer."""
    name: str
    """Qualified module name inside the model."""
    module: nn.Module
    scoring: str
    """"softmax" or "sigmoid": how the native distribution is made from the router logits."""
    weight_scale: float
    """Constant the router multiplies its weights by (DeepSeek ``routed_scaling_factor``), divided out."""
    num_experts: int
    top_k: int


@dataclass
class RoutingCapture:
    """Routing of a batch from one forward.

    ``expert_ids`` int64 [B, T, L, K] (router order), ``expert_weights`` float32 [B, T, L, K],
    ``router_probs`` float32 [B, T, L, E] or None. Entries at padded positions are meaningless.
    """

    expert_ids: torch.Tensor
    expert_weights: torch.Tensor
    router_probs: torch.Tensor | None
    moe_layers: list[int]


def _router_classes(model: nn.Module) -> tuple[type, ...]:
    classes = []
    for m in model.modules():
        rec = getattr(m, "_can_record_outputs", None) or {}
        target = rec.get("router_logits") if isinstance(rec, dict) else None
        cls = getattr(target, "target_class", None)
        if isinstance(cls, type):
            classes.append(cls)
    return tuple(dict.fromkeys(classes))


def find_routers(model: nn.Module) -> list[RouterSite]:
    """The router module of every MoE layer of ``model``, ordered by decoder layer.

    Routers are the classes the model declares as its ``router_logits`` source
    (``_can_record_outputs``), else modules whose class name ends in ``TopKRouter``/``Router``.
    Raises ValueError when the model has none (not an MoE model) or when a layer holds two.
    """
    classes = _router_classes(model)
    sites: dict[int, RouterSite] = {}
    for name, mod in model.named_modules():
        is_router = isinstance(mod, classes) if classes else bool(_ROUTER_NAME.search(type(mod).__name__))
        if not is_router:
            continue
        # multimodal models may hold several towers; keep the text decoder's layers
        m = _LAYER_INDEX.search(name + ".")
        if m is None:
            continue
        li = int(m.group(1))
        if li in sites:
            raise ValueError(f"two routers in decoder layer {li}: {sites[li].name} and {name}")
        weight = getattr(mod, "weight", None)
        num_experts = int(getattr(mod, "num_experts", weight.shape[0] if weight is not None else 0))
        top_k = int(getattr(mod, "top_k", 0))
        if num_experts <= 0 or top_k <= 0:
            raise ValueError(f"router {name} ({type(mod).__name__}) exposes no num_experts/top_k")
        scoring = "sigmoid" if hasattr(mod, "e_score_correction_bias") else "softmax"
        scale = float(getattr(mod, "routed_scaling_factor", 1.0) or 1.0)
        sites[li] = RouterSite(li, name, mod, scoring, scale, num_experts, top_k)
    if not sites:
        raise ValueError(
            f"{type(model).__name__} has no MoE router modules: expertcast needs a transformers-5 MoE causal LM"
        )
    out = [sites[k] for k in sorted(sites)]
    if len({(s.num_experts, s.top_k) for s in out}) != 1:
        raise ValueError("MoE layers of this model differ in E or K; traces need one E and one K")
    return out


def native_distribution(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """[N, E] router logits -> [N, E] float32 native distribution (rows sum to 1)."""
    logits = logits.float()
    if scoring == "sigmoid":
        s = logits.sigmoid()
        return s / s.sum(-1, keepdim=True).clamp_min(1e-20)
    return torch.softmax(logits, dim=-1)


class RoutingRecorder:
    """Forward hooks on every router; each model forward appends one record per MoE layer.

    Use as a context manager (hooks are removed on exit). After a forward over N = B*T tokens,
    :meth:`pop` returns ``(ids [N, L, K], weights [N, L, K], probs [N, L, E] | None)`` for that
    forward; during incremental decoding call it after every step.
    """

    def __init__(self, model: nn.Module, router_probs: bool = False):
        self.model = model
        self.sites = find_routers(model)
        self.router_probs = router_probs
        self._handles: list = []
        self._ids: list[list[torch.Tensor]] = [[] for _ in self.sites]
        self._w: list[list[torch.Tensor]] = [[] for _ in self.sites]
        self._p: list[list[torch.Tensor]] = [[] for _ in self.sites]

    @property
    def moe_layers(self) -> list[int]:
        return [s.layer_idx for s in self.sites]

    @property
    def num_experts(self) -> int:
        return self.sites[0].num_experts

    @property
    def top_k(self) -> int:
        return self.sites[0].top_k

    def _hook(self, i: int):
        site = self.sites[i]

        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) >= 3):
                raise RuntimeError(
                    f"router {site.name} returned {type(output).__name__}; expected (logits, weights, indices)"
                )
            logits, weights, idx = output[0], output[1], output[2]
            k = site.top_k
            self._ids[i].append(idx.detach().reshape(-1, k).to(torch.int64))
            w = weights.detach().reshape(-1, k).float()
            if site.weight_scale != 1.0:
                w = w / site.weight_scale
            self._w[i].append(w)
            if self.router_probs:
                self._p[i].append(native_distribution(logits.detach().reshape(-1, site.num_experts), site.scoring))

        return hook

    def __enter__(self) -> RoutingRecorder:
        for i, s in enumerate(self.sites):
            self._handles.append(s.module.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def pop(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Routing recorded since the last pop, tokens of consecutive forwards concatenated."""
        counts = {len(x) for x in self._ids}
        if counts == {0}:
            raise RuntimeError("no routing recorded: run a forward inside the recorder first")
        if len(counts) != 1:
            raise RuntimeError(f"MoE layers recorded unequal numbers of forwards: {counts}")
        ids = torch.stack([torch.cat(x) for x in self._ids], dim=1)
        w = torch.stack([torch.cat(x) for x in self._w], dim=1)
        p = torch.stack([torch.cat(x) for x in self._p], dim=1) if self.router_probs else None
        for lst in (self._ids, self._w, self._p):
            for x in lst:
                x.clear()
        return ids, w, p


@contextmanager
def record_routing(model: nn.Module, router_probs: bool = False) -> Iterator[RoutingRecorder]:
    """``with record_routing(model) as rec: model(...); ids, w, p = rec.pop()``."""
    rec = RoutingRecorder(model, router_probs=router_probs)
    with rec:
        yield rec


@torch.inference_mode()
def capture_routing(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    router_probs: bool = False,
) -> RoutingCapture:
    """Teacher-forced forward over ``input_ids`` [B, T] returning the routing of every position.

    ``attention_mask`` [B, T] (1 = real token) handles padding; with right padding the routing of
    real tokens equals that of each sequence run alone, since pads only come after them. Left
    padding also works: position ids are derived from the mask as ``generate`` does.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    kwargs = {}
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
            )
        kwargs["attention_mask"] = attention_mask
        pos = attention_mask.long().cumsum(-1) - 1
        kwargs["position_ids"] = pos.clamp_min(0)
    base = getattr(model, "model", model)
    with record_routing(model, router_probs=router_probs) as rec:
        # the base model skips the LM head: routing does not depend on it
        base(input_ids=input_ids, use_cache=False, **kwargs)
        ids, w, p = rec.pop()
    if ids.shape[0] != B * T:
        raise RuntimeError(f"routers saw {ids.shape[0]} tokens, expected B*T = {B * T}")
    L, K = ids.shape[1], ids.shape[2]
    return RoutingCapture(
        expert_ids=ids.view(B, T, L, K),
        expert_weights=w.view(B, T, L, K),
        router_probs=None if p is None else p.view(B, T, L, -1),
        moe_layers=rec.moe_layers,
    )
