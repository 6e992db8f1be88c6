"""Disk expert store: the packed expert rows in one file, read with direct I/O (docs/design.md, "Disk tier").

The file is a safetensors file (self-describing: any safetensors reader opens it) holding one tensor
``rows`` [L, E, S] of the experts' dtype, where ``S * itemsize`` (the *row stride*) is the packed row's
``expert_bytes`` rounded up to :data:`ALIGN` (4096) bytes and the header is padded with spaces so that the
data starts on a multiple of :data:`ALIGN`: every expert's bytes then begin on a 4096-byte boundary of the
file and span whole 4096-byte blocks, which is what ``O_DIRECT`` needs. The metadata names the format
(``expertcast-disk-store``), its version, the packing (:class:`~.store.ExpertLayout`), the MoE layer
names, the stride and the alignment.

Reads bypass the page cache so that the OS cannot turn free RAM into a hidden second expert cache:
``O_DIRECT`` into 4096-aligned buffers (mode ``direct``), or, where the file system refuses ``O_DIRECT``
(tmpfs), plain ``preadv`` followed by ``posix_fadvise(DONTNEED)`` of the range read (mode
``buffered+dontneed``); :attr:`DiskExpertStore.io_mode` records which one ran.

:class:`ReaderPoolEngine` is the :class:`~.transfer.TransferEngine` that moves experts from the file into
slots: N reader threads (``os.preadv`` releases the GIL, so reads overlap the compute thread), demand
reads ahead of queued prefetches (a late prefetch is promoted), reads into one slot kept in submission
order. On the CPU the slots are the device: a read lands straight in the slot's memory when the slot pool
is laid out with the store's stride and alignment (:class:`~.slots.SlotPool` ``io_stride_bytes``), else
through an aligned bounce buffer; on CUDA each reader reads into its pinned bounce buffer, then copies it
to the device slot on its own stream (after the compute that last read the slot).
"""

from __future__ import annotations

import collections
import errno
import json
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from expertcast.inference.runtime.store import (
    _DTYPES_FROM_ST,
    _SAFETENSORS_DTYPES,
    ExpertLayout,
    _read_safetensors_header,
    check_readable,
    restore_rows,
)
from expertcast.inference.runtime.transfer import Transfer, TransferEngine, WorkerWaits
from expertcast.utils.errors import UsageError

READERS = 4
"""The reader pool's threads by default (:class:`ReaderPoolEngine`; every entry point's default)."""
PREFETCH_CHUNK_KB = 2048
"""The reader pool's block size in KiB of a prefetch read that yields to demand reads, by default
(:class:`ReaderPoolEngine`; every entry point's default; docs/design.md, "Disk tier")."""

DISK_FORMAT = "expertcast-disk-store"
DISK_FORMAT_VERSION = 1
ALIGN = 4096
"""Alignment of every expert row in the file and of the read buffers (bytes)."""
IO_MODES = ("auto", "direct", "buffered")
DIRECT, BUFFERED = "direct", "buffered+dontneed"


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def aligned_empty(nbytes: int, align: int = ALIGN, pin_memory: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose first byte is ``align``-aligned (a view into a larger one)."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin_memory)
    off = (-raw.data_ptr()) % align
    return raw[off:off + nbytes]


@dataclass(frozen=True)
class DiskRow:
    """Where one expert's bytes are in the store file: ``nbytes`` of data at ``offset`` (``span`` bytes read)."""

    key: tuple[int, int]
    offset: int
    nbytes: int
    span: int
    """Bytes read (``nbytes`` rounded up to :data:`ALIGN`: the row stride)."""

    def numel(self) -> int:  # TransferEngine callers size a source as numel * element_size
        return self.nbytes

    def element_size(self) -> int:
        return 1


# --------------------------------------------------------------------------------------------- writing
def write_disk_store(path: str | os.PathLike, layer_names: list[str], lay: ExpertLayout,
                     fill: Callable[[int, torch.Tensor], None]) -> Path:
    """Write a disk store file layer by layer (one layer's rows in RAM at a time), atomically.

    ``fill(i, buf)`` packs MoE layer ``i``'s experts into ``buf`` [E, row_numel] (host); e.g.
    :meth:`~expertcast.inference.runtime.loading.ExpertFiller.fill` streaming them from checkpoint shards.
    """
    path = Path(path)
    L, E, N = len(layer_names), lay.num_experts, lay.row_numel
    itemsize = torch.empty((), dtype=lay.dtype).element_size()
    stride = round_up(N * itemsize)
    total = L * E * stride
    meta = {
        "format": DISK_FORMAT,
        "format_version": str(DISK_FORMAT_VERSION),
        "layout": json.dumps(lay.to_dict()),
        "layers": json.dumps(list(layer_names)),
        "row_stride_bytes": str(stride),
        "alignment": str(ALIGN),
    }
    header = {"__metadata__": meta,
              "rows": {"dtype": _SAFETENSORS_DTYPES[lay.dtype], "shape": [L, E, stride // itemsize],
                       "data_offsets": [0, total]}}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-(8 + len(hb))) % ALIGN)  # data starts on an ALIGN boundary
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    buf = torch.empty((E, N), dtype=lay.dtype)
    pad = bytes(stride - N * itemsize)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for i in range(L):
                fill(i, buf)
                rows = buf.view(torch.uint8).numpy()
                for e in range(E):
                    f.write(rows[e].data)
                    f.write(pad)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _drop_cache(path)  # the writes' pages must not serve later reads
    return path


def write_disk_store_from(store, path: str | os.PathLike, layer_names: list[str] | None = None) -> Path:
    """Write the rows of a :class:`~.store.HostExpertStore` (in RAM or memory-mapped) to a disk store file."""
    names = layer_names or [f"layer{i}" for i in range(store.num_layers)]
    return write_disk_store(path, names, store.layout, lambda i, buf: buf.copy_(store.rows[i]))


def _drop_cache(path: Path) -> None:
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------- reading
class DiskExpertStore:
    """The experts of a disk store file, read on demand (nothing of them is held in RAM).

    Duck-types :class:`~.store.HostExpertStore` for the runtime (``layout``, ``row``, ``views``, ...); ``row``
    gives a :class:`DiskRow` that :class:`ReaderPoolEngine` reads.

    Args:
        io: ``auto`` (``O_DIRECT`` where the file system accepts it, else buffered + DONTNEED),
            ``direct`` (refuse to run without it) or ``buffered``.
    """

    is_pinned = False
    mmap_path = None

    def __init__(self, path: str | os.PathLike, io: str = "auto"):
        if io not in IO_MODES:
            raise UsageError(f"disk store I/O mode must be one of {IO_MODES}, got {io!r}")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"disk expert store {self.path} does not exist")
        header, data_start = _read_safetensors_header(self.path)
        meta = header.get("__metadata__", {})
        if meta.get("format") != DISK_FORMAT:
            raise UsageError(f"{self.path} is not an expertcast disk store (metadata format={meta.get('format')!r})")
        if int(meta.get("format_version", -1)) != DISK_FORMAT_VERSION:
            raise UsageError(f"{self.path}: disk store format version {meta.get('format_version')} is not supported "
                             f"(expected {DISK_FORMAT_VERSION})")
        self.layout = check_readable(ExpertLayout.from_dict(json.loads(meta["layout"])), self.path)
        self.layer_names: list[str] = json.loads(meta["layers"])
        self.stride = int(meta["row_stride_bytes"])
        info = header["rows"]
        L, E, S = info["shape"]
        itemsize = torch.empty((), dtype=_DTYPES_FROM_ST[info["dtype"]]).element_size()
        begin, end = info["data_offsets"]
        self.data_start = data_start + begin
        if self.data_start % ALIGN or self.stride % ALIGN or S * itemsize != self.stride:
            raise UsageError(f"{self.path}: rows are not {ALIGN}-aligned (data at {self.data_start}, stride {self.stride})")
        if E != self.layout.num_experts or end - begin != L * E * self.stride:
            raise UsageError(f"{self.path}: rows tensor {info['shape']} does not match its layout")
        if os.path.getsize(self.path) < self.data_start + L * E * self.stride:
            raise UsageError(f"{self.path}: truncated disk store")
        self._L, self._E = int(L), int(E)
        self.io_mode = self._open(io)

    def _open(self, io: str) -> str:
        if io != "buffered" and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if io == "direct":
                    raise UsageError(f"{self.path}: O_DIRECT refused by the file system ({e})") from None
            else:
                probe = aligned_empty(ALIGN)
                try:
                    os.preadv(fd, [probe.numpy()], self.data_start)
                except OSError as e:
                    os.close(fd)
                    if io == "direct" or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise UsageError(f"{self.path}: O_DIRECT read refused ({e})") from None
                else:
                    self.fd = fd
                    return DIRECT
        elif io == "direct":
            raise UsageError("O_DIRECT is not available on this platform")
        self.fd = os.open(self.path, os.O_RDONLY)
        return BUFFERED

    # -- HostExpertStore's interface ---------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self._L

    @property
    def num_experts(self) -> int:
        return self._E

    @property
    def expert_bytes(self) -> int:
        return self.layout.expert_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the packed experts on disk (padded rows)."""
        return self._L * self._E * self.stride

    host_resident_bytes = 0
    """Expert bytes this store keeps in host RAM (none)."""

    def row(self, layer: int, expert: int) -> DiskRow:
        if not (0 <= layer < self._L and 0 <= expert < self._E):
            raise IndexError(f"expert ({layer}, {expert}) outside L={self._L}, E={self._E}")
        return DiskRow((layer, expert), self.data_start + (layer * self._E + expert) * self.stride,
                       self.layout.expert_bytes, self.stride)

    def read_into(self, row: DiskRow, buf: torch.Tensor, chunk: int = 0, between: Callable[[], None] | None = None) -> int:
        """Read ``row``'s ``span`` bytes into the aligned uint8 CPU tensor ``buf`` (>= span bytes); returns
        the bytes read. The GIL is released during the read. ``chunk`` > 0 (a multiple of :data:`ALIGN`) reads
        in blocks of that many bytes and calls ``between()`` after every block but the last (where a
        prefetch read yields the disk to demand reads: :class:`ReaderPoolEngine`)."""
        mv = buf[:row.span].numpy()
        got = 0
        while got < row.span:
            end = min(row.span, got + chunk) if chunk else row.span
            n = self._pread(mv[got:end], row.offset + got)
            if n <= 0:
                raise OSError(f"{self.path}: short read of expert {row.key} ({got} of {row.span} bytes)")
            got += n
            if between is not None and got < row.span:
                between()
        if self.io_mode == BUFFERED:
            os.posix_fadvise(self.fd, row.offset, row.span, os.POSIX_FADV_DONTNEED)
        return got

    def _pread(self, mv, offset: int) -> int:
        """One ``preadv`` (the hook a test slows down)."""
        return os.preadv(self.fd, [mv], offset)

    def read_row(self, layer: int, expert: int) -> torch.Tensor:
        """One expert's packed row [row_numel] read now into a fresh tensor (CPU execution, restore)."""
        r = self.row(layer, expert)
        buf = aligned_empty(r.span)
        self.read_into(r, buf)
        return buf[:r.nbytes].view(self.layout.dtype).clone()

    def views(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Named weight views of one expert, read from the file now (a fresh copy)."""
        return self.layout.views(self.read_row(layer, expert))

    def restore_into(self, refs) -> None:
        """Put the fused weights back into the modules (reads every expert: the whole model in RAM; a quantized
        store gives back its dequantized weights)."""
        restore_rows(self.layout, refs, self.read_row)

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# --------------------------------------------------------------------------------------------- reader pool
class ReaderPoolEngine(WorkerWaits, TransferEngine):
    """Reads expert rows from a :class:`DiskExpertStore` into slots with ``readers`` threads.

    Queue: demand reads first (in submission order), then prefetches; :meth:`promote` moves a queued
    prefetch to the demand queue (a late prefetch). A read into a slot that still has an unfinished read
    waits for it (enqueued when it finishes; a demand inherits its predecessor's promotion), so two reads
    never race on one slot. ``busy_seconds`` is the time at least one read was in progress.

    Prefetch reads yield the disk to demand reads (``prefetch_chunk_kb`` > 0, the default; docs/design.md,
    "Disk tier"): no prefetch read starts while a demand read is queued or in flight, and a prefetch read in
    progress reads in blocks of ``prefetch_chunk_kb`` KiB; between two blocks its reader serves the queued
    demand reads itself, or, while other readers' demand reads are in flight, waits for them. A demand read
    then waits for at most the remainder of one block per reader instead of sharing the disk with up to
    ``readers`` whole prefetch reads (the serial demand-first link that the simulator charges). A prefetch
    promoted while it waits reads on. ``prefetch_chunk_kb=0``: whole reads, no yielding (the A/B baseline).
    """

    failure = "expert read failed"

    def __init__(self, store: DiskExpertStore, readers: int = READERS, device: torch.device | str = "cpu",
                 prefetch_chunk_kb: int = PREFETCH_CHUNK_KB):
        if readers < 1:
            raise UsageError(f"the reader pool needs at least one reader, got {readers}")
        if prefetch_chunk_kb < 0:
            raise UsageError(f"prefetch_chunk_kb must be >= 0 (0: prefetch reads do not yield), got {prefetch_chunk_kb}")
        self.store = store
        self.readers = int(readers)
        self.device = torch.device(device)
        self.chunk = round_up(int(prefetch_chunk_kb) * 1024) if prefetch_chunk_kb else 0
        """Block size (bytes) of a prefetch read that yields to demand reads; 0: prefetch reads do not yield."""
        self.bytes_moved = 0
        self.transfers = 0
        self.direct_reads = 0
        """Reads that landed straight in the destination's memory (no bounce copy)."""
        self.yields = 0
        """Demand reads a reader served between two blocks of its own prefetch read."""
        self.paused_seconds = 0.0
        """Reader-seconds that prefetch reads spent paused while other readers' demand reads ran."""
        self._demand: collections.deque[tuple[Transfer, object, torch.Tensor]] = collections.deque()
        self._prefetch: collections.deque[tuple[Transfer, object, torch.Tensor]] = collections.deque()
        self._blocked: dict[int, collections.deque[tuple[Transfer, object, torch.Tensor]]] = {}
        self._last: dict[int, Transfer] = {}
        self._inflight: dict[int, Transfer] = {}
        """Reads in progress (by id), paused prefetches included."""
        self._cv = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._active = 0
        self._busy_total = 0.0
        self._busy_since = 0.0
        self._pending = 0
        self._compute_event = None
        self._threads = [threading.Thread(target=self._run, name=f"expertcast-reader-{i}", daemon=True)
                         for i in range(self.readers)]
        for t in self._threads:
            t.start()

    # -- submission ---------------------------------------------------------------------------------
    def submit(self, key, src, dst, slot, demand: bool = False) -> Transfer:
        if self._closed:
            raise RuntimeError("reader pool is closed")
        if not isinstance(src, DiskRow):
            raise TypeError("ReaderPoolEngine reads DiskRow sources (DiskExpertStore.row)")
        tr = Transfer(key=key, slot=slot, nbytes=src.nbytes, event=threading.Event(), demand=bool(demand),
                      after_compute=self._compute_event, sink=self.sink)
        with self._cv:
            prev = self._last.get(slot)
            self._last[slot] = tr
            self._pending += 1
            tr.prev = prev if prev is not None and not prev.event.is_set() else None
            if tr.prev is not None:  # starts when the earlier read into this slot has finished
                self._blocked.setdefault(slot, collections.deque()).append((tr, src, dst))
                if demand:
                    self._promote_locked(tr.prev)
            else:
                (self._demand if demand else self._prefetch).append((tr, src, dst))
            if demand:  # every reader: an idle one takes it, a paused prefetch serves it or reads on if promoted
                self._cv.notify_all()
            else:
                self._cv.notify()
        self.transfers += 1
        self.bytes_moved += src.nbytes
        return tr

    def promote(self, tr: Transfer) -> None:
        with self._cv:
            self._promote_locked(tr)
            self._cv.notify_all()

    def _promote_locked(self, tr: Transfer) -> None:
        """``tr`` is needed now: out of the prefetch queue into the demand queue, or, while it waits for an
        earlier read into its slot, that read promoted instead (a read in progress reads on)."""
        while tr is not None and not tr.event.is_set():
            tr.demand = True
            for i, item in enumerate(self._prefetch):
                if item[0] is tr:
                    del self._prefetch[i]
                    self._demand.append(item)
                    return
            tr = tr.prev

    # -- the readers --------------------------------------------------------------------------------
    def _demand_in_flight(self) -> bool:
        return any(t.demand for t in self._inflight.values())

    def _take_locked(self):
        """The read a free reader starts now, or None: demand reads first; a prefetch read while no demand
        read is in flight (yielding) or always (``chunk`` 0)."""
        if self._demand:
            return self._demand.popleft()
        if self._prefetch and not (self.chunk and self._demand_in_flight()):
            return self._prefetch.popleft()
        return None

    def _begin_locked(self, tr: Transfer) -> None:
        if self._active == 0:
            self._busy_since = time.perf_counter()
        self._active += 1
        self._inflight[id(tr)] = tr

    def _run(self) -> None:
        torch.set_num_threads(1)
        cuda = self.device.type == "cuda"
        bufs = [aligned_empty(self.store.stride, pin_memory=cuda), None]  # own bounce; a served demand's (lazily)
        stream = torch.cuda.Stream(device=self.device) if cuda else None
        while True:
            with self._cv:
                while True:
                    item = self._take_locked()
                    if item is not None or (self._closed and not self._demand and not self._prefetch):
                        break
                    self._cv.wait()
                if item is None:
                    return
                self._begin_locked(item[0])
            self._serve(item, bufs, 0, stream)

    def _serve(self, item, bufs: list, depth: int, stream) -> None:
        """Read ``item`` (begun: in flight) into its slot with bounce buffer ``bufs[depth]``, then finish it."""
        tr, src, dst = item
        tr.started = time.perf_counter()
        try:
            between = self._yield_point(tr, bufs, stream) if self.chunk and not tr.demand else None  # depth 1: demand
            self._read(src, dst, bufs[depth], stream, tr, between)
        except BaseException as e:  # surfaced to the compute thread in wait()
            self._error = e
        tr.finished = time.perf_counter()
        sink = tr.sink
        with self._cv:
            self._active -= 1
            del self._inflight[id(tr)]
            if self._active == 0:
                self._busy_total += tr.finished - self._busy_since
            if sink is not None:
                sink.read_seconds += tr.finished - tr.started
            if self.timeline is not None:
                self.timeline.append(("read", tr.key, tr.demand, tr.submitted, tr.started, tr.finished))
            tr.event.set()
            self._pending -= 1
            waiting = self._blocked.get(tr.slot)
            if waiting:  # the next read into this slot may start now
                nxt = waiting.popleft()
                nxt[0].prev = None
                (self._demand if nxt[0].demand else self._prefetch).append(nxt)
                if not waiting:
                    del self._blocked[tr.slot]
            if self._last.get(tr.slot) is tr:
                del self._last[tr.slot]
            self._cv.notify_all()

    def _yield_point(self, tr: Transfer, bufs: list, stream) -> Callable[[], None]:
        """Called between two blocks of prefetch read ``tr``: serve the queued demand reads, wait while other
        demand reads are in flight, return when none is (or when ``tr`` itself was promoted)."""

        def between() -> None:
            while True:
                with self._cv:
                    if tr.demand:
                        return
                    if self._demand:
                        item = self._demand.popleft()
                        self._begin_locked(item[0])
                        self.yields += 1
                    elif self._demand_in_flight():
                        t0 = time.perf_counter()
                        self._cv.wait()
                        self.paused_seconds += time.perf_counter() - t0
                        continue
                    else:
                        return
                if bufs[1] is None:
                    bufs[1] = aligned_empty(self.store.stride, pin_memory=self.device.type == "cuda")
                self._serve(item, bufs, 1, stream)

        return between

    def _read(self, src: DiskRow, dst: torch.Tensor, bounce: torch.Tensor, stream, tr: Transfer,
              between: Callable[[], None] | None = None) -> None:
        chunk = self.chunk if between is not None else 0
        if dst.device.type == "cpu":
            if (dst.dtype == torch.uint8 and dst.numel() >= src.span and dst.data_ptr() % ALIGN == 0
                    and dst.is_contiguous()):
                self.store.read_into(src, dst, chunk, between)  # straight into the slot (padded, aligned pool row)
                self.direct_reads += 1
                return
            self.store.read_into(src, bounce, chunk, between)
            dst.view(-1).view(torch.uint8)[:src.nbytes].copy_(bounce[:src.nbytes])
            return
        self.store.read_into(src, bounce, chunk, between)  # CUDA: disk -> pinned bounce -> device slot
        with torch.cuda.stream(stream):
            if tr.after_compute is not None:
                stream.wait_event(tr.after_compute)  # the slot's previous expert may still be read by kernels
            dst.view(-1).view(torch.uint8)[:src.nbytes].copy_(bounce[:src.nbytes], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        ev.synchronize()  # the bounce buffer is reused by this reader's next read
        tr.cuda_event = ev

    # -- waiting ------------------------------------------------------------------------------------

    def mark_compute(self) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._compute_event = ev

    def busy_seconds(self) -> float:
        """Seconds during which at least one read was in progress (up to now)."""
        with self._cv:
            extra = time.perf_counter() - self._busy_since if self._active else 0.0
            return self._busy_total + extra

    def synchronize(self) -> None:
        with self._cv:
            while self._pending:
                self._cv.wait()
        self._raise_pending()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=10)


def is_disk_store(store) -> bool:
    return isinstance(store, DiskExpertStore)
