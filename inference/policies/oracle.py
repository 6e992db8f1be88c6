"""Oracles that read the future of the replayed stream: Belady, Belady-k and sequential Belady.

* ``belady``: under the protect rule the selection of the running layer stays resident and the
  victim is the non-selected resident whose next use is furthest away (never-used-again first). With
  one expert per layer-execution (top-1) this is exactly classic Belady/MIN with forced insertion
  (libcachesim's ``Belady``). It maximizes the hits of the whole replayed stream (prefill warm-up
  included), so it bounds every demand-paging policy that follows the protect rule on those counts.
  On decode-only counts a policy can trade uncounted prefill hits for decode hits (or, like the
  static placement, bypass its misses), so the tables' ``belady_fraction`` divides by the demand-only
  ceiling instead (:func:`expertcast.inference.sim.simulator.replay_ceiling`), which ``belady`` may not
  reach.
* ``belady-k`` (SeqMoE's Belady-8): the future is visible ``k`` decode steps ahead (the next ``k * L``
  layer-executions). Residents whose next use is visible are ranked as Belady ranks them; residents
  with no visible next use are evicted first, least recently used first. ``k=0`` is LRU; ``k`` at
  least the stream length is Belady.
* ``belady-seq``: sequential Belady over the flattened stream, requests one at a time in selection
  order with no protect rule, so a miss may evict an expert selected earlier in the same step. This
  equals libcachesim's ``Belady`` fed the flat top-K stream; it is a looser (higher) bound than
  ``belady`` for top-K > 1 and is not what the tables' fractions use. It runs only on the compiled
  engine (the generic driver always applies the protect rule).

Ties between residents first used again in the same layer-execution are broken by the lower
``layer * E + expert`` id (hit counts do not depend on the choice).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from expertcast.inference.cache.options import PolicyOptions, option
from expertcast.inference.cache.spec import PolicySpec
from expertcast.inference.policies import kernels
from expertcast.inference.policies.classic import KeyedPolicy


class BeladyPolicy(KeyedPolicy):
    """Belady under the protect rule (full future)."""

    name = "belady"
    kernel_kind = kernels.KIND_BELADY
    horizon_steps: int | None = None

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.stream = None

    def set_future(self, future) -> None:
        """``future``: the simulator's :class:`~expertcast.inference.sim.simulator.AccessStream`."""
        self.stream = future

    def kernel_params(self):
        p = super().kernel_params()
        p["horizon"] = -1 if self.horizon_steps is None else self.horizon_steps * self.config.num_layers
        return p

    def reset(self, config) -> None:
        super().reset(config)
        self.nxt = np.full(config.num_layers * config.num_experts, kernels.NEVER, np.int64)

    def _touch(self, t, layer, index, item, resident, hit):
        if not resident:
            return
        if self.stream is None:
            raise RuntimeError(f"{self.name} is an oracle: the driver must call set_future() first")
        x = t * self.L + layer
        a = int(self.stream.exec_ptr[x]) + index
        self.nxt[item] = int(self.stream.next_exec[a])
        self.last[item] = self.clock

    def keys_of(self, t, layer, items):
        n = self.nxt[items]
        k1 = -n.astype(np.float64)
        k2 = items.astype(np.float64)
        if self.horizon_steps is not None:
            far = n > (t * self.L + layer) + self.horizon_steps * self.L
            k1 = np.where(far, -np.inf, k1)
            k2 = np.where(far, self.last[items], k2)
        return k1, k2


class BeladyKPolicy(BeladyPolicy):
    """Belady with ``k`` decode steps of future; residents with no visible next use go first (LRU)."""

    @dataclass
    class Options(PolicyOptions):
        """Belady that sees k decode steps ahead."""

        k: int = option(8, "decode steps of future visible to the oracle", low=0)

    name = "belady-k"

    def __init__(self, options: Options | None = None) -> None:
        super().__init__(options)
        self.horizon_steps = int(self.options.k)


class SequentialBeladyPolicy(BeladyPolicy):
    """Sequential Belady on the flat stream (no protect rule); compiled engine only."""

    name = "belady-seq"
    kernel_kind = kernels.KIND_BELADY_SEQ

    def choose_victim(self, t, layer, candidates, cache) -> int:
        raise RuntimeError("belady-seq ignores the protect rule and runs only on the compiled engine "
                           "(simulate(..., engine='auto' or 'kernel'))")


_ORACLE = frozenset({"future"})
SPECS = (
    PolicySpec("belady", BeladyPolicy, PolicyOptions, engines={"driver", "kernel"}, needs=_ORACLE, live=False,
               help="Belady under the protect rule (full future)"),
    PolicySpec("belady-k", BeladyKPolicy, BeladyKPolicy.Options, engines={"driver", "kernel"}, needs=_ORACLE,
               live=False, help="Belady seeing k decode steps ahead"),
    PolicySpec("belady-seq", SequentialBeladyPolicy, PolicyOptions, engines={"kernel"}, needs=_ORACLE, live=False,
               help="sequential Belady on the flat stream (compiled engine only)"),
)
