"""Live cache-aware routers: an export's Temporal/Spatio routers attached to the model the runtime runs
(docs/design.md, "Cache-aware router adaptation").

:class:`LiveRouterScores` is a score source of the router policies
(:mod:`expertcast.inference.policies.router`), like a :class:`RouterReplay`, but filled while the model
generates: forward hooks on the native router modules (the :class:`RouterTap` of training, so the
routers read exactly the inputs they were trained on, and the hooks never change an output) compute,
at every forward and for every row the model routes,

- ``p^R_{t,l}``: the native distribution of the router's logits,
- ``p^T_{t,l} = softmax(W^T_l h_{t,l})`` and ``p^S_{t,l} = softmax(W^S_l h_{t,l})`` from that router's input
  ``h_{t,l}`` [H],

and write them, rounded to float16 (the precision a recorded replay keeps), at the row's position in
its sequence's record. A layer's router runs before its experts, so every value a policy reads at
step ``t`` layer ``l`` (p^R/p^T of (t, l), p^S of the causal predecessor, the previous token's p^R/p^T)
is written before the driver serves the layer. The engine is unchanged: the policy receives the
records in ``begin_batch`` and the hooks fill them.

Row -> position: the first forward of a batch is the prompt pass, ``[B, P]`` left-padded rows (member
``b``'s prompt in the last ``prompt_len_b`` columns: positions ``0 .. prompt_len_b - 1``); forward ``k >= 1``
has one row per member at position ``prompt_len_b + k - 1`` (a member that already ended writes past
its end; nothing reads there, and :meth:`LiveRouterScores.recorded` cuts each record to its trace).

``recorded(traces)`` returns the run's router outputs as a :class:`RouterReplay`: with the traces
``OffloadedModel.generate(record=True)`` returns, the simulator replays the run with equal counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from expertcast.inference.policies.router import RouterRecord, RouterReplay
from expertcast.models.cache_routers import CacheRouters, RouterTap
from expertcast.models.routing import native_distribution
from expertcast.utils.errors import UsageError
from torch import nn


def router_policy_names() -> list[str]:
    """The registered policies whose scores come from cache routers (their spec needs ``router_scores``)."""
    from expertcast.inference.policies import registry

    return [n for n, spec in registry().items() if "router_scores" in spec.needs]


def export_modes(policy_name: str) -> tuple[str, ...]:
    """The router modes of an export that give router policy ``policy_name`` the scores it reads (p^T for
    Algorithm 1, p^S for the pre-access refinement, both for Algorithm 2)."""
    from expertcast.inference.policies import policy_class
    from expertcast.inference.policies.router import router_modes

    return router_modes(policy_class(policy_name))


_GROW = 64
"""Positions added to a record when a write reaches its end."""


class _LiveTap(RouterTap):
    """A :class:`RouterTap` that hands every capture (layer, router input, logits) to a callback."""

    def __init__(self, model: nn.Module, routers: CacheRouters | None, callback):
        self._callback = callback
        super().__init__(model, routers)

    def _hook(self, i: int):
        capture = super()._hook(i)

        def hook(module, args, output):
            capture(module, args, output)
            if self.enabled:
                self._callback(i, self._h[i], self._logits[i])
            return None

        return hook


class LiveRouterScores:
    """Router scores computed live from the model's router inputs (see the module docstring).

    Args:
        model: the MoE causal LM the runtime runs (full load or offloaded: the native routers stay).
        routers: the export's :class:`CacheRouters` for that model (None: p^R only).
    Use :meth:`remove` (or ``with``) to take the hooks off.
    """

    def __init__(self, model: nn.Module, routers: CacheRouters | None):
        device = next(model.parameters()).device
        self.routers = routers.to(device).eval() if routers is not None else None
        self.mode = routers.mode if routers is not None else "none"
        self.tap = _LiveTap(model, self.routers, self._capture)
        self.L = len(self.tap.sites)
        self.E = self.tap.sites[0].num_experts
        self.records: dict[str, RouterRecord] = {}
        """The current batch's records, keyed by sequence id (a new batch replaces them)."""
        self._batch: list[RouterRecord] = []
        self._prompt_lens = np.zeros(0, np.int64)
        self._calls = np.zeros(self.L, np.int64)

    # -- score source ------------------------------------------------------------------------------
    def records_for(self, batch: Sequence[Any]) -> list[RouterRecord]:
        """A batch opens (members with ``seq_id`` and ``prompt_len``): fresh records that the next forwards fill."""
        lens = [int(s.prompt_len) for s in batch]
        recs = [self._empty(n + _GROW) for n in lens]
        self.records = {s.seq_id: r for s, r in zip(batch, recs, strict=True)}
        self._batch = recs
        self._prompt_lens = np.asarray(lens, np.int64)
        self._calls[:] = 0
        return recs

    def recorded(self, traces: Sequence[Any]) -> RouterReplay:
        """The router outputs of the last batch's generated ``traces`` (each record cut to its ``num_tokens``)."""
        out = {}
        for s in traces:
            r = self.records[s.seq_id]
            cut = (lambda a, n=s.num_tokens: None if a is None else a[:n].copy())  # noqa: E731
            out[s.seq_id] = RouterRecord(cut(r.p_R), cut(r.p_T), cut(r.p_S))
        return RouterReplay(out, self.mode)

    def remove(self) -> None:
        """Take the hooks off the model."""
        self.tap.remove()
        self._batch = []

    def __enter__(self) -> LiveRouterScores:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # -- hooks ---------------------------------------------------------------------------------------
    def _empty(self, n: int) -> RouterRecord:
        def arr() -> np.ndarray:
            return np.zeros((n, self.L, self.E), np.float16)

        has_t = self.routers is not None and self.routers.temporal is not None
        has_s = self.routers is not None and self.routers.spatio is not None
        return RouterRecord(arr(), arr() if has_t else None, arr() if has_s else None)

    def _spans(self, layer: int, n_rows: int) -> list[tuple[int, int, int]]:
        """(first row, first position, rows) of each member in the current forward of ``layer`` (``n_rows``
        routed rows): a member's rows are consecutive positions."""
        B = len(self._batch)
        k = int(self._calls[layer])
        self._calls[layer] += 1
        if k == 0:  # the prompt pass: left-padded [B, P]
            P = n_rows // B
            if P * B != n_rows or P < int(self._prompt_lens.max()):
                raise RuntimeError(f"live routers: the prompt pass routed {n_rows} rows, not B={B} x P")
            return [(b * P + P - int(n), 0, int(n)) for b, n in enumerate(self._prompt_lens)]
        if n_rows != B:
            raise RuntimeError(f"live routers: decode forward {k} routed {n_rows} rows, expected one per member "
                               f"(B={B})")
        return [(b, int(n) + k - 1, 1) for b, n in enumerate(self._prompt_lens)]

    @torch.no_grad()
    def _capture(self, layer: int, h: torch.Tensor, logits: torch.Tensor) -> None:
        """h [N, H] router inputs and logits [N, E] of one forward at MoE layer ``layer``."""
        if not self._batch:
            return  # no batch open (a forward outside a policy-driven generation)
        spans = self._spans(layer, h.shape[0])
        dists = {"p_R": native_distribution(logits, self.tap.sites[layer].scoring)}
        if self.routers is not None:
            hf = h.float()
            for name, bank in (("p_T", self.routers.temporal), ("p_S", self.routers.spatio)):
                if bank is not None:
                    dists[name] = torch.softmax(bank[layer](hf), dim=-1)
        for name, d in dists.items():
            vals = d.cpu().numpy().astype(np.float16)  # [N, E]
            for rec, (row, pos, n) in zip(self._batch, spans, strict=True):
                self._array(rec, name, pos + n - 1)[pos:pos + n, layer] = vals[row:row + n]

    @staticmethod
    def _array(rec: RouterRecord, name: str, pos: int) -> np.ndarray:
        """The record's array ``name``, grown so that positions ``pos`` and ``pos + 1`` exist (the next
        step's position must exist when the policy opens that step, before its forward writes it)."""
        a = getattr(rec, name)
        if pos + 1 >= a.shape[0]:
            grown = np.zeros((pos + 1 + _GROW, *a.shape[1:]), a.dtype)
            grown[: a.shape[0]] = a
            setattr(rec, name, grown)
            a = grown
        return a


def check_export_fits(policy_name: str, router_mode: str | None, where: str) -> None:
    """UsageError unless an export whose routers are of ``router_mode`` (None: no routers, an LM-only
    export) gives ``policy_name`` the scores it reads."""
    need = export_modes(policy_name)
    if router_mode not in need:
        have = f"{router_mode} routers" if router_mode else "no cache routers (an lm_only export)"
        raise UsageError(f"--policy {policy_name} reads the scores of {' or '.join(need)} routers, but {where} "
                         f"has {have}")


def live_router_policy(spec: str) -> tuple[str, dict[str, Any]]:
    """``router-full[:R=N]`` -> (name, constructor options) for a live evaluation, whose routers come from
    the ``--model`` export (so ``replay=`` is refused); UsageError for anything else. The text is read and typed
    as every policy's (:func:`~expertcast.inference.policies.split_policy_text`, the options' own checks)."""
    from expertcast.inference.policies import options_class, split_policy_text

    name = str(spec).partition(":")[0].strip().lower()
    if name not in router_policy_names():
        raise UsageError(f"--policy {spec}: not a router policy ({', '.join(router_policy_names())})")
    name, values = split_policy_text(spec)
    if set(values) - {"R"}:
        raise UsageError(f"--policy {spec}: a live router policy takes only R=N (its routers come from the "
                         f"--model export; replay= is for `expertcast simulate`)")
    return name, options_class(name).build(name, values).given_values()


def is_router_policy(spec: str) -> bool:
    """True when ``--policy`` names a router policy (``router-temporal|router-full|router-spatio[:...]``)."""
    return str(spec).partition(":")[0].strip().lower() in router_policy_names()


def router_export_model(export: str, policy_name: str) -> tuple[str, dict[str, str]]:
    """For ``--model EXPORT`` with a router policy: (the export folder, which the model loader reads as its
    model; ``{"routers": folder}``, the artefact whose hash joins the run's settings). UsageError when
    ``export`` is no router-adaptation export (verified by its manifest) or its routers do not give the
    policy its scores."""
    from pathlib import Path

    from expertcast.models.backbone import is_export_dir
    from expertcast.models.router_export import read_adaptation_export

    if not is_export_dir(export):
        raise UsageError(f"--policy {policy_name} runs the routers of a router-adaptation export: --model must be "
                         f"such an export (what `expertcast fit --config configs/router/...` writes), not {export}")
    info = read_adaptation_export(export)
    check_export_fits(policy_name, info.get("router_mode"), f"--model {export}")
    return str(export), {"routers": str(Path(export) / info["routers_dir"])}


HYBRID_ROUTER_MODES = ("temporal", "full")
"""Router modes whose export gives the ``hybrid`` policy's routers part its s^T (p^R + p^T, as router-temporal)."""


def hybrid_routers_off(policy: Any, export: str) -> str | None:
    """Why the ``hybrid`` ``policy`` runs without live routers on ``--model export`` (None: they attach).
    UsageError when its ``parts`` name ``routers`` explicitly and they cannot attach, or when it holds
    recorded router outputs (``replay=``: those belong to `expertcast simulate`)."""
    from expertcast.models.backbone import is_export_dir

    source = policy.replay
    if source is not None and not isinstance(source, LiveRouterScores):
        raise UsageError("--policy hybrid: replay= holds recorded router outputs, which `expertcast simulate` "
                         "replays; a live evaluation computes them from the --model export's routers")
    if "routers" not in policy.parts and policy.parts_spec != "auto":
        return f"parts={policy.parts_spec} leave it off"
    reason = None
    if not is_export_dir(export):
        reason = f"--model {export} is no router-adaptation export (no cache routers)"
    else:
        from expertcast.models.router_export import read_adaptation_export

        mode = read_adaptation_export(export).get("router_mode")
        if mode not in HYBRID_ROUTER_MODES:
            have = f"{mode} routers" if mode else "no cache routers (an lm_only export)"
            reason = f"--model {export} has {have}; s^T needs {' or '.join(HYBRID_ROUTER_MODES)} routers"
    config = getattr(policy, "config", None)
    if reason is None and config is not None and config.pool != "per-layer":
        reason = f"the routers part manages B slots per MoE layer: use --pool per-layer, not {config.pool}"
    if reason is not None and policy.routers_explicit:
        raise UsageError(f"--policy hybrid:parts={policy.parts_spec}: the routers part cannot run: {reason}")
    return reason


def attach_live_routers(policy: Any, model: nn.Module, export: str) -> None:
    """Give a router ``policy`` or a ``hybrid`` (else nothing happens) live scores from ``export``'s routers on
    ``model`` (the routers checked against the model). A ``hybrid`` whose routers cannot attach runs without
    its routers part and says so on stderr, once (:func:`hybrid_routers_off`). Undo with
    :func:`detach_live_routers`."""
    from pathlib import Path

    from expertcast.inference.policies import spec_of
    from expertcast.models.router_export import load_routers, read_adaptation_export

    spec = spec_of(policy)
    hybrid = "router_scores" in spec.parts  # router scores are one optional part of its priority
    if not (hybrid or "router_scores" in spec.needs) or isinstance(policy.replay, LiveRouterScores):
        return
    if hybrid:
        reason = hybrid_routers_off(policy, export)
        if reason is not None:
            _say_once(policy, f"hybrid: routers part off ({reason}); parts: {'+'.join(policy.parts)}")
            return
    info = read_adaptation_export(export)
    try:
        routers, _ = load_routers(Path(export) / info["routers_dir"], model=model)
    except ValueError as e:
        raise UsageError(f"--model {export}: {e}") from None
    live = LiveRouterScores(model, routers)
    if hybrid:
        policy.use_routers(live)
        _say_once(policy, f"hybrid: routers part on: s^T from the live {live.mode} routers of {export}; parts: "
                          f"{'+'.join(policy.parts)}")
    else:
        policy.set_replay(live)


def _say_once(policy: Any, line: str) -> None:
    """Print ``line`` to stderr unless this policy said it already (a sweep re-attaches for every pass)."""
    import sys

    said = policy.__dict__.setdefault("_live_router_notes", set())
    if line not in said:
        said.add(line)
        print(line, file=sys.stderr)


def detach_live_routers(policy: Any) -> None:
    """Take the live routers' hooks off the model (a later full-load pass runs without them)."""
    source = getattr(policy, "replay", None)
    if isinstance(source, LiveRouterScores):
        source.remove()
        policy.set_replay(None)
