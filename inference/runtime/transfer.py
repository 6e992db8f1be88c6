"""Host-to-device expert transfers.

Two engines with one interface (:class:`TransferEngine`): ``submit`` starts copying a packed host row
into a device slot and returns a :class:`Transfer`; ``wait`` makes the compute path wait for it;
``done`` polls without blocking.

- :class:`CudaTransferEngine`: copies on a side CUDA stream from pinned memory; the compute stream
  waits on the copy's event (so prefetches overlap compute and a demand load blocks only the layer
  that needs it); before overwriting a slot the side stream waits on the compute stream's last event,
  so that a kernel still reading the slot's previous expert is never raced.
- :class:`ThreadTransferEngine` (CPU): one transfer thread that really copies the bytes; with
  ``bandwidth_gbps`` it also holds each transfer until ``bytes / bandwidth`` has passed on a serial
  link, which emulates a host-device link on a CPU-only machine.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Transfer:
    """One copy of ``nbytes`` into ``slot``; ``key`` is the (layer, expert) being moved."""

    key: tuple[int, int]
    slot: int
    nbytes: int
    submitted: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    event: object | None = None
    """threading.Event (CPU) or torch.cuda.Event (CUDA)."""
    demand: bool = False
    """Submitted as (or promoted to) a demand load."""
    started: float | None = None
    """When a reader began the read (:class:`~.disk_store.ReaderPoolEngine`)."""
    prev: Transfer | None = None
    """An unfinished earlier transfer into the same slot that this one waits for."""
    after_compute: object | None = None
    """CUDA: the compute event the copy waits for (the slot's previous expert may still be in use)."""
    cuda_event: object | None = None
    sink: object | None = None
    """Counters whose ``read_seconds`` the read's duration is added to (counted decode loads)."""


class TransferEngine:
    """Interface shared by the CPU and CUDA engines."""

    bytes_moved: int = 0
    transfers: int = 0
    sink: object | None = None
    """Counters given to the transfers submitted while set (their read time is added to ``read_seconds``)."""

    def submit(self, key: tuple[int, int], src: torch.Tensor, dst: torch.Tensor, slot: int,
               demand: bool = False) -> Transfer:
        """Start copying ``src`` into ``dst``; ``demand`` transfers go ahead of queued prefetches."""
        raise NotImplementedError

    def promote(self, tr: Transfer) -> None:
        """A queued prefetch is needed now (late prefetch): move it ahead of the other queued ones."""

    def done(self, tr: Transfer) -> bool:
        raise NotImplementedError

    def wait(self, tr: Transfer) -> float:
        """Make the compute path wait for ``tr``; returns the host seconds spent blocked."""
        raise NotImplementedError

    def wait_any(self, trs: list[Transfer]) -> float:
        """Block until at least one of ``trs`` is done (the compute then takes the first that landed);
        returns the host seconds spent blocked. This default polls :meth:`done`."""
        if any(self.done(tr) for tr in trs):
            return 0.0
        t0 = time.perf_counter()
        while not any(self.done(tr) for tr in trs):
            time.sleep(1e-4)
        return time.perf_counter() - t0

    def mark_compute(self) -> None:
        """Called after a layer's expert kernels were issued (orders later slot overwrites)."""

    def synchronize(self) -> None:
        """Wait for every submitted transfer."""

    def close(self) -> None:
        """Stop background resources."""


class WorkerWaits:
    """``done``/``wait`` of an engine whose worker threads set each transfer's ``event`` and park the first
    error in ``self._error`` (raised, once, by the next wait): the thread engine and the disk reader pool."""

    _error: BaseException | None = None
    failure = "expert transfer failed"
    timeline: list | None = None
    """When a list: each wait that blocked is appended as ``("wait", key, t0, t1)`` and (the disk reader pool) each
    finished read as ``("read", key, demand, submitted, started, finished)`` (perf_counter seconds; the disk
    benchmark's ``--trace-timeline``)."""

    def done(self, tr: Transfer) -> bool:
        return tr.event.is_set()

    def wait(self, tr: Transfer) -> float:
        if tr.event.is_set():
            self._raise_pending()
            return 0.0
        t0 = time.perf_counter()
        tr.event.wait()
        self._raise_pending()
        t1 = time.perf_counter()
        if self.timeline is not None:
            self.timeline.append(("wait", tr.key, t0, t1))
        return t1 - t0

    def wait_any(self, trs: list[Transfer]) -> float:
        """Block on the engine's condition (its workers notify it after setting each transfer's event)
        until one of ``trs`` is done."""
        if any(tr.event.is_set() for tr in trs):
            self._raise_pending()
            return 0.0
        t0 = time.perf_counter()
        with self._cv:
            while not any(tr.event.is_set() for tr in trs):
                self._cv.wait()
        self._raise_pending()
        t1 = time.perf_counter()
        if self.timeline is not None:
            self.timeline.append(("wait", None, t0, t1))
        return t1 - t0

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"{self.failure}: {err}") from err


class ThreadTransferEngine(WorkerWaits, TransferEngine):
    """CPU engine: a background thread copies rows into slots, optionally throttled to a bandwidth.

    Args:
        bandwidth_gbps: emulated link bandwidth in GB/s (1e9 bytes/s); None copies at memory speed.
        latency_s: fixed per-transfer latency added on the emulated link.
    """

    def __init__(self, bandwidth_gbps: float | None = None, latency_s: float = 0.0):
        if bandwidth_gbps is not None and bandwidth_gbps <= 0:
            raise ValueError(f"bandwidth_gbps must be positive, got {bandwidth_gbps}")
        self.bandwidth = None if bandwidth_gbps is None else bandwidth_gbps * 1e9
        self.latency_s = float(latency_s)
        self.bytes_moved = 0
        self.transfers = 0
        self._queue: collections.deque[tuple[Transfer, torch.Tensor, torch.Tensor]] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._link_free_at = 0.0
        self._busy = False
        self._demand_queued = 0
        """Leading entries of the queue that are demand loads."""
        self._thread = threading.Thread(target=self._run, name="expertcast-transfer", daemon=True)
        self._thread.start()

    def submit(self, key, src, dst, slot, demand: bool = False) -> Transfer:
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        tr = Transfer(key=key, slot=slot, nbytes=src.numel() * src.element_size(), event=threading.Event(),
                      demand=demand, sink=self.sink)
        with self._cv:
            if demand:  # after the transfer on the wire and earlier demands, ahead of queued prefetches
                self._queue.insert(self._demand_queued, (tr, src, dst))
                self._demand_queued += 1
            else:
                self._queue.append((tr, src, dst))
            self._cv.notify_all()
        self.transfers += 1
        self.bytes_moved += tr.nbytes
        return tr

    def _run(self) -> None:
        torch.set_num_threads(1)
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed and not self._queue:
                    return
                tr, src, dst = self._queue.popleft()
                self._demand_queued = max(self._demand_queued - 1, 0)
                self._busy = True
            tr.started = time.perf_counter()
            try:
                start = max(tr.started, self._link_free_at)
                with torch.no_grad():
                    dst.copy_(src)
                if self.bandwidth is not None:
                    end = start + self.latency_s + tr.nbytes / self.bandwidth
                    self._link_free_at = end
                    delay = end - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
            except BaseException as e:  # surfaced to the compute thread in wait()
                self._error = e
            tr.finished = time.perf_counter()
            if tr.sink is not None:
                with self._cv:
                    tr.sink.read_seconds += tr.finished - tr.started
            tr.event.set()
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def promote(self, tr: Transfer) -> None:
        with self._cv:
            for i, item in enumerate(self._queue):
                if item[0] is tr:
                    if i >= self._demand_queued:
                        del self._queue[i]
                        self._queue.insert(self._demand_queued, item)
                        self._demand_queued += 1
                    return


    def synchronize(self) -> None:
        with self._cv:
            while self._queue or self._busy:
                self._cv.wait()
        self._raise_pending()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)


class CudaTransferEngine(TransferEngine):
    """CUDA engine: asynchronous copies from pinned host rows on a side stream, ordered by events."""

    def __init__(self, device: torch.device):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaTransferEngine needs CUDA")
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.demand_stream = torch.cuda.Stream(device=self.device, priority=-1)
        """Demand loads: a high-priority stream, so they are scheduled ahead of queued prefetches."""
        self.bytes_moved = 0
        self.transfers = 0
        self._compute_event: torch.cuda.Event | None = None

    def submit(self, key, src, dst, slot, demand: bool = False) -> Transfer:
        ev = torch.cuda.Event()
        tr = Transfer(key=key, slot=slot, nbytes=src.numel() * src.element_size(), event=ev)
        stream = self.demand_stream if demand else self.stream
        with torch.cuda.stream(stream):
            if self._compute_event is not None:
                # the slot's previous expert may still be read by queued kernels
                stream.wait_event(self._compute_event)
            dst.copy_(src, non_blocking=True)
            ev.record(stream)
        self.transfers += 1
        self.bytes_moved += tr.nbytes
        return tr

    def done(self, tr: Transfer) -> bool:
        return tr.event.query()

    def wait(self, tr: Transfer) -> float:
        # Device-side ordering: the compute stream waits for the copy. The host blocks too when the copy
        # is still running, which measures the stall (the runtime syncs on routing every layer anyway).
        torch.cuda.current_stream(self.device).wait_event(tr.event)
        if tr.event.query():
            return 0.0
        t0 = time.perf_counter()
        tr.event.synchronize()
        return time.perf_counter() - t0

    def mark_compute(self) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._compute_event = ev

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.demand_stream.synchronize()


def make_transfer_engine(device: torch.device, bandwidth_gbps: float | None = None) -> TransferEngine:
    """CUDA engine on a CUDA device, else the CPU thread engine (optionally throttled)."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTransferEngine(device)
    return ThreadTransferEngine(bandwidth_gbps=bandwidth_gbps)
