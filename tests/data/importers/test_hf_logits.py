"""transformers router logits: top-K of the softmax (ties to the lower id), weights renormalised."""

from __future__ import annotations

import numpy as np
import pytest
from expertcast.data.importers import read_traces
from expertcast.data.importers.common import ImportFormatError


def test_topk_of_softmax(fixtures):
    _, imp = read_traces(fixtures / "hf-router-logits" / "logits.safetensors", "hf-router-logits")
    s0, s1 = imp.sequences
    assert (imp.num_layers, imp.num_experts, imp.top_k, imp.has_router_probs) == (2, 4, 2, True)
    assert (s0.num_tokens, s0.prompt_len, s0.source, s0.token_ids.tolist()) == (2, 1, "gsm8k", [5, 6])
    # s0 token 0 layer 0: logits [4, 3, 0, 0] -> experts 0, 1 with weights e/(e+1), 1/(e+1)
    assert s0.expert_ids[0, 0].tolist() == [0, 1]
    np.testing.assert_allclose(s0.expert_weights[0, 0].astype(float), [np.e / (np.e + 1), 1 / (np.e + 1)], rtol=1e-3)
    # token 1 layer 0: [0, 0, 2, 2 + ln 3] -> 3 then 2, weights 3/4 and 1/4; layer 1 all equal -> ties to 0, 1
    assert s0.expert_ids[1].tolist() == [[3, 2], [0, 1]]
    np.testing.assert_allclose(s0.expert_weights[1, 0].astype(float), [0.75, 0.25], rtol=1e-3)
    np.testing.assert_allclose(s0.router_probs[1, 1].astype(float), [0.25] * 4, rtol=1e-3)
    assert s1.expert_ids[0].tolist() == [[3, 0], [0, 1]] and s1.source == "cot"


def test_refusal_names_the_sidecar(fixtures):
    with pytest.raises(ImportFormatError, match=r"logits.json: norm_topk_prob must be true or false"):
        read_traces(fixtures / "hf-router-logits-bad" / "logits.safetensors", "hf-router-logits")
