"""The granite per-prompt expert-trace JSON (``--format granite``): the shared real trace, and errors naming the key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from expertcast.data.importers import ImportOptions, import_traces
from expertcast.data.importers.common import ImportFormatError
from expertcast.data.importers.granite import read_expert_trace_json

DATA = Path(os.environ.get("EXPERTCAST_DATA_DIR", Path(__file__).resolve().parents[4] / "shared" / "data"))
GRANITE = DATA / "traces" / "granite-3.0-1b-a400m" / "moe_expert_trace.json"


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

    import_traces(GRANITE, tmp_path / "granite", "granite", ImportOptions(), expert_bytes=3145728)
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
