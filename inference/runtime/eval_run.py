"""The graded offloaded decode, its metrics and the speed baselines, shared by ``expertcast eval``, ``sweep``,
``router-eval`` and the lm-eval adapter (through :mod:`expertcast.inference.runtime.session`).

:func:`graded_batch` decodes a batch of benchmark problems greedily through an
:class:`~expertcast.inference.runtime.engine.OffloadedModel` and grades every completion; :func:`run_batch`
adds the batch's decode-only counters and its per-step clock (:class:`StepClock`), :func:`decode_metrics` the
metrics of a set of batches (Hit = resident hits / accesses, read MB/token, exposed misses, tokens without a miss,
TTFT and TPOT percentiles). The baselines of % of full speed are the same runtime: :class:`AllResidentPolicy`
(every expert in its slot; :func:`resident_fit` says whether the slots fit) or :class:`HostExecutionPolicy`
(every routed expert executed on the host). :func:`full_load_generate` is the plain model's greedy generation,
timed as the runtime times it (router-eval's full-load run). The recipes that use them (samples file, resume,
summary) are in the commands.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from expertcast.inference.cache.counters import adj_hit_rate, resident_hit_rate
from expertcast.inference.cache.policy import MissAction, Policy
from expertcast.inference.runtime.stats import FORECASTER_FIELDS, forecaster_cost


# -- one batch ----------------------------------------------------------------------------------------
def eos_ids(model: Any, tok: Any) -> list[int]:
    """End-of-sequence ids of the model's generation config and of the tokenizer, sorted."""
    eos: set[int] = set()
    for src in (model.generation_config, tok):
        e = getattr(src, "eos_token_id", None)
        if e is not None:
            eos.update([e] if isinstance(e, int) else list(e))
    return sorted(eos)


def pad_left(tok: Any) -> None:
    """Batched greedy decoding pads prompts on the left; a tokenizer without a pad token pads with EOS."""
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token


def encode_prompts(tok: Any, batch: list[Any], benchmark: str, templated: bool) -> Any:
    """The left-padded encoding of the prompts of ``batch`` (benchmark problems)."""
    from expertcast.data.prompts import build_prompt

    texts = [build_prompt(tok, p.question, benchmark, use_chat_template=templated) for p in batch]
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)


def graded_rows(tok: Any, batch: list[Any], gen: list[list[int]], benchmark: str) -> list[dict[str, Any]]:
    """One row per problem of ``batch`` from its generated ids ``gen`` (cut after the first EOS): id,
    correct, answer, gold, completion, new_tokens."""
    from expertcast.data.grading import extract_answer, grade

    rows = []
    for p, g in zip(batch, gen, strict=True):
        text = tok.decode(g, skip_special_tokens=True)
        rows.append({"id": p.id, "correct": bool(grade(benchmark, text, p.answer)),
                     "answer": extract_answer(benchmark, text), "gold": p.answer, "completion": text,
                     "new_tokens": len(g)})
    return rows


def graded_batch(om: Any, tok: Any, batch: list[Any], *, benchmark: str, templated: bool, max_new_tokens: int,
                 eos: list[int], enc: Any = None) -> tuple[list[dict[str, Any]], list[list[int]], Any]:
    """The graded offloaded decode: greedy generation of ``batch`` (benchmark problems; ``enc`` their
    :func:`encode_prompts`, made here when None) through the offloaded model ``om``, graded. Returns the rows
    (:func:`graded_rows`), the generated ids per problem and the generation result. ``expertcast eval``,
    ``sweep`` and ``router-eval`` all decode through it."""
    if enc is None:
        enc = encode_prompts(tok, batch, benchmark, templated)
    res = om.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new_tokens,
                      eos_token_id=eos or None, pad_token_id=tok.pad_token_id, seq_ids=[p.id for p in batch])
    gen = generated(res.sequences.cpu(), enc["input_ids"].shape[1], eos)
    return graded_rows(tok, batch, gen, benchmark), gen, res


def run_batch(om: Any, tok: Any, batch: list[Any], *, benchmark: str, templated: bool, max_new_tokens: int,
              eos: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`graded_batch` of ``batch`` with the batch's counters and its per-step clock (:func:`batch_stats`)."""
    enc = encode_prompts(tok, batch, benchmark, templated)
    before = counters_now(om)
    t0 = time.perf_counter()
    with StepClock(om) as clock:
        rows, _, res = graded_batch(om, tok, batch, benchmark=benchmark, templated=templated,
                                    max_new_tokens=max_new_tokens, eos=eos, enc=enc)
    return rows, batch_stats(om, before, res, time.perf_counter() - t0, clock)


class StepClock:
    """The wall-clock time and decoded tokens of every decode step of the generations inside it: a forward
    pre-hook on the offloaded model (registered after the runtime's own, so a step's time starts once the
    runtime has begun the step, prefill warm-up done) marks each forward; a decode step lasts from its forward's
    mark to the next one's (the last to the end of the block). Its tokens are what the runtime counted for it
    (the active members). Per-token latency (TPOT) is the step time of each token of the step."""

    def __init__(self, om: Any):
        self.om = om
        self.calls: list[list[tuple[float, int]]] = []
        """Per generate() call: (time, decoded tokens so far) at each forward."""
        self.ends: list[float] = []

    def __enter__(self) -> StepClock:
        self._hook = self.om.model.register_forward_pre_hook(self._mark)
        self._tokens0 = self.om.stats.decoded_tokens
        self.calls.append([])
        return self

    def _mark(self, *_: Any) -> None:
        self.calls[-1].append((time.perf_counter(), int(self.om.stats.decoded_tokens)))

    def __exit__(self, *exc: Any) -> None:
        self.ends.append(time.perf_counter())
        self._hook.remove()

    def steps(self) -> tuple[list[float], list[int]]:
        """(seconds, tokens) of every decode step: the forwards after each call's first (its prefill)."""
        secs: list[float] = []
        toks: list[int] = []
        for marks, end in zip(self.calls, self.ends, strict=True):
            decode = marks[1:]
            prev = marks[0][1] if marks else 0
            for i, (t, n) in enumerate(decode):
                nxt = decode[i + 1][0] if i + 1 < len(decode) else end
                secs.append(nxt - t)
                toks.append(n - prev)
                prev = n
        return secs, toks


def counters_now(om: Any) -> dict[str, Any]:
    """A snapshot of the counters :func:`batch_stats` takes differences of."""
    st = om.stats
    return {"accesses": st.accesses.copy(), "demand": st.demand.copy(), "proactive": st.proactive.copy(),
            "prefetch_used": st.prefetch_used.copy(), "late": st.late.copy(), "cpu": st.cpu.copy(),
            "hits": st.hits.copy(), "decoded_tokens": st.decoded_tokens, "decode_seconds": st.decode_seconds,
            "stall_seconds": st.stall_seconds, "read_bytes": st.read_bytes, "read_exposed": st.read_exposed,
            "steps": len(st.step_demand), "decode_steps": st.decode_steps,
            **{f: getattr(st, f) for f in FORECASTER_FIELDS.values()}}


def batch_stats(om: Any, before: dict[str, Any], res: Any, wall: float, clock: StepClock | None = None
                ) -> dict[str, Any]:
    """Raw decode counters of one batch (differences of ``om.stats`` since ``before``), with the per-step clock
    (``clock``) and what the per-token metrics need: ``resident_hits`` (an access served from its slot: a CPU
    execution is neither a hit nor a miss, a late prefetch not a hit), ``read_bytes`` and ``read_exposed`` (reads
    the compute waited for), ``step_seconds`` / ``step_tokens`` and ``miss_free_tokens`` (tokens of the steps
    with neither a demand miss nor a late prefetch; None where the decode path keeps no per-step tallies)."""
    st = om.stats
    acc = st.accesses - before["accesses"]
    dem = st.demand - before["demand"]
    pro = st.proactive - before["proactive"]
    tok = st.decoded_tokens - before["decoded_tokens"]
    dec_s = st.decode_seconds - before["decode_seconds"]
    A, D, P = int(acc.sum()), int(dem.sum()), int(pro.sum())
    H = int((st.hits - before["hits"]).sum())
    secs, toks = clock.steps() if clock is not None else ([], [])
    step_dem = st.step_demand[before["steps"]:]
    step_late = st.step_late[before["steps"]:]
    miss_free = None
    if toks and len(step_dem) == len(toks):  # the eager path tallies every counted step
        late = step_late if len(step_late) == len(step_dem) else [0] * len(step_dem)
        miss_free = sum(n for n, d, lt in zip(toks, step_dem, late, strict=True) if d == 0 and lt == 0)
    return {
        "accesses": A, "demand_misses": D, "proactive_loads": P, "resident_hits": H,
        "prefetches_used": int((st.prefetch_used - before["prefetch_used"]).sum()),
        "late_prefetches": int((st.late - before["late"]).sum()), "cpu_exec": int((st.cpu - before["cpu"]).sum()),
        "hit": resident_hit_rate(H, A) if A else None, "adj_hit": adj_hit_rate(A, D, P) if A else None,
        "decoded_tokens": tok, "decode_seconds": dec_s, "tokens_per_s": tok / dec_s if dec_s > 0 else None,
        "ttft_s": res.ttft_seconds, "stall_seconds": st.stall_seconds - before["stall_seconds"],
        "read_bytes": int(st.read_bytes - before["read_bytes"]),
        "read_exposed": int(st.read_exposed - before["read_exposed"]),
        "step_seconds": secs, "step_tokens": toks, "miss_free_tokens": miss_free,
        "expert_bytes": om.layout.expert_bytes, "wall_seconds": wall,
        "per_layer_accesses": acc.tolist(), "per_layer_demand": dem.tolist(),
        "per_layer_resident_hits": (st.hits - before["hits"]).tolist(),
        "decode_steps": st.decode_steps - before["decode_steps"],
        **({k: getattr(st, f) - before[f] for k, f in FORECASTER_FIELDS.items()} if st.forecaster else {}),
    }


# -- speed against the runtime with every expert resident (paired) ----------------------------------------
RESIDENT_BASELINE = "all-resident"
HOST_BASELINE = "all-experts-on-host"
"""Baselines of the paired speed measurement (docs/design.md, "Speed baseline"): the runtime itself with every
expert resident in its slots (same kernels, threads and batch as the offloaded run: the cost of offloading and
nothing else), or (when every expert does not fit the device once more) the runtime executing every routed expert
on the host from the host store. The plain transformers model (:func:`full_load_generate`, another kernel path)
is no baseline of % of full speed."""


@dataclass
class ResidentFit:
    """Whether the all-resident baseline (:class:`AllResidentPolicy`: a slot for every expert) fits beside what
    the session holds: on the host (CPU device) its slots need every expert's bytes once more beside the host
    store (host ``MemAvailable``, the evaluated run's slots being freed first); on CUDA the device needs them,
    with a 10% margin for the allocator."""

    fits: bool
    reason: str
    needed_bytes: int
    available_bytes: int | None
    where: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resident_fit(experts_bytes: int, device: str) -> ResidentFit:
    """:class:`ResidentFit` for slots of ``experts_bytes`` (every expert once) on ``device``, memory read now
    (:func:`~expertcast.inference.runtime.memory.device_free_bytes`)."""
    import torch
    from expertcast.inference.runtime import memory

    dev = torch.device(device)
    need = int(experts_bytes * 1.1) if dev.type == "cuda" else int(experts_bytes)
    free = memory.device_free_bytes(dev)
    where = "host memory" if dev.type == "cpu" else str(dev)
    if free is not None and need > free:
        return ResidentFit(False, f"every expert resident needs {need / 1e9:.2f} GB of {where} for its slots, "
                                  f"{free / 1e9:.2f} GB available", need, free, where)
    known = f"{where} unknown" if free is None else f"{need / 1e9:.2f} GB of {free / 1e9:.2f} GB {where}"
    return ResidentFit(True, f"every expert fits a slot ({known})", need, free, where)


def generated(sequences: Any, prompt_len: int, eos: list[int]) -> list[list[int]]:
    """Per row of ``sequences`` [B, P + new]: the generated ids up to and including the first EOS."""
    eos_set = set(eos)
    out = []
    for row in sequences[:, prompt_len:].tolist():
        n = next((j + 1 for j, t in enumerate(row) if t in eos_set), len(row))
        out.append(row[:n])
    return out


def decode_tokens(gen: list[list[int]]) -> int:
    """Tokens processed by decode forwards, as the runtime counts them (``RuntimeStats.decoded_tokens``):
    a sequence that generated ``n`` tokens was fed back ``n - 1`` of them (the first comes from the prefill)."""
    return sum(max(len(g) - 1, 0) for g in gen)


def full_load_generate(model: Any, enc: dict[str, Any], *, max_new_tokens: int, eos: list[int], pad_token_id: int
                       ) -> tuple[Any, float]:
    """Greedy generation of the plain (full-load) model; returns the sequences [B, P + new] and the decode
    seconds, timed as the runtime times them: from the start of the first decode forward (the prompt's
    forward and first token are the TTFT) to the end."""
    import torch

    marks: list[float] = []
    hook = model.register_forward_pre_hook(lambda *_: marks.append(time.perf_counter()))
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            out = model.generate(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or None,
                                 pad_token_id=pad_token_id)
        end = time.perf_counter()
    finally:
        hook.remove()
    seqs = out.sequences if hasattr(out, "sequences") else out
    return seqs.cpu(), (end - marks[1]) if len(marks) > 1 else 0.0


class AllResidentPolicy(Policy):
    """The :data:`RESIDENT_BASELINE` policy: every expert is placed in its slot before anything runs (a warm start
    like prefill's, uncounted), so that no access ever misses; it needs a budget of every expert (capacity 1.0)."""

    name = RESIDENT_BASELINE

    def reset(self, config: Any) -> None:
        L, E = config.num_layers, config.num_experts
        if config.total_slots < L * E:
            raise ValueError(f"the all-resident baseline needs a slot for every expert ({L * E}), got "
                             f"{config.total_slots}")
        super().reset(config)

    def warm_start(self, cache: Any) -> list[tuple[int, int]]:
        return [(layer, e) for layer in range(cache.config.num_layers) for e in range(cache.config.num_experts)]

    def choose_victim(self, t: int, layer: int, candidates: Any, cache: Any) -> int:
        raise RuntimeError("every expert is resident: nothing is ever evicted")


class HostExecutionPolicy(Policy):
    """The :data:`HOST_BASELINE` policy: every routed expert is executed on the host from the host store
    (nothing is ever loaded to the device, the cache stays empty): the speed of a model whose experts do
    not fit the device, without any caching."""

    name = HOST_BASELINE
    demand_only = False

    def on_miss(self, t: int, layer: int, expert: int, n_tokens: int, cache: Any) -> MissAction:
        return MissAction.CPU


# -- the decode metrics of a set of batches -------------------------------------------------------------
def percentiles(values: list[float], weights: list[int] | None = None, qs: tuple[int, ...] = (50, 90, 99)
                ) -> dict[int, float | None]:
    """``{q: the q-th percentile}`` of ``values`` (each counted ``weights[i]`` times; None without values)."""
    import numpy as np

    v = np.repeat(np.asarray(values, np.float64), np.asarray(weights, np.int64)) if weights is not None \
        else np.asarray(values, np.float64)
    return {q: float(np.percentile(v, q)) if v.size else None for q in qs}


def decode_metrics(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The cache, I/O and latency metrics of the raw counters of ``batches`` (:func:`batch_stats` records),
    decode-only: Hit (resident hits / accesses: a CPU-executed expert is neither a hit nor a miss, ``cpu_exec`` its
    own count), AdjHit, MB/token moved, read MB/token (bytes read from the store), exposed misses per token (loads
    the compute waited for), the share of tokens decoded in a step without a miss, TTFT (one per batch) and TPOT
    (the step time of every decoded token) at p50/p90/p99. A batch recorded before a counter existed leaves the
    metric None (its resident hits: accesses - demand - late - CPU, which the driver's counts add up to)."""
    from expertcast.inference.cache.counters import mb_per_token, prefetch_precision

    def total(key: str) -> int | None:
        return sum(x[key] for x in batches) if all(x.get(key) is not None for x in batches) else None

    A, D, P = (sum(x[k] for x in batches) for k in ("accesses", "demand_misses", "proactive_loads"))
    late, cpu = sum(x["late_prefetches"] for x in batches), sum(x["cpu_exec"] for x in batches)
    H = sum(x["resident_hits"] if "resident_hits" in x else
            x["accesses"] - x["demand_misses"] - x["late_prefetches"] - x["cpu_exec"] for x in batches)
    U = total("prefetches_used")
    tok = sum(x["decoded_tokens"] for x in batches)
    dec_s = sum(x["decode_seconds"] for x in batches)
    eb = batches[0]["expert_bytes"] if batches else 0
    read, exposed, free = total("read_bytes"), total("read_exposed"), total("miss_free_tokens")
    secs = [s for x in batches for s in x.get("step_seconds") or []]
    toks = [n for x in batches for n in x.get("step_tokens") or []]
    ttft = percentiles([x["ttft_s"] for x in batches])
    tpot = percentiles([1e3 * s for s in secs], toks)
    return {
        "hit": resident_hit_rate(H, A),
        "adj_hit": adj_hit_rate(A, D, P),
        "mb_per_token": mb_per_token(D, P, eb, tok),
        "read_mb_per_token": read / 1e6 / max(tok, 1) if read is not None else None,
        "exposed_misses_per_token": exposed / max(tok, 1) if exposed is not None else None,
        "miss_free_token_frac": free / tok if free is not None and tok else None,
        "graded_tokens_per_s": tok / dec_s if dec_s > 0 else float("nan"),
        "ttft_s": float(sum(x["ttft_s"] for x in batches) / len(batches)) if batches else float("nan"),
        "ttft_p50_s": ttft[50], "ttft_p90_s": ttft[90], "ttft_p99_s": ttft[99],
        "tpot_p50_ms": tpot[50], "tpot_p90_ms": tpot[90], "tpot_p99_ms": tpot[99],
        "stall_ms_per_token": 1e3 * sum(x["stall_seconds"] for x in batches) / max(tok, 1),
        "decoded_tokens": tok, "accesses": A, "resident_hits": H, "demand_misses": D, "proactive_loads": P,
        "proactive_per_token": P / max(tok, 1), "prefetches_used": U,
        "prefetch_precision": prefetch_precision(U, P) if U is not None else float("nan"),
        "late_prefetches": late, "cpu_exec": cpu,
        **(forecaster_cost({k: sum(x[k] for x in batches) for k in FORECASTER_FIELDS},
                           sum(x["decode_steps"] for x in batches), dec_s)
           if batches and all("forecast_calls" in x for x in batches) else {}),
    }
