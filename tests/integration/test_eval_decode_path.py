"""`expertcast eval --decode-path graph` runs the graph-compatible decode path (docs/design.md,
"Graph-compatible decode path") end to end: the same completions as the eager path, the path printed, and the
path part of the resume key."""

from __future__ import annotations

import json

from expertcast.commands.evaluate import SAMPLES, main, read_samples

BASE = ["--model", "qwen3_moe-tiny", "--benchmark", "gsm8k", "--policy", "lru", "--capacity", "0.5",
        "--limit", "2", "--batch-size", "2", "--max-new-tokens", "6", "--no-progress", "--device", "cpu",
        "--baseline", "none"]


def test_graph_decode_path_gives_the_eager_completions(tmp_path, capsys):
    assert main([*BASE, "--out", str(tmp_path / "eager")]) == 0
    capsys.readouterr()
    assert main([*BASE, "--decode-path", "graph", "--out", str(tmp_path / "graph")]) == 0
    printed = capsys.readouterr()
    assert "decode path: graph" in printed.out + printed.err
    rows = {p: read_samples(tmp_path / p / SAMPLES) for p in ("eager", "graph")}
    assert [r["completion"] for r in rows["graph"]] == [r["completion"] for r in rows["eager"]]
    settings = {p: json.loads((tmp_path / p / "settings.json").read_text()) for p in ("eager", "graph")}
    assert settings["eager"] != settings["graph"]  # the path is part of the resume key


def test_resume_under_another_decode_path_is_refused(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main([*BASE, "--out", out]) == 0
    capsys.readouterr()
    try:
        rc = main([*BASE, "--decode-path", "graph", "--out", out])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert "decode_path" in capsys.readouterr().err
