"""Registry of cache policies: ``make_policy(name, **kwargs)``, ``policy_spec(name)``, ``available_policies()``.

The registry is built from :data:`POLICY_MODULES`: each module ends with ``SPECS = (PolicySpec(...), ...)``
(:class:`~expertcast.inference.cache.spec.PolicySpec`). To add a policy, add one module and its name to
that tuple. Modules are imported when the registry is first read, so a module whose dependencies are absent
does not break the others; but it is never dropped silently: ``available_policies()`` warns naming the
module and the exception, and :func:`policy_import_errors` returns them (``expertcast simulate
--list-policies`` prints them).
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Mapping
from functools import cache
from typing import Any

from expertcast.inference.cache.options import PolicyOptions
from expertcast.inference.cache.policy import Policy
from expertcast.inference.cache.spec import PolicySpec, object_names
from expertcast.utils.errors import UsageError

POLICY_MODULES: tuple[str, ...] = (
    "expertcast.inference.policies.classic",
    "expertcast.inference.policies.static",
    "expertcast.inference.policies.oracle",
    "expertcast.inference.policies.seqmoe",
    "expertcast.inference.policies.async_forecast",
    "expertcast.inference.policies.hybrid",
    "expertcast.inference.policies.stage_aware",
    "expertcast.inference.policies.router",
    "expertcast.inference.policies.mru",
)
"""The policy modules, in registry order (each one's ``SPECS`` in its order)."""


@cache
def _build(modules: tuple[str, ...]) -> tuple[dict[str, PolicySpec], dict[str, str]]:
    """({name: spec}, {module: "module: ExceptionType: message"} of the modules that cannot be imported)."""
    specs: dict[str, PolicySpec] = {}
    errors: dict[str, str] = {}
    for module in modules:
        try:
            found = importlib.import_module(module).SPECS
        except (ImportError, AttributeError) as exc:
            errors[module.rsplit(".", 1)[-1]] = f"{module}: {type(exc).__name__}: {exc}"
            continue
        for spec in found:
            if spec.name in specs:
                raise RuntimeError(f"policy {spec.name!r} is registered twice ({module})")
            specs[spec.name] = spec
    return specs, errors


def registry() -> dict[str, PolicySpec]:
    """``{name: PolicySpec}`` of every importable policy, in registry order."""
    return _build(POLICY_MODULES)[0]


def policy_import_errors() -> dict[str, str]:
    """``{module: "module: ExceptionType: message"}`` for every policy module that cannot be imported."""
    return dict(_build(POLICY_MODULES)[1])


def available_policies() -> list[str]:
    """Names of the policies that can be made now, in registry order; each policy module that cannot be
    imported is reported with a RuntimeWarning naming it and the exception."""
    for name, err in policy_import_errors().items():
        warnings.warn(f"cache policy module {name!r} is unavailable: {err}", RuntimeWarning, stacklevel=2)
    return list(registry())


def unknown_policy_message(name: str) -> str:
    errors = policy_import_errors()
    text = f"unknown policy {name!r}; available: {', '.join(available_policies())}"
    if errors:
        text += f" (unimportable policy modules: {'; '.join(errors.values())})"
    return text


def policy_spec(name: str) -> PolicySpec:
    """The spec registered as ``name`` (UsageError for an unknown name)."""
    key = name.strip().lower()
    specs = registry()
    if key not in specs:
        raise UsageError(unknown_policy_message(name))
    return specs[key]


def spec_of(policy: Policy) -> PolicySpec:
    """The spec of a policy object: its registered one (by name and class), else that of an unregistered
    policy (a test's, the host-execution baseline): the driver engine only, nothing needed, live."""
    spec = registry().get(getattr(policy, "name", ""))
    if spec is not None and isinstance(policy, spec.load()):
        return spec
    from expertcast.inference.cache.options import PolicyOptions

    return PolicySpec(name=policy.name, cls=type(policy), options=PolicyOptions, help="unregistered policy")


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name`` (UsageError for unknown or unimportable names)."""
    spec = policy_spec(name)
    try:
        return spec.load()
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"policy {name!r} is registered as {spec.target} but cannot be imported "
                         f"({type(exc).__name__}: {exc})") from exc


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Instantiate the policy registered as ``name``.

    ``kwargs`` mixes option keys (values typed, or text; a path for a file option is checked to be a file of
    the right kind and loaded: :mod:`expertcast.inference.policies.artifacts`) and loaded objects (a
    forecaster, a router replay, calibration sequences, a decoder...), which are passed through. A key the
    policy does not take is a UsageError naming the valid ones.
    """
    from expertcast.inference.cache.options import _unknown_option

    spec = policy_spec(name)
    cls = policy_class(name)
    fields = spec.options.option_names()
    objects = object_names(cls)
    values: dict[str, Any] = {}
    given: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k in fields and (k not in objects or v is None or isinstance(v, (str, os.PathLike, int, float))):
            values[k] = v
        elif k in objects:
            given[k] = v
        else:
            raise UsageError(_unknown_option(spec.name, k, fields + [n for n in objects if n not in fields]))
    opts = spec.options.build(spec.name, values)
    return build_policy(spec, opts, **given)


def build_policy(spec: PolicySpec, opts: Any, **objects: Any) -> Policy:
    """The policy of ``spec`` with typed options ``opts`` and the loaded ``objects``; the file options not
    covered by an object are loaded (:func:`~expertcast.inference.policies.artifacts.load_artifacts`)."""
    from expertcast.inference.policies.artifacts import load_artifacts

    policy = spec.load()(opts, **load_artifacts(spec, opts, objects))
    policy.name = spec.name
    policy.label = opts.label()
    return policy


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"lrfu:lam=0.1"`` or ``"belady-k:k=8"`` -> (name, options given), typed and validated by the policy's
    options class (:func:`parse_policy_options`)."""

    opts = parse_policy_options(spec)
    return opts.policy, opts.given_values()


def options_class(name: str) -> type[PolicyOptions]:
    """The options class of registered policy ``name`` (UsageError listing the policies otherwise)."""
    return policy_spec(name).options


def parse_policy_options(spec: str, extra: Mapping[str, Any] | None = None) -> PolicyOptions:
    """``"lrfu:lam=0.1"`` -> ``LRFUPolicy.Options(lam=0.1)``; UsageError for an unknown policy, an unknown
    key (naming the valid ones), a repeated key, a malformed part or a value of the wrong type/range.
    ``extra``: typed values a command adds after the text's (``--forecaster``), checked alike."""
    policy, values = split_policy_text(spec)
    cls = options_class(policy)
    for k, v in (extra or {}).items():
        if k in values:
            raise UsageError(f"{policy} option {k} is given twice in {spec!r}")
        values[k] = v
    return cls.parse(policy, values)


def split_policy_text(spec: str) -> tuple[str, dict[str, Any]]:
    """``"lrfu:lam=0.1"`` -> ``("lrfu", {"lam": "0.1"})``: the one reader of a policy's text form (the values
    still text; :meth:`~expertcast.inference.cache.options.PolicyOptions.build` types them). UsageError for an
    unknown policy, a part that is not key=value or a repeated key."""
    name, _, rest = str(spec).partition(":")
    cls = options_class(name)
    policy = name.strip().lower()
    values: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        if "=" not in part:
            names = cls.option_names()
            raise UsageError(f"policy option {part!r} in {spec!r} must be key=value"
                             + (f"; options: {', '.join(names)}" if names else f" ({policy} has no options)"))
        k, v = (s.strip() for s in part.split("=", 1))
        if k in values:
            raise UsageError(f"{policy} option {k} is given twice in {spec!r}")
        values[k] = v
    return policy, values
