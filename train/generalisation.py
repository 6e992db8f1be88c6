"""The generalisation protocol of the forecaster (docs/design.md "Forecaster", "Generalisation protocol").

A row fits on one trace set and is evaluated on another (other benchmark, other text kind, other model
size), or on held-out sequences of the same set (in-domain): the forecaster and the fitted parts of the
baselines (frequency, transition counts, the priors of repeat-last's ties and of recent-freq) see only
the row's ``fit`` sequences; the online baselines (repeat-last, recent-freq) run on the evaluated
sequences themselves, as a serving system would. Data efficiency: the same row with 10, 50 and all
fit sequences (:func:`~expertcast.train.forecaster_data.training_subset`: nested, stable subsets).

The library behind the must-show recall rows; ``expertcast simulate`` reuses :func:`protocol_rows` and
:func:`train_row_forecaster` for the Hit rows. On the command line the same protocol is
``expertcast fit ... --data.init_args.train_sequences N`` on the fit set, then
``expertcast forecast-eval --traces EVAL`` (the baselines default to the export's training sequences).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.data.trace_split import split_by_hash
from expertcast.models.forecaster import ExpertForecaster
from expertcast.models.forecaster_recall import RecallTable, evaluate, fit_baselines
from expertcast.train.forecaster_data import training_subset
from expertcast.utils.provenance import check_overlap

DATA_SIZES: tuple[int | None, ...] = (10, 50, None)
"""Fit-set sizes of the data-efficiency rows (None: all)."""

ONLINE_BASELINES = ("repeat-last", "recent-freq", "recent-count")


@dataclass
class ProtocolRow:
    """One row: ``name`` (e.g. ``gsm8k->cot``), the fit sequences and the evaluated ones (disjoint ids)."""

    name: str
    fit: list[TraceSequence]
    evaluated: list[TraceSequence]
    n_fit: int | None
    """The requested fit size (None: all)."""

    @property
    def label(self) -> str:
        return f"{self.name} n={'all' if self.n_fit is None else self.n_fit} ({len(self.fit)} fit / " \
               f"{len(self.evaluated)} eval)"


def in_domain_split(seqs: Sequence[TraceSequence], eval_fraction: float = 0.25, seed: int = 0
                    ) -> tuple[list[TraceSequence], list[TraceSequence]]:
    """(fit, evaluated) of one trace set, split by a hash of the sequence id (stable under --limit;
    :func:`expertcast.data.trace_split.split_by_hash`)."""
    return split_by_hash(seqs, eval_fraction, seed)


def protocol_rows(name: str, fit: Sequence[TraceSequence], evaluated: Sequence[TraceSequence],
                  sizes: Sequence[int | None] = DATA_SIZES, seed: int = 0) -> list[ProtocolRow]:
    """The data-efficiency rows of one (fit set, evaluated set) pair, sizes the fit set allows (a size
    >= the fit set's is dropped; None is always kept). Raises OverlapError when the sets share an id."""
    check_overlap([s.seq_id for s in evaluated], [s.seq_id for s in fit], what=f"the fit set of {name}")
    rows = []
    for n in sizes:
        if n is not None and n >= len(fit):
            continue
        rows.append(ProtocolRow(name, training_subset(fit, n, seed), list(evaluated), n))
    return rows


def holdout_split(fit: Sequence[TraceSequence], fraction: float = 0.2, seed: int = 0
                  ) -> tuple[list[TraceSequence], list[TraceSequence]]:
    """(train, held out) of a fit set: the last max(1, round(``fraction`` · n)) sequences in
    :func:`training_subset` order are held out (none when n < 2 or ``fraction`` is 0)."""
    order = training_subset(fit, None, seed)
    k = 0 if len(order) < 2 or fraction <= 0 else min(len(order) - 1, max(1, round(fraction * len(order))))
    return order[: len(order) - k], order[len(order) - k:]


def train_row_forecaster(meta: TraceMeta, row: ProtocolRow, *, max_steps: int, seed: int = 0,
                         holdout: float = 0.2, **module_kwargs: Any) -> ExpertForecaster:
    """A forecaster trained on ``row.fit`` only, ``max_steps`` optimizer steps whatever the fit size.

    ``holdout`` of the fit sequences (at least one when there are two or more; :func:`holdout_split`) are kept
    out of training: the probability temperature and the residual scale (the per-horizon factor on the learned
    logits, docs/design.md "Online statistics") are fitted on them, so a learned part that only fits its
    training sequences gives way to the online prior. 0: train on every fit sequence (temperature fitted on
    them, residual scale left at 1). ``module_kwargs`` go to
    :class:`~expertcast.train.forecaster_module.ForecasterModule` (and ``window``/``batch_size``/
    ``trigger_layer`` to the data module)."""
    from expertcast.train.forecaster_module import fit_forecaster

    train, held = holdout_split(row.fit, holdout, seed)
    module, _ = fit_forecaster(meta, train, val_fraction=0.0, seed=seed, max_steps=max_steps,
                               val_sequences=held or None, **module_kwargs)
    return module.net


def recall_row(model: ExpertForecaster | None, meta: TraceMeta, row: ProtocolRow, horizons: int = 8,
               trigger_layer: int | None = None, batch_size: int = 32) -> dict[str, RecallTable]:
    """Recall tables of the forecaster (when given) and the four baselines on ``row.evaluated``; the
    baselines' fitted parts come from ``row.fit``."""
    p = model.config.p if model is not None else (meta.num_layers - 1 if trigger_layer is None else trigger_layer)
    return evaluate(model, row.evaluated, meta, fit_baselines(row.fit, meta, p), horizons=horizons,
                    batch_size=batch_size, trigger_layer=p, progress=False)


def margin_over_online(tables: dict[str, RecallTable], who: str = "forecaster",
                       baselines: tuple[str, ...] = ONLINE_BASELINES) -> np.ndarray:
    """[H] recall@K of ``who`` minus the best of ``baselines`` (default: every online baseline) at each horizon
    (the goal: >= -0.005)."""
    best = np.max([tables[b].recall("k") for b in baselines if b in tables], axis=0)
    return tables[who].recall("k") - best
