"""docs/results.md says what the shipped default model's build report says (its build time)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_recipe_build_time_is_the_shipped_reports():
    from expertcast.models.names import SHIPPED_DEFAULT_DIR

    report = json.loads((SHIPPED_DEFAULT_DIR / "report.json").read_text(encoding="utf-8"))
    text = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    m = re.search(r"key `([0-9a-f]+)`, ([\d.]+) minutes on (\d+) threads", text)
    assert m, "docs/results.md names no build of the shipped recipe"
    assert m.group(1) == report["key"]
    assert float(m.group(2)) == round(report["total_time_s"] / 60, 1)
    assert int(m.group(3)) == report["threads"]
    step = re.search(r"`step_time_s` ([\d.]+)", text)
    assert step and float(step.group(1)) == round(report["step_time_s"], 2)
