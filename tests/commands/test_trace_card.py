"""`expertcast traces card` (docs/design.md, "Protocol card"): the card of the granite trace (imported from its JSON,
``source_format`` granite) with a forecaster export, its files and the consistency of its numbers; the header of a
trace whose source does not mark the phase; the refusal of evaluated ids shared with the fit set or the export."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from expertcast.commands.traces import main as traces_main
from expertcast.data.traces import load_traces
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.models.forecaster_export import save_forecaster

GRANITE = ("traces", "granite-3.0-1b-a400m", "moe_expert_trace.json")
MEGATRON = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "traces" / "megatron" / "router_trace_rank0.jsonl"
DEMAND = ("lru", "lfu", "lrfu", "fifo", "belady-k")


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """The granite trace set (3 prompts, L=24, E=32, K=8) and an untrained forecaster export of its shape whose
    training ids are other sequences (``train``) or the granite prompts themselves (``leaky``)."""
    import os

    root = tmp_path_factory.mktemp("card")
    src = Path(os.environ["EXPERTCAST_DATA_DIR"]).joinpath(*GRANITE)
    assert traces_main(["import", "--format", "auto", str(src), "--out", str(root / "traces")]) == 0
    _, seqs = load_traces(root / "traces")
    torch.manual_seed(0)
    model = ExpertForecaster(ForecasterConfig(num_layers=24, num_experts=32, top_k=8, hidden_size=32, head_dim=8,
                                              state_size=4, num_blocks=1, direct_horizons=2)).eval()
    training = {"traces": ["elsewhere"], "split": {"seed": 0, "val_fraction": 0.2, "test_fraction": 0.0},
                "train_ids": ["other-0", "other-1"], "val_ids": ["other-2"]}
    src_info = {"model_id": "granite-3.0-1b-a400m"}
    export = save_forecaster(model, root / "export", source=src_info, training=training)
    leaky = save_forecaster(model, root / "leaky", source=src_info,
                            training={**training, "train_ids": [seqs[0].seq_id]})
    return {"traces": root / "traces", "export": export, "leaky": leaky, "ids": [s.seq_id for s in seqs]}


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("card:")]  # the progress bar
    assert len(err) == 1, err
    return err[0]


def test_card_on_granite_with_a_forecaster(granite, tmp_path, capsys):
    out = tmp_path / "card"
    assert traces_main(["card", str(granite["traces"]), "--forecaster", str(granite["export"]), "--out", str(out),
                        "--capacity", "0.25,0.45", "--lifecycle", "persistent"]) == 0
    printed = capsys.readouterr().out
    assert "lifecycle: persistent" in printed and "granite" in printed and "no_miss_share" in printed
    card = json.loads((out / "card.json").read_text())
    h = card["header"]
    assert h["source_format"] == "granite" and h["shape"] == {"L": 24, "E": 32, "K": 8} and h["sequences"] == 3
    assert h["tokens"] == 304 and h["decode_tokens"] == 192 and h["phase_known"] is True
    assert h["prefill_counted"] is False and h["lifecycle"] == "persistent"
    assert h["link_model"]["expert_bytes"] == 3 * 1024 * 512 * 2 and h["link_model"]["bandwidth_gbps"] == 25.0
    assert len(h["fingerprint"]) == 64 and len(h["export_hash"]) == 64 and h["code_version"]["code_format"] >= 1
    assert h["overlap"]["forecaster"]["overlap"] == 0
    assert any("static: skipped" in n for n in h["notes"])  # no fit set
    rows = card["cache"]
    assert {r["policy"] for r in rows} == {*DEMAND, "belady", "seqmoe", "hybrid"}
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
        assert cell["seqmoe"]["proactive_per_token"] > 0  # the forecaster's prefetches were replayed
    recall = {r["predictor"]: r for r in card["recall"]}
    assert set(recall) == {"forecaster", "repeat-last", "recent-freq"}
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


def test_card_refuses_overlap_with_the_fit_set_or_the_export(granite, tmp_path, capsys):
    out = tmp_path / "card"
    assert traces_main(["card", str(granite["traces"]), "--fit-traces", str(granite["traces"]),
                        "--out", str(out)]) == 2
    err = _err(capsys)
    assert "expertcast traces card: error: 3 of the 3 evaluated sequences were used to train the fit set" in err
    assert "(a card has no override)" in err
    assert traces_main(["card", str(granite["traces"]), "--forecaster", str(granite["leaky"]), "--out", str(out)]) == 2
    assert "1 of the 3 evaluated sequences were used to train the forecaster" in _err(capsys)
    assert not out.exists()  # refused before anything was written
    assert traces_main(["card", str(granite["traces"]), "--pools", "global", "--out", str(out)]) == 2
    assert "--pools: expected a comma list of per-layer, shared" in _err(capsys)
