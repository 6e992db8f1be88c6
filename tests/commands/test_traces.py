"""`expertcast traces import` reads the granite per-prompt expert-trace JSON (``--format granite`` or detected),
and what it writes is read by `traces stats`, `simulate` and `forecast-eval` (the real-model fixture)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from expertcast.commands.traces import main as traces_main
from expertcast.data.traces import load_traces, read_manifest

GRANITE = ("traces", "granite-3.0-1b-a400m", "moe_expert_trace.json")


@pytest.fixture
def granite(data_dir):
    return data_dir.joinpath(*GRANITE)


def test_granite_import_explicit_and_detected(granite, tmp_path, capsys):
    raw = json.loads(granite.read_text())
    assert traces_main(["import", "--format", "granite", str(granite), "--out", str(tmp_path / "g")]) == 0
    out, err = capsys.readouterr()
    assert "imported 3 sequences (granite layout, L=24, E=32, K=8, 304 tokens, 192 decode tokens" in out
    assert "expert bytes: 3145728" in err
    assert traces_main(["import", str(granite), "--out", str(tmp_path / "auto")]) == 0  # layout detected
    meta, seqs = load_traces(tmp_path / "g")
    meta2, seqs2 = load_traces(tmp_path / "auto")
    assert meta == meta2
    assert (meta.model_id, meta.num_layers, meta.num_experts, meta.top_k, meta.expert_bytes) == (
        raw["model"], 24, 32, 8, 3 * 1024 * 512 * 2)
    assert [s.seq_id for s in seqs] == list(raw["prompts"]) == [s.seq_id for s in seqs2]
    for s, s2 in zip(seqs, seqs2, strict=True):
        p = raw["prompts"][s.seq_id]
        assert s.prompt_len == p["prompt_len"] and s.num_tokens == p["prompt_len"] + 64
        np.testing.assert_array_equal(s.expert_ids, np.asarray(p["prefill"] + p["decode"]))
        np.testing.assert_array_equal(s.expert_ids, s2.expert_ids)
    run = read_manifest(tmp_path / "g")
    assert json.dumps(run).count("granite") >= 1
    # a second import into the same folder needs --overwrite
    assert traces_main(["import", str(granite), "--out", str(tmp_path / "g")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_imported_granite_traces_feed_stats_simulate_and_forecast_eval(granite, tmp_path, capsys):
    from expertcast.commands.forecast_eval import main as forecast_eval
    from expertcast.commands.simulate import main as simulate
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
    from expertcast.models.forecaster_export import save_forecaster

    g = tmp_path / "g"
    assert traces_main(["import", str(granite), "--out", str(g)]) == 0
    js = tmp_path / "stats.json"
    assert traces_main(["stats", str(g), "--phase", "decode", "--json", str(js)]) == 0
    rows = json.loads(js.read_text())
    allrow = next(r for r in rows if r["layer"] == "all")
    assert allrow["tokens"] == 3 * 64 and len(rows) == 25 and 0 < allrow["overlap"] < 1

    assert simulate(["--traces", str(g), "--policies", "lru,belady", "--capacity", "0.25,0.45", "--out",
                     str(tmp_path / "sim")]) == 0
    recs = json.loads((tmp_path / "sim" / "simulate.json").read_text())
    hit = {(r["policy"], float(r["capacity_requested"])): r["hit"] for r in recs}
    assert all(hit[("belady", c)] >= hit[("lru", c)] for c in (0.25, 0.45)), hit
    assert all(0 < h < 1 for h in hit.values()) and recs[0]["mb_per_token"] > 0  # expert bytes known

    torch.manual_seed(0)
    fc = ExpertForecaster(ForecasterConfig(num_layers=24, num_experts=32, top_k=8, hidden_size=16, head_dim=8,
                                           state_size=4, num_blocks=1, direct_horizons=2)).eval()
    export = save_forecaster(fc, tmp_path / "fc", source={"model_id": load_traces(g)[0].model_id},  # its routing
                             training={"train_ids": [], "val_ids": []})
    assert forecast_eval(["--forecaster", str(export), "--traces", str(g), "--horizons", "2", "--out",
                          str(tmp_path / "fe"), "--fit-traces", str(g), "--allow-overlap"]) == 0
    summary = json.loads((tmp_path / "fe" / "recall_summary.json").read_text())
    assert "overlap" in json.dumps(summary) and "recent" in json.dumps(summary)


@pytest.mark.parametrize("content,argv,message", [
    ('{"model": "x", "layers": 3}', [], r"unknown trace layout \(an object with keys layers, model"),
    ("[1, 2, 3]", [], r"unknown trace layout \(a JSON list\)"),
    ("not json at all", [], r"unknown trace layout \(no JSON object on its first line\)"),
    ("", [], "is empty"),
    ("[" * 100_000 + "]" * 100_000, [], r"nested too deeply"),
    ('{"seq": 0, "token": 0, "layer": 0, "experts": [0, 1]}\n' + "[" * 100_000 + "]" * 100_000,
     ["--format", "jsonl", "--num-experts", "4", "--num-layers", "1"], r"f.json:2: JSON nested too deeply"),
    ('{"prompts": ' + "[" * 100_000 + "]" * 100_000 + "}", ["--format", "granite"], r"nested too deeply"),
    ('{"seq": 0, "token": 0, "layer": 0, "experts": [0, 1]}', [], "--num-experts is required for the jsonl layout"),
])
def test_unknown_layouts_and_missing_flags_are_one_line_errors(tmp_path, capsys, content, argv, message):
    import re

    f = tmp_path / "f.json"
    f.write_text(content + "\n")
    assert traces_main(["import", str(f), "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("expertcast traces import: error:") and re.search(message, err), err
    assert not (tmp_path / "o").exists()


def test_granite_flags_must_agree_with_the_file(granite, tmp_path, capsys):
    assert traces_main(["import", "--format", "granite", str(granite), "--out", str(tmp_path / "o"),
                        "--num-experts", "16"]) == 2
    assert "--num-experts 16, but" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert traces_main(["import", str(granite), "--out", str(tmp_path / "o"), "--num-layers", "24",
                        "--expert-bytes", "7", "--model", "g1b"]) == 0
    meta, _ = load_traces(tmp_path / "o")
    assert (meta.expert_bytes, meta.model_id) == (7, "g1b")
    # the jsonl layout forced on the granite file: its rows are refused, naming file and line
    assert traces_main(["import", "--format", "jsonl", str(granite), "--out", str(tmp_path / "j"),
                        "--num-experts", "32"]) == 2
    assert f"{granite}:1: missing field(s) seq, token, layer, experts" in capsys.readouterr().err


def test_synth_writes_a_reproducible_sticky_trace_set_with_its_settings(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    argv = ["synth", "--shape", "3,16,2", "--sequences", "5", "--tokens", "12", "--prompt", "4", "--seed", "3"]
    assert traces_main([*argv, "--out", str(a)]) == 0
    assert traces_main([*argv, "--out", str(b)]) == 0
    meta, seqs = load_traces(a)
    assert (meta.num_layers, meta.num_experts, meta.top_k) == (3, 16, 2)
    assert [s.seq_id for s in seqs] == [f"sticky3x16-3-{i}" for i in range(5)]
    assert all(s.num_tokens == 12 and s.prompt_len == 4 for s in seqs)
    for s in seqs:  # K distinct experts per position and layer
        assert all(len(set(row)) == 2 for row in s.expert_ids.reshape(-1, 2).tolist())
    _, again = load_traces(b)
    assert all(np.array_equal(x.expert_ids, y.expert_ids) for x, y in zip(seqs, again, strict=True))
    run = read_manifest(a)["run"]
    assert run["command"] == "traces synth" and run["shape"] == "3,16,2" and run["seed"] == 3
    _, other = load_traces(tmp_path / "c") if traces_main([*argv[:-1], "4", "--out", str(tmp_path / "c")]) == 0 \
        else (None, None)
    assert not all(np.array_equal(x.expert_ids, y.expert_ids) for x, y in zip(seqs, other, strict=True))


def test_synth_cross_layer_is_recorded_and_changes_the_routing(tmp_path):
    argv = ["synth", "--shape", "3,16,2", "--sequences", "3", "--tokens", "12", "--prompt", "4"]
    assert traces_main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert traces_main([*argv, "--cross-layer", "0.9", "--out", str(tmp_path / "b")]) == 0
    assert "cross_layer" not in read_manifest(tmp_path / "a")["run"]  # the plain process's record is unchanged
    assert read_manifest(tmp_path / "b")["run"]["cross_layer"] == 0.9
    _, a = load_traces(tmp_path / "a")
    _, b = load_traces(tmp_path / "b")
    assert not all(np.array_equal(x.expert_ids, y.expert_ids) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("argv, message", [
    (["--shape", "3,16,2", "--cross-layer", "2"], "--cross-layer"),
    (["--shape", "3,16"], "expected L,E,K"),
    (["--shape", "3,4,5"], "K <= E"),
    (["--shape", "3,16,2", "--tokens", "4", "--prompt", "4"], "leaves no decode position"),
])
def test_synth_refuses_bad_settings_in_one_line(tmp_path, capsys, argv, message):
    assert traces_main(["synth", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_a_killed_import_is_refused_by_consumers_and_resumed_by_the_import(tmp_path, capsys, monkeypatch):
    """Killed after its first shard: simulate refuses the unfinished set (naming it so); rerunning the import
    resumes it (the finished shard kept) and the set then replays whole."""
    from pathlib import Path

    from expertcast.commands.simulate import main as simulate_main
    from expertcast.data.traces import TraceWriter

    src = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "traces" / "vllm" / "requests.jsonl"
    out = tmp_path / "t"
    argv = ["import", str(src), "--out", str(out), "--num-experts", "8", "--shard-size", "1"]
    real = TraceWriter.write_shard

    def killed(self, index, *a, **k):
        if index == 1:
            raise KeyboardInterrupt
        return real(self, index, *a, **k)

    monkeypatch.setattr(TraceWriter, "write_shard", killed)
    assert traces_main(argv) == 130
    assert "interrupted" in capsys.readouterr().err
    monkeypatch.setattr(TraceWriter, "write_shard", real)
    assert not read_manifest(out)["complete"] and len(read_manifest(out)["shards"]) == 1
    capsys.readouterr()
    assert simulate_main(["--traces", str(out), "--policies", "lru", "--capacity", "0.5",
                          "--out", str(tmp_path / "sim")]) == 2
    assert "is unfinished: its writer stopped after 1 shard(s)" in capsys.readouterr().err
    assert traces_main(argv) == 0
    assert "resumed an unfinished import: 1 of 2 shard(s) were already written" in capsys.readouterr().out
    assert read_manifest(out)["complete"] and len(load_traces(out)[1]) == 2
    assert traces_main(argv) == 2
    assert "already holds a trace set" in capsys.readouterr().err
