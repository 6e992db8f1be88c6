"""The disk store (docs/design.md, "Disk tier"): direct-read round trip, reads overlapping compute, forced-routing
equality with the all-in-RAM run for every policy, and reads == counted loads."""

from __future__ import annotations

import json
import os
import struct
import threading
import time

import numpy as np
import pytest
import torch
from expertcast.data.synthetic import zipf_traces
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.disk_store import (
    ALIGN,
    BUFFERED,
    DIRECT,
    DiskExpertStore,
    ReaderPoolEngine,
    aligned_empty,
    write_disk_store_from,
)
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.runtime.store import HostExpertStore
from expertcast.models.presets import build_tiny
from expertcast.utils.errors import UsageError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """A qwen3_moe-tiny model's experts in RAM and the same experts in a disk store file."""
    model = build_tiny("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)
    ram = HostExpertStore.from_model(model)
    path = write_disk_store_from(ram, tmp_path_factory.mktemp("disk") / "experts.safetensors")
    return ram, path


def test_round_trip_bytes_equal(tiny_store):
    """Every expert read back through the store (the mode that ran: direct where the file system takes
    O_DIRECT) equals the bytes written; the file is a plain safetensors file with 4096-aligned rows."""
    ram, path = tiny_store
    for io in ("auto", "buffered"):
        disk = DiskExpertStore(path, io=io)
        assert disk.io_mode in (DIRECT, BUFFERED) and (io != "buffered" or disk.io_mode == BUFFERED)
        assert disk.data_start % ALIGN == 0 and disk.stride % ALIGN == 0 and disk.stride >= ram.expert_bytes
        for layer in range(ram.num_layers):
            for e in range(ram.num_experts):
                got = disk.read_row(layer, e)
                assert torch.equal(got.view(torch.uint8), ram.row(layer, e).view(torch.uint8)), (io, layer, e)
        disk.close()
    with open(path, "rb") as f:  # self-describing: a safetensors header naming the format and its version
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))["__metadata__"]
    assert meta["format"] == "expertcast-disk-store" and meta["format_version"] == "1"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        rows = f.get_tensor("rows")
    assert torch.equal(rows[..., :ram.layout.row_numel], ram.rows)


def test_round_trip_through_reader_pool(tiny_store):
    """The reader pool's reads (straight into an aligned padded slot, and through the bounce buffer into a
    plain row) land the written bytes."""
    ram, path = tiny_store
    disk = DiskExpertStore(path)
    eng = ReaderPoolEngine(disk, readers=3)
    padded = aligned_empty(disk.stride * 2)
    plain = torch.zeros(ram.layout.row_numel, dtype=ram.layout.dtype)
    for layer in range(ram.num_layers):
        for e in range(ram.num_experts):
            a = eng.submit((layer, e), disk.row(layer, e), padded[:disk.stride], 0)
            b = eng.submit((layer, e), disk.row(layer, e), plain, 1, demand=True)
            eng.wait(a)
            eng.wait(b)
            want = ram.row(layer, e).view(torch.uint8)
            assert torch.equal(padded[:ram.expert_bytes], want) and torch.equal(plain.view(torch.uint8), want)
    assert eng.direct_reads == ram.num_layers * ram.num_experts
    eng.close()
    disk.close()


def test_bad_store_files(tmp_path, tiny_store):
    with pytest.raises(FileNotFoundError):
        DiskExpertStore(tmp_path / "none.safetensors")
    ram, _ = tiny_store
    other = tmp_path / "plain.safetensors"
    HostExpertStore.from_model(build_tiny("qwen3_moe-tiny", seed=0), mmap_path=other)
    with pytest.raises(UsageError, match="not an expertcast disk store"):
        DiskExpertStore(other)


class _SlowStore(DiskExpertStore):
    """A disk store whose file reads block until the test's compute thread is running (an injected slow file)."""

    def __init__(self, path):
        super().__init__(path)
        self.compute_started = threading.Event()
        self.read_started = threading.Event()
        self.read_times: list[tuple[float, float]] = []

    def _pread(self, mv, offset):
        t0 = time.perf_counter()
        self.read_started.set()
        self.compute_started.wait(timeout=5)
        n = super()._pread(mv, offset)
        self.read_times.append((t0, time.perf_counter()))
        return n


def test_prefetch_reads_overlap_compute(tiny_store):
    """A prefetch submitted before a layer computes is read while the compute thread works: the read begins
    before the compute ends and ends after it began (by the readers' and the compute's own timestamps). A
    pool that serialised reads behind the compute (or read inside submit) never sees the compute start
    while its read is in progress, and this test fails."""
    _, path = tiny_store
    disk = _SlowStore(path)
    eng = ReaderPoolEngine(disk, readers=2)
    dst = aligned_empty(disk.stride)
    t_submit = time.perf_counter()
    tr = eng.submit((0, 1), disk.row(0, 1), dst, 0)
    submit_s = time.perf_counter() - t_submit
    c0 = time.perf_counter()
    disk.compute_started.set()
    x = torch.randn(64, 64)
    saw_read = disk.read_started.wait(timeout=5)
    while not eng.done(tr) and time.perf_counter() - c0 < 5:
        x = torch.tanh(x @ x.T * 1e-3)  # the compute thread works while the read proceeds
    c1 = time.perf_counter()
    eng.wait(tr)
    eng.close()
    (r0, r1), = disk.read_times
    assert saw_read and submit_s < 1.0
    assert r0 < c1 and r1 > c0, (r0, r1, c0, c1)
    assert tr.started is not None and tr.started < c1 and tr.finished > c0


def test_demand_reads_jump_the_queue(tiny_store):
    """With one reader busy, a demand read submitted after queued prefetches is read before them; a promoted
    (late) prefetch goes ahead of the other prefetches."""
    _, path = tiny_store
    disk = _SlowStore(path)
    eng = ReaderPoolEngine(disk, readers=1)
    bufs = [aligned_empty(disk.stride) for _ in range(5)]
    first = eng.submit((0, 0), disk.row(0, 0), bufs[0], 0)
    assert disk.read_started.wait(timeout=5)  # the reader is held inside the first read
    pf = [eng.submit((0, e), disk.row(0, e), bufs[e], e) for e in (1, 2, 3)]
    dm = eng.submit((1, 0), disk.row(1, 0), bufs[4], 4, demand=True)
    eng.promote(pf[2])
    disk.compute_started.set()
    eng.synchronize()
    order = sorted([first, *pf, dm], key=lambda t: t.started)
    assert order == [first, dm, pf[2], pf[0], pf[1]]
    eng.close()


class _SerialDisk(DiskExpertStore):
    """One read at a time, each 4 KiB block taking ``block_s`` (an injected serial disk: reads in flight
    together queue for it); ``entered`` counts the reads that reached the disk."""

    def __init__(self, path, block_s: float = 0.02):
        super().__init__(path)
        self.block_s = block_s
        self.entered = threading.Semaphore(0)
        self._disk = threading.Lock()

    def _pread(self, mv, offset):
        self.entered.release()
        with self._disk:
            time.sleep(self.block_s * -(-len(mv) // ALIGN))
            return super()._pread(mv, offset)


@pytest.mark.parametrize("chunk_kb", [4, 0])
def test_prefetch_reads_yield_the_disk_to_a_demand_read(tiny_store, chunk_kb):
    """Two readers busy with prefetch reads (3 blocks each) on a serial disk, then a demand read: with
    yielding prefetch reads (4 KiB blocks) the demand read finishes before either prefetch, served between two
    blocks by a reader of a paused prefetch; with whole reads (``prefetch_chunk_kb=0``, the baseline) it
    waits for a reader and finishes after one of them. Every read lands the written bytes."""
    ram, path = tiny_store
    disk = _SerialDisk(path)
    eng = ReaderPoolEngine(disk, readers=2, prefetch_chunk_kb=chunk_kb)
    bufs = [aligned_empty(disk.stride) for _ in range(3)]
    pf = [eng.submit((0, e), disk.row(0, e), bufs[e], e) for e in (0, 1)]
    for _ in range(2):
        assert disk.entered.acquire(timeout=5)  # both prefetch reads have reached the disk
    dm = eng.submit((1, 0), disk.row(1, 0), bufs[2], 2, demand=True)
    eng.synchronize()
    first_pf = min(t.finished for t in pf)
    if chunk_kb:
        assert dm.finished < first_pf and eng.yields == 1, (dm.finished, [t.finished for t in pf])
    else:
        assert dm.finished > first_pf and eng.yields == 0
    for (layer, e), b in zip([(0, 0), (0, 1), (1, 0)], bufs, strict=True):
        assert torch.equal(b[:ram.expert_bytes], ram.row(layer, e).view(torch.uint8))
    eng.close()


def test_yielding_pool_lands_every_read_under_mixed_demand_and_promotion(tiny_store):
    """Many prefetch and demand reads in 4 KiB blocks, some into the same slot, some promoted while queued or
    in flight: every read lands its expert's bytes and the pool drains (no reader waits forever)."""
    ram, path = tiny_store
    disk = _SerialDisk(path, block_s=0.0005)
    eng = ReaderPoolEngine(disk, readers=3, prefetch_chunk_kb=4)
    rng = np.random.default_rng(0)
    slots = [aligned_empty(disk.stride) for _ in range(6)]
    last: dict[int, tuple[int, int]] = {}
    trs = []
    for i in range(120):
        slot, layer, e = int(rng.integers(6)), int(rng.integers(ram.num_layers)), int(rng.integers(ram.num_experts))
        trs.append(eng.submit((layer, e), disk.row(layer, e), slots[slot], slot, demand=bool(rng.random() < 0.3)))
        last[slot] = (layer, e)
        if i % 7 == 3:
            eng.promote(trs[int(rng.integers(len(trs)))])
        if i % 11 == 5:
            eng.wait(trs[-1])
    t0 = time.perf_counter()
    eng.synchronize()
    assert time.perf_counter() - t0 < 30 and all(t.event.is_set() for t in trs)
    for slot, (layer, e) in last.items():
        assert torch.equal(slots[slot][:ram.expert_bytes], ram.row(layer, e).view(torch.uint8)), slot
    assert eng.yields + eng.paused_seconds > 0  # prefetch reads did yield
    eng.close()


class _GradedStore(DiskExpertStore):
    """A disk store whose reads take longer the lower the expert id (an injected slow file): reads in flight
    together land in descending id order, the reverse of the id order."""

    def __init__(self, path, base_s: float = 0.03, step_s: float = 0.006):
        super().__init__(path)
        self.base_s, self.step_s = base_s, step_s

    def _pread(self, mv, offset):
        e = ((offset - self.data_start) // self.stride) % self.num_experts
        time.sleep(self.base_s + self.step_s * (self.num_experts - 1 - e))
        return super()._pread(mv, offset)


def test_layer_computes_resident_experts_first_and_misses_in_landing_order(tiny_store):
    """Forced-routing replay through a slow disk (reads of low expert ids take longest, 4 readers: a layer's
    demand reads are all in flight at once): in every decode layer with a miss, each expert whose bytes were
    there computes before the layer's first demand read lands, and the missed experts compute in the order
    their reads landed (by the readers' and the compute's timestamps). A layer that computes in expert-id
    order (a resident expert waiting behind a missing one) fails. Outputs stay those of the in-RAM run."""
    _, path = tiny_store
    model = build_tiny("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)
    seqs = zipf_traces(num_sequences=1, num_tokens=14, num_layers=4, num_experts=16, top_k=4, seed=5).sequences
    om = OffloadedModel(model, make_policy("lru"), 1.0)
    _, full = _logits_of(om, seqs)
    model = om.restore()
    disk = _GradedStore(path)
    om = OffloadedModel(model, make_policy("lru"), 0.5, store=disk, readers=4)
    assert om.pool.num_temp >= 4  # temporary-slot reads (static's misses) can fill the reader pool too
    log: list[tuple] = []  # ("read", layer, expert, Transfer) at submit, ("compute", t, layer, expert) at the kernel
    submit, views = om.transport.submit, om.pool.views

    def logged_submit(slot, layer, expert, demand):
        tr = submit(slot, layer, expert, demand)
        if om.transport.count_reads and demand:
            log.append(("read", layer, expert, tr))
        return tr

    def logged_views(slot):
        log.append(("compute", time.perf_counter(), *om.transport._holds[slot]))
        return views(slot)

    om.transport.submit, om.pool.views = logged_submit, logged_views
    st, got = _logits_of(om, seqs)
    om.close()
    disk.close()
    assert all(torch.equal(a, b) for a, b in zip(got, full, strict=True)) and len(got) == len(full)
    groups: list[dict] = []  # one per layer-execution: its demand reads and its computes, in log order
    for ev in log:
        if ev[0] == "read" and (not groups or groups[-1]["computes"]):
            groups.append({"reads": {}, "computes": []})
        if ev[0] == "read":
            groups[-1]["reads"][ev[2]] = ev[3]
        elif groups and groups[-1]["reads"] and ev[2] == next(iter(groups[-1]["reads"].values())).key[0]:
            groups[-1]["computes"].append((ev[1], ev[3]))
    checked = 0
    for g in groups:
        reads, computes = g["reads"], g["computes"]
        first_landing = min(tr.finished for tr in reads.values())
        resident = [t for t, e in computes if e not in reads]
        assert all(t < first_landing for t in resident), (computes, reads)
        missed = [e for _, e in computes if e in reads]
        assert missed == sorted(reads, key=lambda e: reads[e].finished), (missed, reads)
        checked += bool(resident) and len(missed) >= 2
    assert st.D > 0 and checked >= 3, (st.D, checked)


def _policy(name, model, seqs):
    if name == "static":
        return make_policy("static", calibration=seqs)
    if name == "seqmoe":
        from expertcast.models.forecaster import untrained_forecaster

        c = model.config
        return make_policy("seqmoe", forecaster=untrained_forecaster(c.num_hidden_layers, c.num_experts,
                                                                     c.num_experts_per_tok),
                           precompute=False, min_confidence=0.05)
    return make_policy(name)


def _logits_of(om, seqs):
    """Forced-routing replay of ``seqs``; (stats, logits of every forward, stacked)."""
    out = []
    hook = om.model.register_forward_hook(lambda m, a, k, o: out.append(o.logits.detach().clone()), with_kwargs=True)
    try:
        st = om.replay(seqs)
    finally:
        hook.remove()
    return st, out


@pytest.mark.parametrize("name", ["lru", "lfu", "static", "seqmoe"])
def test_forced_routing_disk_equals_ram(tiny_store, name):
    """Forced-routing replay through the disk store (capacity 0.25, 2 readers) gives exactly the logits of
    the all-in-RAM run (every expert resident in RAM slots) and of the RAM store at the same capacity, with
    the same counters as the RAM store (seqmoe: the same accesses; its prefetch admissions depend on when its
    transfers land); every counted load is one read (reads == D + P, split by kind)."""
    _, path = tiny_store
    model = build_tiny("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)
    L, E, K = 4, 16, 4
    syn = zipf_traces(num_sequences=2, num_tokens=20, num_layers=L, num_experts=E, top_k=K, seed=3)
    seqs = syn.sequences
    om = OffloadedModel(model, make_policy("lru"), 1.0)
    _, full = _logits_of(om, seqs)
    model = om.restore()
    om = OffloadedModel(model, _policy(name, model, seqs), 0.25)
    ram_st, ram = _logits_of(om, seqs)
    model = om.restore()
    disk = DiskExpertStore(path)
    om = OffloadedModel(model, _policy(name, model, seqs), 0.25, store=disk, readers=2)
    st, got = _logits_of(om, seqs)
    om.close()
    assert len(got) == len(full) == len(ram)
    for a, b, c in zip(got, full, ram, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    # a demand-only policy decides from the routing alone: the same counters on both stores. seqmoe's
    # admissions read which of its own transfers have landed (docs/design.md, "Prefetch"), a real-time fact
    # that differs between a disk read and a RAM copy: only the routing-given counts are equal there
    same = ("accesses",) if name == "seqmoe" else ("accesses", "hits", "demand", "temp", "late", "proactive")
    for k in same:
        assert np.array_equal(getattr(st, k), getattr(ram_st, k)), k
    assert st.D > 0
    assert st.reads == st.D + st.P and ram_st.reads == ram_st.D + ram_st.P
    assert st.read_demand == st.D and st.read_prefetch == st.P
    assert st.read_bytes == st.reads * om.layout.expert_bytes
    assert om.transfer.direct_reads >= st.reads  # straight into the aligned slots on the CPU
    assert st.read_seconds > 0 and st.read_busy_seconds > 0 and 0 <= st.read_exposed <= st.reads
    assert 0 <= st.steps_without_miss <= len(st.step_demand) <= st.decode_steps
    disk.close()


def test_seqmoe_link_estimate_comes_from_the_measured_disk(tiny_store):
    """On the disk store seqmoe's transfer-time estimate is the measured one (reader pool reads, the layer's
    expert compute), not its 25 GB/s / 0.15 ms defaults; a RAM store refuses the measurement."""
    _, path = tiny_store
    model = build_tiny("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)
    seqs = zipf_traces(num_sequences=1, num_tokens=12, num_layers=4, num_experts=16, top_k=4, seed=1).sequences
    pol = _policy("seqmoe", model, seqs)
    disk = _GradedStore(path, base_s=0.01, step_s=0.0)  # each read takes >= 10 ms: far from 25 GB/s
    om = OffloadedModel(model, pol, 0.5, store=disk, readers=2)
    default_tau = pol.scheduler.estimator.tau
    fig = om.use_measured_link()
    model = om.restore()
    disk.close()
    assert fig["reads"] == 4 and fig["queue_depth"] == 2 and fig["layer_compute_ms"] > 0
    assert fig["bytes_per_s"] < 2 * om.layout.expert_bytes / 0.01  # two readers, >= 10 ms a read
    assert pol.link_bytes_per_s == fig["bytes_per_s"] and pol.layer_compute_ms == max(fig["layer_compute_ms"], 1e-3)
    want = om.layout.expert_bytes / fig["bytes_per_s"] * 1e3 / pol.layer_compute_ms
    assert pol.scheduler.estimator.tau == pytest.approx(want) and pol.scheduler.estimator.tau > default_tau
    om = OffloadedModel(model, _policy("seqmoe", model, seqs), 0.5)
    with pytest.raises(UsageError, match="disk store"):
        om.measure_link()
    om.close()


def test_disk_store_refuses_link_emulation_and_graph(tiny_store):
    _, path = tiny_store
    model = build_tiny("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)
    with pytest.raises(UsageError, match="link"):
        OffloadedModel(model, make_policy("lru"), 0.5, store=DiskExpertStore(path), link_gbps=1.0)
    with pytest.raises(UsageError, match="graph"):
        OffloadedModel(model, make_policy("lru"), 0.5, store=DiskExpertStore(path), decode_path="graph")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_disk_reads_equal_ram(tiny_store):
    """On CUDA the reader pool feeds pinned bounce buffers and copies to the device slots: the forced-routing
    logits equal the in-RAM (pinned store) run's and reads == counted loads."""
    _, path = tiny_store
    model = build_tiny("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)
    syn = zipf_traces(num_sequences=2, num_tokens=20, num_layers=4, num_experts=16, top_k=4, seed=3)
    om = OffloadedModel(model, make_policy("lru"), 0.25, device="cuda")
    _, ram = _logits_of(om, syn.sequences)
    model = om.restore().cpu()
    om = OffloadedModel(model, make_policy("lru"), 0.25, device="cuda", store=DiskExpertStore(path), readers=2)
    st, got = _logits_of(om, syn.sequences)
    om.close()
    for a, b in zip(got, ram, strict=True):
        assert torch.equal(a, b)
    assert st.reads == st.D + st.P > 0


@pytest.mark.parametrize("expert_dtype", ["bfloat16", "int8", "int4"])
def test_checkpoint_streams_to_disk_store_token_identical(expert_dtype, tmp_path):
    """A saved checkpoint loads straight to the disk store (``load_offloaded(store="disk")``): greedy tokens
    equal the full-load model's (of the same quantized model for int8/int4: every expert resident in its
    format), the experts are not in host RAM, the report names the I/O mode, the readers and the RSS bound,
    and every counted load is one read of the format's row."""
    from expertcast.inference.runtime.experts import quantize_model_experts
    from expertcast.inference.runtime.loading import RSS_MARGIN_BYTES, load_offloaded
    from expertcast.models.backbone import load_moe_model, save_tiny

    d = save_tiny("qwen3_moe-tiny", tmp_path / "ckpt", seed=1)
    q = expert_dtype != "bfloat16"
    full, _ = load_moe_model(d, dtype="bfloat16" if q else "auto")
    if q:
        quantize_model_experts(full, expert_dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (1, 9), generator=g)
    am = torch.ones_like(ids)
    ref = full.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    del full
    with pytest.raises(UsageError, match="disk_path"):
        load_offloaded(d, make_policy("lru"), 4, store="disk")
    om, _, report = load_offloaded(d, make_policy("lru"), 4, store="disk", disk_path=tmp_path / "x.safetensors",
                                   readers=3, expert_dtype=expert_dtype, **({"dtype": "bfloat16"} if q else {}))
    assert om.store.layout.fmt == expert_dtype
    out = om.generate(ids, am, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    st = om.stats
    assert st.D > 0 and st.reads == st.D + st.P
    r = report.to_dict()
    assert r["store_kind"] == "disk" and r["readers"] == 3 and r["disk_io_mode"] in (DIRECT, BUFFERED)
    assert r["rss_bound_bytes"] >= RSS_MARGIN_BYTES + report.plan.slot_bytes + report.plan.non_expert_bytes
    mem = om.memory_report()
    assert mem.host_expert_bytes == 0 and mem.store_kind == "disk"
    assert mem.disk_store_bytes == om.L * om.E * om.store.stride >= report.plan.expert_bytes_total
    om.close()


_RSS_CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.loading import load_offloaded, peak_rss_bytes, plan_offload
plan_offload(sys.argv[1], 4)  # the imports and a meta skeleton of the model before the baseline
before = peak_rss_bytes()
om, _, report = load_offloaded(sys.argv[1], make_policy("lru"), 4, store="disk", disk_path=sys.argv[2], readers=2)
ids = torch.randint(5, 200, (1, 6))
om.generate(ids, torch.ones_like(ids), max_new_tokens=6, eos_token_id=None, pad_token_id=0)
print("RESULT " + json.dumps({"before": before, "after": peak_rss_bytes(), "report": report.to_dict(),
                              "reads": om.stats.reads, "loads": om.stats.D + om.stats.P}))
"""


@pytest.mark.slow
def test_disk_store_load_holds_no_copy_of_the_experts(tmp_path, write_tiled_checkpoint):
    """A checkpoint with 0.8 GB of experts streamed to the disk store in a fresh process: from after the imports
    (and a meta skeleton built once), its peak RSS grows by at most non-expert weights + slots + one MoE layer's
    rows + 150 MB while loading and decoding (far below the experts' size: no copy of them was ever in RAM, nor
    the checkpoint's or the store's pages); the whole process stays within the reported bound."""
    import subprocess
    import sys

    d = tmp_path / "ckpt"
    write_tiled_checkpoint(d, hidden_size=256, moe_intermediate_size=512, intermediate_size=1024, num_experts=32,
                           num_experts_per_tok=4, num_hidden_layers=16)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(d), str(tmp_path / "x.safetensors")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT "))
    plan = r["report"]["plan"]
    experts = plan["expert_bytes_total"]
    layer = plan["num_experts"] * plan["expert_bytes"]
    allowed = plan["non_expert_bytes"] + plan["slot_bytes"] + layer + 150 * 2**20
    grew = r["after"] - r["before"]
    assert experts > 2 * allowed, (experts, allowed)
    assert grew <= allowed, (grew, allowed, experts)
    assert r["after"] <= r["report"]["rss_bound_bytes"]
    assert r["reads"] == r["loads"] > 0
