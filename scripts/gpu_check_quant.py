"""GPU check of the expert formats (docs/design.md, "Expert formats"); one ``PASS|FAIL|SKIP name figure`` line each.

- ``quant-identity``: qwen3_moe-tiny in bf16, experts offloaded as int8 and int4 on the device: greedy tokens equal
  the full-load quantized model's (every expert resident in its format; on CUDA the formats dequantize).
- ``quant-int4-cuda``: torch's CUDA int4 kernel (``aten::_weight_int4pack_mm``, tinygemm) at the DeepSeek-V2-Lite
  expert projections, packed from the store's int4 values (``_convert_weight_to_int4pack``): equal to the
  dequantized bf16 GEMM to bf16 rounding, and its ms vs bf16 ``torch.mm`` at 1 and 64 tokens.
- ``quant-fp8-scaled-mm``: FP8 ``torch._scaled_mm`` (e4m3, row-wise scales) at the same shapes: relative error
  vs bf16 and ms vs bf16 at 16 and 64 tokens.

    python scripts/gpu_check_quant.py [--dry-run]     # --dry-run: CPU, tiny sizes, the CUDA kernels skipped
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(2816, 2048), (2048, 1408)]  # DeepSeek-V2-Lite expert: gate_up [2I, H], down [H, I]


def line(ok: bool | None, name: str, figure: str) -> int:
    print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {name} {figure}", flush=True)
    return 0 if ok is not False else 1


def _ms(fn, dev: torch.device, repeats: int = 20) -> float:
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return 1e3 * (time.perf_counter() - t0) / repeats


def identity(dev: torch.device) -> int:
    from expertcast.inference.policies import make_policy
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.inference.runtime.experts import quantize_model_experts
    from expertcast.inference.runtime.store import HostExpertStore
    from expertcast.models.presets import build_tiny

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (2, 9), generator=g).to(dev)
    am = torch.ones_like(ids)
    bad = []
    for fmt in ("int8", "int4"):
        full = quantize_model_experts(build_tiny("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16).to(dev), fmt)
        ref = full.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        model = build_tiny("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)
        store = HostExpertStore.from_model(model, pin_memory=dev.type == "cuda", fmt=fmt)
        om = OffloadedModel(model, make_policy("lru"), 4, device=dev, store=store)
        out = om.generate(ids, am, max_new_tokens=8, eos_token_id=None, pad_token_id=0).sequences
        om.close()
        if not torch.equal(out.cpu(), ref.cpu()):
            bad.append(fmt)
    return line(not bad, "quant-identity", f"int8+int4 offloaded == full-load quantized on {dev.type}"
                + (f" (differs: {bad})" if bad else ""))


def int4_cuda(dev: torch.device) -> int:
    from expertcast.inference.runtime.quant import ExpertFormat, QWeight, relative_error, unpack_int4

    if dev.type != "cuda":
        return line(None, "quant-int4-cuda", "dry-run: no CUDA")
    figs, ok = [], True
    for N, K in SHAPES:
        w = (torch.randn(N, K) * 0.02).to(torch.bfloat16)
        qw = QWeight.from_float(w, ExpertFormat.parse("int4"))
        v = unpack_int4(qw.q, N, K, qw.pack)  # [N, K] values 0..15
        packed_u8 = ((v[:, 0::2] << 4) | v[:, 1::2]).to(torch.uint8).to(dev)  # CUDA packing input: even k high
        wq = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
        sz = qw.s.to(dev)
        wd = qw.dequantize(torch.bfloat16).to(dev)
        for n in (1, 64):
            x = torch.randn(n, K, device=dev, dtype=torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm(x, wq, 64, sz)
            err = relative_error(x.float() @ wd.float().t(), y)
            ok &= err < 1e-2
            t4 = _ms(lambda x=x, wq=wq, sz=sz: torch.ops.aten._weight_int4pack_mm(x, wq, 64, sz), dev)
            tb = _ms(lambda x=x, wd=wd: torch.mm(x, wd.t()), dev)
            figs.append(f"[{N},{K}]x{n}: int4 {t4:.3f} ms vs bf16 {tb:.3f} ms, rel.err {err:.1e}")
    return line(ok, "quant-int4-cuda", "; ".join(figs))


def fp8_scaled_mm(dev: torch.device) -> int:
    from expertcast.inference.runtime.quant import relative_error

    if dev.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return line(None, "quant-fp8-scaled-mm", "dry-run: no CUDA")
    figs, ok = [], True
    for N, K in SHAPES:
        w = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
        sw = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0  # [N, 1] row-wise
        w8 = (w.float() / sw).to(torch.float8_e4m3fn)
        for n in (16, 64):
            x = torch.randn(n, K, device=dev, dtype=torch.bfloat16)
            sx = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
            x8 = (x.float() / sx).to(torch.float8_e4m3fn)

            def run(x8=x8, sx=sx, w8=w8, sw=sw):
                return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)

            err = relative_error(x.float() @ w.float().t(), run())
            ok &= err < 0.1
            figs.append(f"[{N},{K}]x{n}: fp8 {_ms(run, dev):.3f} ms vs bf16 {_ms(lambda x=x, w=w: torch.mm(x, w.t()), dev):.3f} ms, "
                        f"rel.err {err:.3f}")
    return line(ok, "quant-fp8-scaled-mm", "; ".join(figs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    dev = torch.device("cpu" if a.dry_run or not torch.cuda.is_available() else "cuda")
    if not a.dry_run and dev.type != "cuda":
        return line(False, "quant", "no CUDA device (use --dry-run)")
    rc = 0
    for step in (identity, int4_cuda, fp8_scaled_mm):
        try:
            rc |= step(dev)
        except Exception as e:  # noqa: BLE001 - one line per check
            rc |= line(False, step.__name__, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
