"""`expertcast stages calibrate | stats | detect | eval` end to end on a tiny model directory (a trained
byte-level BPE) and routing traces whose expert profile changes at "Wait" and stays at "So"."""

from __future__ import annotations

import json

import numpy as np
import pytest
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.data.traces import write_traces
from expertcast.inference.stages_cli import main

L, E, K = 2, 32, 4


def _texts(rng: np.random.Generator, n: int) -> list[str]:
    words = ["x", "y", "z", "plus", "equals", "two", "three", "value", "term", "sum"]
    out = []
    for _ in range(n):
        parts = []
        for _s in range(6):
            cue = str(rng.choice(["Wait,", "So"]))
            body = " ".join(str(w) for w in rng.choice(words, size=int(rng.integers(25, 40))))
            parts.append(f"{cue} {body}.")
        out.append(" ".join(parts))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from expertcast.models.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("stages_cli")
    rng = np.random.default_rng(0)
    texts = _texts(rng, 6)
    tok = train_bpe_tokenizer(texts * 4, vocab_size=290)
    model = root / "model"
    tok.save_pretrained(model)
    w_id = tok.encode("Wait", add_special_tokens=False)[0]  # the token holding the cue's first character
    assert tok.decode([w_id]).startswith("W")
    seqs = []
    for i, text in enumerate(texts):
        ids = np.asarray(tok.encode(text, add_special_tokens=False), np.int32)
        T = len(ids)
        # each "Wait" starts a new expert profile (a hot set of 6 experts per layer); "So" does not
        rows = np.empty((T, L, K), np.int16)
        for t in range(T):
            if t == 0 or int(ids[t]) == w_id:
                hot = np.stack([rng.choice(E, 6, replace=False) for _ in range(L)])
            for lyr in range(L):
                rows[t, lyr] = rng.choice(hot[lyr], K, replace=False)
        seqs.append(TraceSequence(f"s{i}", ids, 4, rows, np.full((T, L, K), 0.25, np.float16)))
    meta = TraceMeta(str(model), L, E, K, expert_bytes=1000)
    traces = write_traces(root / "traces", meta, seqs)
    gold = root / "gold.jsonl"
    with open(gold, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts[:3]):
            sents = [s.strip() + "." for s in text.split(".") if s.strip()]
            chunks = [{"text": s, "function_tags": ["uncertainty_management" if s.startswith("Wait") else
                                                    "active_computation"]} for s in sents]
            f.write(json.dumps({"id": i, "thinking": text, "chunks": chunks}) + "\n")
    return root, model, traces, gold


def test_calibrate_stats_detect_eval(setup, capsys):
    root, model, traces, gold = setup
    cues = model / "cues.json"
    assert main(["calibrate", "--traces", str(traces), "--model", str(model), "--out", str(cues),
                 "--min-rate", "1", "--min-stage-tokens", "4"]) == 0
    cs = json.loads(cues.read_text())
    sc = cs["scores"]
    assert set(cs["cues"]) <= {"Wait", "So"} and sc["Wait"]["count"] > 0 and sc["So"]["count"] > 0
    # every "Wait" plants a new profile: adjacent Wait-stages are less alike than uniform chunks, so the
    # finished stage mispredicts the next and calibration must not prefer Wait over So
    assert sc["Wait"]["tcseq"] < sc["Wait"]["tcseq_uniform"] and sc["Wait"]["tcseq"] < sc["So"]["tcseq"]
    assert cs["cues"] == ["So"]
    # stats and eval find the cue set in the model directory
    out = root / "out"
    assert main(["stats", "--traces", str(traces), "--model", str(model), "--out-dir", str(out)]) == 0
    st = json.loads((out / "stage_stats.json").read_text())
    assert st["cues"] == "So" and st["stages"] > st["sequences"] and 0 < st["tcseq"] <= 1
    assert (out / "tcseq_layers.csv").is_file() and (out / "stage_stats.png").is_file()
    assert main(["detect", "--gold", str(gold), "--model", str(model), "--cues", str(cues),
                 "--out-dir", str(out)]) == 0
    det = json.loads((out / "detect_gold.json").read_text())
    full = [r for r in det if r["cue_set"].startswith("all candidates") and r["tolerance_tokens"] == 4][0]
    assert full["recall"] == pytest.approx(1.0) and 0.2 < full["precision"] < 0.8  # Wait = gold, So = not
    assert main(["eval", "--traces", str(traces), "--model", str(model), "--batch-sizes", "2",
                 "--capacities", "0.03,0.25", "--policies", "stage,stage-oracle,lru,static",
                 "--out-dir", str(out)]) == 0
    rows = json.loads((out / "saem_eval.json").read_text())
    assert len(rows) == 2 * 4 and (out / "saem_eval.png").is_file() and (out / "saem_eval.csv").is_file()
    assert {r["slots_per_layer"] for r in rows} == {1, 8}  # 3% of 32 experts: 1 slot < top-4, accepted
    by = {(r["capacity"], r["policy"]): r for r in rows}
    for cap in (0.03, 0.25):
        st, lru = by[cap, "stage"], by[cap, "lru"]
        assert 0 < st["oracle_eff_hit"] <= 1.0 + 1e-9 and st["updates"] > 0
        assert st["cpu_share"] > 0 and st["transfers_per_token"] < lru["transfers_per_token"]
        assert lru["cpu_share"] == 0 and lru["speedup_vs_lru"] == pytest.approx(1.0)
    # resume: a second run reuses every record of the partial file
    partial = json.loads((out / "partial-cot.json").read_text())
    assert len(partial["records"]) == len(rows) and partial["settings"]["cues"] == ["So"]
    capsys.readouterr()
    assert main(["eval", "--traces", str(traces), "--model", str(model), "--batch-sizes", "2",
                 "--capacities", "0.03,0.25", "--policies", "stage,stage-oracle,lru,static",
                 "--out-dir", str(out)]) == 0
    assert json.loads((out / "saem_eval.json").read_text()) == rows
    # other settings (another expert size) must not silently reuse those records
    assert main(["eval", "--traces", str(traces), "--model", str(model), "--batch-sizes", "2", "--capacities", "0.25",
                 "--policies", "lru", "--expert-bytes", "1000000", "--out-dir", str(out)]) == 2
    assert "other settings (cost differ)" in capsys.readouterr().err


def test_errors_name_the_problem(setup, tmp_path, capsys):
    root, model, traces, gold = setup
    bare = tmp_path / "bare"
    bare.mkdir()
    assert main(["stats", "--traces", str(traces), "--model", str(bare), "--out-dir", str(tmp_path)]) == 2
    assert "has no cues.json" in capsys.readouterr().err
    assert main(["eval", "--traces", str(tmp_path / "none"), "--cues", "x.json", "--out-dir", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
