"""`expertcast eval` measures % of full speed in the same run against the same runtime with every expert resident
in its slots (interleaved paired passes, median and min-max; a ratio whose passes disagree is flagged, not
reported), or the all-experts-on-host baseline, named as such; one tokens/s per row, named; a stage-aware policy
runs with the latency model measured at start-up, written to the summary."""

from __future__ import annotations

import json

import pytest
from expertcast.commands.evaluate import main

ARGS = ["--model", "qwen3_moe-tiny", "--benchmark", "gsm8k", "--policy", "lru", "--capacity", "0.25",
        "--batch-size", "2", "--limit", "2", "--max-new-tokens", "3", "--no-progress", "--device", "cpu",
        "--speed-repeats", "2"]


def test_speed_paired_against_the_runtime_with_every_expert_resident(tmp_path, data_dir, capsys):
    out = tmp_path / "ev"
    assert main([*ARGS, "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    sp = json.loads((out / "speed.json").read_text())
    assert s["baseline"] == sp["baseline"] == "all-resident" and s["speed"]["key"] == sp["key"]
    choice = sp["baseline_choice"]  # auto: a slot for every expert fits the host (the CPU device)
    assert choice["requested"] == "auto" and choice["needed_bytes"] <= choice["available_bytes"]
    assert choice["needed_bytes"] == s["load"]["plan"]["expert_bytes_total"]
    assert sp["tokens_match"]  # offloaded greedy decoding equals the all-resident runtime's
    assert len(sp["offloaded_passes"]) == 2 and len(sp["baseline_passes"]) == 3  # B, O, B, O, B
    assert {p["decoded_tokens"] for p in sp["offloaded_passes"] + sp["baseline_passes"]} == {sp["decoded_tokens"]}
    assert sp["decoded_tokens"] == 2 * 2  # 2 problems x (3 new tokens - the one from the prefill)
    paired = [100 * o["decoded_tokens"] / o["decode_seconds"]
              / (0.5 * sum(b["decoded_tokens"] / b["decode_seconds"] for b in sp["baseline_passes"][i:i + 2]))
              for i, o in enumerate(sp["offloaded_passes"])]
    assert sp["paired_pct"] == pytest.approx(paired)
    assert sp["pct_full_min"] <= s["pct_full_measured"] <= sp["pct_full_max"] and s["pct_full_measured"] > 0
    assert s["pct_full"] == (None if sp["flag"] else sp["pct_full"])  # a flagged ratio is no result
    assert s["tokens_per_s"] == sp["tokens_per_s"]  # one tokens/s per row: the paired offloaded passes'
    assert sp["problems"] == ["gsm8k-test-00000", "gsm8k-test-00001"]
    printed = capsys.readouterr().out
    assert "against all-resident (the same runtime" in printed and "tokens_per_s: median of the paired" in printed

    # a rerun with nothing new reuses the measurement
    assert main([*ARGS, "--out", str(out)]) == 0
    assert "speed: reusing" in capsys.readouterr().out
    assert json.loads((out / "speed.json").read_text()) == sp


def test_host_baseline_named_and_stage_uses_measured_latency(tmp_path, data_dir):
    out = tmp_path / "host"
    args = [*ARGS[:5], "stage:cues=the|and", *ARGS[6:-1], "1", "--limit", "1", "--baseline", "host",
            "--link-gbps", "0.005",  # ~5 ms per 24.6 kB expert: the CPU is faster for few tokens
            "--threads", "1"]  # no OpenMP team: on a loaded host its barriers make a 2-row GEMM take ~100 ms
    assert main([*args, "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    sp = s["speed"]
    assert s["baseline"] == sp["baseline"] == "all-experts-on-host" and sp["tokens_match"]
    lat = s["latency_model"]
    assert lat["source"] == "measured at start-up" and lat["parallel"]
    assert lat["transfer_ms"] > 0 and len(lat["cpu_points"]) == 4
    assert s["cpu_exec"] > 0  # cold experts executed on the host under the measured model


def test_auto_baseline_picks_the_host_one_when_a_slot_for_every_expert_does_not_fit(tmp_path, data_dir,
                                                                                   capsys, monkeypatch):
    from expertcast.inference.runtime import eval_run, memory

    def no_resident(self, config):
        raise AssertionError("the all-resident baseline ran without room for its slots")

    # MemAvailable: 1 MB, far below the experts; the store is memory-mapped, so the offloaded load itself fits
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 10 ** 6)
    monkeypatch.setattr(eval_run.AllResidentPolicy, "reset", no_resident)
    args = [*ARGS[:-1], "1", "--limit", "1", "--mmap-store"]
    out = tmp_path / "auto"
    assert main([*args, "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    sp = json.loads((out / "speed.json").read_text())
    assert s["baseline"] == sp["baseline"] == "all-experts-on-host" and sp["tokens_match"]
    choice = sp["baseline_choice"]
    assert choice["requested"] == "auto" and choice["baseline"] == "all-experts-on-host"
    assert choice["available_bytes"] == 10 ** 6 and choice["where"] == "host memory"
    assert choice["needed_bytes"] == s["load"]["plan"]["expert_bytes_total"] > 10 ** 6  # every expert once more
    assert s["speed"]["baseline_choice"] == choice
    err = capsys.readouterr().err
    assert "--baseline auto: all-experts-on-host (every expert resident needs " \
           f"{choice['needed_bytes'] / 1e9:.2f} GB of host memory for its slots, 0.00 GB available)" in err

    # asked for by name, the all-resident baseline is refused with the same reason
    assert main([*args, "--baseline", "resident", "--out", str(tmp_path / "full")]) != 0
    assert "--baseline resident: every expert resident needs" in capsys.readouterr().err
