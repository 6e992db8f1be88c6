"""Fixture paths of the trace importers' tests (tests/data/fixtures/traces/<layout>/: excerpts of each layout as its writer makes it)."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
