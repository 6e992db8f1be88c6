"""utils/registry.py: records by name in module order; a name registered twice is refused naming the module."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
from expertcast.utils.registry import spec_registry


@dataclass(frozen=True)
class _Spec:
    name: str


def test_records_in_module_order_and_a_twice_registered_name_refused(monkeypatch):
    for mod, name in (("reg_a", "a"), ("reg_b", "b"), ("reg_a2", "a")):
        m = types.ModuleType(mod)
        m.SPEC = _Spec(name)
        monkeypatch.setitem(sys.modules, mod, m)
    assert list(spec_registry(("reg_b", "reg_a"), "thing")) == ["b", "a"]
    with pytest.raises(RuntimeError, match=r"thing 'a' is registered twice \(reg_a2\)"):
        spec_registry(("reg_a", "reg_a2"), "thing")
