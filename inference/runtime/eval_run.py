"""The library half of ``expertcast eval``: one graded batch, the samples file, the summary and its plot.

A run appends one JSON row per problem to ``samples.jsonl``; the rows of a batch are written by one
``write`` + ``fsync``, and each row carries the id of its batch, the batch's size and the hash of the
run's settings (``settings_hash``). :func:`read_samples` is what makes resuming safe:

* a torn tail (a line without its newline, or the first rows of a batch whose other rows are missing)
  is the trace of an interrupted write: it is dropped with a warning (and cut with ``repair=True``);
* a corrupt line anywhere else, a row of other settings or a problem id seen twice is an error naming
  ``file:line`` (the file mixes runs or was edited: start over with ``--overwrite``).

The command (argument parsing, validation, output folder, resume key) is
:mod:`expertcast.commands.evaluate`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.inference.cache.counters import adj_hit_rate, hit_rate, mb_per_token
from expertcast.inference.cache.policy import MissAction, Policy
from expertcast.utils.errors import ResumeMismatchError, UsageError

SAMPLES = "samples.jsonl"
SETTINGS = "settings.json"


# -- samples file -------------------------------------------------------------------------------------
@dataclass
class SampleFile:
    """What :func:`read_samples` found: the complete rows and the byte length of the valid prefix."""

    rows: list[dict[str, Any]]
    valid_bytes: int
    dropped_rows: int = 0
    """Complete rows of a torn last batch that were dropped with it."""
    torn_tail: bool = False
    """True when the file ends in a torn line or a torn batch."""


def read_samples(path: str | os.PathLike, settings_hash: str | None = None, *, repair: bool = False
                 ) -> list[dict[str, Any]]:
    """Rows of a samples file in file order (see the module docstring for what is dropped or refused).

    ``settings_hash``: refuse rows written under other settings. ``repair``: cut a torn tail from the
    file so that the next append starts on a fresh line.
    """
    path = Path(path)
    found = scan_samples(path, settings_hash)
    if found.torn_tail:
        what = f"a torn last batch ({found.dropped_rows} complete rows dropped with it)" if found.dropped_rows \
            else "a torn last line"
        print(f"warning: {path}: dropping {what}: an interrupted run; those problems run again", file=sys.stderr)
        if repair:
            from expertcast.utils.io import atomic_write_bytes

            atomic_write_bytes(path, path.read_bytes()[: found.valid_bytes])
    return found.rows


def scan_samples(path: Path, settings_hash: str | None = None) -> SampleFile:
    """Parse ``path`` without changing it (see :func:`read_samples`)."""
    if not path.is_file():
        return SampleFile([], 0)
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, else a line cut mid-write
    rows: list[dict[str, Any]] = []
    ends: list[int] = []  # byte offset just after each kept row
    first_line: dict[str, int] = {}
    pos = 0
    for i, raw in enumerate(lines):
        pos += len(raw) + 1
        if not raw.strip():
            continue
        row = _parse_row(path, i + 1, raw, settings_hash)
        if row["id"] in first_line:
            raise UsageError(f"{path}:{i + 1}: problem {row['id']} already has a sample (line {first_line[row['id']]}): "
                             f"the file mixes runs; use --overwrite to start over")
        first_line[row["id"]] = i + 1
        rows.append(row)
        ends.append(pos)
    torn = bool(tail.strip())
    keep = _complete_prefix(rows)
    dropped = len(rows) - keep
    valid = ends[keep - 1] if keep else 0
    return SampleFile(rows[:keep], valid, dropped, torn or dropped > 0)


def _parse_row(path: Path, lineno: int, raw: bytes, settings_hash: str | None) -> dict[str, Any]:
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{path}:{lineno}: not a JSON sample row (the file is corrupt); use --overwrite to start "
                         f"over") from None
    if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get("batch"), int) \
            or not isinstance(row.get("batch_stats"), dict):
        raise UsageError(f"{path}:{lineno}: not a sample row of `expertcast eval` (needs id, batch, batch_stats)")
    if settings_hash is not None and row.get("settings_hash") != settings_hash:
        raise ResumeMismatchError(f"{path}:{lineno}: sample {row['id']} was written with other settings "
                                  f"(settings hash {row.get('settings_hash')!r}); use --overwrite or another --out")
    return row


def _complete_prefix(rows: list[dict[str, Any]]) -> int:
    """Number of leading rows to keep: all but a last batch that has fewer rows than it recorded."""
    if not rows:
        return 0
    last = rows[-1]["batch"]
    start = len(rows)
    while start > 0 and rows[start - 1]["batch"] == last:
        start -= 1
    size = rows[-1].get("batch_rows")
    if isinstance(size, int) and len(rows) - start < size:
        return start
    return len(rows)


def append_samples(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Append whole rows in one write and fsync (a batch is recorded whole, or its torn tail is dropped)."""
    data = "".join(json.dumps(r, default=_jsonable) + "\n" for r in rows)
    with open(path, "a", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)


# -- one batch ----------------------------------------------------------------------------------------
def eos_ids(model: Any, tok: Any) -> list[int]:
    """End-of-sequence ids of the model's generation config and of the tokenizer, sorted."""
    eos: set[int] = set()
    for src in (model.generation_config, tok):
        e = getattr(src, "eos_token_id", None)
        if e is not None:
            eos.update([e] if isinstance(e, int) else list(e))
    return sorted(eos)


def run_batch(om: Any, tok: Any, batch: list[Any], *, benchmark: str, templated: bool, max_new_tokens: int,
              eos: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Greedy generation of ``batch`` (benchmark problems) through the offloaded model ``om``, graded.

    Returns one row per problem (id, correct, answer, gold, completion, new_tokens) and the batch's
    counters (:func:`batch_stats`)."""
    from expertcast.data.grading import extract_answer, grade
    from expertcast.data.prompts import build_prompt

    texts = [build_prompt(tok, p.question, benchmark, use_chat_template=templated) for p in batch]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)
    before = _counters(om)
    t0 = time.perf_counter()
    res = om.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new_tokens,
                      eos_token_id=eos or None, pad_token_id=tok.pad_token_id, seq_ids=[p.id for p in batch])
    stats = batch_stats(om, before, res, time.perf_counter() - t0)
    P = enc["input_ids"].shape[1]
    eos_set = set(eos)
    rows = []
    for i, p in enumerate(batch):
        comp = res.sequences[i, P:].tolist()
        n_new = next((j + 1 for j, t in enumerate(comp) if t in eos_set), len(comp))
        text = tok.decode(comp[:n_new], skip_special_tokens=True)
        rows.append({"id": p.id, "correct": bool(grade(benchmark, text, p.answer)),
                     "answer": extract_answer(benchmark, text), "gold": p.answer, "completion": text,
                     "new_tokens": n_new})
    return rows, stats


def _counters(om: Any) -> dict[str, Any]:
    st = om.stats
    return {"accesses": st.accesses.copy(), "demand": st.demand.copy(), "proactive": st.proactive.copy(),
            "late": st.late.copy(), "cpu": st.cpu.copy(), "decoded_tokens": st.decoded_tokens,
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
        "late_prefetches": int((st.late - before["late"]).sum()), "cpu_exec": int((st.cpu - before["cpu"]).sum()),
        "hit": hit_rate(A, D) if A else None, "adj_hit": adj_hit_rate(A, D, P) if A else None,
        "decoded_tokens": tok, "decode_seconds": dec_s, "tokens_per_s": tok / dec_s if dec_s > 0 else None,
        "ttft_s": res.ttft_seconds, "stall_seconds": st.stall_seconds - before["stall_seconds"],
        "expert_bytes": om.layout.expert_bytes, "wall_seconds": wall,
        "per_layer_accesses": acc.tolist(), "per_layer_demand": dem.tolist(),
    }


# -- summary ------------------------------------------------------------------------------------------
def _batches(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        out.setdefault(int(r["batch"]), r["batch_stats"])
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy over samples; cache and speed metrics over the raw counters of their batches."""
    b = list(_batches(rows).values())
    A = sum(x["accesses"] for x in b)
    D = sum(x["demand_misses"] for x in b)
    P = sum(x["proactive_loads"] for x in b)
    tok = sum(x["decoded_tokens"] for x in b)
    dec_s = sum(x["decode_seconds"] for x in b)
    eb = b[0]["expert_bytes"] if b else 0
    per_acc = np.sum([x["per_layer_accesses"] for x in b], axis=0) if b else np.zeros(0)
    per_dem = np.sum([x["per_layer_demand"] for x in b], axis=0) if b else np.zeros(0)
    n = len(rows)
    correct = sum(bool(r["correct"]) for r in rows)
    return {
        "samples": n,
        "correct": correct,
        "accuracy": correct / n if n else float("nan"),
        "hit": hit_rate(A, D),
        "adj_hit": adj_hit_rate(A, D, P),
        "mb_per_token": mb_per_token(D, P, eb, tok),
        "tokens_per_s": tok / dec_s if dec_s > 0 else float("nan"),
        "ttft_s": float(np.mean([x["ttft_s"] for x in b])) if b else float("nan"),
        "stall_ms_per_token": 1e3 * sum(x["stall_seconds"] for x in b) / max(tok, 1),
        "decoded_tokens": tok,
        "accesses": A,
        "demand_misses": D,
        "proactive_loads": P,
        "late_prefetches": sum(x["late_prefetches"] for x in b),
        "cpu_exec": sum(x["cpu_exec"] for x in b),
        "per_layer_hit": [float(1 - d / a) if a else float("nan") for a, d in zip(per_acc, per_dem, strict=True)],
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


# -- speed against the full-load model (paired) -------------------------------------------------------
FULL_LOAD = "full-load"
HOST_BASELINE = "all-experts-on-host"
"""Baselines of the paired speed measurement: the plain model with every expert on the device, or (when the
model does not fit the device) the runtime executing every routed expert on the host from the host store."""


@dataclass
class SpeedRun:
    """Decode figures of one timed pass over the speed prompts."""

    kind: str
    """``offloaded``, :data:`FULL_LOAD` or :data:`HOST_BASELINE`."""
    decoded_tokens: int
    decode_seconds: float
    sequences: list[list[int]]
    """Generated ids per prompt, cut after its first EOS (token identity between the passes)."""

    @property
    def tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


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


class HostExecutionPolicy(Policy):
    """The :data:`HOST_BASELINE` policy: every routed expert is executed on the host from the host store
    (nothing is ever loaded to the device, the cache stays empty): the speed of a model whose experts do
    not fit the device, without any caching."""

    name = HOST_BASELINE
    demand_only = False
    needs_future = False

    def on_miss(self, t: int, layer: int, expert: int, n_tokens: int, cache: Any) -> MissAction:
        return MissAction.CPU
