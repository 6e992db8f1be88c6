"""Paths as titles and shipped reports show them: no machine folders."""

from __future__ import annotations

from pathlib import Path


def test_display_path_drops_the_machines_folders(tmp_path, monkeypatch):
    from expertcast.utils.paths import REPO_ROOT, display_path

    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(tmp_path / "data"))
    assert display_path(tmp_path / "data" / "gsm8k" / "train.jsonl") == "$EXPERTCAST_DATA_DIR/gsm8k/train.jsonl"
    assert display_path(REPO_ROOT / "configs" / "x.yaml") == "configs/x.yaml"
    monkeypatch.chdir(tmp_path)
    assert display_path(tmp_path / "runs" / "traces") == "runs/traces"
    assert display_path(Path.home() / "models" / "m") in ("~/models/m", "models/m")
    assert display_path("/srv/somewhere/deep/model") == ".../deep/model"
    assert display_path("Qwen/Qwen3-30B-A3B") == "Qwen/Qwen3-30B-A3B" and display_path("runs/x") == "runs/x"


def test_shipped_report_holds_no_absolute_path():
    import json

    from expertcast.models.names import SHIPPED_DEFAULT_DIR

    def strings(v):
        if isinstance(v, dict):
            for x in v.values():
                yield from strings(x)
        elif isinstance(v, list):
            for x in v:
                yield from strings(x)
        elif isinstance(v, str):
            yield v

    report = json.loads((SHIPPED_DEFAULT_DIR / "report.json").read_text(encoding="utf-8"))
    assert not [s for s in strings(report) if s.startswith("/")]
