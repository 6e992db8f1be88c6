"""`expertcast quickstart`: the whole pipeline on the embedded default model, on CPU.

Steps (each reuses what an earlier run left in ``--out``, so a second run is quick):
1. build or load the embedded default MoE model (trained by the project's own script, cached);
2. collect routing traces on a slice of GSM8K test (two-pass: generate, then teacher-forced routing);
3. print trace statistics (per-layer expert frequency, entropy, step-to-step overlap);
4. simulate the expert cache on those traces (classic policies vs Belady);
5. train a tiny SeqMoE forecaster on those traces and report its recall by horizon vs baselines;
6. run the model with real expert offloading on a few GSM8K problems.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from expertcast.utils.io import atomic_write_json, print_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expertcast quickstart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/quickstart", help="output directory (reused on a second run)")
    p.add_argument("--limit", type=int, default=32, help="GSM8K test problems to collect traces on")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--capacity", default="0.15,0.25,0.35,0.45", help="cache capacities to simulate")
    p.add_argument("--policies", default="lru,lfu,fifo,static,belady")
    p.add_argument("--forecaster-steps", type=int, default=60,
                   help="training steps of the tiny SeqMoE forecaster (0 skips step 5)")
    p.add_argument("--skip-offload", action="store_true", help="stop after the simulation")
    p.add_argument("--data-dir", default=None, help="local benchmark jsonl directory (default: $EXPERTCAST_DATA_DIR)")
    return p


def _banner(i: int, text: str) -> None:
    print(f"\n=== [{i}] {text} ===", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {}
    t_all = time.perf_counter()

    _banner(1, "embedded default model")
    from expertcast.train.tiny_default import ensure_default_model

    model_dir = ensure_default_model()
    print(f"model: {model_dir}")
    summary["model"] = str(model_dir)

    _banner(2, f"routing traces on GSM8K test[:{args.limit}]")
    from expertcast.data.collect import CollectConfig, collect_traces

    trace_dir = out / "traces" / f"gsm8k-test-n{args.limit}-t{args.max_new_tokens}"
    cfg = CollectConfig(model=str(model_dir), out=str(trace_dir), benchmark="gsm8k", split="test",
                        limit=args.limit, max_new_tokens=args.max_new_tokens, batch_size=8,
                        shard_size=16, router_probs=True, data_dir=args.data_dir)
    res = collect_traces(cfg)
    print(f"{res.sequences} sequences, {res.tokens} tokens this run "
          f"(generate {res.generate_tokens_per_s:.0f} tok/s, route {res.route_tokens_per_s:.0f} tok/s; "
          f"{res.shards_skipped} shards reused)")
    summary["collect"] = {"sequences": res.sequences, "tokens": res.tokens,
                          "generate_tok_s": res.generate_tokens_per_s, "route_tok_s": res.route_tokens_per_s}

    _banner(3, "trace statistics")
    from expertcast.data.trace_stats import trace_stats
    from expertcast.data.traces import load_traces

    meta, seqs = load_traces(trace_dir)
    rows, _ = trace_stats(meta, seqs)
    print_table([r for r in rows if r["layer"] == "all" or len(rows) <= 24], title="routing statistics")

    _banner(4, "expert-cache simulation (decode only; protect-rule Belady as the ceiling)")
    from expertcast.inference.simulator import simulate

    caps = [float(c) for c in args.capacity.split(",")]
    sim_dir = out / "simulate"
    sim_dir.mkdir(parents=True, exist_ok=True)
    records = simulate((meta, seqs), args.policies.split(","), caps, pool="shared", progress=False)
    cols = ["policy", "capacity", "slots", "hit", "adj_hit", "mb_per_token", "belady_fraction"]
    print_table(records, title="simulated decode hit rate", columns=cols)
    atomic_write_json(sim_dir / "results.json", records)
    summary["simulate"] = str(sim_dir / "results.json")

    if args.forecaster_steps > 0:
        _banner(5, f"SeqMoE forecaster: {args.forecaster_steps} training steps, then recall by horizon")
        from expertcast.train.cli import build_cli
        from expertcast.train.forecast_eval import main as forecast_eval_main

        fc_root = out / "forecaster"
        export = fc_root / "export"
        if not (export / "forecaster.json").is_file():
            from expertcast.utils.paths import REPO_ROOT

            build_cli(["fit", "--config", str(REPO_ROOT / "configs" / "forecaster" / "tiny.yaml"),
                       "--data.init_args.traces", str(trace_dir),
                       "--model.init_args.export_dir", str(export),
                       "--trainer.default_root_dir", str(fc_root),
                       "--trainer.max_steps", str(args.forecaster_steps),
                       "--trainer.check_val_every_n_epoch", "1",
                       "--trainer.logger", "false", "--trainer.callbacks", "[]",
                       "--ckpt_path", "null"])
        rc = forecast_eval_main(["--forecaster", str(export), "--traces", str(trace_dir),
                                 "--out", str(out / "forecast-eval")])
        if rc:
            return rc
        summary["forecaster"] = str(export)

    if not args.skip_offload:
        _banner(6, "real expert offloading on GSM8K test (LRU, 25% of experts resident)")
        from expertcast.inference.eval_cli import main as eval_main

        eval_dir = out / "eval-lru-0.25"
        rc = eval_main(["--model", str(model_dir), "--benchmark", "gsm8k", "--policy", "lru", "--capacity", "0.25",
                        "--limit", "4", "--batch-size", "2", "--max-new-tokens", "64", "--out", str(eval_dir)]
                       + (["--data-dir", args.data_dir] if args.data_dir else []))
        if rc:
            return rc
        summary["offload_eval"] = str(eval_dir)

    summary["seconds"] = time.perf_counter() - t_all
    atomic_write_json(out / "summary.json", summary)
    print(f"\nquickstart finished in {summary['seconds']:.0f} s; outputs in {out}/")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
