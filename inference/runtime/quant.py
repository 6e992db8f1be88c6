"""Quantized experts: the expert formats, their packing and their kernels (docs/design.md, "Expert formats").

An expert format is what one routed expert's weights are stored as in the host store, the disk store, the
slots and the transfers:

- ``bfloat16``: unquantized, the model's dtype (the runtime's behaviour before formats existed);
- ``int8``: symmetric int8 per output channel (``int8``) or per group of the input dim (``int8-g128``),
  scales in bfloat16: ``w = q * s``;
- ``int4``: asymmetric 4-bit per group of the input dim (``int4`` = group 64; ``int4-g32`` .. ``int4-g128``),
  two per byte, scale and zero in bfloat16 (``[K/g, N, 2]``, the layout torch's int4 kernels take):
  ``w = (q - 8) * s + z``.

A projection ``W`` [N, K] (``y = x @ W.T``) becomes a :class:`QWeight`; :meth:`QWeight.mm` runs torch's
weight-only kernels on the CPU (``torch._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``) or
dequantizes and runs the ordinary GEMM, whichever the calibrated :class:`KernelTable` measured faster at that
shape and token count. The int4 nibbles are stored in the CPU kernel's own packing
(``aten._convert_weight_to_int4pack_for_cpu``, which depends on the CPU's vector width: the pack names it,
e.g. ``aten-cpu-AVX512``), so the kernel reads a slot's bytes as they landed; ``nibble`` is the portable
packing (low nibble = even k) used where that kernel is missing.

This module knows nothing of layouts or stores (:mod:`.store` builds quantized layouts on top of it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from expertcast.utils.errors import UsageError

FORMATS = ("bfloat16", "int8", "int4")
INT4_GROUPS = (32, 64, 128)
DEFAULT_INT4_GROUP = 64
SCALE_DTYPE = torch.bfloat16
PART_ALIGN = 64
"""Byte alignment of every part inside a quantized row."""


def _has_int4_cpu_kernel() -> bool:
    return hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu") and hasattr(
        torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def native_int4_pack() -> str:
    """The int4 packing this machine's CPU kernel reads (``aten-cpu-<capability>``), ``nibble`` without it."""
    if not _has_int4_cpu_kernel():
        return "nibble"
    return f"aten-cpu-{torch.backends.cpu.get_cpu_capability()}"


@dataclass(frozen=True)
class ExpertFormat:
    """One expert format: ``kind`` (``bfloat16``, ``int8``, ``int4``) and ``group_size`` (0: per channel)."""

    kind: str = "bfloat16"
    group_size: int = 0

    @classmethod
    def parse(cls, spec: str | ExpertFormat | None) -> ExpertFormat:
        """``bfloat16`` | ``int8`` | ``int8-g<G>`` | ``int4`` | ``int4-g<G>`` (G in 32..128 for int4)."""
        if isinstance(spec, ExpertFormat):
            return spec
        text = str(spec or "bfloat16").strip().lower()
        kind, _, g = text.partition("-g")
        if kind not in FORMATS or (kind == "bfloat16" and g):
            raise UsageError(f"expert format {spec!r}: expected one of bfloat16, int8, int8-g<G>, int4, int4-g<G>")
        try:
            group = int(g) if g else (DEFAULT_INT4_GROUP if kind == "int4" else 0)
        except ValueError:
            raise UsageError(f"expert format {spec!r}: group size {g!r} is not an integer") from None
        if kind == "int4" and group not in INT4_GROUPS:
            raise UsageError(f"expert format {spec!r}: int4 groups are {INT4_GROUPS}")
        if kind == "int8" and g and (group < 16 or group & (group - 1)):
            raise UsageError(f"expert format {spec!r}: int8 groups are powers of two >= 16")
        return cls(kind, group)

    @property
    def quantized(self) -> bool:
        return self.kind != "bfloat16"

    @property
    def name(self) -> str:
        """The spec that :meth:`parse` reads back (``int4`` for the default group, else ``int4-g32``)."""
        if (self.kind == "int4" and self.group_size == DEFAULT_INT4_GROUP) or self.group_size == 0:
            return self.kind
        return f"{self.kind}-g{self.group_size}"

    def group_for(self, K: int) -> int:
        """The group used for an input size ``K``: the format's, halved (not below 32, or 16 for int8) while it
        does not divide ``K`` (narrow test models); 0 = per channel."""
        g = self.group_size
        floor = 32 if self.kind == "int4" else 16
        while g > floor and K % g:
            g //= 2
        return g

    def check_shape(self, N: int, K: int, what: str) -> None:
        """Refuse a projection [N, K] this format cannot hold (a group must divide K)."""
        g = self.group_for(K)
        if g and K % g:
            raise UsageError(f"{what}: input size {K} is not a multiple of the {self.name} group {g}")
        if self.kind == "int4" and K % 2:
            raise UsageError(f"{what}: int4 packs two per byte, input size {K} is odd")


# --------------------------------------------------------------------------------------------- quantize
def quantize(w: torch.Tensor, fmt: ExpertFormat, pack: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of ``w`` [N, K] in ``fmt`` (see the module docstring); int4 ``q`` packed as ``pack``."""
    N, K = w.shape
    fmt.check_shape(N, K, "quantize")
    wf = w.detach().float()
    if fmt.kind == "int8":
        g = fmt.group_for(K) or K
        wg = wf.view(N, K // g, g)
        s = (wg.abs().amax(-1) / 127.0).clamp(min=1e-12).to(SCALE_DTYPE)  # rounded first: q uses the stored scale
        q = torch.round(wg / s.float().unsqueeze(-1)).clamp(-127, 127).to(torch.int8).view(N, K)
        return q, (s.view(N) if fmt.group_size == 0 else s)
    if fmt.kind == "int4":
        g = fmt.group_for(K)
        wg = wf.view(N, K // g, g)
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = ((hi - lo) / 15.0).clamp(min=1e-12).to(SCALE_DTYPE)
        z = (lo + 8.0 * s.float()).to(SCALE_DTYPE)
        q = torch.round((wg - z.float().unsqueeze(-1)) / s.float().unsqueeze(-1) + 8.0).clamp(0, 15)
        q = q.to(torch.int32).view(N, K)
        sz = torch.stack([s.t(), z.t()], dim=-1).contiguous()  # [K/g, N, 2]
        return pack_int4(q, pack or native_int4_pack()), sz
    raise UsageError(f"format {fmt.name} is not quantized")


def pack_int4(q: torch.Tensor, pack: str) -> torch.Tensor:
    """Values ``q`` [N, K] in 0..15 -> uint8 [N, K/2] in ``pack`` (``nibble`` or the CPU kernel's)."""
    N, K = q.shape
    if pack == "nibble":
        q8 = q.to(torch.uint8)
        return (q8[:, 0::2] | (q8[:, 1::2] << 4)).contiguous()
    _check_pack(pack)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


_PERMS: dict[tuple[int, int, str], torch.Tensor] = {}


def _check_pack(pack: str) -> None:
    if pack != native_int4_pack():
        raise UsageError(f"int4 rows packed as {pack!r} cannot be read here (this machine's int4 packing is "
                         f"{native_int4_pack()!r}): rebuild the expert store on this machine")


def _kernel_perm(N: int, K: int, pack: str) -> torch.Tensor:
    """Index into q.flatten() of every nibble of the CPU kernel's packing (nibble 2i = low half of byte i),
    learned once per shape by packing the digits of the positions (the packing is a permutation)."""
    key = (N, K, pack)
    perm = _PERMS.get(key)
    if perm is None:
        _check_pack(pack)
        idx = torch.arange(N * K, dtype=torch.int64)
        perm = torch.zeros(N * K, dtype=torch.int64)
        for j in range(max(1, math.ceil(math.log(N * K, 16)))):
            digits = ((idx >> (4 * j)) & 15).to(torch.int32).view(N, K)
            p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digits, 1).reshape(-1)
            nib = torch.stack([p & 15, p >> 4], dim=-1).reshape(-1).to(torch.int64)
            perm |= nib << (4 * j)
        _PERMS[key] = perm
    return perm


def unpack_int4(packed: torch.Tensor, N: int, K: int, pack: str) -> torch.Tensor:
    """uint8 [N, K/2] in ``pack`` -> int values [N, K] in 0..15 (uint8)."""
    p = packed.reshape(-1)
    nib = torch.stack([p & 15, p >> 4], dim=-1).reshape(-1)
    if pack == "nibble":
        return nib.view(N, K)
    perm = _kernel_perm(N, K, pack).to(p.device)
    out = torch.empty(N * K, dtype=torch.uint8, device=p.device)
    out[perm] = nib
    return out.view(N, K)


def dequantize(q: torch.Tensor, s: torch.Tensor, fmt: ExpertFormat, N: int, K: int, pack: str = "",
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight [N, K] in ``dtype`` of (q, scales) (computed in float32, rounded once)."""
    if fmt.kind == "int8":
        if fmt.group_size == 0:
            return (q.float() * s.float().unsqueeze(-1)).to(dtype)
        g = fmt.group_for(K)
        return (q.float().view(N, K // g, g) * s.float().unsqueeze(-1)).view(N, K).to(dtype)
    if fmt.kind == "int4":
        g = fmt.group_for(K)
        v = unpack_int4(q, N, K, pack).float().view(N, K // g, g)
        sc = s[..., 0].t().float().unsqueeze(-1)
        z = s[..., 1].t().float().unsqueeze(-1)
        return ((v - 8.0) * sc + z).view(N, K).to(dtype)
    raise UsageError(f"format {fmt.name} is not quantized")


def packed_shapes(fmt: ExpertFormat, N: int, K: int) -> tuple[tuple[tuple[int, ...], torch.dtype],
                                                              tuple[tuple[int, ...], torch.dtype]]:
    """((q shape, q dtype), (scales shape, scales dtype)) of a projection [N, K] in ``fmt``."""
    fmt.check_shape(N, K, f"projection [{N}, {K}]")
    if fmt.kind == "int8":
        s = (N,) if fmt.group_size == 0 else (N, K // fmt.group_for(K))
        return ((N, K), torch.int8), (s, SCALE_DTYPE)
    if fmt.kind == "int4":
        return ((N, K // 2), torch.uint8), ((K // fmt.group_for(K), N, 2), SCALE_DTYPE)
    raise UsageError(f"format {fmt.name} is not quantized")


def projection_bytes(fmt: ExpertFormat, N: int, K: int, itemsize: int = 2) -> int:
    """Bytes of one projection [N, K] in ``fmt`` (unaligned; ``itemsize`` of the unquantized dtype)."""
    if not fmt.quantized:
        return N * K * itemsize
    (qs, qd), (ss, sd) = packed_shapes(fmt, N, K)
    return math.prod(qs) * qd.itemsize + math.prod(ss) * sd.itemsize


# --------------------------------------------------------------------------------------------- kernels
KERNELS = ("kernel", "dequant")
"""``kernel``: torch's weight-only int8/int4 CPU kernel; ``dequant``: dequantize, then the dtype's GEMM."""


def kernel_name(fmt: ExpertFormat, choice: str) -> str:
    """What runs for ``choice``: the aten op, or the dequantize + GEMM path."""
    if choice == "dequant":
        return "dequantize+mm"
    return "aten::_weight_int8pack_mm" if fmt.kind == "int8" else "aten::_weight_int4pack_mm_for_cpu"


def kernel_available(fmt: ExpertFormat, x: torch.Tensor, pack: str) -> bool:
    """torch ships a weight-only kernel for ``fmt`` on ``x``'s device and dtype (CPU, bfloat16 activations;
    int8 per channel only; int4 in the CPU kernel's packing)."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16:
        return False
    if fmt.kind == "int8":
        return fmt.group_size == 0 and hasattr(torch, "_weight_int8pack_mm")
    return fmt.kind == "int4" and pack.startswith("aten-cpu") and _has_int4_cpu_kernel()


class KernelTable:
    """Which path runs each (format, N, K, tokens): measured (:meth:`calibrate`) or fixed (``mode``).

    ``mode``: ``auto`` (a shape is measured the first time it runs, at 1 and 64 tokens; a call with n tokens
    takes the row of the nearer count on a log scale), ``kernel`` (torch's kernel wherever it exists) or
    ``dequant``. The decision is fixed for the process once taken, so a full-load and an offloaded run of
    one model compute with the same kernels."""

    TOKENS = (1, 64)

    def __init__(self, mode: str = "auto"):
        if mode not in ("auto", *KERNELS):
            raise UsageError(f"kernel mode must be auto, kernel or dequant, got {mode!r}")
        self.mode = mode
        self.rows: dict[tuple[str, int, int, int], dict] = {}

    def _bucket(self, n: int) -> int:
        return min(self.TOKENS, key=lambda t: abs(math.log(max(n, 1)) - math.log(t)))

    def choose(self, w: QWeight, x: torch.Tensor) -> str:
        if not kernel_available(w.fmt, x, w.pack):
            return "dequant"
        if self.mode != "auto":
            return self.mode
        key = (w.fmt.name, w.N, w.K, self._bucket(x.shape[0]))
        row = self.rows.get(key)
        if row is None:
            for r in measure(w, self.TOKENS, repeats=5):
                self.rows[(w.fmt.name, w.N, w.K, r["tokens"])] = r
            row = self.rows[key]
        return row["choice"]

    def to_list(self) -> list[dict]:
        return [dict(r) for _, r in sorted(self.rows.items())]


def measure(w: QWeight, tokens: Iterable[int] = (1, 64), repeats: int = 5) -> list[dict]:
    """Least ms (``<path>_ms``; the median in ``<path>_median_ms``) of ``w.mm`` by each available path at each
    token count (bfloat16 activations on the CPU), and the faster one by the least time (``choice``): on a
    shared machine the least of a few runs is the one least disturbed by other processes."""
    out = []
    g = torch.Generator().manual_seed(0)
    for n in tokens:
        x = torch.randn(n, w.K, generator=g).to(torch.bfloat16)
        row = {"format": w.fmt.name, "N": w.N, "K": w.K, "tokens": int(n)}
        paths = ["dequant"] + (["kernel"] if kernel_available(w.fmt, x, w.pack) else [])
        for p in paths:
            w.mm(x, choice=p)  # warm (and the int4 permutation, once)
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                w.mm(x, choice=p)
                ts.append(time.perf_counter() - t0)
            row[f"{p}_ms"] = 1e3 * min(ts)
            row[f"{p}_median_ms"] = 1e3 * sorted(ts)[len(ts) // 2]
        row["choice"] = min(paths, key=lambda p: row[f"{p}_ms"])
        row["kernel"] = kernel_name(w.fmt, row["choice"])
        out.append(row)
    return out


TABLE = KernelTable()
"""The process's kernel table (:func:`set_kernel_mode` replaces it)."""


def set_kernel_mode(mode: str) -> KernelTable:
    """A fresh process kernel table in ``mode`` (``auto``, ``kernel``, ``dequant``); returns it."""
    global TABLE
    TABLE = KernelTable(mode)
    return TABLE


class QWeight:
    """One quantized projection ``W`` [N, K] (``y = x @ W.T``): views ``q`` and ``s`` into a packed row."""

    __slots__ = ("fmt", "N", "K", "q", "s", "pack", "dtype")

    def __init__(self, fmt: ExpertFormat, N: int, K: int, q: torch.Tensor, s: torch.Tensor, pack: str,
                 dtype: torch.dtype):
        self.fmt, self.N, self.K, self.q, self.s, self.pack, self.dtype = fmt, N, K, q, s, pack, dtype

    @classmethod
    def from_float(cls, w: torch.Tensor, fmt: ExpertFormat, pack: str | None = None) -> QWeight:
        pack = (pack or native_int4_pack()) if fmt.kind == "int4" else ""
        q, s = quantize(w, fmt, pack)
        return cls(fmt, w.shape[0], w.shape[1], q, s, pack, w.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.q, self.s, self.fmt, self.N, self.K, self.pack, dtype or self.dtype)

    def mm(self, x: torch.Tensor, out: torch.Tensor | None = None, choice: str | None = None) -> torch.Tensor:
        """``x @ W.T`` for ``x`` [n, K] -> [n, N] (into ``out`` when given) by the table's (or ``choice``'s) path."""
        c = choice or TABLE.choose(self, x)
        if c == "kernel":
            if self.fmt.kind == "int8":
                y = torch._weight_int8pack_mm(x, self.q, self.s)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.q, self.fmt.group_for(self.K),
                                                           self.s)
            if out is None:
                return y
            return out.copy_(y)
        w = self.dequantize(x.dtype)
        return torch.mm(x, w.t(), out=out) if out is not None else torch.mm(x, w.t())


# --------------------------------------------------------------------------------------------- budgets
def relative_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| (float32)."""
    r = ref.float()
    return float((got.float() - r).norm() / r.norm().clamp(min=1e-30))


def calibrate(shapes: Sequence[tuple[int, int]], formats: Sequence[str], tokens: Sequence[int] = (1, 64),
              repeats: int = 5, seed: int = 0) -> list[dict]:
    """Measured rows (:func:`measure`) of random projections [N, K] in each format, with the least ms of the bf16
    GEMM (``bf16_mm_ms``): the calibrated table."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for N, K in shapes:
        w = (torch.randn(N, K, generator=g) * 0.02).to(torch.bfloat16)
        xs = [torch.randn(n, K, generator=g).to(torch.bfloat16) for n in tokens]
        bf = []
        for x in xs:
            torch.mm(x, w.t())
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.mm(x, w.t())
                ts.append(time.perf_counter() - t0)
            bf.append(1e3 * min(ts))
        for f in formats:
            fmt = ExpertFormat.parse(f)
            if not fmt.quantized:
                continue
            for r, b in zip(measure(QWeight.from_float(w, fmt), tokens, repeats), bf, strict=True):
                r["bf16_mm_ms"] = b
                rows.append(r)
    return rows


# --------------------------------------------------------------------------------------------- fp8 checkpoints
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn."""


def _block_expand(s: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    return s.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-scaled FP8 weight (DeepSeek-V3, Qwen3-FP8: e4m3 ``w`` [N, K] and ``weight_scale_inv``
    [ceil(N/b0), ceil(K/b1)], ``w_real = w * scale_inv`` per block) in float32."""
    N, K = w.shape
    want = (-(-N // block[0]), -(-K // block[1]))
    if tuple(scale_inv.shape) != want:
        raise UsageError(f"fp8 weight {list(w.shape)} needs scale blocks {list(want)} for block {list(block)}, "
                         f"got {list(scale_inv.shape)}")
    return w.float() * _block_expand(scale_inv.float(), (N, K), block)


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 ``weight_scale_inv``) of ``w`` [N, K], one scale per ``block`` (the inverse of
    :func:`dequantize_fp8_blocks`; what DeepSeek-V3's FP8 checkpoints hold)."""
    N, K = w.shape
    wf = w.detach().float()
    nb = (-(-N // block[0]), -(-K // block[1]))
    pad = torch.zeros(nb[0] * block[0], nb[1] * block[1])
    pad[:N, :K] = wf.abs()
    amax = pad.view(nb[0], block[0], nb[1], block[1]).amax(dim=(1, 3))
    s = (amax / FP8_MAX).clamp(min=1e-12)
    q = (wf / _block_expand(s, (N, K), block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s
