"""Host expert store: one packed host copy of every routed expert of a transformers-5 MoE model.

transformers 5 keeps the routed experts of a layer fused in 3-D parameters with the expert on the
leading axis (``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]; GPT-OSS transposed,
``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H], plus ``*_bias`` [E, ...]). The store packs
the tensors of one expert into one contiguous row of ``row_numel`` elements, so that moving an expert
between host and device is a single copy of ``expert_bytes`` bytes. Rows live in a tensor
[L, E, row_numel] that is pinned on CUDA hosts, or memory-mapped from a safetensors file so that host
RAM need not hold all experts at once.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from expertcast.inference.runtime.quant import (
    PART_ALIGN,
    ExpertFormat,
    QWeight,
    native_int4_pack,
    packed_shapes,
    quantize,
)
from expertcast.utils.errors import UsageError
from torch import nn

STORE_FORMAT_VERSION = 1

# Per-expert parameters that transformers' fused experts modules may hold (leading axis = expert).
_EXPERT_PARAMS = ("gate_up_proj", "up_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj", "down_proj_bias")

_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.uint8: "U8",
}
_DTYPES_FROM_ST = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


class UnsupportedModelError(ValueError):
    """The model has no transformers-5 fused experts modules the runtime can drive."""


@dataclass(frozen=True)
class ExpertPart:
    """One tensor of an expert inside its packed row: ``row[offset:offset+numel].view(shape)``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    dtype: str = ""
    """Quantized rows (uint8 bytes): the part's own dtype (``offset`` and :attr:`span` are then bytes); "" in
    an unquantized row (the layout's dtype)."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def span(self) -> int:
        """Row elements the part occupies (its numel, or its bytes in a quantized row)."""
        return self.numel * (getattr(torch, self.dtype).itemsize if self.dtype else 1)

    def view(self, row: torch.Tensor) -> torch.Tensor:
        t = row[self.offset:self.offset + self.span]
        return (t.view(getattr(torch, self.dtype)) if self.dtype else t).view(self.shape)


@dataclass(frozen=True)
class ExpertLayout:
    """How one expert's tensors are packed in a row, plus the flags of its experts module.

    A quantized layout (:func:`quantized_layout`; docs/design.md, "Expert formats") packs bytes (``dtype``
    uint8): per projection ``<name>.q`` and ``<name>.s`` (quantized weight and scales), biases as they were;
    ``base`` is the unquantized layout it came from (the model's dtype and shapes), ``fmt`` the format and
    ``pack`` the int4 packing."""

    parts: tuple[ExpertPart, ...]
    dtype: torch.dtype
    num_experts: int
    is_transposed: bool
    has_gate: bool
    has_bias: bool
    fmt: str = "bfloat16"
    pack: str = ""
    base: ExpertLayout | None = None

    @property
    def row_numel(self) -> int:
        return max((p.offset + p.span for p in self.parts), default=0) if self.base is not None else sum(
            p.numel for p in self.parts)

    @property
    def expert_bytes(self) -> int:
        return self.row_numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def quantized(self) -> bool:
        return self.base is not None

    @property
    def act_dtype(self) -> torch.dtype:
        """The dtype the expert computes in (the model's; a quantized row's own dtype is uint8)."""
        return self.base.dtype if self.base is not None else self.dtype

    @property
    def format(self) -> ExpertFormat:
        return ExpertFormat.parse(self.fmt)

    def views(self, row: torch.Tensor) -> dict[str, torch.Tensor | QWeight]:
        """Named views of a packed row [row_numel] (no copy); a quantized row's projections are :class:`QWeight`."""
        if self.base is None:
            return {p.name: row[p.offset:p.offset + p.numel].view(p.shape) for p in self.parts}
        out: dict = {}
        fmt = self.format
        parts = {p.name: p for p in self.parts}
        for b in self.base.parts:
            if b.name in parts:  # a bias
                out[b.name] = parts[b.name].view(row)
                continue
            N, K = _nk(b, self.base.is_transposed)
            out[b.name] = QWeight(fmt, N, K, parts[f"{b.name}.q"].view(row), parts[f"{b.name}.s"].view(row),
                                  self.pack, self.base.dtype)
        return out

    def to_dict(self) -> dict:
        d = {
            "parts": [{"name": p.name, "shape": list(p.shape), "offset": p.offset, **({"dtype": p.dtype} if p.dtype else {})}
                      for p in self.parts],
            "dtype": str(self.dtype).removeprefix("torch."),
            "num_experts": self.num_experts,
            "is_transposed": self.is_transposed,
            "has_gate": self.has_gate,
            "has_bias": self.has_bias,
        }
        if self.base is not None:
            d.update(fmt=self.fmt, pack=self.pack, base=self.base.to_dict())
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ExpertLayout:
        return cls(
            parts=tuple(ExpertPart(p["name"], tuple(p["shape"]), int(p["offset"]), p.get("dtype", ""))
                        for p in d["parts"]),
            dtype=getattr(torch, d["dtype"]),
            num_experts=int(d["num_experts"]),
            is_transposed=bool(d["is_transposed"]),
            has_gate=bool(d["has_gate"]),
            has_bias=bool(d["has_bias"]),
            fmt=d.get("fmt", "bfloat16"),
            pack=d.get("pack", ""),
            base=cls.from_dict(d["base"]) if d.get("base") else None,
        )


def check_readable(lay: ExpertLayout, path: object) -> ExpertLayout:
    """``lay`` when this machine reads its rows; a store whose int4 rows were packed for another CPU kernel
    (another vector width) is refused with one line."""
    if lay.pack and lay.pack != "nibble" and lay.pack != native_int4_pack():
        raise UsageError(f"{path}: int4 rows packed as {lay.pack!r}, this machine packs {native_int4_pack()!r}: "
                         "rebuild the expert store here")
    return lay


def _nk(part: ExpertPart, transposed: bool) -> tuple[int, int]:
    """(N, K) of a projection part: out x in (``y = x @ W.T``); transposed modules store [K, N]."""
    a, b = part.shape
    return (b, a) if transposed else (a, b)


def quantized_layout(base: ExpertLayout, fmt: ExpertFormat | str, pack: str | None = None) -> ExpertLayout:
    """The layout of ``base``'s experts in ``fmt`` (``base`` itself for ``bfloat16``): bytes, each part on a
    :data:`~.quant.PART_ALIGN` boundary."""
    fmt = ExpertFormat.parse(fmt)
    if not fmt.quantized:
        return base
    if base.quantized:
        raise ValueError(f"layout is already quantized ({base.fmt})")
    pack = (pack or native_int4_pack()) if fmt.kind == "int4" else ""
    parts, off = [], 0

    def add(name: str, shape: tuple[int, ...], dt: torch.dtype) -> None:
        nonlocal off
        p = ExpertPart(name, tuple(shape), off, str(dt).removeprefix("torch."))
        parts.append(p)
        off += -(-p.span // PART_ALIGN) * PART_ALIGN

    for b in base.parts:
        if b.name.endswith("_bias"):
            add(b.name, b.shape, base.dtype)
            continue
        N, K = _nk(b, base.is_transposed)
        (qs, qd), (ss, sd) = packed_shapes(fmt, N, K)
        add(f"{b.name}.q", qs, qd)
        add(f"{b.name}.s", ss, sd)
    return ExpertLayout(tuple(parts), torch.uint8, base.num_experts, base.is_transposed, base.has_gate,
                        base.has_bias, fmt=fmt.name, pack=pack, base=base)


def quantize_rows(lay: ExpertLayout, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Quantize unquantized rows ``src`` [E, base.row_numel] into ``dst`` [E, lay.row_numel] (uint8)."""
    base, fmt = lay.base, lay.format
    parts = {p.name: p for p in lay.parts}
    dst.zero_()  # alignment padding is deterministic
    for e in range(src.shape[0]):
        row = dst[e]
        for b in base.parts:
            w = src[e, b.offset:b.offset + b.numel].view(b.shape)
            if b.name in parts:
                parts[b.name].view(row).copy_(w)
                continue
            q, s = quantize(w.t() if base.is_transposed else w, fmt, lay.pack)
            parts[f"{b.name}.q"].view(row).copy_(q)
            parts[f"{b.name}.s"].view(row).copy_(s)


def dequantize_row(lay: ExpertLayout, row: torch.Tensor) -> torch.Tensor:
    """One quantized row -> the unquantized row [base.row_numel] of the model's dtype (its dequantized weights)."""
    base = lay.base
    out = torch.empty(base.row_numel, dtype=base.dtype)
    views = lay.views(row)
    for b in base.parts:
        v = views[b.name]
        w = v.dequantize(base.dtype) if isinstance(v, QWeight) else v
        out[b.offset:b.offset + b.numel].view(b.shape).copy_(w.t() if isinstance(v, QWeight) and base.is_transposed else w)
    return out


@dataclass(frozen=True)
class MoELayerRef:
    """A fused experts module of the model and where it sits."""

    name: str
    """Module path, e.g. ``model.layers.3.mlp.experts``."""
    decoder_layer: int
    """Index of the decoder layer holding it (-1 when the path names none)."""
    module: nn.Module


def find_experts_modules(model: nn.Module) -> list[MoELayerRef]:
    """The model's fused experts modules in execution order (one per MoE layer).

    Raises :class:`UnsupportedModelError` naming the architecture when there is none: the runtime only
    drives experts dispatched through ``transformers.integrations.moe`` (``@use_experts_implementation``).
    """
    refs = []
    for name, mod in model.named_modules():
        if not (hasattr(mod, "is_transposed") and hasattr(mod, "has_gate") and hasattr(mod, "num_experts")):
            continue
        w = getattr(mod, "gate_up_proj" if mod.has_gate else "up_proj", None)
        released = isinstance(w, torch.Tensor) and w.numel() == 0  # experts moved to a host store already
        if not isinstance(w, torch.Tensor) or (w.ndim != 3 and not released):
            continue
        parts = name.split(".")
        dec = -1
        for a, b in zip(parts[:-1], parts[1:], strict=True):
            if a in ("layers", "h", "blocks") and b.isdigit():
                dec = int(b)
        refs.append(MoELayerRef(name=name, decoder_layer=dec, module=mod))
    if not refs:
        arch = getattr(getattr(model, "config", None), "architectures", None) or [type(model).__name__]
        mtype = getattr(getattr(model, "config", None), "model_type", "?")
        raise UnsupportedModelError(
            f"unsupported architecture {arch[0]} (model_type={mtype!r}): no fused experts module dispatched "
            "through transformers.integrations.moe (gate_up_proj/up_proj [E, ., .]) was found, so experts "
            "cannot be offloaded"
        )
    return refs


def layout_of(module: nn.Module) -> ExpertLayout:
    """Packed-row layout of one fused experts module."""
    parts, off, dtype = [], 0, None
    E = int(module.num_experts)
    for pname in _EXPERT_PARAMS:
        t = getattr(module, pname, None)
        if not isinstance(t, torch.Tensor) or t.ndim < 2:
            continue
        if t.shape[0] != E:
            raise UnsupportedModelError(f"{type(module).__name__}.{pname} has leading size {t.shape[0]}, expected E={E}")
        if dtype is None:
            dtype = t.dtype
        elif t.dtype != dtype:
            raise UnsupportedModelError(f"{type(module).__name__}: expert tensors mix dtypes ({dtype} and {t.dtype})")
        parts.append(ExpertPart(pname, tuple(t.shape[1:]), off))
        off += parts[-1].numel
    if getattr(module, "has_bias", False) and not any(p.name.endswith("_bias") for p in parts):
        raise UnsupportedModelError(f"{type(module).__name__} declares has_bias but holds no bias tensors")
    return ExpertLayout(tuple(parts), dtype, E, bool(module.is_transposed), bool(module.has_gate),
                        bool(getattr(module, "has_bias", False)))


def _pack_layer(module: nn.Module, layout: ExpertLayout, out: torch.Tensor) -> None:
    """Copy every expert of ``module`` into ``out`` [E, row_numel] (quantized per ``layout``'s format)."""
    if layout.quantized:
        src = torch.empty((layout.num_experts, layout.base.row_numel), dtype=layout.base.dtype)
        _pack_layer(module, layout.base, src)
        quantize_rows(layout, src, out)
        return
    with torch.no_grad():
        for p in layout.parts:
            src = getattr(module, p.name).detach()
            out[:, p.offset:p.offset + p.numel].copy_(src.reshape(layout.num_experts, p.numel))


class HostExpertStore:
    """Packed host copies of all routed experts.

    Attributes:
        rows: tensor [L, E, row_numel] of the experts' dtype (pinned, plain, or memory-mapped).
        layout: the packing of one row (identical for all layers).
        mmap_path: the safetensors file backing ``rows`` when memory-mapped, else None.
    """

    def __init__(self, rows: torch.Tensor, layout: ExpertLayout, mmap_path: Path | None = None):
        if rows.ndim != 3 or rows.shape[1] != layout.num_experts or rows.shape[2] != layout.row_numel:
            raise ValueError(
                f"store rows must be [L, E={layout.num_experts}, {layout.row_numel}], got {tuple(rows.shape)}")
        self.rows = rows
        self.layout = layout
        self.mmap_path = mmap_path

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_model(cls, model: nn.Module, *, pin_memory: bool = False, mmap_path: str | os.PathLike | None = None,
                   refs: list[MoELayerRef] | None = None, fmt: ExpertFormat | str = "bfloat16") -> HostExpertStore:
        """Copy the experts of ``model`` to the host.

        Args:
            pin_memory: page-lock the host rows (for asynchronous CUDA copies).
            mmap_path: write the rows to this safetensors file and memory-map it instead of holding
                them in anonymous host memory.
            fmt: the expert format of the rows (:class:`~.quant.ExpertFormat`; quantized on the way in).
        """
        refs = refs if refs is not None else find_experts_modules(model)
        layouts = [layout_of(r.module) for r in refs]
        for r, lay in zip(refs, layouts, strict=True):
            if lay != layouts[0]:
                raise UnsupportedModelError(f"experts module {r.name} differs in shape/dtype from {refs[0].name}")
        lay = quantized_layout(layouts[0], fmt)
        L = len(refs)
        if mmap_path is not None:
            path = Path(mmap_path)
            _write_store_file(path, refs, lay)
            return cls.open_mmap(path)
        rows = torch.empty((L, lay.num_experts, lay.row_numel), dtype=lay.dtype, pin_memory=pin_memory)
        for i, r in enumerate(refs):
            _pack_layer(r.module, lay, rows[i])
        return cls(rows, lay)

    @classmethod
    def open_mmap(cls, path: str | os.PathLike) -> HostExpertStore:
        """Memory-map a store file written by :meth:`from_model` (``mmap_path``); reads no pickle."""
        path = Path(path)
        header, data_start = _read_safetensors_header(path)
        meta = header.get("__metadata__", {})
        if meta.get("format") != "expertcast-expert-store":
            raise ValueError(f"{path} is not an expertcast expert store (metadata format={meta.get('format')!r})")
        if int(meta.get("format_version", -1)) != STORE_FORMAT_VERSION:
            raise ValueError(f"{path}: expert store format version {meta.get('format_version')} is not supported "
                             f"(expected {STORE_FORMAT_VERSION})")
        lay = check_readable(ExpertLayout.from_dict(json.loads(meta["layout"])), path)
        info = header.get("rows")
        if info is None:
            raise ValueError(f"{path}: expert store has no 'rows' tensor")
        dtype = _DTYPES_FROM_ST[info["dtype"]]
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = os.path.getsize(path)
        if data_start + end > nbytes:
            raise ValueError(f"{path}: truncated expert store ({nbytes} bytes, header wants {data_start + end})")
        if (data_start + begin) % itemsize:
            raise ValueError(f"{path}: misaligned tensor data")
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=nbytes)
        rows = torch.empty(0, dtype=dtype)
        n = 1
        for s in shape:
            n *= s
        rows.set_(storage, (data_start + begin) // itemsize, shape)
        if n * itemsize != end - begin:
            raise ValueError(f"{path}: tensor size does not match its shape {shape}")
        return cls(rows, lay, mmap_path=path)

    # ----------------------------------------------------------------- access
    @property
    def num_layers(self) -> int:
        return self.rows.shape[0]

    @property
    def num_experts(self) -> int:
        return self.rows.shape[1]

    @property
    def expert_bytes(self) -> int:
        return self.layout.expert_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of all packed experts (file-backed when memory-mapped)."""
        return self.rows.numel() * self.rows.element_size()

    @property
    def is_pinned(self) -> bool:
        return self.rows.is_pinned()

    def row(self, layer: int, expert: int) -> torch.Tensor:
        """Packed row [row_numel] of one expert (a view)."""
        return self.rows[layer, expert]

    def views(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Named weight views (``gate_up_proj``, ``down_proj``, ...) of one expert's host copy."""
        return self.layout.views(self.rows[layer, expert])

    def restore_into(self, refs: list[MoELayerRef]) -> None:
        """Put the fused weights back into the modules (undoes :func:`release_model_experts`; a quantized
        store gives back its dequantized weights)."""
        restore_rows(self.layout, refs, lambda i, e: self.rows[i, e])


def restore_rows(lay: ExpertLayout, refs: list[MoELayerRef], row_of: Callable[[int, int], torch.Tensor]) -> None:
    """Fused parameters of every module of ``refs`` rebuilt from the packed rows ``row_of(layer, expert)``."""
    base = lay.base or lay
    for i, r in enumerate(refs):
        rows = torch.stack([row_of(i, e) if lay.base is None else dequantize_row(lay, row_of(i, e))
                            for e in range(lay.num_experts)])
        for p in base.parts:
            full = rows[:, p.offset:p.offset + p.numel].reshape((lay.num_experts, *p.shape)).clone()
            setattr(r.module, p.name, nn.Parameter(full, requires_grad=False))


def release_model_experts(refs: list[MoELayerRef], layout: ExpertLayout) -> int:
    """Replace each experts module's fused tensors by empty ones, so the full weights do not stay on the
    device beside the slot pool. Returns the bytes released."""
    freed = 0
    for r in refs:
        for p in (layout.base or layout).parts:
            t = getattr(r.module, p.name)
            freed += t.numel() * t.element_size()
            setattr(r.module, p.name, nn.Parameter(torch.empty(0, dtype=t.dtype, device=t.device), requires_grad=False))
    return freed


# --------------------------------------------------------------------- safetensors I/O (no pickle)
def _write_store_file(path: Path, refs: list[MoELayerRef], lay: ExpertLayout) -> None:
    """Stream the packed rows of the modules ``refs`` into a safetensors file (see :func:`write_store_file`)."""
    write_store_file(path, [r.name for r in refs], lay, lambda i, buf: _pack_layer(refs[i].module, lay, buf))


def write_store_file(path: Path, layer_names: list[str], lay: ExpertLayout,
                     fill: Callable[[int, torch.Tensor], None]) -> None:
    """Write an expert store file layer by layer (never all layers in RAM), atomically.

    ``fill(i, buf)`` packs MoE layer ``i``'s experts into ``buf`` [E, row_numel] (host); the file is
    what :meth:`HostExpertStore.open_mmap` reads.
    """
    L, E, N = len(layer_names), lay.num_experts, lay.row_numel
    itemsize = torch.empty((), dtype=lay.dtype).element_size()
    total = L * E * N * itemsize
    header = {
        "__metadata__": {
            "format": "expertcast-expert-store",
            "format_version": str(STORE_FORMAT_VERSION),
            "layout": json.dumps(lay.to_dict()),
            "layers": json.dumps(list(layer_names)),
        },
        "rows": {"dtype": _SAFETENSORS_DTYPES[lay.dtype], "shape": [L, E, N], "data_offsets": [0, total]},
    }
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    buf = torch.empty((E, N), dtype=lay.dtype)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for i in range(L):
            fill(i, buf)
            f.write(buf.view(torch.uint8).numpy().data)  # no per-layer bytes copy
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_safetensors_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    return header, 8 + n
