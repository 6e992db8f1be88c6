"""Cache-aware auxiliary routers (Temporal and Spatio) and their soft Top-B coverage loss.

Reference: docs/design.md, "Cache-aware router adaptation (restated)"; paper
``papers/cache-aware-router-adaptation.txt`` (sections 3.1-3.4, Algorithms 1-2).

Per MoE layer ``l`` the native router gives ``p^R_{t,l} = softmax(W^R_l h_{t,l})`` from its input
``h_{t,l}``. The auxiliary routers are linear maps of the *same* router input:

- Temporal router ``p^T_{t,l} = softmax(W^T_l h_{t,l})`` predicts layer ``l``'s demand at token
  ``t+1``; retention priority ``s^T_{t,l} = p^R_{t,l} + p^T_{t,l}``.
- Spatio router at source ``(t, l)``: ``p^S_{t,l} = softmax(W^S_l h_{t,l})`` predicts the next MoE
  position in causal order, i.e. layer ``l+1`` of token ``t`` (and layer 0 of token ``t+1`` when
  ``l = L-1``). The predecessor of target ``(t, l)`` is ``rho(t, l) = (t, l-1)`` for ``l > 0`` and
  ``(t-1, L-1)`` for ``l = 0`` (the first-layer wrap-around).
- Full pre-access priority ``s^ST_{t,l} = p^R_{t-1,l} + p^T_{t-1,l} + p^S_{rho(t,l)}``;
  spatio-only ``s^S_{t,l} = p^R_{t-1,l} + p^S_{rho(t,l)}``.

The routers are attached to a backbone with forward hooks on its native router modules (found by
:func:`expertcast.models.routing.find_routers`, so every family that module supports works). The
hooks only *read* the router input and logits; they return nothing, so the native Top-K rule and
every output of the backbone are unchanged (tested exactly in ``tests/models/test_cache_routers.py``).

Copy-initialisation (paper section 3.4; the summary in ``papers/`` lost its text, so this is the
rule as implemented here): before cache-aware training, ``W^T_l <- W^R_l`` (the Temporal router
starts as the native router of its own layer: "next token's demand = this token's demand", the
recency prior LRU relies on), and ``W^S_l <- W^R_{next(l)}`` with ``next(l) = l+1`` and
``next(L-1) = 0`` (the Spatio router starts as the *target* layer's native router applied to the
source layer's input; the residual stream makes consecutive router inputs close). Biases (GPT-OSS
routers have one) are copied the same way. ``init="random"`` draws small normal weights instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from expertcast.models.routing import RouterSite, find_routers, native_distribution
from torch import nn

RouterMode = Literal["temporal", "spatio_only", "full"]
ROUTER_MODES: tuple[str, ...] = ("temporal", "spatio_only", "full")


def resolve_budget(budget: float | int, num_experts: int, top_k: int | None = None) -> int:
    """Per-layer cache budget B in experts.

    ``budget`` < 1 is a fraction of the ``num_experts`` experts of a layer (rounded to the nearest
    integer, at least 1); ``budget`` >= 1 is a count. Raises ValueError when B is below the native
    top-K (a selection would not fit the cache) or above E.
    """
    if budget <= 0:
        raise ValueError(f"cache budget must be positive, got {budget}")
    b = max(1, int(round(budget * num_experts))) if budget < 1 else int(budget)
    if b != budget and budget >= 1:
        raise ValueError(f"cache budget {budget} >= 1 must be a whole number of experts")
    if b > num_experts:
        raise ValueError(f"cache budget B={b} exceeds the {num_experts} experts of a layer")
    if top_k is not None and b < top_k:
        raise ValueError(
            f"cache budget B={b} is below the native top-K={top_k}: one token's selection would not fit"
        )
    return b


# --------------------------------------------------------------------------------------------
# the loss (pure functions on distributions; hand-worked cases in tests/models/test_cache_routers.py)
# --------------------------------------------------------------------------------------------


def soft_topb_membership(s: torch.Tensor, budget: int, tau: float) -> torch.Tensor:
    """Soft Top-B membership ``m_i(s) = sigmoid((s_i - theta_B(s)) / tau)``.

    ``s`` [..., E] priorities; ``theta_B(s)`` is the B-th largest entry of each row (differentiable:
    torch.topk passes gradients to the entry it picks). Returns [..., E] in (0, 1).
    """
    if tau <= 0:
        raise ValueError(f"temperature tau must be positive, got {tau}")
    E = s.shape[-1]
    if not 1 <= budget <= E:
        raise ValueError(f"budget B={budget} outside [1, E={E}]")
    theta = torch.topk(s, budget, dim=-1).values[..., budget - 1 : budget]
    return torch.sigmoid((s - theta) / tau)


def coverage_loss(
    s: torch.Tensor, q: torch.Tensor, budget: int, tau: float, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``L_cov(s, q) = -sum_i q_i m_i(s)`` averaged over valid rows.

    ``s``, ``q`` [..., E] (``q`` the full native target distribution); ``valid`` bool [...] (the
    leading dims of ``s``) or None for all rows. Returns a scalar in [-1, 0] (0 when no row is valid).
    """
    if s.shape != q.shape:
        raise ValueError(f"priority {tuple(s.shape)} and target {tuple(q.shape)} shapes differ")
    per_row = -(q.float() * soft_topb_membership(s.float(), budget, tau)).sum(-1)
    if valid is None:
        return per_row.mean()
    if valid.shape != per_row.shape:
        raise ValueError(f"valid mask {tuple(valid.shape)} does not match rows {tuple(per_row.shape)}")
    w = valid.to(per_row.dtype)
    return (per_row * w).sum() / w.sum().clamp_min(1.0)


def spatio_at_target(p_S: torch.Tensor) -> torch.Tensor:
    """Re-index Spatio predictions from source to target: out[:, t, l] = p^S at rho(t, l).

    ``p_S`` [B, T, L, E] indexed by source. rho(t, l) = (t, l-1) for l > 0, (t-1, L-1) for l = 0
    (first-layer wrap-around). out[:, 0, 0] has no predecessor and is zero (never a valid target).
    """
    out = torch.zeros_like(p_S)
    out[:, :, 1:] = p_S[:, :, :-1]
    out[:, 1:, 0] = p_S[:, :-1, -1]
    return out


def pair_mask(attention_mask: torch.Tensor, num_layers: int) -> torch.Tensor:
    """bool [B, T-1, L]: token pair (t, t+1) both real. This is Omega_T (indexed by the source t,
    which has a next-token target) and Omega_ST (indexed by target t+1, which has a previous token and
    a causal predecessor) alike."""
    m = attention_mask.bool()
    pair = m[:, :-1] & m[:, 1:]
    return pair[:, :, None].expand(-1, -1, num_layers)


def temporal_priority(p_R: torch.Tensor, p_T: torch.Tensor) -> torch.Tensor:
    """s^T_{t,l} = p^R_{t,l} + p^T_{t,l} (equal-weight sum). Any shape [..., E]."""
    return p_R + p_T


def spatio_temporal_priority(p_R: torch.Tensor, p_T: torch.Tensor | None, p_S: torch.Tensor) -> torch.Tensor:
    """Pre-access priority for targets t = 1..T-1, shape [B, T-1, L, E]:
    s^ST_{t,l} = p^R_{t-1,l} + p^T_{t-1,l} + p^S_{rho(t,l)}; without ``p_T`` it is the spatio-only
    s^S_{t,l} = p^R_{t-1,l} + p^S_{rho(t,l)}. Inputs [B, T, L, E]."""
    prev = p_R[:, :-1] if p_T is None else p_R[:, :-1] + p_T[:, :-1]
    return prev + spatio_at_target(p_S)[:, 1:]


@dataclass
class RouterOutputs:
    """Distributions of one forward, float32 [B, T, L, E] (``p_T``/``p_S`` None when absent)."""

    p_R: torch.Tensor
    p_T: torch.Tensor | None
    p_S: torch.Tensor | None


def cache_coverage_loss(
    out: RouterOutputs, mode: str, budget: int, tau: float, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The mode's coverage loss (scalar in [-1, 0]).

    - ``temporal``: L_T = mean over Omega_T of L_cov(s^T_{t,l}, p^R_{t+1,l}).
    - ``full``: L_ST = mean over Omega_ST of L_cov(s^ST_{t,l}, p^R_{t,l}) (no separate L_T term: the
      Temporal router is trained through s^ST, paper section 3.3).
    - ``spatio_only``: the same with s^S_{t,l}.
    The native distributions stay in the graph (joint mode adapts demand as well as priorities).
    """
    B, T, L, _ = out.p_R.shape
    if T < 2:
        return out.p_R.sum() * 0.0
    mask = torch.ones(B, T, dtype=torch.bool, device=out.p_R.device) if attention_mask is None else attention_mask
    valid = pair_mask(mask, L)
    q_next = out.p_R[:, 1:]
    if mode == "temporal":
        if out.p_T is None:
            raise ValueError("temporal mode needs the Temporal router's outputs")
        s = temporal_priority(out.p_R[:, :-1], out.p_T[:, :-1])
    elif mode == "full":
        if out.p_T is None or out.p_S is None:
            raise ValueError("full mode needs the Temporal and Spatio routers' outputs")
        s = spatio_temporal_priority(out.p_R, out.p_T, out.p_S)
    elif mode == "spatio_only":
        if out.p_S is None:
            raise ValueError("spatio_only mode needs the Spatio router's outputs")
        s = spatio_temporal_priority(out.p_R, None, out.p_S)
    else:
        raise ValueError(f"unknown router mode {mode!r}; expected one of {ROUTER_MODES}")
    return coverage_loss(s, q_next, budget, tau, valid)


# --------------------------------------------------------------------------------------------
# the routers and their attachment to a backbone
# --------------------------------------------------------------------------------------------


def _native_params(site: RouterSite) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = getattr(site.module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        raise ValueError(f"router {site.name} ({type(site.module).__name__}) has no 2-D weight [E, H]")
    b = getattr(site.module, "bias", None)
    return w, (b if isinstance(b, torch.Tensor) else None)


class CacheRouters(nn.Module):
    """Temporal and/or Spatio routers for the L MoE layers of one backbone.

    ``temporal[l]`` / ``spatio[l]``: ``nn.Linear(H, E)`` on layer l's native router input; kept in
    float32 whatever the backbone dtype. Which exist depends on ``mode``: temporal -> T; full -> T and
    S; spatio_only -> S.
    """

    def __init__(self, num_layers: int, num_experts: int, hidden_size: int, mode: str = "temporal",
                 bias: bool = False):
        super().__init__()
        if mode not in ROUTER_MODES:
            raise ValueError(f"unknown router mode {mode!r}; expected one of {ROUTER_MODES}")
        self.mode = mode
        self.num_layers, self.num_experts, self.hidden_size = num_layers, num_experts, hidden_size

        def bank() -> nn.ModuleList:
            return nn.ModuleList(nn.Linear(hidden_size, num_experts, bias=bias) for _ in range(num_layers))

        self.temporal = bank() if mode in ("temporal", "full") else None
        self.spatio = bank() if mode in ("spatio_only", "full") else None

    @property
    def has_bias(self) -> bool:
        bank = self.temporal if self.temporal is not None else self.spatio
        return bank[0].bias is not None

    @classmethod
    def for_model(cls, model: nn.Module, mode: str = "temporal", init: str = "copy", seed: int = 0) -> CacheRouters:
        """Routers sized for ``model``'s MoE layers, copy-initialised from its native routers
        (``init="copy"``, module docstring) or random (``init="random"``, std 0.02, seeded)."""
        sites = find_routers(model)
        w0, b0 = _native_params(sites[0])
        r = cls(len(sites), w0.shape[0], w0.shape[1], mode=mode, bias=b0 is not None)
        if init == "copy":
            r.copy_init_(model)
        elif init == "random":
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in r.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.ndim == 2 else torch.zeros(p.shape))
        else:
            raise ValueError(f"unknown router init {init!r}; expected 'copy' or 'random'")
        return r

    @torch.no_grad()
    def copy_init_(self, model: nn.Module) -> None:
        """W^T_l <- W^R_l and W^S_l <- W^R_{(l+1) mod L} (biases too): paper section 3.4."""
        sites = find_routers(model)
        self.check_model(model, sites)
        native = [_native_params(s) for s in sites]
        L = self.num_layers
        for li in range(L):
            if self.temporal is not None:
                self._copy(self.temporal[li], *native[li])
            if self.spatio is not None:
                self._copy(self.spatio[li], *native[(li + 1) % L])

    @staticmethod
    def _copy(lin: nn.Linear, w: torch.Tensor, b: torch.Tensor | None) -> None:
        lin.weight.copy_(w.detach().float())
        if lin.bias is not None and b is not None:
            lin.bias.copy_(b.detach().float())

    def check_model(self, model: nn.Module, sites: list[RouterSite] | None = None) -> None:
        """Raise ValueError when ``model``'s MoE layers (L, E, H) differ from these routers'."""
        sites = sites or find_routers(model)
        w0, _ = _native_params(sites[0])
        theirs = (len(sites), int(w0.shape[0]), int(w0.shape[1]))
        mine = (self.num_layers, self.num_experts, self.hidden_size)
        if mine != theirs:
            raise ValueError(
                f"cache routers are for L={mine[0]}, E={mine[1]}, H={mine[2]} but the model has "
                f"L={theirs[0]}, E={theirs[1]}, H={theirs[2]}: they were trained for another model"
            )

    def attach(self, model: nn.Module) -> RouterTap:
        """Hook this bank onto ``model``'s native routers (see :class:`RouterTap`)."""
        return RouterTap(model, self)

    def distributions(self, h: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``h`` [..., L, H] router inputs -> (p^T, p^S), each float32 [..., L, E] or None."""

        def run(bank: nn.ModuleList | None) -> torch.Tensor | None:
            if bank is None:
                return None
            # float32 routers; a trainer's bf16-true precision casts them down: inputs follow, outputs stay float32
            hf = h.to(bank[0].weight.dtype)
            logits = torch.stack([bank[li](hf[..., li, :]) for li in range(self.num_layers)], dim=-2)
            return torch.softmax(logits.float(), dim=-1)

        return run(self.temporal), run(self.spatio)


class RouterTap:
    """Forward hooks that read every native router's input h_{t,l} and logits, never changing them.

    After ``model(input_ids [B, T])`` call :meth:`outputs` (B, T) for the :class:`RouterOutputs` of
    that forward. Each MoE layer keeps its latest capture (a gradient-checkpointing recompute
    overwrites it with equal values). Use as a context manager or call :meth:`remove`.
    """

    def __init__(self, model: nn.Module, routers: CacheRouters | None):
        self.sites = find_routers(model)
        if routers is not None:
            routers.check_model(model, self.sites)
        self.routers = routers
        self.enabled = True
        self._h: list[torch.Tensor | None] = [None] * len(self.sites)
        self._logits: list[torch.Tensor | None] = [None] * len(self.sites)
        self._handles = [s.module.register_forward_hook(self._hook(i)) for i, s in enumerate(self.sites)]

    def _hook(self, i: int):
        site = self.sites[i]

        def hook(module, args, output):
            if not self.enabled:
                return None
            h = args[0] if args else None
            if not isinstance(h, torch.Tensor):
                raise RuntimeError(f"router {site.name} was called without a positional hidden-state input")
            logits = output[0] if isinstance(output, tuple) else output
            self._h[i] = h.reshape(-1, h.shape[-1])
            self._logits[i] = logits.reshape(-1, site.num_experts)
            return None  # never replace the router's output

        return hook

    def clear(self) -> None:
        self._h = [None] * len(self.sites)
        self._logits = [None] * len(self.sites)

    def remove(self) -> None:
        for hd in self._handles:
            hd.remove()
        self._handles.clear()
        self.clear()

    def __enter__(self) -> RouterTap:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def outputs(self, batch_size: int, seq_len: int) -> RouterOutputs:
        """p^R, p^T, p^S of the last forward as float32 [B, T, L, E] (in the autograd graph)."""
        if any(x is None for x in self._h):
            raise RuntimeError("no router inputs captured: run a forward of the model with the routers attached")
        N = batch_size * seq_len
        if self._h[0].shape[0] != N:
            raise ValueError(f"last forward routed {self._h[0].shape[0]} tokens, expected B*T = {N}")
        p_R = torch.stack(
            [native_distribution(lg, s.scoring) for lg, s in zip(self._logits, self.sites, strict=True)], dim=1
        ).view(batch_size, seq_len, len(self.sites), -1)
        p_T = p_S = None
        if self.routers is not None:
            h = torch.stack(self._h, dim=1).view(batch_size, seq_len, len(self.sites), -1)
            p_T, p_S = self.routers.distributions(h)
        return RouterOutputs(p_R=p_R, p_T=p_T, p_S=p_S)


@contextmanager
def attached(model: nn.Module, routers: CacheRouters):
    """``with attached(model, routers) as tap: model(ids); out = tap.outputs(B, T)``."""
    tap = RouterTap(model, routers)
    try:
        yield tap
    finally:
        tap.remove()


@torch.no_grad()
def record_router_outputs(model: nn.Module, routers: CacheRouters | None, input_ids: torch.Tensor,
                          attention_mask: torch.Tensor | None = None) -> RouterOutputs:
    """Teacher-forced pass of ``model`` over ``input_ids`` [B, T] returning p^R/p^T/p^S [B, T, L, E]
    (the side arrays the router policies replay). Runs the base model only (no LM head)."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
        kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    base = getattr(model, "model", model)
    with RouterTap(model, routers) as tap:
        base(input_ids=input_ids, use_cache=False, **kwargs)
        return tap.outputs(B, T)


def expert_use_stats(expert_ids: torch.Tensor, num_experts: int, top_b: int) -> dict[str, float]:
    """Concentration of native expert use (paper Fig. 3), averaged over layers.

    ``expert_ids`` int [N, L, K] selections. Per layer, f = selection frequencies (sum 1): returns
    ``max_freq`` (max f), ``topb_mass`` (mass of the B most used), ``entropy`` (nats) and
    ``effective_experts`` (exp(entropy)).
    """
    if expert_ids.ndim != 3:
        raise ValueError(f"expert_ids must be [N, L, K], got shape {tuple(expert_ids.shape)}")
    counts = F.one_hot(expert_ids.long(), num_experts).sum((0, 2)).float()  # [L, E]
    f = counts / counts.sum(-1, keepdim=True).clamp_min(1)
    ent = -(f * f.clamp_min(1e-12).log()).sum(-1)
    topb = torch.topk(f, top_b, dim=-1).values.sum(-1)
    return {
        "max_freq": float(f.max(-1).values.mean()),
        "topb_mass": float(topb.mean()),
        "entropy": float(ent.mean()),
        "effective_experts": float(ent.exp().mean()),
    }
