"""Replay speed of the simulator on a Qwen3-30B-A3B-shaped trace (48 layers, 128 experts, top-8).

Prints accesses per second (an access = one selected expert at one layer at one step; prefill
accesses included, they are replayed too) for each policy on the compiled engine, measured in CPU time
of this single-threaded process (``accesses_per_s``; the wall-clock rate is printed beside it, lower
when other jobs share the core), and two baselines measured in the same run on the same machine:
* ``numpy pass``: one vectorized pass over the trace (``np.bincount`` of the (layer, expert) ids), a
  floor on what any replay costs;
* ``python engine``: the generic Python driver (every policy hook, cost-model clock) on a slice of the
  trace.
Ratios are kernel rate / baseline rate. Single-threaded: run as is (it pins BLAS/numba to one thread).

    python scripts/bench_simulator.py [--steps 20000] [--capacity 0.25] [--pool per-layer|shared]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402
from expertcast.data.synthetic import markov_traces, zipf_popularity  # noqa: E402
from expertcast.inference.cache.expert_cache import Budget, CacheConfig  # noqa: E402
from expertcast.inference.policies import make_policy  # noqa: E402
from expertcast.inference.sim.simulator import build_stream, replay, replay_kernel  # noqa: E402
from expertcast.utils.io import report  # noqa: E402


def qwen_like_traces(steps: int, seqs: int, seed: int = 0):
    """Markov traces with Zipf-skewed transition rows: 48 layers, 128 experts, top-8."""
    L, E, K = 48, 128, 8
    rng = np.random.default_rng(seed)
    pop = zipf_popularity(L, E, 1.0, rng)  # [L, E]
    conc = rng.dirichlet(np.full(E, 0.2), size=(L, E))
    P = 0.5 * conc + 0.5 * pop[:, None, :]
    P /= P.sum(-1, keepdims=True)
    per = steps // seqs
    return markov_traces(num_sequences=seqs, num_tokens=per + 16, num_layers=L, num_experts=E, top_k=K,
                         transition=P, prompt_len=16, seed=seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000, help="decode steps in all (>= 20000 for the target)")
    ap.add_argument("--sequences", type=int, default=20)
    ap.add_argument("--capacity", type=float, default=0.25)
    ap.add_argument("--pool", default="per-layer", choices=["per-layer", "shared"])
    ap.add_argument("--policies", default="lru,fifo,lfu,lrfu,belady,belady-k,belady-seq")
    ap.add_argument("--python-steps", type=int, default=300, help="steps replayed by the Python baseline")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.json:  # a new file, or this script's earlier figures only
        from expertcast.utils.outdir import claim_output_file

        args.json = claim_output_file(args.json, "--json", "bench_simulator --json")

    t0 = time.perf_counter()
    tr = qwen_like_traces(args.steps, args.sequences)
    stream = build_stream(tr.meta, tr.sequences)
    gen_s = time.perf_counter() - t0
    A = len(stream.experts)
    print(f"trace: {len(tr.sequences)} sequences, {stream.num_steps} steps "
          f"({int(stream.step_counted.sum())} decode), {A:,} accesses; built in {gen_s:.1f}s")
    cfg = CacheConfig(48, 128, 8, pool=args.pool, budget=Budget.fraction(args.capacity), expert_bytes=tr.meta.expert_bytes)
    print(f"cache: {cfg.describe()}")

    # warm the JIT on a tiny stream so compile time is not measured
    small = build_stream(tr.meta, [tr.sequences[0]])
    for name in args.policies.split(","):
        replay_kernel(small, make_policy(name), cfg)
    _ = stream.next_exec, stream.next_access

    t = time.process_time()
    ids = (np.arange(stream.num_execs, dtype=np.int64) % 48).repeat(np.diff(stream.exec_ptr)) * 128 + stream.experts
    np.bincount(ids, minlength=48 * 128)
    numpy_rate = A / (time.process_time() - t)

    sub = build_stream(tr.meta, [tr.sequences[0]])
    n_py = min(args.python_steps, sub.num_steps)
    sub.step_counted[:] = True
    sub.exec_ptr = sub.exec_ptr[: n_py * 48 + 1]
    sub.step_counted = sub.step_counted[:n_py]
    sub.step_tokens = sub.step_tokens[:n_py]
    sub.step_batch = sub.step_batch[:n_py]
    sub.experts = sub.experts[: sub.exec_ptr[-1]]
    sub.counts = sub.counts[: sub.exec_ptr[-1]]
    t = time.process_time()
    replay(sub, make_policy("lru"), cfg)
    python_rate = len(sub.experts) / (time.process_time() - t)

    rows = []
    for name in args.policies.split(","):
        pol = make_policy(name)
        c0 = time.process_time()
        res = replay_kernel(stream, pol, cfg)
        cpu = time.process_time() - c0
        rate = A / cpu
        rows.append({"policy": pol.label, "hit": res.hit, "cpu_s": cpu, "accesses_per_s": rate,
                     "wall_accesses_per_s": A / res.seconds, "x_numpy_pass": rate / numpy_rate,
                     "x_python_engine": rate / python_rate})
    rows.append({"policy": "baseline: numpy pass", "accesses_per_s": numpy_rate})
    rows.append({"policy": "baseline: python engine (lru)", "accesses_per_s": python_rate})
    report(rows, title=f"simulator replay speed, one core ({A:,} accesses, {cfg.describe()})", json_path=args.json)
    lru = next(r for r in rows if r["policy"] == "lru")["accesses_per_s"]
    bel = next((r for r in rows if r["policy"] == "belady"), {"accesses_per_s": float("nan")})["accesses_per_s"]
    per_seq = 1000 * 48 * 8
    print(f"targets: LRU {lru / 1e6:.2f}M/s (>= 2M), Belady {bel / 1e6:.2f}M/s (>= 1M); 600 x 1000-token "
          f"sequences ({600 * per_seq:,} accesses) replay in ~{600 * per_seq / lru:.0f}s (LRU), "
          f"~{600 * per_seq / bel:.0f}s (Belady)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
