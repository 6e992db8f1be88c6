"""The disk tier's benchmark: disk, RAM and GEMM figures, then every policy's forced-routing replay through the
disk store per RAM budget, in one run (a thin wrapper over :mod:`expertcast.recipes.bench_disk`;
docs/design.md, "Disk tier").

    python scripts/bench_disk.py --out runs/bench_disk [--quick] [--hidden 2048 --moe-intermediate 1408
        --experts 64 --top-k 6 --layers 4] [--policies lru lfu static] [--budgets 0.10 0.25 0.45]
        [--readers 4] [--traces DIR] [--forecaster EXPORT] [--baseline-model DIR] [--disk-mb 1024]

Put ``--out`` on the disk being measured (not tmpfs: the run then says ``buffered+dontneed``).
"""

from __future__ import annotations

import argparse
import os
import sys

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

from expertcast.recipes.bench_disk import BenchConfig, quick_config, run_bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    d = BenchConfig(out="runs/bench_disk")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=d.out)
    ap.add_argument("--quick", action="store_true", help="a tiny shape that runs in seconds")
    for name in ("hidden", "moe_intermediate", "experts", "top_k", "layers", "readers", "repeats", "sequences",
                 "tokens", "prompt", "disk_mb", "threads", "seed", "full_repeats", "calib_sequences"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--policies", nargs="+", default=list(d.policies))
    ap.add_argument("--budgets", nargs="+", type=float, default=list(d.budgets))
    ap.add_argument("--model", default=None, help="benchmark this model (preset, tiny-default, local dir) instead of "
                    "a random-weight Qwen3-MoE of --hidden/--experts/... shape")
    ap.add_argument("--traces", default=None, help="recorded traces of the model's shape (default: synthetic)")
    ap.add_argument("--forecaster", default=None, help="forecaster export: adds seqmoe")
    ap.add_argument("--baseline-model", default=None,
                    help="a build-shape --layers N subset of --model (same shape and seed) when the model's experts "
                         "do not fit RAM: every policy also runs on it, paired against its all-in-RAM run")
    ap.add_argument("--seq-ids", nargs="+", default=[], help="replay these sequences of --traces (e.g. held-out ids "
                    "of the forecaster's export)")
    a = ap.parse_args(argv)
    if a.quick:
        cfg = quick_config(a.out)
        cfg.policies = tuple(a.policies)
        cfg.traces, cfg.forecaster, cfg.model = a.traces, a.forecaster, a.model
    else:
        cfg = BenchConfig(**{k: v for k, v in vars(a).items() if k != "quick"})
        cfg.policies, cfg.budgets, cfg.seq_ids = tuple(a.policies), tuple(a.budgets), tuple(a.seq_ids)
    for b in cfg.budgets:
        if not 0 < b <= 1:
            raise SystemExit(f"--budgets: {b} is not a fraction in (0, 1]")
    from expertcast.inference.sim.simulator import build_stream

    run_bench(cfg, stream=build_stream)  # oracles (belady) read the replayed access stream
    return 0


if __name__ == "__main__":
    sys.exit(main())
