"""`expertcast router-eval`: cache-aware router adaptation, every mode through the offloading runtime.

Trains the study's runs on the default model (or takes ``--exports``) and runs each through the
runtime on its own greedy decoding of held-out benchmark prompts (``--benchmark``, arith by default),
paired with the full-load run of the same weights: Hit, AdjHit, MB/token, tokens/s and % of full-load
tokens/s, accuracy, held-out LM loss and greedy agreement with the LM-only run, for LRU, static (LM-only
run) and the run's live router policy (R sweep). Prompts and texts are held out (checked against every
export's training texts; ``--allow-overlap`` to evaluate anyway, reported in every row). Writes Table
2/3-style tables (CSV/JSON), a PNG, and logs the table to W&B with ``--wandb``.

The study, step by step. For each run (an export of :class:`~expertcast.train.router_module.RouterAdaptationModule`, trained
here when missing: short CPU runs on the default model, resumable run by run) the study measures, on
the same weights:

1. the **full-load run**: greedy decoding of held-out benchmark prompts (``benchmark``: ``arith`` by
   default; ``gsm8k``/``math500`` when asked) by the plain model: its completions, accuracy (exact
   grading) and decode tokens/s;
2. the **offloaded runs**: the same prompts through :class:`~expertcast.inference.runtime.engine.OffloadedModel`
   with B slots per MoE layer under LRU (every run: the router-vs-backbone comparison on the same
   weights), static placement (the LM-only run; calibrated on the held-out texts' routing) and the
   run's router policy with its routers attached live (:mod:`expertcast.inference.runtime.live_routers`:
   Algorithm 1 for ``temporal``, Algorithm 2 at each top-R for ``full``, the spatio-only refinement),
   each reporting decode-only Hit, AdjHit, MB/token (the model's expert bytes, and Qwen3-30B-A3B's
   9.44 MB), tokens/s and % of the full-load tokens/s, accuracy, and whether its tokens equal the
   full-load run's (they must: offloading never changes a token);
3. the held-out **LM loss** (teacher-forced, token mean over the gold solutions of held-out texts) and
   the concentration of native expert use on them (max frequency, top-B mass, entropy);
4. the **greedy agreement** of its full-load completions with the LM-only run's (token by position).

The gold-text simulation of earlier versions is gone: every cache figure now comes from the model's
own decoding in the runtime.

Held-out data only: the LM texts are the data module's held-out split (by a hash of each text's id,
:mod:`expertcast.train.router_data`) and the prompts are the benchmark's test problems; both are
checked against every export's training texts (:func:`expertcast.utils.provenance.check_overlap` on the ids;
an export that records no training ids is refused unless overlap is allowed), and every prompt's question
is searched in the export's recorded training texts (:mod:`expertcast.train.router_leakage`). Every row
carries ``train_overlap``, ``prompt_overlap`` and ``overlap_allowed``.

Prompts are decoded ``decode_batch_size`` at a time (default 1: each sequence owns the B slots of a layer, the
paper's setting; with n sequences a layer serves the union of up to n*K experts and the hit rate measures
that union more than the policy). :func:`combine_seeds` merges finished studies of different seeds (mean and
max - min spread per metric, ``table2_seeds.csv``).

Outputs in the output folder: ``runs/<name>/export`` and ``runs/<name>/run.json`` (runs trained here),
``eval/`` (rows and completions cached per export and B, each with its settings key), ``table2.{csv,json}``
(base B: every run under LRU and its router policy, R sweep included), ``table3.{csv,json}`` (other
budgets, when swept), ``table2.png`` (Hit and MB/token per row; Hit against held-out LM loss) and
``all_rows.json``. ``d_hit_vs_lru_pts`` compares a row with LRU on the *same* weights (the router's own
gain), ``d_hit_vs_lm_only_lru_pts`` with LRU on the LM-only weights (the total gain: router plus the
backbone's more concentrated expert use).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.commands.common import (
    CommandParser,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    resolve_model,
    run_command,
)
from expertcast.commands.router_study import (
    STUDY,
    EvalTarget,
    RunSpec,
    StudyConfig,
    combine_seeds,
    select_runs,
    write_seed_table,
)
from expertcast.utils.errors import UsageError
from expertcast.utils.io import atomic_write_json, report
from expertcast.utils.outdir import OutputDir
from expertcast.utils.provenance import check_overlap, check_resume, settings_key, sha256_json

PROG = "expertcast router-eval"


def heldout_fraction(text: str) -> float:
    """argparse type: a fraction in (0, 1)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text!r}") from None
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text} (texts are held out by a hash "
                                         f"of their id; a count is no longer accepted)")
    return v


def build_parser() -> CommandParser:
    p = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--model", default=None,
                   help="backbone of the runs trained here: tiny-default/default (when omitted), a tiny preset or a "
                        "model folder; with --exports, the base every export must have been adapted from")
    p.add_argument("--out", default="runs/router-eval", help="output folder (exports, tables, plot); reused to resume")
    p.add_argument("--overwrite", action="store_true", help="remove this command's earlier output in --out first")
    p.add_argument("--exports", nargs="+", default=None, metavar="DIR",
                   help="evaluate these router-adaptation exports only (no training)")
    p.add_argument("--combine", nargs="+", default=None, metavar="STUDY",
                   help="no training or evaluation: combine finished router-eval outputs of different --seed values "
                        "into table2_seeds.csv (mean and spread of every metric) in --out")
    p.add_argument("--steps", type=positive_int, default=150, help="optimizer steps per training run")
    p.add_argument("--budget", type=positive_float, default=0.25,
                   help="per-layer router budget B of the base runs: a fraction of E (< 1) or a number of experts")
    p.add_argument("--budgets", type=positive_float, nargs="*", default=[],
                   help="B sweep (each value trains temporal and full runs)")
    p.add_argument("--sw", type=nonneg_float, default=0.1,
                   help="coverage-loss weight of the base runs (every mode: temporal, full, spatio_only, aux)")
    p.add_argument("--sw-sweep", type=nonneg_float, nargs="*", default=[0.3, 1.0, 2.0],
                   help="coverage-loss weights sw of the sweep (temporal and full runs)")
    p.add_argument("--R", type=positive_int, nargs="+", default=[2, 4, 6, 8],
                   help="top-R values of the full/spatio policies (values above B are skipped)")
    p.add_argument("--modes", nargs="*", default=None, help="train/evaluate only these run names; when omitted: every run of the study")
    p.add_argument("--tau", type=positive_float, default=0.02, help="temperature of the soft top-B coverage loss")
    p.add_argument("--lr", type=positive_float, default=5e-4, help="backbone learning rate")
    p.add_argument("--router-lr", type=positive_float, default=3e-3, help="learning rate of the cache routers")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="texts per batch (training and the held-out LM-loss pass)")
    p.add_argument("--decode-batch-size", type=positive_int, default=1,
                   help="prompts decoded together through the runtime; 1: each sequence owns the B slots of a "
                        "layer (the paper's setting); n > 1: a layer serves the union of n selections")
    p.add_argument("--max-length", type=positive_int, default=320, help="tokens per text (prompt + solution)")
    p.add_argument("--heldout", type=heldout_fraction, default=0.05,
                   help="fraction of the texts held out, chosen by a hash of each text's id (stable under --limit)")
    p.add_argument("--eval-limit", type=nonneg_int, default=96,
                   help="held-out LM loss on the first N held-out texts (0: all of them)")
    p.add_argument("--benchmark", default="arith",
                   help="benchmark whose test prompts every run decodes greedily (accuracy): arith, gsm8k, math500")
    p.add_argument("--prompts", type=positive_int, default=32, help="decode the first N test prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="generated tokens per prompt at most")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N texts of the source")
    p.add_argument("--source", default="gsm8k",
                   help="LM text source: gsm8k, math500, arith (the benchmark's train split), a datasets Hub id or a "
                        "local .json/.jsonl/.parquet/.txt file")
    p.add_argument("--data-dir", default=None, help="local benchmark folder; when omitted: $EXPERTCAST_DATA_DIR, else ../shared/data")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of training, data order and held-out split")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads; when omitted: torch's choice")
    p.add_argument("--allow-overlap", action="store_true",
                   help="evaluate even when an export was trained on evaluated texts (reported in every row)")
    p.add_argument("--allow-model-mismatch", action="store_true",
                   help="with --exports and --model: evaluate an export adapted from another base model (reported)")
    p.add_argument("--progress", action="store_true", help="Lightning progress bars while training")
    p.add_argument("--wandb", action="store_true", help="log the tables to W&B")
    p.add_argument("--wandb-project", default="expertcast-router", help="W&B project")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from expertcast.utils.outdir import claim_output_dir

        if args.combine:
            if len(args.combine) < 2:
                raise UsageError("--combine needs two or more router-eval outputs (one per seed)")
            studies = [Path(s) for s in args.combine]
            rows = combine_seeds(studies)  # bad input fails before the output folder is claimed
            with claim_output_dir(args.out, "router-eval-seeds", overwrite=args.overwrite) as out:
                write_seed_table(rows, studies, out)
            return 0
        from expertcast.data.benchmarks import load_benchmark

        cfg = StudyConfig(
            model=args.model or "default", steps=args.steps, budget=args.budget, budgets=list(args.budgets),
            sw=args.sw, sw_sweep=list(args.sw_sweep), R=list(args.R), modes=args.modes or None, tau=args.tau, lr=args.lr,
            router_lr=args.router_lr, batch_size=args.batch_size,
            decode_batch_size=args.decode_batch_size, max_length=args.max_length, heldout=args.heldout,
            eval_limit=args.eval_limit or None, limit=args.limit, source=args.source, data_dir=args.data_dir,
            benchmark=args.benchmark, prompts=args.prompts, max_new_tokens=args.max_new_tokens, seed=args.seed,
            progress=args.progress, allow_overlap=args.allow_overlap, wandb=args.wandb,
            wandb_project=args.wandb_project)
        # input errors (exports, run names, model) fail before the output folder is claimed
        exports = given_exports(args.exports) if args.exports else None
        guards = check_export_models(exports, args.model, args.seed, args.allow_model_mismatch) \
            if exports is not None and args.model is not None else {}
        load_benchmark(args.benchmark, "test", data_dir=args.data_dir, limit=args.prompts)  # unknown/missing: exit 2
        if exports is None:
            select_runs(cfg)
            cfg.model = resolve_model(cfg.model)
        if args.threads:
            torch.set_num_threads(args.threads)
        with claim_output_dir(args.out, "router-eval", overwrite=args.overwrite) as out:
            run_study(cfg, out, exports=exports, guards=guards)
        return 0

    return run_command(PROG, body)


# --------------------------------------------------------------------------------- the study
Q3_EXPERT_BYTES = 9_440_000
"""One Qwen3-30B-A3B expert in bf16 (docs/design.md "Anchors"), for the second MB/token column."""


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


# --------------------------------------------------------------------------------- held-out text


@torch.no_grad()
def heldout_pass(model, examples, batch_size: int = 8, model_id: str = "model"):
    """Teacher-forced pass over held-out texts: (TraceMeta, [TraceSequence], LM loss).

    LM loss: mean token cross-entropy over the completion tokens. The traces (native routing of every
    position) calibrate the static policy and give the concentration of expert use."""
    from expertcast.data.trace_format import TraceMeta, TraceSequence
    from expertcast.models.routing import record_routing
    from expertcast.models.spec import MoESpec
    from expertcast.train.router_data import collate

    spec = MoESpec.from_model(model)
    seqs = []
    nll, ntok = 0.0, 0
    with record_routing(model) as rr:
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            b = collate(chunk, 0)
            B, T = b["input_ids"].shape
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
            ids, w, _ = rr.pop()
            lab = b["labels"][:, 1:]
            ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                   lab.reshape(-1), ignore_index=-100, reduction="sum")
            nll += float(ce)
            ntok += int((lab != -100).sum())
            L, K = ids.shape[1], ids.shape[2]
            ids, w = ids.view(B, T, L, K), w.view(B, T, L, K)
            for j, ex in enumerate(chunk):
                n = len(ex.ids)
                seqs.append(TraceSequence(ex.seq_id or f"heldout-{i + j:05d}", np.asarray(ex.ids, np.int32),
                                          len(ex.prompt_ids), ids[j, :n].numpy().astype(np.int16),
                                          w[j, :n].numpy().astype(np.float16)))
    meta = TraceMeta(model_id=model_id, num_layers=spec.num_layers, num_experts=spec.num_experts, top_k=spec.top_k,
                     expert_bytes=spec.expert_bytes, moe_layers=spec.moe_layers, dataset="heldout")
    return meta, seqs, nll / max(ntok, 1)


# --------------------------------------------------------------------------------- decoding


def prompt_batches(tok, problems, batch_size: int) -> list[list]:
    """The prompts in batches of ``batch_size`` (left padding set on ``tok``, the pad token defaulting to EOS)."""
    from expertcast.inference.runtime.eval_run import pad_left

    pad_left(tok)
    return [problems[i : i + batch_size] for i in range(0, len(problems), batch_size)]


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean over prompts of the fraction of positions (of the longer completion) where ``a`` and ``b``
    generated the same token."""
    fr = [sum(x == y for x, y in zip(p, q, strict=False)) / max(len(p), len(q), 1) for p, q in zip(a, b, strict=True)]
    return float(np.mean(fr)) if fr else float("nan")


# --------------------------------------------------------------------------------- one export


def study_policies(info: dict[str, Any], B: int, Rs: list[int], static_calibration) -> list[tuple[str, Any, Any]]:
    """(policy name, policy, R) evaluated on one export: LRU, static (LM-only run), the run's router policy
    (at every R <= B for the pre-access policies)."""
    from expertcast.inference.policies import make_policy

    pols: list[tuple[str, Any, Any]] = [("lru", make_policy("lru"), "-")]
    rmode = info.get("router_mode")
    if info.get("mode") == "lm_only":
        pols.append(("static", make_policy("static", calibration=static_calibration), "-"))
    if rmode == "temporal":
        pols.append(("router-temporal", make_policy("router-temporal"), "-"))
    elif rmode in ("full", "spatio_only"):
        name = "router-full" if rmode == "full" else "router-spatio"
        pols += [(name, make_policy(name, R=R), R) for R in Rs if R <= B]
    return pols


def evaluate_run(target: EvalTarget, examples, problems, B: int, cfg: StudyConfig,
                 overlap: dict[str, Any]) -> dict[str, Any]:
    """Rows (one per policy/R) and the full-load completions of one export; ``overlap`` is its
    :func:`check_overlap` result."""
    from expertcast.inference.cache.expert_cache import Budget
    from expertcast.inference.runtime.eval_run import eos_ids
    from expertcast.inference.runtime.session import ModelSession, SessionSettings
    from expertcast.models.backbone import load_adaptation_export
    from expertcast.models.cache_routers import expert_use_stats

    model, tok, _, info = load_adaptation_export(target.export)
    meta, seqs, lm = heldout_pass(model, examples, cfg.batch_size, model_id=str(target.export))
    dec = np.concatenate([s.decode_expert_ids for s in seqs]).astype(np.int64)
    use = expert_use_stats(torch.from_numpy(dec), meta.num_experts, B)
    eos = eos_ids(model, tok)
    batches = prompt_batches(tok, problems, cfg.decode_batch_size)
    session = ModelSession.of_model(SessionSettings(model=str(target.export), model_path=str(target.export),
                                                    device=str(next(model.parameters()).device)), model, tok)
    full = session.decode_full_load(batches, benchmark=cfg.benchmark, max_new_tokens=cfg.max_new_tokens, eos=eos)
    rows = []
    run = target.run_info.get("run", {})
    for pname, policy, R in study_policies(info, B, cfg.R, seqs):
        off = session.decode(policy, Budget.slots(B), batches, benchmark=cfg.benchmark,
                             max_new_tokens=cfg.max_new_tokens, eos=eos)
        A, D, P = off.counters["accesses"], off.counters["demand"], off.counters["proactive"]
        ntok = max(off.decoded_tokens, 1)
        rows.append({
            "run": target.name, "train_mode": info["mode"], "router_mode": info.get("router_mode") or "-",
            "sw": info.get("sw", 0.0), "seed": cfg.seed, "B": B, "R": R, "policy": pname,
            "hit": 1 - D / A if A else float("nan"), "adj_hit": (A - D) / (A + P) if A else float("nan"),
            "mb_per_token": (D + P) * meta.expert_bytes / 1e6 / ntok, "mb_per_token_q3": (D + P) * Q3_EXPERT_BYTES / 1e6 / ntok,
            "tokens_per_s": off.tokens_per_s, "full_tokens_per_s": full.tokens_per_s,
            "pct_full": 100 * off.tokens_per_s / full.tokens_per_s if full.tokens_per_s > 0 else float("nan"),
            "accuracy": off.accuracy, "full_accuracy": full.accuracy, "identical_to_full": off.completions == full.completions,
            "heldout_lm": lm, "max_freq": use["max_freq"], "topB_mass": use["topb_mass"], "entropy": use["entropy"],
            "prompts": len(problems), "decoded_tokens": off.decoded_tokens, "heldout_texts": len(examples),
            "train_overlap": overlap["overlap"], "prompt_overlap": overlap.get("prompt_overlap"),
            "overlap_allowed": overlap["allowed"], "decode_batch_size": cfg.decode_batch_size, "train_steps": info.get("steps"),
            "train_seconds": target.run_info.get("train_seconds"), "budget_arg": run.get("budget"),
        })
    return {"rows": rows, "completions": full.completions}


# --------------------------------------------------------------------------------- report


def _base_budget(rows) -> int:
    """The budget most rows were evaluated at (the study's base B)."""
    return max((r["B"] for r in rows), key=lambda b: sum(1 for r in rows if r["B"] == b))


def _table_R(rows, run: str, B: int):
    """The R a one-row summary shows for ``run``: of the R values evaluated, the one closest to 0.75*B
    (the paper's ratio, R=15 of B=20; ties to the larger); "-" for runs without R."""
    Rs = sorted({r["R"] for r in rows if r["run"] == run and r["B"] == B and r["R"] != "-"})
    if not Rs:
        return "-"
    return min(Rs, key=lambda R: (abs(R - 0.75 * B), -R))


def add_lru_deltas(rows: list[dict[str, Any]]) -> None:
    """``d_hit_vs_lru_pts``: a row's hit minus LRU's hit on the same export and B (percentage points), the
    router's own gain; ``d_hit_vs_lm_only_lru_pts``: minus the LM-only run's LRU at that B (router plus
    backbone). NaN where the reference was not evaluated."""
    lru = {(r["run"], r["B"]): r["hit"] for r in rows if r["policy"] == "lru"}
    ref = {r["B"]: r["hit"] for r in rows if r["policy"] == "lru" and r.get("train_mode") == "lm_only"}
    for r in rows:
        same = lru.get((r["run"], r["B"]))
        r["d_hit_vs_lru_pts"] = 100 * (r["hit"] - same) if same is not None else float("nan")
        base = ref.get(r["B"])
        r["d_hit_vs_lm_only_lru_pts"] = 100 * (r["hit"] - base) if base is not None else float("nan")


def add_lm_only_refs(rows: list[dict[str, Any]], completions: dict[str, list[list[int]]]) -> None:
    """``lm_vs_lm_only_pct`` (held-out LM loss change against the LM-only run) and ``agree_lm_only`` (greedy
    agreement of the run's completions with the LM-only run's); NaN without an LM-only run."""
    lm_run = next((r for r in rows if r["train_mode"] == "lm_only"), None)
    for r in rows:
        if lm_run is None:
            r["lm_vs_lm_only_pct"] = r["agree_lm_only"] = float("nan")
            continue
        r["lm_vs_lm_only_pct"] = 100 * (r["heldout_lm"] / lm_run["heldout_lm"] - 1)
        r["agree_lm_only"] = greedy_agreement(completions[r["run"]], completions[lm_run["run"]])


COLUMNS = ["run", "policy", "sw", "B", "R", "hit", "d_hit_vs_lru_pts", "d_hit_vs_lm_only_lru_pts", "adj_hit",
           "mb_per_token", "mb_per_token_q3", "tokens_per_s", "pct_full", "accuracy", "identical_to_full", "heldout_lm",
           "lm_vs_lm_only_pct", "agree_lm_only", "topB_mass", "train_overlap"]


def check_export_models(exports: list[EvalTarget], model: str, seed: int,
                        allow_model_mismatch: bool) -> dict[str, dict[str, Any]]:
    """The model-identity guard (:func:`~expertcast.utils.fitted_on.check_fitted_on`) of every given export: its
    base against ``--model`` (a preset built with ``seed``); exit 2 on another base unless allowed.
    ``{export name: result}``."""
    from expertcast.models.backbone import model_identity
    from expertcast.models.router_export import router_fitted_on
    from expertcast.utils.fitted_on import check_fitted_on, guard_note

    scored = model_identity(resolve_model(model), init_seed=seed)
    guards = {t.name: check_fitted_on(router_fitted_on(t.export), None, scored, scored=f"--model {model}",
                                      allow_model_mismatch=allow_model_mismatch,
                                      mismatch_hint="give --model the export's base or pass --allow-model-mismatch "
                                                    "(reported in every row)")
              for t in exports}
    note = guard_note(guards)
    if note:
        print(f"router-eval: guard: {note}")
    return guards


def run_study(cfg: StudyConfig, out: OutputDir, exports: list[EvalTarget] | None = None,
              guards: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Train the study's runs (or take ``exports``, from :func:`given_exports`), evaluate each through the
    runtime, write the tables and the plot into ``out``; returns every row (with ``guards``, the
    :func:`check_export_models` result of given exports: ``model_match`` per row)."""
    from expertcast.data.benchmarks import load_benchmark
    from expertcast.models.cache_routers import resolve_budget
    from tqdm.auto import tqdm

    problems = load_benchmark(cfg.benchmark, "test", data_dir=cfg.data_dir, limit=cfg.prompts)
    targets = exports or [train_run(s, out, cfg) for s in tqdm(select_runs(cfg), desc="train runs", unit="run")]
    examples = heldout_examples(cfg, targets[0].export)
    evaluated = [e.seq_id for e in examples] + [p.id for p in problems]
    # refuse leakage before any evaluation work: evaluated ids against the training ids, and the prompts'
    # questions against the recorded training texts (train/router_leakage.py)
    overlaps = {t.name: {**check_overlap(evaluated, t.train_ids, what=f"export {t.export}",
                                         allow_overlap=cfg.allow_overlap),
                         **prompt_leakage(problems, t.export, cfg)} for t in targets}
    rows: list[dict[str, Any]] = []
    completions: dict[str, list[list[int]]] = {}
    for t in tqdm(targets, desc="evaluate runs", unit="run"):
        info = _read_export_info(t.export)
        E = _num_experts(t.export, info)
        budgets = [int(info.get("budget") or resolve_budget(cfg.budget, E))]
        if info.get("mode") == "lm_only":  # the LM-only reference at every budget of the B sweep
            budgets += sorted({resolve_budget(x, E) for x in cfg.budgets} - set(budgets))
        for B in budgets:
            got = _evaluate_cached(t, examples, problems, B, cfg, overlaps[t.name], out)
            if guards and t.name in guards:
                for r in got["rows"]:
                    r.update(model_match=guards[t.name]["model_match"],
                             model_mismatch_allowed=guards[t.name]["model_mismatch_allowed"])
            rows += got["rows"]
            completions[t.name] = got["completions"]
    add_lm_only_refs(rows, completions)
    add_lru_deltas(rows)
    write_tables(rows, out, len(examples), len(problems), overlaps, cfg, [t.export for t in targets])
    return rows


_TRAINING_TEXTS: dict[str, list[str]] = {}
"""Training texts reloaded for the leakage check, by the JSON of their source fields (exports of one study
share them)."""


def prompt_leakage(problems, export: Path, cfg: StudyConfig) -> dict[str, Any]:
    """:func:`expertcast.train.router_leakage.check_prompt_leakage` of the prompts against ``export``'s recorded
    training texts (reloaded once per source): ``{"prompt_overlap", "leaked_prompts", "allowed"}``; an
    OverlapError when they leak and ``cfg.allow_overlap`` is off."""
    from expertcast.train.router_leakage import check_prompt_leakage, recorded_training, training_texts

    training = recorded_training(export)
    texts = None
    if training is not None:
        key = json.dumps({k: training.get(k) for k in ("source", "dataset_split", "text_field", "dataset_config",
                                                       "limit", "train_ids", "val_ids")}, sort_keys=True)
        if key not in _TRAINING_TEXTS:
            try:
                _TRAINING_TEXTS[key] = training_texts(training, data_dir=cfg.data_dir)
            except (FileNotFoundError, ValueError):
                _TRAINING_TEXTS[key] = None  # check_prompt_leakage reloads and says why
        texts = _TRAINING_TEXTS[key]
    got = check_prompt_leakage(problems, export, allow_overlap=cfg.allow_overlap, data_dir=cfg.data_dir, texts=texts)
    return {"prompt_overlap": got["prompt_overlap"], "leaked_prompts": got["leaked_prompts"]}


def heldout_examples(cfg: StudyConfig, export: Path) -> list:
    """The held-out texts of the LM loss (the first ``cfg.eval_limit`` of the held-out split), tokenised
    with the tokenizer of ``export``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export / _read_export_info(export)["model_dir"], trust_remote_code=False)
    examples = datamodule(cfg, tok).heldout_set
    return examples[: cfg.eval_limit] if cfg.eval_limit else examples


def write_tables(rows: list[dict[str, Any]], out: OutputDir, n_texts: int, n_prompts: int,
                 overlaps: dict[str, dict[str, Any]], cfg: StudyConfig, exports: list[Path] = ()) -> None:
    """Table 2 (base B), Table 3 (other budgets), ``table2.png``, ``all_rows.json``; W&B when asked (the run
    declares the evaluated ``exports`` as its inputs)."""
    base_B = _base_budget(rows)
    leaked = sum(1 for o in overlaps.values() if o["overlap"] or o.get("prompt_overlap"))
    unknown = sum(1 for o in overlaps.values() if o["overlap"] is None or o.get("prompt_overlap", 0) is None)
    header = (f"{n_prompts} {cfg.benchmark} test prompts decoded greedily through the runtime "
              f"({cfg.decode_batch_size} per batch), LM loss on {n_texts} "
              f"held-out texts; training overlap: "
              + ("none" if not leaked and not unknown else
                 f"{leaked} export(s) trained on evaluated texts or prompts, {unknown} record no training ids")
              + (" (--allow-overlap)" if cfg.allow_overlap else ""))
    t2 = [r for r in rows if r["B"] == base_B]
    t3 = sorted((r for r in rows if r["B"] != base_B), key=lambda r: (r["B"], r["run"], r["policy"] != "lru"))
    report(t2, title=f"Table 2: modes through the runtime (B={base_B} per layer, decode-only, seed {cfg.seed}; {header})",
           json_path=out.file("table2.json"), csv_path=out.file("table2.csv"), columns=COLUMNS)
    if t3:
        report(t3, title=f"Table 3: other budgets B (LRU on the same weights beside each run; {header})",
               json_path=out.file("table3.json"), csv_path=out.file("table3.csv"), columns=COLUMNS)
    _plot(t2, out.file("table2.png"), base_B)
    atomic_write_json(out.file("all_rows.json"), rows)
    atomic_write_json(out.file(STUDY), {"settings": cfg.study_settings()})
    if cfg.wandb:
        _log_wandb(rows, cfg, out.path / "table2.png", exports)
    print(f"{header}\nwrote {out.path}/table2.csv, table2.png, all_rows.json (MB/token: real expert bytes; "
          f"mb_per_token_q3: {Q3_EXPERT_BYTES / 1e6} MB experts)")


def _label(r: dict[str, Any]) -> str:
    return f"{r['run']}+{r['policy']}" + (f" R={r['R']}" if r["R"] != "-" else "")


def _plot(rows: list[dict[str, Any]], path: Path, B: int) -> None:
    """PNG: Hit and MB/token per row (left, middle); Hit against held-out LM loss (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from expertcast.utils.io import save_figure

    labels = [_label(r) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    axes[0].barh(labels, [100 * r["hit"] for r in rows])
    axes[0].set_xlabel("decode hit rate (%)")
    axes[1].barh(labels, [r["mb_per_token"] for r in rows])
    axes[1].set_xlabel("MB / token (real expert bytes)")
    axes[1].set_yticklabels([])
    for r in rows:
        marker = "x" if r["policy"] in ("lru", "static") else "o"
        axes[2].scatter(r["heldout_lm"], 100 * r["hit"], marker=marker)
        axes[2].annotate(_label(r), (r["heldout_lm"], 100 * r["hit"]), fontsize=6)
    lm_ref = next((r["heldout_lm"] for r in rows if r["train_mode"] == "lm_only"), None)
    if lm_ref:
        axes[2].axvline(lm_ref * 1.02, color="grey", linestyle=":", label="LM-only loss +2%")
        axes[2].legend(fontsize=7)
    axes[2].set_xlabel("held-out LM loss")
    axes[2].set_ylabel("decode hit rate (%)")
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(f"cache-aware routers through the runtime, B={B} per layer (x: LRU/static, o: router policy)")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def _log_wandb(rows: list[dict[str, Any]], cfg: StudyConfig, png: Path | None = None, exports: list[Path] = ()) -> None:
    import wandb
    from expertcast.data.lineage import use_inputs
    from expertcast.utils.tracking import start_wandb_run

    run = start_wandb_run(cfg.wandb_project, {**asdict(cfg)}, job_type="router-eval", name=f"router-eval-s{cfg.seed}")
    use_inputs(run, [(d, "router", _read_export_info(d)["export_hash"]) for d in exports])
    table = wandb.Table(columns=COLUMNS, data=[[_cell(r.get(c)) for c in COLUMNS] for r in rows])
    run.log({"router_eval/table2": table})
    if png is not None:
        from expertcast.utils.tracking import log_image

        log_image(run, "router_eval/plot", png)
    run.finish()


def _cell(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def _evaluate_cached(target: EvalTarget, examples, problems, B: int, cfg: StudyConfig, overlap: dict[str, Any],
                     out: OutputDir) -> dict[str, Any]:
    """evaluate_run with its rows and completions cached in ``eval/<run>@B<B>.json``, reused only when the
    file's settings key matches (a ResumeMismatchError otherwise)."""
    cache_file = out.file("eval") / f"{target.name}@B{B}.json"
    key = settings_key(export=_read_export_info(target.export)["export_hash"], B=B, R=cfg.R, eval_limit=cfg.eval_limit,
                       evaluated_ids=sha256_json([e.seq_id for e in examples]),
                       prompt_ids=sha256_json([p.id for p in problems]), overlap=overlap,
                       **cfg.decode_settings(), **cfg.data_settings())
    if cache_file.is_file():
        saved = json.loads(cache_file.read_text(encoding="utf-8"))
        check_resume(saved.get("settings"), key, cache_file)
        return saved
    got = evaluate_run(target, examples, problems, B, cfg, overlap)
    atomic_write_json(cache_file, {"settings": key, **got})
    return got


def _num_experts(d: Path, info: dict[str, Any]) -> int:
    cfg = json.loads((d / info["model_dir"] / "config.json").read_text())
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if k in cfg:
            return int(cfg[k])
    raise UsageError(f"{d}/{info['model_dir']}/config.json names no expert count")


