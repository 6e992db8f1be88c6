"""Accuracy of the expert formats (docs/results.md, "Quantized experts").

On the default model (``tiny-default``, run in bfloat16), per expert format: greedy accuracy on the held-out
``arith`` test problems, perplexity of GSM8K test solutions (teacher-forced, as the model's report measures
it), and the share of greedy tokens identical to bfloat16's over the first 64 decoded tokens of GSM8K test
problems (position by position, EOS ignored, free-running: after a first difference the texts differ; also
the mean length of the identical prefix, and the teacher-forced agreement: the share of bfloat16's decoded tokens
the format picks greedily when fed bfloat16's own prefix). ``float32`` is the model's own dtype (unquantized):
how far bfloat16 itself is from it is the noise floor of these comparisons. The quantized
model is the full-load one (every expert resident in its format, the runtime's kernels): an offloaded run
of it decodes the same tokens (tests/inference/runtime/test_loading.py). At the DeepSeek-V2-Lite expert
shape (hidden 2048, moe_intermediate 1408), the relative error of one expert layer's output per format
(random weights with the std of a trained layer, K=6 experts mixed with softmax weights, 64 tokens).

    python scripts/quant_accuracy.py --out outputs/quant_accuracy [--arith 200] [--gsm8k 100] [--identity 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def expert_layer_error(formats: list[str], tokens: int = 64, H: int = 2048, I: int = 1408, K: int = 6,  # noqa: E741
                       seed: int = 0) -> dict[str, float]:
    """Relative error of one MoE layer's routed output (K experts, softmax-weighted) per format, against the
    bfloat16 experts, at hidden ``H`` / intermediate ``I`` (the DeepSeek-V2-Lite shape)."""
    from expertcast.inference.runtime.quant import ExpertFormat, QWeight, relative_error

    g = torch.Generator().manual_seed(seed)
    std = 0.02
    experts = [((torch.randn(2 * I, H, generator=g) * std).to(torch.bfloat16),
                (torch.randn(H, I, generator=g) * std).to(torch.bfloat16)) for _ in range(K)]
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    mix = torch.softmax(torch.randn(tokens, K, generator=g), -1)

    def layer(proj) -> torch.Tensor:
        out = torch.zeros(tokens, H)
        for k, (gu, dn) in enumerate(experts):
            h = proj(x, gu)
            a = torch.nn.functional.silu(h[:, :I].float()) * h[:, I:].float()
            out += mix[:, k:k + 1] * proj(a.to(torch.bfloat16), dn).float()
        return out

    ref = layer(lambda a, w: a @ w.t())
    res = {}
    for f in formats:
        fmt = ExpertFormat.parse(f)
        if not fmt.quantized:
            continue
        res[fmt.name] = relative_error(ref, layer(lambda a, w, fmt=fmt: QWeight.from_float(w, fmt).mm(a)))
    return res


@torch.no_grad()
def greedy_tokens(model, tok, questions: list[str], new: int, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per batch of prompts (left padded): (prompt + ``new`` greedy tokens [B, P+new], attention mask, P)."""
    from expertcast.data.prompts import build_prompt

    out = []
    for i in range(0, len(questions), batch):
        enc = tok([build_prompt(tok, q, "gsm8k") for q in questions[i:i + batch]], return_tensors="pt",
                  padding=True, add_special_tokens=False)
        gen = model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=None)
        P = enc["input_ids"].shape[1]
        am = torch.cat([enc["attention_mask"], torch.ones(gen.shape[0], gen.shape[1] - P, dtype=torch.long)], 1)
        out.append((gen, am, P))
    return out


def decoded(batches) -> list[list[int]]:
    return [row for gen, _, P in batches for row in gen[:, P:].tolist()]


@torch.no_grad()
def teacher_forced_agreement(model, ref_batches) -> float:
    """Share of the reference's decoded tokens that ``model`` picks greedily when fed the reference's own prefix
    (each decision compared once, no cascade after a first difference)."""
    same = total = 0
    for gen, am, P in ref_batches:
        logits = model(input_ids=gen, attention_mask=am).logits
        pick = logits[:, P - 1:-1].argmax(-1)
        same += int((pick == gen[:, P:]).sum())
        total += pick.numel()
    return same / max(total, 1)


def identity(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    same = total = prefix = 0
    for a, b in zip(ref, got, strict=True):
        n = min(len(a), len(b))
        same += sum(x == y for x, y in zip(a[:n], b[:n], strict=True))
        total += n
        p = 0
        while p < n and a[p] == b[p]:
            p += 1
        prefix += p
    return {"identical_share": same / max(total, 1), "mean_identical_prefix": prefix / max(len(ref), 1),
            "tokens": total}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-default")
    ap.add_argument("--formats", default="bfloat16,int8,int4,int4-g32,int4-g128,float32",
                    help="expert formats (bfloat16 first: the reference); float32 = the model's own dtype, unquantized")
    ap.add_argument("--arith", type=int, default=200, help="held-out arith test problems")
    ap.add_argument("--gsm8k", type=int, default=100, help="GSM8K test solutions for the perplexity (first N)")
    ap.add_argument("--identity", type=int, default=32, help="GSM8K test problems for the greedy identity")
    ap.add_argument("--new", type=int, default=64, help="decoded tokens compared")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", default="auto", choices=("auto", "kernel", "dequant"))
    ap.add_argument("--out", default="outputs/quant_accuracy")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from expertcast.inference.runtime import quant
    from expertcast.inference.runtime.experts import quantize_model_experts
    from expertcast.models.backbone import load_moe_model
    from expertcast.models.tiny_default import TinyDefaultConfig, heldout_arith_accuracy, heldout_perplexity
    from expertcast.utils.io import read_jsonl
    from expertcast.utils.paths import data_dir

    quant.set_kernel_mode(args.kernels)
    cfg = TinyDefaultConfig()
    gsm = read_jsonl(Path(data_dir()) / "gsm8k" / "test.jsonl", limit=max(args.gsm8k, args.identity))
    questions = [r["question"] for r in gsm[:args.identity]]
    rows, ref_tokens, ref_batches = [], None, None
    for f in [s.strip() for s in args.formats.split(",") if s.strip()]:
        native = f == "float32"  # the model's own dtype: the noise floor of bf16 itself
        fmt = quant.ExpertFormat.parse("bfloat16" if native else f)
        t0 = time.perf_counter()
        model, tok = load_moe_model(args.model, dtype="float32" if native else "bfloat16")
        if fmt.quantized:
            quantize_model_experts(model, fmt.name)
        arith = heldout_arith_accuracy(model, tok, args.arith) if args.arith else None
        ppl = heldout_perplexity(model, tok, gsm[:args.gsm8k], cfg) if args.gsm8k else None
        batches = greedy_tokens(model, tok, questions, args.new) if args.identity else None
        toks = decoded(batches) if batches else None
        if f == "bfloat16":
            ref_tokens, ref_batches = toks, batches
        row = {"format": "float32 (model dtype)" if native else fmt.name, "arith_accuracy": arith["accuracy"] if arith else None,
               "arith_problems": args.arith, "gsm8k_ppl": ppl["perplexity"] if ppl else None,
               "gsm8k_solutions": args.gsm8k, "seconds": time.perf_counter() - t0}
        if toks is not None and ref_tokens is not None:
            row.update(identity(ref_tokens, toks))
            row["teacher_forced_agreement"] = teacher_forced_agreement(model, ref_batches)
        rows.append(row)
        print(json.dumps(row), flush=True)
    err = expert_layer_error([r["format"] for r in rows if not r["format"].startswith("float32")])
    print(json.dumps({"deepseek_v2_lite_layer_relative_error": err}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = next((r for r in rows if r["format"] == "bfloat16"), None)
    lines = ["| format | arith acc. | Δ vs bf16 (points) | GSM8K ppl | identical greedy tokens (free-running) | "
             "identical prefix (of 64) | teacher-forced agreement | V2-Lite layer rel. error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = (100 * (r["arith_accuracy"] - base["arith_accuracy"])) if base and r["arith_accuracy"] is not None else None
        rel = f"{err[r['format']]:.4f} |" if r["format"] in err else "(reference) |"
        lines.append(f"| {r['format']} | {100 * r['arith_accuracy']:.1f}% | {'' if d is None else f'{d:+.1f}'} | "
                     f"{r['gsm8k_ppl']:.3f} | {100 * r.get('identical_share', float('nan')):.1f}% | "
                     f"{r.get('mean_identical_prefix', float('nan')):.1f} | "
                     f"{100 * r.get('teacher_forced_agreement', float('nan')):.1f}% | "
                     + rel)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "accuracy.json").write_text(json.dumps({
        "model": args.model, "dtype": "bfloat16", "rows": rows, "deepseek_v2_lite_layer_relative_error": err,
        "kernels": quant.TABLE.to_list(), "kernel_mode": args.kernels, "argv": sys.argv[1:]}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
