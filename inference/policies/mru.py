"""MRU: evict the most recently used candidate (docs/design.md, "Cache policies").

The example of adding a policy: this module and its name in
:data:`expertcast.inference.policies.POLICY_MODULES`. Time is one clock that advances once per
layer-execution; every expert of the selection is stamped with it after the layer ran. The victim is the
candidate with the latest stamp (ties: the lower ``layer * E + expert``); never-used residents go last.
MRU suits cyclic access patterns longer than the cache, where LRU evicts exactly what comes next.
"""

from __future__ import annotations

import numpy as np
from expertcast.inference.cache.options import PolicyOptions
from expertcast.inference.cache.policy import Policy
from expertcast.inference.cache.spec import PolicySpec


class MRUPolicy(Policy):
    """Most recently used: evicts the candidate accessed last."""

    name = "mru"

    def reset(self, config) -> None:
        super().reset(config)
        self.E = config.num_experts
        self.last = np.full(config.num_layers * config.num_experts, -1, np.int64)
        self.clock = 0

    def on_access(self, t, layer, selected, counts, cache) -> None:
        self.clock += 1
        self.last[layer * self.E + np.asarray(selected, np.int64)] = self.clock

    def choose_victim(self, t, layer, candidates, cache) -> int:
        items = candidates[:, 0].astype(np.int64) * self.E + candidates[:, 1].astype(np.int64)
        return int(np.lexsort((items, -self.last[items]))[0])


SPECS = (PolicySpec("mru", MRUPolicy, PolicyOptions, help="most recently used"),)
