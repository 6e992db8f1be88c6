"""The one model-name resolver (models/names.py): presets, folders, exports, Hub ids, the embedded default."""

from __future__ import annotations

import pytest
from expertcast.models.names import ModelNotFoundError, record_default_model, resolve_model
from expertcast.utils.errors import UsageError


def test_names_resolve_to_what_the_loader_loads(tmp_path):
    assert resolve_model("qwen3_moe-tiny") == "qwen3_moe-tiny"
    assert resolve_model("Qwen/Qwen3-30B-A3B") == "Qwen/Qwen3-30B-A3B"  # owner/name: a Hub id
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "m")) == str(tmp_path / "m")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "export.json").write_text("{}")  # a router-adaptation export: kept as the folder
    assert resolve_model(str(tmp_path / "e")) == str(tmp_path / "e")
    for bad, why in [(str(tmp_path / "nope"), "no such local directory"), ("nope", "no such local directory"),
                     ("a/b/c", "does not exist"), (str(tmp_path / "e" / "export.json"), "is a file"),
                     (str(tmp_path), "no config.json"), (" ", "empty")]:
        with pytest.raises(ModelNotFoundError, match=why):
            resolve_model(bad)
    assert issubclass(ModelNotFoundError, UsageError) and issubclass(ModelNotFoundError, FileNotFoundError)


def test_the_default_is_its_last_build_or_the_builder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EXPERTCAST_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelNotFoundError, match="run `expertcast build-default`"):
        resolve_model("tiny-default")
    build = tmp_path / "build"
    build.mkdir()
    (build / "config.json").write_text("{}")
    assert resolve_model("default", build_default=lambda: build, announce=True) == str(build)
    assert "embedded default model at" in capsys.readouterr().err
    record_default_model(build)
    assert resolve_model("tiny-default") == str(build.resolve())
