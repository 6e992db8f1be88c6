"""Registry of cache policies: ``make_policy(name, **kwargs)`` and ``available_policies()``.

To add a policy, add one line to ``REGISTRY``: ``"name": "module.path:ClassName"`` and its options
class to :data:`expertcast.inference.cache.options.OPTIONS`. Modules are imported only when their
policy is made, so a policy whose dependencies are absent does not break the others; but it is never
dropped silently: ``available_policies()`` warns naming the module and the exception, and
:func:`policy_import_errors` returns them (``expertcast simulate --list-policies`` prints them).
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

from expertcast.inference.cache.policy import Policy
from expertcast.utils.errors import UsageError

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
    "seqmoe-async": "expertcast.inference.policies.async_forecast:AsyncSeqMoEPolicy",
    "hybrid": "expertcast.inference.policies.hybrid:HybridPolicy",
    "stage": "expertcast.inference.policies.stage_aware:StageAwarePolicy",
    "stage-oracle": "expertcast.inference.policies.stage_aware:StageOraclePolicy",
    "router-temporal": "expertcast.inference.policies.router:TemporalRetentionPolicy",
    "router-full": "expertcast.inference.policies.router:RouterFullPolicy",
    "router-spatio": "expertcast.inference.policies.router:SpatioOnlyPolicy",
}


def _load(name: str) -> type[Policy]:
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def policy_import_errors() -> dict[str, str]:
    """``{name: "module: ExceptionType: message"}`` for every registered policy that cannot be imported."""
    out = {}
    for name in REGISTRY:
        try:
            _load(name)
        except (ImportError, AttributeError) as exc:
            out[name] = f"{REGISTRY[name]}: {type(exc).__name__}: {exc}"
    return out


def available_policies() -> list[str]:
    """Names whose class can be imported now, in registry order; each one that cannot is reported with a
    RuntimeWarning naming its module and the exception."""
    errors = policy_import_errors()
    for name, err in errors.items():
        warnings.warn(f"cache policy {name!r} is unavailable: {err}", RuntimeWarning, stacklevel=2)
    return [n for n in REGISTRY if n not in errors]


def unknown_policy_message(name: str) -> str:
    return f"unknown policy {name!r}; available: {', '.join(available_policies())}"


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name`` (UsageError for unknown or unimportable names)."""
    key = name.strip().lower()
    if key not in REGISTRY:
        raise UsageError(unknown_policy_message(name))
    try:
        return _load(key)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"policy {name!r} is registered as {REGISTRY[key]} but cannot be imported "
                         f"({type(exc).__name__}: {exc})") from exc


def policy_label(name: str, kwargs: dict[str, Any]) -> str:
    """Name of a run: the policy with its scalar options (``lrfu(lam=0.1)``); objects (replays, loaded
    calibration data) do not name the run."""
    opts = ",".join(f"{k}={os.fspath(v) if isinstance(v, os.PathLike) else v}" for k, v in kwargs.items()
                    if isinstance(v, (int, float, str, bool, os.PathLike)))
    key = name.strip().lower()
    return f"{key}({opts})" if opts else key


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Instantiate the policy registered as ``name`` with ``kwargs``.

    A key the constructor does not take is a UsageError naming the valid ones; a path given for a file
    option must be a file of the right kind (see :mod:`expertcast.inference.cache.options`), and a
    trace directory given for ``static``'s calibration is loaded.
    """
    from expertcast.inference.cache.options import check_kwargs, materialize

    cls = policy_class(name)
    key = name.strip().lower()
    check_kwargs(key, cls, kwargs)
    policy = cls(**materialize(key, kwargs))
    policy.name = key
    policy.label = policy_label(key, kwargs)
    return policy


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"lrfu:lam=0.1"`` or ``"belady-k:k=8"`` -> (name, kwargs), typed and validated by the policy's
    options class (:func:`expertcast.inference.cache.options.parse_policy_options`)."""
    from expertcast.inference.cache.options import parse_policy_options

    opts = parse_policy_options(spec)
    return opts.policy, opts.to_kwargs()
