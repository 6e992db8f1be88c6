"""Cache policies of the cache-aware router adaptation (docs/design.md, "Cache-aware router adaptation").

The policies read the routers' outputs through a *score source*: one :class:`RouterRecord` per
sequence (p^R, p^T, p^S, each float16 [T, L, E]) returned by ``source.records_for(batch)`` when the
batch opens, read at the position the driver says each member processes (``StepInfo.positions``:
prefill steps first, then decode steps). Two sources exist and a policy does not tell them apart:

- :class:`RouterReplay`: records of finished sequences keyed by sequence id (a teacher-forced pass,
  or the router outputs a runtime run recorded), for the simulator;
- :class:`expertcast.inference.runtime.live_routers.LiveRouterScores`: records that the export's routers
  fill during a live generation, each position written by forward hooks on the native routers as
  the model computes it (before the policy reads it at that step).

With a batch of several sequences, a priority is the mean over the members processing a token.

- :class:`TemporalRetentionPolicy` (``router-temporal``, Algorithm 1, update-only): demand-load
  misses, protect the selection, evict the lowest ``s^T_{t,l} = p^R_{t,l} + p^T_{t,l}`` resident.
  No proactive loads.
- :class:`RouterFullPolicy` (``router-full``, Algorithm 2): before access, scan the top-R of
  ``s^ST_{t,l} = p^R_{t-1,l} + p^T_{t-1,l} + p^S_{rho(t,l)}`` in descending order; a non-resident
  candidate replaces the lowest-s^ST resident only when its score is higher (a proactive load; an
  empty slot is taken freely). Then the update-only retention with s^T.
- :class:`SpatioOnlyPolicy` (``router-spatio``): the same pre-access refinement with
  ``s^S_{t,l} = p^R_{t-1,l} + p^S_{rho(t,l)}`` and LRU retention of demand-loaded experts.

``R`` (<= B) is an inference knob: no retraining. These policies need per-layer pools (B slots per
MoE layer), the setting of the paper.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from expertcast.inference.cache.options import PolicyOptions, option
from expertcast.inference.cache.policy import Policy
from expertcast.inference.cache.spec import PolicySpec
from expertcast.utils.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.cache.expert_cache import CacheConfig, ExpertCache
    from expertcast.inference.cache.schedule import StepInfo

REPLAY_FORMAT = "expertcast-router-replay"
REPLAY_FORMAT_VERSION = 1


@dataclass
class RouterRecord:
    """Router outputs of one sequence's teacher-forced pass: float16 [T, L, E] each (None if absent)."""

    p_R: np.ndarray
    p_T: np.ndarray | None = None
    p_S: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.p_R.ndim != 3:
            raise ValueError(f"p_R must be [T, L, E], got shape {self.p_R.shape}")
        for n in ("p_T", "p_S"):
            a = getattr(self, n)
            if a is not None and a.shape != self.p_R.shape:
                raise ValueError(f"{n} {a.shape} does not match p_R {self.p_R.shape}")


class RouterReplay:
    """{seq_id: RouterRecord} plus the mode of the routers that produced them; saved as one ``.npz``
    (no pickle) beside a JSON header."""

    def __init__(self, records: dict[str, RouterRecord] | None = None, mode: str = "temporal"):
        self.records: dict[str, RouterRecord] = dict(records or {})
        self.mode = mode

    def __getitem__(self, seq_id: str) -> RouterRecord:
        try:
            return self.records[seq_id]
        except KeyError:
            raise KeyError(f"no router outputs recorded for sequence {seq_id!r}: record the replay on the same "
                           "traces the simulator runs") from None

    def __len__(self) -> int:
        return len(self.records)

    def records_for(self, batch: Sequence[Any]) -> list[RouterRecord]:
        """The records of the batch's members (by ``seq_id``), in batch order."""
        return [self[s.seq_id] for s in batch]

    def save(self, directory: str | os.PathLike) -> Path:
        from expertcast.utils.io import atomic_write_bytes, atomic_write_json

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        ids = list(self.records)
        arrays: dict[str, np.ndarray] = {}
        for i, k in enumerate(ids):
            r = self.records[k]
            for n in ("p_R", "p_T", "p_S"):
                a = getattr(r, n)
                if a is not None:
                    arrays[f"{n}_{i}"] = a.astype(np.float16)
        import io

        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write_bytes(d / "router_replay.npz", buf.getvalue())
        atomic_write_json(d / "router_replay.json", {"format": REPLAY_FORMAT, "format_version": REPLAY_FORMAT_VERSION,
                                                     "mode": self.mode, "seq_ids": ids})
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike) -> RouterReplay:
        d = Path(directory)
        hp = d / "router_replay.json"
        if not hp.is_file():
            raise ValueError(f"{d} holds no router replay ({hp.name} missing)")
        head = json.loads(hp.read_text())
        if head.get("format") != REPLAY_FORMAT or head.get("format_version", 99) > REPLAY_FORMAT_VERSION:
            raise ValueError(f"{hp} is not a router replay this expertcast reads")
        with np.load(d / "router_replay.npz", allow_pickle=False) as z:
            recs = {}
            for i, k in enumerate(head["seq_ids"]):
                got = [z[f"{n}_{i}"] if f"{n}_{i}" in z.files else None for n in ("p_R", "p_T", "p_S")]
                recs[k] = RouterRecord(*got)
        return cls(recs, head.get("mode", "temporal"))


class _RouterPolicyBase(Policy):
    """Shared bookkeeping: the batch's records, positions, and per-(t, l) priorities."""

    @dataclass
    class Options(PolicyOptions):
        """Cache-aware router policies fed by recorded router outputs."""

        replay: str | None = option(None, "recorded router outputs on the replayed traces (required)",
                                    file="router_replay")
        R: int | None = option(None, "experts per layer kept by the Temporal router (R <= per-layer budget B)", low=1)

        def check(self) -> None:
            if self.replay is None:
                raise UsageError(f"{self.policy} needs the routers' recorded outputs: {self.policy}:replay=DIR")

    needs_p_T = False
    needs_p_S = False

    def __init__(self, options: Options | None = None, *, replay: Any = None):
        """``replay``: the score source (a loaded :class:`RouterReplay`, or a
        :class:`~expertcast.inference.runtime.live_routers.LiveRouterScores`)."""
        super().__init__(options)
        self.replay = replay
        self.R = self.options.R
        self._batch: list[RouterRecord] = []
        self._act: list[tuple[RouterRecord, int]] = []
        self.t = -1

    def set_replay(self, replay: Any) -> None:
        """Use another score source (a :class:`RouterReplay` or live scores) from the next batch on."""
        self.replay = replay

    def reset(self, config: CacheConfig) -> None:
        super().reset(config)
        if config.pool != "per-layer":
            raise ValueError(f"{type(self).__name__} manages B slots per MoE layer: use pool='per-layer', "
                             f"not {config.pool!r}")
        self.B = config.pool_capacities.copy()
        if self.R is not None:
            if self.R < 1:
                raise ValueError(f"R must be >= 1, got {self.R}")
            if self.R > int(self.B.min()):
                raise ValueError(f"R={self.R} exceeds the per-layer budget B={int(self.B.min())} (R <= B)")
        self._batch = []
        self._cache_key = None

    def begin_batch(self, batch: Any) -> None:
        if self.replay is None:
            raise ValueError(f"{type(self).__name__} needs the routers' recorded outputs: pass replay=RouterReplay")
        out = []
        for s, rec in zip(batch, self.replay.records_for(batch), strict=True):
            T = getattr(s, "num_tokens", None)  # a live prompt's length is not known yet
            L, E = self.config.num_layers, self.config.num_experts
            if (T is not None and rec.p_R.shape[0] != T) or rec.p_R.shape[1:] != (L, E):
                raise ValueError(
                    f"router outputs of {s.seq_id} are {rec.p_R.shape}, but the trace has T={T}, L={L}, E={E}: "
                    "recorded on another model or text")
            if self.needs_p_T and rec.p_T is None:
                raise ValueError(f"{type(self).__name__} needs Temporal-router outputs (p_T) for {s.seq_id}")
            if self.needs_p_S and rec.p_S is None:
                raise ValueError(f"{type(self).__name__} needs Spatio-router outputs (p_S) for {s.seq_id}")
            out.append(rec)
        self._batch = out
        self._act = []
        self.t = -1

    def on_step(self, t: int, info: StepInfo) -> None:
        """The members processing a position at step ``t`` (positions from the driver's schedule)."""
        self.t = t
        self._act = [(rec, int(pos)) for rec, pos in zip(self._batch, info.positions.tolist(), strict=True)
                     if 0 <= pos < rec.p_R.shape[0]]

    def _active(self, t: int, need_prev: bool = False) -> list[tuple[RouterRecord, int]]:
        """(record, position) of the members processing a token at step t (with a previous token if
        asked)."""
        if t != self.t:
            raise RuntimeError(f"{self.name}: step {t} was not opened by on_step (the driver calls it first)")
        return [(r, p) for r, p in self._act if p >= 1 or not need_prev]

    def temporal_priority(self, t: int, layer: int) -> np.ndarray | None:
        """s^T_{t,l} [E] (batch mean), or None when no sequence is active."""
        act = self._active(t)
        if not act:
            return None
        s = np.zeros(self.config.num_experts, np.float32)
        for rec, pos in act:
            s += rec.p_R[pos, layer].astype(np.float32)
            if rec.p_T is not None:
                s += rec.p_T[pos, layer].astype(np.float32)
        return s / len(act)

    def pre_access_priority(self, t: int, layer: int, use_temporal: bool) -> np.ndarray | None:
        """s^ST_{t,l} (use_temporal) or s^S_{t,l} [E] (batch mean), or None when not available."""
        act = self._active(t, need_prev=True)
        if not act:
            return None
        L = self.config.num_layers
        s = np.zeros(self.config.num_experts, np.float32)
        for rec, pos in act:
            s += rec.p_R[pos - 1, layer].astype(np.float32)
            if use_temporal:
                s += rec.p_T[pos - 1, layer].astype(np.float32)
            # causal predecessor rho(t, l): (t, l-1), or (t-1, L-1) for the first layer
            s += (rec.p_S[pos, layer - 1] if layer > 0 else rec.p_S[pos - 1, L - 1]).astype(np.float32)
        return s / len(act)


class TemporalRetentionPolicy(_RouterPolicyBase):
    """Algorithm 1: update-only retention by s^T (no proactive loads)."""

    name = "router-temporal"
    demand_only = True
    needs_p_T = True

    def reset(self, config: CacheConfig) -> None:
        super().reset(config)
        self._prio = np.zeros((config.num_layers, config.num_experts), np.float32)
        self._prio_at = np.full(config.num_layers, -(10**9), np.int64)

    def _retention_priority(self, t: int, layer: int) -> np.ndarray:
        if self._prio_at[layer] != t:
            s = self.temporal_priority(t, layer)
            if s is not None:
                self._prio[layer] = s
            self._prio_at[layer] = t
        return self._prio[layer]

    def choose_victim(self, t: int, layer: int, candidates: np.ndarray, cache: ExpertCache) -> int:
        pr = self._retention_priority(t, layer)
        if np.all(candidates[:, 0] == layer):
            return int(np.argmin(pr[candidates[:, 1]]))
        vals = np.array([self._prio[li, e] if li != layer else pr[e] for li, e in candidates], np.float32)
        return int(np.argmin(vals))

    def on_access(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray, cache: ExpertCache) -> None:
        self._retention_priority(t, layer)


class _PreAccessMixin:
    """Algorithm 2's pre-access refinement with top-R candidates (shared by full and spatio-only)."""

    use_temporal_in_pre_access = True

    def _plan(self, t: int, layer: int, cache: ExpertCache) -> list[tuple[int, int]]:
        self._planned: list[int] = []
        s = self.pre_access_priority(t, layer, self.use_temporal_in_pre_access)
        if s is None:
            return []
        B = int(self.B[layer])
        R = B if self.R is None else int(self.R)
        cand = np.argsort(-s, kind="stable")[:R]
        from expertcast.inference.cache.expert_cache import SlotState

        resident = set(int(e) for e in cache.resident_experts(layer))
        evictable = {e for e in resident if cache.state_of(layer, e) == SlotState.USED}
        free = B - len(resident)
        loads = []
        for c in cand:
            c = int(c)
            if c in resident:
                continue
            if free > 0:
                free -= 1
            else:
                if not evictable:
                    break
                low = min(evictable, key=lambda e: (s[e], e))
                if not s[c] > s[low]:
                    break  # candidates come in descending order: no later one beats the lowest resident
                evictable.discard(low)
                resident.discard(low)
                self._planned.append(low)
            resident.add(c)
            loads.append((layer, c))
        self._pre_s = s
        return loads

    def _planned_victim(self, candidates: np.ndarray, layer: int) -> int | None:
        while getattr(self, "_planned", None):
            v = self._planned.pop(0)
            hit = np.flatnonzero((candidates[:, 0] == layer) & (candidates[:, 1] == v))
            if len(hit):
                return int(hit[0])
        return None


class RouterFullPolicy(_PreAccessMixin, TemporalRetentionPolicy):
    """Algorithm 2: top-R pre-access refinement by s^ST, then update-only retention by s^T."""

    name = "router-full"
    demand_only = False
    needs_p_T = True
    needs_p_S = True

    def before_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        return self._plan(t, layer, cache)

    def on_miss(self, t, layer, expert, n_tokens, cache):
        self._planned = []  # access phase: retention rule from here on
        return super().on_miss(t, layer, expert, n_tokens, cache)

    def choose_victim(self, t: int, layer: int, candidates: np.ndarray, cache: ExpertCache) -> int:
        v = self._planned_victim(candidates, layer)
        return v if v is not None else super().choose_victim(t, layer, candidates, cache)

    def on_access(self, t, layer, selected, counts, cache) -> None:
        self._planned = []
        super().on_access(t, layer, selected, counts, cache)


class SpatioOnlyPolicy(_PreAccessMixin, _RouterPolicyBase):
    """Spatio-only: top-R pre-access refinement by s^S; demand misses retained with LRU eviction."""

    name = "router-spatio"
    demand_only = False
    needs_p_S = True
    use_temporal_in_pre_access = False

    def reset(self, config: CacheConfig) -> None:
        super().reset(config)
        self._last = np.full((config.num_layers, config.num_experts), -1, np.int64)
        self._clock = 0

    def before_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        return self._plan(t, layer, cache)

    def on_miss(self, t, layer, expert, n_tokens, cache):
        self._planned = []
        return super().on_miss(t, layer, expert, n_tokens, cache)

    def choose_victim(self, t: int, layer: int, candidates: np.ndarray, cache: ExpertCache) -> int:
        v = self._planned_victim(candidates, layer)
        if v is not None:
            return v
        return int(np.argmin(self._last[candidates[:, 0], candidates[:, 1]]))

    def on_access(self, t, layer, selected, counts, cache) -> None:
        self._planned = []
        self._clock += 1
        self._last[layer, np.asarray(selected, dtype=np.int64)] = self._clock

    def on_insert(self, layer: int, expert: int, proactive: bool) -> None:
        self._clock += 1
        self._last[layer, expert] = self._clock


def router_modes(policy_cls: type) -> tuple[str, ...]:
    """The router modes of an export that give a router policy class the scores it reads: p^T (Algorithm 1)
    comes from ``temporal`` and ``full`` routers, p^S (the pre-access refinement) from ``spatio_only`` and
    ``full`` ones."""
    gives = {"temporal": {"p_T"}, "spatio_only": {"p_S"}, "full": {"p_T", "p_S"}}
    need = {n for n, on in (("p_T", policy_cls.needs_p_T), ("p_S", policy_cls.needs_p_S)) if on}
    return tuple(mode for mode, have in gives.items() if need <= have)


_ROUTER = frozenset({"router_scores"})
SPECS = (
    PolicySpec("router-temporal", TemporalRetentionPolicy, TemporalRetentionPolicy.Options, needs=_ROUTER,
               help="update-only retention by the Temporal router's scores (Algorithm 1)"),
    PolicySpec("router-full", RouterFullPolicy, RouterFullPolicy.Options, needs=_ROUTER,
               help="top-R pre-access refinement, then retention by the routers' scores (Algorithm 2)"),
    PolicySpec("router-spatio", SpatioOnlyPolicy, SpatioOnlyPolicy.Options, needs=_ROUTER,
               help="top-R pre-access refinement by the Spatio router, LRU retention"),
)
