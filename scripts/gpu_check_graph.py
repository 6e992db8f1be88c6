"""The graph decode path's step of ``scripts/gpu_check.sh`` (docs/design.md, "Graph-compatible decode path"): one
line per check, ``PASS|FAIL|SKIP name figure``; exit status 1 when a check failed.

1. ``graph-tokens``: greedy tokens of the graph path equal the full-load model's (lru and seqmoe; two families);
2. ``cuda-graph-replay``: the MoE part of a decode step captured in one CUDA Graph, replayed on new routing with
   the outputs, counters and residency of the uncaptured step (``--dry-run``: the uncaptured step run twice from
   the same state on the CPU, no capture), and the replay's host time (launch) and step time per MoE layer;
3. ``overhead``: ``bench_runtime.py --overhead --device cpu``: host time per MoE layer on the CPU (the issue's
   target), eager vs graph path with its layer function compiled by AOTInductor (target: graph <= 1/5 of eager
   and < 30 us); the per-layer host time of the CUDA path is the graph replay's launch, in step 2;
4. ``pct-full``: ``bench_runtime.py`` on the real-shape Qwen3-30B-A3B layer (random weights, as many layers as
   ``--layers``) at 25% and 45% residency, lru, eager vs graph path (% of full-load tokens/s).

``--dry-run`` runs every step on the CPU with tiny sizes and one family (the graph path then falls back to the
eager one in step 4, under the CPU link emulation, and says so; the overhead figure is not judged).

    python scripts/gpu_check_graph.py [--dry-run] [--out DIR] [--layers 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from expertcast.inference.cache.counters import COUNTER_NAMES
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.checks import check_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.models.presets import build_tiny

BENCH = Path(__file__).resolve().parent / "bench_runtime.py"


def line(ok: bool | None, name: str, figure: str) -> bool:
    print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {name} {figure}", flush=True)
    return ok is not False


def check_tokens(dev: torch.device, dry_run: bool) -> bool:
    ok, figs = True, []
    for preset in ("qwen3_moe-tiny",) if dry_run else ("qwen3_moe-tiny", "gpt_oss-tiny"):
        for name in ("lru", "seqmoe"):
            model = build_tiny(preset, seed=0).to(dev)
            ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(1)).to(dev)
            am = torch.ones_like(ids)
            ref = model.generate(ids, attention_mask=am, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            om = OffloadedModel(model, check_policy(name, model), 6, device=dev, decode_path="graph")
            try:
                out = om.generate(ids, am, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
                same = torch.equal(out.sequences, ref)
                figs.append(f"{preset}/{name}:{'equal' if same else 'DIFFER'}(hit {om.stats.hit:.2f})")
                ok &= same
            finally:
                om.restore()
    return line(ok, "graph-tokens", " ".join(figs))


def check_graph_replay(dev: torch.device, dry_run: bool) -> bool:
    model = build_tiny("qwen3_moe-tiny", seed=0).to(dev)
    om = OffloadedModel(model, make_policy("lru"), 6, device=dev, decode_path="graph")
    gd, L, E, K, H = om.graph, om.L, om.E, om.K, model.config.hidden_size
    h, w = torch.zeros(L, 1, H, device=dev), torch.zeros(L, 1, K, device=dev)
    idx = torch.zeros(L, 1, K, dtype=torch.long, device=dev)
    out = torch.zeros(L, 1, H, device=dev)
    gen = torch.Generator().manual_seed(0)
    fields = [f.name for f in dataclasses.fields(gd.state)]

    def step() -> None:
        for layer in range(L):
            out[layer].copy_(gd.run_layer(gd.layer_ids[layer], h[layer], idx[layer], w[layer]))

    def snap() -> dict:
        return {k: getattr(gd.state, k).clone() for k in fields}

    def restore(s: dict) -> None:
        for k, v in s.items():
            getattr(gd.state, k).copy_(v)

    def new_inputs() -> None:
        h.copy_(torch.randn(L, 1, H, generator=gen))
        idx.copy_(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(L)])[:, None])
        w.copy_(torch.rand(L, 1, K, generator=gen))

    try:
        new_inputs()
        replay = step
        if not dry_run:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
                step()
            torch.cuda.current_stream().wait_stream(side)
            s0 = snap()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            restore(s0)
            replay = graph.replay
        equal, steps = True, 3 if dry_run else 8
        for _ in range(steps):
            new_inputs()
            before = snap()
            step()
            want, want_state = out.clone(), snap()
            restore(before)
            replay()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            equal &= torch.equal(out, want) and all(torch.equal(v, want_state[k]) for k, v in snap().items())
        loads = int(gd.state.counters[COUNTER_NAMES.index("demand")].sum())
        host_us, step_us = _time_replay(replay, dev, L)
    finally:
        om.restore()
    what = "uncaptured step rerun (dry run)" if dry_run else "one CUDA Graph of all layers"
    return line(equal and loads > 0, "cuda-graph-replay",
                f"{what}: {steps} steps equal={equal}, demand loads {loads}; per MoE layer: host {host_us:.2f} us "
                f"(the replay call's launch), step {step_us:.2f} us (until the device finished; median of 50)")


def _time_replay(replay, dev: torch.device, L: int, reps: int = 50) -> tuple[float, float]:
    """(host us, step us) per layer of ``replay()``: the call's own wall time on the host (CUDA: the graph launch,
    asynchronous) and the time until the device finished it, each divided by the L layers it covers (medians)."""
    import time

    import numpy as np

    host, full = [], []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay()
        t1 = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        host.append(t1 - t0)
        full.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(host)) / L, 1e6 * float(np.median(full)) / L


def run_bench(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True, text=True)


def check_overhead(out: Path, dry_run: bool) -> bool:
    """The issue's CPU target, measured on this machine's CPU (a GPU node's CPUs are usually quieter than a shared
    workstation's): graph path (AOTInductor) vs eager path, host time per MoE layer. On CUDA the graph path's
    host cost per layer is the CUDA Graph replay's launch (check ``cuda-graph-replay``)."""
    js = out / "overhead.json"
    extra = (["--tokens", "4", "--repeats", "1", "--overhead-layers", "4", "--compile-backend", "none"] if dry_run
             else ["--tokens", "32", "--repeats", "7"])
    p = run_bench(["--overhead", "--device", "cpu", "--json", str(js), *extra])
    if p.returncode != 0 or not js.is_file():
        return line(False, "overhead", (p.stderr or p.stdout).strip().splitlines()[-1:])
    r = json.loads(js.read_text())
    fig = (f"CPU ({r['compile_backend']}): eager {r['eager_us_per_layer']:.1f} us/layer, graph "
           f"{r['graph_us_per_layer']:.1f} us/layer (x{r['graph_over_eager']:.3f}; target <= 0.2 and < 30 us; "
           f"load {(r.get('load_avg') or [float('nan')])[0]:.1f})")
    return line(None if dry_run else bool(r["target_met"]), "overhead", fig)


def check_pct_full(dev: torch.device, out: Path, layers: int, dry_run: bool) -> bool:
    if dry_run:
        shape = ["--hidden", "64", "--moe-intermediate", "32", "--experts", "16", "--top-k", "4", "--layers", "2",
                 "--tokens", "4", "--sequences", "1", "--repeats", "1", "--ratios", "2"]
    else:  # Qwen3-30B-A3B's MoE layer: hidden 2048, 128 experts of intermediate 768, top-8
        shape = ["--hidden", "2048", "--moe-intermediate", "768", "--experts", "128", "--top-k", "8", "--layers",
                 str(layers), "--tokens", "64", "--sequences", "2"]
    figs, ok = [], True
    for path in ("graph",) if dry_run else ("eager", "graph"):
        d = out / f"pct_full_{path}"
        p = run_bench(["--device", dev.type, "--synthetic", "--policies", "lru", "--residency", "0.25", "0.45",
                       "--decode-path", "auto" if dry_run else path, "--out", str(d), *shape])
        if p.returncode != 0:
            ok = False
            figs.append(f"{path}: failed ({(p.stderr or p.stdout).strip().splitlines()[-1:]})")
            continue
        rows = json.loads((d / "residency.json").read_text())
        rows = rows["rows"] if isinstance(rows, dict) and "rows" in rows else rows
        cells = ", ".join(f"{100 * r['residency']:.0f}%: {r['pct_full']:.1f}% ({r.get('decode_path', '?')})"
                          for r in rows)
        figs.append(f"{path}[{cells}]")
    return line(ok, "pct-full", "lru % of full-load tokens/s " + "; ".join(figs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU with tiny sizes (no CUDA needed)")
    ap.add_argument("--out", default=None, help="folder for the benchmarks' JSON (default: a temporary one)")
    ap.add_argument("--layers", type=int, default=8, help="MoE layers of the real-shape benchmark model")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("FAIL graph-check CUDA is not available (use --dry-run on a CPU machine)")
        return 1
    torch.set_num_threads(1)
    dev = torch.device("cpu" if args.dry_run else "cuda")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu_check_graph-"))
    out.mkdir(parents=True, exist_ok=True)
    ok = check_tokens(dev, args.dry_run)
    ok &= check_graph_replay(dev, args.dry_run)
    ok &= check_overhead(out, args.dry_run)
    ok &= check_pct_full(dev, out, args.layers, args.dry_run)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
