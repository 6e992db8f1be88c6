"""Fixtures shared by the inference rooms' tests."""

from __future__ import annotations

import inspect

import pytest

LIFECYCLE = ("reset", "set_future", "warm_start")
"""The once-per-run policy calls, which only the driver makes (docs/design.md, "Driver")."""


@pytest.fixture
def lifecycle_callers():
    """``watch(policy)`` -> a list that receives ``(hook, calling module)`` for every lifecycle call of ``policy``
    from then on."""

    def watch(policy) -> list[tuple[str, str]]:
        callers: list[tuple[str, str]] = []
        for hook in LIFECYCLE:
            def call(*args, _hook=hook, _fn=getattr(policy, hook), **kwargs):
                callers.append((_hook, inspect.currentframe().f_back.f_globals["__name__"]))
                return _fn(*args, **kwargs)
            setattr(policy, hook, call)
        return callers

    return watch
