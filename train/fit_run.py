"""Fit runs: one run directory per training run, resume only when asked, checkpoints that survive
an interruption (docs/design.md, "Fit runs").

* A run lives in ``<root>/<run-name>-<YYYYmmdd-HHMMSS>-<8 hex>`` (:func:`new_run_dir`); the hex
  digits are the sha256 of the run's settings (:func:`fit_settings`: the resolved config entries that
  determine what is learned, plus the data fingerprint). It holds ``run.json``, the resolved
  ``config.yaml``, ``checkpoints/``, the logger's files and, unless the config names another
  ``export_dir``, ``export/``.
* :class:`ResumeCheckpoint` keeps ``checkpoints/last.ckpt`` and the one before it
  (``last-prev.ckpt``); each records the run's settings and the RNG states. On SIGTERM or SIGINT
  (:func:`stop_on_signals`; it replaces Lightning's own SIGTERM handler for the run) it saves one at
  the end of the running training step and stops training with :class:`FitInterrupted`: no export
  is written. A signal during validation stops after the next training step (or at the end).
* :func:`find_resume_checkpoint` picks the newest readable checkpoint of a run (the previous one,
  with a warning, when the newest is truncated or corrupt) and :func:`check_fit_resume` refuses to
  resume under other settings, naming the first one that differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as pl
import numpy as np
import torch
from expertcast.utils.errors import ResumeMismatchError, UsageError
from expertcast.utils.io import atomic_write_json
from expertcast.utils.provenance import check_resume, settings_key, sha256_json

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
CKPT_DIR = "checkpoints"
LAST_CKPT = "last.ckpt"
PREV_CKPT = "last-prev.ckpt"
EXPORT_DIR = "export"
RUN_KIND = "fit-run"
RUN_DIR_ENV = "EXPERTCAST_FIT_RUN_DIR"
"""The run directory shared by every process of a multi-process fit: rank 0 sets it for the processes
Lightning launches; for torchrun / SLURM launches set it to a new folder for all ranks."""
SHARDED_META = "meta.pt"
"""The non-tensor part of a distributed checkpoint folder (Lightning's ModelParallelStrategy writes it on rank 0)."""
CKPT_KEY = "expertcast"
"""Key of the block every checkpoint of a fit run carries: settings, data fingerprint, run dir, RNG states."""

NOT_SETTINGS = (
    "config", "ckpt_path",
    "trainer.max_epochs", "trainer.max_steps", "trainer.max_time", "trainer.min_epochs", "trainer.min_steps",
    "trainer.default_root_dir", "trainer.logger", "trainer.callbacks", "trainer.enable_checkpointing",
    "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.log_every_n_steps",
    "model.init_args.export_dir", "data.init_args.traces", "data.init_args.data_dir", "data.init_args.num_workers",
)
"""Config entries that do not decide what a run learns: they may differ between a run and its resumption
(max_steps/max_epochs may grow; trace folders may move: their content is in the data fingerprint)."""


# -- settings and names ----------------------------------------------------------------------------
def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> one dict with dotted keys (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``); lists stay values."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _is_setting(key: str) -> bool:
    return not any(key == n or key.startswith(n + ".") for n in NOT_SETTINGS)


def fit_settings(config: Mapping[str, Any], data_fingerprint: str) -> dict[str, Any]:
    """The settings key of a run: every resolved config entry that decides what is learned (dotted keys,
    so a refused resume names the exact entry) plus ``data_fingerprint``."""
    flat = {k: v for k, v in flatten(config).items() if _is_setting(k)}
    return settings_key(**flat, data_fingerprint=data_fingerprint)


def settings_hash(settings: Mapping[str, Any]) -> str:
    """The 8 hex digits in a run directory's name."""
    return sha256_json(dict(settings))[:8]


def new_run_dir(root: str | os.PathLike, name: str, settings: Mapping[str, Any]) -> Path:
    """Create ``root/<name>-<YYYYmmdd-HHMMSS>-<settings hash>`` (a ``-N`` suffix when two runs start in the
    same second with the same settings) and return it."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"
    base = f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{settings_hash(settings)}"
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(1000):
        d = root / (base if i == 0 else f"{base}-{i}")
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise UsageError(f"cannot create a new run directory under {root} (1000 runs named {base}*)")


def launch_rank() -> int:
    """This process's rank in a multi-process launch (0 when alone or the first)."""
    return max(int(os.environ.get(v) or 0) for v in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def shared_run_dir(rank: int) -> Path:
    """The run directory of rank 0, for a process of rank > 0. It creates nothing: under torchrun the ranks
    start together, and rank 0 claims the folder (which must then be empty or new) while the others may
    already be here; nothing of a rank > 0 writes into it (checkpoints, logs and the export are rank 0's)."""
    shared = os.environ.get(RUN_DIR_ENV)
    if not shared:
        raise UsageError(f"process rank {rank} of a multi-process fit: set {RUN_DIR_ENV} to one new folder for every "
                         f"rank (Lightning's own launcher sets it)")
    return Path(shared)


def read_run_info(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    import json

    p = Path(run_dir) / RUN_FILE
    try:
        info = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        raise UsageError(f"{p}: unreadable run record") from None
    return info if isinstance(info, dict) else None


def write_run_info(run_dir: str | os.PathLike, info: Mapping[str, Any]) -> None:
    atomic_write_json(Path(run_dir) / RUN_FILE, dict(info))


# -- data -------------------------------------------------------------------------------------------
def link_tokenizer(datamodule: Any, model: Any) -> None:
    """Give an LM-text data module that reads its tokenizer from the trainer's module the model's
    tokenizer now: the data must be loaded (and fingerprinted) before the trainer exists."""
    hp = getattr(datamodule, "hparams", None)
    tok = getattr(model, "tokenizer", None)
    if hp is not None and "tokenizer" in hp and not hp["tokenizer"] and tok is not None:
        datamodule.tokenizer = tok


def data_fingerprint(datamodule: Any) -> str:
    """sha256 of the data a run trains and validates on: the data module's ``data_fingerprint()``, or for
    LM-text modules (``train_set`` / ``heldout_set`` of examples with ``seq_id`` and token ids) a hash of
    their texts' ids and tokens."""
    fn = getattr(datamodule, "data_fingerprint", None)
    if callable(fn):
        return str(fn())
    datamodule.setup("fit")
    examples = list(getattr(datamodule, "train_set", [])) + list(getattr(datamodule, "heldout_set", []))
    if not examples:
        raise UsageError(f"{type(datamodule).__name__} holds no data to fingerprint (and has no data_fingerprint())")
    h = hashlib.sha256()
    for e in sorted(examples, key=lambda e: str(getattr(e, "seq_id", ""))):
        h.update(f"{getattr(e, 'seq_id', '')}\0{list(e.prompt_ids)}\0{list(e.completion_ids)}\n".encode())
    return h.hexdigest()


def data_training_info(datamodule: Any, fingerprint: str) -> dict[str, Any]:
    """The data half of an export's ``training`` block: where the data came from, its fingerprint, the split
    method and the exact ``train_ids`` / ``val_ids``."""
    fn = getattr(datamodule, "training_info", None)
    if callable(fn):
        info = dict(fn())
        traces = info.get("traces")
        if isinstance(traces, list) and traces and "model" not in info:
            from expertcast.utils.fitted_on import trace_set_model

            # the routing's model, for the guard against scoring another model's (utils/fitted_on.py)
            info["model"] = trace_set_model(traces[0], None)
        return info
    hp = dict(getattr(datamodule, "hparams", {}) or {})
    info: dict[str, Any] = {k: hp[k] for k in ("source", "dataset_config", "text_field", "limit") if k in hp}
    info.update(dataset_split=hp.get("split"), data_fingerprint=fingerprint,
                split={"method": "sha256(seed, text id)", "seed": hp.get("seed"), "val_fraction": hp.get("heldout")})
    if callable(getattr(datamodule, "train_ids", None)):
        info["train_ids"] = list(datamodule.train_ids())
        info["val_ids"] = list(datamodule.heldout_ids())
    return info


# -- checkpoints ------------------------------------------------------------------------------------
class FitInterrupted(Exception):
    """Training stopped on a signal after saving a resumable checkpoint."""

    def __init__(self, signum: int, checkpoint: Path | None, step: int):
        self.signum = signum
        self.checkpoint = checkpoint
        self.step = step
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}")


@dataclass
class StopRequest:
    """Set by the signal handler of :func:`stop_on_signals`, read by :class:`ResumeCheckpoint`."""

    signum: int | None = None
    handler: Any = None
    """The handler :func:`stop_on_signals` installed (None outside it, or off the main thread)."""

    def reinstall(self) -> None:
        """Put the handler back in place of Lightning's SIGTERM handler, which the trainer installs when it
        starts and which ends a fit through ``SIGTERMException`` (exit status 0) at its own points."""
        if self.handler is not None and threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, self.handler)


@contextlib.contextmanager
def stop_on_signals(request: StopRequest) -> Iterator[StopRequest]:
    """While active, SIGTERM and SIGINT ask training to stop after the running step (a second SIGINT
    interrupts at once). Only installs handlers from the main thread; restores the previous ones."""
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    sigs = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in sigs}

    def handler(signum: int, frame: Any) -> None:
        if request.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        request.signum = signum
        print(f"expertcast fit: {signal.Signals(signum).name} received: saving a checkpoint after this step, "
              f"then stopping", file=sys.stderr, flush=True)

    request.handler = handler
    for s in sigs:
        signal.signal(s, handler)
    try:
        yield request
    finally:
        request.handler = None
        for s, h in previous.items():
            signal.signal(s, h)


def _rng_states() -> dict[str, Any]:
    """Global RNG states in types ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    kind, keys, *rest = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _replace(src: Path, dst: Path) -> None:
    """Move ``src`` over ``dst`` (files atomically; a sharded checkpoint folder replaces the old folder)."""
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    os.replace(src, dst)


class ResumeCheckpoint(pl.Callback):
    """Resumable checkpoints of a fit run: ``last.ckpt`` and the previous one, ``last-prev.ckpt``.

    Saved every ``every_n_train_steps`` optimizer steps, at the end of every training epoch, when training
    ends, and when :class:`StopRequest` is set by a signal (then training stops with
    :class:`FitInterrupted`). A new checkpoint is written to a temporary name and renamed over
    ``last.ckpt`` after the old one moved to ``last-prev.ckpt``, so an interrupted write never costs
    the last good checkpoint. Each checkpoint carries ``block`` (settings, data fingerprint, run dir)
    and the global RNG states, restored on resume.
    """

    def __init__(self, dirpath: str | os.PathLike, block: Mapping[str, Any], request: StopRequest,
                 every_n_train_steps: int = 100):
        self.dirpath = Path(dirpath)
        self.block = dict(block)
        self.request = request
        self.every = int(every_n_train_steps)
        self._saved_step = -1

    @property
    def last(self) -> Path:
        return self.dirpath / LAST_CKPT

    def save(self, trainer: pl.Trainer) -> None:
        tmp = self.dirpath / f".{LAST_CKPT}.tmp"
        trainer.save_checkpoint(tmp, weights_only=False)
        if trainer.is_global_zero:
            if self.last.exists():
                _replace(self.last, self.dirpath / PREV_CKPT)
            _replace(tmp, self.last)
        trainer.strategy.barrier("expertcast-resume-checkpoint")
        self._saved_step = trainer.global_step

    def _stop_if_asked(self, trainer: pl.Trainer) -> None:
        # every process stops at the same step when any of them was signalled
        if trainer.strategy.reduce_boolean_decision(self.request.signum is not None, all=False):
            if trainer.global_step != self._saved_step:
                self.save(trainer)
            signum = self.request.signum or signal.SIGTERM
            raise FitInterrupted(signum, self.last if self.last.exists() else None, trainer.global_step)

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.request.reinstall()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.request.reinstall()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.every and step and step % self.every == 0 and step != self._saved_step:
            self.save(trainer)
        self._stop_if_asked(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._saved_step:
            self.save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._saved_step:
            self.save(trainer)
        self._stop_if_asked(trainer)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        checkpoint[CKPT_KEY] = {**self.block, "rng": _rng_states()}

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        rng = (checkpoint.get(CKPT_KEY) or {}).get("rng")
        if rng:
            _set_rng_states(rng)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Open a checkpoint of a fit run (``torch.load(weights_only=True)``, memory-mapped): UsageError when it
    is truncated, corrupt or was not written by ``expertcast fit``. A sharded checkpoint (a folder) must be
    non-empty; a distributed one (FSDP2's, from ModelParallelStrategy) is read through its non-tensor part
    (``meta.pt``, with the block), any other carries no readable block (returns ``{}``)."""
    p = Path(path)
    sharded = p.is_dir()
    if sharded:
        if not any(p.iterdir()):
            raise UsageError(f"{p}: empty checkpoint folder")
        if not (p / SHARDED_META).is_file():
            return {}
        p = p / SHARDED_META
    try:
        ck = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any failure to read means "not usable"; the message says which
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"{p}: unreadable checkpoint ({type(e).__name__}: {first[:160]})") from None
    if not isinstance(ck, dict) or ("state_dict" not in ck and not sharded) or "global_step" not in ck:
        raise UsageError(f"{p}: not a Lightning checkpoint")
    if not isinstance(ck.get(CKPT_KEY), dict) or "settings" not in ck[CKPT_KEY]:
        raise UsageError(f"{p}: not a checkpoint of an `expertcast fit` run (it records no settings)")
    return ck


def find_resume_checkpoint(target: str | os.PathLike) -> tuple[Path, Path, dict[str, Any]]:
    """``(run_dir, checkpoint, checkpoint dict)`` to resume from ``target`` (a run directory or one of its
    checkpoints). Falls back from an unusable ``last.ckpt`` to ``last-prev.ckpt`` with a one-line warning."""
    p = Path(target).expanduser()
    if p.is_dir() and not p.name.endswith(".ckpt"):
        run_dir = p.parent if p.name == CKPT_DIR else p
        candidates = [run_dir / CKPT_DIR / LAST_CKPT, run_dir / CKPT_DIR / PREV_CKPT]
    elif p.exists():
        run_dir = p.parent.parent
        candidates = [p] + ([p.parent / PREV_CKPT] if p.name == LAST_CKPT else [])
    else:
        raise UsageError(f"--resume {target}: no such run directory or checkpoint")
    if not (run_dir / RUN_FILE).is_file():
        raise UsageError(f"--resume {target}: {run_dir} is not an `expertcast fit` run directory (no {RUN_FILE})")
    problems = []
    for c in candidates:
        if not c.exists():
            problems.append(f"{c.name} is missing")
            continue
        try:
            ck = read_checkpoint(c)
        except UsageError as e:
            problems.append(str(e))
            continue
        if problems:
            print(f"expertcast fit: warning: {problems[0]}; resuming from the previous checkpoint {c} "
                  f"(step {ck.get('global_step', '?')})", file=sys.stderr)
        return run_dir, c, ck
    raise UsageError(f"--resume {target}: no usable checkpoint ({'; '.join(problems)})")


def check_fit_resume(saved: Mapping[str, Any] | None, current: Mapping[str, Any], where: str | os.PathLike) -> None:
    """:func:`~expertcast.utils.provenance.check_resume` with the fit command's advice."""
    try:
        check_resume(saved, current, where)
    except ResumeMismatchError as e:
        msg = str(e).split("; use --overwrite")[0]
        raise ResumeMismatchError(f"{msg}; resume with the run's own config and data, or drop --resume to start "
                                  f"a new run") from None


# -- progress in a plain log ----------------------------------------------------------------------------
class PlainProgress(pl.Callback):
    """Progress of a fit as plain lines when stdout is no terminal (nohup, SLURM, a pipe), where the progress bar
    renders nothing: ``expertcast fit: step S/N (P%), epoch E, <losses>, <steps/s>, <elapsed>`` at every tenth of
    the steps and at least every ``every_s`` seconds, and one line per finished validation."""

    def __init__(self, every_s: float = 60.0, stream: Any = None):
        self.every_s = every_s
        self.stream = stream
        self._t0 = self._last = 0.0
        self._mark = -1

    def _print(self, text: str) -> None:
        print(f"expertcast fit: {text}", file=self.stream or sys.stdout, flush=True)

    @staticmethod
    def _metrics(trainer: pl.Trainer, part: str) -> str:
        got = []
        for k, v in sorted(trainer.callback_metrics.items()):
            if part in k and getattr(v, "numel", lambda: 0)() == 1:
                got.append(f"{k} {float(v):.4g}")
        return ", ".join(got[:4])

    @staticmethod
    def _total(trainer: pl.Trainer) -> int | None:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        return int(total) if total and total != float("inf") else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = self._last = time.monotonic()
        total = self._total(trainer)
        if trainer.is_global_zero:
            self._print(f"training from step {trainer.global_step}" + (f" to {total}" if total else "")
                        + " (plain progress lines: stdout is no terminal)")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        step, total, now = int(trainer.global_step), self._total(trainer), time.monotonic()
        mark = 10 * step // total if total else -1
        if not (mark > self._mark or now - self._last >= self.every_s):
            return
        self._mark, self._last = max(mark, self._mark), now
        elapsed = now - self._t0
        parts = [f"step {step}" + (f"/{total} ({100 * step / total:.0f}%)" if total else ""),
                 f"epoch {trainer.current_epoch}", self._metrics(trainer, "loss"),
                 f"{elapsed:.0f} s elapsed"]
        self._print(", ".join(p for p in parts if p))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            got = self._metrics(trainer, "val")
            if got:
                self._print(f"validation at step {trainer.global_step}: {got}")


def plain_progress(stream: Any = None) -> list[pl.Callback]:
    """``[PlainProgress()]`` when ``stream`` (default stdout) is no terminal, else ``[]`` (the bar shows)."""
    s = stream or sys.stdout
    return [] if getattr(s, "isatty", lambda: False)() else [PlainProgress()]
