"""Forecaster costs: step latency at batch 1 on CPU, its share of a Qwen3-30B-A3B decode step, and the training
speed and peak memory of the tiny config.

Measured in the same run (ratios against baselines of this machine and process):

* ``step``: one forecaster step (one element in, next-element logits out) at batch 1, for the tiny config
  (the embedded default model's shape) and the Qwen3-30B-A3B config; ``step+rollout``: the step plus the
  rollout steps the seqmoe policy runs per decode step for a c-step forecast: c-1 for the paper's recursive
  rollout (``heads=1``), none when the direct heads cover the horizon (``heads=c``). Baseline: one decode step (batch 1, KV cache)
  of the embedded default model on the same CPU, when it is available (``--model``), so ``x decode`` says
  how many of the served model's decode steps one forecaster step costs here.
* FLOPs: the forecaster's multiply-adds per step+rollout against a Qwen3-30B-A3B decode step at
  ``--context`` tokens (from the model's preset config: attention projections, the 8 active experts, the
  router, the LM head and attention over the context), as a fraction.
* Training: windows (sequences of ``window`` elements) per second and peak memory (process RSS on CPU,
  ``max_memory_allocated`` on CUDA) of the tiny config, on ``--traces`` or on synthetic traces of the
  default model's shape (L=4, E=32, K=4).

    python scripts/bench_forecaster.py [--traces DIR] [--model tiny-default] [--steps 200] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig, predictions_to_input
from expertcast.utils.io import report

REPO = Path(__file__).resolve().parents[1]


def qwen3_decode_flops(context: int) -> tuple[float, dict]:
    """Multiply-add FLOPs (2 per MAC) of one Qwen3-30B-A3B decode token at ``context`` cached tokens."""
    from expertcast.models.presets import get_preset

    c = get_preset("qwen3-30b-a3b").config
    H, L, hd = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    attn_proj = H * nq * hd + 2 * H * nkv * hd + nq * hd * H
    attn_ctx = 2 * nq * hd * context  # scores + weighted sum
    experts = c["num_experts_per_tok"] * 3 * H * c["moe_intermediate_size"]
    router = H * c["num_experts"]
    per_layer = attn_proj + attn_ctx + experts + router
    macs = L * per_layer + H * c["vocab_size"]
    return 2.0 * macs, {"layers": L, "experts": c["num_experts"], "top_k": c["num_experts_per_tok"]}


def model_cfg(path: Path, **shape) -> ForecasterConfig:
    import yaml

    init = yaml.safe_load(path.read_text())["model"]["init_args"]
    keys = ("backbone", "hidden_size", "num_blocks", "state_size", "head_dim", "expand", "conv_kernel", "n_groups",
            "chunk_size", "direct_horizons")
    kw = {k: init[k] for k in keys if k in init}
    kw.update(shape)
    return ForecasterConfig(**kw)


@torch.no_grad()
def time_step(m: ExpertForecaster, horizon: int, reps: int, device: str) -> tuple[float, float]:
    """(ms per step, ms per step + the rollout steps of a ``horizon``-element forecast) at batch 1."""
    c = m.config
    st = m.init_state(1, device)
    x = torch.zeros(1, c.num_layers, c.num_experts, device=device)
    x[..., : c.top_k] = 1.0 / c.top_k
    for _ in range(5):
        lg, _ = m.step(x, st)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        lg, _ = m.step(x, st)
    sync()
    step_ms = (time.perf_counter() - t0) / reps * 1e3
    t0 = time.perf_counter()
    for _ in range(max(1, reps // horizon)):
        lg, _ = m.step(predictions_to_input(lg, c.top_k), st, all_horizons=True)
        m.rollout(lg, st, horizon)
        lg = lg[:, 0]
    sync()
    roll_ms = (time.perf_counter() - t0) / max(1, reps // horizon) * 1e3
    return step_ms, roll_ms


@torch.no_grad()
def time_default_decode(name: str, reps: int) -> float | None:
    """ms per decode step (batch 1, KV cache, 64 tokens of context) of the served model on CPU, or None."""
    try:
        from expertcast.recipes.collect import load_model

        model, _ = load_model(name, device="cpu")
    except Exception as exc:  # the model is optional for this benchmark
        print(f"(no decode baseline: {name!r} not available: {exc})")
        return None
    ids = torch.randint(4, 200, (1, 64))
    out = model(ids, use_cache=True)
    past = out.past_key_values
    tok = out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = model(tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / reps * 1e3


def peak_rss_mb() -> float:
    """Peak resident set of this process so far, MiB (VmHWM: not inherited across exec, unlike ru_maxrss)."""
    from expertcast.inference.runtime.loading import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def bench_training(args, cfg_path: Path) -> dict:
    import warnings

    import lightning as pl
    from expertcast.data.synthetic import ModeMarkovProcess
    from expertcast.train.forecaster_data import ForecasterDataModule
    from expertcast.train.forecaster_module import ForecasterModule

    warnings.filterwarnings("ignore")
    import yaml

    y = yaml.safe_load(cfg_path.read_text())
    init = dict(y["model"]["init_args"])
    init.pop("export_dir", None)
    dinit = dict(y["data"]["init_args"])
    window, batch = int(dinit.get("window", 128)), int(dinit.get("batch_size", 16))
    if args.traces:
        dm = ForecasterDataModule(traces=args.traces, window=window, batch_size=batch, val_fraction=0.2)
        source = args.traces
    else:
        proc = ModeMarkovProcess.random(num_modes=32, num_layers=4, num_experts=32, top_k=4, seed=0)
        seqs, _ = proc.sample(256, window * 3, prompt_len=16, seed=1)
        dm = ForecasterDataModule.from_sequences(proc.meta(), seqs, window=window, batch_size=batch, val_fraction=0.2)
        source = "synthetic L=4 E=32 K=4"
    module = ForecasterModule(**init)
    rss0 = peak_rss_mb()
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    class Timer(pl.Callback):
        def __init__(self):
            self.t = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.t.append((time.perf_counter(), int(batch["inputs"].shape[0])))

    timer = Timer()
    trainer = pl.Trainer(max_steps=args.train_steps, accelerator="gpu" if cuda else "cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=1.0,
                         precision="bf16-mixed" if cuda else "32-true", callbacks=[timer])
    trainer.fit(module, dm)
    skip = min(5, len(timer.t) // 4)  # warm-up steps excluded
    (t0, _), (t1, _) = timer.t[skip], timer.t[-1]
    windows = sum(n for _, n in timer.t[skip + 1:])
    rate = windows / (t1 - t0)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
    return {"source": source, "window": window, "batch_size": batch, "steps": len(timer.t),
            "windows_per_s": rate, "elements_per_s": rate * window,
            "peak_memory_mb": peak, "peak_before_training_mb": rss0 if not cuda else 0.0,
            "parameters": module.net.num_parameters(), "memory_kind": "cuda allocated" if cuda else "process RSS"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: comparable across machines)")
    ap.add_argument("--reps", type=int, default=200, help="timed steps")
    ap.add_argument("--horizon", type=int, default=8, help="rollout length c of the seqmoe policy")
    ap.add_argument("--context", type=int, default=1024, help="context tokens of the Qwen3 decode step (FLOPs)")
    ap.add_argument("--model", default="tiny-default", help="served model for the measured decode baseline ('' skips)")
    ap.add_argument("--traces", default=None, help="trace directory for the training benchmark (default synthetic)")
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--out", default="runs/bench/forecaster")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    qflops, qshape = qwen3_decode_flops(args.context)
    decode_ms = time_default_decode(args.model, args.reps // 2) if args.model else None
    rows = []
    shapes = {"tiny": (REPO / "configs/forecaster/tiny.yaml", dict(num_layers=4, num_experts=32, top_k=4)),
              "qwen3-30b-a3b": (REPO / "configs/forecaster/qwen3-30b-a3b.yaml",
                                dict(num_layers=qshape["layers"], num_experts=qshape["experts"], top_k=qshape["top_k"]))}
    for (name, (path, shape)), heads in [(kv, h) for kv in shapes.items() for h in (1, args.horizon)]:
        m = ExpertForecaster(model_cfg(path, **shape, direct_horizons=heads)).to(args.device).eval()
        step_ms, roll_ms = time_step(m, args.horizon, args.reps, args.device)
        fl = m.step_flops()
        fl_all = fl * (1 + max(0, args.horizon - heads))
        row = {"config": name, "heads": heads, "params": m.num_parameters(), "step_ms": step_ms,
               "step+rollout_ms": roll_ms, "step_MFLOP": fl / 1e6, "step+rollout_MFLOP": fl_all / 1e6,
               "qwen3_decode_GFLOP": qflops / 1e9, "fraction_of_qwen3_step": fl_all / qflops}
        if decode_ms:
            row["default_decode_ms"] = decode_ms
            row["step_x_decode"] = step_ms / decode_ms
        rows.append(row)
    report(rows, title=f"forecaster step at batch 1 ({args.device}, {args.threads} thread(s)); rollout c={args.horizon}; "
                       f"Qwen3-30B-A3B decode at {args.context} tokens of context",
           json_path=out / "step.json", csv_path=out / "step.csv")
    train = bench_training(args, REPO / "configs/forecaster/tiny.yaml")
    report([train], title="training speed of configs/forecaster/tiny.yaml", json_path=out / "train.json",
           csv_path=out / "train.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
