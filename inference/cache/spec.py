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

ENGINES = frozenset({"driver", "kernel", "device", "placement"})
"""Where a policy can run: ``driver`` = the eager Python driver (simulator and runtime), ``kernel`` = the
simulator's compiled fast path (the policy's ``kernel_params()``), ``device`` = the runtime's graph decode path,
``placement`` = the simulator's vectorized replay of a fixed placement (nothing moves: the policy's warm start, placed
by the driver, stays resident)."""
NEEDS = frozenset({"future", "forecaster", "router_scores", "cues", "tokenizer", "calibration"})
"""Inputs a policy needs: the future routing (oracles), a forecaster export, the routers' scores (a replay or
live routers), stage cues, a tokenizer decoding the generated tokens, calibration traces (their selection counts:
``policy.calibrate(counts, source)``; ``policy.calibration_source`` is None until it has them, and the simulator
then calibrates on the replayed traces, in-sample)."""


@dataclass(frozen=True)
class PolicySpec:
    """The identity and capabilities of one registered policy.

    Attributes:
        name: registry name (``lru``, ``seqmoe``...).
        cls: the policy class, or ``"module:Class"`` imported on first use.
        options: the policy's options dataclass (a :class:`~expertcast.inference.cache.options.PolicyOptions`).
        engines: subset of :data:`ENGINES`.
        needs: subset of :data:`NEEDS`.
        parts: subset of :data:`NEEDS`: the inputs of optional parts, each switching on a part of the policy when
            given and left off otherwise (hybrid's routers and stage terms); a caller that can supply one offers
            it through the policy's ``use_routers`` / ``use_tokenizer``.
        live: can drive a live generation (runtime, ``expertcast eval``).
        help: one line.
    """

    name: str
    cls: type | str
    options: type[PolicyOptions]
    engines: frozenset[str] = field(default=frozenset({"driver"}))
    needs: frozenset[str] = field(default=frozenset())
    parts: frozenset[str] = field(default=frozenset())
    live: bool = True
    help: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "engines", frozenset(self.engines))
        object.__setattr__(self, "needs", frozenset(self.needs))
        object.__setattr__(self, "parts", frozenset(self.parts))
        if not self.engines or not self.engines <= ENGINES:
            raise ValueError(f"policy spec {self.name}: engines {sorted(self.engines)} not a subset of {sorted(ENGINES)}")
        if not self.needs <= NEEDS:
            raise ValueError(f"policy spec {self.name}: needs {sorted(self.needs)} not a subset of {sorted(NEEDS)}")
        if not self.parts <= NEEDS:
            raise ValueError(f"policy spec {self.name}: parts {sorted(self.parts)} not a subset of {sorted(NEEDS)}")
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

    def takes(self, need: str) -> bool:
        """The policy reads input ``need``: as a need or as the input of an optional part."""
        return need in self.needs or need in self.parts

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "engines": sorted(self.engines), "needs": sorted(self.needs),
                "parts": sorted(self.parts), "live": self.live}


def object_names(cls: type) -> list[str]:
    """The loaded objects policy class ``cls`` takes: the keyword-only parameters of its constructor."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.kind == p.KEYWORD_ONLY]
