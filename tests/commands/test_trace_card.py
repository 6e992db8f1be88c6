"""`expertcast traces card` (docs/design.md, "Protocol card"): the card of the granite trace (imported from its JSON,
``source_format`` granite), its files and the consistency of its numbers; a card with a fit set and a forecaster
export (static, seqmoe, hybrid, the fitted predictors); the header of a trace whose source does not mark the phase;
the refusal of evaluated ids shared with the fit set or the export."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from expertcast.commands.traces import main as traces_main
from expertcast.data.synthetic import zipf_traces
from expertcast.data.traces import write_traces
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.models.forecaster_export import save_forecaster

GRANITE = ("traces", "granite-3.0-1b-a400m", "moe_expert_trace.json")
MEGATRON = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "traces" / "megatron" / "router_trace_rank0.jsonl"
DEMAND = ("lru", "lfu", "lrfu", "fifo", "belady-k")

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """The granite trace set (3 prompts, L=24, E=32, K=8), imported with ``--format auto``."""
    import os

    root = tmp_path_factory.mktemp("card")
    src = Path(os.environ["EXPERTCAST_DATA_DIR"]).joinpath(*GRANITE)
    assert traces_main(["import", "--format", "auto", str(src), "--out", str(root / "traces")]) == 0
    return root / "traces"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small trace set (L=2, E=8, K=2), a fit set of other sequences, and an untrained forecaster export whose
    training ids are other sequences (``export``) or one of the evaluated ones (``leaky``)."""
    root = tmp_path_factory.mktemp("small")
    tr = zipf_traces(4, 24, num_layers=2, num_experts=8, top_k=2, prompt_len=4, seed=1)
    fit = zipf_traces(3, 24, num_layers=2, num_experts=8, top_k=2, prompt_len=4, seed=2)
    for s in fit.sequences:
        s.seq_id = f"fit-{s.seq_id}"
    traces = write_traces(root / "traces", tr.meta, tr.sequences)
    fit_dir = write_traces(root / "fit", fit.meta, fit.sequences)
    torch.manual_seed(0)
    model = ExpertForecaster(ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=16, head_dim=8,
                                              state_size=4, num_blocks=1, direct_horizons=2)).eval()
    training = {"traces": [str(fit_dir)], "split": {"seed": 0, "val_fraction": 0.2, "test_fraction": 0.0},
                "train_ids": [s.seq_id for s in fit.sequences[:2]], "val_ids": [fit.sequences[2].seq_id]}
    src = {"model_id": tr.meta.model_id}
    export = save_forecaster(model, root / "export", source=src, training=training)
    leaky = save_forecaster(model, root / "leaky", source=src,
                            training={**training, "train_ids": [tr.sequences[0].seq_id]})
    return {"traces": traces, "fit": fit_dir, "export": export, "leaky": leaky}


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("card:")]  # the progress bar
    assert len(err) == 1, err
    return err[0]


def test_card_on_granite(granite, tmp_path, capsys):
    out = tmp_path / "card"
    assert traces_main(["card", str(granite), "--out", str(out), "--capacity", "0.25,0.45",
                        "--lifecycle", "persistent"]) == 0
    printed = capsys.readouterr().out
    assert "lifecycle: persistent" in printed and "granite" in printed and "no-miss tok" in printed
    card = json.loads((out / "card.json").read_text())
    h = card["header"]
    assert h["source_format"] == "granite" and h["shape"] == {"L": 24, "E": 32, "K": 8} and h["sequences"] == 3
    assert h["tokens"] == 304 and h["decode_tokens"] == 192 and h["phase_known"] is True
    assert h["prefill_counted"] is False and h["lifecycle"] == "persistent"
    assert h["link_model"]["expert_bytes"] == 3 * 1024 * 512 * 2 and h["link_model"]["bandwidth_gbps"] == 25.0
    assert len(h["fingerprint"]) == 64 and h["code_version"]["code_format"] >= 1 and h["forecaster"] is None
    assert any("static: skipped" in n for n in h["notes"])  # no fit set
    rows = card["cache"]
    assert {r["policy"] for r in rows} == {*DEMAND, "belady"}
    assert {(r["pool"], r["capacity"]) for r in rows} == {(p, c) for p in ("per-layer", "shared") for c in (0.25, 0.45)}
    for (pool, cap) in {(r["pool"], r["capacity"]) for r in rows}:
        cell = {r["policy"]: r for r in rows if (r["pool"], r["capacity"]) == (pool, cap)}
        bel, lru = cell["belady"]["hit"], cell["lru"]["hit"]
        for p in DEMAND:
            assert cell[p]["hit"] <= bel + 1e-12, (pool, cap, p)
        for p, r in cell.items():
            assert 0.0 <= r["no_miss_share"] <= 1.0 and r["tokens"] == 192
            assert r["misses_per_token"] == pytest.approx((1 - r["hit"]) * 24 * 8)  # K=8 of each of 24 layers
            if bel > lru:
                assert r["gap_closed"] == pytest.approx((r["hit"] - lru) / (bel - lru))
            if p in DEMAND or p == "belady":  # demand only: every miss is exposed, nothing arrives late
                assert r["exposed_per_token"] == pytest.approx(r["misses_per_token"])
                assert r["late_prefetches"] == 0 == r["prefetches_used"]
    recall = {r["predictor"]: r for r in card["recall"]}
    assert set(recall) == {"repeat-last", "recent-freq", "recent-count"}
    for r in recall.values():
        assert all(0.0 <= r[f"R@K h{h}"] <= 1.0 for h in (1, 2, 4, 8))
    with open(out / "card.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert sum(r["table"] == "cache" for r in table) == len(rows)
    assert sum(r["table"] == "recall" for r in table) == 3 * 2 * 4  # predictors x (@K, @K+3) x horizons
    assert (out / "card.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_card_header_says_when_the_phase_is_unknown(tmp_path, capsys):
    traces = tmp_path / "megatron"
    assert traces_main(["import", str(MEGATRON), "--num-experts", "8", "--out", str(traces)]) == 0
    out = tmp_path / "card"
    assert traces_main(["card", str(traces), "--out", str(out), "--capacity", "0.5", "--pools", "shared",
                        "--count-prefill"]) == 0
    assert "phase: unknown" in capsys.readouterr().out
    h = json.loads((out / "card.json").read_text())["header"]
    assert h["source_format"] == "megatron" and h["phase_known"] is False and h["prefill_counted"] == "unknown"
    rows = json.loads((out / "card.json").read_text())["cache"]
    assert rows and all(r["pool"] == "shared" for r in rows) and not any(math.isnan(r["hit"]) for r in rows)


def test_card_with_a_fit_set_and_a_forecaster(small, tmp_path, capsys):
    out = tmp_path / "card"
    assert traces_main(["card", str(small["traces"]), "--fit-traces", str(small["fit"]), "--forecaster",
                        str(small["export"]), "--capacity", "0.5", "--pools", "shared", "--mlp-steps", "5",
                        "--out", str(out)]) == 0
    card = json.loads((out / "card.json").read_text())
    h = card["header"]
    assert h["lifecycle"] == "cold" and h["fit_sequences"] == 3 and len(h["export_hash"]) == 64
    fc = h["overlap"]["forecaster"]
    assert h["overlap"]["fit"] == {"overlap": 0, "evaluated": 4, "allowed": False}
    assert {k: fc[k] for k in ("overlap", "evaluated", "allowed", "model_match")} == \
        {"overlap": 0, "evaluated": 4, "allowed": False, "model_match": True}
    rows = card["cache"]
    assert {r["policy"] for r in rows} == {*DEMAND, "static", "belady", "seqmoe", "hybrid"}
    for r in rows:
        assert 0.0 <= r["no_miss_share"] <= 1.0 and r["exposed_per_token"] >= 0 and 0.0 <= r["hit"] <= 1.0
        if r["policy"] in ("seqmoe", "hybrid"):
            assert r["engine"] == "python"  # the driver over the modelled link
    hit = {(r["pool"], r["policy"]): r["hit"] for r in rows}
    assert hit[("shared", "seqmoe")] != hit[("shared", "lru")]  # the forecast's eviction order was replayed
    assert {r["predictor"] for r in card["recall"]} == {"forecaster", "repeat-last", "frequency", "transition",
                                                       "recent-freq", "recent-count", "cross-layer", "cross-x-recent",
                                                       "mlp-reference"}


def test_card_refuses_overlap_with_the_fit_set_or_the_export(granite, small, tmp_path, capsys):
    out = tmp_path / "card"
    assert traces_main(["card", str(granite), "--fit-traces", str(granite), "--out", str(out)]) == 2
    err = _err(capsys)
    assert "expertcast traces card: error: 3 of the 3 evaluated sequences were used to train the fit set" in err
    assert "(a card has no override)" in err
    assert traces_main(["card", str(small["traces"]), "--forecaster", str(small["leaky"]), "--out", str(out)]) == 2
    assert "1 of the 4 evaluated sequences were used to train the forecaster" in _err(capsys)
    assert not out.exists()  # refused before anything was written
    assert traces_main(["card", str(granite), "--pools", "global", "--out", str(out)]) == 2
    assert "--pools: expected a comma list of per-layer, shared" in _err(capsys)
