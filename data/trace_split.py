"""Fit/eval splits of a trace set (docs/design.md, "Trace importers"): by a hash of the sequence id (stable under
``--limit`` and shard order: :func:`expertcast.utils.provenance.split_of`), or by the sequences' ``source`` (prompt
set / dataset), so that fitting on some sources and evaluating on others measures a domain shift."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from expertcast.data.trace_format import TraceSequence
from expertcast.utils.errors import UsageError
from expertcast.utils.provenance import split_of


def split_by_hash(seqs: Sequence[TraceSequence], eval_fraction: float = 0.25, seed: int = 0
                  ) -> tuple[list[TraceSequence], list[TraceSequence]]:
    """(fit, eval): a sequence is evaluated when ``split_of(id, eval_fraction, seed=seed)`` is ``"val"``."""
    if not 0 <= eval_fraction < 1:
        raise UsageError(f"the eval fraction must be in [0, 1), got {eval_fraction}")
    fit, ev = [], []
    for s in seqs:
        (ev if split_of(s.seq_id, eval_fraction, seed=seed) == "val" else fit).append(s)
    return fit, ev


def split_by_source(seqs: Sequence[TraceSequence], eval_sources: Iterable[str],
                    fit_sources: Iterable[str] | None = None) -> tuple[list[TraceSequence], list[TraceSequence]]:
    """(fit, eval): the sequences whose source is in ``eval_sources`` are evaluated; the fit set is those of
    ``fit_sources`` (None: every other source). UsageError when a sequence records no source, a named source is
    absent (the present ones listed), the two lists share a source, or either side is empty."""
    ev_src = list(dict.fromkeys(eval_sources))
    present = sorted({s.source for s in seqs if s.source is not None})
    none = next((s.seq_id for s in seqs if s.source is None), None)
    if none is not None:
        raise UsageError(f"sequence {none!r} records no source: a split by source needs traces whose importer keeps "
                         f"one (e.g. the gating-jsonl dataset, a source field per request)")
    fit_src = [x for x in present if x not in ev_src] if fit_sources is None else list(dict.fromkeys(fit_sources))
    unknown = [x for x in [*ev_src, *fit_src] if x not in present]
    if unknown:
        raise UsageError(f"source(s) {', '.join(unknown)} not in the traces (their sources: {', '.join(present)})")
    both = sorted(set(ev_src) & set(fit_src))
    if both:
        raise UsageError(f"source(s) {', '.join(both)} named for both fit and eval")
    fit = [s for s in seqs if s.source in fit_src]
    ev = [s for s in seqs if s.source in ev_src]
    if not fit or not ev:
        raise UsageError(f"a split by source needs sequences on both sides (fit sources {fit_src or 'none'}, eval "
                         f"sources {ev_src or 'none'})")
    return fit, ev
