"""The forecast ceiling of a ``traces synth`` routing: what recall@K at the next step any forecaster could reach.

For a trace set written by ``expertcast traces synth`` (the sticky process, ``--cross-layer 0``), the process is
rebuilt from the settings its manifest records and its sequences are drawn again and checked equal to the set's,
draw for draw; then, on every decode step's next step, recall@K of:

- ``bayes (true rho)``: the top-K of P(e in S_t+1 | S_t, rho) (``StickyRoutingProcess.next_step_probabilities``,
  Monte Carlo over the process's own step) with each sequence's **true** preferences rho: a ceiling, since a
  forecaster fitted on other sequences does not know them and must infer them from the sequence so far;
- ``repeat-last`` (S_t itself) and ``rho top-K`` (the favourites alone), on the same targets.

The targets are the steps after the prompt's last one (S_t+1 for t from the prompt's last position on), the next
step of every layer: what ``forecast-eval``'s horizon 1 asks of layers after the trigger layer (and of the trigger
layer itself a step later).

    python scripts/synth_ceiling.py --traces /work/bench/syn26-eval [--samples 2000] [--json out.json]

Prints a table; ``--json`` (a new file, or this script's own earlier output) records it with the command and the
code version.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", required=True, help="a trace set written by `expertcast traces synth`")
    ap.add_argument("--samples", type=int, default=2000, help="Monte Carlo draws per step (default 2000)")
    ap.add_argument("--max-sequences", type=int, default=None, help="score the first N sequences only")
    ap.add_argument("--mc-seed", type=int, default=123, help="seed of the Monte Carlo draws")
    ap.add_argument("--json", default=None, help="write the result here (a new file or this script's own output)")
    a = ap.parse_args(argv)

    from expertcast.data.synthetic import StickyRoutingProcess
    from expertcast.data.traces import load_traces, read_manifest
    from expertcast.utils.errors import UsageError
    from expertcast.utils.io import atomic_write_json, print_table
    from expertcast.utils.outdir import claim_output_file
    from expertcast.utils.provenance import code_version

    if a.samples < 1:
        sys.exit("error: --samples must be >= 1")
    out = None
    if a.json:  # a new file, or this script's earlier output only
        try:
            out = claim_output_file(a.json, "--json", "synth_ceiling --json")
        except UsageError as e:
            sys.exit(f"error: {e}")
    run = read_manifest(a.traces).get("run") or {}
    if run.get("command") != "traces synth":
        sys.exit(f"error: {a.traces} was not written by `expertcast traces synth` (its manifest says "
                 f"{run.get('command')!r}); the ceiling needs the process that drew it")
    if float(run.get("cross_layer", 0.0)) > 0:
        sys.exit("error: --cross-layer routing: the ceiling is computed for cross_layer 0 only")
    L, E, K = (int(x) for x in str(run["shape"]).split(","))
    proc = StickyRoutingProcess.realistic(L, E, K, skew=float(run["skew"]), stay=float(run["stay"]),
                                          concentration=float(run["concentration"]), seed=int(run["process_seed"]))
    n, tokens, prompt, seed = int(run["sequences"]), int(run["tokens"]), int(run["prompt"]), int(run["seed"])
    meta, seqs = load_traces(a.traces)
    again = proc.sample(n, tokens, prompt_len=prompt, seed=seed, prefix=f"sticky{L}x{E}")
    for x, y in zip(again, seqs, strict=True):
        if x.seq_id != y.seq_id or not np.array_equal(x.expert_ids, y.expert_ids):
            sys.exit(f"error: {y.seq_id}: drawn again from the manifest's settings it differs from the trace set's; "
                     f"not the process that wrote it")
    m = min(n, a.max_sequences or n)
    log_rho = proc.preferences(n, seed)[:m]
    ids = np.stack([s.expert_ids.astype(np.int64) for s in seqs[:m]])  # [N, T, L, K]
    rng = np.random.default_rng(a.mc_seed)
    fav = np.argsort(-log_rho, axis=-1)[..., :K]
    hits: dict[str, list[float]] = {"bayes (true rho)": [], "repeat-last": [], "rho top-K": []}
    t0 = time.perf_counter()
    for t in range(prompt - 1, tokens - 1):
        cur, nxt = ids[:, t], ids[:, t + 1]
        top = np.argsort(-proc.next_step_probabilities(log_rho, cur, a.samples, rng), axis=-1)[..., :K]
        for name, pred in (("bayes (true rho)", top), ("repeat-last", cur), ("rho top-K", fav)):
            hits[name].append(float((pred[..., :, None] == nxt[..., None, :]).any(-2).mean()))
    rows = [{"predictor": k, "recall_at_k_next_step": float(np.mean(v))} for k, v in hits.items()]
    targets = (tokens - prompt) * m * L
    print_table(rows, title=f"next-step recall@{K} on {a.traces}: {m} sequences x {tokens - prompt} steps x {L} "
                f"layers = {targets} targets, {a.samples} Monte Carlo draws per step ({time.perf_counter() - t0:.1f} s)")
    if out is not None:
        atomic_write_json(out.path, {"command": "synth_ceiling", "argv": sys.argv, "code_version": code_version(),
                                     "traces": str(a.traces), "process": run, "sequences": m, "targets": targets,
                                     "samples": a.samples, "mc_seed": a.mc_seed, "rows": rows})
        out.written()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
