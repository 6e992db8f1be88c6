"""Fixture paths of the trace importers' tests (tests/data/fixtures/traces/<layout>/, written by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
