"""``expertcast eval``: offloaded inference on GSM8K / MATH-500 with a cache policy.

    expertcast eval --model M --benchmark gsm8k|math500 --policy P --capacity C [--batch-size N]
                    [--limit N] [--max-new-tokens N] --out DIR [--wandb]

Greedy generation through :class:`~expertcast.inference.runtime.engine.OffloadedModel` (real expert
offloading), graded with the benchmark's grader (:mod:`expertcast.data.grading`). Reports accuracy and
the decode-only cache and speed metrics: Hit, AdjHit, MB/token, tokens/s, TTFT and stall time per
token. Each finished batch appends its samples to ``DIR/samples.jsonl`` (with the batch's counters),
so an interrupted run resumes where it stopped (with ``--resume``, the default; the cache starts empty
again). Outputs: a terminal table, ``summary.json``, ``summary.csv``, ``samples.csv`` and
``summary.png`` (per-layer decode hit and per-batch tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.utils.io import atomic_write_json, print_table, write_csv

SAMPLES = "samples.jsonl"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="expertcast eval", description="offloaded inference on GSM8K / MATH-500")
    ap.add_argument("--model", required=True, help="preset name, 'tiny-default', local HF directory or Hub id")
    ap.add_argument("--benchmark", required=True, choices=["gsm8k", "math500"])
    ap.add_argument("--policy", required=True,
                    help="cache policy with options, e.g. lru, 'lrfu:lam=0.1', 'stage:cue_set=CUES.json'")
    ap.add_argument("--capacity", required=True,
                    help="fraction of all experts (0.25) or a slot count (an integer, e.g. 8)")
    ap.add_argument("--pool", default="per-layer", choices=["per-layer", "shared"])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="first N problems")
    ap.add_argument("--split", default="test")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="model dtype (float32, bfloat16); default: the loader's")
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="CPU only: emulated host-device bandwidth in GB/s (default: memory speed)")
    ap.add_argument("--mmap-store", action="store_true", help="memory-map the host expert store (DIR/experts.safetensors)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--chat-template", choices=["auto", "yes", "no"], default="auto")
    ap.add_argument("--no-resume", action="store_true", help="start over even if DIR/samples.jsonl exists")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb", action="store_true", help="log the summary and per-batch metrics to W&B")
    ap.add_argument("--wandb-project", default="expertcast")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _capacity(text: str) -> float | int:
    try:
        if any(c in text for c in ".eE"):
            v = float(text)
            if not 0 < v <= 1:
                raise ValueError
            return v
        v = int(text)
        if v < 1:
            raise ValueError
        return v
    except ValueError:
        raise SystemExit(f"--capacity must be a fraction in (0, 1] (e.g. 0.25) or a positive slot count, got "
                         f"{text!r}") from None


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Rows of a samples JSONL; a torn last line (interrupted write) is dropped with a warning."""
    rows: list[dict[str, Any]] = []
    if not path.is_file():
        return rows
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                print(f"warning: {path}: dropping a torn last line (interrupted run)", file=sys.stderr)
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON: the file is corrupt") from None
    return rows


def repair_samples(path: Path) -> None:
    """Cut a torn last line (a write interrupted mid-line) so that appended rows start on a new line."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    keep = data[: data.rfind(b"\n") + 1]
    from expertcast.utils.io import atomic_write_bytes

    atomic_write_bytes(path, keep)


def _append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append whole rows and fsync (a batch is either fully recorded or, if torn, dropped on resume)."""
    data = "".join(json.dumps(r, default=_jsonable) + "\n" for r in rows)
    with open(path, "a", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy over samples; cache and speed metrics over the batches' raw counters."""
    batches: dict[int, dict[str, Any]] = {}
    for r in rows:
        batches.setdefault(int(r["batch"]), r["batch_stats"])
    b = list(batches.values())
    A = sum(x["accesses"] for x in b)
    D = sum(x["demand_misses"] for x in b)
    P = sum(x["proactive_loads"] for x in b)
    tok = sum(x["decoded_tokens"] for x in b)
    dec_s = sum(x["decode_seconds"] for x in b)
    eb = b[0]["expert_bytes"] if b else 0
    per_acc = np.sum([x["per_layer_accesses"] for x in b], axis=0) if b else np.zeros(0)
    per_dem = np.sum([x["per_layer_demand"] for x in b], axis=0) if b else np.zeros(0)
    n = len(rows)
    correct = sum(bool(r["correct"]) for r in rows)
    return {
        "samples": n,
        "correct": correct,
        "accuracy": correct / n if n else float("nan"),
        "hit": 1.0 - D / A if A else float("nan"),
        "adj_hit": (A - D) / (A + P) if A else float("nan"),
        "mb_per_token": (D + P) * eb / 1e6 / max(tok, 1),
        "tokens_per_s": tok / dec_s if dec_s > 0 else float("nan"),
        "ttft_s": float(np.mean([x["ttft_s"] for x in b])) if b else float("nan"),
        "stall_ms_per_token": 1e3 * sum(x["stall_seconds"] for x in b) / max(tok, 1),
        "decoded_tokens": tok,
        "accesses": A,
        "demand_misses": D,
        "proactive_loads": P,
        "late_prefetches": sum(x["late_prefetches"] for x in b),
        "cpu_exec": sum(x["cpu_exec"] for x in b),
        "per_layer_hit": [float(1 - d / a) if a else float("nan") for a, d in zip(per_acc, per_dem, strict=True)],
        "batches": len(b),
        "accounting": "decode-only; prefill uncounted (cache state after prefill initializes decoding)",
    }


def _plot(summary: dict[str, Any], rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    ph = summary["per_layer_hit"]
    a1.bar(range(len(ph)), ph)
    a1.set_xlabel("MoE layer")
    a1.set_ylabel("decode hit rate")
    a1.set_ylim(0, 1.05)
    a1.set_title(f"hit {summary['hit']:.3f}, AdjHit {summary['adj_hit']:.3f}")
    batches: dict[int, dict] = {}
    for r in rows:
        batches.setdefault(int(r["batch"]), r["batch_stats"])
    ks = sorted(batches)
    a2.plot(ks, [batches[k]["tokens_per_s"] for k in ks], marker="o")
    a2.set_xlabel("batch")
    a2.set_ylabel("decode tokens/s")
    a2.set_title(f"accuracy {summary['accuracy']:.3f} over {summary['samples']} samples")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    capacity = _capacity(str(args.capacity))
    if args.batch_size < 1:
        raise SystemExit("--batch-size must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from expertcast.data.benchmarks import load_benchmark
    from expertcast.data.grading import extract_answer, grade
    from expertcast.data.prompts import build_prompt, has_chat_template
    from expertcast.inference.policies import make_policy, parse_policy_spec
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.models.backbone import load_moe_model

    # everything that can be wrong is checked before any generation: data, policy, model, capacity
    problems = load_benchmark(args.benchmark, args.split, data_dir=args.data_dir, limit=args.limit)
    name, kwargs = parse_policy_spec(args.policy)
    policy = make_policy(name, **kwargs)
    if policy.needs_future:
        raise SystemExit(f"policy {name!r} is an oracle (it reads the future routing): it cannot drive a live "
                         "evaluation; use `expertcast simulate` on recorded traces")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else \
        torch.device(args.device)
    model, tok = load_moe_model(args.model, dtype=args.dtype or "auto", device=device, seed=args.seed)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    templated = has_chat_template(tok) if args.chat_template == "auto" else args.chat_template == "yes"
    eos = set()
    for src in (model.generation_config, tok):
        e = getattr(src, "eos_token_id", None)
        if e is not None:
            eos.update([e] if isinstance(e, int) else list(e))
    om = OffloadedModel(model, policy, capacity, pool=args.pool, device=device, link_gbps=args.link_gbps,
                        mmap_path=str(out / "experts.safetensors") if args.mmap_store else None)
    settings = {"model": args.model, "benchmark": args.benchmark, "split": args.split, "policy": args.policy,
                "capacity": capacity, "capacity_fraction": om.cache_config.fraction, "pool": args.pool,
                "slots": om.cache.num_slots, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
                "device": str(device), "link_gbps": args.link_gbps, "greedy": True}

    samples_path = out / SAMPLES
    if args.no_resume and samples_path.exists():
        samples_path.unlink()
    done = read_samples(samples_path)
    repair_samples(samples_path)
    if done:
        prev = done[0].get("settings", {})
        diff = {k: (prev.get(k), v) for k, v in settings.items() if k in prev and prev.get(k) != v}
        if diff:
            raise SystemExit(f"{samples_path} was written with other settings {diff}; use another --out or --no-resume")
    done_ids = {r["id"] for r in done}
    todo = [p for p in problems if p.id not in done_ids]
    next_batch = max((int(r["batch"]) for r in done), default=-1) + 1
    if done:
        print(f"resuming: {len(done)} samples done, {len(todo)} to go")

    run = None
    if args.wandb:
        from expertcast.utils.tracking import start_wandb_run

        run = start_wandb_run(args.wandb_project, settings, job_type="eval",
                              name=f"eval-{args.benchmark}-{name}-{capacity}")

    batches = [todo[i:i + args.batch_size] for i in range(0, len(todo), args.batch_size)]
    it = batches
    if not args.no_progress:
        from tqdm.auto import tqdm

        it = tqdm(batches, desc=f"eval {args.benchmark} {name}@{capacity}", unit="batch")
    for bi, batch in enumerate(it):
        texts = [build_prompt(tok, p.question, args.benchmark, use_chat_template=templated) for p in batch]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)
        before = _counters(om)
        t0 = time.perf_counter()
        res = om.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=args.max_new_tokens,
                          eos_token_id=sorted(eos) or None, pad_token_id=tok.pad_token_id,
                          seq_ids=[p.id for p in batch])
        wall = time.perf_counter() - t0
        bstats = _batch_stats(om, before, res, wall)
        P = enc["input_ids"].shape[1]
        rows = []
        for i, p in enumerate(batch):
            comp_ids = res.sequences[i, P:].tolist()
            n_new = next((j + 1 for j, t in enumerate(comp_ids) if t in eos), len(comp_ids))
            text = tok.decode(comp_ids[:n_new], skip_special_tokens=True)
            rows.append({"id": p.id, "batch": next_batch + bi, "correct": bool(grade(args.benchmark, text, p.answer)),
                         "answer": extract_answer(args.benchmark, text), "gold": p.answer, "completion": text,
                         "new_tokens": n_new, "batch_stats": bstats, "settings": settings})
        _append_rows(samples_path, rows)
        if run is not None:
            run.log({"batch": next_batch + bi, **{k: v for k, v in bstats.items() if not isinstance(v, list)}})

    rows = read_samples(samples_path)
    rows = [r for r in rows if r["id"] in {p.id for p in problems}]
    summary = summarize(rows)
    summary["memory"] = om.memory_report().to_dict()
    summary["settings"] = settings
    om.close()
    cols = ["samples", "accuracy", "hit", "adj_hit", "mb_per_token", "tokens_per_s", "ttft_s", "stall_ms_per_token",
            "late_prefetches", "cpu_exec"]
    print_table([{"policy": args.policy, "capacity": capacity, **{k: summary[k] for k in cols}}],
                title=f"expertcast eval: {args.model} on {args.benchmark} ({summary['accounting']})")
    atomic_write_json(out / "summary.json", summary)
    write_csv(out / "summary.csv", [{"policy": args.policy, "capacity": capacity, **{k: summary[k] for k in cols}}])
    write_csv(out / "samples.csv", [{k: r[k] for k in ("id", "batch", "correct", "answer", "gold", "new_tokens")}
                                    for r in rows])
    _plot(summary, rows, out / "summary.png", f"{args.model} {args.benchmark} {args.policy} @ {capacity}")
    if run is not None:
        run.summary.update({k: summary[k] for k in cols})
        run.finish()
    print(f"wrote {out / 'summary.json'}, summary.csv, samples.csv, summary.png, {SAMPLES}")
    return 0


def _counters(om) -> dict[str, Any]:
    st = om.stats
    return {"accesses": st.accesses.copy(), "demand": st.demand.copy(), "proactive": st.proactive.copy(),
            "late": st.late.copy(), "cpu": st.cpu.copy(), "decoded_tokens": st.decoded_tokens,
            "decode_seconds": st.decode_seconds, "stall_seconds": st.stall_seconds}


def _batch_stats(om, before: dict[str, Any], res, wall: float) -> dict[str, Any]:
    st = om.stats
    acc = st.accesses - before["accesses"]
    dem = st.demand - before["demand"]
    pro = st.proactive - before["proactive"]
    tok = st.decoded_tokens - before["decoded_tokens"]
    dec_s = st.decode_seconds - before["decode_seconds"]
    A, D, P = int(acc.sum()), int(dem.sum()), int(pro.sum())
    return {
        "accesses": A, "demand_misses": D, "proactive_loads": P,
        "late_prefetches": int((st.late - before["late"]).sum()), "cpu_exec": int((st.cpu - before["cpu"]).sum()),
        "hit": 1 - D / A if A else None, "adj_hit": (A - D) / (A + P) if A else None,
        "decoded_tokens": tok, "decode_seconds": dec_s, "tokens_per_s": tok / dec_s if dec_s > 0 else None,
        "ttft_s": res.ttft_seconds, "stall_seconds": st.stall_seconds - before["stall_seconds"],
        "expert_bytes": om.layout.expert_bytes, "wall_seconds": wall,
        "per_layer_accesses": acc.tolist(), "per_layer_demand": dem.tolist(),
    }


if __name__ == "__main__":
    sys.exit(main())
