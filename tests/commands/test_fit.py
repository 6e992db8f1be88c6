"""`expertcast fit` you can trust, on a tiny forecaster and synthetic traces: every run has its own run
directory and starts at step 0; resume only when asked and only under the same settings and data; a
truncated last.ckpt falls back to the previous one; SIGTERM mid-fit leaves a checkpoint and no export,
and the resumed run ends with the weights of an uninterrupted one."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from expertcast.commands import fit as fit_cmd
from expertcast.data.synthetic import ModeMarkovProcess
from expertcast.data.trace_format import sequences_fingerprint
from expertcast.data.traces import load_traces, write_traces
from expertcast.models.forecaster_export import load_forecaster, training_ids

REPO = Path(__file__).resolve().parents[2]
RUN_NAME = re.compile(r"forecaster-tiny-\d{8}-\d{6}-[0-9a-f]{8}(-\d+)?")


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fit_traces")
    proc = ModeMarkovProcess.random(num_modes=6, num_layers=2, num_experts=8, top_k=2, seed=0)
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        seqs, _ = proc.sample(24, 40, prompt_len=6, seed=seed)
        out[name] = write_traces(root / name, proc.meta(), seqs)
    return out


def fit_args(root: Path, traces: Path, epochs: int = 2, *extra: str) -> list[str]:
    """A tiny forecaster fit: 12 batches per epoch, no logger, validation every epoch."""
    return ["--config", str(REPO / "configs/forecaster/tiny.yaml"), "--data.init_args.traces", str(traces),
            "--trainer.default_root_dir", str(root), "--trainer.max_epochs", str(epochs), "--trainer.min_steps", "0",
            "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.check_val_every_n_epoch", "1",
            "--model.init_args.hidden_size", "16", "--model.init_args.head_dim", "8",
            "--model.init_args.state_size", "8", "--model.init_args.num_blocks", "1",
            "--model.init_args.direct_horizons", "2", "--model.init_args.chunk_size", "16",
            "--data.init_args.window", "8", "--data.init_args.batch_size", "8", *extra]


def run_fit(args: list[str]):
    rc = fit_cmd.main(args)
    return rc, fit_cmd.last_result


def ckpt_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def weights(export: Path) -> dict[str, torch.Tensor]:
    return load_forecaster(export).model.state_dict()


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "error:" in ln]


@pytest.fixture(scope="module")
def two_runs(traces, tmp_path_factory):
    root = tmp_path_factory.mktemp("fit_runs")
    rc_a, a = run_fit(fit_args(root, traces["a"], 2, "--checkpoint-every", "5"))
    rc_b, b = run_fit(fit_args(root, traces["b"], 2, "--checkpoint-every", "5"))
    assert rc_a == 0 and rc_b == 0
    return root, a, b


def test_two_fits_get_their_own_run_dirs_and_start_at_step_zero(two_runs, traces):
    root, a, b = two_runs
    assert a.run_dir != b.run_dir and a.run_dir.parent == b.run_dir.parent == root
    assert RUN_NAME.fullmatch(a.run_dir.name) and RUN_NAME.fullmatch(b.run_dir.name)
    assert a.global_step == b.global_step == 24 and a.resumed_from is None and b.resumed_from is None
    # the second run trained from step 0 on its own data: its previous checkpoint is its own step 20
    assert ckpt_step(b.run_dir / "checkpoints/last-prev.ckpt") == 20
    assert ckpt_step(b.run_dir / "checkpoints/last.ckpt") == 24
    info = json.loads((b.run_dir / "run.json").read_text())
    assert info["status"] == "finished" and "resumes" not in info
    # what the run's speed depends on beyond its settings (in-process here: the console script holds the heap)
    assert info["host"]["torch_threads"] == torch.get_num_threads() and info["host"]["cpus"] >= 1
    assert info["host"]["heap_held"] is False and "omp_num_threads" in info["host"]
    assert (b.run_dir / "config.yaml").is_file() and b.export_dir == b.run_dir / "export"
    exp = load_forecaster(b.export_dir)
    assert exp.export_hash == b.export_hash
    _, seqs = load_traces(traces["b"])
    t = exp.training
    assert t["traces"] == [str(traces["b"])] and t["trace_fingerprint"] == sequences_fingerprint(seqs)
    assert t["run_dir"] == str(b.run_dir) and t["global_step"] == 24 and t["config"]["trainer"]["max_epochs"] == 2
    assert training_ids(b.export_dir) == {s.seq_id for s in seqs}
    assert not set(t["train_ids"]) & set(t["val_ids"]) and t["val_ids"]
    wa, wb = weights(a.export_dir), weights(b.export_dir)
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_refused_under_other_data_or_settings(two_runs, traces, capsys):
    root, a, _ = two_runs
    before = sorted(root.iterdir())
    capsys.readouterr()
    rc, _ = run_fit(fit_args(root, traces["b"], 2, "--resume", str(a.run_dir)))
    err = capsys.readouterr().err
    assert rc == 2 and len(error_lines(err)) == 1 and "data_fingerprint" in error_lines(err)[0], err
    rc, _ = run_fit(fit_args(root, traces["a"], 2, "--model.init_args.hidden_size", "32", "--resume", str(a.run_dir)))
    err = capsys.readouterr().err
    assert rc == 2 and "model.init_args.hidden_size: 16 (saved) vs 32 (now)" in error_lines(err)[0], err
    rc, _ = run_fit(fit_args(root, traces["a"], 2, "--resume", str(root / "nope")))
    assert rc == 2 and "no such run directory" in capsys.readouterr().err
    assert sorted(root.iterdir()) == before  # no run directory was made


def test_resume_continues_from_the_saved_step_and_survives_a_truncated_last(two_runs, traces, capsys):
    _, a, _ = two_runs
    last, prev = a.run_dir / "checkpoints/last.ckpt", a.run_dir / "checkpoints/last-prev.ckpt"
    prev_step = ckpt_step(prev)
    assert prev_step == 20
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    capsys.readouterr()
    rc, r = run_fit(fit_args(a.run_dir.parent, traces["a"], 3, "--resume", str(a.run_dir)))
    err = capsys.readouterr().err
    assert rc == 0 and r.run_dir == a.run_dir and r.resumed_from == prev and r.global_step == 36
    warn = [ln for ln in err.splitlines() if "warning:" in ln]
    assert len(warn) == 1 and "last.ckpt" in warn[0] and "last-prev.ckpt (step 20)" in warn[0], err
    info = json.loads((a.run_dir / "run.json").read_text())
    assert info["resumes"][0]["step"] == 20 and info["status"] == "finished" and info["global_step"] == 36
    assert info["resumes"][0]["host"]["torch_threads"] == torch.get_num_threads()
    assert ckpt_step(last) == 36 and load_forecaster(r.export_dir).training["global_step"] == 36


def test_explicit_export_dir_is_claimed_and_replaced_only_with_overwrite(traces, tmp_path, capsys):
    export = tmp_path / "fc-export"
    args = fit_args(tmp_path / "runs", traces["a"], 1, "--model.init_args.export_dir", str(export))
    rc, first = run_fit(args)
    assert rc == 0 and first.export_dir == export and not (first.run_dir / "export").exists()
    assert load_forecaster(export).training["run_dir"] == str(first.run_dir)
    capsys.readouterr()
    rc, _ = run_fit(args)
    err = capsys.readouterr().err
    assert rc == 2 and "already holds an export" in error_lines(err)[0] and "--overwrite" in err, err
    assert len(list((tmp_path / "runs").iterdir())) == 1  # refused before a run directory was made
    rc, second = run_fit([*args, "--overwrite"])
    assert rc == 0 and load_forecaster(export).training["run_dir"] == str(second.run_dir) != str(first.run_dir)
    (export / "notes.txt").write_text("mine")  # a file expertcast did not write: refused before training
    capsys.readouterr()
    rc, _ = run_fit([*args, "--overwrite"])
    err = capsys.readouterr().err
    assert rc == 2 and "notes.txt" in error_lines(err)[0] and (export / "notes.txt").read_text() == "mine"
    assert len(list((tmp_path / "runs").iterdir())) == 2
    assert json.loads((export / "forecaster.json").read_text())["training"]["run_dir"] == str(second.run_dir)


def test_run_dir_variable_is_set_only_while_training(traces, tmp_path, monkeypatch):
    """build_cli alone leaves RUN_DIR_ENV as it found it (unset, or a torchrun launch's folder); fit() sets it
    to the run directory for the processes Lightning launches while it trains, and restores it after."""
    from expertcast.train import cli as fit_cli
    from expertcast.train.fit_run import RUN_DIR_ENV

    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    built = fit_cli.build_cli(fit_args(tmp_path / "built", traces["a"], 1))
    built.plan.release()
    assert built.plan.run_dir.parent == tmp_path / "built" and RUN_DIR_ENV not in os.environ
    shared = tmp_path / "launch" / "run"
    monkeypatch.setenv(RUN_DIR_ENV, str(shared))  # as torchrun / SLURM users set it
    built = fit_cli.build_cli(fit_args(tmp_path / "unused", traces["a"], 1))
    built.plan.release()
    assert built.plan.run_dir == shared and os.environ[RUN_DIR_ENV] == str(shared)

    monkeypatch.delenv(RUN_DIR_ENV)
    seen, train = [], fit_cli._train

    def spy(cli, plan, args):
        seen.append(os.environ.get(RUN_DIR_ENV))
        return train(cli, plan, args)

    monkeypatch.setattr(fit_cli, "_train", spy)
    rc, result = run_fit(fit_args(tmp_path / "fit", traces["a"], 1))
    assert rc == 0 and seen == [str(result.run_dir)] and RUN_DIR_ENV not in os.environ


def _fork_fit(args: list[str], log: Path) -> int:
    """Run the fit command in a forked child (a real separate process, output to ``log``); returns its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            # pytest's capture replaced sys.stdout/stderr with its own objects: write to the log instead
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            code = fit_cmd.main(args)
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(code)
    return pid


def test_sigterm_mid_fit_then_resume_matches_an_uninterrupted_run(traces, tmp_path):
    # scheduled sampling from the first step: every step draws from the global RNG, which a resume restores
    sampling = ("--model.init_args.teacher_forcing_fraction", "0.0", "--checkpoint-every", "1")
    args = fit_args(tmp_path / "runs", traces["a"], 3, *sampling)
    pid = _fork_fit(args, tmp_path / "child.log")
    deadline = time.monotonic() + 120
    while not list((tmp_path / "runs").glob("*/checkpoints/last.ckpt")):
        assert time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0), "fit ended before SIGTERM"
        time.sleep(0.02)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 143
    (run,) = (tmp_path / "runs").iterdir()
    info = json.loads((run / "run.json").read_text())
    stopped = ckpt_step(run / "checkpoints/last.ckpt")
    print(f"SIGTERM stopped the fit after step {stopped} of 36")
    assert info["status"] == "interrupted" and info["global_step"] == stopped and 0 < stopped < 36
    assert not (run / "export").exists()  # no export from an interrupted run
    log = (tmp_path / "child.log").read_text()
    assert "SIGTERM received" in log and "no export written" in log and f"--resume {run}" in log, log

    rc, resumed = run_fit([*args, "--resume", str(run)])
    assert rc == 0 and resumed.global_step == 36 and resumed.run_dir == run
    rc, ref = run_fit(fit_args(tmp_path / "ref", traces["a"], 3, *sampling))
    assert rc == 0 and ref.global_step == 36
    w_resumed, w_ref = weights(resumed.export_dir), weights(ref.export_dir)
    assert all(torch.equal(w_resumed[k], w_ref[k]) for k in w_ref), f"stopped at step {stopped}"
    assert load_forecaster(resumed.export_dir).config == load_forecaster(ref.export_dir).config


def test_sigkill_mid_fit_then_resume_matches_an_uninterrupted_run(traces, tmp_path):
    """SIGKILL gives no chance to clean up: the run resumes from its last periodic checkpoint (the lock dies
    with the process) and still ends with the weights of an uninterrupted run."""
    sampling = ("--model.init_args.teacher_forcing_fraction", "0.0", "--checkpoint-every", "3")
    args = fit_args(tmp_path / "runs", traces["a"], 3, *sampling)
    pid = _fork_fit(args, tmp_path / "child.log")
    deadline = time.monotonic() + 120
    ckpts = tmp_path / "runs"
    while not any(_readable(p) and ckpt_step(p) >= 6 for p in ckpts.glob("*/checkpoints/last.ckpt")):
        assert time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0), "fit ended before SIGKILL"
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
    (run,) = (tmp_path / "runs").iterdir()
    assert not (run / "export").exists()
    stopped = ckpt_step(run / "checkpoints/last.ckpt")
    print(f"SIGKILL after the checkpoint at step {stopped} of 36")
    rc, resumed = run_fit([*args, "--resume", str(run)])
    assert rc == 0 and resumed.global_step == 36 and resumed.run_dir == run
    rc, ref = run_fit(fit_args(tmp_path / "ref", traces["a"], 3, *sampling))
    assert rc == 0
    w_resumed, w_ref = weights(resumed.export_dir), weights(ref.export_dir)
    assert all(torch.equal(w_resumed[k], w_ref[k]) for k in w_ref), f"killed after step {stopped}"


def _readable(path: Path) -> bool:
    try:
        ckpt_step(path)
        return True
    except Exception:  # a checkpoint being written right now
        return False


def test_wandb_checkpoints_are_logged_as_an_artifact_when_asked(traces, tmp_path, wandb_dir, offline_contents, capsys):
    """``--wandb-checkpoints``: the finished run's checkpoints become a ``model-checkpoint`` artifact of its W&B
    run (offline here), beside the export; without a W&B logger the flag is a one-line refusal."""
    args = fit_args(tmp_path / "runs", traces["a"], 1, "--wandb-checkpoints")
    rc, _ = run_fit(args)
    assert rc == 2 and "--wandb-checkpoints" in capsys.readouterr().err
    logger = '{"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"project": "t", "offline": true}}'
    args[args.index("--trainer.logger") + 1] = logger
    rc, res = run_fit(args)
    assert rc == 0
    [run] = sorted(res.run_dir.glob("wandb/offline-run-*"))
    got = offline_contents(run, lambda c: {a["type"] for a in c["artifacts"]} >= {"model-checkpoint",
                                                                                  "forecaster-export"})
    [art] = [a for a in got["artifacts"] if a["type"] == "model-checkpoint"]
    assert sorted(art["files"]) == sorted(p.name for p in (res.run_dir / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in art["files"] and not art["used"]
    assert {"step", "export_hash", "files"} <= set(art["metadata"])


def test_shipped_config_without_logger_fits_and_prints_progress_lines(traces, tmp_path, capsys):
    """`fit --config configs/forecaster/tiny.yaml --trainer.logger false` keeps the config's callbacks: its
    LearningRateMonitor (nothing to log to) is left out with a note instead of a traceback; stdout is no terminal
    here (as under nohup or SLURM), so progress comes as plain lines, not a bar that renders nothing."""
    args = fit_args(tmp_path / "runs", traces["a"], 1)
    i = args.index("--trainer.callbacks")
    del args[i:i + 2]
    rc, res = run_fit([*args, "--trainer.max_steps", "4"])
    cap = capsys.readouterr()
    assert rc == 0 and res.status == "finished", cap.err[-2000:]
    assert "Traceback" not in cap.err and "LearningRateMonitor is left out" in cap.err
    lines = [ln for ln in cap.out.splitlines() if re.match(r"expertcast fit: step \d+/4 \(\d+%\), epoch \d+", ln)]
    assert lines and "train/loss" in lines[-1], cap.out[-2000:]
    assert re.search(r"expertcast fit: step 4/4 \(100%\)", cap.out), cap.out[-2000:]
