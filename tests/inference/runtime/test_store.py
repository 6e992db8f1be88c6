"""Runtime building blocks: host expert store, transfer thread, slot pool, grouped expert compute."""

from __future__ import annotations

import time

import pytest
import torch
from expertcast.inference.runtime.experts import Workspace, group_by_expert, grouped_expert_compute
from expertcast.inference.runtime.slots import SlotPool
from expertcast.inference.runtime.store import (
    HostExpertStore,
    UnsupportedModelError,
    find_experts_modules,
    release_model_experts,
)
from expertcast.inference.runtime.transfer import ThreadTransferEngine
from expertcast.models.presets import build_tiny

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gpt_oss():
    return build_tiny("gpt_oss-tiny", seed=0)


@pytest.mark.parametrize("preset", ["qwen3_moe-tiny", "gpt_oss-tiny"])
def test_store_rows_equal_fused_weights(preset):
    model = build_tiny(preset, seed=1)
    refs = find_experts_modules(model)
    store = HostExpertStore.from_model(model)
    assert store.num_layers == len(refs) and store.num_experts == refs[0].module.num_experts
    for li, r in enumerate(refs):
        for e in (0, r.module.num_experts - 1):
            v = store.views(li, e)
            for name, t in v.items():
                assert torch.equal(t, getattr(r.module, name)[e]), (preset, name)
    # GPT-OSS is stored transposed with biases
    if preset == "gpt_oss-tiny":
        assert store.layout.is_transposed and store.layout.has_bias
        assert {p.name for p in store.layout.parts} == {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    assert store.expert_bytes == sum(getattr(refs[0].module, p.name)[0].numel() for p in store.layout.parts) * 4


def test_mmap_store_roundtrip_and_corrupt_file(tmp_path, gpt_oss):
    refs = find_experts_modules(gpt_oss)
    path = tmp_path / "experts.safetensors"
    store = HostExpertStore.from_model(gpt_oss, mmap_path=path)
    assert store.mmap_path == path
    mem = HostExpertStore.from_model(gpt_oss)
    assert torch.equal(store.rows, mem.rows)
    assert store.views(1, 3)["down_proj"].shape == refs[1].module.down_proj[3].shape
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated|corrupt"):
        HostExpertStore.open_mmap(bad)
    foreign = tmp_path / "foreign.safetensors"
    from safetensors.torch import save_file

    save_file({"rows": torch.zeros(2, 2)}, str(foreign))
    with pytest.raises(ValueError, match="not an expertcast expert store"):
        HostExpertStore.open_mmap(foreign)


def test_release_and_restore_experts():
    model = build_tiny("mixtral-tiny", seed=0)
    refs = find_experts_modules(model)
    before = refs[0].module.gate_up_proj.detach().clone()
    store = HostExpertStore.from_model(model, refs=refs)
    freed = release_model_experts(refs, store.layout)
    assert freed == store.nbytes
    assert refs[0].module.gate_up_proj.numel() == 0
    store.restore_into(refs)
    assert torch.equal(refs[0].module.gate_up_proj, before)


def test_unsupported_architecture_is_named():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        find_experts_modules(dense)


def test_transfer_thread_copies_bytes_and_throttles():
    eng = ThreadTransferEngine(bandwidth_gbps=0.01)  # 10 MB/s: 40 KB take 4 ms
    try:
        src = torch.randn(10_000)
        dst = torch.zeros(10_000)
        t0 = time.perf_counter()
        tr = eng.submit((0, 1), src, dst, slot=0)
        eng.wait(tr)
        took = time.perf_counter() - t0
        assert torch.equal(src, dst)
        assert took >= 0.0039
        assert eng.bytes_moved == 40_000 and eng.transfers == 1
        # the link is serial: two transfers take twice as long
        d2 = [torch.zeros(10_000) for _ in range(2)]
        t0 = time.perf_counter()
        trs = [eng.submit((0, i), src, d, slot=i) for i, d in enumerate(d2)]
        eng.synchronize()
        assert all(eng.done(t) for t in trs)
        assert time.perf_counter() - t0 >= 0.0079
    finally:
        eng.close()


def test_grouped_compute_matches_transformers_from_slots(gpt_oss):
    """Weights served from device slots (after a real transfer) give the fused module's exact output."""
    refs = find_experts_modules(gpt_oss)
    mod = refs[0].module
    store = HostExpertStore.from_model(gpt_oss)
    pool = SlotPool(store.layout, num_slots=mod.num_experts, device="cpu")
    eng = ThreadTransferEngine()
    try:
        for e in range(mod.num_experts):
            eng.submit((0, e), store.row(0, e), pool.row(e), slot=e)
        eng.synchronize()
    finally:
        eng.close()
    g = torch.Generator().manual_seed(0)
    T, K = 9, gpt_oss.config.num_experts_per_tok
    h = torch.randn(T, gpt_oss.config.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(mod.num_experts, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    ref = mod(h, idx, w)
    ws = Workspace(h.device, h.dtype)
    out = grouped_expert_compute(mod, h, idx, w, pool.views, ws)
    assert torch.equal(out, ref)
    # CPU execution of some experts from the host copy gives the same result
    g = group_by_expert(idx, mod.num_experts)
    active = g.active
    assert sum(g.counts) == T * K and active == sorted(set(idx.flatten().tolist()))
    assert g.selected.tolist() == list(dict.fromkeys(idx.flatten().tolist()))  # first-appearance order
    assert [idx.flatten()[i].item() for i in g.perm.tolist()] == sorted(idx.flatten().tolist())
    out2 = grouped_expert_compute(mod, h, idx, w, pool.views, ws, cpu_weights_of=lambda e: store.views(0, e),
                                  cpu_experts={active[0], active[-1]})
    assert torch.equal(out2, ref)
    n = ws.nbytes
    grouped_expert_compute(mod, h[:3], idx[:3], w[:3], pool.views, ws)
    assert ws.nbytes == n  # workspace reused, not reallocated


def test_demand_loads_and_late_prefetches_go_ahead_of_queued_prefetches():
    eng = ThreadTransferEngine(bandwidth_gbps=0.01)  # 4 ms per 40 KB transfer
    try:
        src = torch.randn(10_000)
        d = [torch.zeros(10_000) for _ in range(4)]
        a = eng.submit((0, 0), src, d[0], 0)  # on the wire first
        b = eng.submit((0, 1), src, d[1], 1)
        c = eng.submit((0, 2), src, d[2], 2)
        dem = eng.submit((0, 3), src, d[3], 3, demand=True)
        eng.promote(c)  # c is needed now: late prefetch
        eng.synchronize()
        # (whether ``a`` was already on the wire depends on thread scheduling; the rest does not)
        assert dem.finished < c.finished < b.finished and a.finished < b.finished
        assert all(torch.equal(x, src) for x in d)
    finally:
        eng.close()
