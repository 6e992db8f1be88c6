"""The graded offloaded decode and the full-load baseline, shared by ``expertcast eval``, ``sweep`` and
``router-eval``.

:func:`graded_batch` decodes a batch of benchmark problems greedily through an
:class:`~expertcast.inference.runtime.engine.OffloadedModel` and grades every completion; :func:`run_batch`
adds the batch's decode-only counters. :func:`full_load_generate` is the plain model's greedy generation,
timed as the runtime times it; :func:`full_load_fit` says whether that full load fits beside the host store;
:class:`HostExecutionPolicy` executes every routed expert on the host.
The recipes that use them (samples file, resume, summary, paired speed) are in :mod:`expertcast.commands`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from expertcast.inference.cache.counters import adj_hit_rate, hit_rate
from expertcast.inference.cache.policy import MissAction, Policy


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
    """:func:`graded_batch` of ``batch`` with the batch's counters (:func:`batch_stats`)."""
    enc = encode_prompts(tok, batch, benchmark, templated)
    before = _counters(om)
    t0 = time.perf_counter()
    rows, _, res = graded_batch(om, tok, batch, benchmark=benchmark, templated=templated,
                                max_new_tokens=max_new_tokens, eos=eos, enc=enc)
    return rows, batch_stats(om, before, res, time.perf_counter() - t0)


def _counters(om: Any) -> dict[str, Any]:
    st = om.stats
    return {"accesses": st.accesses.copy(), "demand": st.demand.copy(), "proactive": st.proactive.copy(),
            "prefetch_used": st.prefetch_used.copy(), "late": st.late.copy(), "cpu": st.cpu.copy(), "decoded_tokens": st.decoded_tokens,
            "decode_seconds": st.decode_seconds, "stall_seconds": st.stall_seconds}


def batch_stats(om: Any, before: dict[str, Any], res: Any, wall: float) -> dict[str, Any]:
    """Raw decode counters of one batch (differences of ``om.stats`` since ``before``)."""
    st = om.stats
    acc = st.accesses - before["accesses"]
    dem = st.demand - before["demand"]
    pro = st.proactive - before["proactive"]
    tok = st.decoded_tokens - before["decoded_tokens"]
    dec_s = st.decode_seconds - before["decode_seconds"]
    A, D, P = int(acc.sum()), int(dem.sum()), int(pro.sum())
    return {
        "accesses": A, "demand_misses": D, "proactive_loads": P,
        "prefetches_used": int((st.prefetch_used - before["prefetch_used"]).sum()),
        "late_prefetches": int((st.late - before["late"]).sum()), "cpu_exec": int((st.cpu - before["cpu"]).sum()),
        "hit": hit_rate(A, D) if A else None, "adj_hit": adj_hit_rate(A, D, P) if A else None,
        "decoded_tokens": tok, "decode_seconds": dec_s, "tokens_per_s": tok / dec_s if dec_s > 0 else None,
        "ttft_s": res.ttft_seconds, "stall_seconds": st.stall_seconds - before["stall_seconds"],
        "expert_bytes": om.layout.expert_bytes, "wall_seconds": wall,
        "per_layer_accesses": acc.tolist(), "per_layer_demand": dem.tolist(),
    }


# -- speed against the full-load model (paired) -------------------------------------------------------
FULL_LOAD = "full-load"
HOST_BASELINE = "all-experts-on-host"
"""Baselines of the paired speed measurement: the plain model with every expert on the device, or (when the
model does not fit the device) the runtime executing every routed expert on the host from the host store."""


@dataclass
class FullLoadFit:
    """Whether the full-load baseline fits beside the host store. Giving the model its experts back
    (:meth:`~expertcast.inference.runtime.engine.OffloadedModel.restore`) copies every expert out of the store on
    the host before it moves to the device, so the host needs every expert's bytes once more beside the store
    (its ``MemAvailable``); on CUDA the device needs them too (with a 10% margin for the allocator, the slot pool
    being freed first)."""

    fits: bool
    reason: str
    host_needed_bytes: int
    host_available_bytes: int | None
    device_needed_bytes: int | None = None
    device_free_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def full_load_fit(store_bytes: int, device: str, pool_bytes: int = 0) -> FullLoadFit:
    """:class:`FullLoadFit` for a store of ``store_bytes`` (every expert once) and a runtime on ``device`` whose
    slot pool holds ``pool_bytes``; host memory read now (:func:`~expertcast.inference.runtime.loading.host_available_bytes`)."""
    from expertcast.inference.runtime import loading

    need = int(store_bytes)
    host = loading.host_available_bytes()
    fig = {"host_needed_bytes": need, "host_available_bytes": host}
    if host is not None and need > host:
        return FullLoadFit(False, f"a full load copies every expert once more beside the host store: needs "
                                  f"{need / 1e9:.2f} GB of host memory, {host / 1e9:.2f} GB available", **fig)
    if str(device).startswith("cuda"):
        import torch

        free = int(torch.cuda.mem_get_info(torch.device(device))[0]) + int(pool_bytes)
        dev_need = int(need * 1.1)
        fig.update(device_needed_bytes=dev_need, device_free_bytes=free)
        if dev_need > free:
            return FullLoadFit(False, f"the experts ({need / 1e9:.2f} GB + 10%) do not fit the free memory of {device} "
                                      f"({free / 1e9:.2f} GB once the slots are freed)", **fig)
    known = "host memory unknown" if host is None else f"{need / 1e9:.2f} GB more of {host / 1e9:.2f} GB host memory"
    return FullLoadFit(True, f"the experts fit a full load ({known})", **fig)


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


class HostExecutionPolicy(Policy):
    """The :data:`HOST_BASELINE` policy: every routed expert is executed on the host from the host store
    (nothing is ever loaded to the device, the cache stays empty): the speed of a model whose experts do
    not fit the device, without any caching."""

    name = HOST_BASELINE
    demand_only = False

    def on_miss(self, t: int, layer: int, expert: int, n_tokens: int, cache: Any) -> MissAction:
        return MissAction.CPU
