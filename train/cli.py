"""The library behind `expertcast fit`: LightningCLI over a YAML, one run directory per run.

Subclass mode is on for both the LightningModule and the LightningDataModule, so the YAML picks them::

    model:
      class_path: expertcast.train.forecaster_module.ForecasterModule
      init_args: {hidden_size: 64}
    data:
      class_path: expertcast.train.forecaster_data.ForecasterDataModule
      init_args: {traces: runs/traces/tiny-gsm8k}
    trainer: {max_epochs: 3, gradient_clip_val: 1.0, default_root_dir: runs/forecaster/tiny}

:func:`fit` parses the config, builds model and data, names the run directory after the resolved
settings and the data fingerprint (:mod:`expertcast.train.fit_run`), builds the trainer with its
logger and checkpoints inside that directory, trains, and writes the export only once training
finished normally. A run resumes only when asked (``FitOptions.resume`` or ``ckpt_path``), and only
under the same settings and data. The command line (``expertcast fit``) lives in
:mod:`expertcast.commands.fit`.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as pl
import yaml
from expertcast.data.lineage import use_inputs_of_loggers
from expertcast.train.fit_run import (
    CKPT_DIR,
    CKPT_KEY,
    CONFIG_FILE,
    EXPORT_DIR,
    RUN_DIR_ENV,
    RUN_FILE,
    RUN_KIND,
    FitInterrupted,
    ResumeCheckpoint,
    StopRequest,
    check_fit_resume,
    data_fingerprint,
    data_training_info,
    find_resume_checkpoint,
    fit_settings,
    launch_rank,
    link_tokenizer,
    new_run_dir,
    plain_progress,
    read_run_info,
    settings_hash,
    shared_run_dir,
    stop_on_signals,
    write_run_info,
)
from expertcast.utils.errors import UsageError
from expertcast.utils.io import atomic_write_text
from expertcast.utils.outdir import OutputDir, claim_output_dir, read_marker
from expertcast.utils.provenance import host_record
from expertcast.utils.tracking import (
    finish_wandb_loggers,
    log_checkpoints_to_loggers,
    log_export_to_loggers,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI, instantiate_class


@dataclass
class FitOptions:
    """What `expertcast fit` adds to LightningCLI's options."""

    resume: str | None = None
    """A run directory or checkpoint to continue (its settings and data must match)."""
    run_name: str | None = None
    """First part of the run directory's name (default ``<task>-<config name>``)."""
    overwrite: bool = False
    """Replace an earlier export in an explicit ``export_dir`` (only once this run finished)."""
    checkpoint_every: int = 100
    """Optimizer steps between resumable checkpoints (also at every epoch end, at the end, on a signal)."""
    log_checkpoints: bool = False
    """Log the run's checkpoints to its W&B logger as an artifact once training finished (a W&B logger needed)."""


@dataclass
class FitResult:
    """The outcome of :func:`fit`."""

    run_dir: Path
    status: str
    """``finished`` or ``interrupted``."""
    global_step: int
    export_dir: Path | None = None
    export_hash: str | None = None
    resumed_from: Path | None = None
    checkpoint: Path | None = None
    exit_code: int = 0


@dataclass
class RunPlan:
    """Where a run writes, decided once model and data exist (before the trainer is built)."""

    run_dir: Path
    settings: dict[str, Any]
    fingerprint: str
    config: dict[str, Any]
    export_dir: Path
    callback: ResumeCheckpoint
    claims: list[OutputDir] = field(default_factory=list)
    export_claim: OutputDir | None = None
    resume_ckpt: Path | None = None

    def release(self) -> None:
        for c in self.claims:
            c.release()


def _check_not_nested(run_dir: Path, export_dir: Path) -> None:
    """An explicit export folder and the run directory must not contain one another (the export's
    manifest lists every file of its folder, so checkpoints inside it would break it)."""
    r, e = Path(run_dir).resolve(), Path(export_dir).resolve()
    if r == e or e in r.parents or r in e.parents:
        raise UsageError(f"model.init_args.export_dir {export_dir} and the run directory {run_dir} overlap; put the "
                         f"export elsewhere (or leave export_dir unset: the export then goes to RUN_DIR/export)")


class FitCLI(LightningCLI):
    """LightningCLI that instantiates model and data first, then plans the run (:class:`RunPlan`), then
    builds the trainer with its logger, checkpoint callbacks and ``default_root_dir`` in the run directory.
    Parse errors raise :class:`~expertcast.utils.errors.UsageError` (one line) instead of exiting."""

    def __init__(self, args: list[str], options: FitOptions, request: StopRequest):
        self.options = options
        self.request = request
        self._argv = list(args)
        self.plan: RunPlan | None = None
        self._held: dict[str, Any] = {}
        super().__init__(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                         subclass_mode_data=True, seed_everything_default=0, save_config_callback=None,
                         auto_configure_optimizers=False, parser_kwargs={"exit_on_error": False}, args=args,
                         run=False)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="run directory or checkpoint to resume (same as `expertcast fit --resume`)")

    def parse_arguments(self, parser: Any, args: Any) -> None:
        from jsonargparse import ArgumentError

        try:
            super().parse_arguments(parser, args)
        except ArgumentError as e:
            raise UsageError(_parse_error(str(e))) from None

    def instantiate_classes(self) -> None:
        # the logger and the callbacks need the run directory, known once model and data exist
        trainer_cfg = self.config["trainer"]
        self._held = {"logger": trainer_cfg["logger"], "callbacks": trainer_cfg["callbacks"]}
        _check_held(**self._held)
        if self.config.get("ckpt_path") == "last":
            raise UsageError("ckpt_path: last is not supported (a fit never resumes by itself): remove it from the "
                             "config and pass --resume RUN_DIR to continue a run")
        trainer_cfg["logger"], trainer_cfg["callbacks"] = None, None
        try:
            super().instantiate_classes()
        finally:
            trainer_cfg["logger"], trainer_cfg["callbacks"] = self._held["logger"], self._held["callbacks"]

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        self.plan = self._plan_run()
        run_dir = self.plan.run_dir
        try:
            callbacks = [_build_callback(c, run_dir) for c in (self._held["callbacks"] or [])]
            logger = _build_logger(self._held["logger"], run_dir)
            callbacks = _without_logger_callbacks(callbacks, logger)
            if not any(isinstance(c, ModelCheckpoint) for c in callbacks):
                kwargs["enable_checkpointing"] = False  # the resumable checkpoints are ResumeCheckpoint's
            return super().instantiate_trainer(default_root_dir=str(run_dir),
                                               logger=logger,
                                               callbacks=[*callbacks, self.plan.callback, *plain_progress()],
                                               **kwargs)
        except BaseException:
            _update_run(run_dir, status="failed")
            self.plan.release()
            raise

    # -- the run ------------------------------------------------------------------------------------
    def resolved_config(self) -> dict[str, Any]:
        return yaml.safe_load(self.parser.dump(self.config, skip_none=False, skip_link_targets=False))

    def _config_name(self) -> str:
        files = self.config.get("config") or []
        return Path(str(files[-1])).stem if files else "custom"

    def _plan_run(self) -> RunPlan:
        model, dm = self.model, self.datamodule
        if dm is None:
            raise UsageError("the config has no data module (data: class_path: ...)")
        link_tokenizer(dm, model)
        fingerprint = data_fingerprint(dm)
        config = self.resolved_config()
        settings = fit_settings(config, fingerprint)
        target = self.options.resume or self.config.get("ckpt_path")
        resumed, resume_ckpt, ck = None, None, {}
        if target:
            resumed, resume_ckpt, ck = find_resume_checkpoint(target)
            check_fit_resume(ck.get(CKPT_KEY, {}).get("settings"), settings, resume_ckpt)
        rank = launch_rank()
        if rank > 0:  # a process of a multi-process run: rank 0 owns the run directory
            run_dir, claims, export_claim = shared_run_dir(rank), [], None
        else:
            run_dir, claims, export_claim = self._take_run_dir(resumed, config, settings)
            self._record(run_dir, settings, fingerprint, export_claim.path if export_claim else run_dir / EXPORT_DIR,
                         resume_ckpt, ck)
        block = {"settings": settings, "data_fingerprint": fingerprint, "run_dir": str(run_dir)}
        cb = ResumeCheckpoint(run_dir / CKPT_DIR, block, self.request, self.options.checkpoint_every)
        return RunPlan(run_dir=run_dir, settings=settings, fingerprint=fingerprint, config=config,
                       export_dir=export_claim.path if export_claim else run_dir / EXPORT_DIR, callback=cb,
                       claims=claims, export_claim=export_claim, resume_ckpt=resume_ckpt)

    def _take_run_dir(self, resumed: Path | None, config: dict[str, Any], settings: dict[str, Any]
                      ) -> tuple[Path, list[OutputDir], OutputDir | None]:
        """Claim an explicit export folder, then the run directory (``resumed``, or a new one named after the
        settings); a refused export folder leaves no run directory behind."""
        export_claim = self._claim_export(self.model)
        try:
            run_dir = resumed if resumed is not None else self._new_run_dir(config, settings)
            if export_claim is not None:
                _check_not_nested(run_dir, export_claim.path)
            claims = [claim_output_dir(run_dir, RUN_KIND)]
        except BaseException:
            if export_claim is not None:
                export_claim.release()
            raise
        claims[0].track(CONFIG_FILE, CKPT_DIR, RUN_FILE, *([] if export_claim else [EXPORT_DIR]))
        return run_dir, claims + ([export_claim] if export_claim else []), export_claim

    def _new_run_dir(self, config: dict[str, Any], settings: dict[str, Any]) -> Path:
        shared = os.environ.get(RUN_DIR_ENV)
        if shared:  # set for all processes of a multi-process launch (torchrun, SLURM)
            d = Path(shared)
            if (d / RUN_FILE).exists():
                raise UsageError(f"{RUN_DIR_ENV}={shared} already holds a run; pass --resume {shared} to continue it")
            d.mkdir(parents=True, exist_ok=True)
            return d
        task = getattr(self.model, "task_name", type(self.model).__name__.lower())
        root = config["trainer"].get("default_root_dir") or f"runs/{task}/{self._config_name()}"
        return new_run_dir(root, self.options.run_name or f"{task}-{self._config_name()}", settings)

    def _record(self, run_dir: Path, settings: dict[str, Any], fingerprint: str, export_dir: Path,
                resume_ckpt: Path | None, ck: dict[str, Any]) -> None:
        """Write the resolved ``config.yaml`` and ``run.json`` (a resume appends to its ``resumes``)."""
        info = read_run_info(run_dir) or {
            "format": "expertcast-fit-run", "format_version": 1,
            "task": getattr(self.model, "task_name", type(self.model).__name__.lower()),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "settings": settings,
            "settings_hash": settings_hash(settings), "data_fingerprint": fingerprint, "host": host_record()}
        if resume_ckpt is not None:
            info.setdefault("resumes", []).append({"checkpoint": str(resume_ckpt), "step": ck.get("global_step"),
                                                   "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": host_record()})
        (run_dir / CKPT_DIR).mkdir(exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(self.parser.dump(self.config, skip_none=False), encoding="utf-8")
        info.update(status="running", run_dir=str(run_dir), export_dir=str(export_dir),
                    command=["expertcast", "fit", *self._argv])
        write_run_info(run_dir, info)

    def _claim_export(self, model: Any) -> OutputDir | None:
        """Claim the explicit ``model.init_args.export_dir`` (None: the export goes to the run directory)."""
        explicit = (getattr(model, "hparams", None) or {}).get("export_dir")
        if not explicit:
            return None
        kind = getattr(model, "export_kind", f"export-{type(model).__name__.lower()}")
        claim = claim_output_dir(explicit, kind)
        earlier = (read_marker(claim.path) or {}).get("written") or []
        foreign = sorted(e.name for e in claim.path.iterdir() if not e.name.startswith(".") and e.name not in earlier)
        problem = None
        if foreign:
            problem = (f"export_dir {explicit} also holds files expertcast did not write ({', '.join(foreign[:5])}); "
                       f"move them or choose another model.init_args.export_dir")
        elif any((claim.path / n).exists() for n in earlier) and not self.options.overwrite:
            problem = (f"export_dir {explicit} already holds an export; pass --overwrite to replace it once this run "
                       f"finishes, or choose another model.init_args.export_dir")
        if problem:
            claim.release()
            raise UsageError(problem)
        return claim


def _parse_error(message: str) -> str:
    """jsonargparse's message on one line, without the Union alternatives noise when a class's argument is wrong."""
    import re

    msg = " ".join(message.split())
    m = re.search(r"Parser key \"(\w+)\": .*?Problem with given class_path '([\w.]+)': (.*?)(?: - Expected a <class "
                  r"'NoneType'>.*)?$", msg)
    if m:
        msg = f"{m.group(1)} ({m.group(2)}): {m.group(3)}"
    return msg[:600]


def _as_init(ns: Any) -> dict[str, Any]:
    d = ns.as_dict() if hasattr(ns, "as_dict") else dict(ns)
    d["init_args"] = dict(d.get("init_args") or {})
    return d


def _is_class_config(raw: Any) -> bool:
    return hasattr(raw, "as_dict") or isinstance(raw, dict)


def _loggers(raw: Any) -> list[Any]:
    return [r for r in (raw if isinstance(raw, list) else [raw]) if _is_class_config(r)]


def _check_held(logger: Any, callbacks: Any) -> None:
    """Refuse logger / checkpoint settings that would put a run's files outside its run directory."""
    import inspect

    for raw in _loggers(logger):
        init = _as_init(raw)
        param = inspect.signature(_import(init["class_path"])).parameters.get("save_dir")
        given = init["init_args"].get("save_dir")
        if param is not None and given is not None and given != param.default:
            raise UsageError(f"trainer.logger ({init['class_path']}): remove save_dir: every run logs into its own "
                             f"run directory (trainer.default_root_dir chooses where run directories go)")
    for raw in callbacks or []:
        if not _is_class_config(raw):
            continue
        init = _as_init(raw)
        if issubclass(_import(init["class_path"]), ModelCheckpoint):
            if init["init_args"].get("dirpath") is not None:
                raise UsageError("trainer.callbacks ModelCheckpoint: remove dirpath: checkpoints go to the run "
                                 "directory's checkpoints/")
            if init["init_args"].get("save_last"):
                raise UsageError("trainer.callbacks ModelCheckpoint: remove save_last: expertcast fit keeps "
                                 "checkpoints/last.ckpt and last-prev.ckpt itself")


def _build_logger(raw: Any, run_dir: Path) -> Any:
    """The configured logger(s), writing into the run directory (``save_dir``)."""
    import inspect

    if isinstance(raw, list):
        return [_build_logger(r, run_dir) for r in raw]
    if not _is_class_config(raw):
        return raw
    init = _as_init(raw)
    if "save_dir" in inspect.signature(_import(init["class_path"])).parameters:
        init["init_args"]["save_dir"] = str(run_dir)
    if init["class_path"].rpartition(".")[2] == "WandbLogger" and not init["init_args"].get("id"):
        # one W&B run per run directory: a resumed fit continues it (docs/design.md, "W&B lineage")
        init["init_args"]["id"] = wandb_run_id(run_dir)
        init["init_args"].setdefault("resume", "allow")
    return instantiate_class((), init)


WANDB_ID_FILE = "wandb_run_id"
"""In the run directory: the id of its W&B run, reused by ``--resume``."""


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of ``run_dir`` (written there on first use; a resumed run reads it back)."""
    import secrets

    f = Path(run_dir) / WANDB_ID_FILE
    if f.is_file() and f.read_text(encoding="utf-8").strip():
        return f.read_text(encoding="utf-8").strip()
    run_id = secrets.token_hex(4)
    if launch_rank() == 0:
        atomic_write_text(f, run_id + "\n")
    return run_id


def _without_logger_callbacks(callbacks: list[Any], logger: Any) -> list[Any]:
    """``callbacks`` less a LearningRateMonitor when there is no logger (``--trainer.logger false`` with a config
    that monitors the learning rate: it has nothing to log to, and Lightning would stop the fit at its start)."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    if logger not in (None, False, []) or not any(isinstance(c, LearningRateMonitor) for c in callbacks):
        return callbacks
    print("expertcast fit: no logger (trainer.logger false): the config's LearningRateMonitor is left out",
          file=sys.stderr, flush=True)
    return [c for c in callbacks if not isinstance(c, LearningRateMonitor)]


def _build_callback(raw: Any, run_dir: Path) -> Any:
    """A configured callback; a ModelCheckpoint writes into ``<run_dir>/checkpoints``."""
    if not _is_class_config(raw):
        return raw
    init = _as_init(raw)
    if issubclass(_import(init["class_path"]), ModelCheckpoint):
        init["init_args"]["dirpath"] = str(run_dir / CKPT_DIR)
    return instantiate_class((), init)


def _import(class_path: str) -> type:
    import importlib

    mod, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


@contextmanager
def _run_dir_env(run_dir: Path) -> Iterator[None]:
    """``RUN_DIR_ENV`` = ``run_dir`` inside the block, for the processes Lightning's launcher starts in
    ``trainer.fit`` (they rebuild the CLI and take rank 0's run directory from it); its earlier value
    (or its absence) afterwards."""
    before = os.environ.get(RUN_DIR_ENV)
    os.environ[RUN_DIR_ENV] = str(run_dir)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = before


def build_cli(args: list[str], options: FitOptions | None = None, request: StopRequest | None = None) -> FitCLI:
    """Parse ``args`` (LightningCLI options: ``--config``, ``--trainer.*``, ...) and build model, data, run
    directory and trainer without training. It reads ``RUN_DIR_ENV`` (a torchrun/SLURM launch) and leaves the
    environment as it was (:func:`fit` sets the variable only while training)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # ``args`` is the whole command line: hide the process's own argv, which LightningCLI would warn about
    saved, sys.argv = sys.argv, sys.argv[:1]
    try:
        return FitCLI(list(args), options or FitOptions(), request or StopRequest())
    finally:
        sys.argv = saved


def fit(args: list[str], options: FitOptions | None = None) -> FitResult:
    """Train per ``args`` (LightningCLI options) in a new run directory (or the one ``options.resume`` names)
    and write the export once training finished; a SIGTERM/SIGINT saves a checkpoint and returns an
    ``interrupted`` result (exit code 128 + signal) with no export."""
    options = options or FitOptions()
    request = StopRequest()
    with stop_on_signals(request):
        cli = build_cli(args, options, request)
        plan = cli.plan
        assert plan is not None
        try:
            if options.log_checkpoints and not any(type(lg).__name__ == "WandbLogger" for lg in cli.trainer.loggers):
                raise UsageError("--wandb-checkpoints logs the checkpoints to the run's W&B logger, and trainer.logger "
                                 "has none (e.g. lightning.pytorch.loggers.WandbLogger, as in configs/forecaster/tiny.yaml)")
            with _run_dir_env(plan.run_dir):
                return _train(cli, plan, args)
        finally:
            finish_wandb_loggers(cli.trainer.loggers)
            plan.release()


def _train(cli: FitCLI, plan: RunPlan, args: list[str]) -> FitResult:
    trainer = cli.trainer
    start = f" from {plan.resume_ckpt}" if plan.resume_ckpt else ""
    print(f"expertcast fit: run directory {plan.run_dir}{start}", flush=True)
    try:
        with warnings.catch_warnings():
            if _resumable(cli.datamodule):  # it restores the loader position itself (state_dict / load_state_dict)
                warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")
            trainer.fit(cli.model, datamodule=cli.datamodule, weights_only=True,
                        ckpt_path=str(plan.resume_ckpt) if plan.resume_ckpt else None)
        if plan.callback.request.signum is not None:  # a signal after the last step: the final checkpoint exists
            raise FitInterrupted(plan.callback.request.signum, plan.callback.last, trainer.global_step)
    except FitInterrupted as e:
        _update_run(plan.run_dir, status="interrupted", global_step=e.step, checkpoint=str(e.checkpoint))
        cmd = shlex.join(["expertcast", "fit", *[a for a in args if a]] + ["--resume", str(plan.run_dir)])
        print(f"expertcast fit: {e}; checkpoint {e.checkpoint}; no export written. Resume with:\n  {cmd}",
              file=sys.stderr, flush=True)
        return FitResult(plan.run_dir, "interrupted", e.step, resumed_from=plan.resume_ckpt, checkpoint=e.checkpoint,
                         exit_code=128 + int(e.signum))
    except BaseException:
        _update_run(plan.run_dir, status="failed", global_step=int(trainer.global_step))
        raise
    export_hash = None
    if trainer.is_global_zero or getattr(cli.model, "collective_export", False):
        export_hash = _write_export(cli, plan)
    if trainer.is_global_zero:
        _update_run(plan.run_dir, status="finished", global_step=int(trainer.global_step), export_hash=export_hash)
        traces = getattr(cli.datamodule, "traces", None)  # the forecaster's trace set(s), by their fingerprint
        traces = [traces] if isinstance(traces, (str, os.PathLike)) else list(traces or [])
        use_inputs_of_loggers(trainer.loggers, [(t, "traces", None) for t in traces])
        log_export_to_loggers(trainer.loggers, plan.export_dir)  # a W&B logger gets the export as an artifact
        if cli.options.log_checkpoints:
            log_checkpoints_to_loggers(trainer.loggers, plan.run_dir / CKPT_DIR, step=int(trainer.global_step),
                                       export_hash=export_hash)
        print(f"expertcast fit: {getattr(cli.model, 'task_name', 'model')} export written to {plan.export_dir} "
              f"(export hash {export_hash[:12]}, step {trainer.global_step})", flush=True)
    return FitResult(plan.run_dir, "finished", int(trainer.global_step), export_dir=plan.export_dir,
                     export_hash=export_hash, resumed_from=plan.resume_ckpt, checkpoint=plan.callback.last)


def _resumable(datamodule: Any) -> bool:
    return type(datamodule).load_state_dict is not pl.LightningDataModule.load_state_dict


def _write_export(cli: FitCLI, plan: RunPlan) -> str | None:
    """Write the export (replacing an earlier one in an explicit export_dir) with its ``training`` block;
    returns the export hash from its manifest. A model with ``collective_export`` is called on every rank
    (its export gathers sharded weights and writes from rank 0 only; None on the other ranks)."""
    import shutil

    from expertcast.utils.provenance import verify_export_manifest

    training = {**data_training_info(cli.datamodule, plan.fingerprint), "run_dir": str(plan.run_dir),
                "global_step": int(cli.trainer.global_step), "settings_hash": settings_hash(plan.settings),
                "config": plan.config}
    claim = plan.export_claim
    if claim is not None:
        for name in (read_marker(claim.path) or {}).get("written") or []:
            t = claim.path / name
            if t.is_dir() and not t.is_symlink():
                shutil.rmtree(t)
            elif t.exists() or t.is_symlink():
                t.unlink()
    written = cli.model.export(plan.export_dir, training=training)
    if written is None:
        return None
    out = Path(written)
    if claim is not None:
        claim.track(*[p.name for p in out.iterdir() if not p.name.startswith(".")])
    return verify_export_manifest(out)


def _update_run(run_dir: Path, **fields: Any) -> None:
    if launch_rank() > 0:
        return
    info = read_run_info(run_dir) or {}
    info.update(fields, updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    write_run_info(run_dir, info)
