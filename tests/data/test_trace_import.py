"""Real-like synthetic routing (near-uniform in aggregate, locally sticky) and the granite expert-trace importer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from expertcast.data.synthetic import StickyRoutingProcess
from expertcast.data.trace_import import ImportFormatError, import_expert_trace_json, read_expert_trace_json
from expertcast.data.trace_stats import trace_stats

DATA = Path(os.environ.get("EXPERTCAST_DATA_DIR", Path(__file__).resolve().parents[3] / "shared" / "data"))
GRANITE = DATA / "traces" / "granite-3.0-1b-a400m" / "moe_expert_trace.json"


def _summary(meta, seqs) -> dict:
    rows, _ = trace_stats(meta, seqs)
    return next(r for r in rows if r.get("layer") == "all" and r.get("phase") == "decode")


def test_sticky_process_has_real_routing_statistics():
    """Top-6 of 64: normalised entropy of expert use ~0.99 in aggregate, step overlap ~0.27 (random: 0.094)."""
    proc = StickyRoutingProcess.realistic(num_layers=4, num_experts=64, top_k=6, seed=0)
    seqs = proc.sample(60, 100, seed=1)
    s = _summary(proc.meta(), seqs)
    assert 0.985 <= s["entropy"] <= 0.995, s
    assert 0.24 <= s["overlap"] <= 0.30, s
    # each sequence has favourites (what recent frequency reads), which differ between sequences
    per_seq = [np.bincount(q.expert_ids[:, 0].ravel(), minlength=64) / q.expert_ids[:, 0].size for q in seqs[:10]]
    assert np.mean([_norm_entropy(f) for f in per_seq]) < s["entropy"] - 0.05
    assert all(q.expert_ids.shape == (100, 4, 6) for q in seqs)
    assert all(len(set(row.tolist())) == 6 for q in seqs[:5] for row in q.expert_ids.reshape(-1, 6))


def _norm_entropy(f: np.ndarray) -> float:
    f = f[f > 0]
    return float(-(f * np.log(f)).sum() / np.log(64))


@pytest.mark.skipif(not GRANITE.is_file(), reason="shared data not present")
def test_granite_trace_imports_as_three_sequences(tmp_path):
    meta, seqs = read_expert_trace_json(GRANITE, expert_bytes=3145728)
    assert (meta.num_layers, meta.num_experts, meta.top_k) == (24, 32, 8)
    raw = json.loads(GRANITE.read_text())
    assert [s.seq_id for s in seqs] == list(raw["prompts"])  # file order: first prompts -> last prompt
    for s in seqs:
        pr = raw["prompts"][s.seq_id]
        assert s.prompt_len == pr["prompt_len"] == len(pr["prefill"])
        assert s.num_tokens - s.prompt_len == len(pr["decode"]) == 64
        assert s.expert_ids[s.prompt_len + 3].tolist() == pr["decode"][3]
        assert np.allclose(s.expert_weights.astype(np.float32), 1 / 8)
    from expertcast.data.traces import load_traces

    import_expert_trace_json(GRANITE, tmp_path / "granite", expert_bytes=3145728)
    meta2, back = load_traces(tmp_path / "granite")
    assert meta2.expert_bytes == 3145728 and sorted(s.seq_id for s in back) == sorted(raw["prompts"])


def test_expert_trace_json_errors_name_the_key(tmp_path):
    p = tmp_path / "t.json"
    good = {"model": "m", "num_layers": 2, "num_experts": 4, "top_k": 2,
            "prompts": {"a": {"prompt_len": 1, "prefill": [[[0, 1], [2, 3]]], "decode": [[[1, 2], [0, 3]]]}}}
    p.write_text(json.dumps(good))
    meta, seqs = read_expert_trace_json(p)
    assert seqs[0].num_tokens == 2 and seqs[0].prompt_len == 1
    bad = json.loads(json.dumps(good))
    bad["prompts"]["a"]["decode"][0][1] = [0, 9]
    p.write_text(json.dumps(bad))
    with pytest.raises(ImportFormatError, match=r"prompts\.a\.decode\[0\]\[1\].*outside"):
        read_expert_trace_json(p)
    bad = json.loads(json.dumps(good))
    bad["prompts"]["a"]["prompt_len"] = 3
    p.write_text(json.dumps(bad))
    with pytest.raises(ImportFormatError, match="prompt_len 3 but 1 prefill"):
        read_expert_trace_json(p)
    bad = json.loads(json.dumps(good))
    bad["prompts"]["a"]["prefill"][0] = [[0, 1]]
    p.write_text(json.dumps(bad))
    with pytest.raises(ImportFormatError, match=r"prefill\[0\]: expected 2 layers"):
        read_expert_trace_json(p)
