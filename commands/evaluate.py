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

Speed against full load, in the same run: the first ``--speed-samples`` problems are generated again,
offloaded and by the baseline in interleaved passes (baseline, then offloaded + baseline ``--speed-repeats``
times); ``pct_full`` is the median of each offloaded pass's tokens/s over the mean of its two neighbouring
baseline passes, with the min-max of those ratios (``speed.json``; reused on resume when nothing changed).
The baseline is the full-load model (every expert on the device) or, when the experts do not fit beside
it (``--baseline auto`` on CUDA), the runtime executing every routed expert on the host
(``all-experts-on-host``, named as such). A stage-aware policy decides CPU execution vs transfer with a
latency model measured on this machine at start-up (``latency_model`` in ``summary.json``).
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
from expertcast.data.benchmarks import BENCHMARKS
from expertcast.utils.errors import UsageError

PROG = "expertcast eval"
DTYPES = ("auto", "float32", "bfloat16", "float16")
SIMULATOR_ONLY = {
    "stage-oracle": "it reads the next stage from the recorded routing",
}
"""Registered policies that cannot drive a live generation, and why."""
SUMMARY_COLUMNS = ["samples", "accuracy", "hit", "adj_hit", "mb_per_token", "tokens_per_s", "ttft_s",
                   "stall_ms_per_token", "late_prefetches", "cpu_exec", "pct_full", "pct_full_min", "pct_full_max", "baseline"]
BASELINES = ("auto", "full-load", "host", "none")
SPEED = "speed.json"


def build_parser() -> CommandParser:
    ap = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("--model", required=True, help="tiny preset name, 'tiny-default', local HF directory or Hub id")
    ap.add_argument("--benchmark", required=True, choices=list(BENCHMARKS), help="benchmark to grade")
    ap.add_argument("--policy", required=True,
                    help="cache policy with options, e.g. lru, 'lrfu:lam=0.1', 'seqmoe:forecaster=EXPORT', "
                         "'stage:cue_set=CUES.json'")
    add_capacity_args(ap, multiple=False)
    ap.add_argument("--out", required=True, help="output folder (claimed; resumed when the settings match)")
    ap.add_argument("--overwrite", action="store_true", help="remove this folder's earlier eval output and start over")
    ap.add_argument("--mmap-store", action="store_true",
                    help="memory-map the host expert store (written to OUT/experts.safetensors)")
    add_run_args(ap)
    return ap


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
    add_speed_args(ap)
    ap.add_argument("--wandb", action="store_true", help="log the summary and per-batch metrics to W&B")
    ap.add_argument("--wandb-project", default="expertcast", help="W&B project")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_speed_args(ap: CommandParser) -> None:
    """The paired speed measurement's flags (shared with ``expertcast sweep``)."""
    ap.add_argument("--baseline", default="auto", choices=BASELINES,
                    help="speed baseline: full-load (every expert on the device), host (every expert executed on "
                         "the host: all-experts-on-host), auto (full-load when it fits the device), none (skip)")
    ap.add_argument("--speed-repeats", type=positive_int, default=3,
                    help="offloaded passes of the paired speed measurement (each between two baseline passes)")
    ap.add_argument("--speed-samples", type=positive_int, default=None,
                    help="problems timed in the paired speed measurement (None = one batch: --batch-size)")


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), argv, PROG, evaluate)


# -- validation (cheap, before the model loads) --------------------------------------------------------
def build_policy(spec: str) -> tuple[Any, str, dict[str, Any], dict[str, str]]:
    """(policy, name, options, file options) of ``--policy NAME[:k=v,...]``, options typed and validated
    by :func:`~expertcast.inference.cache.options.parse_policy_options`; every mistake is a UsageError."""
    from expertcast.inference.policies import make_policy
    from expertcast.inference.cache.options import parse_policy_options
    from expertcast.inference.runtime.live_routers import is_router_policy, live_router_policy

    if is_router_policy(spec):  # live routers: their scores come from the --model export (attached at offload)
        name, opts = live_router_policy(spec)
        return make_policy(name, **opts), name, opts, {}
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
        from expertcast.models.backbone import load_moe_config

        try:
            config = load_moe_config(resolved)  # a router-adaptation export: its model's (or adapter base's)
        except (OSError, ValueError) as e:
            raise UsageError(f"--model {resolved}: cannot read its config ({' '.join(str(e).split())[:200]})") from None
    spec = MoESpec.from_config(config)
    return spec.num_layers, spec.num_experts, spec.top_k


def check_capacity(cap: dict[str, Any], pool: str, shape: tuple[int, int, int]):
    """The CacheConfig of ``cap`` on a model of ``shape`` (UsageError naming the flag when it cannot hold)."""
    from expertcast.inference.cache.expert_cache import Budget, CacheConfig

    L, E, K = shape
    flag = "--capacity" if "capacity" in cap else "--slots"
    try:
        return CacheConfig(num_layers=L, num_experts=E, top_k=K, pool=pool, budget=Budget.from_flags(cap))
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
        decode_path=args.decode_path)


def resume_rows(out: Any, settings: dict[str, Any], settings_hash: str) -> list[dict[str, Any]]:
    """Samples an earlier run of the same settings left in ``out`` (exit 2 on any mismatch)."""
    from expertcast.inference.runtime.eval_run import SAMPLES, SETTINGS, read_samples
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
def prepare(args: Any) -> dict[str, Any]:
    """Every cheap check of one evaluation (before the model loads); returns the cell: the policy factory,
    the problems and the run's info (settings, hash, capacity, artefacts, overlap)."""
    from expertcast.data.benchmarks import load_benchmark
    from expertcast.utils.provenance import sha256_json

    caps = capacities_from_args(args, multiple=False)
    if not caps:
        raise UsageError("give --capacity (a fraction of all experts) or --slots (a slot count)")
    device = resolve_device(args.device)
    policy, name, opts, files = build_policy(args.policy)
    from expertcast.inference.runtime.live_routers import is_router_policy, router_export_model

    if is_router_policy(name):  # --model is a router-adaptation export: its model folder, its routers' hash
        resolved, files = router_export_model(args.model, name)
    else:
        resolved = resolve_model(args.model)
    shape = model_shape(resolved)
    cache_config = check_capacity(caps[0], args.pool, shape)
    check_policy_fits(policy, shape, args.model)
    fit_stage_policy(policy, resolved)
    problems = load_benchmark(args.benchmark, args.split, data_dir=args.data_dir, limit=args.limit)
    overlap = check_leakage(name, files, [p.id for p in problems], args.allow_overlap)
    settings = eval_settings(args, resolved=resolved, device=device, policy_name=name, opts=opts, files=files,
                             capacity=caps[0])
    info = {"model": args.model, "model_path": resolved, "policy": args.policy, "capacity": caps[0],
            "cache": cache_config.describe(), "artefacts": files, "overlap": overlap, "settings": settings,
            "settings_hash": sha256_json(settings)}
    return {"policy": policy, "problems": problems, "device": device, "info": info, "shape": shape}


def evaluate(args: Any) -> int:
    """Validate, claim ``--out``, resume, generate the missing samples, measure the speed, summarize."""
    from expertcast.utils.outdir import claim_output_dir

    cell = prepare(args)
    set_threads(args.threads)
    with claim_output_dir(args.out, "eval", overwrite=args.overwrite) as out:
        run_cell(args, out, cell, ModelSession(args, cell["info"]["model_path"], cell["device"]))
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
    return _generate_and_report(args, out, cell, done, session)


class ModelSession:
    """The evaluated model, loaded once and shared by the evaluations of a sweep. It is loaded straight to
    the host store (:func:`~expertcast.inference.runtime.loading.load_offloaded`: the whole model is never
    on the device); between two offloaded runs the experts go back into the model (full load) when they
    fit the device and a full-load baseline is wanted, and the host store is reused."""

    def __init__(self, args: Any, resolved: str, device: str):
        self.args, self.resolved, self.device = args, resolved, device
        self.model = self.tok = self.store = None
        self.full = False
        """The model holds its experts (full load) now."""
        self.load_report: dict[str, Any] | None = None

    def offload(self, policy: Any, capacity: dict[str, Any], measure_latency: bool = False):
        """An OffloadedModel of the session's model (loaded on the first call; then the store is reused)."""
        from expertcast.inference.cache.expert_cache import Budget
        from expertcast.inference.runtime.engine import OffloadedModel
        from expertcast.inference.runtime.live_routers import attach_live_routers

        a = self.args
        cap = Budget.from_flags(capacity)
        if self.model is None:
            from expertcast.inference.runtime.loading import load_offloaded

            mmap = str(Path(a.out) / "experts.safetensors") if a.mmap_store else None
            om, self.tok, report = load_offloaded(self.resolved, policy, cap, device=self.device, dtype=a.dtype,
                                                  pool=a.pool, link_gbps=a.link_gbps, mmap_path=mmap, seed=a.seed,
                                                  decode_path=a.decode_path)
            _pad_left(self.tok)
            self.model, self.store, self.load_report = om.model, om.store, report.to_dict()
            if measure_latency:
                om.use_measured_latency()
        else:
            om = OffloadedModel(self.model, policy, cap, pool=a.pool, device=self.device, link_gbps=a.link_gbps,
                                store=self.store, measure_latency=measure_latency, decode_path=a.decode_path)
        self.full = False
        attach_live_routers(policy, om.model, a.model)  # router policies: the --model export's routers, live
        return om

    def give_back(self, om: Any, full: bool) -> None:
        """Detach ``om``; with ``full`` the experts go back into the model (full load) when they fit the
        device (CUDA: its free memory once the slots are freed), else they stay in the host store only."""
        from expertcast.inference.runtime.live_routers import detach_live_routers

        detach_live_routers(om.policy)  # a full-load pass runs without the live routers' hooks
        if full and self._full_load_fits(om):
            self.model = om.restore()
            self.full = True
        else:
            om.close()
            self.full = False

    def _full_load_fits(self, om: Any) -> bool:
        if not str(self.device).startswith("cuda"):
            return True  # the "device" is the host, which holds the experts already
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(self.device))
        return self.store.nbytes * 1.1 <= free + om.pool.nbytes  # a margin for the allocator


def _pad_left(tok: Any) -> None:
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token


def _generate_and_report(args: Any, out: Any, cell: dict[str, Any], done: list[dict[str, Any]],
                         session: ModelSession) -> dict[str, Any]:
    from expertcast.data.prompts import has_chat_template
    from expertcast.inference.runtime.eval_run import SAMPLES, append_samples, eos_ids, read_samples, run_batch

    info, problems = cell["info"], cell["problems"]
    done_ids = {r["id"] for r in done}
    todo = [p for p in problems if p.id not in done_ids]
    next_batch = max((int(r["batch"]) for r in done), default=-1) + 1
    if done:
        print(f"resuming {out.path}: {len(done)} samples done (same settings), {len(todo)} to go")
    om = session.offload(cell["policy"], info["capacity"], measure_latency=True)
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
                run.log({"batch": next_batch + bi, **{k: v for k, v in stats.items() if not isinstance(v, list)}})
        wanted = {p.id: i for i, p in enumerate(problems)}
        rows = sorted((r for r in read_samples(out.path / SAMPLES, info["settings_hash"]) if r["id"] in wanted),
                      key=lambda r: wanted[r["id"]])
        memory = om.memory_report().to_dict()
        lat_model = getattr(om.policy, "latency", None) if latency is not None else None
    except BaseException:
        om.close()
        raise
    session.give_back(om, full=args.baseline in ("auto", "full-load"))
    speed = _speed(args, out, cell, session, templated, eos, lat_model)
    return _write_outputs(args, out, rows, memory, templated,
                          {**info, "latency_model": latency, "speed": speed, "load": session.load_report}, run)


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
    baseline = _baseline_kind(args.baseline, session)
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
    atomic_write_json(out.file(SPEED), speed)
    return speed


def _baseline_kind(choice: str, session: ModelSession) -> str:
    """:data:`~expertcast.inference.runtime.eval_run.FULL_LOAD` or ``HOST_BASELINE`` for ``--baseline``: ``auto``
    takes the full load when the experts went back into the model (they fit the device)."""
    from expertcast.inference.runtime.eval_run import FULL_LOAD, HOST_BASELINE

    if choice == "host" or (choice == "auto" and not session.full):
        return HOST_BASELINE
    if not session.full:
        raise UsageError(f"--baseline full-load: the model's experts ({session.store.nbytes / 1e9:.2f} GB) do not fit "
                         f"the free memory of {session.device}; use --baseline auto or host")
    return FULL_LOAD


def measure_speed(args: Any, session: ModelSession, cell: dict[str, Any], probs: list[Any], templated: bool,
                  eos: list[int], baseline: str, lat_model: Any) -> dict[str, Any]:
    """Interleaved passes over ``probs`` (batches of ``--batch-size``): the evaluated policy offloaded, a
    fresh policy and an empty cache each pass, against ``baseline`` (see
    :func:`~expertcast.inference.runtime.eval_run.paired_speed`)."""
    from expertcast.data.prompts import build_prompt
    from expertcast.inference.runtime.eval_run import (
        FULL_LOAD,
        HostExecutionPolicy,
        SpeedRun,
        decode_tokens,
        full_load_generate,
        generated,
        paired_speed,
    )

    tok, info = session.tok, cell["info"]
    encs = []
    for i in range(0, len(probs), args.batch_size):
        texts = [build_prompt(tok, p.question, args.benchmark, use_chat_template=templated)
                 for p in probs[i:i + args.batch_size]]
        encs.append(tok(texts, return_tensors="pt", padding=True, add_special_tokens=not templated))
    gen_kw = {"max_new_tokens": args.max_new_tokens, "eos_token_id": eos or None, "pad_token_id": tok.pad_token_id}

    def offloaded(policy: Any, capacity: dict[str, Any], kind: str) -> SpeedRun:
        om = session.offload(policy, capacity)
        try:
            seqs = []
            for enc in encs:
                res = om.generate(enc["input_ids"], enc["attention_mask"], **gen_kw)
                seqs += generated(res.sequences.cpu(), enc["input_ids"].shape[1], eos)
            st = om.stats
        except BaseException:
            om.close()
            raise
        session.give_back(om, full=baseline == FULL_LOAD)
        return SpeedRun(kind, int(st.decoded_tokens), float(st.decode_seconds), seqs)

    def run_policy() -> SpeedRun:
        policy = build_policy(args.policy)[0]
        fit_stage_policy(policy, info["model_path"])
        if lat_model is not None and hasattr(policy, "use_latency"):
            policy.use_latency(lat_model)  # the latency model measured at start-up
        return offloaded(policy, info["capacity"], "offloaded")

    def run_full() -> SpeedRun:
        seqs, secs = [], 0.0
        for enc in encs:
            out, dt = full_load_generate(session.model, enc, max_new_tokens=args.max_new_tokens, eos=eos,
                                         pad_token_id=tok.pad_token_id)
            seqs += generated(out, enc["input_ids"].shape[1], eos)
            secs += dt
        return SpeedRun(FULL_LOAD, decode_tokens(seqs), secs, seqs)

    def run_host() -> SpeedRun:
        return offloaded(HostExecutionPolicy(), {"slots": cell["shape"][2]}, HostExecutionPolicy.name)

    speed = paired_speed(run_policy, run_full if baseline == FULL_LOAD else run_host, args.speed_repeats)
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
    from expertcast.utils.tracking import start_wandb_run

    cap = next(iter(info["capacity"].values()))
    return start_wandb_run(args.wandb_project, info["settings"], job_type="eval",
                           name=f"eval-{args.benchmark}-{args.policy}-{cap}")


def _write_outputs(args: Any, out: Any, rows: list[dict[str, Any]], memory: dict[str, Any], templated: bool,
                   info: dict[str, Any], run: Any) -> dict[str, Any]:
    from expertcast.inference.runtime.eval_run import SAMPLES, plot_summary, summarize
    from expertcast.utils.io import atomic_write_json, print_table, write_csv

    summary = summarize(rows)
    summary.update(memory=memory, chat_template_used=templated, **info)
    speed = info["speed"] or {}
    summary.update({k: speed.get(k) for k in ("pct_full", "pct_full_min", "pct_full_max", "baseline")},
                   baseline_tokens_per_s=speed.get("baseline_tokens_per_s"))
    head = {"policy": args.policy, **info["capacity"]}
    table = [{**head, **{k: summary[k] for k in SUMMARY_COLUMNS}}]
    print_table(table, title=f"expertcast eval: {args.model} on {args.benchmark}, {info['cache']} "
                             f"({summary['accounting']})")
    if info["overlap"] is not None:
        ov = info["overlap"]
        print(f"forecaster training overlap: {ov['overlap']} of {ov['evaluated']} evaluated problems"
              + (" (allowed by --allow-overlap)" if ov["allowed"] else ""))
    if speed:
        print(f"speed: {speed['pct_full']:.1f}% of {speed['baseline']} tokens/s (median of {speed['repeats']} paired "
              f"passes, min-max {speed['pct_full_min']:.1f}-{speed['pct_full_max']:.1f}%; {speed['tokens_per_s']:.1f} vs "
              f"{speed['baseline_tokens_per_s']:.1f} tokens/s on {len(speed['problems'])} problems)")
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
