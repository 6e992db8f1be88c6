"""The router study of ``expertcast router-eval``: its settings (:class:`StudyConfig`), its training runs and the
exports it evaluates, and the combination of finished studies over seeds (:func:`combine_seeds`).

The study itself (training, decoding through the runtime, tables) is :mod:`expertcast.commands.router_eval`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.utils.errors import UsageError
from expertcast.utils.io import atomic_write_json, report
from expertcast.utils.outdir import OutputDir
from expertcast.utils.provenance import settings_key


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
    sw: float = 0.1
    """Coverage-loss weight of the base runs (every mode; the paper's Table 2 uses 0.1)."""
    sw_sweep: list[float] = field(default_factory=lambda: [0.3, 1.0, 2.0])
    R: list[int] = field(default_factory=lambda: [2, 4, 6, 8])
    """Top-R values of the full/spatio policies (those above B are skipped)."""
    modes: list[str] | None = None
    """Only these run names (None: the whole study)."""
    tau: float = 0.02
    lr: float = 5e-4
    router_lr: float = 3e-3
    batch_size: int = 8
    """Texts per batch of training and of the held-out LM-loss pass."""
    decode_batch_size: int = 1
    """Prompts decoded together through the runtime. 1 (default): each sequence owns the B slots of a layer,
    the setting of the paper's Hit/AdjHit; with n > 1 a layer serves the union of n selections (up to n*K
    experts for B slots), so hit rates mostly measure that union, not what a policy retains."""
    max_length: int = 320
    heldout: float = 0.05
    """Fraction of the texts held out (by a hash of each text's id)."""
    eval_limit: int | None = 96
    """Held-out LM loss on the first N held-out texts (None: all of them)."""
    benchmark: str = "arith"
    """Benchmark whose test prompts are decoded (accuracy)."""
    prompts: int = 32
    """Decode the first N test prompts of the benchmark."""
    max_new_tokens: int = 64
    """Generated tokens per prompt at most."""
    limit: int | None = None
    """Use only the first N texts of the source."""
    source: str = "gsm8k"
    data_dir: str | None = None
    seed: int = 0
    progress: bool = False
    allow_overlap: bool = False
    """Evaluate even when an export trained on evaluated texts (reported in every row)."""
    wandb: bool = False
    """Log the tables to W&B."""
    wandb_project: str = "expertcast-router"

    def decode_settings(self) -> dict[str, Any]:
        """What selects and decodes the benchmark prompts."""
        return {"benchmark": self.benchmark, "prompts": self.prompts, "max_new_tokens": self.max_new_tokens,
                "decode_batch_size": self.decode_batch_size}

    def data_settings(self) -> dict[str, Any]:
        """What selects and tokenises the texts."""
        return {"source": self.source, "limit": self.limit, "heldout": self.heldout, "seed": self.seed,
                "max_length": self.max_length}

    def study_settings(self) -> dict[str, Any]:
        """Every setting that shapes the study's tables (``study.json``; :func:`combine_seeds` requires all
        but ``seed`` to match): the config less progress bars, W&B and where the data lives."""
        return {k: v for k, v in sorted(asdict(self).items()) if k not in NOT_STUDY_SETTINGS}

    def train_settings(self, spec: RunSpec) -> dict[str, Any]:
        """Everything a trained run's weights depend on (the resume key of ``runs/<name>``)."""
        return settings_key(model=self.model, steps=self.steps, tau=self.tau, lr=self.lr, router_lr=self.router_lr,
                            batch_size=self.batch_size, run=asdict(spec), **self.data_settings())


STUDY = "study.json"
"""The study's settings (:meth:`StudyConfig.study_settings`), written beside its tables."""
NOT_STUDY_SETTINGS = ("progress", "wandb", "wandb_project", "data_dir")


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


def study_runs(sw_sweep: list[float], budgets: list[float], base_budget: float, base_sw: float = 0.1) -> list[RunSpec]:
    """The default study: every mode at the base ``base_sw`` (paper Table 2: 0.1), the sw sweep for
    temporal/full, the B sweep (at ``base_sw``)."""
    sw0 = f"{base_sw:g}"
    runs = [
        RunSpec("lm_only", "lm_only", 0.0, base_budget),
        RunSpec(f"aux_temporal_sw{sw0}", "aux_only", base_sw, base_budget, "temporal"),
        RunSpec(f"aux_full_sw{sw0}", "aux_only", base_sw, base_budget, "full"),
        RunSpec(f"temporal_sw{sw0}", "temporal", base_sw, base_budget),
        RunSpec(f"full_sw{sw0}", "full", base_sw, base_budget),
        RunSpec(f"spatio_sw{sw0}", "spatio_only", base_sw, base_budget),
    ]
    for sw in sw_sweep:
        runs += [RunSpec(f"temporal_sw{sw:g}", "temporal", sw, base_budget), RunSpec(f"full_sw{sw:g}", "full", sw, base_budget)]
    for b in budgets:
        if b != base_budget:
            runs += [RunSpec(f"temporal_B{b:g}", "temporal", base_sw, b), RunSpec(f"full_B{b:g}", "full", base_sw, b)]
    return list({r.name: r for r in runs}.values())


def select_runs(cfg: StudyConfig) -> list[RunSpec]:
    """The study's runs, restricted to ``cfg.modes`` (a UsageError names unknown run names)."""
    specs = study_runs(cfg.sw_sweep, cfg.budgets, cfg.budget, cfg.sw)
    if cfg.modes:
        unknown = sorted(set(cfg.modes) - {s.name for s in specs})
        if unknown:
            raise UsageError(f"--modes: unknown run names {', '.join(unknown)}; known: "
                             f"{', '.join(s.name for s in specs)}")
        specs = [s for s in specs if s.name in cfg.modes]
    return specs


# -- seeds: finished studies combined ----------------------------------------------------------------------
SPREAD_METRICS = ("hit", "d_hit_vs_lru_pts", "d_hit_vs_lm_only_lru_pts", "adj_hit", "mb_per_token", "accuracy",
                  "heldout_lm", "lm_vs_lm_only_pct")
"""Metrics :func:`combine_seeds` reports as mean and spread (max - min over the seeds)."""


def combine_seeds(studies: list[Path]) -> list[dict[str, Any]]:
    """One row per (run, policy, B, R) present in every study folder of ``studies`` (each a finished
    ``router-eval`` output, ``table2.json``): ``seeds``, and per metric of :data:`SPREAD_METRICS` its mean
    (``<metric>``), spread ``<metric>_spread`` (max - min) and per-seed values ``<metric>_by_seed``.
    A UsageError when a folder holds no Table 2 (or not a readable one), the studies differ in a setting
    other than the seed (``study.json``), two folders have the same seed, or they share no row."""
    tables = [_read_table2(Path(d)) for d in studies]
    _check_same_study(studies)
    seeds = [sorted({r["seed"] for r in t}) for t in tables]
    flat = [s for ss in seeds for s in ss]
    if len(set(flat)) != len(flat):
        raise UsageError(f"--combine: the studies repeat a seed ({', '.join(map(str, flat))}); combine different seeds")

    def key(r: dict[str, Any]) -> tuple:
        return (r["run"], r["policy"], r["B"], str(r["R"]))

    by = [{key(r): r for r in t} for t in tables]
    keys = [k for k in by[0] if all(k in b for b in by[1:])]
    if not keys:
        raise UsageError("--combine: the studies share no (run, policy, B, R) row")
    out = []
    for k in keys:
        rs = [b[k] for b in by]
        row: dict[str, Any] = {"run": k[0], "policy": k[1], "B": k[2], "R": rs[0]["R"], "sw": rs[0].get("sw"),
                               "seeds": ",".join(str(r["seed"]) for r in rs), "prompts": rs[0].get("prompts")}
        for m in SPREAD_METRICS:
            try:
                vals = [float(r.get(m, float("nan"))) for r in rs]
            except (TypeError, ValueError):
                raise UsageError(f"--combine: a {m} of row {k} is not a number") from None
            row[m] = float(np.mean(vals))
            row[f"{m}_spread"] = float(np.max(vals) - np.min(vals))
            row[f"{m}_by_seed"] = vals
        row["identical_to_full"] = all(bool(r.get("identical_to_full")) for r in rs)
        row["train_overlap"] = sum(int(r.get("train_overlap") or 0) for r in rs)
        row["prompt_overlap"] = sum(int(r.get("prompt_overlap") or 0) for r in rs)
        out.append(row)
    return out


def _read_json(p: Path, what: str) -> Any:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UsageError(f"--combine: {p} is not a readable {what} ({' '.join(str(e).split())[:120]})") from None


def _read_table2(d: Path) -> list[dict[str, Any]]:
    """The rows of ``d/table2.json``, each with the keys :func:`combine_seeds` reads (else a UsageError)."""
    p = d / "table2.json"
    if not p.is_file():
        raise UsageError(f"--combine: {d} holds no table2.json (a finished `expertcast router-eval` output)")
    rows = _read_json(p, "JSON table")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UsageError(f"--combine: {p} is not a list of Table 2 rows (a finished `expertcast router-eval` output)")
    for i, r in enumerate(rows):
        missing = [k for k in ("run", "policy", "B", "R", "seed") if k not in r]
        if missing:
            raise UsageError(f"--combine: {p} row {i} has no {', '.join(missing)} (not a `expertcast router-eval` "
                             f"Table 2)")
    return rows


def _check_same_study(studies: list[Path]) -> None:
    """Refuse studies whose settings (``study.json``) differ in anything but the seed."""
    settings = []
    for d in studies:
        p = Path(d) / STUDY
        if not p.is_file():
            raise UsageError(f"--combine: {d} holds no {STUDY} (its settings), so it cannot be checked to differ from "
                             f"the others only in --seed; rerun it with this version of `expertcast router-eval`")
        got = _read_json(p, "JSON file")
        if not isinstance(got, dict) or not isinstance(got.get("settings"), dict):
            raise UsageError(f"--combine: {p} holds no settings object")
        settings.append({k: v for k, v in got["settings"].items() if k != "seed"})
    for d, s in zip(studies[1:], settings[1:], strict=True):
        diff = sorted(k for k in set(s) | set(settings[0]) if s.get(k, "<absent>") != settings[0].get(k, "<absent>"))
        if diff:
            k = diff[0]
            raise UsageError(f"--combine: {d} was run with other settings than {studies[0]} ({k}: "
                             f"{settings[0].get(k, '<absent>')!r} vs {s.get(k, '<absent>')!r}"
                             + (f", and {len(diff) - 1} more" if len(diff) > 1 else "")
                             + "); only the seed may differ")


SEED_COLUMNS = ["run", "policy", "B", "R", "seeds", "hit", "hit_spread", "d_hit_vs_lm_only_lru_pts",
                "d_hit_vs_lm_only_lru_pts_spread", "d_hit_vs_lru_pts", "adj_hit", "adj_hit_spread", "mb_per_token",
                "accuracy", "accuracy_spread", "heldout_lm", "lm_vs_lm_only_pct", "lm_vs_lm_only_pct_spread",
                "identical_to_full", "train_overlap", "prompt_overlap"]


def write_seed_table(rows: list[dict[str, Any]], studies: list[Path], out: OutputDir) -> None:
    """``rows`` (:func:`combine_seeds` of ``studies``) as ``table2_seeds.{csv,json}`` in ``out`` (printed), with
    ``seeds_source.json`` naming the studies."""
    report(rows, title=f"Table 2 over seeds {rows[0]['seeds']}: mean and spread (max - min) of each metric "
                       f"(studies: {', '.join(str(s) for s in studies)})",
           json_path=out.file("table2_seeds.json"), csv_path=out.file("table2_seeds.csv"), columns=SEED_COLUMNS)
    atomic_write_json(out.file("seeds_source.json"), {"studies": [str(Path(s).resolve()) for s in studies]})
