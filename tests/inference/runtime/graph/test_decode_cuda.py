"""Graph decode path on CUDA (marker ``gpu``; skipped without CUDA): greedy tokens equal the full-load model's on
the graph path (misses copied on the device by the Triton kernel from pinned, device-mapped host memory), and
the MoE part of a decode step (every layer's function, one after another) captured in one CUDA Graph and
replayed gives the same outputs, counters and residency as running it uncaptured.

    pytest -m gpu tests/inference/runtime/graph/test_decode_cuda.py -q -s
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from expertcast.inference.cache.counters import COUNTER_NAMES
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.checks import check_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.models.presets import build_tiny

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["lru", "seqmoe"])
def test_cuda_graph_path_tokens_equal_full_load(name):
    dev = torch.device("cuda")
    model = build_tiny("qwen3_moe-tiny", seed=0).to(dev)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (2, 9), generator=g).to(dev)
    am = torch.ones_like(ids)
    ref = model.generate(ids, attention_mask=am, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    om = OffloadedModel(model, check_policy(name, model), 6, device=dev, decode_path="graph")
    try:
        assert om.decode_path == "graph" and om.store.is_pinned
        out = om.generate(ids, am, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
        assert torch.equal(out.sequences, ref)
        assert om.stats.D > 0 and om.stats.hits.sum() > 0
    finally:
        om.restore()


def _snapshot(st):
    return {f.name: getattr(st, f.name).clone() for f in dataclasses.fields(st)}


def _restore(st, snap):
    for k, v in snap.items():
        getattr(st, k).copy_(v)


def test_cuda_graph_capture_and_replay_of_decode_step():
    dev = torch.device("cuda")
    model = build_tiny("qwen3_moe-tiny", seed=0).to(dev)
    om = OffloadedModel(model, make_policy("lru"), 6, device=dev, decode_path="graph")
    gd, L, E, K = om.graph, om.L, om.E, om.K
    H = model.config.hidden_size
    h = torch.zeros(L, 1, H, device=dev)
    idx = torch.zeros(L, 1, K, dtype=torch.long, device=dev)
    w = torch.zeros(L, 1, K, device=dev)
    out = torch.zeros(L, 1, H, device=dev)

    def step():
        for layer in range(L):
            out[layer].copy_(gd.run_layer(gd.layer_ids[layer], h[layer], idx[layer], w[layer]))

    gen = torch.Generator().manual_seed(0)

    def new_inputs():
        h.copy_(torch.randn(L, 1, H, generator=gen))
        idx.copy_(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(L)])[:, None])
        w.copy_(torch.rand(L, 1, K, generator=gen))

    try:
        new_inputs()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()  # warm-up (Triton compiles, allocator settles)
        torch.cuda.current_stream().wait_stream(side)
        snap = _snapshot(gd.state)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        _restore(gd.state, snap)
        for _ in range(6):
            new_inputs()
            before = _snapshot(gd.state)
            step()
            want_out, want_state = out.clone(), _snapshot(gd.state)
            _restore(gd.state, before)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want_out)
            got = _snapshot(gd.state)
            for k in want_state:
                assert torch.equal(got[k], want_state[k]), k
        assert int(gd.state.counters[COUNTER_NAMES.index("demand")].sum()) > 0, "the replayed steps should have loaded experts on the device"
    finally:
        om.restore()
