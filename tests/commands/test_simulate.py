"""`expertcast simulate`: outputs, --list-policies, one-line errors, capacity units, the output-folder lock,
resume only on identical settings (also after SIGKILL), and the forecaster leakage check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from expertcast.commands.simulate import main
from expertcast.data.synthetic import zipf_traces
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.data.traces import write_traces
from expertcast.inference.policies import registry
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.models.forecaster_export import save_forecaster
from expertcast.utils.outdir import claim_output_dir

TIMING = ("seconds", "accesses_per_s")
SMALL = ["--synthetic", "zipf", "--synthetic-shape", "2,8,2,3,24"]


def _traces(tmp_path: Path, name: str = "tr", seed: int = 5) -> Path:
    tr = zipf_traces(4, 40, num_layers=2, num_experts=8, top_k=2, seed=seed)
    return write_traces(tmp_path / name, tr.meta, tr.sequences)


def _export(path: Path, trained_ids: list[str], seed: int = 0) -> Path:
    """A tiny (untrained) forecaster export whose training block lists ``trained_ids``."""
    torch.manual_seed(seed)
    model = ExpertForecaster(ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=16, head_dim=8,
                                              state_size=4, num_blocks=1, direct_horizons=2)).eval()
    training = {"traces": [], "split": {"seed": 0, "val_fraction": 0.5, "test_fraction": 0.0},
                "train_ids": trained_ids[1:], "val_ids": trained_ids[:1]}
    return save_forecaster(model, path, source={"model_id": "synthetic-zipf"}, training=training)


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    return err


def _records(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in json.loads((out / "simulate.json").read_text())]


def test_writes_table_json_csv_png_with_settings_hash(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--traces", str(_traces(tmp_path)), "--policies", "lru,lrfu:lam=0.1,belady", "--capacity", "0.25,0.5",
               "--out", str(out)])
    assert rc == 0
    recs = json.loads((out / "simulate.json").read_text())
    assert len(recs) == 6 and {r["policy"] for r in recs} == {"lru", "lrfu(lam=0.1)", "belady"}
    settings = json.loads((out / "simulate.settings.json").read_text())
    assert len({r["settings_sha256"] for r in recs}) == 3  # one per policy, the same for its two capacities
    assert settings["settings"]["cpu_expert_ms"] == 0.19 and settings["settings"]["belady_fraction"] is True
    assert (out / "simulate.csv").read_text().startswith("policy,")
    assert (out / "hit_vs_capacity.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "simulate.partial.json").exists()
    assert not [p for p in out.iterdir() if ".tmp" in p.name]
    assert "belady_fraction" in capsys.readouterr().out


def test_list_policies_prints_every_policy_with_typed_options(capsys):
    assert main(["--list-policies"]) == 0
    text = capsys.readouterr().out
    for name in registry():
        assert f"\n{name}: " in "\n" + text, name
    lrfu = text.split("\nlrfu: ")[1].split("\nstatic: ")[0]
    assert "lam" in lrfu and "float" in lrfu and "default 0.01" in lrfu and "0 = LFU, 1 = LRU" in lrfu
    assert "history" in lrfu and "one of perfect, in-cache" in lrfu
    assert text.startswith("lru: ") and text.splitlines()[1].strip() == "(no options)"


@pytest.mark.parametrize("argv, message", [
    (["--policies", "lru:foo=1"], "lru has no options (got 'foo')"),
    (["--policies", "lrfu:lamda=0.1"], "lrfu has no option 'lamda'; options: lam, history"),
    (["--policies", "static:calibration=/etc/passwd"], "static option calibration=/etc/passwd: not a trace set"),
    (["--policies", "nope"], "unknown policy 'nope'"),
    (["--policies", "lru,lru"], "policy lru is given twice"),
    (["--policies", "belady-seq", "--engine", "python"], "belady-seq runs only on the compiled engine"),
    (["--capacity", "1.5"], "--capacity: 1.5 is outside (0, 1]"),
    (["--capacity", "0"], "--capacity: 0 is outside (0, 1]"),
    (["--slots", "0"], "--slots: 0 slots"),
    (["--slots", "1"], "below top-K=2"),
    (["--max-sequences", "0"], "--max-sequences: expected a positive integer"),
    (["--max-sequences", "-1"], "--max-sequences: expected a positive integer"),
    (["--layer-compute-ms", "0.1,0.2,0.3"], "--layer-compute-ms: give one value or one per MoE layer (2)"),
    (["--synthetic-shape", "2,8,2,3,8"], "holds no decode tokens"),
    (["--synthetic-shape", "2,8,9,3,24"], "top-K 9 exceeds the 8 experts"),
    (["--calibration", "/etc"], "--calibration /etc: not a trace set"),
    (["--forecaster", "/etc"], "--forecaster /etc: not a forecaster export"),
    (["--bandwidth-gbps", "-1"], "--bandwidth-gbps: expected a finite positive number"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, message):
    args = SMALL + ["--capacity", "0.5"] + argv if "--synthetic-shape" not in argv else \
        ["--synthetic", "zipf", "--capacity", "0.5"] + argv
    assert main(args + ["--out", str(tmp_path / "out")]) == 2
    err = _err(capsys)
    assert err.startswith("expertcast simulate: error: ") and message in err, err


def test_no_trace_source_and_missing_traces(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "o")]) == 2
    assert "give exactly one of --traces DIR or --synthetic KIND" in _err(capsys)
    assert main(["--traces", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist; expected a trace directory" in _err(capsys)


def test_capacity_1_means_every_expert(tmp_path):
    """--capacity 1 is all L*E experts: with every expert routed during the prompt, decode never misses."""
    rng = np.random.default_rng(0)
    L, E, K = 2, 8, 2
    seqs = []
    for i in range(2):
        prompt = np.stack([np.arange(E).reshape(E // K, K)] * L, axis=1)  # [4, L, K]: each expert once per layer
        decode = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(12)])
        ids = np.concatenate([prompt, decode]).astype(np.int16)
        seqs.append(TraceSequence(f"s{i}", np.arange(len(ids), dtype=np.int32), len(prompt), ids,
                                  np.full(ids.shape, 0.5, np.float16)))
    d = write_traces(tmp_path / "full", TraceMeta("test/full", L, E, K, 1000), seqs)
    out = tmp_path / "out"
    assert main(["--traces", str(d), "--policies", "lru,lfu,fifo,static,belady", "--capacity", "1",
                 "--out", str(out)]) == 0
    recs = json.loads((out / "simulate.json").read_text())
    assert all(r["slots"] == L * E and r["capacity"] == 1.0 and r["hit"] == 1.0 for r in recs), recs


def test_slot_runs_plot_on_an_integer_axis(tmp_path):
    from expertcast.inference.sim.report import x_axis

    out = tmp_path / "out"
    assert main(SMALL + ["--policies", "lru", "--slots", "2,3", "--out", str(out)]) == 0
    recs = json.loads((out / "simulate.json").read_text())
    assert [r["slots_per_layer"] for r in recs] == [2, 3]
    assert x_axis(recs) == ("slots_per_layer", "slots per layer")
    assert x_axis([{**recs[0], "capacity_requested": 0.25}]) [0] == "capacity"


def test_a_second_concurrent_run_fails_fast(tmp_path, capsys):
    out = tmp_path / "out"
    with claim_output_dir(out, "simulate"):  # another run holds the folder
        t = time.perf_counter()
        assert main(SMALL + ["--capacity", "0.5", "--out", str(out)]) == 2
        assert time.perf_counter() - t < 10
    assert "is in use by another expertcast run" in _err(capsys)
    assert not (out / "simulate.json").exists()
    assert main(SMALL + ["--capacity", "0.5", "--out", str(out)]) == 0  # free again


@pytest.mark.parametrize("change, setting", [
    (["--cpu-expert-ms", "0.3"], "cpu_expert_ms"),
    (["--no-belady-fraction"], "belady_fraction"),
    (["--batch-size", "2"], "batch_size"),
    (["--max-sequences", "2"], "sequences"),
])
def test_resume_refuses_other_settings(tmp_path, capsys, change, setting):
    out = tmp_path / "out"
    common = SMALL + ["--policies", "lru,static", "--capacity", "0.5", "--out", str(out)]
    assert main(common) == 0
    capsys.readouterr()
    assert main(common + change) == 2
    err = _err(capsys)
    assert f"cannot resume {out}" in err and f"{setting}:" in err and "--overwrite" in err, err
    assert main(common + change + ["--overwrite"]) == 0
    assert main(common) == 2  # the folder now holds the other settings' records


def test_a_rerun_with_more_policies_reuses_the_finished_records(tmp_path, capsys):
    out = tmp_path / "out"
    common = SMALL + ["--capacity", "0.5", "--engine", "python", "--out", str(out)]
    assert main(common + ["--policies", "lru"]) == 0
    first = json.loads((out / "simulate.json").read_text())
    capsys.readouterr()
    assert main(common + ["--policies", "lru,lfu"]) == 0
    assert "resuming: 1 finished runs" in capsys.readouterr().out
    recs = json.loads((out / "simulate.json").read_text())
    assert [r["policy"] for r in recs] == ["lru", "lfu"] and recs[0] == first[0]


def test_resume_refuses_other_calibration_traces(tmp_path, capsys):
    out = tmp_path / "out"
    common = SMALL + ["--policies", "static", "--capacity", "0.5", "--out", str(out)]
    a, b = _traces(tmp_path, "a", seed=1), _traces(tmp_path, "b", seed=2)
    assert main(common + ["--calibration", str(a)]) == 0
    first = _records(out)
    capsys.readouterr()
    assert main(common + ["--calibration", str(b)]) == 2
    assert "calibration:" in _err(capsys)
    assert main(common + ["--calibration", str(a)]) == 0  # same settings: reused, not recomputed
    assert "resuming: 1 finished runs" in capsys.readouterr().out
    assert _records(out) == first


def test_resume_refuses_a_changed_forecaster(tmp_path, capsys):
    tr = _traces(tmp_path)
    exp = _export(tmp_path / "exp", ["other-0", "other-1"], seed=0)
    out = tmp_path / "out"
    common = ["--traces", str(tr), "--policies", "lru,seqmoe:horizon=2", "--capacity", "0.5", "--forecaster", str(exp),
              "--pool", "shared", "--out", str(out)]
    assert main(common) == 0
    _export(tmp_path / "exp", ["other-0", "other-1"], seed=1)  # same path, other weights
    capsys.readouterr()
    assert main(common) == 2
    assert "forecaster:" in _err(capsys)


def test_forecaster_trained_on_replayed_sequences_is_refused_unless_allowed(tmp_path, capsys):
    tr = _traces(tmp_path)
    ids = sorted(p.seq_id for p in zipf_traces(4, 40, num_layers=2, num_experts=8, top_k=2, seed=5).sequences)
    exp = _export(tmp_path / "exp", ids[:2])
    common = ["--traces", str(tr), "--policies", f"lru,seqmoe:forecaster={exp},horizon=2", "--capacity", "0.5",
              "--pool", "shared"]
    assert main(common + ["--out", str(tmp_path / "o1")]) == 2
    err = _err(capsys)
    assert "2 of the 4 evaluated sequences were used to train the forecaster" in err and "--allow-overlap" in err
    assert main(common + ["--allow-overlap", "--out", str(tmp_path / "o2")]) == 0
    assert "trained on 2 of the 4 replayed sequences (--allow-overlap)" in capsys.readouterr().out
    recs = {r["policy"].split("(")[0]: r for r in json.loads((tmp_path / "o2" / "simulate.json").read_text())}
    assert recs["seqmoe"]["train_overlap"] == 2 and "train_overlap" not in recs["lru"]
    torch.manual_seed(0)
    no_ids = save_forecaster(ExpertForecaster(ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=16,
                                                               head_dim=8, state_size=4, num_blocks=1)),
                             tmp_path / "no-ids")  # an export without a training block
    assert main(["--traces", str(tr), "--policies", "seqmoe", "--forecaster", str(no_ids), "--capacity", "0.5",
                 "--out", str(tmp_path / "o4")]) == 2
    assert "records no training sequence ids" in _err(capsys)
    held_out = _export(tmp_path / "exp2", ["other-0", "other-1"])
    assert main(["--traces", str(tr), "--policies", "seqmoe:horizon=2", "--forecaster", str(held_out),
                 "--capacity", "0.5", "--pool", "shared", "--out", str(tmp_path / "o3")]) == 0


def test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run(tmp_path):
    argv = ["--synthetic", "zipf", "--synthetic-shape", "4,32,2,4,96", "--policies", "lru,lfu", "--capacity",
            "0.25,0.5", "--engine", "python", "--no-belady-fraction"]
    out = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "expertcast.cli", "simulate", *argv, "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = out / "simulate.partial.json"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if partial.exists() and json.loads(partial.read_text())["records"]:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert proc.wait(30) == -signal.SIGKILL, "the run finished before it could be killed"
    saved = json.loads(partial.read_text())["records"]
    assert 1 <= len(saved) < 4 and not (out / "simulate.json").exists()
    assert main(argv + ["--out", str(out)]) == 0  # the kernel released the dead run's lock
    assert main(argv + ["--out", str(tmp_path / "clean")]) == 0
    assert _records(out) == _records(tmp_path / "clean")
    resumed = {r["key"]: r for r in json.loads((out / "simulate.json").read_text())}
    assert all(resumed[r["key"]] == r for r in saved)  # the killed run's records were reused as they were


def test_config_file_values_and_flag_override_equal_the_command_line(tmp_path, capsys):
    from expertcast.commands.simulate import SETTINGS_FILE, build_parser

    cfg = tmp_path / "sim.yaml"
    cfg.write_text("synthetic: zipf\nsynthetic-shape: 2,8,2,3,24\npolicies: lru,lfu\ncapacity: 0.25,0.5\n"
                   "bandwidth_gbps: 10\nno_belady_fraction: true\n")
    over = ["--capacity", "0.5", "--policies", "lru"]
    flags = [*SMALL, "--capacity", "0.5", "--policies", "lru", "--bandwidth-gbps", "10", "--no-belady-fraction"]
    got = vars(build_parser().parse_args(["--config", str(cfg), *over]))
    want = vars(build_parser().parse_args(flags))
    assert got.pop("config") == str(cfg) and want.pop("config") is None
    assert got == want
    # the same values from the file: the same settings (so the same resume key), the file recorded beside them
    assert main(["--config", str(cfg), *over, "--out", str(tmp_path / "a")]) == 0
    assert main([*flags, "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / d / SETTINGS_FILE).read_text()) for d in "ab")
    assert a.pop("config")["path"] == str(cfg.resolve()) and "config" not in b
    assert a == b


def test_no_progress_is_accepted_like_the_other_commands(tmp_path, capsys):
    assert main([*SMALL, "--policies", "lru", "--capacity", "0.5", "--no-progress", "--out", str(tmp_path / "o")]) == 0
    assert "simulate:" not in capsys.readouterr().err  # no progress bar


def test_a_forecaster_of_another_models_routing_is_refused_unless_allowed(tmp_path, capsys):
    """The export was fitted on the routing of 'synthetic-zipf'; traces of a router-adapted model are another
    model's routing: refused, or with --allow-model-mismatch reported in the title and simulate.settings.json."""
    tr = zipf_traces(4, 40, num_layers=2, num_experts=8, top_k=2, seed=5)
    tr.meta.model_id = "org/router-adapted"
    traces = write_traces(tmp_path / "adapted", tr.meta, tr.sequences)
    exp = _export(tmp_path / "exp", ["other-0"])
    argv = ["--traces", str(traces), "--policies", f"lru,seqmoe:forecaster={exp},horizon=2", "--capacity", "0.5"]
    assert main([*argv, "--out", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'synthetic-zipf'" in err and "'org/router-adapted'" in err
    assert "--allow-model-mismatch" in err
    assert main([*argv, "--allow-model-mismatch", "--out", str(tmp_path / "o2")]) == 0
    assert "(--allow-model-mismatch)" in capsys.readouterr().out
    saved = json.loads((tmp_path / "o2" / "simulate.settings.json").read_text())["train_overlap"]
    [got] = [v for k, v in saved.items() if k.startswith("seqmoe")]
    assert got["model_match"] is False and got["scored_model"] == {"path": "org/router-adapted"}


def test_a_byte_budget_resolves_with_the_traces_expert_bytes(tmp_path, capsys):
    """``--budget-gb``: the trace meta's bytes per expert decide the slots; a trace set that does not record them
    is refused in one line."""
    from dataclasses import replace

    tr = zipf_traces(4, 40, num_layers=2, num_experts=8, top_k=2, seed=5)
    xb = tr.meta.expert_bytes
    sized = write_traces(tmp_path / "sized", tr.meta, tr.sequences)
    gb = 2 * 4 * xb / 1e9  # 4 slots per layer
    assert main(["--traces", str(sized), "--policies", "lru", "--budget-gb", str(gb), "--out", str(tmp_path / "a")]) == 0
    rec = json.loads((tmp_path / "a" / "simulate.json").read_text())[0]
    assert rec["slots_per_layer"] == 4 and rec["capacity_requested"] == round(gb * 1e9)
    assert main(["--traces", str(sized), "--policies", "lru", "--capacity", "0.5", "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "simulate.json").read_text())[0]["hit"] == rec["hit"]  # the same 4 of 8
    bare = write_traces(tmp_path / "bare", replace(tr.meta, expert_bytes=0), tr.sequences)
    capsys.readouterr()
    assert main(["--traces", str(bare), "--policies", "lru", "--budget-gb", "1", "--out", str(tmp_path / "c")]) == 2
    err = _err(capsys)
    assert "--budget-gb: the trace's meta does not record the bytes of one expert" in err
    assert main(SMALL + ["--capacity", "0.5", "--budget-gb", "1", "--out", str(tmp_path / "d")]) == 2
    assert "give --budget-gb (bytes of experts) or --capacity, not both" in _err(capsys)
