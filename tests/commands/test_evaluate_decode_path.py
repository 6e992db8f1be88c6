"""`expertcast eval --decode-path graph` runs the graph-compatible decode path (docs/design.md,
"Graph-compatible decode path") end to end: the same completions as the eager path, the path printed, and the
path part of the resume key; on CUDA (marker ``gpu``) the eval's graph path captures the decode layers in CUDA Graphs
and replays them, with the eager path's completions."""

from __future__ import annotations

import json

import pytest
import torch
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


@pytest.mark.gpu
def test_eval_graph_decode_path_on_cuda_replays_cuda_graphs(tmp_path, capsys, monkeypatch):
    """`expertcast eval --device cuda --decode-path graph` itself captures the decode layers in CUDA Graphs and
    replays them (torch.cuda.CUDAGraph.replay is counted), and its completions equal the eager path's on CUDA."""
    cuda = ["cuda" if a == "cpu" else a for a in BASE]
    assert main([*cuda, "--out", str(tmp_path / "eager")]) == 0
    capsys.readouterr()
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: (replays.append(1), replay(self))[1])
    assert main([*cuda, "--decode-path", "graph", "--out", str(tmp_path / "graph")]) == 0
    printed = capsys.readouterr()
    assert "decode path: graph" in printed.out + printed.err
    assert replays, "the graph decode path on CUDA should replay captured CUDA Graphs"
    rows = {p: read_samples(tmp_path / p / SAMPLES) for p in ("eager", "graph")}
    assert [r["completion"] for r in rows["graph"]] == [r["completion"] for r in rows["eager"]]
