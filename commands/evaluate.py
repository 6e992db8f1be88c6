"""``expertcast eval``: offloaded inference on GSM8K / MATH-500 under a cache policy.

    expertcast eval --model M --benchmark gsm8k|math500 --policy P (--capacity F | --slots N) --out DIR

Greedy generation through :class:`~expertcast.inference.runtime.engine.OffloadedModel` (real expert
offloading), graded with the benchmark's grader. Reports accuracy and the decode-only cache and speed
metrics: Hit, AdjHit, MB/token, tokens/s, TTFT and stall time per token.

Everything cheap is checked before the model loads (flags, policy and its options, capacity against
the model's shape, artefacts made for another model, train/test overlap of a forecaster, the output
folder). ``DIR`` is claimed (a second concurrent run on it exits 2). Each finished batch appends its
samples (one row per problem id) to ``DIR/samples.jsonl``; a rerun resumes only when every setting
that determines the samples is the same (``DIR/settings.json``), else it exits 2 naming the setting;
``--overwrite`` starts over. Outputs: a table, ``summary.json``, ``summary.csv``, ``samples.csv`` and
``summary.png`` (per-layer decode hit and per-batch tokens/s).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from expertcast.commands.common import (
    CommandParser,
    add_capacity_args,
    capacities_from_args,
    parse_and_run,
    positive_float,
    positive_int,
    resolve_device,
    resolve_model,
)
from expertcast.utils.errors import UsageError

PROG = "expertcast eval"
DTYPES = ("auto", "float32", "bfloat16", "float16")
SIMULATOR_ONLY = {
    "router-temporal": "it reads router outputs recorded on finished sequences (a RouterReplay)",
    "router-full": "it reads router outputs recorded on finished sequences (a RouterReplay)",
    "router-spatio": "it reads router outputs recorded on finished sequences (a RouterReplay)",
    "stage-oracle": "it reads the next stage from the recorded routing",
}
"""Registered policies that cannot drive a live generation, and why."""
SUMMARY_COLUMNS = ["samples", "accuracy", "hit", "adj_hit", "mb_per_token", "tokens_per_s", "ttft_s",
                   "stall_ms_per_token", "late_prefetches", "cpu_exec"]


def build_parser() -> CommandParser:
    ap = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("--model", required=True, help="tiny preset name, 'tiny-default', local HF directory or Hub id")
    ap.add_argument("--benchmark", required=True, choices=["gsm8k", "math500"], help="benchmark to grade")
    ap.add_argument("--split", default="test", help="benchmark split")
    ap.add_argument("--limit", type=positive_int, default=None, help="evaluate only the first N problems (None = all)")
    ap.add_argument("--policy", required=True,
                    help="cache policy with options, e.g. lru, 'lrfu:lam=0.1', 'seqmoe:forecaster=EXPORT', "
                         "'stage:cue_set=CUES.json'")
    add_capacity_args(ap, multiple=False)
    ap.add_argument("--pool", default="per-layer", choices=["per-layer", "shared"],
                    help="one slot pool per MoE layer, or one pool shared by all layers")
    ap.add_argument("--batch-size", type=positive_int, default=1, help="problems decoded together")
    ap.add_argument("--max-new-tokens", type=positive_int, default=512, help="generated tokens per problem at most")
    ap.add_argument("--out", required=True, help="output folder (claimed; resumed when the settings match)")
    ap.add_argument("--overwrite", action="store_true", help="remove this folder's earlier eval output and start over")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="model dtype (auto = the checkpoint's)")
    ap.add_argument("--link-gbps", type=positive_float, default=None,
                    help="CPU only: emulated host-device bandwidth in GB/s (None = memory speed)")
    ap.add_argument("--mmap-store", action="store_true",
                    help="memory-map the host expert store (written to OUT/experts.safetensors)")
    ap.add_argument("--data-dir", default=None, help="local benchmark folder (None = $EXPERTCAST_DATA_DIR, ../shared/data, else the Hub)")
    ap.add_argument("--chat-template", choices=["auto", "yes", "no"], default="auto",
                    help="wrap prompts in the tokenizer's chat template (auto = when it has one)")
    ap.add_argument("--seed", type=int, default=0, help="seed of a random-init preset model")
    ap.add_argument("--allow-overlap", action="store_true",
                    help="evaluate even when the policy's forecaster was trained on evaluated problems "
                         "(reported in the summary)")
    ap.add_argument("--wandb", action="store_true", help="log the summary and per-batch metrics to W&B")
    ap.add_argument("--wandb-project", default="expertcast", help="W&B project")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), argv, PROG, evaluate)


# -- validation (cheap, before the model loads) --------------------------------------------------------
def build_policy(spec: str) -> tuple[Any, str, dict[str, Any], dict[str, str]]:
    """(policy, name, options, file options) of ``--policy NAME[:k=v,...]``, options typed and validated
    by :func:`~expertcast.inference.policy_options.parse_policy_options`; every mistake is a UsageError."""
    from expertcast.inference.policies import make_policy
    from expertcast.inference.policy_options import parse_policy_options

    parsed = parse_policy_options(spec)
    name, opts = parsed.policy, parsed.to_kwargs()
    if name in SIMULATOR_ONLY:
        raise UsageError(f"--policy {name}: {SIMULATOR_ONLY[name]}, so it runs only in `expertcast simulate` on "
                         f"recorded traces, not in a live evaluation")
    try:
        policy = make_policy(name, **opts)
    except UsageError:
        raise
    except (TypeError, AttributeError, ValueError) as e:
        keys = ", ".join(opts) or "none"
        raise UsageError(f"--policy {spec}: cannot build {name} with options ({keys}): {e}") from None
    if policy.needs_future:
        raise UsageError(f"--policy {name} is an oracle (it reads the future routing): it cannot drive a live "
                         f"evaluation; use `expertcast simulate` on recorded traces")
    if getattr(policy, "kernel_only", False):
        raise UsageError(f"--policy {name} runs only on the simulator's compiled engine, not in the runtime")
    return policy, name, opts, parsed.files()


def fit_stage_policy(policy: Any, resolved: str) -> None:
    """A stage-aware policy reads the evaluated model's generated tokens: its cue set must come from this
    model (else a UsageError naming both), and without a tokenizer of its own it decodes with the model's."""
    cue_set = getattr(policy, "cue_set", None)
    if cue_set is not None:
        cue_set.check_model(resolved, source=f"cue set of --policy {policy.name}", what="the evaluated tokens")
    if hasattr(policy, "default_tokenizer"):
        policy.default_tokenizer(resolved)


def model_shape(resolved: str) -> tuple[int, int, int]:
    """(L, E, K) from the model's config alone (no weights)."""
    from expertcast.models.presets import get_config, is_preset
    from expertcast.models.spec import MoESpec

    if is_preset(resolved):
        config = get_config(resolved)
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(resolved, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise UsageError(f"--model {resolved}: cannot read its config ({' '.join(str(e).split())[:200]})") from None
    spec = MoESpec.from_config(config)
    return spec.num_layers, spec.num_experts, spec.top_k


def check_capacity(cap: dict[str, Any], pool: str, shape: tuple[int, int, int]):
    """The CacheConfig of ``cap`` on a model of ``shape`` (UsageError naming the flag when it cannot hold)."""
    from expertcast.inference.cache import CacheConfig

    L, E, K = shape
    flag = "--capacity" if "capacity" in cap else "--slots"
    try:
        return CacheConfig(num_layers=L, num_experts=E, top_k=K, pool=pool, **cap)
    except ValueError as e:
        raise UsageError(f"{flag} {next(iter(cap.values()))}: {e} (model: L={L}, E={E}, K={K}, --pool {pool})") from None


def check_policy_fits(policy: Any, shape: tuple[int, int, int], model: str) -> None:
    """Refuse a policy holding an artefact (forecaster, cue set) made for a model of another shape."""
    from expertcast.inference.runtime.engine import check_policy_compatible

    try:
        check_policy_compatible(policy, *shape, f"model {model}")
    except ValueError as e:
        raise UsageError(f"--policy: {e}") from None


def check_leakage(name: str, files: dict[str, str], problem_ids: list[str], allow: bool) -> dict[str, Any] | None:
    """Overlap of the evaluated problems with the training sequences of the policy's forecaster (None
    when the policy has no forecaster)."""
    from expertcast.models.forecaster_export import training_ids
    from expertcast.utils.provenance import check_overlap

    export = files.get("forecaster")
    if export is None:
        return None
    return check_overlap(problem_ids, training_ids(export), what=f"the forecaster {export} of --policy {name}",
                         allow_overlap=allow)


# -- settings that determine the samples --------------------------------------------------------------
def model_identity(resolved: str) -> dict[str, Any]:
    """What fixes the model's weights (with the seed, for a random-init preset): the preset name, the
    sha256 of a local folder's files, or a Hub id."""
    from expertcast.models.presets import is_preset
    from expertcast.utils.provenance import sha256_files

    if is_preset(resolved):
        return {"preset": resolved}
    p = Path(resolved)
    if p.is_dir():
        return {"path": str(p.resolve()), "files_sha256": sha256_files(p)}
    return {"hub_id": resolved}


def artefact_hashes(files: dict[str, str]) -> dict[str, str]:
    """``{option: sha256}`` of the policy's file options (a folder: over all its files)."""
    from expertcast.utils.provenance import sha256_file, sha256_files

    return {k: sha256_files(p) if Path(p).is_dir() else sha256_file(p) for k, p in sorted(files.items())}


def eval_settings(args: Any, *, resolved: str, device: str, policy_name: str, opts: dict[str, Any],
                  files: dict[str, str], capacity: dict[str, Any]) -> dict[str, Any]:
    """The resume key: every setting that determines the samples (:func:`~expertcast.utils.provenance.settings_key`)."""
    from expertcast.utils.provenance import settings_key

    return settings_key(
        job="eval", model=model_identity(resolved), dtype=args.dtype, device=device.split(":")[0],
        seed=args.seed, chat_template=args.chat_template, benchmark=args.benchmark, split=args.split,
        max_new_tokens=args.max_new_tokens,
        policy={"name": policy_name, "options": {k: v for k, v in sorted(opts.items()) if k not in files},
                "artefacts_sha256": artefact_hashes(files)},
        capacity=capacity, pool=args.pool, batch_size=args.batch_size, link_gbps=args.link_gbps, greedy=True)


def resume_rows(out: Any, settings: dict[str, Any], settings_hash: str) -> list[dict[str, Any]]:
    """Samples an earlier run of the same settings left in ``out`` (exit 2 on any mismatch)."""
    from expertcast.inference.eval_run import SAMPLES, SETTINGS, read_samples
    from expertcast.utils.io import atomic_write_json
    from expertcast.utils.provenance import check_resume

    samples, saved_path = out.path / SAMPLES, out.path / SETTINGS
    has_samples = samples.is_file() and samples.stat().st_size > 0
    if has_samples:
        saved = json.loads(saved_path.read_text(encoding="utf-8")) if saved_path.is_file() else None
        check_resume(saved, settings, out.path)
    done = read_samples(samples, settings_hash, repair=True)
    atomic_write_json(out.file(SETTINGS), settings)
    out.track(SAMPLES)
    return done


# -- the run ------------------------------------------------------------------------------------------
def evaluate(args: Any) -> int:
    """Validate, claim ``--out``, resume, generate the missing samples, summarize."""
    from expertcast.data.benchmarks import load_benchmark
    from expertcast.utils.outdir import claim_output_dir
    from expertcast.utils.provenance import sha256_json

    caps = capacities_from_args(args, multiple=False)
    if not caps:
        raise UsageError("give --capacity (a fraction of all experts) or --slots (a slot count)")
    device = resolve_device(args.device)
    policy, name, opts, files = build_policy(args.policy)
    resolved = resolve_model(args.model)
    shape = model_shape(resolved)
    cache_config = check_capacity(caps[0], args.pool, shape)
    check_policy_fits(policy, shape, args.model)
    fit_stage_policy(policy, resolved)
    problems = load_benchmark(args.benchmark, args.split, data_dir=args.data_dir, limit=args.limit)
    overlap = check_leakage(name, files, [p.id for p in problems], args.allow_overlap)
    settings = eval_settings(args, resolved=resolved, device=device, policy_name=name, opts=opts, files=files,
                             capacity=caps[0])
    settings_hash = sha256_json(settings)
    with claim_output_dir(args.out, "eval", overwrite=args.overwrite) as out:
        done = resume_rows(out, settings, settings_hash)
        info = {"model": args.model, "model_path": resolved, "policy": args.policy, "capacity": caps[0],
                "cache": cache_config.describe(), "artefacts": files, "overlap": overlap, "settings": settings,
                "settings_hash": settings_hash}
        return _generate_and_report(args, out, problems, done, policy, device, info)


def _load_model(args: Any, resolved: str, device: str):
    from expertcast.models.backbone import load_moe_model

    model, tok = load_moe_model(resolved, dtype=args.dtype, device=device, seed=args.seed)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _generate_and_report(args: Any, out: Any, problems: list[Any], done: list[dict[str, Any]], policy: Any,
                         device: str, info: dict[str, Any]) -> int:
    from expertcast.data.prompts import has_chat_template
    from expertcast.inference.eval_run import SAMPLES, append_samples, eos_ids, read_samples, run_batch
    from expertcast.inference.runtime.engine import OffloadedModel

    done_ids = {r["id"] for r in done}
    todo = [p for p in problems if p.id not in done_ids]
    next_batch = max((int(r["batch"]) for r in done), default=-1) + 1
    if done:
        print(f"resuming {out.path}: {len(done)} samples done (same settings), {len(todo)} to go")
    model, tok = _load_model(args, info["model_path"], device)
    templated = has_chat_template(tok) if args.chat_template == "auto" else args.chat_template == "yes"
    cap = info["capacity"]
    om = OffloadedModel(model, policy, cap.get("capacity", cap.get("slots")), pool=args.pool, device=device,
                        link_gbps=args.link_gbps,
                        mmap_path=str(out.file("experts.safetensors")) if args.mmap_store else None)
    run = _start_wandb(args, info)
    eos = eos_ids(model, tok)
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
                run.log({"batch": next_batch + bi, **{k: v for k, v in stats.items() if not isinstance(v, list)}})
        wanted = {p.id: i for i, p in enumerate(problems)}
        rows = sorted((r for r in read_samples(out.path / SAMPLES, info["settings_hash"]) if r["id"] in wanted),
                      key=lambda r: wanted[r["id"]])
        memory = om.memory_report().to_dict()
    finally:
        om.close()
    _write_outputs(args, out, rows, memory, templated, info, run)
    return 0


def _progress(args: Any, batches: list[Any], info: dict[str, Any]):
    if args.no_progress or not batches:
        return batches
    from tqdm.auto import tqdm

    return tqdm(batches, desc=f"eval {args.benchmark} {args.policy} @ {info['cache']}", unit="batch")


def _start_wandb(args: Any, info: dict[str, Any]):
    if not args.wandb:
        return None
    from expertcast.utils.tracking import start_wandb_run

    cap = next(iter(info["capacity"].values()))
    return start_wandb_run(args.wandb_project, info["settings"], job_type="eval",
                           name=f"eval-{args.benchmark}-{args.policy}-{cap}")


def _write_outputs(args: Any, out: Any, rows: list[dict[str, Any]], memory: dict[str, Any], templated: bool,
                   info: dict[str, Any], run: Any) -> None:
    from expertcast.inference.eval_run import SAMPLES, plot_summary, summarize
    from expertcast.utils.io import atomic_write_json, print_table, write_csv

    summary = summarize(rows)
    summary.update(memory=memory, chat_template_used=templated, **info)
    head = {"policy": args.policy, **info["capacity"]}
    table = [{**head, **{k: summary[k] for k in SUMMARY_COLUMNS}}]
    print_table(table, title=f"expertcast eval: {args.model} on {args.benchmark}, {info['cache']} "
                             f"({summary['accounting']})")
    if info["overlap"] is not None:
        ov = info["overlap"]
        print(f"forecaster training overlap: {ov['overlap']} of {ov['evaluated']} evaluated problems"
              + (" (allowed by --allow-overlap)" if ov["allowed"] else ""))
    atomic_write_json(out.file("summary.json"), summary)
    write_csv(out.file("summary.csv"), table)
    write_csv(out.file("samples.csv"), [{k: r[k] for k in ("id", "batch", "correct", "answer", "gold", "new_tokens")}
                                        for r in rows])
    plot_summary(summary, rows, out.file("summary.png"),
                 f"{args.model} {args.benchmark} {args.policy} @ {next(iter(info['capacity'].values()))}")
    if run is not None:
        run.summary.update({k: summary[k] for k in SUMMARY_COLUMNS})
        run.finish()
    print(f"wrote {out.path / 'summary.json'}, summary.csv, samples.csv, summary.png, {SAMPLES}")
