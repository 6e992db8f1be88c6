"""moe-cache-lab routing-trace-v1: metadata record, prompt (layer-major) then generated (token-major) events."""

from __future__ import annotations

import json

import numpy as np
import pytest
from expertcast.data.importers import ImportOptions, read_traces
from expertcast.data.importers.common import ImportFormatError
from expertcast.utils.errors import UsageError


def test_trace_imports_with_phase_probabilities_and_token_ids(fixtures):
    _, imp = read_traces(fixtures / "moe-cache-lab" / "trace.jsonl", "moe-cache-lab")
    (s,) = imp.sequences
    assert (imp.num_experts, imp.top_k, imp.moe_layers, imp.model_id) == (8, 2, [0, 5], "synthetic/olmoe-tiny")
    assert (s.seq_id, s.num_tokens, s.prompt_len) == ("trace", 3, 2)
    assert s.expert_ids.tolist() == [[[1, 2], [5, 6]], [[3, 4], [7, 0]], [[2, 1], [6, 5]]]
    assert s.token_ids.tolist() == [100, 101, 102]
    np.testing.assert_allclose(s.expert_weights[0, 0].astype(float), [0.75, 0.25])
    np.testing.assert_allclose(s.expert_weights[2, 1].astype(float), [0.5, 0.5])  # empty probabilities: 1/K


def test_refusals(fixtures, tmp_path):
    with pytest.raises(ImportFormatError, match=r"bad_order.jsonl:3: prompt records must come in ascending "
                                                 r"\(layer, token_position\) order"):
        read_traces(fixtures / "moe-cache-lab" / "bad_order.jsonl", "moe-cache-lab")
    with pytest.raises(UsageError, match=r"--num-experts 16, but .* records 8"):
        read_traces(fixtures / "moe-cache-lab" / "trace.jsonl", "moe-cache-lab", ImportOptions(num_experts=16))
    lines = (fixtures / "moe-cache-lab" / "trace.jsonl").read_text().splitlines()
    meta = json.loads(lines[0]) | {"format_version": 2}
    (tmp_path / "v2.jsonl").write_text("\n".join([json.dumps(meta), *lines[1:]]) + "\n")
    with pytest.raises(ImportFormatError, match=r"v2.jsonl:1: format_version 2 is not read here"):
        read_traces(tmp_path / "v2.jsonl", "moe-cache-lab")
    ev = json.loads(lines[1]) | {"extra": 1}
    (tmp_path / "u.jsonl").write_text("\n".join([lines[0], json.dumps(ev), *lines[2:]]) + "\n")
    with pytest.raises(ImportFormatError, match=r"u.jsonl:2: unknown field\(s\) extra"):
        read_traces(tmp_path / "u.jsonl", "moe-cache-lab")
