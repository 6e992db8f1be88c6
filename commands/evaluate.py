"""``expertcast eval``: offloaded inference on GSM8K / MATH-500 under a cache policy.

    expertcast eval --model M --benchmark gsm8k|math500 --policy P (--capacity F | --slots N | --budget-gb G) --out DIR

Greedy generation through :class:`~expertcast.inference.runtime.engine.OffloadedModel` (real expert
offloading), graded with the benchmark's grader. Reports accuracy and the decode-only metrics users compare
systems by: Hit (resident hits / accesses; an expert executed on the CPU is neither a hit nor a miss, ``cpu_exec``
counts them), AdjHit, MB/token moved and read MB/token (bytes read from the store), exposed misses per token (loads
the compute waited for), the share of tokens decoded in a step without a miss, TTFT and TPOT (per-token step time)
at p50/p90/p99, stall per token, one tokens/s (the paired offloaded passes', else the graded pass's: the run says
which) and the run's own peak RSS against its bound.

Everything cheap is checked before the model loads (flags, policy and its options, capacity against
the model's shape, artefacts made for another model, train/test overlap of a forecaster, the output
folder). ``DIR`` is claimed (a second concurrent run on it exits 2). Each finished batch appends its
samples (one row per problem id) to ``DIR/samples.jsonl``; a rerun resumes only when every setting
that determines the samples is the same (``DIR/settings.json``), else it exits 2 naming the setting;
``--overwrite`` starts over. The rows of a batch are written by one ``write`` + ``fsync``, each carrying its
batch id, the batch's size and the settings hash; :func:`read_samples` drops a torn tail (a line cut mid-write,
or the first rows of a batch whose other rows are missing: an interrupted run) with a warning, and refuses a
corrupt line elsewhere, a row of other settings or a problem seen twice, naming ``file:line``. A resume with
a ``--limit`` that cuts a batch of the earlier run is refused (a batch's counters cannot be split).
Outputs: a table, ``summary.json``, ``summary.csv``, ``samples.csv`` and ``summary.png`` (per-layer decode
hit and per-batch tokens/s).

% of full speed, in the same run (docs/design.md, "Speed baseline"): the first ``--speed-samples`` problems are
generated again, offloaded and by the baseline in interleaved passes (baseline, then offloaded + baseline
``--speed-repeats`` times); ``pct_full`` is the median of each offloaded pass's tokens/s over the mean of its two
neighbouring baseline passes, with the min-max of those ratios (``speed.json``; reused on resume when nothing
changed). The baseline is the same runtime with every expert resident in its slots (``all-resident``: same kernels,
threads and batch) or, when a slot for every expert does not fit (``--baseline auto``: host MemAvailable on CPU,
the device's free memory on CUDA), the runtime executing every routed expert on the host (``all-experts-on-host``);
the choice, its reason and figures are in ``speed.json``'s ``baseline_choice`` and on stderr. A ratio whose
passes span more than 10 points, or that is above 100% in every pair, is flagged (``speed_flag``) and not reported
as ``pct_full``. A stage-aware policy decides CPU execution vs transfer with a latency model measured on this
machine at start-up (``latency_model`` in ``summary.json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.commands.common import (
    CommandParser,
    add_capacity_args,
    add_config_arg,
    capacities_from_args,
    nonneg_int,
    parse_and_run,
    positive_float,
    positive_int,
    resolve_device,
)
from expertcast.data.benchmarks import BENCHMARKS
from expertcast.inference.runtime.disk_store import PREFETCH_CHUNK_KB, READERS
from expertcast.inference.runtime.eval_samples import append_samples, read_samples  # noqa: F401 (re-exported)
from expertcast.inference.runtime.session import (
    BASELINES,
    DTYPES,
    ModelSession,
    SessionSettings,
    build_policy,
    check_artefacts,
    check_run,
    check_store,
    choose_baseline,
    default_disk_path,
    fit_stage_policy,
    mmap_store_path,
    paired_speed_passes,
    speed_line,
)
from expertcast.inference.runtime.stats import RowPeak, forecaster_line
from expertcast.utils.errors import UsageError

PROG = "expertcast eval"
EXPERT_DTYPES = ("bfloat16", "int8", "int4", "int4-g32", "int4-g128", "int8-g128")
"""``--expert-dtype`` choices (:class:`~expertcast.inference.runtime.quant.ExpertFormat`)."""
SUMMARY_COLUMNS = ["samples", "accuracy", "hit", "cpu_exec", "adj_hit", "mb_per_token", "read_mb_per_token",
                   "exposed_misses_per_token", "miss_free_token_frac", "stall_ms_per_token", "tokens_per_s",
                   "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
                   "pct_full", "pct_full_min", "pct_full_max", "speed_flag", "baseline", "proactive_per_token",
                   "prefetch_precision", "late_prefetches", "peak_rss_gb", "rss_bound_gb"]
"""The table's columns: Hit is resident hits / accesses (a CPU-executed expert is neither a hit nor a miss:
``cpu_exec``); one tokens/s per row (:func:`_write_outputs` says which); ``pct_full`` against the runtime with every
expert resident, None when ``speed_flag`` says why it is no result; the row's own peak RSS against its bound."""
SPEED = "speed.json"
SAMPLES = "samples.jsonl"
SETTINGS = "settings.json"


def build_parser() -> CommandParser:
    ap = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("--model", required=True, help="tiny preset name, 'tiny-default', local HF directory or Hub id")
    ap.add_argument("--benchmark", required=True, choices=list(BENCHMARKS), help="benchmark to grade")
    ap.add_argument("--policy", required=True,
                    help="cache policy with options, e.g. lru, 'lrfu:lam=0.1', 'seqmoe:forecaster=EXPORT', "
                         "'stage:cue_set=CUES.json'")
    add_capacity_args(ap, multiple=False, budget_gb=True)
    ap.add_argument("--out", required=True, help="output folder (claimed; resumed when the settings match)")
    ap.add_argument("--overwrite", action="store_true", help="remove this folder's earlier eval output and start over")
    ap.add_argument("--mmap-store", action="store_true",
                    help="memory-map the host expert store (written to OUT/experts.safetensors)")
    add_store_args(ap)
    add_run_args(ap)
    add_config_arg(ap)
    return ap


def add_store_args(ap: CommandParser) -> None:
    """Where the experts live (docs/design.md, "Disk tier")."""
    ap.add_argument("--store", choices=("ram", "disk"), default="ram",
                    help="ram: the host expert store in RAM (or --mmap-store); disk: the experts in one file read with "
                         "direct I/O by a reader pool, RAM holding only the slots")
    ap.add_argument("--disk-path", default=None,
                    help="--store disk: the expert file (default OUT/experts.disk.safetensors; put it on the disk to "
                         "measure, not on tmpfs)")
    ap.add_argument("--readers", type=positive_int, default=READERS, help="--store disk: reader threads of the reader pool")
    ap.add_argument("--prefetch-chunk-kb", type=nonneg_int, default=PREFETCH_CHUNK_KB,
                    help="--store disk: a prefetch read reads in blocks of this many KiB and yields the disk to "
                         "demand reads between them (0: whole reads, no yielding)")


def check_store_args(a: Any) -> None:
    """The store flags (:func:`~expertcast.inference.runtime.session.check_store`)."""
    check_store(getattr(a, "store", "ram"), getattr(a, "disk_path", None), mmap=getattr(a, "mmap_store", False),
                link_gbps=getattr(a, "link_gbps", None))


def session_settings(args: Any, model_path: str, device: str, out: str | None = None) -> SessionSettings:
    """The :class:`~expertcast.inference.runtime.session.SessionSettings` of the flags (``out``: the folder of the
    memory-mapped or disk store; default ``--out``)."""
    out = args.out if out is None else out
    disk = getattr(args, "store", "ram") == "disk"
    return SessionSettings(
        model=args.model, model_path=model_path, device=device, dtype=args.dtype, pool=args.pool,
        link_gbps=args.link_gbps, decode_path=args.decode_path, seed=args.seed, store=getattr(args, "store", "ram"),
        disk_path=(getattr(args, "disk_path", None) or default_disk_path(out)) if disk else None,
        readers=getattr(args, "readers", READERS),
        prefetch_chunk_kb=getattr(args, "prefetch_chunk_kb", PREFETCH_CHUNK_KB),
        mmap_path=mmap_store_path(out) if getattr(args, "mmap_store", False) else None,
        expert_dtype=getattr(args, "expert_dtype", "bfloat16"))


def add_run_args(ap: CommandParser) -> None:
    """The flags of one offloaded generation run (shared with ``expertcast sweep``)."""
    ap.add_argument("--split", default="test", help="benchmark split")
    ap.add_argument("--limit", type=positive_int, default=None, help="evaluate only the first N problems (None = all)")
    ap.add_argument("--pool", default="per-layer", choices=["per-layer", "shared"],
                    help="one slot pool per MoE layer, or one pool shared by all layers")
    ap.add_argument("--batch-size", type=positive_int, default=1, help="problems decoded together")
    ap.add_argument("--max-new-tokens", type=positive_int, default=512, help="generated tokens per problem at most")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch CPU threads (None = torch's default; 1 avoids oversubscription on a shared host)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="model dtype (auto = the checkpoint's)")
    ap.add_argument("--expert-dtype", default="bfloat16", choices=EXPERT_DTYPES,
                    help="experts' format in the stores, slots and transfers: bfloat16 (unquantized), int8, int4 "
                         "(group 64), int4-g32/g128, int8-g128; the speed baseline runs the same format")
    ap.add_argument("--decode-path", choices=("eager", "graph", "auto"), default="eager",
                    help="MoE decode path: eager (the reference), graph (residency and miss handling on the device, "
                         "no host sync per layer; lru and seqmoe), auto (graph where it applies; the run prints "
                         "which path runs and why)")
    ap.add_argument("--link-gbps", type=positive_float, default=None,
                    help="CPU only: emulated host-device bandwidth in GB/s (None = memory speed)")
    ap.add_argument("--data-dir", default=None, help="local benchmark folder (None = $EXPERTCAST_DATA_DIR, ../shared/data, else the Hub)")
    ap.add_argument("--chat-template", choices=["auto", "yes", "no"], default="auto",
                    help="wrap prompts in the tokenizer's chat template (auto = when it has one)")
    ap.add_argument("--seed", type=int, default=0, help="seed of a random-init preset model")
    ap.add_argument("--allow-overlap", action="store_true",
                    help="evaluate even when the policy's forecaster was trained on evaluated problems "
                         "(reported in the summary)")
    ap.add_argument("--allow-model-mismatch", action="store_true",
                    help="evaluate even when the policy's forecaster or cue set was fitted on another model's routing "
                         "(reported in the summary)")
    add_speed_args(ap)
    ap.add_argument("--wandb", action="store_true", help="log the summary and per-batch metrics to W&B")
    ap.add_argument("--wandb-project", default="expertcast", help="W&B project")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_speed_args(ap: CommandParser) -> None:
    """The paired speed measurement's flags (shared with ``expertcast sweep``)."""
    ap.add_argument("--baseline", default="auto", choices=BASELINES,
                    help="speed baseline, the same runtime: resident (every expert resident in its slots), host "
                         "(every expert executed on the host: all-experts-on-host), auto (resident when a slot for "
                         "every expert fits, else host), none (skip)")
    ap.add_argument("--speed-repeats", type=positive_int, default=3,
                    help="offloaded passes of the paired speed measurement (each between two baseline passes)")
    ap.add_argument("--speed-samples", type=positive_int, default=None,
                    help="problems timed in the paired speed measurement (None = one batch: --batch-size)")


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), argv, PROG, evaluate)


# -- validation (cheap, before the model loads) --------------------------------------------------------
def check_guard(checked: Any, problem_ids: list[str], args: Any) -> dict[str, dict[str, Any]]:
    """The overlap / model-identity guard of the run's artefacts (forecaster, cue set) against the evaluated
    problems and model (:func:`~expertcast.inference.runtime.session.check_artefacts`); exit 2 unless allowed."""
    return check_artefacts(checked, problem_ids, scored=f"the evaluated problems of --model {args.model}",
                           allow_overlap=args.allow_overlap,
                           allow_model_mismatch=getattr(args, "allow_model_mismatch", False))


# -- settings that determine the samples --------------------------------------------------------------
def artefact_hashes(files: dict[str, str]) -> dict[str, str]:
    """``{option: sha256}`` of the policy's file options (a folder: over all its files)."""
    from expertcast.utils.provenance import sha256_file, sha256_files

    return {k: sha256_files(p) if Path(p).is_dir() else sha256_file(p) for k, p in sorted(files.items())}


def eval_settings(args: Any, *, resolved: str, device: str, policy_name: str, opts: dict[str, Any],
                  files: dict[str, str], capacity: dict[str, Any]) -> dict[str, Any]:
    """The resume key: every setting that determines the samples (:func:`~expertcast.utils.provenance.settings_key`)."""
    from expertcast.models.backbone import model_identity
    from expertcast.utils.provenance import settings_key

    return settings_key(
        job="eval", model=model_identity(resolved, init_seed=None),  # a preset's init seed is `seed`
        dtype=args.dtype, device=device.split(":")[0],
        seed=args.seed, chat_template=args.chat_template, benchmark=args.benchmark, split=args.split,
        max_new_tokens=args.max_new_tokens,
        policy={"name": policy_name, "options": {k: v for k, v in sorted(opts.items()) if k not in files},
                "artefacts_sha256": artefact_hashes(files)},
        capacity=capacity, pool=args.pool, batch_size=args.batch_size, link_gbps=args.link_gbps, greedy=True,
        decode_path=args.decode_path,
        # a quantized format changes the samples; bfloat16 (the format before formats existed) adds no key, so
        # earlier output folders still resume
        **({} if session_expert_dtype(args) == "bfloat16" else {"expert_dtype": session_expert_dtype(args)}))


def session_expert_dtype(args: Any) -> str:
    """``--expert-dtype``'s canonical name (:class:`~expertcast.inference.runtime.quant.ExpertFormat`)."""
    from expertcast.inference.runtime.quant import ExpertFormat

    return ExpertFormat.parse(getattr(args, "expert_dtype", "bfloat16")).name


def resume_rows(out: Any, settings: dict[str, Any], settings_hash: str) -> list[dict[str, Any]]:
    """Samples an earlier run of the same settings left in ``out`` (exit 2 on any mismatch)."""
    from expertcast.utils.io import atomic_write_json
    from expertcast.utils.provenance import check_resume

    samples, saved_path = out.path / SAMPLES, out.path / SETTINGS
    has_samples = samples.is_file() and samples.stat().st_size > 0
    if has_samples:
        try:
            saved = json.loads(saved_path.read_text(encoding="utf-8")) if saved_path.is_file() else None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise UsageError(f"{saved_path} is not valid JSON; use --overwrite to start over") from None
        check_resume(saved, settings, out.path)
    done = read_samples(samples, settings_hash, repair=True)
    atomic_write_json(out.file(SETTINGS), settings)
    out.track(SAMPLES)
    return done


def rows_of(rows: list[dict[str, Any]], problem_ids: list[str], path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of ``problem_ids`` (in their order) among ``rows``. A batch's counters cover all its problems
    and cannot be split, so a batch holding both wanted problems and others (an earlier run with a larger
    ``--limit`` that cuts it) is refused: the summary would count problems outside this run."""
    wanted = {pid: i for i, pid in enumerate(problem_ids)}
    by_batch: dict[int, list[str]] = {}
    for r in rows:
        by_batch.setdefault(int(r["batch"]), []).append(r["id"])
    for b, ids in sorted(by_batch.items()):
        inside = [i for i in ids if i in wanted]
        if inside and len(inside) < len(ids):
            raise UsageError(f"{path}: batch {b} of the earlier run holds problems {inside[0]} .. {ids[-1]}, of which "
                             f"{len(ids) - len(inside)} are outside this run's problems (--limit {len(problem_ids)}); "
                             f"its counters cannot be split: use a --limit that ends on a batch boundary, or "
                             f"--overwrite")
    return sorted((r for r in rows if r["id"] in wanted), key=lambda r: wanted[r["id"]])


# -- the run ------------------------------------------------------------------------------------------
def prepare(args: Any) -> dict[str, Any]:
    """Every cheap check of one evaluation (before the model loads); returns the cell: the policy factory,
    the problems and the run's info (settings, hash, capacity, artefacts, overlap)."""
    from expertcast.data.benchmarks import load_benchmark
    from expertcast.utils.fitted_on import guard_note
    from expertcast.utils.provenance import sha256_json

    caps = capacities_from_args(args, multiple=False)
    if not caps:
        raise UsageError("give --capacity (a fraction of all experts), --slots (a slot count) or --budget-gb (GB of experts)")
    check_store_args(args)
    device = resolve_device(args.device)
    budget = caps[0]
    checked = check_run(args.model, args.policy, budget, args.pool,
                        allow_model_mismatch=getattr(args, "allow_model_mismatch", False))
    policy, name, opts, files = checked.policy, checked.policy_name, checked.options, checked.files
    resolved, shape, cache_config = checked.model_path, checked.shape, checked.cache_config
    problems = load_benchmark(args.benchmark, args.split, data_dir=args.data_dir, limit=args.limit)
    guard = check_guard(checked, [p.id for p in problems], args)
    fc = guard.get("forecaster")
    overlap = None if fc is None else {k: fc.get(k) for k in ("overlap", "evaluated", "allowed")}
    settings = eval_settings(args, resolved=resolved, device=device, policy_name=name, opts=opts, files=files,
                             capacity=budget.row())
    info = {"model": args.model, "model_path": resolved, "policy": args.policy, "capacity": budget.row(),
            "cache": cache_config.describe(), "artefacts": files, "overlap": overlap, "guard": guard,
            "guard_note": guard_note(guard), "expert_dtype": session_expert_dtype(args), "settings": settings,
            "settings_hash": sha256_json(settings)}
    return {"policy": policy, "problems": problems, "device": device, "info": info, "shape": shape, "budget": budget}


def evaluate(args: Any) -> int:
    """Validate, claim ``--out``, resume, generate the missing samples, measure the speed, summarize."""
    from expertcast.utils.outdir import claim_output_dir

    cell = prepare(args)
    set_threads(args.threads)
    with claim_output_dir(args.out, "eval", overwrite=args.overwrite) as out:
        run_cell(args, out, cell, ModelSession(session_settings(args, cell["info"]["model_path"], cell["device"])))
    return 0


def set_threads(n: int | None) -> None:
    """``--threads``: torch's CPU thread count for this process (the runtime's host thread follows it)."""
    if n is not None:
        import torch

        torch.set_num_threads(n)


def run_cell(args: Any, out: Any, cell: dict[str, Any], session: ModelSession) -> dict[str, Any]:
    """Resume, generate the missing samples and the speed measurement in ``out`` (an OutputDir or a
    sub-folder of one), write the outputs; returns the summary."""
    done = resume_rows(out, cell["info"]["settings"], cell["info"]["settings_hash"])
    rows_of(done, [p.id for p in cell["problems"]], out.path / SAMPLES)  # a batch cut by --limit: refused
    return _generate_and_report(args, out, cell, done, session)


def _generate_and_report(args: Any, out: Any, cell: dict[str, Any], done: list[dict[str, Any]],
                         session: ModelSession) -> dict[str, Any]:
    from expertcast.data.prompts import has_chat_template
    from expertcast.inference.runtime.eval_run import eos_ids, run_batch

    info, problems = cell["info"], cell["problems"]
    done_ids = {r["id"] for r in done}
    todo = [p for p in problems if p.id not in done_ids]
    next_batch = max((int(r["batch"]) for r in done), default=-1) + 1
    if done:
        print(f"resuming {out.path}: {len(done)} samples done (same settings), {len(todo)} to go")
    row_peak = RowPeak().__enter__()  # this run's own peak: its load (or its slots), its generation
    om = session.offload(cell["policy"], cell["budget"], measure_latency=True)
    tok = session.tok
    templated = has_chat_template(tok) if args.chat_template == "auto" else args.chat_template == "yes"
    latency = om.latency_measurement
    run = _start_wandb(args, info)
    eos = eos_ids(session.model, tok)
    batches = [todo[i:i + args.batch_size] for i in range(0, len(todo), args.batch_size)]
    try:
        for bi, batch in enumerate(_progress(args, batches, info)):
            rows, stats = run_batch(om, tok, batch, benchmark=args.benchmark, templated=templated,
                                    max_new_tokens=args.max_new_tokens, eos=eos)
            for r in rows:
                r.update(batch=next_batch + bi, batch_rows=len(rows), batch_stats=stats,
                         settings_hash=info["settings_hash"])
            append_samples(out.path / SAMPLES, rows)
            if run is not None:
                series = {k: v for k, v in stats.items() if not isinstance(v, list)}
                if bi == 0:
                    from expertcast.utils.tracking import define_step_axis

                    define_step_axis(run, "batch", series)  # per-batch series over the batch id
                run.log({"batch": next_batch + bi, **series})
        rows = rows_of(read_samples(out.path / SAMPLES, info["settings_hash"]), [p.id for p in problems],
                       out.path / SAMPLES)
        memory = om.memory_report().to_dict()
        lat_model = getattr(om.policy, "latency", None) if latency is not None else None
    except BaseException:
        om.close()
        raise
    row_peak.__exit__(None, None, None)
    memory.update(row_peak_rss=row_peak.bytes, row_peak_scope=row_peak.scope)
    session.give_back(om)
    del om
    speed = _speed(args, out, cell, session, templated, eos, lat_model)
    return _write_outputs(args, out, rows, memory, templated,
                          {**info, "latency_model": latency, "speed": speed, "load": session.load_report}, run)


# -- summary ------------------------------------------------------------------------------------------
def _batches(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        out.setdefault(int(r["batch"]), r["batch_stats"])
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy over samples; cache, I/O and latency metrics over the raw counters of their batches
    (:func:`~expertcast.inference.runtime.eval_run.decode_metrics`); ``tokens_per_s`` is the graded pass's until
    the paired speed passes replace it (:func:`_write_outputs`)."""
    from expertcast.inference.runtime.eval_run import decode_metrics

    b = list(_batches(rows).values())
    per_acc = np.sum([x["per_layer_accesses"] for x in b], axis=0) if b else np.zeros(0)
    per_dem = np.sum([x["per_layer_demand"] for x in b], axis=0) if b else np.zeros(0)
    per_hit = np.sum([x["per_layer_resident_hits"] for x in b], axis=0) \
        if b and all("per_layer_resident_hits" in x for x in b) else per_acc - per_dem  # older batches: 1 - D/A
    n = len(rows)
    correct = sum(bool(r["correct"]) for r in rows)
    m = decode_metrics(b)
    return {
        "samples": n,
        "correct": correct,
        "accuracy": correct / n if n else float("nan"),
        **m,
        "tokens_per_s": m["graded_tokens_per_s"],
        "per_layer_hit": [float(h / a) if a else float("nan") for a, h in zip(per_acc, per_hit, strict=True)],
        "batches": len(b),
        "accounting": "decode-only; prefill uncounted (cache state after prefill initializes decoding)",
    }


def plot_summary(summary: dict[str, Any], rows: list[dict[str, Any]], path: str | os.PathLike, title: str) -> None:
    """PNG: per-layer decode hit rate (left) and decode tokens/s per batch (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from expertcast.utils.io import save_figure

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    ph = summary["per_layer_hit"]
    a1.bar(range(len(ph)), ph)
    a1.set_xlabel("MoE layer")
    a1.set_ylabel("decode hit rate")
    a1.set_ylim(0, 1.05)
    a1.set_title(f"hit {summary['hit']:.3f}, AdjHit {summary['adj_hit']:.3f}")
    batches = _batches(rows)
    ks = sorted(batches)
    a2.plot(ks, [batches[k]["tokens_per_s"] for k in ks], marker="o")
    a2.set_xlabel("batch")
    a2.set_ylabel("decode tokens/s")
    a2.set_title(f"accuracy {summary['accuracy']:.3f} over {summary['samples']} samples")
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)



# -- speed against full load ----------------------------------------------------------------------------
def _speed(args: Any, out: Any, cell: dict[str, Any], session: ModelSession, templated: bool, eos: list[int],
           lat_model: Any) -> dict[str, Any] | None:
    """The paired speed measurement (``speed.json``; reused when its key is unchanged), or None with
    ``--baseline none``."""
    from expertcast.utils.io import atomic_write_json

    if args.baseline == "none":
        return None
    n = args.speed_samples or args.batch_size
    probs = cell["problems"][:n]
    baseline, choice = choose_baseline(args.baseline, session)
    key = {"settings_hash": cell["info"]["settings_hash"], "baseline": baseline, "speed_samples": n,
           "speed_repeats": args.speed_repeats, "problems": [p.id for p in probs]}
    path = out.path / SPEED
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("key") == key:
            print(f"speed: reusing {path} (same settings)")
            return saved
    speed = measure_speed(args, session, cell, probs, templated, eos, baseline, lat_model)
    speed["key"] = key
    speed["baseline_choice"] = choice
    atomic_write_json(out.file(SPEED), speed)
    return speed


def measure_speed(args: Any, session: ModelSession, cell: dict[str, Any], probs: list[Any], templated: bool,
                  eos: list[int], baseline: str, lat_model: Any) -> dict[str, Any]:
    """Interleaved passes over ``probs`` (batches of ``--batch-size``): the evaluated policy offloaded, a
    fresh policy and an empty cache each pass, against ``baseline`` (see :func:`paired_speed_passes`)."""
    from expertcast.inference.runtime.eval_run import encode_prompts

    tok, info = session.tok, cell["info"]
    encs = [encode_prompts(tok, probs[i:i + args.batch_size], args.benchmark, templated)
            for i in range(0, len(probs), args.batch_size)]

    def make_policy() -> Any:
        policy = build_policy(args.policy)[0]
        fit_stage_policy(policy, info["model_path"], getattr(args, "allow_model_mismatch", False))
        if lat_model is not None and hasattr(policy, "use_latency"):
            policy.use_latency(lat_model)  # the latency model measured at start-up
        return policy

    speed = paired_speed_passes(session, encs, make_policy, cell["budget"], int(cell["shape"][2]), baseline,
                                args.speed_repeats, max_new_tokens=args.max_new_tokens, eos=eos)
    speed["problems"] = [p.id for p in probs]
    if not speed["tokens_match"]:
        print(f"warning: the speed passes of {args.policy} and the {baseline} baseline generated different "
              "tokens (numerics of the device and host kernels differ)")
    return speed


def _crossover_text(n: int) -> str:
    if n <= 0:
        return "never (the transfer is faster)"
    return f"up to {n} tokens" if n < 2 ** 31 - 1 else "at every token count"


def _progress(args: Any, batches: list[Any], info: dict[str, Any]):
    if args.no_progress or not batches:
        return batches
    from tqdm.auto import tqdm

    return tqdm(batches, desc=f"eval {args.benchmark} {args.policy} @ {info['cache']}", unit="batch")


def _start_wandb(args: Any, info: dict[str, Any]):
    if not args.wandb:
        return None
    from expertcast.data.lineage import use_inputs
    from expertcast.utils.tracking import start_wandb_run

    cap = next(iter(info["capacity"].values()))
    run = start_wandb_run(args.wandb_project, info["settings"], job_type="eval",
                          name=f"eval-{args.benchmark}-{args.policy}-{cap}")
    use_inputs(run, wandb_inputs(args, info["artefacts"]))
    return run


def wandb_inputs(args: Any, files: dict[str, str]) -> list[tuple[str, str, str | None]]:
    """The ``(path, kind, digest)`` inputs of the evaluation for W&B lineage: a router-adaptation export given
    as ``--model`` (a router policy runs its routers), and the file options of any other policy (forecaster
    export, cue set, ...)."""
    from expertcast.data.lineage import policy_inputs
    from expertcast.inference.policies import parse_policy_options
    from expertcast.models.names import is_export_dir

    model = [(args.model, "router", None)] if is_export_dir(args.model) else []
    if "routers" in files:
        return model
    return model + policy_inputs(files, parse_policy_options(args.policy).file_options())


def _write_outputs(args: Any, out: Any, rows: list[dict[str, Any]], memory: dict[str, Any], templated: bool,
                   info: dict[str, Any], run: Any) -> dict[str, Any]:
    from expertcast.utils.io import atomic_write_json, print_table, write_csv

    summary = summarize(rows)
    summary.update(memory=memory, chat_template_used=templated, **info)
    speed = info["speed"] or {}
    flag = speed.get("flag")
    summary.update({k: speed.get(k) for k in ("pct_full_min", "pct_full_max", "baseline")},
                   pct_full=None if flag else speed.get("pct_full"), pct_full_measured=speed.get("pct_full"),
                   speed_flag=flag, baseline_tokens_per_s=speed.get("baseline_tokens_per_s"))
    if speed:  # one tokens/s per row: the offloaded passes the % of full speed is made of
        summary.update(tokens_per_s=speed["tokens_per_s"],
                       tokens_per_s_source="median of the paired offloaded passes (speed.json)")
    else:
        summary["tokens_per_s_source"] = "the graded pass (no paired speed passes: --baseline none)"
    load = info.get("load") or {}
    bound = load.get("rss_bound_bytes")
    summary["rss"] = {"peak_rss_bytes": memory.get("row_peak_rss"), "scope": memory.get("row_peak_scope"),
                      "process_peak_rss_bytes": memory.get("process_peak_rss"), "bound_bytes": bound,
                      "store": load.get("store_kind", "ram"), "disk_io_mode": load.get("disk_io_mode"),
                      "readers": load.get("readers"), "prefetch_chunk_kb": load.get("prefetch_chunk_kb")}
    summary.update(peak_rss_gb=(memory.get("row_peak_rss") or 0) / 1e9, rss_bound_gb=bound / 1e9 if bound else None)
    head = {"policy": args.policy, **info["capacity"]}
    table = [{**head, **{k: summary[k] for k in SUMMARY_COLUMNS}}]
    fmt = info.get("expert_dtype", "bfloat16")
    print_table(table, title=f"expertcast eval: {args.model} on {args.benchmark}, {info['cache']}"
                             + ("" if fmt == "bfloat16" else f", experts {fmt}") + f" ({summary['accounting']})")
    if info.get("guard_note"):
        print(f"guard: {info['guard_note']}")
    if info["overlap"] is not None:
        ov = info["overlap"]
        print(f"forecaster training overlap: {ov['overlap']} of {ov['evaluated']} evaluated problems"
              + (" (allowed by --allow-overlap)" if ov["allowed"] else ""))
    if speed:
        print(speed_line(speed, f"{len(speed['problems'])} problems"))
    print(f"tokens_per_s: {summary['tokens_per_s_source']}")
    if (line := forecaster_line(summary)) is not None:
        print(f"{line} (the graded pass)")
    if load.get("store_kind") == "disk":
        rss = summary["rss"]
        print(f"disk store ({rss['disk_io_mode']}, {rss['readers']} readers): peak RSS of this run ({rss['scope']}) "
              f"{(rss['peak_rss_bytes'] or 0) / 2**30:.2f} GiB, bound {rss['bound_bytes'] / 2**30:.2f} GiB (slots + "
              "non-expert weights + one layer's rows + 1 GiB margin)")
    lat = info.get("latency_model")
    if lat:
        print(f"latency model (measured): transfer {lat['transfer_ms']:.3f} ms/expert, CPU {lat['cpu_expert_ms']:.3f} ms + "
              f"{lat['cpu_token_ms']:.4f} ms/token, device {lat['device_ms']:.3f} ms/layer; CPU execution "
              + _crossover_text(lat["crossover_tokens"]))
    atomic_write_json(out.file("summary.json"), summary)
    write_csv(out.file("summary.csv"), table)
    write_csv(out.file("samples.csv"), [{k: r[k] for k in ("id", "batch", "correct", "answer", "gold", "new_tokens")}
                                        for r in rows])
    plot_summary(summary, rows, out.file("summary.png"),
                 f"{args.model} {args.benchmark} {args.policy} @ {next(iter(info['capacity'].values()))}")
    if run is not None:
        from expertcast.utils.tracking import log_image, log_table

        run.summary.update({k: summary[k] for k in SUMMARY_COLUMNS})
        log_table(run, "eval_summary", table)
        log_table(run, "eval_samples", [{k: r[k] for k in ("id", "batch", "correct", "answer", "gold", "new_tokens")}
                                        for r in rows])
        log_image(run, "eval_summary", out.path / "summary.png")
        run.finish()
    print(f"wrote {out.path / 'summary.json'}, summary.csv, samples.csv, summary.png, {SAMPLES}"
          + (f", {SPEED}" if speed else ""))
    return summary
