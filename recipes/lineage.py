"""A command's results in a W&B run of its own, with the inputs it consumed (lineage).

* :func:`log_results` logs one command's inputs, tables, plots, series and exports in a run of its own (simulate,
  forecast-eval, stages eval, ...), through the W&B primitives of :mod:`expertcast.utils.tracking`.

The inputs are declared by :mod:`expertcast.data.lineage` (a trace set's digest is read with the data room's trace
reader).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from expertcast.data.lineage import use_inputs
from expertcast.utils.tracking import (
    log_export,
    log_image,
    log_series,
    log_table,
    start_wandb_run,
)


def log_results(project: str, job_type: str, name: str, config: Mapping[str, Any],
                tables: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
                images: Mapping[str, str | Path] | None = None,
                exports: Iterable[tuple[str | Path, str]] = (),
                inputs: Iterable[tuple[str | Path, str, str | None]] = (),
                series: Iterable[tuple[Sequence[Mapping[str, Any]], str, str | Sequence[str] | None,
                                       Sequence[str] | None]] = ()) -> str:
    """One W&B run for one command's results: ``inputs`` ((path, kind, digest) consumed, :func:`use_inputs`),
    ``tables`` (key -> rows), ``images`` (key -> PNG path), ``exports`` ((folder, kind) pairs), ``series``
    ((rows, axis, group, metrics) of :func:`log_series`). Returns the run's local directory."""
    run = start_wandb_run(project, dict(config), job_type=job_type, name=name)
    try:
        use_inputs(run, inputs)
        for rows, axis, group, metrics in series:
            log_series(run, axis, rows, group, metrics)
        for key, rows in (tables or {}).items():
            log_table(run, key, rows)
        for key, path in (images or {}).items():
            log_image(run, key, path)
        for folder, kind in exports:
            log_export(run, folder, kind)
        return str(Path(run.dir).parent)
    finally:
        run.finish()
