"""Windows over routing-trace datasets for forecaster training (SeqMoE 5.4; docs/design.md "Forecaster").

Sequences are assigned to train / val / test by a hash of their id (never by token;
:func:`expertcast.utils.provenance.split_of`), so the same sequence lands in the same split whatever
the order or subset of sequences loaded, and ``expertcast forecast-eval`` can pick exactly the
held-out ones again; the export also lists the training and validation ids
(:meth:`ForecasterDataModule.training_info`).

The training loader shuffles with a permutation fixed by (seed, epoch) alone
(:class:`EpochShuffleSampler`), and the data module records in each checkpoint how far into the
epoch training got: a fit resumed from a mid-epoch checkpoint sees exactly the batches the
interrupted run would have seen next (single device; see docs/design.md, "Fit runs").

Each window holds W+1 consecutive forecaster elements (see
:func:`~expertcast.models.forecaster.trigger_sequence`): inputs are elements [i, i+W), targets
elements [i+1, i+W]. Dense activation vectors are built per window from the compact trace arrays, so
memory stays O(T·L·K) per sequence.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as pl
import numpy as np
import torch
from expertcast.data.trace_format import TraceMeta, TraceSequence, sequences_fingerprint
from expertcast.models.forecaster import activation_vector, trigger_offset, trigger_sequence
from expertcast.utils.provenance import split_of
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


def split_sequences(seqs: Sequence[TraceSequence], seed: int = 0, val_fraction: float = 0.1,
                    test_fraction: float = 0.0) -> dict[str, list[TraceSequence]]:
    """Group sequences by :func:`expertcast.utils.provenance.split_of` of their id."""
    if not 0 <= val_fraction < 1 or not 0 <= test_fraction < 1 or val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction={val_fraction} and test_fraction={test_fraction} must leave a training split")
    out: dict[str, list[TraceSequence]] = {s: [] for s in SPLITS}
    for s in seqs:
        out[split_of(s.seq_id, val_fraction, test_fraction, seed=seed)].append(s)
    return out


def training_subset(seqs: Sequence[TraceSequence], n: int | None, seed: int = 0) -> list[TraceSequence]:
    """The first ``n`` sequences in the order of sha256(seed, sequence id) (all for None).

    The order depends on the ids alone, so the subsets are nested (10 ⊂ 50 ⊂ all) and do not move with
    load order: the data-efficiency rows of the generalisation protocol (docs/design.md "Forecaster")."""
    if n is not None and n < 1:
        raise ValueError(f"a training subset needs n >= 1, got {n}")
    order = sorted(seqs, key=lambda s: hashlib.sha256(f"{seed}:{s.seq_id}".encode()).hexdigest())
    return order if n is None else order[:n]


def load_trace_dirs(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[TraceMeta, list[TraceSequence]]:
    """Load one or several trace directories (same model) through :func:`expertcast.data.traces.load_traces`."""
    from expertcast.data.traces import load_traces

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError("no trace directory given")
    meta: TraceMeta | None = None
    seqs: list[TraceSequence] = []
    for p in paths:
        if not Path(p).exists():
            raise FileNotFoundError(f"trace directory {p} does not exist (collect traces with `expertcast collect`)")
        m, s = load_traces(p)
        if meta is None:
            meta = m
        else:
            m.check_compatible(meta.num_layers, meta.num_experts, meta.top_k, what=f"trace set {paths[0]}")
            meta.has_router_probs = meta.has_router_probs and m.has_router_probs
        seqs += [_prefixed(x, str(p)) if len(paths) > 1 else x for x in s]
    assert meta is not None
    return meta, seqs


def _prefixed(s: TraceSequence, prefix: str) -> TraceSequence:
    s.seq_id = f"{Path(prefix).name}/{s.seq_id}"
    return s


def check_sequences(meta: TraceMeta, seqs: Sequence[TraceSequence]) -> None:
    """Raise ValueError when a sequence's L/K or expert ids do not fit ``meta``."""
    for s in seqs:
        _, L, K = s.expert_ids.shape
        if (L, K) != (meta.num_layers, meta.top_k):
            raise ValueError(f"sequence {s.seq_id} has L={L}, K={K} but the trace metadata says "
                             f"L={meta.num_layers}, K={meta.top_k}")
        if s.expert_ids.size and (int(s.expert_ids.min()) < 0 or int(s.expert_ids.max()) >= meta.num_experts):
            raise ValueError(f"sequence {s.seq_id} has expert ids outside [0, {meta.num_experts})")
        if s.router_probs is not None and s.router_probs.shape[-1] != meta.num_experts:
            raise ValueError(f"sequence {s.seq_id}: router_probs has {s.router_probs.shape[-1]} experts, "
                             f"metadata says E={meta.num_experts}")


@dataclass
class _Window:
    seq: int
    start: int
    """First input element index."""
    n: int
    """Number of valid targets (<= W)."""


class ForecastWindows(Dataset):
    """Fixed-length windows of forecaster elements over a list of sequences.

    Item (W = window): ``inputs`` float [W, L, E]; ``target_ids`` long [W, L, K] (experts of the target
    elements); ``target_dist`` float [W, L, E] (KL target: router_probs when every sequence has them,
    else the normalized top-K weights); ``mask`` bool [W] (valid targets); ``decode`` bool [W] (target
    is a decode element).
    """

    def __init__(self, seqs: Sequence[TraceSequence], meta: TraceMeta, window: int, trigger_layer: int | None = None,
                 stride: int | None = None, use_router_probs: bool = True):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.seqs = list(seqs)
        self.meta = meta
        self.E = meta.num_experts
        self.L = meta.num_layers
        self.p = self.L - 1 if trigger_layer is None else trigger_layer
        self.s = trigger_offset(self.L, self.p)
        self.window = window
        self.stride = stride or window
        self.use_probs = use_router_probs and bool(self.seqs) and all(x.router_probs is not None for x in self.seqs)
        self.index: list[_Window] = []
        for i, sq in enumerate(self.seqs):
            n_el = sq.num_tokens - self.s
            for start in range(0, max(n_el - 1, 0), self.stride):
                self.index.append(_Window(i, start, min(window, n_el - 1 - start)))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        w = self.index[idx]
        sq = self.seqs[w.seq]
        n_el = w.n + 1
        lo, hi = w.start, w.start + n_el + self.s  # steps covering elements [start, start + n_el)
        ids = torch.from_numpy(np.asarray(sq.expert_ids[lo:hi], dtype=np.int64))
        wts = torch.from_numpy(np.asarray(sq.expert_weights[lo:hi], dtype=np.float32))
        el = trigger_sequence(activation_vector(ids, wts, self.E), self.p)  # [n_el, L, E]
        el_ids = trigger_sequence(ids, self.p)
        W = self.window
        inputs = torch.zeros(W, self.L, self.E)
        inputs[: w.n] = el[:-1]
        target_ids = torch.zeros(W, self.L, self.meta.top_k, dtype=torch.long)
        target_ids[: w.n] = el_ids[1:]
        target_dist = torch.zeros(W, self.L, self.E)
        if self.use_probs:
            rp = torch.from_numpy(np.asarray(sq.router_probs[lo:hi], dtype=np.float32))
            rp = trigger_sequence(rp, self.p)[1:]
            target_dist[: w.n] = rp / rp.sum(-1, keepdim=True).clamp_min(1e-9)
        else:
            target_dist[: w.n] = el[1:]
        mask = torch.zeros(W, dtype=torch.bool)
        mask[: w.n] = True
        decode = torch.zeros(W, dtype=torch.bool)
        tgt_el = torch.arange(w.start + 1, w.start + 1 + w.n)
        decode[: w.n] = tgt_el >= sq.prompt_len
        return {"inputs": inputs, "target_ids": target_ids, "target_dist": target_dist, "mask": mask,
                "decode": decode}


def whole_sequence_batches(seqs: Sequence[TraceSequence], meta: TraceMeta, trigger_layer: int | None,
                           row_floats: int, budget: int, by_length: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of whole sequences, each one window of :class:`ForecastWindows` run from a zero state, padded only to
    the longest sequence of its own batch: scoring them all costs about one pass over their elements, where one
    window of the longest sequence for every sequence costs (longest / mean length) passes.

    A batch holds at most ``budget`` floats of ``row_floats`` per padded element (at least one sequence), and
    sequences whose lengths differ by at most 2x (so that padding at most doubles the elements a batch runs).
    ``by_length``: batches of sequences of similar length (shortest first); False: consecutive sequences in the given
    order, so that the elements come out in that order. Sequences without a target are left out."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_tokens) if by_length else list(range(len(seqs)))
    group: list[int] = []
    longest, shortest = 0, 0

    def batch() -> dict[str, torch.Tensor] | None:
        ds = ForecastWindows([seqs[i] for i in group], meta, window=max(1, longest), trigger_layer=trigger_layer)
        items = [ds[k] for k in range(len(ds))]
        return {k: torch.stack([it[k] for it in items]) for k in items[0]} if items else None

    for i in order:
        n = int(seqs[i].num_tokens)
        if group and ((len(group) + 1) * max(longest, n) * row_floats > budget
                      or max(longest, n) > 2 * min(shortest, n)):
            if (out := batch()) is not None:
                yield out
            group, longest = [], 0
        shortest = min(shortest, n) if group else n
        group.append(i)
        longest = max(longest, n)
    if group and (out := batch()) is not None:
        yield out


class EpochShuffleSampler(Sampler[int]):
    """A permutation of ``range(n)`` per epoch, fixed by ``(seed, epoch)`` alone (no global RNG).

    Lightning calls :meth:`set_epoch` before each epoch. :meth:`resume_at` makes the next pass over a
    given epoch start after its first ``skip`` samples: a fit resumed mid-epoch trains on exactly the
    samples the interrupted run had not reached yet, in the same order.
    """

    def __init__(self, n: int, seed: int = 0):
        self.n = int(n)
        self.seed = int(seed)
        self.epoch = 0
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def resume_at(self, epoch: int, skip: int) -> None:
        """Skip the first ``skip`` samples of the next pass, when that pass is over ``epoch``."""
        self._resume = (int(epoch), int(skip))

    def permutation(self, epoch: int) -> list[int]:
        """The sample order of ``epoch``."""
        key = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "big") >> 1)
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        skip = self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0
        self._resume = None
        return iter(self.permutation(self.epoch)[skip:])

    def __len__(self) -> int:
        return self.n


class EpochShardSampler(DistributedSampler):
    """:class:`EpochShuffleSampler`'s order split over data-parallel ranks: rank r takes positions
    r, r+W, r+2W, ... of the epoch permutation (padded at the end by wrapping around, as DistributedSampler
    does), so with a per-rank batch of B/W the W ranks' step k covers exactly the permutation's B samples
    that a 1-process run with batch B trains on at step k. Lightning keeps a DistributedSampler as given
    (instead of re-shuffling the order with its own DistributedSamplerWrapper)."""

    def __init__(self, order: EpochShuffleSampler, num_replicas: int, rank: int):
        super().__init__(range(order.n), num_replicas=num_replicas, rank=rank, shuffle=False)
        self.order = order

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.order.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order = list(self.order)
        order += order[: (-len(order)) % self.num_replicas]
        return iter(order[self.rank :: self.num_replicas])


class ForecasterDataModule(pl.LightningDataModule):
    """Routing traces -> train/val/test windows, split by sequence.

    Args:
        traces: trace directory (or list of directories of the same model) written by ``expertcast collect``.
        window: W, forecaster elements per training window.
        stride: step between window starts (default W: non-overlapping).
        batch_size: windows per batch.
        val_fraction / test_fraction: share of sequences held out (hash of seq id and ``split_seed``).
        split_seed: seed of the sequence split.
        trigger_layer: p (None: L-1). The model reads it from here.
        use_router_probs: KL targets from router_probs when the traces hold them.
        max_sequences: keep only the first N sequences (quick runs).
        train_sequences: train on N of the training split (:func:`training_subset`; data efficiency); the
            validation split is unchanged and the export lists exactly the N training ids.
        num_workers: DataLoader workers.

    Checkpoints store the training loader's position (:meth:`state_dict`), so a resumed fit continues
    the interrupted epoch where it stopped instead of starting it over.
    """

    def __init__(self, traces: str | list[str] | None = None, window: int = 128, stride: int | None = None,
                 batch_size: int = 16, val_fraction: float = 0.1, test_fraction: float = 0.0, split_seed: int = 0,
                 trigger_layer: int | None = None, use_router_probs: bool = True, max_sequences: int | None = None,
                 num_workers: int = 0, train_sequences: int | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.traces = traces
        self.window = window
        self.stride = stride
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.trigger_layer = trigger_layer
        self.use_router_probs = use_router_probs
        self.max_sequences = max_sequences
        self.num_workers = num_workers
        self.train_sequences = train_sequences
        self.meta: TraceMeta | None = None
        self.splits: dict[str, list[TraceSequence]] | None = None
        self._fingerprint: str | None = None
        self._resume_at: tuple[int, int] | None = None

    @classmethod
    def from_sequences(cls, meta: TraceMeta, seqs: Sequence[TraceSequence], **kwargs: Any) -> ForecasterDataModule:
        """A data module over in-memory sequences (synthetic traces, tests)."""
        dm = cls(traces=None, **kwargs)
        dm._set(meta, list(seqs))
        return dm

    def _set(self, meta: TraceMeta, seqs: list[TraceSequence]) -> None:
        if self.max_sequences:
            seqs = seqs[: self.max_sequences]
        if not seqs:
            raise ValueError("the trace set holds no sequences")
        check_sequences(meta, seqs)
        if self.trigger_layer is not None and not 0 <= self.trigger_layer < meta.num_layers:
            raise ValueError(f"trigger_layer {self.trigger_layer} outside [0, {meta.num_layers - 1}] for these traces")
        self.meta = meta
        self._fingerprint = sequences_fingerprint(seqs)
        self.splits = split_sequences(seqs, self.split_seed, self.val_fraction, self.test_fraction)
        if self.train_sequences is not None:
            self.splits["train"] = training_subset(self.splits["train"], self.train_sequences, self.split_seed)
        if not self.splits["train"]:
            raise ValueError(f"no training sequences left after holding out val={self.val_fraction}, "
                             f"test={self.test_fraction} of {len(seqs)}")

    def prepare(self) -> TraceMeta:
        """Load the traces (once) and return their metadata."""
        if self.meta is None:
            if self.traces is None:
                raise ValueError("ForecasterDataModule needs `traces` (a trace directory) or from_sequences()")
            meta, seqs = load_trace_dirs(self.traces)
            self._set(meta, seqs)
        assert self.meta is not None
        return self.meta

    def setup(self, stage: str | None = None) -> None:
        self.prepare()

    @property
    def split_info(self) -> dict[str, Any]:
        """What forecast-eval needs to find the held-out sequences again."""
        return {"traces": self.traces, "split_seed": self.split_seed, "val_fraction": self.val_fraction,
                "test_fraction": self.test_fraction,
                "num_sequences": {k: len(v) for k, v in (self.splits or {}).items()}}

    def data_fingerprint(self) -> str:
        """:func:`~expertcast.data.trace_format.sequences_fingerprint` of every loaded sequence (all splits)."""
        self.prepare()
        assert self._fingerprint is not None
        return self._fingerprint

    def split_ids(self) -> dict[str, list[str]]:
        """Sorted sequence ids per split (``train``, ``val``, ``test``)."""
        self.prepare()
        assert self.splits is not None
        return {k: sorted(s.seq_id for s in v) for k, v in self.splits.items()}

    def training_info(self) -> dict[str, Any]:
        """The data half of an export's ``training`` block: trace dirs, fingerprint, split method and the
        exact train / val (/ test) sequence ids."""
        ids = self.split_ids()
        traces = self.traces if isinstance(self.traces, (list, tuple)) or self.traces is None else [self.traces]
        info: dict[str, Any] = {
            "traces": [str(t) for t in traces] if traces is not None else None,
            "trace_fingerprint": self.data_fingerprint(),
            "split": {"method": "sha256(seed, sequence id)", "seed": self.split_seed,
                      "val_fraction": self.val_fraction, "test_fraction": self.test_fraction},
            "train_ids": ids["train"], "val_ids": ids["val"],
        }
        if self.test_fraction > 0:
            info["test_ids"] = ids["test"]
        return info

    # --- loader position in checkpoints ---
    def state_dict(self) -> dict[str, int]:
        """The training loader's position when a checkpoint is written mid-epoch: ``{"epoch", "batches"}``
        (batches already trained on in that epoch); empty at epoch boundaries."""
        t = self.trainer
        if t is None:
            return {}
        done = int(t.fit_loop.epoch_loop.batch_progress.current.processed)
        if not 0 < done < t.num_training_batches:
            return {}
        return {"epoch": int(t.fit_loop.epoch_progress.current.processed), "batches": done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = (int(state["epoch"]), int(state["batches"])) if state else None

    def dataset(self, split: str) -> ForecastWindows:
        self.prepare()
        assert self.splits is not None and self.meta is not None
        return ForecastWindows(self.splits[split], self.meta, self.window, self.trigger_layer, self.stride,
                               self.use_router_probs)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        ds = self.dataset(split)
        sampler = None
        if shuffle:
            sampler = EpochShuffleSampler(len(ds), self.split_seed)
            if self._resume_at is not None and (self.trainer is None or self.trainer.world_size == 1):
                epoch, batches = self._resume_at
                sampler.resume_at(epoch, batches * self.batch_size)
            self._resume_at = None
            dist_kw = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
            if dist_kw and dist_kw["num_replicas"] > 1:  # data parallel: each global batch = the 1-process batch
                sampler = EpochShardSampler(sampler, dist_kw["num_replicas"], dist_kw["rank"])
        # an explicit generator: creating the loader's iterator then draws nothing from the global RNG,
        # whose state a resumed fit restores from the checkpoint
        return DataLoader(ds, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0, drop_last=False,
                          generator=torch.Generator().manual_seed(self.split_seed))

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test" if self.test_fraction > 0 else "val", False)
