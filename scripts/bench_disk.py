"""The disk tier's benchmark: disk, RAM and GEMM figures, then every policy's forced-routing replay through the
disk store per RAM budget, in one run (a thin wrapper over :mod:`expertcast.recipes.bench_disk`;
docs/design.md, "Disk tier").

    python scripts/bench_disk.py --out runs/bench_disk [--quick] [--hidden 2048 --moe-intermediate 1408
        --experts 64 --top-k 6 --layers 4] [--policies lru lfu static] [--budgets 0.10 0.25 0.45]
        [--readers 4] [--traces DIR] [--forecaster EXPORT] [--baseline-model DIR] [--disk-mb 1024]
        [--recall 1.0,0.9,0.7,0.5] [--expert-dtype bfloat16,int8,int4] [--equal-bytes] [--trace-timeline FILE]

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
    ap.add_argument("--recall", default="", help="oracle forecast recalls, comma-separated (seqmoe:forecast=oracle,"
                    "recall=R, break-even on and off, per budget)")
    ap.add_argument("--expert-dtype", default="bfloat16", help="expert formats, comma-separated (bfloat16,int8,int4)")
    ap.add_argument("--equal-bytes", action="store_true", help="quantized formats also at each budget's bf16 bytes")
    ap.add_argument("--disk-seconds", type=float, default=d.disk_seconds,
                    help="the disk measurement reads for at least this long")
    ap.add_argument("--trace-timeline", default=None, help="write one pass's per-layer timeline (JSON) here")
    ap.add_argument("--timeline-budget", type=float, default=None, help="the budget of the timeline's pass (default: "
                    "the first of --budgets)")
    ap.add_argument("--allow-overlap", action="store_true",
                    help="replay sequences the forecaster was fitted on (reported)")
    ap.add_argument("--allow-model-mismatch", action="store_true",
                    help="replay another model's routing with the forecaster (reported)")
    ap.add_argument("--truncate-trace", action="store_true",
                    help="replay the first L layers of --traces with more MoE layers than the model")
    ap.add_argument("--seq-ids", nargs="+", default=[], help="replay these sequences of --traces (e.g. held-out ids "
                    "of the forecaster's export)")
    a = ap.parse_args(argv)
    try:
        recall = tuple(float(x) for x in a.recall.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"--recall: {a.recall!r} is not a comma-separated list of numbers") from None
    dtypes = tuple(x.strip() for x in a.expert_dtype.split(",") if x.strip())
    common = dict(recall=recall, expert_dtypes=dtypes, equal_bytes=a.equal_bytes, trace_timeline=a.trace_timeline,
                  timeline_budget=a.timeline_budget,
                  allow_overlap=a.allow_overlap, allow_model_mismatch=a.allow_model_mismatch,
                  truncate_trace=a.truncate_trace)
    if a.quick:
        cfg = quick_config(a.out)
        cfg.policies = tuple(a.policies)
        cfg.traces, cfg.forecaster, cfg.model = a.traces, a.forecaster, a.model
        for k, v in common.items():
            setattr(cfg, k, v)
    else:
        skip = {"quick", "recall", "expert_dtype", "equal_bytes", "trace_timeline", "timeline_budget", "allow_overlap",
                "allow_model_mismatch", "truncate_trace"}
        cfg = BenchConfig(**{k: v for k, v in vars(a).items() if k not in skip}, **common)
        cfg.policies, cfg.budgets, cfg.seq_ids = tuple(a.policies), tuple(a.budgets), tuple(a.seq_ids)
    if cfg.trace_timeline and cfg.timeline_budget is not None and \
            not any(abs(b - cfg.timeline_budget) < 1e-9 for b in cfg.budgets):
        raise SystemExit(f"--timeline-budget {cfg.timeline_budget:g} is not one of --budgets")
    for b in cfg.budgets:
        if not 0 < b <= 1:
            raise SystemExit(f"--budgets: {b} is not a fraction in (0, 1]")
    from expertcast.inference.runtime.quant import ExpertFormat
    from expertcast.inference.sim.simulator import build_stream
    from expertcast.utils.errors import UsageError

    try:
        for f in cfg.expert_dtypes:
            ExpertFormat.parse(f)
        run_bench(cfg, stream=build_stream)
    except UsageError as e:
        raise SystemExit(f"bench_disk: {' '.join(str(e).split())}") from None  # oracles (belady) read the replayed access stream
    return 0


if __name__ == "__main__":
    sys.exit(main())
