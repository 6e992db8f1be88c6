"""Experiment tracking outside Lightning (the offloaded-eval harness): W&B, imported only when asked,
so that `inference/` and `models/` never import wandb themselves."""

from __future__ import annotations

from typing import Any


def start_wandb_run(project: str, config: dict[str, Any], job_type: str, name: str) -> Any:
    """Start a W&B run (honours ``WANDB_MODE=offline``); returns the run, whose ``log``/``finish`` the
    caller uses. A missing wandb package is a clear error."""
    try:
        import wandb
    except ImportError as e:  # pragma: no cover - wandb is a core dependency
        raise RuntimeError("--wandb needs the wandb package (pip install wandb)") from e
    return wandb.init(project=project, config=config, job_type=job_type, name=name)
