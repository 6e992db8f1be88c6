"""Expert formats (docs/design.md, "Expert formats"): quantize / dequantize error bounds, torch's int8/int4 CPU
kernels against the dequantized reference, the packings, quantized layouts (bytes per expert, slots a byte
budget buys), the kernel table, the FP8 block round trip, the one-line refusal of other quantization methods and
a quantized runtime's restore (FP8 checkpoints: test_quant_checkpoint.py)."""

from __future__ import annotations

import json

import pytest
import torch
from expertcast.inference.cache.expert_cache import Budget, CacheConfig
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime import quant
from expertcast.inference.runtime.quant import (
    ExpertFormat,
    KernelTable,
    QWeight,
    dequantize_fp8_blocks,
    kernel_available,
    native_int4_pack,
    pack_int4,
    quantize_fp8_blocks,
    unpack_int4,
)
from expertcast.inference.runtime.store import (
    ExpertLayout,
    ExpertPart,
    dequantize_row,
    quantize_rows,
    quantized_layout,
)
from expertcast.utils.errors import UsageError

torch.set_num_threads(1)


def _w(N=96, K=256, seed=0):
    return (torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)


def test_format_parse():
    assert ExpertFormat.parse("int4") == ExpertFormat("int4", 64)
    assert ExpertFormat.parse("int4-g32").name == "int4-g32" and ExpertFormat.parse("int4-g128").group_size == 128
    assert ExpertFormat.parse("int8") == ExpertFormat("int8", 0) and not ExpertFormat.parse("bfloat16").quantized
    assert ExpertFormat.parse("int8-g128").name == "int8-g128"
    for bad in ("int3", "int4-g16", "int4-g256", "bfloat16-g64", "int8-gx", "int8-g100"):
        with pytest.raises(UsageError, match="expert format"):
            ExpertFormat.parse(bad)


@pytest.mark.parametrize("spec", ["int8", "int8-g64", "int4", "int4-g32", "int4-g128"])
def test_round_trip_error_bound(spec):
    """Every dequantized weight is within half a quantization step of the original (+ the bf16 rounding of
    the stored zero and of the dequantized value)."""
    fmt = ExpertFormat.parse(spec)
    w = _w()
    N, K = w.shape
    qw = QWeight.from_float(w, fmt)
    d = qw.dequantize(torch.float32)
    err = (d - w.float()).abs()
    g = fmt.group_for(K) or K
    if fmt.kind == "int8":
        step = (qw.s.float().view(N, -1, 1).expand(N, K // g, g)).reshape(N, K)
        assert (err <= step / 2 + 1e-6).all()
        assert quant.relative_error(w, d) < 0.01
    else:
        sz = qw.s.float()  # [K/g, N, 2]
        step = sz[..., 0].t().repeat_interleave(g, 1)
        zero = sz[..., 1].t().repeat_interleave(g, 1)
        assert (err <= step / 2 + zero.abs() * 2 ** -8 + 1e-6).all()
        assert quant.relative_error(w, d) < 0.12
    # more bits, less error
    if spec == "int4-g32":
        assert quant.relative_error(w, d) < quant.relative_error(w, QWeight.from_float(w, ExpertFormat.parse("int4-g128")).dequantize())


@pytest.mark.parametrize("spec", ["int8", "int4", "int4-g32", "int4-g128"])
@pytest.mark.parametrize("n", [1, 5, 64])
def test_kernel_equals_dequantized_reference(spec, n):
    """torch's weight-only kernel gives the dequantized bf16 GEMM's result to bf16 rounding."""
    fmt = ExpertFormat.parse(spec)
    w = _w(N=192, K=256, seed=1)
    qw = QWeight.from_float(w, fmt)
    x = torch.randn(n, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = x.float() @ qw.dequantize(torch.float32).t()
    assert kernel_available(fmt, x, qw.pack)
    got = qw.mm(x, choice="kernel")
    assert got.shape == (n, 192) and got.dtype == torch.bfloat16
    assert quant.relative_error(ref, got) < 1e-2
    assert quant.relative_error(ref, qw.mm(x, choice="dequant")) < 1e-2
    out = torch.empty(n, 192, dtype=torch.bfloat16)
    assert qw.mm(x, out=out, choice="kernel") is out and torch.equal(out, got)


def test_no_kernel_for_float32_or_int8_groups():
    x32 = torch.randn(2, 256)
    assert not kernel_available(ExpertFormat.parse("int4"), x32, native_int4_pack())
    assert not kernel_available(ExpertFormat.parse("int8-g64"), x32.bfloat16(), "")
    assert not kernel_available(ExpertFormat.parse("int4"), x32.bfloat16(), "nibble")
    qw = QWeight.from_float(_w().float(), ExpertFormat.parse("int4"))
    assert quant.relative_error(x32[:, :256] @ _w().float().t(), qw.mm(x32)) < 0.15  # dequantize path in fp32


def test_packing_layout():
    """``nibble``: byte k//2 of row n holds q[n, 2j] in its low and q[n, 2j+1] in its high half; the CPU
    kernel's packing is a permutation of the same nibbles (learned per shape) and unpacks exactly."""
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]], dtype=torch.int32)
    p = pack_int4(q, "nibble")
    assert p.dtype == torch.uint8 and p.tolist() == [[0x21, 0x0F], [0x87, 0xA9]]
    assert torch.equal(unpack_int4(p, 2, 4, "nibble").int(), q)
    big = torch.randint(0, 16, (128, 192), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    native = native_int4_pack()
    kp = pack_int4(big, native)
    assert kp.shape == (128, 96) and kp.dtype == torch.uint8
    assert torch.equal(unpack_int4(kp, 128, 192, native).int(), big)
    assert sorted(torch.stack([kp & 15, kp >> 4], -1).reshape(-1).tolist()) == sorted(big.reshape(-1).tolist())
    with pytest.raises(UsageError, match="cannot be read here"):
        unpack_int4(kp, 128, 192, "aten-cpu-OTHER")


def _base(H=2048, I=1408, E=64, transposed=False):  # noqa: E741 - the DeepSeek-V2-Lite expert by default
    gu, dn = ((H, 2 * I), (I, H)) if transposed else ((2 * I, H), (H, I))
    parts = (ExpertPart("gate_up_proj", gu, 0), ExpertPart("down_proj", dn, 2 * I * H))
    return ExpertLayout(parts, torch.bfloat16, E, transposed, True, False)


def test_bytes_per_expert_and_slots_for_a_byte_budget():
    """At the DeepSeek-V2-Lite shape: bf16 17.3 MB, int8 about half, int4 (group 64) >= 3.5x fewer bytes, so a
    byte budget holds >= 3.5x the experts."""
    base = _base()
    H, I = 2048, 1408  # noqa: E741
    assert base.expert_bytes == 3 * H * I * 2 == 17_301_504
    i8, i4 = quantized_layout(base, "int8"), quantized_layout(base, "int4")
    assert 3 * H * I <= i8.expert_bytes <= 3 * H * I + 2 * (2 * I + H) + 4 * 64
    q4 = 3 * H * I // 2
    sz = (H // 64) * 2 * I * 4 + (I // 64) * H * 4
    assert q4 + sz <= i4.expert_bytes <= q4 + sz + 4 * 64
    budget = 25 * base.expert_bytes

    def slots_for_bytes(n: int, expert_bytes: int, num_layers: int = 4, pool: str = "per-layer") -> int:
        """The slots the cache resolves a byte budget to (``Budget.bytes``, the one byte-budget rule)."""
        cfg = CacheConfig(num_layers=num_layers, num_experts=256, top_k=6, pool=pool, budget=Budget.bytes(n),
                          expert_bytes=expert_bytes)
        return cfg.total_slots if pool == "shared" else cfg.total_slots // num_layers

    assert slots_for_bytes(budget, base.expert_bytes, pool="shared") == 25
    assert slots_for_bytes(budget, i4.expert_bytes, pool="shared") >= 3.5 * 25
    assert slots_for_bytes(budget, i8.expert_bytes, pool="shared") >= 1.9 * 25
    assert slots_for_bytes(10 * budget, i4.expert_bytes, num_layers=4) == int(10 * budget // i4.expert_bytes) // 4
    with pytest.raises(UsageError, match="positive"):
        slots_for_bytes(0, 100)
    assert quantized_layout(base, "bfloat16") is base


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_quantized_rows_round_trip_through_the_layout(spec, transposed):
    base = _base(H=128, I=64, E=3, transposed=transposed)
    lay = quantized_layout(base, spec)
    assert ExpertLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay
    assert lay.dtype == torch.uint8 and lay.act_dtype == torch.bfloat16
    assert all(p.offset % quant.PART_ALIGN == 0 for p in lay.parts)
    src = (torch.randn(3, base.row_numel, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    dst = torch.empty(3, lay.row_numel, dtype=torch.uint8)
    quantize_rows(lay, src, dst)
    back = dequantize_row(lay, dst[1])
    assert back.shape == (base.row_numel,) and quant.relative_error(src[1], back) < (0.01 if spec == "int8" else 0.12)
    v = lay.views(dst[1])
    gu = v["gate_up_proj"]
    assert isinstance(gu, QWeight) and (gu.N, gu.K) == (128, 128)  # gate_up: N = 2I, K = H either way
    x = torch.randn(2, 128).to(torch.bfloat16)
    W = base.views(src[1])["gate_up_proj"]
    ref = x.float() @ (W.float() if transposed else W.float().t())
    assert quant.relative_error(ref, gu.mm(x)) < (0.02 if spec == "int8" else 0.15)


def test_kernel_table_measures_once_and_records_the_kernel():
    t = KernelTable("auto")
    qw = QWeight.from_float(_w(N=64, K=128), ExpertFormat.parse("int4"))
    x = torch.randn(3, 128).to(torch.bfloat16)
    c = t.choose(qw, x)
    assert c in ("kernel", "dequant")
    rows = t.to_list()
    assert [r["tokens"] for r in rows] == [1, 64]
    assert all(r["kernel_ms"] > 0 and r["dequant_ms"] > 0 and r["kernel"] for r in rows)
    assert t.choose(qw, x) == c and len(t.to_list()) == 2  # fixed once measured
    assert KernelTable("dequant").choose(qw, x) == "dequant" and KernelTable("kernel").choose(qw, x) == "kernel"
    assert KernelTable("kernel").choose(qw, x.float()) == "dequant"  # no kernel for float32 activations
    with pytest.raises(UsageError, match="kernel mode"):
        KernelTable("fast")


def test_fp8_block_round_trip():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0)) * 0.03
    q, s = quantize_fp8_blocks(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3) and s.dtype == torch.float32
    d = dequantize_fp8_blocks(q, s, (128, 128))
    assert ((d - w).abs() <= w.abs() * 2 ** -4 + s.amax() * 2 ** -9).all()  # e4m3: 3 mantissa bits
    with pytest.raises(UsageError, match="scale blocks"):
        dequantize_fp8_blocks(q, s[:, :2], (128, 128))


def test_unsupported_quantization_is_one_line_naming_the_method(tmp_path):
    from expertcast.inference.runtime.loading import load_offloaded, plan_offload
    from expertcast.models.backbone import save_tiny

    d = save_tiny("qwen3_moe-tiny", tmp_path / "m", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    for qc, name in [({"quant_method": "gptq", "bits": 4}, "'gptq'"), ({"quant_method": "fp8"}, "'fp8' without")]:
        cfg["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UsageError, match=f"quantization method {name}") as e:
            plan_offload(d, 0.5)
        assert "\n" not in str(e.value)
        with pytest.raises(UsageError, match=name):
            load_offloaded(d, make_policy("lru"), 0.5)


def test_restore_of_a_quantized_runtime_gives_the_dequantized_weights():
    """``OffloadedModel.restore()`` of an int4 runtime puts back the experts' dequantized weights (full load of
    the quantized model's values), and the quantized graph decode path is refused."""
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.inference.runtime.store import HostExpertStore
    from expertcast.models.presets import build_tiny

    model = build_tiny("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)
    store = HostExpertStore.from_model(model, fmt="int4")
    with pytest.raises(UsageError, match="graph"):
        OffloadedModel(model, make_policy("lru"), 4, store=store, decode_path="graph")
    om = OffloadedModel(model, make_policy("lru"), 4, store=store)
    assert om.memory_report().expert_bytes == store.layout.expert_bytes < store.layout.base.expert_bytes / 3
    restored = om.restore()
    mod = restored.model.layers[0].mlp.experts
    want = dequantize_row(store.layout, store.rows[0, 5])
    b = store.layout.base.parts
    assert torch.equal(mod.gate_up_proj[5].reshape(-1), want[b[0].offset:b[0].offset + b[0].numel])
    assert torch.equal(mod.down_proj[5].reshape(-1), want[b[1].offset:b[1].offset + b[1].numel])
