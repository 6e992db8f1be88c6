"""Registry of cache policies: ``make_policy(name, **kwargs)`` and ``available_policies()``.

To add a policy, add one line to ``REGISTRY``: ``"name": "module.path:ClassName"``. Modules are
imported only when their policy is made, so a policy whose module is missing (written later) or whose
dependencies are absent never breaks the others; ``available_policies()`` lists only importable ones.
"""

from __future__ import annotations

import importlib
from typing import Any

from expertcast.inference.policy import Policy

REGISTRY: dict[str, str] = {
    "lru": "expertcast.inference.policies.classic:LRUPolicy",
    "fifo": "expertcast.inference.policies.classic:FIFOPolicy",
    "lfu": "expertcast.inference.policies.classic:LFUPolicy",
    "lrfu": "expertcast.inference.policies.classic:LRFUPolicy",
    "static": "expertcast.inference.policies.static:StaticFrequencyPolicy",
    "belady": "expertcast.inference.policies.oracle:BeladyPolicy",
    "belady-k": "expertcast.inference.policies.oracle:BeladyKPolicy",
    "belady-seq": "expertcast.inference.policies.oracle:SequentialBeladyPolicy",
    "seqmoe": "expertcast.inference.policies.seqmoe:SeqMoEPolicy",
    "seqmoe-async": "expertcast.inference.runtime.async_forecast:AsyncSeqMoEPolicy",
    "stage": "expertcast.inference.policies.stage_aware:StageAwarePolicy",
    "stage-oracle": "expertcast.inference.policies.stage_aware:StageOraclePolicy",
    "router-temporal": "expertcast.inference.policies.router:TemporalRetentionPolicy",
    "router-full": "expertcast.inference.policies.router:RouterFullPolicy",
    "router-spatio": "expertcast.inference.policies.router:SpatioOnlyPolicy",
}


def _load(name: str) -> type[Policy]:
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def available_policies() -> list[str]:
    """Names whose class can be imported now, in registry order."""
    out = []
    for name in REGISTRY:
        try:
            _load(name)
        except (ImportError, AttributeError):
            continue
        out.append(name)
    return out


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name`` (clear errors for unknown or unimportable names)."""
    key = name.strip().lower()
    if key not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available_policies())}")
    try:
        return _load(key)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"policy {name!r} is registered as {REGISTRY[key]} but cannot be imported ({exc}); "
                         f"available: {', '.join(available_policies())}") from exc


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Instantiate the policy registered as ``name`` with ``kwargs``."""
    cls = policy_class(name)
    policy = cls(**kwargs)
    policy.name = name.strip().lower()
    # scalar options name the run (lrfu(lam=0.1)); objects (replays, calibration data) do not
    opts = ",".join(f"{k}={v}" for k, v in kwargs.items() if isinstance(v, (int, float, str, bool)))
    policy.label = f"{policy.name}({opts})" if opts else policy.name
    return policy


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"lrfu:lam=0.1"`` or ``"belady-k:k=8"`` -> (name, kwargs); values parsed as int, float, bool or
    text."""
    name, _, rest = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for part in filter(None, rest.split(",")):
        if "=" not in part:
            raise ValueError(f"policy option {part!r} in {spec!r} must be key=value")
        k, v = part.split("=", 1)
        kwargs[k.strip()] = _parse_value(v.strip())
    return name.strip(), kwargs


def _parse_value(v: str) -> Any:
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v
