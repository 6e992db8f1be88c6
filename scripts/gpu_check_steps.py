"""Python steps of ``scripts/gpu_check.sh``; each prints one line ``PASS|FAIL|SKIP name figure`` and exits 1 on
FAIL.

``forecaster``: one training epoch of the Qwen3-30B-A3B forecaster (configs/forecaster/qwen3-30b-a3b.yaml's
model, L=48, E=128, K=8) on synthetic mode-Markov traces, Lightning on one GPU in bf16-mixed, first with
mamba-ssm's kernels (asserted: every dispatched Mamba call took the kernel,
:mod:`expertcast.models.mamba_kernels`), then the same epoch on the PyTorch reference (models/mamba_ssd.py); the
figure is the median step time of each and their ratio. ``--dry-run``: the same code on the CPU at a tiny
size, PyTorch path only.

``router OUT DATA_DIR``: ``expertcast fit`` of configs/router/qwen3-30b-a3b.yaml as shipped (its FSDP2 strategy
block, bf16-true, LoRA) on one GPU with the qwen3_moe-tiny preset, 2 steps on local GSM8K: every decoder layer
sharded, the run finished and its export written; the figure names the units and the seconds. ``--dry-run``: the
same on the CPU.

``memory OUT``: the peak device memory of the runtime benchmark (``OUT/memory.json`` of
scripts/bench_runtime.py) against its memory report (slots + non-expert weights + workspace).

    python scripts/gpu_check_steps.py forecaster [--dry-run]
    python scripts/gpu_check_steps.py memory runs/bench_runtime
    python scripts/gpu_check_steps.py router runs/gpu_check ../shared/data [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs/forecaster/qwen3-30b-a3b.yaml"
ROUTER_CONFIG = REPO / "configs/router/qwen3-30b-a3b.yaml"


def line(ok: bool | None, name: str, figure: str) -> int:
    print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'} {name} {figure}", flush=True)
    return 1 if ok is False else 0


def _model_args(dry_run: bool) -> dict:
    import yaml

    args = dict(yaml.safe_load(CONFIG.read_text())["model"]["init_args"])
    args.pop("export_dir", None)
    if dry_run:
        args.update(hidden_size=32, num_blocks=1, state_size=8, head_dim=16, chunk_size=16, direct_horizons=2,
                    online_half_lives=[0, 16])  # keeps the shipped prior_start (16) one of them
    return args


def _epoch(args: dict, dm, accelerator: str, precision: str) -> list[float]:
    """One epoch; returns the step times in seconds (device-synchronized)."""
    import lightning as pl
    import torch
    from expertcast.train.forecaster_module import ForecasterModule

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def _sync(self) -> None:
            if torch.cuda.is_available() and accelerator == "gpu":
                torch.cuda.synchronize()

        def on_train_batch_start(self, *a) -> None:
            self._sync()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *a) -> None:
            self._sync()
            self.times.append(time.perf_counter() - self.t0)

    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    trainer = pl.Trainer(max_epochs=1, accelerator=accelerator, devices=1, precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer], gradient_clip_val=1.0)
    trainer.fit(ForecasterModule(**args), dm)
    return timer.times


def recipe_cost(step_s: float, batch: int, fit_windows: int = 500) -> str:
    """The shipped GPU recipe's cost from a measured step time: ``fit_windows`` training windows at the config's
    batch size and epochs, a step's time taken as linear in the batch (an estimate from ``batch``'s step, said so)."""
    import math

    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    B = int(cfg["data"]["init_args"]["batch_size"])
    epochs = int(cfg["trainer"]["max_epochs"])
    steps = math.ceil(fit_windows / B) * epochs
    per = step_s * B / batch
    return (f"recipe estimate ({CONFIG.name}: {fit_windows} windows, batch {B}, {epochs} epochs = {steps} steps at "
            f"~{1e3 * per:.0f} ms, linear in the batch from batch {batch}): {steps * per / 60:.1f} min")


def forecaster(dry_run: bool) -> int:
    from expertcast.data.synthetic import ModeMarkovProcess
    from expertcast.models import mamba_kernels
    from expertcast.train.forecaster_data import ForecasterDataModule

    L, E, K, n, T, batch = (48, 128, 8, 64, 512, 8) if not dry_run else (4, 16, 2, 8, 48, 4)
    proc = ModeMarkovProcess.random(num_modes=8, num_layers=L, num_experts=E, top_k=K, seed=0)
    seqs, _ = proc.sample(n, T, prompt_len=16, seed=1)
    dm = ForecasterDataModule.from_sequences(proc.meta(), seqs, window=T, batch_size=batch, val_fraction=0.0)
    args = _model_args(dry_run)
    kernels = mamba_kernels.kernel_status()["chunk_scan"]
    if dry_run:
        mamba_kernels.reset_calls()
        times = _epoch(args, dm, "cpu", "32-true")
        path = "torch" if not any(k.endswith(":kernel") for k in mamba_kernels.calls()) else "kernel"
        med = statistics.median(times)
        return line(path == "torch", "forecaster-epoch", f"dry-run cpu fp32 L={L} E={E} K={K}: {len(times)} steps, "
                    f"median {1e3 * med:.1f} ms/step, mamba path {path}; {recipe_cost(med, batch)} (of a toy)")
    if not kernels:
        return line(False, "forecaster-epoch", "mamba-ssm kernels not importable (pip install -e '.[gpu]')")
    mamba_kernels.reset_calls()
    fast = _epoch(args, dm, "gpu", "bf16-mixed")
    calls = mamba_kernels.calls()
    used = sum(v for k, v in calls.items() if k.endswith(":kernel"))
    fallback = sum(v for k, v in calls.items() if k.endswith(":torch"))
    with mamba_kernels.reference_only():
        slow = _epoch(args, dm, "gpu", "bf16-mixed")
    f, s = statistics.median(fast[1:] or fast), statistics.median(slow[1:] or slow)
    return line(used > 0 and fallback == 0, "forecaster-epoch",
                f"bf16 L={L} E={E} K={K}, {len(fast)} steps: mamba path kernel ({used} kernel calls, {fallback} "
                f"PyTorch) {1e3 * f:.1f} ms/step vs PyTorch fallback {1e3 * s:.1f} ms/step ({s / f:.2f}x); "
                f"{recipe_cost(f, batch)}")


def memory(out: Path, dry_run: bool) -> int:
    f = out / "memory.json"
    if not f.is_file():
        return line(False, "peak-memory", f"{f} missing (the bench step failed?)")
    m = json.loads(f.read_text())["lru_max_residency"]
    report = m["device_non_expert_bytes"] + m["device_slot_bytes"] + m["device_workspace_bytes"]
    peak = m.get("device_peak_allocated")
    if peak is None:
        return line(True if dry_run else False, "peak-memory", f"report {report / 2**20:.1f} MiB; no device peak "
                    f"on {'the CPU (dry run)' if dry_run else 'this device'}")
    # the report holds weights, slots and workspace; activations and the KV cache of batch-1 decoding come on top
    ok = peak <= 1.25 * report + 512 * 2**20
    return line(ok, "peak-memory", f"peak allocated {peak / 2**20:.0f} MiB vs memory report {report / 2**20:.0f} MiB "
                f"({peak / report:.2f}x; pass <= 1.25x + 512 MiB)")


def router(out: Path, data_dir: str, dry_run: bool) -> int:
    import re
    import shutil
    import subprocess

    root = out / "router_fit"
    shutil.rmtree(root, ignore_errors=True)
    cmd = [sys.executable, "-m", "expertcast.cli", "fit", "--config", str(ROUTER_CONFIG),
           "--model.init_args.model", "qwen3_moe-tiny", "--model.init_args.budget", "4",
           "--data.init_args.data_dir", data_dir, "--data.init_args.limit", "24", "--data.init_args.heldout", "0.25",
           "--data.init_args.max_length", "48", "--data.init_args.num_workers", "0",
           *(["--trainer.accelerator", "cpu"] if dry_run else []), "--trainer.devices", "1",
           "--trainer.max_steps", "2", "--trainer.accumulate_grad_batches", "1", "--trainer.val_check_interval", "2",
           "--trainer.limit_val_batches", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
           "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(root)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=480)
    secs = time.perf_counter() - t0
    log = out / "router_fit.log"
    log.write_text(r.stdout + r.stderr)
    sharded = re.search(r"FSDP2: (\d+) (\w+) units sharded over (\d+) processes", r.stdout + r.stderr)
    runs = sorted(root.iterdir()) if root.is_dir() else []
    info = json.loads((runs[0] / "run.json").read_text()) if len(runs) == 1 and (runs[0] / "run.json").is_file() else {}
    exported = len(runs) == 1 and (runs[0] / "export" / "export.json").is_file()
    if r.returncode != 0 or not sharded or info.get("status") != "finished" or not exported:
        return line(False, "router-fsdp2", f"exit {r.returncode}, sharded {bool(sharded)}, status "
                    f"{info.get('status')}, export {exported} (see {log})")
    where = "dry-run cpu" if dry_run else "1 GPU"
    return line(True, "router-fsdp2", f"{where}, {ROUTER_CONFIG.name}'s strategy as shipped on qwen3_moe-tiny: "
                f"{sharded.group(1)} {sharded.group(2)} FSDP2 units, {info.get('global_step')} steps, export written "
                f"({secs:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=["forecaster", "memory", "router"])
    ap.add_argument("out", nargs="?", default="runs/bench_runtime",
                    help="memory: the benchmark's --out folder; router: the check's output folder")
    ap.add_argument("data_dir", nargs="?", default=None, help="router: the folder holding gsm8k/train.jsonl")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    names = {"forecaster": "forecaster-epoch", "memory": "peak-memory", "router": "router-fsdp2"}
    try:
        if a.step == "forecaster":
            return forecaster(a.dry_run)
        if a.step == "router":
            return router(Path(a.out), a.data_dir or "", a.dry_run)
        return memory(Path(a.out), a.dry_run)
    except Exception as e:  # one FAIL line, the traceback on stderr
        import traceback

        traceback.print_exc()
        return line(False, names[a.step], f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


if __name__ == "__main__":
    sys.exit(main())
