"""`expertcast eval` you can trust: one-line refusals of bad input before the model loads, resume only
under identical settings, one run per output folder, and a rerun after SIGKILL that equals an
uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from expertcast.commands.evaluate import SAMPLES, main, read_samples

BASE = ["--model", "qwen3_moe-tiny", "--benchmark", "gsm8k", "--policy", "lru", "--capacity", "0.5",
        "--limit", "2", "--max-new-tokens", "4", "--no-progress", "--device", "cpu",
        "--baseline", "none"]  # the paired speed measurement: tests/commands/test_evaluate_speed.py
SLOW_LINK = ["--link-gbps", "0.02"]
"""An emulated 20 MB/s host link: every batch takes long enough to be interrupted between batches."""
DETERMINISTIC = ("id", "batch", "batch_rows", "correct", "answer", "gold", "completion", "new_tokens")


def run(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of ``expertcast eval argv`` run in this process."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse refusals
        rc = e.code
    return rc, capsys.readouterr().err


def with_opt(flag: str, value: str | None, base: list[str] = BASE) -> list[str]:
    """``base`` with ``flag`` replaced by ``flag value`` (or removed when value is None)."""
    out = list(base)
    if flag in out:
        i = out.index(flag)
        del out[i:i + 2]
    return out + ([flag, value] if value is not None else [])


def stable(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in DETERMINISTIC} for r in rows]


def spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "expertcast.cli", "eval", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=os.environ.copy())


def wait_for(cond, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"eval exited early ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the eval subprocess")
        time.sleep(0.01)


def complete_rows(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.is_file() else 0


# -- bad input: exit 2, one line, nothing written, before the model loads ------------------------------
def _other_model_cues(tmp: Path) -> str:
    from expertcast.inference.saem.cues import CueSet

    p = tmp / "cues-olmoe.json"
    CueSet(cues=["Wait"], model_id="olmoe-tiny", expert_frequency=[[1.0] * 64] * 2).save(p)
    return str(p)


def _router_replay(tmp: Path) -> str:
    from expertcast.inference.policies.router import RouterReplay

    return str(RouterReplay({}).save(tmp / "replay"))


BAD = [
    ("--policy", "nosuch", "unknown policy"),
    ("--policy", "belady", "oracle"),
    ("--policy", "router-temporal:replay=/nonexistent", "replay= is for `expertcast simulate`"),
    ("--policy", "router-full:replay=ROUTER_REPLAY", "replay= is for `expertcast simulate`"),
    ("--policy", "router-full:R=0", "option R=0: must be >= 1"),
    ("--policy", "router-full", "--model must be such an export"),
    ("--policy", "lrfu:lamda=0.1", "no option 'lamda'"),
    ("--policy", "lrfu:lam=fast", "expected a number"),
    ("--policy", "lrfu:lam", "must be key=value"),
    ("--policy", "seqmoe", "needs a forecaster"),
    ("--policy", "stage:cue_set=CUES_OF_OTHER_MODEL", "another model"),
    ("--capacity", "1.5", "outside (0, 1]"),
    ("--capacity", "0", "outside (0, 1]"),
    ("--capacity", "abc", "not a number"),
    ("--capacity", "0.1", "below top-K=4"),
    ("--slots", "2", "below top-K=4"),
    ("--slots", "17", "more than E=16"),
    ("--slots", "0", "at least 1"),
    ("--capacity", None, "give --capacity"),
    ("--max-new-tokens", "0", "--max-new-tokens"),
    ("--limit", "0", "--limit"),
    ("--limit", "-1", "--limit"),
    ("--batch-size", "0", "--batch-size"),
    ("--link-gbps", "-1", "--link-gbps"),
    ("--dtype", "float8", "--dtype"),
    ("--device", "cuda", "CUDA is not available"),
    ("--device", "tpu", "expected auto, cpu or cuda"),
    ("--model", "./no-such-model", "no such local directory"),
    ("--split", "nosuch", "no split"),
    ("--data-dir", "/nonexistent-data", "not found"),
]


@pytest.mark.parametrize("flag,value,expected", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_bad_input_exits_2_with_one_line(flag, value, expected, tmp_path, capsys, data_dir):
    if flag == "--device" and value == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    if value == "stage:cue_set=CUES_OF_OTHER_MODEL":
        value = f"stage:cue_set={_other_model_cues(tmp_path)}"
    if value == "router-full:replay=ROUTER_REPLAY":
        value = f"router-full:replay={_router_replay(tmp_path)}"
    out = tmp_path / "out"
    base = with_opt("--capacity", None) if flag == "--slots" else BASE
    rc, err = run(with_opt(flag, value, base) + ["--out", str(out)], capsys)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("expertcast eval: error:") and "Traceback" not in err
    assert expected in err, err
    assert not (out / SAMPLES).exists()


def test_capacity_and_slots_together_refused(tmp_path, capsys, data_dir):
    rc, err = run([*BASE, "--slots", "8", "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "not both" in err


@pytest.mark.parametrize("out", ["cwd", "foreign"])
def test_unusable_output_folder(out, tmp_path, monkeypatch, capsys, data_dir):
    if out == "cwd":
        monkeypatch.chdir(tmp_path)
        target = "."
    else:
        (tmp_path / "mine.txt").write_text("not expertcast's")
        target = str(tmp_path)
    rc, err = run([*BASE, "--out", target], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert ("current working directory" if out == "cwd" else "not empty") in err


# -- resume only under identical settings -------------------------------------------------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir_module):
    out = tmp_path_factory.mktemp("eval") / "run"
    assert main([*BASE, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def data_dir_module():
    d = os.environ.get("EXPERTCAST_DATA_DIR")
    if not d or not Path(d).is_dir():
        pytest.fail("benchmark data not found: set EXPERTCAST_DATA_DIR or keep ../shared/data beside the repo")
    return Path(d)


@pytest.mark.parametrize("flag,value,setting", [("--seed", "1", "seed"), ("--dtype", "bfloat16", "dtype"),
                                                ("--chat-template", "no", "chat_template"),
                                                ("--max-new-tokens", "5", "max_new_tokens"),
                                                ("--policy", "lrfu:lam=0.5", "policy"),
                                                ("--pool", "shared", "pool")])
def test_resume_with_other_settings_refused(finished, flag, value, setting, capsys):
    before = (finished / SAMPLES).read_bytes()
    rc, err = run([*with_opt(flag, value), "--out", str(finished)], capsys)
    assert rc == 2, err
    assert f"cannot resume {finished}" in err and f"{setting}:" in err and len(err.strip().splitlines()) == 1
    assert (finished / SAMPLES).read_bytes() == before


def test_resume_same_settings_and_larger_limit(finished, tmp_path, capsys):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    first = read_samples(out / SAMPLES)
    assert main([*with_opt("--limit", "3"), "--out", str(out)]) == 0
    assert "resuming" in capsys.readouterr().out
    rows = read_samples(out / SAMPLES)
    assert [r["id"] for r in rows] == ["gsm8k-test-00000", "gsm8k-test-00001", "gsm8k-test-00002"]
    assert rows[:2] == first  # done samples are kept, never regenerated or duplicated
    assert json.loads((out / "summary.json").read_text())["samples"] == 3
    # a smaller limit summarizes its own problems only, from the same file
    assert main([*with_opt("--limit", "1"), "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["samples"] == 1
    assert len(read_samples(out / SAMPLES)) == 3
    # --overwrite starts over
    assert main([*with_opt("--limit", "1", with_opt("--seed", "1")), "--overwrite", "--out", str(out)]) == 0
    assert json.loads((out / "settings.json").read_text())["seed"] == 1
    assert len(read_samples(out / SAMPLES)) == 1


def test_corrupt_samples_named_by_line(finished, tmp_path, capsys):
    import shutil

    for case in ("middle", "duplicate"):
        out = tmp_path / case
        shutil.copytree(finished, out)
        lines = (out / SAMPLES).read_text().splitlines(keepends=True)
        lines.insert(1, "{not json\n" if case == "middle" else lines[0])
        (out / SAMPLES).write_text("".join(lines))
        rc, err = run([*BASE, "--out", str(out)], capsys)
        assert rc == 2 and f"{out / SAMPLES}:2:" in err, err
        assert ("not a JSON sample row" if case == "middle" else "already has a sample") in err


# -- one run per folder; interrupted runs -------------------------------------------------------------
def test_second_concurrent_eval_exits_2(tmp_path, capsys, data_dir):
    out = tmp_path / "busy"
    proc = spawn([*BASE, *SLOW_LINK, "--out", str(out)])
    try:
        lock = out / ".expertcast.lock"
        wait_for(lambda: lock.is_file() and lock.read_text().startswith(f"{proc.pid} "), proc)
        rc, err = run([*BASE, *SLOW_LINK, "--out", str(out)], capsys)
        assert rc == 2 and f"in use by another expertcast run (pid {proc.pid} " in err, err
    finally:
        proc.kill()
        proc.wait()


def test_rerun_after_sigkill_equals_uninterrupted_run(tmp_path, capsys, data_dir):
    ref = tmp_path / "ref"
    assert main([*BASE, "--out", str(ref)]) == 0  # the link speed changes timings, never the completions
    argv = [*BASE, *SLOW_LINK]
    out = tmp_path / "killed"
    proc = spawn([*argv, "--out", str(out)])
    try:
        wait_for(lambda: complete_rows(out / SAMPLES) >= 1, proc)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists() and complete_rows(out / SAMPLES) < 2  # it died mid-run
    assert main([*argv, "--out", str(out)]) == 0
    rows = read_samples(out / SAMPLES)
    assert len({r["id"] for r in rows}) == len(rows) == 2
    assert stable(rows) == stable(read_samples(ref / SAMPLES))


# -- forecaster leakage --------------------------------------------------------------------------------
def _forecaster(tmp: Path, trained: list[str]) -> Path:
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
    from expertcast.models.forecaster_export import save_forecaster

    cfg = ForecasterConfig(num_layers=4, num_experts=16, top_k=4, hidden_size=16, num_blocks=1, state_size=8,
                           head_dim=8, chunk_size=16, direct_horizons=2)
    return save_forecaster(ExpertForecaster(cfg), tmp / "fc", source={"model_id": "qwen3_moe-tiny"},
                           training={"train_ids": trained, "val_ids": []})


def test_seqmoe_forecaster_trained_on_evaluated_problems(tmp_path, capsys, data_dir):
    fc = _forecaster(tmp_path, ["gsm8k-test-00001", "gsm8k-test-00500"])
    rc, err = run([*with_opt("--policy", f"seqmoe:forecaster={fc}"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and "1 of the 2 evaluated sequences were used to train" in err and "gsm8k-test-00001" in err
    assert not (tmp_path / "o").exists()  # refused before the output folder is claimed


@pytest.mark.slow  # the SeqMoE policy forecasts at every position of a ~600-token prompt (minutes on 2 cores)
def test_allowed_overlap_is_reported(tmp_path, capsys, data_dir):
    fc = _forecaster(tmp_path, ["gsm8k-test-00000"])
    short = with_opt("--limit", "1", with_opt("--max-new-tokens", "2"))
    argv = with_opt("--policy", f"seqmoe:forecaster={fc},horizon=2", short)
    assert main([*argv, "--allow-overlap", "--out", str(tmp_path / "o")]) == 0
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["overlap"] == {"overlap": 1, "evaluated": 1, "allowed": True}
    assert s["settings"]["policy"]["artefacts_sha256"]["forecaster"]
    assert "forecaster training overlap: 1 of 1 evaluated problems (allowed by --allow-overlap)" in capsys.readouterr().out


def test_resume_with_a_limit_that_cuts_a_batch_is_refused(tmp_path, capsys):
    """A batch's counters cover all its problems: a smaller --limit that cuts a batch of the earlier run
    is refused (nothing written); one that ends on a batch boundary summarizes exactly those batches."""
    out = tmp_path / "o"
    two = with_opt("--batch-size", "2", with_opt("--limit", "4"))
    assert main([*two, "--out", str(out)]) == 0
    before = (out / SAMPLES).read_bytes()
    rc, err = run([*with_opt("--limit", "3", two), "--out", str(out)], capsys)
    assert rc == 2 and "counters cannot be split" in err and len(err.strip().splitlines()) == 1, err
    assert (out / SAMPLES).read_bytes() == before
    assert main([*with_opt("--limit", "2", two), "--out", str(out)]) == 0
    resumed = json.loads((out / "summary.json").read_text())
    fresh_out = tmp_path / "fresh"
    assert main([*with_opt("--limit", "2", two), "--out", str(fresh_out)]) == 0
    fresh = json.loads((fresh_out / "summary.json").read_text())
    for k in ("samples", "correct", "accesses", "demand_misses", "proactive_loads", "decoded_tokens"):
        assert resumed[k] == fresh[k], k


def test_config_file_values_and_flag_override_equal_the_command_line(tmp_path):
    from expertcast.commands.evaluate import build_parser

    cfg = tmp_path / "eval.yaml"
    cfg.write_text("model: qwen3_moe-tiny\nbenchmark: arith\npolicy: lru\ncapacity: 0.5\nlimit: 4\n"
                   "max-new-tokens: 16\nout: runs/a\n")
    got = vars(build_parser().parse_args(["--config", str(cfg), "--limit", "2", "--policy", "lfu"]))
    flags = vars(build_parser().parse_args(["--model", "qwen3_moe-tiny", "--benchmark", "arith", "--policy", "lfu",
                                            "--capacity", "0.5", "--limit", "2", "--max-new-tokens", "16",
                                            "--out", "runs/a"]))
    assert got.pop("config") == str(cfg) and flags.pop("config") is None
    assert got == flags


def test_disk_store_eval_equals_ram_and_reports_rss(finished, tmp_path, capsys, data_dir):
    """``--store disk``: the same completions as the RAM store's run, the expert file in OUT by default, the I/O
    mode, the readers and the peak RSS against its bound in summary.json and on stdout; contradictory flags
    refused with one line."""
    out = tmp_path / "disk"
    assert main([*BASE, "--store", "disk", "--readers", "2", "--prefetch-chunk-kb", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert stable(read_samples(out / SAMPLES)) == stable(read_samples(finished / SAMPLES))
    assert (out / "experts.disk.safetensors").is_file()
    rss = json.loads((out / "summary.json").read_text())["rss"]
    assert rss["store"] == "disk" and rss["readers"] == 2 and rss["disk_io_mode"] in ("direct", "buffered+dontneed")
    assert rss["prefetch_chunk_kb"] == 0  # whole prefetch reads, as asked: the flag reaches the reader pool's load
    assert rss["peak_rss_bytes"] > 0 and rss["bound_bytes"] > 0 and "peak RSS" in printed
    for extra, msg in ((["--store", "disk", "--mmap-store"], "exclude each other"),
                       (["--store", "disk", *SLOW_LINK], "--link-gbps"),
                       (["--disk-path", str(tmp_path / "x")], "needs --store disk")):
        rc, err = run([*BASE, *extra, "--out", str(tmp_path / "bad")], capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and msg in err, err


# -- the fitted-on guard: another model's routing ------------------------------------------------------
def _other_model_forecaster(tmp: Path, model_id: str) -> Path:
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
    from expertcast.models.forecaster_export import save_forecaster

    cfg = ForecasterConfig(num_layers=4, num_experts=16, top_k=4, hidden_size=16, num_blocks=1, state_size=8,
                           head_dim=8, chunk_size=16, direct_horizons=2)
    return save_forecaster(ExpertForecaster(cfg), tmp / "fc-other", source={"model_id": model_id},
                           training={"train_ids": ["gsm8k-train-00000"], "val_ids": []})


def test_forecaster_of_another_model_is_refused_unless_allowed(tmp_path, capsys, data_dir):
    from expertcast.commands.evaluate import build_parser, prepare

    fc = _other_model_forecaster(tmp_path, "olmoe-tiny")
    argv = [*with_opt("--policy", f"seqmoe:forecaster={fc}"), "--out", str(tmp_path / "o")]
    rc, err = run(argv, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "was fitted on model 'olmoe-tiny'" in err and "'qwen3_moe-tiny'" in err and "--allow-model-mismatch" in err
    assert not (tmp_path / "o").exists()
    info = prepare(build_parser().parse_args([*argv, "--allow-model-mismatch"]))["info"]
    assert info["guard"]["forecaster"]["model_match"] is False and info["overlap"]["overlap"] == 0
    assert "--allow-model-mismatch" in info["guard_note"] and "olmoe-tiny" in info["guard_note"]


def test_router_adapted_model_is_not_its_base(tmp_path, capsys, data_dir):
    """A forecaster fitted on the base's routing, evaluated on the router-adapted model (another routing)."""
    from expertcast.train.router_module import RouterAdaptationModule

    torch.set_num_threads(1)
    export = tmp_path / "adapted"
    RouterAdaptationModule(model="qwen3_moe-tiny", mode="lm_only", budget=6).export(export, training=None)
    fc = _other_model_forecaster(tmp_path, "qwen3_moe-tiny")
    capsys.readouterr()  # the export's own progress bar
    argv = with_opt("--model", str(export), with_opt("--policy", f"seqmoe:forecaster={fc}"))
    rc, err = run([*argv, "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "was fitted on model 'qwen3_moe-tiny'" in err and "router-adapted" in err, err


# -- expert formats ------------------------------------------------------------------------------------
def test_int4_experts_run_and_match_the_all_resident_int4_baseline(tmp_path, capsys, data_dir):
    out = tmp_path / "o"
    argv = with_opt("--baseline", "resident", with_opt("--limit", "1"))
    assert main([*argv, "--expert-dtype", "int4", "--speed-repeats", "1", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["expert_dtype"] == "int4" and s["settings"]["expert_dtype"] == "int4"
    assert s["load"]["plan"]["expert_format"] == "int4"
    sp = json.loads((out / "speed.json").read_text())
    # the baseline reuses the session's int4 store (same kernels): its tokens are the offloaded run's
    assert sp["baseline"] == "all-resident" and sp["tokens_match"] and sp["decoded_tokens"] > 0
    assert "experts int4" in capsys.readouterr().out


def test_cue_set_of_another_model_is_reported_when_allowed(tmp_path, capsys, data_dir):
    from expertcast.commands.evaluate import build_parser, prepare
    from expertcast.inference.saem.cues import CueSet

    p = tmp_path / "cues.json"
    CueSet(cues=["Wait"], model_id="olmoe-tiny", expert_frequency=[[1.0] * 16] * 4).save(p)
    argv = [*with_opt("--policy", f"stage:cue_set={p}"), "--out", str(tmp_path / "o")]
    rc, err = run(argv, capsys)
    assert rc == 2 and "'olmoe-tiny'" in err and "--allow-model-mismatch" in err, err
    info = prepare(build_parser().parse_args([*argv, "--allow-model-mismatch"]))["info"]
    assert info["guard"]["cue set"]["model_match"] is False and "olmoe-tiny" in info["guard_note"]
