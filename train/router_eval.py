"""`expertcast router-eval`: cache-aware router adaptation, hit rate and traffic against quality.

For each run (an export of :class:`~expertcast.train.router_module.RouterAdaptationModule`, trained
here when missing: short CPU runs on the default model, resumable run by run), the evaluated model
makes one teacher-forced pass over the held-out text (question as prompt, gold solution as the
decoded part), recording its native routing (a trace) and the routers' p^R/p^T/p^S (the replay).
The simulator then replays the decode positions with per-layer pools of B slots through LRU (same
backbone) and the run's router policy (Algorithm 1 for ``temporal``, Algorithm 2 for ``full`` with
top-R, spatio-only), reporting Hit, AdjHit and MB/token with the model's real expert bytes and with
Qwen3-30B-A3B's 9.44 MB, the held-out LM loss (token mean over the solutions), and the concentration
of native expert use (max frequency, top-B mass, entropy). Prefill is replayed uncounted.

Outputs in ``--out``: ``runs/<name>/`` exports, ``table2.{csv,json}`` (modes and sw sweep, shaped like
the paper's Table 2; full/spatio at the evaluated R closest to 0.75*B), ``table3.{csv,json}`` (B and R
sweeps, with the LM-only model under LRU at every B), ``tradeoff.png`` (hit and MB/token against held-out
LM loss over the sw sweep; concentration of expert use against sw). Every router row carries
``d_hit_vs_lru_pts``: its hit minus LRU's on the *same* adapted weights and B, the honest comparison
(adaptation alone already raises LRU's hit by concentrating expert use).
GSM8K accuracy is reported only with ``--gsm8k N`` (greedy generation on N test problems); the
embedded tiny model cannot solve GSM8K, so it is off by default.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.utils.io import atomic_write_json, report

Q3_EXPERT_BYTES = 9_440_000
"""One Qwen3-30B-A3B expert in bf16 (DESIGN.md anchors), for the second MB/token column."""


@dataclass
class RunSpec:
    """One training run of the study."""

    name: str
    mode: str
    sw: float = 0.1
    budget: float = 0.25
    aux_routers: str = "temporal"

    def module_kwargs(self) -> dict[str, Any]:
        return {"mode": self.mode, "sw": self.sw, "budget": self.budget, "aux_routers": self.aux_routers}


def study_runs(sw_sweep: list[float], budgets: list[float], base_budget: float) -> list[RunSpec]:
    """The default study: modes at sw=0.1 (paper Table 2), sw sweep for temporal/full, B sweep."""
    runs = [
        RunSpec("lm_only", "lm_only", 0.0, base_budget),
        RunSpec("aux_temporal", "aux_only", 0.1, base_budget, "temporal"),
        RunSpec("aux_full", "aux_only", 0.1, base_budget, "full"),
        RunSpec("temporal_sw0.1", "temporal", 0.1, base_budget),
        RunSpec("full_sw0.1", "full", 0.1, base_budget),
        RunSpec("spatio_sw0.1", "spatio_only", 0.1, base_budget),
    ]
    for sw in sw_sweep:
        runs += [RunSpec(f"temporal_sw{sw:g}", "temporal", sw, base_budget), RunSpec(f"full_sw{sw:g}", "full", sw, base_budget)]
    for b in budgets:
        if b != base_budget:
            runs += [RunSpec(f"temporal_B{b:g}", "temporal", 0.1, b), RunSpec(f"full_B{b:g}", "full", 0.1, b)]
    return runs


# --------------------------------------------------------------------------------- training


def train_run(spec: RunSpec, out: Path, args) -> Path:
    """Train one run (skipped when its export exists) and return the export directory."""
    d = out / "runs" / spec.name
    if (d / "export.json").is_file():
        return d
    import lightning as pl
    from expertcast.train.router_module import RouterAdaptationModule

    pl.seed_everything(args.seed, verbose=False)
    backbone = args.model
    if spec.mode == "aux_only":  # the auxiliary-only control freezes the LM-only backbone (paper 4)
        ref = out / "runs" / "lm_only"
        if not (ref / "export.json").is_file():
            train_run(RunSpec("lm_only", "lm_only", 0.0, spec.budget), out, args)
        backbone = str(ref / "model")
    module = RouterAdaptationModule(model=backbone, tau=args.tau, lr=args.lr, router_lr=args.router_lr,
                                    seed=args.seed, **spec.module_kwargs())
    dm = _datamodule(args, module.tokenizer)
    trainer = pl.Trainer(max_steps=args.steps, logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         limit_val_batches=0, enable_progress_bar=args.progress, enable_model_summary=False,
                         accelerator="cpu" if not torch.cuda.is_available() else "auto", devices=1)
    t0 = time.perf_counter()
    trainer.fit(module, dm)
    module.export(str(d))
    info = json.loads((d / "export.json").read_text())
    info.update({"train_seconds": round(time.perf_counter() - t0, 1), "run": spec.__dict__})
    atomic_write_json(d / "export.json", info)
    return d


def _datamodule(args, tokenizer):
    from expertcast.train.router_data import RouterLMDataModule

    dm = RouterLMDataModule(source=args.source, max_length=args.max_length, batch_size=args.batch_size,
                            heldout=args.heldout, limit=args.limit, seed=args.seed, data_dir=args.data_dir)
    dm.tokenizer = tokenizer
    dm.setup("fit")
    return dm


# --------------------------------------------------------------------------------- evaluation


def load_export(d: Path):
    """(model, tokenizer, routers | None, info) of an export directory (no Lightning needed)."""
    from expertcast.models.router_export import load_routers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info_path = d / "export.json"
    if not info_path.is_file():
        raise ValueError(f"{d} is not a router-adaptation export: export.json is missing")
    info = json.loads(info_path.read_text())
    from expertcast.train.router_module import EXPORT_FORMAT, EXPORT_FORMAT_VERSION

    if info.get("format") != EXPORT_FORMAT or info.get("format_version", 99) > EXPORT_FORMAT_VERSION:
        raise ValueError(f"{info_path} is not a router-adaptation export this expertcast reads")
    if "model_dir" not in info:
        raise ValueError(f"{d}: only merged exports (model/) are evaluated here; merge the LoRA adapter first")
    mdir = d / info["model_dir"]
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32, trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(mdir, trust_remote_code=False)
    routers = None
    if info.get("routers_dir"):
        routers, _ = load_routers(d / info["routers_dir"], model=model)
    return model, tok, routers, info


@torch.no_grad()
def record_heldout(model, routers, examples, batch_size: int = 8, model_id: str = "model"):
    """Teacher-forced pass over held-out examples: (TraceMeta, [TraceSequence], RouterReplay, LM loss).

    LM loss: mean token cross-entropy over the completion tokens."""
    from expertcast.data.trace_format import TraceMeta, TraceSequence
    from expertcast.inference.policies.router import RouterRecord, RouterReplay
    from expertcast.models.cache_routers import RouterTap
    from expertcast.models.routing import record_routing
    from expertcast.models.spec import MoESpec
    from expertcast.train.router_data import collate

    spec = MoESpec.from_model(model)
    seqs, recs = [], {}
    nll, ntok = 0.0, 0
    tap = RouterTap(model, routers)
    try:
        with record_routing(model) as rr:
            for i in range(0, len(examples), batch_size):
                chunk = examples[i : i + batch_size]
                b = collate(chunk, 0)
                B, T = b["input_ids"].shape
                logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
                ids, w, _ = rr.pop()
                ro = tap.outputs(B, T)
                lab = b["labels"][:, 1:]
                ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                       lab.reshape(-1), ignore_index=-100, reduction="sum")
                nll += float(ce)
                ntok += int((lab != -100).sum())
                L, K = ids.shape[1], ids.shape[2]
                ids, w = ids.view(B, T, L, K), w.view(B, T, L, K)
                for j, ex in enumerate(chunk):
                    n = len(ex.ids)
                    sid = f"heldout-{i + j:05d}"
                    seqs.append(TraceSequence(sid, np.asarray(ex.ids, np.int32), len(ex.prompt_ids),
                                              ids[j, :n].numpy().astype(np.int16), w[j, :n].numpy().astype(np.float16)))
                    f16 = (lambda x, j=j, n=n: None if x is None else x[j, :n].numpy().astype(np.float16))  # noqa: E731
                    recs[sid] = RouterRecord(f16(ro.p_R), f16(ro.p_T), f16(ro.p_S))
    finally:
        tap.remove()
    meta = TraceMeta(model_id=model_id, num_layers=spec.num_layers, num_experts=spec.num_experts, top_k=spec.top_k,
                     expert_bytes=spec.expert_bytes, moe_layers=spec.moe_layers, dataset="heldout")
    return meta, seqs, RouterReplay(recs, routers.mode if routers is not None else "none"), nll / max(ntok, 1)


def evaluate_run(d: Path, examples, B: int, R_values: list[int], args) -> list[dict[str, Any]]:
    """Rows (one per policy/R) for one export."""
    from expertcast.inference.policies import make_policy
    from expertcast.inference.simulator import simulate
    from expertcast.models.cache_routers import expert_use_stats

    model, tok, routers, info = load_export(d)
    meta, seqs, rp, lm = record_heldout(model, routers, examples, args.batch_size, model_id=str(d))
    dec = np.concatenate([s.decode_expert_ids for s in seqs]).astype(np.int64)
    use = expert_use_stats(torch.from_numpy(dec), meta.num_experts, B)
    pols: list[tuple[str, Any, int | None]] = [("lru", make_policy("lru"), None)]
    rmode = info.get("router_mode")
    if rmode == "temporal":
        pols.append(("router-temporal", make_policy("router-temporal", replay=rp), None))
    elif rmode in ("full", "spatio_only"):
        name = "router-full" if rmode == "full" else "router-spatio"
        for R in R_values:
            if R <= B:
                pols.append((name, make_policy(name, replay=rp, R=R), R))
    recs = simulate((meta, seqs), [p for _, p, _ in pols], capacities=None, slots_per_layer=[B],
                    progress=False, engine="auto")
    rows = []
    run = info.get("run", {})
    for (pname, _, R), r in zip(pols, recs, strict=True):
        loads = r["demand_misses"] + r["proactive_loads"]
        rows.append({
            "run": d.name, "train_mode": info["mode"], "router_mode": rmode or "-", "sw": info.get("sw", 0.0),
            "B": B, "R": R if R is not None else "-", "policy": pname,
            "hit": r["hit"], "adj_hit": r["adj_hit"], "mb_per_token": r["mb_per_token"],
            "mb_per_token_q3": loads * Q3_EXPERT_BYTES / 1e6 / max(r["decoded_tokens"], 1),
            "belady_fraction": r.get("belady_fraction", float("nan")), "heldout_lm": lm,
            "max_freq": use["max_freq"], "topB_mass": use["topb_mass"], "entropy": use["entropy"],
            "decoded_tokens": r["decoded_tokens"], "train_steps": info.get("steps"),
            "train_seconds": info.get("train_seconds"), "budget_arg": run.get("budget"),
        })
    if args.gsm8k:
        acc = gsm8k_accuracy(model, tok, args.gsm8k, args.data_dir)
        for row in rows:
            row["gsm8k_acc"] = acc
    return rows


@torch.no_grad()
def gsm8k_accuracy(model, tok, n: int, data_dir: str | None, max_new_tokens: int = 256) -> float:
    """Greedy accuracy on the first ``n`` GSM8K test problems."""
    from expertcast.data.benchmarks import load_benchmark
    from expertcast.data.grading import grade
    from expertcast.data.prompts import build_prompt

    probs = load_benchmark("gsm8k", "test", data_dir=data_dir, limit=n)
    ok = 0
    for p in probs:
        ids = tok(build_prompt(tok, p.question, "gsm8k"), return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id or 0, eos_token_id=tok.eos_token_id)
        ok += grade("gsm8k", tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), p.answer)
    return ok / max(len(probs), 1)


# --------------------------------------------------------------------------------- report


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Trade-off PNG: hit vs held-out LM loss, MB/token vs LM loss (one point per sw, annotated), and
    the concentration of native expert use vs sw. Base budget only; full at its Table-2 R."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    base_B = _base_budget(rows)
    lm_ref = next((r["heldout_lm"] for r in rows if r["train_mode"] == "lm_only"), None)
    for rmode, pol, marker in (("temporal", "router-temporal", "o"), ("full", "router-full", "s")):
        pts = sorted((r for r in rows if r["train_mode"] == rmode and r["policy"] == pol and r["B"] == base_B
                      and r["R"] == _table_R(rows, r["run"], base_B)), key=lambda r: r["sw"])
        pts = _dedupe(pts)
        if not pts:
            continue
        sw = [r["sw"] for r in pts]
        lm = [r["heldout_lm"] for r in pts]
        axes[0].plot(lm, [100 * r["hit"] for r in pts], marker=marker, label=f"{rmode} (hit)")
        axes[1].plot(lm, [r["mb_per_token"] for r in pts], marker=marker, label=rmode)
        for r in pts:
            axes[0].annotate(f"sw={r['sw']:g}", (r["heldout_lm"], 100 * r["hit"]), fontsize=7)
            axes[1].annotate(f"sw={r['sw']:g}", (r["heldout_lm"], r["mb_per_token"]), fontsize=7)
        axes[2].plot(sw, [100 * r["max_freq"] for r in pts], marker=marker, label=f"{rmode} max freq")
        axes[2].plot(sw, [100 * r["topB_mass"] for r in pts], marker=marker, linestyle="--", label=f"{rmode} top-B mass")
    lru = next((r for r in rows if r["train_mode"] == "lm_only" and r["policy"] == "lru" and r["B"] == base_B), None)
    if lru:
        axes[0].scatter([lru["heldout_lm"]], [100 * lru["hit"]], c="k", marker="x", label="LM-only + LRU")
        axes[1].scatter([lru["heldout_lm"]], [lru["mb_per_token"]], c="k", marker="x", label="LM-only + LRU")
    if lm_ref:
        for a in axes[:2]:
            a.axvline(lm_ref * 1.02, color="grey", linestyle=":", label="LM-only loss +2%")
    axes[0].set_xlabel("held-out LM loss")
    axes[0].set_ylabel("hit rate (%)")
    axes[0].set_title(f"quality vs hit (sw sweep, B={base_B})")
    axes[1].set_xlabel("held-out LM loss")
    axes[1].set_ylabel("MB / token (real expert bytes)")
    axes[1].set_title("quality vs traffic (sw sweep)")
    axes[2].set_xlabel("sw")
    axes[2].set_ylabel("%")
    axes[2].set_xscale("symlog", linthresh=0.1)
    axes[2].set_title("concentration of native expert use")
    for a in axes:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _base_budget(rows) -> int:
    """The budget most rows were evaluated at (the study's base B)."""
    return max((r["B"] for r in rows), key=lambda b: sum(1 for r in rows if r["B"] == b))


def _table_R(rows, run: str, B: int):
    """The R shown for ``run`` in Table 2 and the plot: of the R values evaluated, the one closest to
    0.75*B (the paper's ratio, R=15 of B=20; ties to the larger); "-" for runs without R."""
    Rs = sorted({r["R"] for r in rows if r["run"] == run and r["B"] == B and r["R"] != "-"})
    if not Rs:
        return "-"
    return min(Rs, key=lambda R: (abs(R - 0.75 * B), -R))


def _dedupe(rows):
    seen, out = set(), []
    for r in rows:
        if r["sw"] not in seen:
            seen.add(r["sw"])
            out.append(r)
    return out


def add_lru_deltas(rows: list[dict[str, Any]]) -> None:
    """``d_hit_vs_lru_pts``: a row's hit minus LRU's hit on the same export and B (percentage points),
    the honest comparison (same adapted weights); ``lm_vs_lm_only_pct`` is set by the caller."""
    lru = {(r["run"], r["B"]): r["hit"] for r in rows if r["policy"] == "lru"}
    for r in rows:
        ref = lru.get((r["run"], r["B"]))
        r["d_hit_vs_lru_pts"] = 100 * (r["hit"] - ref) if ref is not None else float("nan")


COLUMNS = ["run", "policy", "sw", "B", "R", "hit", "d_hit_vs_lru_pts", "adj_hit", "belady_fraction", "mb_per_token",
           "mb_per_token_q3", "heldout_lm", "lm_vs_lm_only_pct", "max_freq", "topB_mass", "entropy"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="expertcast router-eval", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="backbone: 'default', a tiny preset, or an HF directory")
    ap.add_argument("--out", default="runs/router-eval", help="output directory (exports, tables, plot)")
    ap.add_argument("--exports", nargs="*", default=None,
                    help="evaluate these export directories only (no training)")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per training run")
    ap.add_argument("--budget", type=float, default=0.25, help="per-layer B: fraction of E (<1) or experts")
    ap.add_argument("--budgets", type=float, nargs="*", default=[], help="B sweep (separate trainings)")
    ap.add_argument("--sw-sweep", type=float, nargs="*", default=[0.3, 1.0, 2.0])
    ap.add_argument("--R", type=int, nargs="*", default=None, help="top-R values for full/spatio (default 0.75*B)")
    ap.add_argument("--modes", nargs="*", default=None, help="only these run names (default: the whole study)")
    ap.add_argument("--tau", type=float, default=0.02)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--router-lr", type=float, default=3e-3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=320)
    ap.add_argument("--heldout", type=float, default=96, help="held-out examples (count, or fraction < 1)")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N texts of the source")
    ap.add_argument("--source", default="gsm8k", help="LM text source (gsm8k or a datasets source)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--gsm8k", type=int, default=0, help="also measure GSM8K accuracy on N test problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--progress", action="store_true", help="Lightning progress bars while training")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from expertcast.models.cache_routers import resolve_budget
    from tqdm.auto import tqdm

    if args.exports:
        dirs = [Path(p) for p in args.exports]
        specs = None
    else:
        specs = study_runs(args.sw_sweep, args.budgets, args.budget)
        if args.modes:
            unknown = sorted(set(args.modes) - {s.name for s in specs})
            if unknown:
                raise SystemExit(f"unknown run names {unknown}; known: {[s.name for s in specs]}")
            specs = [s for s in specs if s.name in args.modes]
        dirs = []
        for s in tqdm(specs, desc="train runs", unit="run"):
            dirs.append(train_run(s, out, args))

    # held-out text: the data module's held-out split, tokenised with the first run's tokenizer
    _, tok0, _, info0 = load_export(dirs[0])
    examples = _datamodule(args, tok0).heldout_set
    rows: list[dict[str, Any]] = []
    for d in tqdm(dirs, desc="evaluate runs", unit="run"):
        info = json.loads((d / "export.json").read_text())
        E = _num_experts(d)
        B = int(info.get("budget") or resolve_budget(args.budget, E))
        Rs = args.R or [max(1, int(round(0.75 * B)))]
        rows += _evaluate_cached(d, examples, B, Rs, args, out / "eval" / f"{d.name}.json")
        if info.get("mode") == "lm_only":  # the LM-only reference under LRU at every budget of the B sweep
            for b in sorted({resolve_budget(x, E) for x in args.budgets} - {B}):
                rows += _evaluate_cached(d, examples, b, [], args, out / "eval" / f"{d.name}@B{b}.json")
    lm_ref = next((r["heldout_lm"] for r in rows if r["train_mode"] == "lm_only"), None)
    for r in rows:
        r["lm_vs_lm_only_pct"] = 100 * (r["heldout_lm"] / lm_ref - 1) if lm_ref else float("nan")
        if not args.gsm8k:
            r["gsm8k_acc"] = "n/a (tiny model)"
    add_lru_deltas(rows)
    base_B = _base_budget(rows)
    t2 = [r for r in rows if r["B"] == base_B and (r["policy"] == "lru" or r["R"] == _table_R(rows, r["run"], base_B))]
    t3 = sorted((r for r in rows if r["train_mode"] == "lm_only"
                 or (r["train_mode"] in ("temporal", "full") and r["sw"] == 0.1)),
                key=lambda r: (r["B"], r["run"], r["policy"] != "lru", str(r["R"])))
    report(t2, title=f"Table 2: modes and sw (B={base_B} per layer, decode-only, held-out text)",
           json_path=out / "table2.json", csv_path=out / "table2.csv", columns=COLUMNS)
    report(t3, title="Table 3: budget B and refinement R (sw=0.1; LRU on the same weights beside each run)", json_path=out / "table3.json",
           csv_path=out / "table3.csv", columns=COLUMNS)
    _plot(rows, out / "tradeoff.png")
    atomic_write_json(out / "all_rows.json", rows)
    print(f"wrote {out}/table2.csv, table3.csv, tradeoff.png "
          f"(MB/token: real expert bytes; mb_per_token_q3: {Q3_EXPERT_BYTES / 1e6} MB experts; "
          "GSM8K accuracy: " + ("measured" if args.gsm8k else "not measured, the tiny model cannot solve GSM8K") + ")")
    return 0


def _evaluate_cached(d: Path, examples, B: int, Rs: list[int], args, cache_file: Path) -> list[dict[str, Any]]:
    """evaluate_run with its rows cached in ``cache_file`` (reused while the evaluation key matches)."""
    key = _eval_key(args, B, Rs)
    if cache_file.is_file() and json.loads(cache_file.read_text()).get("key") == key:
        return json.loads(cache_file.read_text())["rows"]
    rows = evaluate_run(d, examples, B, Rs, args)
    atomic_write_json(cache_file, {"key": key, "rows": rows})
    return rows


def _eval_key(args, B, Rs) -> str:
    return json.dumps({"B": B, "R": Rs, "heldout": args.heldout, "limit": args.limit, "source": args.source,
                       "max_length": args.max_length, "seed": args.seed, "gsm8k": args.gsm8k})


def _num_experts(d: Path) -> int:
    cfg = json.loads((d / "model" / "config.json").read_text())
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if k in cfg:
            return int(cfg[k])
    raise ValueError(f"{d}/model/config.json names no expert count")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
