"""`expertcast eval`: graded offloaded generation with summary outputs, and resumption after an
interrupted run."""

from __future__ import annotations

import json

from expertcast.commands.evaluate import SAMPLES, main, read_samples

ARGS = ["--model", "qwen3_moe-tiny", "--benchmark", "gsm8k", "--policy", "lru", "--capacity", "0.25",
        "--batch-size", "2", "--limit", "3", "--max-new-tokens", "4", "--no-progress", "--device", "cpu",
        "--baseline", "none"]  # the paired speed measurement: tests/commands/test_evaluate_speed.py


def test_eval_outputs_and_resume(tmp_path, data_dir, capsys):
    out = tmp_path / "ev"
    assert main([*ARGS, "--out", str(out)]) == 0
    for name in ("summary.json", "summary.csv", "samples.csv", "summary.png", SAMPLES):
        assert (out / name).is_file(), name
    s = json.loads((out / "summary.json").read_text())
    assert s["samples"] == 3 and 0.0 <= s["accuracy"] <= 1.0
    assert 0.0 <= s["hit"] <= 1.0 and s["adj_hit"] <= s["hit"] + 1e-12
    assert s["tokens_per_s"] > 0 and s["ttft_s"] > 0 and s["mb_per_token"] > 0
    assert s["memory"]["device_expert_param_bytes"] == 0
    rows = read_samples(out / SAMPLES)
    assert [r["id"] for r in rows] == ["gsm8k-test-00000", "gsm8k-test-00001", "gsm8k-test-00002"]
    first_batch = rows[:2]

    # interrupted during the second batch: only the first batch's rows plus a torn line remain
    lines = (out / SAMPLES).read_text().splitlines()
    (out / SAMPLES).write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    assert main([*ARGS, "--out", str(out)]) == 0
    rows = read_samples(out / SAMPLES)
    assert [r["id"] for r in rows] == ["gsm8k-test-00000", "gsm8k-test-00001", "gsm8k-test-00002"]
    assert rows[:2] == first_batch  # done samples are not regenerated
    assert rows[2]["batch"] == 1
    assert json.loads((out / "summary.json").read_text())["samples"] == 3

    # resuming with other settings is refused (exit 2, one line naming the setting)
    assert main([*ARGS[:7], "0.5", *ARGS[8:], "--out", str(out)]) == 2
    assert "capacity" in capsys.readouterr().err


def test_eval_refuses_bad_input_before_generation(tmp_path, data_dir, capsys):
    assert main([*ARGS[:5], "belady", *ARGS[6:], "--out", str(tmp_path / "o")]) == 2
    assert "oracle" in capsys.readouterr().err
    assert main([*ARGS[:6], "--slots", "2", *ARGS[8:], "--out", str(tmp_path / "c")]) == 2
    assert "below top-K" in capsys.readouterr().err
    assert main([*ARGS[:7], "1.5", *ARGS[8:], "--out", str(tmp_path / "d")]) == 2
    assert "--capacity" in capsys.readouterr().err
    assert not (tmp_path / "c" / SAMPLES).exists()
