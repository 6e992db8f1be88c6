"""One record per cache policy: :class:`PolicySpec` (docs/design.md, "Cache policies").

Every question "can policy P run here, what does it need" reads its spec: the engines it runs on, the
inputs it needs loaded, whether it can drive a live generation. Each policy module ends with
``SPECS = (PolicySpec(...), ...)``; :mod:`expertcast.inference.policies` builds the registry from them.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.cache.options import PolicyOptions
    from expertcast.inference.cache.policy import Policy

ENGINES = frozenset({"driver", "kernel", "device"})
"""Where a policy can run: ``driver`` = the eager Python driver (simulator and runtime), ``kernel`` = the
simulator's compiled fast path, ``device`` = the runtime's graph decode path."""
NEEDS = frozenset({"future", "forecaster", "router_scores", "cues", "tokenizer"})
"""Inputs a policy needs: the future routing (oracles), a forecaster export, the routers' scores (a replay or
live routers), stage cues, a tokenizer decoding the generated tokens."""


@dataclass(frozen=True)
class PolicySpec:
    """The identity and capabilities of one registered policy.

    Attributes:
        name: registry name (``lru``, ``seqmoe``...).
        cls: the policy class, or ``"module:Class"`` imported on first use.
        options: the policy's options dataclass (a :class:`~expertcast.inference.cache.options.PolicyOptions`).
        engines: subset of :data:`ENGINES`.
        needs: subset of :data:`NEEDS`.
        live: can drive a live generation (runtime, ``expertcast eval``).
        help: one line.
    """

    name: str
    cls: type | str
    options: type[PolicyOptions]
    engines: frozenset[str] = field(default=frozenset({"driver"}))
    needs: frozenset[str] = field(default=frozenset())
    live: bool = True
    help: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "engines", frozenset(self.engines))
        object.__setattr__(self, "needs", frozenset(self.needs))
        if not self.engines or not self.engines <= ENGINES:
            raise ValueError(f"policy spec {self.name}: engines {sorted(self.engines)} not a subset of {sorted(ENGINES)}")
        if not self.needs <= NEEDS:
            raise ValueError(f"policy spec {self.name}: needs {sorted(self.needs)} not a subset of {sorted(NEEDS)}")
        if self.live and "driver" not in self.engines:
            raise ValueError(f"policy spec {self.name}: a live policy runs on the driver engine")

    @property
    def target(self) -> str:
        """``"module:Class"`` of the policy class."""
        if isinstance(self.cls, str):
            return self.cls
        return f"{self.cls.__module__}:{self.cls.__qualname__}"

    def load(self) -> type[Policy]:
        """The policy class (imported when given as ``"module:Class"``)."""
        if not isinstance(self.cls, str):
            return self.cls
        module, name = self.cls.split(":")
        return getattr(importlib.import_module(module), name)

    def runs_on(self, engine: str) -> bool:
        return engine in self.engines

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "engines": sorted(self.engines), "needs": sorted(self.needs), "live": self.live}


def object_names(cls: type) -> list[str]:
    """The loaded objects policy class ``cls`` takes: the keyword-only parameters of its constructor."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.kind == p.KEYWORD_ONLY]
