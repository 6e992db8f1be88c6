"""Output folders: foreign files survive, protected paths are refused, a second concurrent run fails fast."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from expertcast.utils.errors import OutputDirError
from expertcast.utils.outdir import MARKER, claim_output_dir


def test_new_folder_is_claimed_and_tracked(tmp_path):
    out = tmp_path / "run"
    with claim_output_dir(out, "simulate") as od:
        od.file("simulate.json").write_text("{}")
        (out / "shard-00000").mkdir()
        od.track(out / "shard-00000")
    assert (out / MARKER).is_file()
    with claim_output_dir(out, "simulate"):  # own earlier output of the same kind: fine
        pass


def test_foreign_non_empty_folder_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="not empty and was not written by expertcast"):
        claim_output_dir(tmp_path, "traces")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_other_kind_is_refused(tmp_path):
    claim_output_dir(tmp_path / "o", "eval").release()
    with pytest.raises(OutputDirError, match="expertcast eval"):
        claim_output_dir(tmp_path / "o", "simulate")


@pytest.mark.parametrize("where", ["cwd", "home", "checkout"])
def test_protected_paths_are_refused(where, tmp_path, monkeypatch):
    from expertcast.utils.paths import REPO_ROOT

    monkeypatch.chdir(tmp_path)
    path = {"cwd": Path("."), "home": Path.home(), "checkout": REPO_ROOT}[where]
    with pytest.raises(OutputDirError, match="refusing"):
        claim_output_dir(path, "traces", overwrite=True)


def test_overwrite_removes_only_own_output(tmp_path):
    out = tmp_path / "o"
    with claim_output_dir(out, "traces") as od:
        od.file("manifest.json").write_text("{}")
    (out / "foreign.txt").write_text("keep me")
    with pytest.raises(OutputDirError, match="did not write"):
        claim_output_dir(out, "traces", overwrite=True)
    assert (out / "foreign.txt").read_text() == "keep me" and (out / "manifest.json").exists()
    (out / "foreign.txt").unlink()
    claim_output_dir(out, "traces", overwrite=True).release()
    assert not (out / "manifest.json").exists()


def test_second_concurrent_claim_fails_fast(tmp_path):
    out = tmp_path / "o"
    holder = claim_output_dir(out, "simulate")
    try:
        code = ("from expertcast.utils.outdir import claim_output_dir\n"
                f"claim_output_dir({str(out)!r}, 'simulate')")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "in use by another expertcast run" in r.stderr
    finally:
        holder.release()
    claim_output_dir(out, "simulate").release()  # free again once the holder is gone


@pytest.mark.parametrize("entry", ["../victim", "ABS", "sub/../../victim", "..", "a/b"])
def test_overwrite_refuses_marker_paths_outside_the_folder(tmp_path, entry):
    import json

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    out = tmp_path / "o"
    with claim_output_dir(out, "traces") as od:
        od.file("manifest.json").write_text("{}")
    m = json.loads((out / MARKER).read_text())
    m["written"].append(str(victim) if entry == "ABS" else entry)
    (out / MARKER).write_text(json.dumps(m))
    with pytest.raises(OutputDirError, match="not a plain name inside the folder"):
        claim_output_dir(out, "traces", overwrite=True)
    assert (victim / "precious.txt").read_text() == "keep me" and (out / "manifest.json").exists()
