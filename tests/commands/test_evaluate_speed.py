"""`expertcast eval` measures the full-load speed of the same prompts in the same run (interleaved paired
passes, median and min-max), or the all-experts-on-host baseline, named as such; a stage-aware policy
runs with the latency model measured at start-up, written to the summary."""

from __future__ import annotations

import json

import pytest
from expertcast.commands.evaluate import main

ARGS = ["--model", "qwen3_moe-tiny", "--benchmark", "gsm8k", "--policy", "lru", "--capacity", "0.25",
        "--batch-size", "2", "--limit", "2", "--max-new-tokens", "3", "--no-progress", "--device", "cpu",
        "--speed-repeats", "2"]


def test_full_load_speed_paired_in_the_same_run(tmp_path, data_dir, capsys):
    out = tmp_path / "ev"
    assert main([*ARGS, "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    sp = json.loads((out / "speed.json").read_text())
    assert s["baseline"] == sp["baseline"] == "full-load" and s["speed"]["key"] == sp["key"]
    choice = sp["baseline_choice"]  # auto: every expert fits once more beside the host store
    assert choice["requested"] == "auto" and choice["host_needed_bytes"] <= choice["host_available_bytes"]
    assert sp["tokens_match"]  # offloaded greedy decoding equals the full-load model's
    assert len(sp["offloaded_passes"]) == 2 and len(sp["baseline_passes"]) == 3  # B, O, B, O, B
    assert {p["decoded_tokens"] for p in sp["offloaded_passes"] + sp["baseline_passes"]} == {sp["decoded_tokens"]}
    assert sp["decoded_tokens"] == 2 * 2  # 2 problems x (3 new tokens - the one from the prefill)
    paired = [100 * o["decoded_tokens"] / o["decode_seconds"]
              / (0.5 * sum(b["decoded_tokens"] / b["decode_seconds"] for b in sp["baseline_passes"][i:i + 2]))
              for i, o in enumerate(sp["offloaded_passes"])]
    assert sp["paired_pct"] == pytest.approx(paired)
    assert sp["pct_full_min"] <= s["pct_full"] <= sp["pct_full_max"] and s["pct_full"] > 0
    assert sp["problems"] == ["gsm8k-test-00000", "gsm8k-test-00001"]
    assert "% of full-load tokens/s" in capsys.readouterr().out

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


def test_auto_baseline_picks_the_host_one_when_the_experts_do_not_fit_twice_in_host_memory(tmp_path, data_dir,
                                                                                           capsys, monkeypatch):
    from expertcast.inference.runtime import loading
    from expertcast.inference.runtime.engine import OffloadedModel

    def no_restore(self):
        raise AssertionError("the experts were restored beside the store")

    # MemAvailable: 1 MB, far below the experts; the store is memory-mapped, so the offloaded load itself fits
    monkeypatch.setattr(loading, "host_available_bytes", lambda: 10 ** 6)
    monkeypatch.setattr(OffloadedModel, "restore", no_restore)
    args = [*ARGS[:-1], "1", "--limit", "1", "--mmap-store"]
    out = tmp_path / "auto"
    assert main([*args, "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    sp = json.loads((out / "speed.json").read_text())
    assert s["baseline"] == sp["baseline"] == "all-experts-on-host" and sp["tokens_match"]
    choice = sp["baseline_choice"]
    assert choice["requested"] == "auto" and choice["baseline"] == "all-experts-on-host"
    assert choice["host_available_bytes"] == 10 ** 6
    assert choice["host_needed_bytes"] == s["load"]["plan"]["expert_bytes_total"] > 10 ** 6  # every expert once more
    assert s["speed"]["baseline_choice"] == choice
    err = capsys.readouterr().err
    assert "--baseline auto: all-experts-on-host (a full load copies every expert once more beside the host store: " \
           f"needs {choice['host_needed_bytes'] / 1e9:.2f} GB of host memory, 0.00 GB available)" in err

    # asked for by name, the full load is refused with the same reason
    assert main([*args, "--baseline", "full-load", "--out", str(tmp_path / "full")]) != 0
    assert "--baseline full-load: a full load copies every expert once more beside the host store" in capsys.readouterr().err
