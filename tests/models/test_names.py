"""The one model-name resolver (models/names.py): presets, folders, exports, Hub ids, the embedded default."""

from __future__ import annotations

import pytest
from expertcast.models.names import (
    SHIPPED_DEFAULT_DIR,
    ModelNotFoundError,
    resolve_model,
    shipped_default_model,
)
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


def test_the_default_is_the_shipped_model_verified_and_never_trained(tmp_path, monkeypatch, capsys):
    """`tiny-default` names the files committed in models/shipped/tiny-default once every checksum in their
    report matches; an empty cache builds nothing; a corrupt or missing file is one line naming it."""
    import json
    import shutil

    monkeypatch.setenv("EXPERTCAST_CACHE_DIR", str(tmp_path / "cache"))
    assert resolve_model("tiny-default", announce=True) == str(SHIPPED_DEFAULT_DIR)
    assert "(shipped, sha256 verified)" in capsys.readouterr().err
    assert resolve_model("default") == str(SHIPPED_DEFAULT_DIR)
    assert not (tmp_path / "cache").exists()  # nothing was built or cached
    listed = json.loads((SHIPPED_DEFAULT_DIR / "report.json").read_text())["shipped_files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(listed)

    copy = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DEFAULT_DIR, copy)
    assert shipped_default_model(copy) == copy
    cfg = (copy / "config.json").read_bytes()
    (copy / "config.json").write_bytes(cfg.replace(b"4", b"5", 1))  # same size, other bytes
    with pytest.raises(ModelNotFoundError, match=r"config.json has sha256 .* its report records"):
        shipped_default_model(copy)
    (copy / "config.json").write_bytes(cfg + b" ")
    with pytest.raises(ModelNotFoundError, match=r"config.json has \d+ bytes, its report records"):
        shipped_default_model(copy)
    (copy / "config.json").write_bytes(cfg)
    assert shipped_default_model(copy) == copy
    (copy / "report.json").unlink()
    with pytest.raises(ModelNotFoundError, match="is not shipped at .*expertcast build-default"):
        shipped_default_model(copy)
