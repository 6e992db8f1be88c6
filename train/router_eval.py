"""The cache-aware router study of `expertcast router-eval`: hit rate and traffic against quality.

For each run (an export of :class:`~expertcast.train.router_module.RouterAdaptationModule`, trained
here when missing: short CPU runs on the default model, resumable run by run), the evaluated model
makes one teacher-forced pass over held-out text (question as prompt, gold solution as the decoded
part), recording its native routing (a trace) and the routers' p^R/p^T/p^S (the replay). The
simulator then replays the decode positions with per-layer pools of B slots through LRU (same
backbone) and the run's router policy (Algorithm 1 for ``temporal``, Algorithm 2 for ``full`` with
top-R, spatio-only), reporting Hit, AdjHit and MB/token with the model's real expert bytes and with
Qwen3-30B-A3B's 9.44 MB, the held-out LM loss (token mean over the solutions), and the concentration
of native expert use (max frequency, top-B mass, entropy). Prefill is replayed uncounted.

Held-out text only: the evaluated texts are the data module's held-out split (by a hash of each text's
id, :mod:`expertcast.train.router_data`), and every evaluated export's training texts are checked
against them (:func:`expertcast.utils.provenance.check_overlap`; an export that records no training
ids is refused unless overlap is allowed). Every row carries ``train_overlap`` (evaluated texts the
export trained on) and ``overlap_allowed``.

Outputs in the output folder: ``runs/<name>/export`` (the export, its ``training`` block listing the
train ids) and ``runs/<name>/run.json`` (its settings key, held-out ids, training time), ``eval/`` (rows cached per export, B and R values,
each with its settings key), ``table2.{csv,json}`` (modes and sw sweep, shaped like the paper's Table
2; full/spatio at the evaluated R closest to 0.75*B), ``table3.{csv,json}`` (B and R sweeps, with the
LM-only model under LRU at every B), ``tradeoff.png`` (hit and MB/token against held-out LM loss over
the sw sweep; concentration of expert use against sw), ``all_rows.json``. Every router row carries
``d_hit_vs_lru_pts``: its hit minus LRU's on the *same* adapted weights and B, the honest comparison
(adaptation alone already raises LRU's hit by concentrating expert use). GSM8K accuracy is reported
only with ``gsm8k > 0`` (greedy generation on N test problems); the embedded tiny model cannot solve
GSM8K, so it is off by default.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.utils.errors import UsageError
from expertcast.utils.io import atomic_write_json, report
from expertcast.utils.outdir import OutputDir
from expertcast.utils.provenance import check_overlap, check_resume, settings_key, sha256_json

Q3_EXPERT_BYTES = 9_440_000
"""One Qwen3-30B-A3B expert in bf16 (docs/design.md "Anchors"), for the second MB/token column."""


@dataclass
class StudyConfig:
    """Settings of a router study (``expertcast router-eval`` flags)."""

    model: str = "default"
    """Backbone of the runs trained here: a resolved model directory or a preset name."""
    steps: int = 150
    """Optimizer steps per training run."""
    budget: float = 0.25
    """Per-layer B of the base runs: a fraction of E (< 1) or a number of experts."""
    budgets: list[float] = field(default_factory=list)
    """B sweep (separate trainings)."""
    sw_sweep: list[float] = field(default_factory=lambda: [0.3, 1.0, 2.0])
    R: list[int] | None = None
    """Top-R values for full/spatio (None: 0.75*B)."""
    modes: list[str] | None = None
    """Only these run names (None: the whole study)."""
    tau: float = 0.02
    lr: float = 5e-4
    router_lr: float = 3e-3
    batch_size: int = 8
    max_length: int = 320
    heldout: float = 0.05
    """Fraction of the texts held out (by a hash of each text's id)."""
    eval_limit: int | None = 96
    """Evaluate the first N held-out texts (None: all of them)."""
    limit: int | None = None
    """Use only the first N texts of the source."""
    source: str = "gsm8k"
    data_dir: str | None = None
    gsm8k: int = 0
    """Also measure GSM8K accuracy on N test problems."""
    seed: int = 0
    progress: bool = False
    allow_overlap: bool = False
    """Evaluate even when an export trained on evaluated texts (reported in every row)."""

    def data_settings(self) -> dict[str, Any]:
        """What selects and tokenises the texts."""
        return {"source": self.source, "limit": self.limit, "heldout": self.heldout, "seed": self.seed,
                "max_length": self.max_length}

    def train_settings(self, spec: RunSpec) -> dict[str, Any]:
        """Everything a trained run's weights depend on (the resume key of ``runs/<name>``)."""
        return settings_key(model=self.model, steps=self.steps, tau=self.tau, lr=self.lr, router_lr=self.router_lr,
                            batch_size=self.batch_size, run=asdict(spec), **self.data_settings())


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


@dataclass
class EvalTarget:
    """An export to evaluate: its name in the tables, folder, training ids (None: not recorded) and the
    ``run.json`` of a run trained here (else empty)."""

    name: str
    export: Path
    train_ids: list[str] | None
    run_info: dict[str, Any] = field(default_factory=dict)


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
    return list({r.name: r for r in runs}.values())


def select_runs(cfg: StudyConfig) -> list[RunSpec]:
    """The study's runs, restricted to ``cfg.modes`` (a UsageError names unknown run names)."""
    specs = study_runs(cfg.sw_sweep, cfg.budgets, cfg.budget)
    if cfg.modes:
        unknown = sorted(set(cfg.modes) - {s.name for s in specs})
        if unknown:
            raise UsageError(f"--modes: unknown run names {', '.join(unknown)}; known: "
                             f"{', '.join(s.name for s in specs)}")
        specs = [s for s in specs if s.name in cfg.modes]
    return specs


# --------------------------------------------------------------------------------- training


def train_run(spec: RunSpec, out: OutputDir, cfg: StudyConfig) -> EvalTarget:
    """Train one run into ``runs/<name>/export`` (skipped when ``runs/<name>/run.json`` records the
    same settings; a ResumeMismatchError when it records others)."""
    run_dir = out.file("runs") / spec.name
    export, info_path = run_dir / "export", run_dir / "run.json"
    settings = cfg.train_settings(spec)
    if info_path.is_file():
        info = json.loads(info_path.read_text(encoding="utf-8"))
        check_resume(info.get("settings"), settings, info_path)
        return EvalTarget(spec.name, export, export_train_ids(export), info)
    import shutil

    import lightning as pl
    from expertcast.train.router_module import RouterAdaptationModule

    if export.exists():  # a run interrupted after its export began: train it again
        shutil.rmtree(export)
    pl.seed_everything(cfg.seed, verbose=False)
    backbone = cfg.model
    if spec.mode == "aux_only":  # the auxiliary-only control freezes the LM-only backbone (paper 4)
        ref = train_run(RunSpec("lm_only", "lm_only", 0.0, spec.budget), out, cfg)
        backbone = str(ref.export / "model")
    module = RouterAdaptationModule(model=backbone, tau=cfg.tau, lr=cfg.lr, router_lr=cfg.router_lr, seed=cfg.seed,
                                    **spec.module_kwargs())
    dm = datamodule(cfg, module.tokenizer)
    trainer = pl.Trainer(max_steps=cfg.steps, logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         limit_val_batches=0, enable_progress_bar=cfg.progress, enable_model_summary=False,
                         accelerator="cpu" if not torch.cuda.is_available() else "auto", devices=1)
    t0 = time.perf_counter()
    trainer.fit(module, dm)
    # no validation runs here (limit_val_batches=0): the held-out texts are no val_ids of the export
    module.export(export, training={**cfg.data_settings(), "split": "split_of(text_id, heldout, seed)",
                                    "train_ids": dm.train_ids(), "val_ids": []})
    info = {"settings": settings, "run": asdict(spec), "train_seconds": round(time.perf_counter() - t0, 1),
            "heldout_ids": dm.heldout_ids()}
    atomic_write_json(info_path, info)
    return EvalTarget(spec.name, export, export_train_ids(export), info)


def datamodule(cfg: StudyConfig, tokenizer):
    """The study's data module (set up), tokenised with ``tokenizer``."""
    from expertcast.train.router_data import RouterLMDataModule

    dm = RouterLMDataModule(source=cfg.source, max_length=cfg.max_length, batch_size=cfg.batch_size,
                            heldout=cfg.heldout, limit=cfg.limit, seed=cfg.seed, data_dir=cfg.data_dir)
    dm.tokenizer = tokenizer
    dm.setup("fit")
    return dm


# --------------------------------------------------------------------------------- exports


def _read_export_info(d: Path) -> dict[str, Any]:
    """``export.json`` of a router-adaptation export (manifest verified; carries ``export_hash``)."""
    from expertcast.models.router_export import read_adaptation_export
    from expertcast.train.router_module import EXPORT_FORMAT, EXPORT_FORMAT_VERSION

    if not d.is_dir():
        raise UsageError(f"--exports: {d} is not a folder")
    info = read_adaptation_export(d)
    if info.get("format") != EXPORT_FORMAT or info.get("format_version", 99) > EXPORT_FORMAT_VERSION:
        raise UsageError(f"{d / 'export.json'} is not a router-adaptation export this expertcast reads")
    if "model_dir" not in info:
        raise UsageError(f"{d}: only merged exports (model/) are evaluated here; merge the LoRA adapter first")
    return info


def export_train_ids(d: Path) -> list[str] | None:
    """The ids of the texts an export was trained on (``export.json`` ``training.train_ids``), or None
    when the export records none. Validation texts are not counted: a router fit selects no
    checkpoint by them, so evaluating on them is no leakage."""
    training = _read_export_info(d).get("training")
    ids = training.get("train_ids") if isinstance(training, dict) else None
    return [str(i) for i in ids] if isinstance(ids, list) else None


def given_exports(paths: list[str]) -> list[EvalTarget]:
    """EvalTargets of user-given export folders (named by folder, or by the parent of an ``export``
    folder); a UsageError for a folder that is no export or two exports of one name."""
    out: list[EvalTarget] = []
    for p in paths:
        d = Path(p)
        _read_export_info(d)
        name = d.resolve().parent.name if d.resolve().name == "export" else d.resolve().name
        if any(t.name == name for t in out):
            raise UsageError(f"--exports: two exports are named {name!r}; give folders with distinct names")
        out.append(EvalTarget(name, d, export_train_ids(d)))
    return out


def load_export(d: Path):
    """(model, tokenizer, routers | None, info) of an export directory (no Lightning needed)."""
    from expertcast.models.router_export import load_routers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = _read_export_info(d)
    mdir = d / info["model_dir"]
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32, trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(mdir, trust_remote_code=False)
    routers = None
    if info.get("routers_dir"):
        routers, _ = load_routers(d / info["routers_dir"], model=model)
    return model, tok, routers, info


# --------------------------------------------------------------------------------- evaluation


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


def evaluate_run(target: EvalTarget, examples, B: int, R_values: list[int], cfg: StudyConfig,
                 overlap: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows (one per policy/R) for one export; ``overlap`` is its :func:`check_overlap` result."""
    from expertcast.inference.policies import make_policy
    from expertcast.inference.simulator import simulate
    from expertcast.models.cache_routers import expert_use_stats

    d = target.export
    model, tok, routers, info = load_export(d)
    meta, seqs, rp, lm = record_heldout(model, routers, examples, cfg.batch_size, model_id=str(d))
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
    run = target.run_info.get("run", {})
    for (pname, _, R), r in zip(pols, recs, strict=True):
        loads = r["demand_misses"] + r["proactive_loads"]
        rows.append({
            "run": target.name, "train_mode": info["mode"], "router_mode": rmode or "-", "sw": info.get("sw", 0.0),
            "B": B, "R": R if R is not None else "-", "policy": pname,
            "hit": r["hit"], "adj_hit": r["adj_hit"], "mb_per_token": r["mb_per_token"],
            "mb_per_token_q3": loads * Q3_EXPERT_BYTES / 1e6 / max(r["decoded_tokens"], 1),
            "belady_fraction": r.get("belady_fraction", float("nan")), "heldout_lm": lm,
            "max_freq": use["max_freq"], "topB_mass": use["topb_mass"], "entropy": use["entropy"],
            "decoded_tokens": r["decoded_tokens"], "heldout_texts": overlap["evaluated"],
            "train_overlap": overlap["overlap"], "overlap_allowed": overlap["allowed"], "train_steps": info.get("steps"),
            "train_seconds": target.run_info.get("train_seconds"), "budget_arg": run.get("budget"),
        })
    if cfg.gsm8k:
        acc = gsm8k_accuracy(model, tok, cfg.gsm8k, cfg.data_dir)
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
           "mb_per_token_q3", "heldout_lm", "lm_vs_lm_only_pct", "max_freq", "topB_mass", "entropy", "train_overlap"]


def run_study(cfg: StudyConfig, out: OutputDir, exports: list[EvalTarget] | None = None) -> list[dict[str, Any]]:
    """Train the study's runs (or take ``exports``, from :func:`given_exports`), evaluate each on the
    held-out texts, write the tables and the plot into ``out``; returns every row."""
    from expertcast.models.cache_routers import resolve_budget
    from tqdm.auto import tqdm

    targets = exports or [train_run(s, out, cfg) for s in tqdm(select_runs(cfg), desc="train runs", unit="run")]
    examples = heldout_examples(cfg, targets[0].export)
    evaluated = [e.seq_id for e in examples]
    # refuse leakage before any evaluation work
    overlaps = {t.name: check_overlap(evaluated, t.train_ids, what=f"export {t.export}",
                                      allow_overlap=cfg.allow_overlap) for t in targets}
    rows: list[dict[str, Any]] = []
    for t in tqdm(targets, desc="evaluate runs", unit="run"):
        info = _read_export_info(t.export)
        E = _num_experts(t.export, info)
        B = int(info.get("budget") or resolve_budget(cfg.budget, E))
        Rs = cfg.R or [max(1, int(round(0.75 * B)))]
        rows += _evaluate_cached(t, examples, B, Rs, cfg, overlaps[t.name], out)
        if info.get("mode") == "lm_only":  # the LM-only reference under LRU at every budget of the B sweep
            for b in sorted({resolve_budget(x, E) for x in cfg.budgets} - {B}):
                rows += _evaluate_cached(t, examples, b, [], cfg, overlaps[t.name], out)
    lm_ref = next((r["heldout_lm"] for r in rows if r["train_mode"] == "lm_only"), None)
    for r in rows:
        r["lm_vs_lm_only_pct"] = 100 * (r["heldout_lm"] / lm_ref - 1) if lm_ref else float("nan")
        if not cfg.gsm8k:
            r["gsm8k_acc"] = "n/a (tiny model)"
    add_lru_deltas(rows)
    write_tables(rows, out, len(evaluated), overlaps, cfg.allow_overlap)
    return rows


def heldout_examples(cfg: StudyConfig, export: Path) -> list:
    """The held-out texts evaluated (the first ``cfg.eval_limit`` of the held-out split), tokenised
    with the tokenizer of ``export``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export / _read_export_info(export)["model_dir"], trust_remote_code=False)
    examples = datamodule(cfg, tok).heldout_set
    return examples[: cfg.eval_limit] if cfg.eval_limit else examples


def write_tables(rows: list[dict[str, Any]], out: OutputDir, n_texts: int, overlaps: dict[str, dict[str, Any]],
                 allow_overlap: bool) -> None:
    """Table 2, Table 3 (terminal, JSON, CSV), ``tradeoff.png`` and ``all_rows.json``."""
    base_B = _base_budget(rows)
    leaked = sum(1 for o in overlaps.values() if o["overlap"])
    unknown = sum(1 for o in overlaps.values() if o["overlap"] is None)
    header = (f"{n_texts} held-out texts; training overlap: "
              + ("none" if not leaked and not unknown else
                 f"{leaked} export(s) trained on evaluated texts, {unknown} record no training ids")
              + (" (--allow-overlap)" if allow_overlap else ""))
    t2 = [r for r in rows if r["B"] == base_B and (r["policy"] == "lru" or r["R"] == _table_R(rows, r["run"], base_B))]
    t3 = sorted((r for r in rows if r["train_mode"] == "lm_only"
                 or (r["train_mode"] in ("temporal", "full") and r["sw"] == 0.1)),
                key=lambda r: (r["B"], r["run"], r["policy"] != "lru", str(r["R"])))
    report(t2, title=f"Table 2: modes and sw (B={base_B} per layer, decode-only; {header})",
           json_path=out.file("table2.json"), csv_path=out.file("table2.csv"), columns=COLUMNS)
    report(t3, title=f"Table 3: budget B and refinement R (sw=0.1; LRU on the same weights beside each run; {header})",
           json_path=out.file("table3.json"), csv_path=out.file("table3.csv"), columns=COLUMNS)
    _plot(rows, out.file("tradeoff.png"))
    atomic_write_json(out.file("all_rows.json"), rows)
    print(f"{header}\nwrote {out.path}/table2.csv, table3.csv, tradeoff.png (MB/token: real expert bytes; "
          f"mb_per_token_q3: {Q3_EXPERT_BYTES / 1e6} MB experts)")


def _evaluate_cached(target: EvalTarget, examples, B: int, Rs: list[int], cfg: StudyConfig,
                     overlap: dict[str, Any], out: OutputDir) -> list[dict[str, Any]]:
    """evaluate_run with its rows cached in ``eval/<run>@B<B>[-R<r,..>].json``, reused only when the
    file's settings key matches (a ResumeMismatchError otherwise)."""
    suffix = f"-R{','.join(map(str, Rs))}" if Rs else ""
    cache_file = out.file("eval") / f"{target.name}@B{B}{suffix}.json"
    key = settings_key(export=_read_export_info(target.export)["export_hash"], B=B, R=Rs, gsm8k=cfg.gsm8k, eval_limit=cfg.eval_limit,
                       evaluated_ids=sha256_json([e.seq_id for e in examples]), overlap=overlap,
                       **cfg.data_settings())
    if cache_file.is_file():
        saved = json.loads(cache_file.read_text(encoding="utf-8"))
        check_resume(saved.get("settings"), key, cache_file)
        return saved["rows"]
    rows = evaluate_run(target, examples, B, Rs, cfg, overlap)
    atomic_write_json(cache_file, {"settings": key, "rows": rows})
    return rows


def _num_experts(d: Path, info: dict[str, Any]) -> int:
    cfg = json.loads((d / info["model_dir"] / "config.json").read_text())
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if k in cfg:
            return int(cfg[k])
    raise UsageError(f"{d}/{info['model_dir']}/config.json names no expert count")

