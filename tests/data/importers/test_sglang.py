"""SGLang /generate responses: flat base64 ids reshaped by --num-layers/--top-k, a dense layer (-1) dropped."""

from __future__ import annotations

import pytest
from expertcast.data.importers import ImportOptions, read_traces
from expertcast.data.importers.common import ImportFormatError
from expertcast.utils.errors import UsageError

OPTS = ImportOptions(num_experts=8, num_layers=3, top_k=2)


def test_batched_and_single_responses(fixtures):
    _, imp = read_traces(fixtures / "sglang" / "responses.jsonl", "sglang", OPTS)
    a, b = imp.sequences
    assert (imp.num_layers, imp.top_k, imp.moe_layers, imp.phase_known) == (2, 2, [1, 2], True)
    assert (a.seq_id, a.num_tokens, a.prompt_len) == ("req-a", 3, 2)  # int32, T = P + C - 1
    assert (b.seq_id, b.num_tokens, b.prompt_len) == ("req-b", 3, 1)  # int16, T = P + C
    assert a.expert_ids[2].tolist() == [[5, 6], [7, 0]] and b.expert_ids[0].tolist() == [[6, 7], [0, 1]]
    assert a.source == b.source == "gsm8k" and "dropped 1 dense layer(s) [0]" in imp.notes[0]


def test_refusals(fixtures):
    with pytest.raises(ImportFormatError, match=r"bad_size.jsonl:1: routed_experts holds 17 int32 ids, not a "
                                                 r"multiple of --num-layers x --top-k = 3 x 2"):
        read_traces(fixtures / "sglang" / "bad_size.jsonl", "sglang", OPTS)
    with pytest.raises(UsageError, match="--top-k is required for the sglang layout"):
        read_traces(fixtures / "sglang" / "responses.jsonl", "sglang", ImportOptions(num_experts=8, num_layers=3))


def _routed(T: int, L: int, K: int, E: int, seed: int = 0):
    rng = __import__("numpy").random.default_rng(seed)
    return __import__("numpy").stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(T)])


def test_a_wrong_shape_with_the_same_product_is_refused(tmp_path):
    """The payload is L x K ids per position with no shape: 4 layers x top-4 of 16, read as 8 x 2 (each layer's
    top-4 cut in two halves that never share an expert) or 2 x 8 (two layers in one row, with repeats), is refused
    naming the flags; the model's own pair imports."""
    import base64
    import json

    import numpy as np

    ids = _routed(60, 4, 4, 16).astype(np.int32)
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"meta_info": {"id": "q", "prompt_tokens": 20, "completion_tokens": 41,
                                           "routed_experts": base64.b64encode(ids.tobytes()).decode()}}) + "\n")
    _, imp = read_traces(f, "sglang", ImportOptions(num_experts=16, num_layers=4, top_k=4))
    assert imp.sequences[0].expert_ids.tolist() == ids.tolist()
    with pytest.raises(ImportFormatError, match=r"layers 0 and 1 never select a common expert at the same position "
                                                 r"over 60 positions .* --num-layers 8 and --top-k 2 must be the"):
        read_traces(f, "sglang", ImportOptions(num_experts=16, num_layers=8, top_k=2))
    with pytest.raises(ImportFormatError, match=r"repeated expert in .*--num-layers 2 and --top-k 8 must be"):
        read_traces(f, "sglang", ImportOptions(num_experts=16, num_layers=2, top_k=8))
