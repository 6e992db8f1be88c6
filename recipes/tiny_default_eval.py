"""Held-out measurements of the embedded default model's build (:mod:`expertcast.recipes.tiny_default`): greedy
``arith`` accuracy, the experts each position routes to, per-layer load balance and step-to-step overlap, and the
divergence of expert usage between GSM8K and chain-of-thought text (the build's ``report.json``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


@torch.no_grad()
def heldout_arith_accuracy(model, tokenizer, n: int, max_new_tokens: int = 64, batch_size: int = 25) -> dict[str, Any]:
    """Greedy accuracy on the first ``n`` held-out ``arith`` test problems, prompted and graded as
    ``expertcast eval --benchmark arith`` does (chat template, exact match of the number after ``####``)."""
    from expertcast.data.benchmarks import load_benchmark
    from expertcast.data.grading import grade
    from expertcast.data.prompts import build_prompt

    model.eval()
    problems = load_benchmark("arith", "test", limit=n)
    correct = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        enc = tokenizer([build_prompt(tokenizer, p.question, "arith") for p in chunk], return_tensors="pt",
                        padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(grade("arith", t, p.answer) for t, p in zip(texts, chunk, strict=True))
    return {"accuracy": correct / len(problems), "correct": correct, "problems": len(problems),
            "first_id": problems[0].id, "last_id": problems[-1].id}


@torch.no_grad()
def routing_of(model, ids: list[int]) -> np.ndarray:
    """Top-K expert ids of every position and MoE layer of one sequence: int16 [T, L, K] (the
    router's own selection: softmax over the router logits, then top-K)."""
    model.eval()
    out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    sel = [torch.topk(torch.softmax(r.float(), dim=-1), k, dim=-1).indices for r in out.router_logits]
    return torch.stack(sel, dim=1).to(torch.int16).numpy()  # [T, L, K]


def routing_stats(routings: list[np.ndarray], num_experts: int) -> list[dict[str, float]]:
    """Per MoE layer: normalized entropy of expert usage (1 = perfectly balanced), max-expert share
    (fraction of all selections that went to the busiest expert; 1/E when balanced) and the mean
    step-to-step overlap |S_t ∩ S_(t+1)| / K of consecutive positions' selected sets (K/E for
    independent uniform choices).

    ``routings``: int arrays [T, L, K], one per sequence.
    """
    L, K = routings[0].shape[1], routings[0].shape[2]
    rows = []
    for layer in range(L):
        counts = np.zeros(num_experts, dtype=np.int64)
        inter, pairs = 0, 0
        for r in routings:
            sel = r[:, layer, :].astype(np.int64)
            counts += np.bincount(sel.ravel(), minlength=num_experts)
            if len(sel) > 1:
                onehot = np.zeros((len(sel), num_experts), dtype=bool)
                np.put_along_axis(onehot, sel, True, axis=1)
                inter += int((onehot[1:] & onehot[:-1]).sum())
                pairs += len(sel) - 1
        p = counts / counts.sum()
        nz = p[p > 0]
        rows.append({
            "layer": layer,
            "entropy_norm": float(-(nz * np.log(nz)).sum() / math.log(num_experts)),
            "max_share": float(p.max()),
            "overlap": inter / (pairs * K) if pairs else float("nan"),
        })
    return rows


def routing_report(model, seqs: dict[str, list[list[int]]], num_experts: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    usage = {}
    for name, group in seqs.items():
        rts = [routing_of(model, s) for s in group]
        per_layer = routing_stats(rts, num_experts)
        res[name] = {
            "per_layer": per_layer,
            "mean_entropy_norm": float(np.mean([r["entropy_norm"] for r in per_layer])),
            "mean_max_share": float(np.mean([r["max_share"] for r in per_layer])),
            "mean_overlap": float(np.mean([r["overlap"] for r in per_layer])),
        }
        L = rts[0].shape[1]
        usage[name] = np.stack([
            np.bincount(np.concatenate([r[:, layer].ravel() for r in rts]).astype(np.int64), minlength=num_experts)
            for layer in range(L)])
    if len(usage) == 2:
        # Specialisation across domains: Jensen-Shannon divergence (bits) between the per-layer expert
        # usage on GSM8K solutions and on chain-of-thought text.
        a, b = (u / u.sum(axis=1, keepdims=True) for u in usage.values())
        m = (a + b) / 2

        def kl(x, y):
            with np.errstate(divide="ignore", invalid="ignore"):
                return np.where(x > 0, x * np.log2(x / y), 0.0).sum(axis=1)

        res["domain_js_bits"] = [float(v) for v in (kl(a, m) + kl(b, m)) / 2]
    return res
