"""The eval session: a model loaded once, offloaded under many policies and budgets, with paired speed passes.

``expertcast eval``, ``sweep``, ``router-eval``, ``quickstart`` and the lm-evaluation-harness adapter are thin
users of this module: each builds a :class:`SessionSettings` from its own flags (no argparse namespace reaches
the library), checks a run before the model loads (:func:`check_run`), then asks a :class:`ModelSession` for
one :class:`~expertcast.inference.runtime.engine.OffloadedModel` per policy and budget. The model is loaded
straight to the host store (:func:`~expertcast.inference.runtime.loading.load_offloaded`: the whole model is
never on the device) and the store is reused by every later run.

% of full speed (:func:`paired_speed_passes`, docs/design.md "Speed baseline"): the offloaded passes interleaved
with passes of the same runtime with every expert resident in its slots (same kernels, threads and batch; baseline,
then offloaded + baseline ``repeats`` times); each offloaded tokens/s is divided by the mean of its two
neighbouring baseline passes (:func:`paired_speed`); a ratio whose passes disagree by more than
:data:`WIDE_SPREAD_PTS` points, or that is above 100% in every pair, is flagged, not reported (:func:`speed_flag`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.inference.cache.expert_cache import Budget
from expertcast.inference.runtime.disk_store import PREFETCH_CHUNK_KB, READERS
from expertcast.utils.errors import UsageError

DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Model dtypes a session loads (``auto``: the checkpoint's)."""
BASELINES = ("auto", "resident", "host", "none")
"""Speed baselines a session measures against (see :func:`choose_baseline`)."""
WIDE_SPREAD_PTS = 10.0
"""A % of full speed whose paired ratios span more than this many points (max - min) is flagged as noise, not
reported as a result (:func:`speed_flag`)."""


@dataclass
class SessionSettings:
    """How a :class:`ModelSession` loads its model and builds every offloaded run (the flags of ``eval``,
    ``sweep`` and the harness adapter's model arguments)."""

    model: str
    """The model as the user named it (a router-adaptation export: its routers run live under a router policy)."""
    model_path: str
    """The resolved model: a preset name or a local folder (:func:`~expertcast.models.names.resolve_model`)."""
    device: str = "cpu"
    """The resolved compute device (:func:`~expertcast.utils.devices.resolve_device`)."""
    dtype: str = "auto"
    """Model dtype, one of :data:`DTYPES`."""
    pool: str = "per-layer"
    """``per-layer`` (one slot pool per MoE layer) or ``shared`` (one pool for all layers)."""
    link_gbps: float | None = None
    """CPU only: emulated host-device bandwidth in GB/s (None = memory speed)."""
    decode_path: str = "eager"
    """MoE decode path: ``eager``, ``graph`` or ``auto`` (:class:`~expertcast.inference.runtime.engine.OffloadedModel`)."""
    seed: int = 0
    """Seed of a random-init preset model."""
    store: str = "ram"
    """``ram`` (the host expert store in RAM, or memory-mapped) or ``disk`` (one file read with direct I/O)."""
    disk_path: str | None = None
    """``store="disk"``: the expert file."""
    readers: int = READERS
    """``store="disk"``: reader threads of the reader pool."""
    prefetch_chunk_kb: int = PREFETCH_CHUNK_KB
    """``store="disk"``: block size in KiB of a prefetch read that yields to demand reads (0: whole reads)."""
    mmap_path: str | None = None
    """Memory-map the host store in this safetensors file (None: in RAM)."""
    expert_dtype: str = "bfloat16"
    """The experts' format in the stores, slots and transfers (:class:`~expertcast.inference.runtime.quant.ExpertFormat`;
    docs/design.md, "Expert formats"); every run of the session, its speed baseline included, reuses that store."""

    def __post_init__(self) -> None:
        from expertcast.inference.runtime.quant import ExpertFormat

        self.expert_dtype = ExpertFormat.parse(self.expert_dtype).name
        check_store(self.store, self.disk_path, mmap=self.mmap_path is not None, link_gbps=self.link_gbps)
        if self.store == "disk" and self.disk_path is None:
            raise UsageError("the disk store needs the path of its expert file")
        if self.dtype not in DTYPES:
            raise UsageError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.pool not in ("per-layer", "shared"):
            raise UsageError(f"pool {self.pool!r}: expected per-layer or shared")
        if self.decode_path not in ("eager", "graph", "auto"):
            raise UsageError(f"decode path {self.decode_path!r}: expected eager, graph or auto")


# -- checks before the model loads ---------------------------------------------------------------------
def check_store(store: str, disk_path: str | None, *, mmap: bool, link_gbps: float | None) -> None:
    """Where the experts live (docs/design.md, "Disk tier"): ``ram`` or ``disk``; the disk store is its own file
    (no memory-mapped store beside it) read from the real disk (no emulated link); a disk path needs it."""
    if store not in ("ram", "disk"):
        raise UsageError(f"--store {store}: expected ram or disk")
    if store == "disk":
        if mmap:
            raise UsageError("--store disk and --mmap-store exclude each other (the disk store is its own file)")
        if link_gbps is not None:
            raise UsageError("--link-gbps emulates a link; --store disk reads the real disk (drop --link-gbps)")
        if disk_path is not None:  # a new file, or an earlier disk store only (docs/design.md, "Provenance")
            from expertcast.utils.outdir import DISK_STORE_KIND, claim_output_file

            claim_output_file(disk_path, "--disk-path", DISK_STORE_KIND)
    elif disk_path is not None:
        raise UsageError("--disk-path needs --store disk")


def build_policy(spec: str) -> tuple[Any, str, dict[str, Any], dict[str, str]]:
    """(policy, name, options, file options) of ``--policy NAME[:k=v,...]``, options typed and validated
    by :func:`~expertcast.inference.policies.parse_policy_options`; the policy's spec says whether it
    can drive a live generation. Every mistake is a UsageError."""
    from expertcast.inference.policies import build_policy as build
    from expertcast.inference.policies import make_policy, parse_policy_options, policy_spec
    from expertcast.inference.runtime.live_routers import is_router_policy, live_router_policy

    if is_router_policy(spec):  # live routers: their scores come from the --model export (attached at offload)
        name, opts = live_router_policy(spec)
        return make_policy(name, **opts), name, opts, {}
    parsed = parse_policy_options(spec)
    name, opts = parsed.policy, parsed.given_values()
    pspec = policy_spec(name)
    if not pspec.live:
        if "future" in pspec.needs:
            raise UsageError(f"--policy {name} is an oracle (it reads the future routing): it cannot drive a live "
                             f"evaluation; use `expertcast simulate` on recorded traces")
        raise UsageError(f"--policy {name} runs only on the simulator's compiled engine, not in the runtime")
    try:
        policy = build(pspec, parsed)
    except UsageError:
        raise
    except (TypeError, AttributeError, ValueError) as e:
        keys = ", ".join(opts) or "none"
        raise UsageError(f"--policy {spec}: cannot build {name} with options ({keys}): {e}") from None
    return policy, name, opts, parsed.files()


def fit_stage_policy(policy: Any, resolved: str, allow_model_mismatch: bool = False) -> dict[str, Any] | None:
    """A policy that decodes the generated tokens (its spec needs a tokenizer) reads the evaluated model's: its
    cue set must come from this model (else a :class:`~expertcast.utils.fitted_on.ModelMismatchError` naming both,
    unless ``allow_model_mismatch``), and without a tokenizer of its own it decodes with the model's. Returns the
    cue set's guard result (None: no cue set)."""
    from expertcast.inference.policies import spec_of
    from expertcast.models.backbone import model_identity

    if "tokenizer" not in spec_of(policy).needs:
        return None
    cue_set = getattr(policy, "cue_set", None)
    guard = None
    if cue_set is not None:
        from expertcast.utils.fitted_on import ModelMismatchError

        try:
            guard = cue_set.check_model(resolved, source=f"cue set of --policy {policy.name}",
                                        what="the evaluated tokens", model=model_identity(resolved, init_seed=None),
                                        allow_mismatch=allow_model_mismatch)
        except ModelMismatchError as e:
            raise ModelMismatchError(f"{e} or pass --allow-model-mismatch (reported in the output)") from None
    if policy.wants_tokenizer():
        from expertcast.inference.policies.artifacts import load_tokenizer

        policy.use_tokenizer(load_tokenizer(resolved))
    return guard


def check_artefacts(checked: CheckedRun, problem_ids: list[str] | None, *, scored: str, allow_overlap: bool = False,
                    allow_model_mismatch: bool = False) -> dict[str, dict[str, Any]]:
    """The overlap / model-identity guard (:func:`~expertcast.utils.fitted_on.check_fitted_on`, docs/design.md
    "Provenance") of a checked run's artefacts: its forecaster against ``problem_ids`` (the scored problems, in
    the benchmark's id form; None: none recorded) and the evaluated model's identity, and its cue set's guard
    (:func:`fit_stage_policy`). ``{label: result}`` for :func:`~expertcast.utils.fitted_on.guard_note` and the JSON."""
    from expertcast.utils.fitted_on import check_fitted_on

    out: dict[str, dict[str, Any]] = {}
    export = checked.files.get("forecaster")
    if export is not None:
        from expertcast.models.backbone import model_identity
        from expertcast.models.forecaster_export import forecaster_fitted_on

        out["forecaster"] = check_fitted_on(
            forecaster_fitted_on(export), problem_ids, model_identity(checked.model_path, init_seed=None),
            scored=scored, allow_overlap=allow_overlap, allow_model_mismatch=allow_model_mismatch)
    if checked.cue_guard is not None:
        out["cue set"] = checked.cue_guard
    return out


def model_shape(resolved: str) -> tuple[int, int, int]:
    """(L, E, K) from the model's config alone (no weights)."""
    spec = model_spec(resolved)
    return spec.num_layers, spec.num_experts, spec.top_k


def model_spec(resolved: str):
    """The model's :class:`~expertcast.models.spec.MoESpec` from its config alone (no weights)."""
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
    return MoESpec.from_config(config)


def check_capacity(budget: Budget, pool: str, shape: tuple[int, int, int], expert_bytes: int = 0):
    """The CacheConfig of ``budget`` on a model of ``shape`` (UsageError naming the flag when it cannot hold);
    a byte budget resolves with ``expert_bytes`` (the experts' format's row)."""
    from expertcast.inference.cache.expert_cache import CacheConfig

    L, E, K = shape
    if not isinstance(budget, Budget):
        raise UsageError(f"give the cache budget as a Budget (fraction, slots or bytes), got {budget!r}")
    try:
        return CacheConfig(num_layers=L, num_experts=E, top_k=K, pool=pool, budget=budget, expert_bytes=expert_bytes)
    except ValueError as e:
        raise UsageError(f"{budget.flag} {budget.value_text}: {e} (model: L={L}, E={E}, K={K}, --pool {pool})") from None


def check_policy_fits(policy: Any, shape: tuple[int, int, int], model: str) -> None:
    """Refuse a policy holding an artefact (forecaster, cue set) made for a model of another shape."""
    from expertcast.inference.runtime.engine import check_policy_compatible

    try:
        check_policy_compatible(policy, *shape, f"model {model}")
    except ValueError as e:
        raise UsageError(f"--policy: {e}") from None


@dataclass
class CheckedRun:
    """What :func:`check_run` found: one policy at one budget on one model, checked before the model loads."""

    policy: Any
    """The built policy (options typed and validated)."""
    policy_name: str
    options: dict[str, Any]
    """The options given in the spec (file options included)."""
    files: dict[str, str]
    """File options (forecaster export, cue set, ...): ``{option: path}``; a router policy: ``{"routers": export}``."""
    model_path: str
    """The resolved model (a router policy: the export's model folder)."""
    shape: tuple[int, int, int]
    """(L, E, K) of the model."""
    cache_config: Any
    """The :class:`~expertcast.inference.cache.expert_cache.CacheConfig` of the budget on this model."""
    cue_guard: dict[str, Any] | None = None
    """A stage policy's cue set against the model's identity (:func:`fit_stage_policy`); None: no cue set."""


def check_run(model: str, policy_spec: str, capacity: Budget, pool: str, expert_bytes: int = 0, *,
              allow_model_mismatch: bool = False) -> CheckedRun:
    """Every cheap check of a run of ``policy_spec`` at ``capacity`` (a
    :class:`~expertcast.inference.cache.expert_cache.Budget`) on ``model`` (as the user named it): the policy and
    its options, the model's config, the capacity against its shape, artefacts made for another model, a stage
    policy's cue set (against the model's identity, unless ``allow_model_mismatch``) and tokenizer. UsageError on
    any. A byte budget resolves with ``expert_bytes`` (the experts' format's row; 0: one expert at the config's
    dtype, what the runtime stores unless told another format)."""
    from expertcast.inference.runtime.live_routers import is_router_policy, router_export_model
    from expertcast.models.names import resolve_model

    policy, name, opts, files = build_policy(policy_spec)
    if is_router_policy(name):  # --model is a router-adaptation export: its model folder, its routers' hash
        resolved, files = router_export_model(model, name)
    else:
        resolved = resolve_model(model, announce=True)
    shape = model_shape(resolved)
    if isinstance(capacity, Budget) and capacity.kind == "bytes" and not expert_bytes:
        expert_bytes = model_spec(resolved).expert_bytes
    cache_config = check_capacity(capacity, pool, shape, expert_bytes)
    check_policy_fits(policy, shape, model)
    cue_guard = fit_stage_policy(policy, resolved, allow_model_mismatch)
    return CheckedRun(policy, name, opts, files, resolved, shape, cache_config, cue_guard)


# -- the session ---------------------------------------------------------------------------------------
@dataclass
class Decoding:
    """One pass of greedy decoding over benchmark prompts: completions and figures."""

    completions: list[list[int]]
    """Generated ids per prompt, up to and including its first EOS."""
    correct: list[bool]
    decoded_tokens: int
    decode_seconds: float
    counters: dict[str, int] = field(default_factory=dict)
    """Offloaded runs: accesses, demand, proactive (decode-only totals)."""

    @property
    def tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else float("nan")


class ModelSession:
    """The evaluated model, loaded once and shared by the offloaded runs of an evaluation or a sweep. It is
    loaded straight to the host store on the first :meth:`offload`; between two offloaded runs the experts go
    back into the model (full load) when they fit the device and a full-load baseline is wanted, and the host
    store is reused."""

    def __init__(self, settings: SessionSettings):
        self.settings = settings
        self.model: Any = None
        self.tok: Any = None
        self.store: Any = None
        self.full = False
        """The model holds its experts (full load) now: a session over a whole model (:meth:`of_model`)."""
        self.load_report: dict[str, Any] | None = None

    @classmethod
    def of_model(cls, settings: SessionSettings, model: Any, tok: Any) -> ModelSession:
        """A session over ``model``, loaded whole (every expert in it: a full load); its first :meth:`offload`
        packs the host store from it, later ones reuse that store."""
        session = cls(settings)
        session.model, session.tok, session.full = model, tok, True
        return session

    def offload(self, policy: Any, capacity: Budget, measure_latency: bool = False):
        """An OffloadedModel of the session's model under ``policy`` at ``capacity`` (the model is loaded on the
        first call; later calls reuse its host store)."""
        from expertcast.inference.runtime.engine import OffloadedModel
        from expertcast.inference.runtime.live_routers import attach_live_routers

        s = self.settings
        if self.model is None:
            from expertcast.inference.runtime.eval_run import pad_left
            from expertcast.inference.runtime.loading import load_offloaded

            om, self.tok, report = load_offloaded(s.model_path, policy, capacity, device=s.device, dtype=s.dtype,
                                                  pool=s.pool, link_gbps=s.link_gbps, mmap_path=s.mmap_path,
                                                  seed=s.seed, decode_path=s.decode_path, store=s.store,
                                                  disk_path=s.disk_path, readers=s.readers,
                                                  prefetch_chunk_kb=s.prefetch_chunk_kb,
                                                  expert_dtype=s.expert_dtype)
            pad_left(self.tok)
            if s.store == "disk" and s.disk_path:  # expertcast's own output from now on (a rerun may replace it)
                from expertcast.utils.outdir import DISK_STORE_KIND, OutputFile

                OutputFile(Path(s.disk_path).expanduser(), DISK_STORE_KIND).written()
            self.model, self.store, self.load_report = om.model, om.store, report.to_dict()
            if measure_latency:
                om.use_measured_latency()
        else:
            om = OffloadedModel(self.model, policy, capacity, pool=s.pool, device=s.device, link_gbps=s.link_gbps,
                                store=self.store, measure_latency=measure_latency, decode_path=s.decode_path,
                                readers=s.readers, prefetch_chunk_kb=s.prefetch_chunk_kb)
            self.store = om.store  # a session over a full-load model (:meth:`of_model`): packed on its first run
        self.full = False
        attach_live_routers(policy, om.model, s.model)  # router policies: the --model export's routers, live
        return om

    def give_back(self, om: Any) -> None:
        """Detach and close ``om`` (its slots go before the next run allocates its own: collected, and the freed
        heap handed back to the OS, :func:`~expertcast.inference.runtime.stats.release_memory`)."""
        from expertcast.inference.runtime.live_routers import detach_live_routers
        from expertcast.inference.runtime.stats import release_memory

        detach_live_routers(om.policy)
        om.close()
        om.pool = om.workspace = None  # the slots go now, whoever still holds the closed run
        self.full = False
        release_memory()

    def restore(self, om: Any) -> None:
        """Detach ``om`` and give the model its experts back (full load), whatever the memory."""
        from expertcast.inference.runtime.live_routers import detach_live_routers

        detach_live_routers(om.policy)
        self.model = om.restore()
        self.full = True

    def decode(self, policy: Any, capacity: Budget, batches: list[list[Any]], *, benchmark: str,
               max_new_tokens: int, eos: list[int]) -> Decoding:
        """Every batch of benchmark problems through one offloaded run under ``policy`` at ``capacity``, each
        graded by the runtime's graded batch (the one ``expertcast eval`` runs), with the run's decode-only
        counters; a session over a full-load model (:meth:`of_model`) holds its experts again afterwards."""
        from expertcast.data.prompts import has_chat_template
        from expertcast.inference.runtime.eval_run import graded_batch

        full = self.full
        om = self.offload(policy, capacity)
        templated = has_chat_template(self.tok)
        comps, correct = [], []
        try:
            for chunk in batches:
                rows, gen, _ = graded_batch(om, self.tok, chunk, benchmark=benchmark, templated=templated,
                                            max_new_tokens=max_new_tokens, eos=eos)
                comps += gen
                correct += [r["correct"] for r in rows]
            st = om.stats
            counters = {"accesses": int(st.accesses.sum()), "demand": int(st.demand.sum()),
                        "proactive": int(st.proactive.sum())}
            return Decoding(comps, correct, int(st.decoded_tokens), float(st.decode_seconds), counters)
        finally:
            if full:
                self.restore(om)
            else:
                self.give_back(om)

    def decode_full_load(self, batches: list[list[Any]], *, benchmark: str, max_new_tokens: int,
                         eos: list[int]) -> Decoding:
        """The plain model (every expert in it: a full load) decodes every batch greedily, graded."""
        from expertcast.data.prompts import has_chat_template
        from expertcast.inference.runtime.eval_run import (
            decode_tokens,
            encode_prompts,
            full_load_generate,
            generated,
            graded_rows,
        )

        if not self.full:
            raise RuntimeError("decode_full_load needs the model to hold its experts (a full load)")
        tok = self.tok
        templated = has_chat_template(tok)
        comps, correct, n, secs = [], [], 0, 0.0
        for chunk in batches:
            enc = encode_prompts(tok, chunk, benchmark, templated)
            seqs, dec_s = full_load_generate(self.model, enc, max_new_tokens=max_new_tokens, eos=eos,
                                             pad_token_id=tok.pad_token_id)
            gen = generated(seqs, enc["input_ids"].shape[1], eos)
            comps += gen
            correct += [r["correct"] for r in graded_rows(tok, chunk, gen, benchmark)]
            n += decode_tokens(gen)
            secs += dec_s
        return Decoding(comps, correct, n, secs)


# -- paired speed passes -------------------------------------------------------------------------------
@dataclass
class SpeedRun:
    """Decode figures of one timed pass over the speed prompts."""

    kind: str
    """``offloaded``, :data:`~expertcast.inference.runtime.eval_run.RESIDENT_BASELINE` or ``HOST_BASELINE``."""
    decoded_tokens: int
    decode_seconds: float
    sequences: list[list[int]]
    """Generated ids per prompt, cut after its first EOS (token identity between the passes)."""

    @property
    def tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def paired_speed(run_offloaded: Any, run_baseline: Any, repeats: int) -> dict[str, Any]:
    """Interleaved passes B, O, B, O, ..., O, B (``repeats`` offloaded passes, each between two baseline
    passes): every offloaded tokens/s is divided by the mean of the baseline passes right before and after
    it (shared machines drift over tens of seconds; a pair sees the same speed). Reports the median of the
    paired ratios in % (``pct_full``) with their min-max, the median tokens/s of both, and whether every
    pass generated the same tokens (``tokens_match``)."""
    base = [run_baseline()]
    offs = []
    for _ in range(repeats):
        offs.append(run_offloaded())
        base.append(run_baseline())
    pct = [100.0 * o.tokens_per_s / (0.5 * (base[i].tokens_per_s + base[i + 1].tokens_per_s))
           for i, o in enumerate(offs)]
    ref = base[0].sequences
    return {
        "baseline": base[0].kind,
        "repeats": repeats,
        "pct_full": float(np.median(pct)),
        "pct_full_min": float(min(pct)),
        "pct_full_max": float(max(pct)),
        "paired_pct": pct,
        "tokens_per_s": float(np.median([o.tokens_per_s for o in offs])),
        "baseline_tokens_per_s": float(np.median([b.tokens_per_s for b in base])),
        "offloaded_passes": [{"decoded_tokens": o.decoded_tokens, "decode_seconds": o.decode_seconds} for o in offs],
        "baseline_passes": [{"decoded_tokens": b.decoded_tokens, "decode_seconds": b.decode_seconds} for b in base],
        "tokens_match": all(r.sequences == ref for r in [*base, *offs]),
        "decoded_tokens": offs[0].decoded_tokens,
        "order": "baseline, then (offloaded, baseline) x repeats; each offloaded pass against the mean of its two "
                 "neighbouring baseline passes; median and min-max of those ratios",
    }


def speed_flag(speed: dict[str, Any]) -> str | None:
    """Why the paired ratio of ``speed`` (:func:`paired_speed`) is no result, or None: its passes disagree by more
    than :data:`WIDE_SPREAD_PTS` points, or every pair is above 100% (the offloaded run cannot beat the same runtime
    with every expert resident: the measurement, not the policy)."""
    lo, hi = speed["pct_full_min"], speed["pct_full_max"]
    if lo > 100.0:
        return f"above 100% in every pair ({lo:.1f}-{hi:.1f}%): a measurement problem, not a result"
    if hi - lo > WIDE_SPREAD_PTS:
        return f"noisy: the paired ratios span {lo:.1f}-{hi:.1f}% (> {WIDE_SPREAD_PTS:.0f} points): not a result"
    return None


def speed_line(speed: dict[str, Any], on: str) -> str:
    """The one line that reports a paired speed measurement ``speed`` made on ``on`` (e.g. "8 problems"): % of full
    speed with its noise, or why it is no result, and the two tokens/s it is made of, each named."""
    head = (f"speed: NOT A RESULT ({speed['flag']}); measured {speed['pct_full']:.1f}%" if speed.get("flag")
            else f"speed: {speed['pct_full']:.1f}% of full speed")
    return (f"{head} against {speed['baseline']} (the same runtime, same kernels, threads and batch; median of "
            f"{speed['repeats']} paired passes, noise: min-max {speed['pct_full_min']:.1f}-{speed['pct_full_max']:.1f}%)"
            f"; offloaded {speed['tokens_per_s']:.1f} tokens/s, {speed['baseline']} {speed['baseline_tokens_per_s']:.1f} "
            f"tokens/s on {on}")


def choose_baseline(choice: str, session: ModelSession, who: str = "eval") -> tuple[str, dict[str, Any]]:
    """:data:`~expertcast.inference.runtime.eval_run.RESIDENT_BASELINE` or ``HOST_BASELINE`` for ``--baseline``
    ``choice`` and the record of the choice (the reason and the memory figures). ``auto`` takes the runtime with
    every expert resident when a slot for every expert fits (:func:`~expertcast.inference.runtime.eval_run.resident_fit`,
    read now: give the evaluated run back first), else the runtime executing every expert on the host, which needs
    no slot; it says which on stderr (prefixed ``who``)."""
    from expertcast.inference.runtime.eval_run import HOST_BASELINE, RESIDENT_BASELINE, resident_fit

    if choice not in BASELINES or choice == "none":
        raise UsageError(f"--baseline {choice}: expected one of {', '.join(b for b in BASELINES if b != 'none')}")
    st = session.store
    check = resident_fit(st.layout.expert_bytes * st.num_layers * st.num_experts, session.settings.device)
    figures = check.to_dict()
    why = figures.pop("reason")
    figures.pop("fits")
    if choice == "host":
        kind, why = HOST_BASELINE, "asked (--baseline host)"
    elif check.fits:
        kind = RESIDENT_BASELINE
    elif choice == "auto":
        kind = HOST_BASELINE
    else:
        raise UsageError(f"--baseline resident: {why}; use --baseline auto or host")
    if choice == "auto":
        print(f"{who}: --baseline auto: {kind} ({why})", file=sys.stderr, flush=True)
    return kind, {"requested": choice, "baseline": kind, "reason": why, **figures}


def paired_speed_passes(session: ModelSession, encs: list[dict[str, Any]], make_policy: Any,
                        capacity: Budget, host_slots: int, baseline: str, repeats: int, *,
                        max_new_tokens: int, eos: list[int]) -> dict[str, Any]:
    """:func:`paired_speed` over the encoded batches ``encs`` (``input_ids``, ``attention_mask``): a fresh
    ``make_policy()`` and an empty cache of ``capacity`` each offloaded pass, against ``baseline``, the same
    runtime on the same batches (:data:`~expertcast.inference.runtime.eval_run.RESIDENT_BASELINE`: every expert in
    its slot, :class:`~expertcast.inference.runtime.eval_run.AllResidentPolicy`; else every routed expert executed
    on the host with ``host_slots`` slots: the model's top-K). The record gets ``flag`` (:func:`speed_flag`)."""
    from expertcast.inference.runtime.eval_run import (
        RESIDENT_BASELINE,
        AllResidentPolicy,
        HostExecutionPolicy,
        generated,
    )

    pad = session.tok.pad_token_id
    gen_kw = {"max_new_tokens": max_new_tokens, "eos_token_id": eos or None, "pad_token_id": pad}

    def offloaded(policy: Any, cap: Budget, kind: str) -> SpeedRun:
        om = session.offload(policy, cap)
        try:
            seqs = []
            for enc in encs:
                res = om.generate(enc["input_ids"], enc["attention_mask"], **gen_kw)
                seqs += generated(res.sequences.cpu(), enc["input_ids"].shape[1], eos)
            run = SpeedRun(kind, int(om.stats.decoded_tokens), float(om.stats.decode_seconds), seqs)
        finally:
            session.give_back(om)
        return run

    def run_baseline() -> SpeedRun:
        if baseline == RESIDENT_BASELINE:
            return offloaded(AllResidentPolicy(), Budget.fraction(1.0), RESIDENT_BASELINE)
        return offloaded(HostExecutionPolicy(), Budget.slots(host_slots), HostExecutionPolicy.name)

    speed = paired_speed(lambda: offloaded(make_policy(), capacity, "offloaded"), run_baseline, repeats)
    speed["flag"] = speed_flag(speed)
    return speed


def mmap_store_path(out: str | Path) -> str:
    """Where ``--mmap-store`` memory-maps the host store: ``OUT/experts.safetensors``."""
    return str(Path(out) / "experts.safetensors")


def default_disk_path(out: str | Path) -> str:
    """The disk store's file when ``--disk-path`` is not given: ``OUT/experts.disk.safetensors``."""
    return str(Path(out) / "experts.disk.safetensors")
