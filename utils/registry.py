"""The one builder of the package's record registries (trace importers, model families): each registered module ends
with ``SPEC = <record>``; a registry is its modules' records by ``name``, in module order, built once."""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any


@cache
def spec_registry(modules: tuple[str, ...], what: str) -> dict[str, Any]:
    """``{spec.name: spec}`` of the ``SPEC`` of each module in ``modules``, in order; a name registered twice is a
    bug (RuntimeError naming ``what`` and the module)."""
    specs: dict[str, Any] = {}
    for module in modules:
        spec = importlib.import_module(module).SPEC
        if spec.name in specs:
            raise RuntimeError(f"{what} {spec.name!r} is registered twice ({module})")
        specs[spec.name] = spec
    return specs
