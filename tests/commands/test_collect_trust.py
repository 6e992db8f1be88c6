"""`expertcast collect` you can trust: guarded output folders, exact-settings resume, --limit
extension, interruption by SIGKILL/SIGTERM, stable sequence ids, one-line errors (exit 2)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from expertcast.commands.collect import main as collect_main
from expertcast.data.trace_format import sequences_fingerprint
from expertcast.data.traces import load_traces, read_manifest
from expertcast.utils.outdir import MARKER, claim_output_dir
from expertcast.utils.paths import REPO_ROOT

MODEL = "qwen3_moe-tiny"
BASE = ["--model", MODEL, "--benchmark", "gsm8k", "--max-new-tokens", "4", "--device", "cpu", "--no-progress",
        "--threads", "1"]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _collect(out: Path | str, *extra: str) -> int:
    """collect's exit status (argparse's own refusals included)."""
    try:
        return collect_main([*BASE, "--out", str(out), *extra])
    except SystemExit as e:
        return int(e.code)


def _fingerprint(d: Path) -> str:
    return sequences_fingerprint(load_traces(d)[1])


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("expertcast collect: error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_limit_must_be_positive_at_parse_time(tmp_path, capsys):
    for bad in ("0", "-1", "two"):
        assert _collect(tmp_path / "o", "--limit", bad) == 2
        _one_line_error(capsys, "--limit: expected a positive integer")
    assert not (tmp_path / "o").exists()


def test_protected_and_foreign_folders_are_refused_and_left_alone(tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for extra in ([], ["--overwrite"]):  # the filer's case: `--out .`, then the same with --overwrite
        assert _collect(".", "--limit", "1", *extra) == 2
        _one_line_error(capsys, "refusing to use the current working directory")
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    for where, why in ((Path.home(), "the home folder"), (REPO_ROOT, "the expertcast checkout")):
        assert _collect(where, "--limit", "1", "--overwrite") == 2
        _one_line_error(capsys, f"refusing to use {why}")
    assert not (Path.home() / MARKER).exists() and not (REPO_ROOT / MARKER).exists()
    monkeypatch.chdir(tmp_path)
    for extra in ([], ["--overwrite"]):  # a foreign, non-empty folder
        assert _collect(work, "--limit", "1", *extra) == 2
        _one_line_error(capsys, f"output folder {work} is not empty and was not written by expertcast (notes.txt)")
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]


def test_overwrite_keeps_foreign_files_by_refusing(tmp_path, capsys):
    out = tmp_path / "t"
    assert _collect(out, "--limit", "1") == 0
    before = _fingerprint(out)
    (out / "notes.txt").write_text("mine")
    assert _collect(out, "--limit", "1", "--overwrite") == 2
    _one_line_error(capsys, "also holds files expertcast did not write (notes.txt)")
    assert (out / "notes.txt").read_text() == "mine" and _fingerprint(out) == before
    assert _collect(out, "--limit", "1") == 0  # a plain resume leaves the foreign file alone too
    assert "0 shards written, 1 resumed" in capsys.readouterr().out
    (out / "notes.txt").unlink()
    assert _collect(out, "--limit", "1", "--overwrite") == 0
    assert "1 shards written, 0 resumed" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MARKER, ".expertcast.lock", "manifest.json", "trace_meta.json", "shard-00000"])


def test_a_second_concurrent_run_fails_fast(tmp_path, capsys):
    out = tmp_path / "t"
    with claim_output_dir(out, "traces"):
        t0 = time.perf_counter()
        assert _collect(out, "--limit", "1") == 2
        assert time.perf_counter() - t0 < 10
        _one_line_error(capsys, f"{out} is in use by another expertcast run (pid {os.getpid()}")
    assert not (out / "manifest.json").exists()


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("base") / "t"
    assert _collect(out, "--limit", "1") == 0
    return out


@pytest.mark.parametrize("extra,named", [
    (["--max-new-tokens", "5"], "max_new_tokens: 4 (saved) vs 5 (now)"),
    (["--sample"], "do_sample: false (saved) vs true (now)"),
    (["--shard-size", "2"], "shard_size: 64 (saved) vs 2 (now)"),
    (["--batch-size", "2"], "batch_size: 8 (saved) vs 2 (now)"),
    (["--no-chat-template"], "chat_template: true (saved) vs false (now)"),
    (["--router-probs"], "has_router_probs: False (saved) vs True (now)"),
    (["--benchmark", "math500"], "dataset: 'gsm8k' (saved) vs 'math500' (now)"),
    (["--model", "olmoe-tiny"], "model_id: 'qwen3_moe-tiny' (saved) vs 'olmoe-tiny' (now)"),
])
def test_resume_with_another_setting_is_refused_naming_it(base_run, capsys, extra, named):
    before = read_manifest(base_run)
    assert _collect(base_run, "--limit", "1", *extra) == 2
    _one_line_error(capsys, f"cannot resume {base_run}", named, "--overwrite")
    assert read_manifest(base_run) == before


def test_limit_can_grow_but_not_shrink(tmp_path, capsys):
    fresh = tmp_path / "fresh"
    assert _collect(fresh, "--limit", "3", "--shard-size", "2") == 0
    out = tmp_path / "t"
    assert _collect(out, "--limit", "1", "--shard-size", "2") == 0  # shard 0 holds 1 of its 2 items
    capsys.readouterr()
    assert _collect(out, "--limit", "3", "--shard-size", "2") == 0
    assert "2 shards written, 0 resumed, 1 redone" in capsys.readouterr().out  # the partial shard was redone
    assert _fingerprint(out) == _fingerprint(fresh)
    assert read_manifest(out)["complete"] is True
    assert _collect(out, "--limit", "2", "--shard-size", "2") == 2
    _one_line_error(capsys, "shard-00001", "smaller --limit")
    # a shard altered on disk: the resume names the file instead of trusting it
    arrow = next((out / "shard-00001").glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[-8] ^= 0xFF
    arrow.write_bytes(bytes(data))
    assert _collect(out, "--limit", "3", "--shard-size", "2") == 2
    _one_line_error(capsys, f"{arrow} does not match the sha256 recorded in manifest.json")


def test_a_local_model_directory_is_identified_by_its_content(tmp_path, capsys, monkeypatch):
    from expertcast.models.backbone import save_tiny

    monkeypatch.setenv("EXPERTCAST_CACHE_DIR", str(tmp_path / "cache"))
    model = save_tiny(MODEL, tmp_path / "m", seed=0)
    out = tmp_path / "t"
    assert _collect(out, "--limit", "1", "--model", str(model)) == 0
    run = read_manifest(out)["run"]["model"]
    assert set(run) == {"path", "files_sha256"} and run["path"] == str(model.resolve())
    assert json.loads((tmp_path / "cache" / "sha256-cache.json").read_text())  # per-file digests cached
    save_tiny(MODEL, model, seed=1)  # other weights in the same folder
    capsys.readouterr()
    assert _collect(out, "--limit", "1", "--model", str(model)) == 2
    _one_line_error(capsys, "model: {\"", "files_sha256")


def _rows_file(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_completion_ids_are_identities_and_rows_are_validated(tmp_path, capsys):
    rows = [{"id": "a", "thinking": "First, add."}, {"thinking": "Wait, subtract."}, {"id": 7, "thinking": "Hmm."}]
    mode = ["--completions", "--text-field", "thinking", "--max-tokens", "64"]

    def run(out: Path, rows_: list[dict], *extra: str) -> int:
        f = _rows_file(out.parent / f"{out.name}.jsonl", rows_)
        return _collect(out, *mode[:1], str(f), *mode[1:], *extra)

    assert run(tmp_path / "fwd", rows) == 0
    hashed = "sha256-" + hashlib.sha256(json.dumps([None, "Wait, subtract."]).encode()).hexdigest()[:16]
    assert [s.seq_id for s in load_traces(tmp_path / "fwd")[1]] == ["a", hashed, "7"]
    assert run(tmp_path / "rev", rows[::-1]) == 0  # ids do not depend on row numbers
    assert {s.seq_id for s in load_traces(tmp_path / "rev")[1]} == {"a", hashed, "7"}
    assert _fingerprint(tmp_path / "rev") == _fingerprint(tmp_path / "fwd")
    capsys.readouterr()
    bad = [
        ([rows[0], {"id": "a", "thinking": "other"}], ":2: sequence id 'a' repeats line 1"),
        ([rows[1], rows[1]], f":2: sequence id '{hashed}' repeats line 1"),
        ([{"id": None, "thinking": "x"}], ":1: field 'id' must be a non-empty string or an integer, got null"),
        ([{"thinking": 12}], ":1: field 'thinking' must be a non-empty string"),
        ([{"thinking": "  "}], ":1: field 'thinking' must be a non-empty string"),
        ([{"text": "x"}], ":1: no field 'thinking' (fields: text)"),
    ]
    for i, (rows_, message) in enumerate(bad):
        out = tmp_path / f"bad{i}"
        assert run(out, rows_) == 2
        _one_line_error(capsys, f"{out}.jsonl{message}")
        assert not out.exists()  # the file is validated before the output folder is claimed


# -- interruption ----------------------------------------------------------------------------------
INTERRUPT_ARGS = ["--limit", "8", "--shard-size", "1", "--sample", "--seed", "3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("whole") / "t"
    assert _collect(out, *INTERRUPT_ARGS) == 0
    return _fingerprint(out)


def _shards_listed(out: Path) -> int:
    try:
        return len(json.loads((out / "manifest.json").read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


def _collect_in_child(out: Path) -> None:
    sys.exit(collect_main([*BASE, "--out", str(out), *INTERRUPT_ARGS]))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_after_the_first_shard_then_rerun_equals_an_uninterrupted_run(tmp_path, capsys, uninterrupted, sig):
    """A forked child process (it shares the loaded modules, so no 20 s of imports) is killed once the
    manifest lists a shard; the rerun resumes and gives the same trace set as an uninterrupted run."""
    import multiprocessing

    out = tmp_path / "t"
    child = multiprocessing.get_context("fork").Process(target=_collect_in_child, args=(out,))
    child.start()
    try:
        deadline = time.monotonic() + 120
        while _shards_listed(out) < 1 and child.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(child.pid, sig)
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM)
    written = _shards_listed(out)
    assert 1 <= written < 8 and read_manifest(out)["complete"] is False
    capsys.readouterr()
    assert _collect(out, *INTERRUPT_ARGS) == 0
    assert f"{8 - written} shards written, {written} resumed" in capsys.readouterr().out
    assert _fingerprint(out) == uninterrupted
    assert not (out / ".tmp-shards").exists()


def test_a_resumed_collect_reports_the_whole_set(tmp_path, capsys):
    """Rows and accuracy of a resumed run cover every shard of the set, as a fresh run's do."""
    def rows_and_accuracy(out: Path, limit: str) -> tuple[list[dict], str]:
        capsys.readouterr()
        assert _collect(out, "--limit", limit, "--shard-size", "1", "--json", str(out) + f"-{limit}.json") == 0
        acc = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("accuracy of the generated")]
        rows = json.loads(Path(str(out) + f"-{limit}.json").read_text())
        return [{k: r[k] for k in ("pass", "sequences", "tokens")} for r in rows], acc[0]

    fresh = rows_and_accuracy(tmp_path / "fresh", "3")
    rows_and_accuracy(tmp_path / "t", "1")
    resumed = rows_and_accuracy(tmp_path / "t", "3")
    assert resumed == fresh and fresh[0][0]["sequences"] == 3 and "/3 = " in fresh[1]


def test_a_manifest_without_sha256_is_refused(tmp_path, capsys):
    out = tmp_path / "t"
    assert _collect(out, "--limit", "1") == 0
    man = json.loads((out / "manifest.json").read_text())
    for e in man["shards"].values():
        del e["sha256"]
    (out / "manifest.json").write_text(json.dumps(man))
    capsys.readouterr()
    assert _collect(out, "--limit", "1") == 2
    _one_line_error(capsys, "manifest.json is corrupt")
    with pytest.raises(Exception, match="corrupt"):
        load_traces(out)


def test_a_model_folder_without_weights_is_refused_before_the_folder_is_claimed(tmp_path, capsys):
    from expertcast.models.backbone import save_tiny

    model = save_tiny(MODEL, tmp_path / "m", seed=0)
    for f in model.glob("*.safetensors"):
        f.unlink()
    capsys.readouterr()
    assert _collect(tmp_path / "t", "--limit", "1", "--model", str(model)) == 2
    _one_line_error(capsys, "has a config.json but no weights")
    assert not (tmp_path / "t").exists()
