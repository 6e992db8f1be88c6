"""Provenance helpers: stable splits, resume keys, overlap checks, export manifests."""

from __future__ import annotations

import json

import pytest
from expertcast.utils.errors import OverlapError, ResumeMismatchError, UsageError
from expertcast.utils.provenance import (
    check_overlap,
    check_resume,
    settings_key,
    split_of,
    verify_export_manifest,
    write_export_manifest,
)


def test_split_is_stable_under_subsetting():
    ids = [f"gsm8k-test-{i}" for i in range(400)]
    small = {s: split_of(s, 0.2) for s in ids[:28]}
    big = {s: split_of(s, 0.2) for s in ids}
    assert all(big[s] == v for s, v in small.items())
    share = sum(v == "val" for v in big.values()) / len(big)
    assert 0.12 < share < 0.28


def test_resume_refuses_any_changed_setting():
    a = settings_key(seed=0, dtype="float32", model="m")
    check_resume(a, settings_key(seed=0, dtype="float32", model="m"), "x")
    with pytest.raises(ResumeMismatchError, match="seed"):
        check_resume(a, settings_key(seed=1, dtype="float32", model="m"), "x")
    with pytest.raises(ResumeMismatchError, match="records no settings"):
        check_resume(None, a, "x")


def test_overlap_is_an_error_unless_allowed():
    with pytest.raises(OverlapError, match="2 of the 3"):
        check_overlap(["a", "b", "c"], {"a", "b"}, what="export E")
    assert check_overlap(["a", "b", "c"], {"a", "b"}, what="E", allow_overlap=True)["overlap"] == 2
    assert check_overlap(["c"], {"a"}, what="E")["overlap"] == 0
    with pytest.raises(OverlapError, match="records no training"):
        check_overlap(["c"], None, what="E")


def test_export_manifest_covers_every_file(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"temperature": 1.0}))
    (tmp_path / "w.safetensors").write_bytes(b"\0" * 16)
    h = write_export_manifest(tmp_path, ["cfg.json", "w.safetensors"])
    assert verify_export_manifest(tmp_path) == h
    (tmp_path / "cfg.json").write_text(json.dumps({"temperature": 2.0}))
    with pytest.raises(UsageError, match="cfg.json was modified"):
        verify_export_manifest(tmp_path)


def test_export_manifest_refuses_paths_outside(tmp_path):
    with pytest.raises(UsageError, match="outside"):
        write_export_manifest(tmp_path, ["../escape.json"])


def test_code_version_is_read_once_per_process_so_a_long_job_records_the_code_it_loaded(monkeypatch):
    """A commit made while a job runs must not reach its output: the first reading is the process's."""
    import expertcast.utils.provenance as prov

    monkeypatch.setattr(prov, "_CODE_VERSION", None)
    first = prov.code_version()
    assert first["code_format"] == prov.CODE_FORMAT
    monkeypatch.setattr(prov, "_read_code_version", lambda: {"git_commit": "a later commit"})
    again = prov.code_version()
    assert again == first and again["git_commit"] != "a later commit"
    again["git_commit"] = "edited by a caller"
    assert prov.code_version() == first  # callers get copies
