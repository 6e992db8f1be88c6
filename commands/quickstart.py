"""``expertcast quickstart``: the whole pipeline on the embedded default model, on CPU.

Steps (each through the same code path as its own command):

1. load the embedded default MoE model (shipped in the repository, its checksums verified; built by
   ``expertcast build-default``, which is never run implicitly);
2. collect routing traces on the first ``--limit`` GSM8K test problems (``expertcast collect``);
3. print trace statistics (``expertcast traces stats``);
4. simulate the expert cache on those traces (``expertcast simulate``: table, JSON, CSV, PNG);
5. train a tiny SeqMoE forecaster on those traces (``expertcast fit``) and report its recall by
   horizon on the sequences it never saw (``expertcast forecast-eval``);
6. run the model with real expert offloading on 4 GSM8K problems and on 16 held-out ``arith`` problems
   (``expertcast eval``): GSM8K is out of reach of a model this size, arith is its accuracy signal.

Every step writes into its own sub-folder of ``--out`` named by a hash of the settings that determine
its output (a changed ``--limit`` means new traces, a new simulation and a new forecaster, never a
forecaster trained on a subset scored on its own training sequences). A step whose folder finished under the same settings is
reused, and the run says so in one line. The simulator and the runtime use the same ``--pool``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expertcast.commands.common import (
    CommandParser,
    add_capacity_args,
    capacities_from_args,
    nonneg_int,
    parse_and_run,
    positive_int,
    resolve_model,
)

if TYPE_CHECKING:
    from expertcast.inference.cache.expert_cache import Budget

PROG = "expertcast quickstart"
STEPS_FILE = "steps.json"
EVAL_BENCHMARKS = {"gsm8k": 4, "arith": 16}
"""Problems of each benchmark in the offloaded run (step 6)."""
EVAL_MAX_NEW_TOKENS = 64
EVAL_CAPACITY = 0.25
FORECAST_TEST_FRACTION = 0.2
"""Share of the traced problems the forecaster never sees (by a hash of the problem id): forecast-eval's
held-out set."""
FORECAST_MIN_PROBLEMS = 3
"""Problems the forecaster step needs at least: one to train on, one to validate on, one held out."""
MEANINGS = [
    ("Hit", "share of decode-time expert accesses served from the cache: 1 - demand misses / accesses"),
    ("AdjHit", "hits over accesses + prefetches: (A - D) / (A + P); charges a prefetching policy for its loads"),
    ("MB/token", "expert bytes moved over the host link per decoded token: (D + P) x expert size"),
    ("belady_fraction", "Hit as a fraction of the demand-only ceiling (Belady with a free warm start and bypass: no policy that loads only on a miss can beat it) at the same capacity"),
    ("pct_full_speed", "modelled decode speed as % of running with every expert resident (cost model)"),
    ("recall@K h", "share of the true top-K experts h decode steps ahead found in the forecaster's top-K"),
    ("accuracy", "exact match of the final answer: GSM8K, and held-out 2-digit arithmetic (arith, never in the corpus)"),
    ("tokens/s, TTFT", "measured decode speed (the paired offloaded passes) and time to first token of the offloaded run "
                       "on this machine"),
    ("% of full speed", "offloaded tokens/s over the same runtime's with every expert resident (same kernels, threads, "
                        "batch), median of interleaved paired passes with their min-max; flagged when the passes disagree"),
]


def build_parser() -> CommandParser:
    p = CommandParser(prog=PROG, description=__doc__.split("\n\n", 1)[0].split(": ", 1)[1],
                      epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", default="runs/quickstart", help="output folder (a second run reuses finished steps)")
    p.add_argument("--model", default="tiny-default",
                   help="model to run the pipeline on: 'tiny-default' (the embedded default), a tiny preset, a "
                        "local Hugging Face directory or a Hub id")
    p.add_argument("--limit", type=positive_int, default=32, help="GSM8K test problems to collect traces on")
    p.add_argument("--max-new-tokens", type=positive_int, default=128,
                   help=f"tokens generated per problem when collecting (the offloaded run: at most "
                        f"{EVAL_MAX_NEW_TOKENS})")
    add_capacity_args(p, multiple=True, default="0.15,0.25,0.35,0.45")
    p.add_argument("--policies", default="lru,lfu,fifo,static,belady", help="cache policies to simulate")
    p.add_argument("--pool", default="per-layer", choices=["per-layer", "shared"],
                   help="slot pool of the simulator and of the offloaded run (the same for both)")
    p.add_argument("--forecaster-steps", type=nonneg_int, default=60,
                   help="optimizer steps of the tiny SeqMoE forecaster (0 skips step 5)")
    p.add_argument("--skip-offload", action="store_true", help="stop before the offloaded run (step 6)")
    p.add_argument("--data-dir", default=None, help="local benchmark folder (None = $EXPERTCAST_DATA_DIR, ../shared/data, else the Hub)")
    return p


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), argv, PROG, quickstart)


class StepFailed(Exception):
    """A step's command exited with a non-zero status (it printed why)."""

    def __init__(self, rc: int):
        super().__init__(rc)
        self.rc = rc


class Pipeline:
    """Banners with real step numbers, settings-keyed step folders and their reuse."""

    def __init__(self, out: Any, total: int):
        self.out = out
        self.total = total
        self.index = 0
        self.state_path = out.path / STEPS_FILE
        self.finished: dict[str, str] = json.loads(self.state_path.read_text()) if self.state_path.is_file() else {}

    def banner(self, text: str) -> None:
        self.index += 1
        print(f"\n=== [{self.index}/{self.total}] {text} ===", flush=True)

    def folder(self, group: str, label: str, key: dict[str, Any]) -> tuple[Path, str]:
        """(``OUT/group/label-HASH``, HASH) for a step of settings ``key``."""
        from expertcast.utils.provenance import settings_key, sha256_json

        digest = sha256_json(settings_key(**key))[:12]
        self.out.track(group)
        return self.out.path / group / f"{label}-{digest}", digest

    def run(self, what: str, folder: Path, digest: str, body: Callable[[], int | None]) -> bool:
        """Run ``body`` unless ``folder`` finished under the same settings; True when it was reused."""
        rel = str(folder.relative_to(self.out.path))
        if self.finished.get(rel) == digest and folder.is_dir():
            print(f"reusing {what} in {folder} (same settings)")
            return True
        rc = int(body() or 0)
        if rc:
            raise StepFailed(rc)
        from expertcast.utils.io import atomic_write_json

        self.finished[rel] = digest
        atomic_write_json(self.out.file(STEPS_FILE), self.finished)
        return False


def quickstart(args: Any) -> int:
    from expertcast.utils.errors import UsageError
    from expertcast.utils.outdir import claim_output_dir

    if args.forecaster_steps > 0 and args.limit < FORECAST_MIN_PROBLEMS:
        raise UsageError(f"--limit {args.limit}: the forecaster step needs at least {FORECAST_MIN_PROBLEMS} problems "
                         f"(one each to train on, to validate on and to hold out); use --limit "
                         f"{FORECAST_MIN_PROBLEMS} or more, or --forecaster-steps 0")
    caps = capacities_from_args(args, multiple=True)
    cap_flags = _capacity_flags(caps)
    total = 5 + len(EVAL_BENCHMARKS) - (args.forecaster_steps == 0) - len(EVAL_BENCHMARKS) * bool(args.skip_offload)
    t0 = time.perf_counter()
    with claim_output_dir(args.out, "quickstart") as out:
        pipe = Pipeline(out, total)
        try:
            done = _steps(pipe, args, cap_flags)
        except StepFailed as e:
            return e.rc
        _final_summary(done, args, out.path, time.perf_counter() - t0)
    return 0


def _capacity_flags(caps: list[Budget]) -> list[str]:
    fracs = [str(c.value) for c in caps if c.kind == "fraction"]
    slots = [str(c.value) for c in caps if c.kind == "slots"]
    return (["--capacity", ",".join(fracs)] if fracs else []) + (["--slots", ",".join(slots)] if slots else [])


def _steps(pipe: Pipeline, args: Any, cap_flags: list[str]) -> dict[str, Path]:
    """Run (or reuse) every step; returns the folder of each step's output."""
    from expertcast.models.backbone import model_identity

    data = ["--data-dir", args.data_dir] if args.data_dir else []
    pipe.banner("model")
    model = resolve_model(args.model)
    print(f"model: {model}")
    if args.model in _default_names():
        print(_default_provenance(Path(model)))
    ident = model_identity(model)
    done: dict[str, Path] = {}

    pipe.banner(f"routing traces on GSM8K test[:{args.limit}], {args.max_new_tokens} new tokens per problem")
    done["traces"], traces_key = _collect(pipe, args, model, ident, data)

    pipe.banner("trace statistics (decode positions)")
    from expertcast.commands.traces import main as traces_main

    stats, _ = pipe.folder("stats", done["traces"].name, {"traces": traces_key})
    stats.mkdir(parents=True, exist_ok=True)
    if traces_main(["stats", str(done["traces"]), "--phase", "decode", "--json", str(stats / "stats.json"),
                    "--plot", str(stats / "frequency.png")]):
        raise StepFailed(2)

    pipe.banner(f"expert-cache simulation, {args.pool} pool (the offloaded run uses the same), decode only; "
                f"belady_fraction against the demand-only ceiling")
    done["simulate"] = _simulate(pipe, args, traces_key, done["traces"], cap_flags)

    if args.forecaster_steps > 0:
        pipe.banner(f"SeqMoE forecaster: {args.forecaster_steps} training steps, then recall by horizon on the "
                    f"sequences it never saw")
        done["forecaster"], done["forecast-eval"] = _forecaster(pipe, args, traces_key, done["traces"])

    if not args.skip_offload:
        for bench, n in EVAL_BENCHMARKS.items():
            pipe.banner(f"real expert offloading on {bench} test[:{n}]: LRU, {EVAL_CAPACITY:.0%} of experts "
                        f"resident, {args.pool} pool (as simulated)")
            done[f"eval-{bench}"] = _offloaded(pipe, args, model, ident, data, bench, n)
    return done


def _collect(pipe: Pipeline, args: Any, model: str, ident: dict[str, Any], data: list[str]) -> tuple[Path, str]:
    from expertcast.commands.collect import main as collect_main

    key = {"model": ident, "benchmark": "gsm8k", "split": "test", "limit": args.limit,
           "max_new_tokens": args.max_new_tokens, "router_probs": True}
    folder, digest = pipe.folder("traces", f"gsm8k-test-n{args.limit}-t{args.max_new_tokens}", key)
    pipe.run("the routing traces", folder, digest, lambda: collect_main(
        ["--model", model, "--benchmark", "gsm8k", "--split", "test", "--limit", str(args.limit),
         "--max-new-tokens", str(args.max_new_tokens), "--batch-size", "8", "--shard-size", "16", "--router-probs",
         "--out", str(folder), *data]))
    return folder, digest


def _simulate(pipe: Pipeline, args: Any, traces_key: str, traces: Path, cap_flags: list[str]) -> Path:
    from expertcast.commands.simulate import main as simulate_main

    key = {"traces": traces_key, "policies": args.policies, "capacity": cap_flags, "pool": args.pool}
    folder, digest = pipe.folder("simulate", traces.name, key)
    pipe.run("the simulation", folder, digest, lambda: simulate_main(
        ["--traces", str(traces), "--policies", args.policies, *cap_flags, "--pool", args.pool, "--out", str(folder)]))
    return folder


def _forecaster(pipe: Pipeline, args: Any, traces_key: str, traces: Path) -> tuple[Path, Path]:
    from expertcast.commands.fit import main as fit_main
    from expertcast.commands.forecast_eval import main as forecast_eval_main
    from expertcast.utils.paths import REPO_ROOT
    from expertcast.utils.provenance import sha256_file

    config = REPO_ROOT / "configs" / "forecaster" / "tiny.yaml"
    seed = split_seed_of(traces, config)
    key = {"traces": traces_key, "steps": args.forecaster_steps, "config": sha256_file(config),
           "test_fraction": FORECAST_TEST_FRACTION, "split_seed": seed}
    folder, digest = pipe.folder("forecaster", traces.name, key)
    export = folder / "export"
    reused = pipe.run("the forecaster", folder, digest, lambda: fit_main(
        ["fit", "--config", str(config), "--data.init_args.traces", str(traces),
         "--data.init_args.test_fraction", str(FORECAST_TEST_FRACTION), "--data.init_args.split_seed", str(seed),
         "--model.init_args.export_dir", str(export), "--trainer.default_root_dir", str(folder),
         "--trainer.max_steps", str(args.forecaster_steps), "--trainer.max_epochs", "-1",
         "--trainer.check_val_every_n_epoch", "1", "--trainer.logger", "false", "--trainer.callbacks", "[]",
         "--ckpt_path", "null"]))
    if not reused:
        steps = json.loads((export / "forecaster.json").read_text()).get("extra", {}).get("global_step")
        print(f"trained {steps} optimizer steps; export: {export}")
    fe_folder, fe_digest = pipe.folder("forecast-eval", traces.name, {"forecaster": digest})
    pipe.run("the forecast evaluation", fe_folder, fe_digest, lambda: forecast_eval_main(
        ["--forecaster", str(export), "--traces", str(traces), "--split", "auto", "--out", str(fe_folder)]))
    return export, fe_folder


def held_out_seed(ids: list[str], val_fraction: float, test_fraction: float, tries: int = 10_000) -> int | None:
    """The smallest split seed whose hash split (:func:`~expertcast.utils.provenance.split_of`) of ``ids`` leaves
    every split non-empty (train, val when ``val_fraction`` > 0, test), or None within ``tries`` seeds."""
    from collections import Counter

    from expertcast.utils.provenance import split_of

    need = ["train", "test"] + (["val"] if val_fraction > 0 else [])
    for seed in range(tries):
        got = Counter(split_of(i, val_fraction, test_fraction, seed=seed) for i in ids)
        if all(got[k] for k in need):
            return seed
    return None


def split_seed_of(traces: Path, config: Path) -> int:
    """The forecaster's split seed for the traced problems: the config's when its split holds out at least one
    problem and leaves one to train and one to validate on, else the smallest seed that does
    (:func:`held_out_seed`): a few problems (``--limit 8``) may all hash into the training split."""
    import yaml
    from expertcast.data.traces import load_traces
    from expertcast.utils.errors import UsageError

    data = (yaml.safe_load(config.read_text()) or {}).get("data", {}).get("init_args", {})
    val, seed = float(data.get("val_fraction", 0.0)), int(data.get("split_seed", 0))
    ids = [s.seq_id for s in load_traces(traces)[1]]
    from expertcast.utils.provenance import split_of

    splits = {split_of(i, val, FORECAST_TEST_FRACTION, seed=seed) for i in ids}
    if {"train", "test"} | ({"val"} if val > 0 else set()) <= splits:
        return seed
    found = held_out_seed(ids, val, FORECAST_TEST_FRACTION)
    if found is None:
        raise UsageError(f"{traces}: no split seed holds out one of its {len(ids)} problems and leaves one to train "
                         f"and one to validate on; use a larger --limit")
    return found


def _offloaded(pipe: Pipeline, args: Any, model: str, ident: dict[str, Any], data: list[str], benchmark: str,
               limit: int) -> Path:
    from expertcast.commands.evaluate import main as eval_main

    new_tokens = min(args.max_new_tokens, EVAL_MAX_NEW_TOKENS)
    batch = 2 if benchmark == "gsm8k" else 8
    key = {"model": ident, "benchmark": benchmark, "policy": "lru", "capacity": EVAL_CAPACITY, "pool": args.pool,
           "limit": limit, "batch_size": batch, "max_new_tokens": new_tokens}
    folder, digest = pipe.folder("eval", f"{benchmark}-lru-{EVAL_CAPACITY}", key)
    pipe.run(f"the offloaded run on {benchmark}", folder, digest, lambda: eval_main(
        ["--model", model, "--benchmark", benchmark, "--policy", "lru", "--capacity", str(EVAL_CAPACITY),
         "--pool", args.pool, "--limit", str(limit), "--batch-size", str(batch), "--max-new-tokens", str(new_tokens),
         "--out", str(folder), *data]))
    return folder


def _default_names() -> tuple[str, ...]:
    from expertcast.commands.common import DEFAULT_MODEL_NAMES

    return DEFAULT_MODEL_NAMES


def _default_provenance(folder: Path) -> str:
    """Where the embedded default came from, in one line (from its shipped, verified report)."""
    from expertcast.recipes.tiny_default import load_report

    r = load_report(folder)
    arith = (r.get("heldout_arith_test") or {}).get("accuracy")
    size = sum(f["bytes"] for f in r["shipped_files"].values()) / 1e6
    return (f"the embedded default: shipped in the repository ({size:.1f} MB, sha256 of every file verified against "
            f"its report), built by `expertcast build-default` (recipe {r['recipe_hash']}, {r['steps']} steps on "
            f"{r['threads']} threads, {r['train_time_s'] / 60:.0f} min, torch {r['torch']}); held-out arith accuracy "
            f"{arith:.1%} at build time. Nothing is trained here.")


# -- the closing summary ------------------------------------------------------------------------------
def _final_summary(done: dict[str, Path], args: Any, out: Path, seconds: float) -> None:
    """What the headline numbers mean, the numbers, and where every output is."""
    print(f"\n=== quickstart finished in {seconds:.0f} s ===")
    for line in _headlines(done):
        print(line)
    print("\nwhat the numbers mean:")
    width = max(len(n) for n, _ in MEANINGS)
    for name, meaning in MEANINGS:
        print(f"  {name.ljust(width)}  {meaning}")
    if _is_tiny(args.model):
        print("\nThis model is tiny: it demonstrates the plumbing (collection, simulation, forecasting, real "
              "offloading), not reasoning: GSM8K accuracy near 0 is expected; arith (held-out 2-digit arithmetic in "
              "GSM8K's answer format) is where its accuracy means something.")
    print("\noutputs:")
    for name, path in done.items():
        print(f"  {name.ljust(14)} {path}")
    print(f"  {'steps'.ljust(14)} {out / STEPS_FILE} (settings hash of every finished step)")


def _is_tiny(model: str) -> bool:
    from expertcast.commands.common import DEFAULT_MODEL_NAMES
    from expertcast.models.presets import get_preset, is_preset

    return model in DEFAULT_MODEL_NAMES or (is_preset(model) and get_preset(model).size == "tiny")


def _speed_text(s: dict[str, Any]) -> str:
    """% of full speed of an eval summary against its baseline, with the noise, or why it is no result."""
    if s.get("baseline") is None:
        return "speed not measured"
    if s.get("speed_flag"):
        return f"speed: no result ({s['speed_flag']})"
    return (f"speed: {s['pct_full']:.1f}% of full speed (the runtime with every expert resident, paired passes, "
            f"min-max {s['pct_full_min']:.1f}-{s['pct_full_max']:.1f}%)" if s["baseline"] == "all-resident" else
            f"speed: {s['pct_full']:.1f}% of {s['baseline']} (min-max {s['pct_full_min']:.1f}-{s['pct_full_max']:.1f}%)")


def _headlines(done: dict[str, Path]) -> list[str]:
    lines = []
    sim = done.get("simulate")
    if sim and (sim / "simulate.json").is_file():
        by_policy: dict[str, list[str]] = {}
        for r in json.loads((sim / "simulate.json").read_text()):
            by_policy.setdefault(r["policy"], []).append(f"{r['capacity']:.2f}: {r['hit']:.3f}")
        lines.append("simulated decode Hit by capacity:")
        lines += [f"  {p.ljust(10)} " + ", ".join(v) for p, v in by_policy.items()]
    fe = done.get("forecast-eval")
    if fe and (fe / "recall_summary.json").is_file():
        s = json.loads((fe / "recall_summary.json").read_text())
        lines.append(f"forecast recall@K on {s['sequences']} held-out sequences (h1 / h8):")
        lines += [f"  {r['predictor'].ljust(14)} {r.get('R@K h1', float('nan')):.3f} / {r.get('R@K h8', float('nan')):.3f}"
                  for r in s["rows"]]
    for bench in EVAL_BENCHMARKS:
        ev = done.get(f"eval-{bench}")
        if ev and (ev / "summary.json").is_file():
            s = json.loads((ev / "summary.json").read_text())
            lines.append(f"offloaded run on {bench} ({s['cache']}): accuracy {s['accuracy']:.2f} on {s['samples']} "
                         f"problems, Hit {s['hit']:.3f}, AdjHit {s['adj_hit']:.3f}, {s['mb_per_token']:.2f} MB/token, "
                         f"{s['tokens_per_s']:.1f} tokens/s, TTFT {s['ttft_s']:.2f} s; " + _speed_text(s))
    return lines
