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


# -- file-valued output flags ---------------------------------------------------------------------------
def test_output_file_new_path_then_own_earlier_output(tmp_path):
    from expertcast.utils.outdir import FILES, claim_output_file

    f = tmp_path / "rows.json"
    out = claim_output_file(f, "--json", "replay --json")
    f.write_text("[]")
    out.written()
    assert (tmp_path / FILES).is_file()
    claim_output_file(f, "--json", "replay --json")  # its own earlier output: may be replaced
    with pytest.raises(OutputDirError, match="written by `expertcast replay --json`"):
        claim_output_file(f, "--csv", "replay --csv")


@pytest.mark.parametrize("how", ["foreign", "edited", "symlink"])
def test_output_file_never_replaces_a_foreign_file(tmp_path, how):
    from expertcast.utils.outdir import claim_output_file

    f = tmp_path / "precious.txt"
    if how == "symlink":
        (tmp_path / "target.txt").write_text("notes")
        f.symlink_to(tmp_path / "target.txt")
    elif how == "edited":  # expertcast wrote it once, the user changed it since
        out = claim_output_file(f, "--json", "k")
        f.write_text("[]")
        out.written()
        f.write_text("notes, edited by hand")
    else:
        f.write_text("notes")
    with pytest.raises(OutputDirError, match=r"^--json .*precious.txt exists and .*refusing to replace it"):
        claim_output_file(f, "--json", "k")
    assert f.read_text().startswith("notes")


def test_output_file_refuses_folders_and_bookkeeping_names(tmp_path):
    from expertcast.utils.outdir import FILES, claim_output_file

    with pytest.raises(OutputDirError, match="is a folder"):
        claim_output_file(tmp_path, "--csv", "k")
    with pytest.raises(OutputDirError, match="bookkeeping"):
        claim_output_file(tmp_path / FILES, "--csv", "k")


def test_output_file_recognise_and_overwrite(tmp_path):
    from expertcast.utils.outdir import claim_output_file

    f = tmp_path / "cues.json"
    f.write_text('{"format": "mine"}')
    claim_output_file(f, "--out", "k", recognise=lambda p: "mine" in p.read_text())
    with pytest.raises(OutputDirError, match="is not a cue set; refusing to replace it \\(pass --overwrite\\)"):
        claim_output_file(f, "--out", "k", recognise=lambda p: False, what="a cue set", hint="pass --overwrite")
    claim_output_file(f, "--out", "k", overwrite=True)
