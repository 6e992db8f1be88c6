"""The calibrated kernel table of the expert formats (docs/results.md, "Quantized experts").

Per projection shape and token count (1 and 64): the least ms (of --repeats runs: the one least disturbed on a shared machine) of the bf16 GEMM (``torch.mm``), of torch's
weight-only kernel for the format (``aten::_weight_int8pack_mm``, ``aten::_weight_int4pack_mm_for_cpu``) and of
dequantize + bf16 GEMM, and the path the runtime picks (the faster: ``choice``). Shapes: DeepSeek-V2-Lite's
expert (gate_up [2816, 2048], down [2048, 1408]) and the default model's (gate_up [256, 128], down [128, 128]).
Which kernel the bf16 GEMM ran is read from oneDNN's verbose log (``ONEDNN_VERBOSE=1`` in a child process);
the int kernels are aten's own CPU kernels (no oneDNN primitive: nothing in that log).

    python scripts/quant_kernels.py --out outputs/quant_kernels [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SHAPES = {"deepseek-v2-lite gate_up": (2816, 2048), "deepseek-v2-lite down": (2048, 1408),
          "tiny-default gate_up": (256, 128), "tiny-default down": (128, 128)}

_VERBOSE_CHILD = r"""
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
for n, (N, K) in [(1, (2816, 2048)), (64, (2816, 2048))]:
    x = torch.randn(n, K).to(torch.bfloat16); w = torch.randn(N, K).to(torch.bfloat16)
    for _ in range(2):
        torch.mm(x, w.t())
    print("MARK", n, flush=True)
"""


def onednn_kernels(threads: int) -> list[str]:
    """oneDNN verbose lines of the bf16 expert GEMM (``exec`` lines: primitive, implementation, shapes)."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    p = subprocess.run([sys.executable, "-c", _VERBOSE_CHILD, str(threads)], capture_output=True, text=True, env=env,
                       timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("onednn_verbose") and ",exec," in ln]
    return sorted(set(",".join(ln.split(",")[3:-1]) for ln in lines)) or ["(no oneDNN primitive ran: aten's own GEMM)"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8,int4,int4-g32,int4-g128")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="outputs/quant_kernels")
    args = ap.parse_args(argv)
    import torch
    from expertcast.inference.runtime.quant import calibrate, native_int4_pack

    torch.set_num_threads(args.threads)
    rows = []
    for name, shape in SHAPES.items():
        for r in calibrate([shape], args.formats.split(","), repeats=args.repeats):
            rows.append({"shape": name, **r})
            print(json.dumps(rows[-1]), flush=True)
    verbose = onednn_kernels(args.threads)
    lines = ["| shape | format | tokens | bf16 mm ms | int kernel ms | dequant+mm ms | picked |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        kern = f"{r['kernel_ms']:.3f}" if "kernel_ms" in r else "n/a"
        lines.append(f"| {r['shape']} [{r['N']}, {r['K']}] | {r['format']} | {r['tokens']} | {r['bf16_mm_ms']:.3f} | {kern} | "
                     f"{r['dequant_ms']:.3f} | {r['kernel']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "kernels.json").write_text(json.dumps({
        "rows": rows, "bf16_onednn_verbose": verbose, "int4_pack": native_int4_pack(), "threads": args.threads,
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "argv": sys.argv[1:]}, indent=2))
    print("\n".join(lines))
    print("bf16 GEMM (oneDNN verbose):")
    for v in verbose:
        print("  " + v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
