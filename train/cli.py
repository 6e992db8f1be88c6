"""`expertcast fit --config CONFIG.yaml`: LightningCLI training entry, generic over model and data.

Subclass mode is on for both the LightningModule and the LightningDataModule, so the YAML picks them::

    model:
      class_path: expertcast.train.forecaster_module.ForecasterModule
      init_args: {hidden_size: 64}
    data:
      class_path: expertcast.train.forecaster_data.ForecasterDataModule
      init_args: {traces: runs/traces/tiny-gsm8k}
    trainer: {max_epochs: 3, gradient_clip_val: 1.0}
    ckpt_path: last      # resume from the last checkpoint when there is one

The first argument may name a LightningCLI subcommand (``fit``, ``validate``, ``test``); without one,
``fit`` runs. Anything after is passed to LightningCLI (``--trainer.max_steps 10``, ``--print_config``).
"""

from __future__ import annotations

import os
import sys

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def build_cli(args: list[str], run: bool = True):
    """Construct (and by default run) the LightningCLI over ``args`` (subcommand first)."""
    import lightning as pl
    from lightning.pytorch.cli import LightningCLI

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # ``args`` is the whole command line: hide the process's own argv (e.g. `expertcast fit ...` or
    # `expertcast quickstart`), which LightningCLI would otherwise warn about
    saved, sys.argv = sys.argv, sys.argv[:1]
    try:
        return LightningCLI(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=args,
            run=run,
        )
    finally:
        sys.argv = saved


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in LIGHTNING_SUBCOMMANDS + ("-h", "--help"):
        argv = ["fit", *argv]
    build_cli(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
