"""Load an MoE checkpoint straight into the offloading runtime (docs/design.md, "Runtime").

:func:`load_offloaded` never holds the whole model on the device, nor two copies of the experts on
the host:

1. the model skeleton is built with every parameter on the meta device (no weights materialised;
   buffers such as rotary frequencies are computed as usual, they are small);
2. the checkpoint's safetensors shards (``model.safetensors`` or the ``*.safetensors.index.json``
   shard map) are read tensor by tensor with plain file reads (no memory map of the shards, so the
   checkpoint's pages never count in the process's RSS);
3. non-expert tensors go to the compute device; routed-expert tensors go straight into their rows
   of the host store (:class:`~expertcast.inference.runtime.store.HostExpertStore`; pinned on CUDA,
   or streamed layer by layer into a memory-mapped store file with ``mmap_path``). A checkpoint
   whose experts are per-expert tensors (``...experts.3.gate_proj.weight``, what ``save_pretrained``
   writes for most families) is converted on load with transformers' own checkpoint conversion
   mapping (``MergeModulelist`` + ``Concatenate``: gate then up, stacked over experts); a fused
   checkpoint (``...experts.gate_up_proj`` [E, ...], GPT-OSS) is read one expert slice at a time;
4. the skeleton's expert parameters are replaced by empty tensors and an ordinary
   :class:`~expertcast.inference.runtime.engine.OffloadedModel` is built on top with the filled store.

Peak device memory is then non-expert weights + slots + workspace (+ KV cache); peak host memory is
one copy of the experts (none beyond the page cache with ``mmap_path``). :func:`plan_offload` gives the
sizes from the checkpoint headers alone, and both refuse, with one line naming the capacity and the
byte counts, a configuration whose slots do not fit the device or whose experts do not fit the host.

    >>> om, tok, report = load_offloaded("/models/Qwen3-30B-A3B", make_policy("lru"), 0.25, device="cuda")
    >>> report.to_dict()    # expert / non-expert bytes, slots, peak RSS, peak device bytes, seconds
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from expertcast.inference.cache.expert_cache import Budget, CacheConfig
from expertcast.inference.runtime.checkpoint import (
    FP8,
    SCALE_SUFFIX,
    ShardReader,
    TensorEntry,
    checkpoint_tensors,
)
from expertcast.inference.runtime.disk_store import PREFETCH_CHUNK_KB, READERS
from expertcast.inference.runtime.memory import (  # the sizes and memory figures of a load (re-exported)
    RSS_MARGIN_BYTES,
    LoadPlan,
    LoadReport,
    device_free_bytes,
    gb,
    host_available_bytes,
    peak_rss_bytes,
)
from expertcast.inference.runtime.quant import ExpertFormat
from expertcast.inference.runtime.store import (
    ExpertLayout,
    HostExpertStore,
    MoELayerRef,
    UnsupportedModelError,
    find_experts_modules,
    layout_of,
    quantize_rows,
    quantized_layout,
    write_store_file,
)
from expertcast.utils.errors import UsageError
from torch import nn

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------- skeleton
@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block lives on the meta device; buffers stay real.

    (``torch.device("meta")`` would also put the non-persistent buffers, e.g. rotary frequencies
    computed in ``__init__``, on meta, and they are in no checkpoint.)
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_skeleton(config: Any, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with all parameters on the meta device (buffers on the CPU)."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    return model.eval()


def _expert_param_ids(refs: list[MoELayerRef], layout: ExpertLayout) -> set[int]:
    return {id(getattr(r.module, p.name)) for r in refs for p in layout.parts}


def _non_expert_tensors(model: nn.Module, refs: list[MoELayerRef], layout: ExpertLayout) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of ``model`` other than the routed experts, by state-dict key."""
    skip = _expert_param_ids(refs, layout)
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if id(v) not in skip}


# --------------------------------------------------------------------------------------------- key mapping
@dataclass(frozen=True)
class ExpertTarget:
    """Where a checkpoint tensor goes in the store: part ``part`` of layer ``layer``'s rows.

    ``expert`` None: a fused tensor [E, *part.shape] with every expert; else one expert's tensor that
    fills chunk ``chunk`` of ``num_chunks`` along dim ``dim`` of the part (gate then up)."""

    layer: int
    part: str
    expert: int | None
    chunk: int = 0
    num_chunks: int = 1
    dim: int = 0


class KeyMapper:
    """Maps checkpoint keys to the skeleton's non-expert state-dict keys or to store targets, with
    transformers' checkpoint conversion mapping of the model (renamings, then expert converters)."""

    def __init__(self, model: nn.Module, refs: list[MoELayerRef], non_expert: dict[str, torch.Tensor]):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        transforms = get_model_conversion_mapping(model)
        self._renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._prefix = getattr(model, "base_model_prefix", None) or None
        self._known = dict.fromkeys(non_expert) | {f"{r.name}.{p}": None for r in refs for p in _parts(r.module)}
        self._layer_of = {r.name: i for i, r in enumerate(refs)}

    def map(self, key: str) -> str | ExpertTarget | None:
        """The non-expert state-dict key, the :class:`ExpertTarget`, or None (a tensor the model lacks)."""
        from transformers.core_model_loading import apply_renamings, rename_source_key

        target, pattern = rename_source_key(key, self._renamings, self._converters, self._prefix, self._known)
        module, _, part = target.rpartition(".")
        layer = self._layer_of.get(module)
        if layer is None:
            return target if target in self._known else None
        if pattern is None:
            return ExpertTarget(layer, part, None)  # fused checkpoint tensor [E, ...]
        conv = next(c for c in self._converters if pattern in c.source_patterns)
        dim = _concat_dim(conv)
        m = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), apply_renamings(key, self._renamings))
        if m is None or not m.groups():
            raise UnsupportedModelError(f"checkpoint key {key}: cannot find the expert index ({pattern})")
        return ExpertTarget(layer, part, int(m.group(1)), conv.source_patterns.index(pattern),
                            len(conv.source_patterns), dim)


def _parts(module: nn.Module) -> list[str]:
    return [p.name for p in layout_of(module).parts]


def _concat_dim(conv: Any) -> int:
    """Per-expert dim along which the converter concatenates its sources (gate, up); 0 when it only
    stacks experts. Other conversions are refused."""
    ops = [(type(o).__name__, getattr(o, "dim", None)) for o in conv.operations]
    if ops == [("MergeModulelist", 0)]:
        return 0
    if len(ops) == 2 and ops[0] == ("MergeModulelist", 0) and ops[1][0] == "Concatenate" and ops[1][1] >= 1:
        return ops[1][1] - 1
    raise UnsupportedModelError(f"checkpoint conversion {conv.source_patterns} -> {conv.target_patterns} uses "
                                f"operations {ops}, which the offloading loader does not implement")


# --------------------------------------------------------------------------------------------- expert filling
class ExpertFiller:
    """Copies the checkpoint's expert tensors of one MoE layer into that layer's packed rows [E, N]."""

    def __init__(self, layout: ExpertLayout, reader: ShardReader,
                 by_layer: dict[int, list[tuple[TensorEntry, ExpertTarget]]], fp8: Fp8Scales | None = None):
        self.layout = layout
        self.reader = reader
        self.by_layer = by_layer
        self.fp8 = fp8 or Fp8Scales({}, None)
        self._parts = {p.name: p for p in layout.parts}

    def fill(self, layer: int, rows: torch.Tensor) -> None:
        """Fill ``rows`` [E, row_numel] (host) for MoE layer ``layer``; every part of every expert must be
        covered (all chunks of it)."""
        E = self.layout.num_experts
        seen: dict[tuple[str, int], set[tuple[int, int]]] = {}  # (part, expert) -> {(chunk, num_chunks)}
        for entry, tgt in sorted(self.by_layer.get(layer, []), key=lambda it: (str(it[0].file), it[0].offset)):
            part = self._parts.get(tgt.part)
            if part is None:
                raise UnsupportedModelError(f"checkpoint tensor {entry.key} maps to expert part {tgt.part!r}, "
                                            f"which the model's experts module does not hold")
            for e in range(E) if tgt.expert is None else [tgt.expert]:
                if not 0 <= e < E:
                    raise UsageError(f"checkpoint tensor {entry.key}: expert {e} outside 0..{E - 1}")
                self._copy(entry, tgt, part, e, rows[e])
                seen.setdefault((tgt.part, e), set()).add((tgt.chunk, tgt.num_chunks))
        missing = [(p.name, e) for p in self.layout.parts for e in range(E) if not _complete(seen.get((p.name, e)))]
        if missing:
            raise UsageError(f"the checkpoint lacks expert weights of MoE layer {layer} (part, expert): {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}")

    def _copy(self, entry: TensorEntry, tgt: ExpertTarget, part: Any, e: int, row: torch.Tensor) -> None:
        dst = row[part.offset:part.offset + part.numel].view(part.shape)
        if tgt.num_chunks > 1:
            size = part.shape[tgt.dim] // tgt.num_chunks
            dst = dst.narrow(tgt.dim, tgt.chunk * size, size)
        shape = entry.shape[1:] if tgt.expert is None else entry.shape
        if tuple(shape) != tuple(dst.shape):
            raise UsageError(f"checkpoint tensor {entry.key} has shape {list(entry.shape)}, the model expects "
                             f"{list(dst.shape)} per expert (is config.json the checkpoint's?)")
        if entry.dtype == FP8:
            if tgt.expert is None:
                raise UnsupportedModelError(f"checkpoint tensor {entry.key}: fused fp8 expert tensors are not supported "
                                            "(per-expert fp8 weights with weight_scale_inv are)")
            dst.copy_(self.fp8.read(entry, self.reader))  # dequantized per tensor (docs/design.md, "Expert formats")
            return
        if entry.dtype not in _FLOAT_DTYPES:
            raise UnsupportedModelError(f"checkpoint tensor {entry.key} is {entry.dtype}: quantized experts are read "
                                        "from block-scaled fp8 checkpoints only")
        start = e * dst.numel() * entry.dtype.itemsize if tgt.expert is None else 0
        if entry.dtype == dst.dtype and dst.is_contiguous():
            self.reader.read_into(entry, dst, start)  # straight into the store row, no temporary
        else:
            tmp = torch.empty(dst.shape, dtype=entry.dtype)
            self.reader.read_into(entry, tmp, start)
            dst.copy_(tmp)


class Fp8Scales:
    """The ``weight_scale_inv`` blocks of a block-scaled FP8 checkpoint, by weight key (``block``: [rows, cols])."""

    def __init__(self, scales: dict[str, TensorEntry], block: tuple[int, int] | None):
        self.scales = scales
        self.block = block

    def read(self, entry: TensorEntry, reader: ShardReader) -> torch.Tensor:
        """The fp8 tensor ``entry`` dequantized to float32 (one tensor in memory at a time)."""
        from expertcast.inference.runtime.quant import dequantize_fp8_blocks

        scale = self.scales.get(entry.key)
        if scale is None or self.block is None:
            raise UsageError(f"checkpoint tensor {entry.key} is fp8 without {entry.key}{SCALE_SUFFIX} (or the config "
                             "has no quantization_config.weight_block_size)")
        return dequantize_fp8_blocks(reader.read(entry), reader.read(scale).float(), self.block)


class QuantizingFill:
    """``fill(i, buf)`` of a quantized layout: the unquantized rows of layer ``i`` from ``fill_base`` (one layer
    at a time), quantized into ``buf`` [E, lay.row_numel] (docs/design.md, "Expert formats")."""

    def __init__(self, lay: ExpertLayout, fill_base: Callable[[int, torch.Tensor], None]):
        self.lay = lay
        self.fill_base = fill_base
        self._tmp: torch.Tensor | None = None

    def __call__(self, i: int, buf: torch.Tensor) -> None:
        base = self.lay.base
        if self._tmp is None:
            self._tmp = torch.empty((base.num_experts, base.row_numel), dtype=base.dtype)
        self.fill_base(i, self._tmp)
        quantize_rows(self.lay, self._tmp, buf)


def _store_fill(lay: ExpertLayout, fill: Callable[[int, torch.Tensor], None]) -> Callable[[int, torch.Tensor], None]:
    return QuantizingFill(lay, fill) if lay.quantized else fill


def check_quantization(config: Any, where: object) -> tuple[int, int] | None:
    """The FP8 block ([rows, cols]) of a block-scaled fp8 checkpoint's config, None for an unquantized one;
    any other quantization is refused with one line naming its method."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else vars(qc))
    method = qc.get("quant_method")
    block = qc.get("weight_block_size")
    if method == "fp8" and isinstance(block, (list, tuple)) and len(block) == 2:
        if qc.get("fmt", "e4m3") != "e4m3":
            raise UsageError(f"{where}: fp8 format {qc.get('fmt')!r} is not supported (e4m3 is)")
        return int(block[0]), int(block[1])
    what = f"{method!r}" + (" without weight_block_size" if method == "fp8" else "")
    raise UsageError(f"{where}: quantization method {what} is not supported (expertcast loads unquantized and "
                     "block-scaled fp8 checkpoints)")


def _complete(chunks: set[tuple[int, int]] | None) -> bool:
    """All ``num_chunks`` chunks of a part were read (a fused or single tensor is one chunk of one)."""
    return bool(chunks) and len(chunks) == next(iter(chunks))[1]


# --------------------------------------------------------------------------------------------- entry points
def resolve_model_dir(name_or_path: str | os.PathLike, revision: str | None = None) -> Path:
    """A local model directory: as given, or the Hub snapshot (config, tokenizer, safetensors only)."""
    from expertcast.models.backbone import resolve_model_path

    path, local = resolve_model_path(name_or_path)
    if local:
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, revision=revision,
                                  allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))


def _config_and_dtype(model_dir: Path, dtype: str | torch.dtype | None, revision: str | None):
    from expertcast.models.backbone import check_supported
    from expertcast.models.dtypes import parse_dtype
    from expertcast.models.spec import _config_dtype
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False, revision=revision)
    check_supported(config)
    td = parse_dtype(dtype)
    return config, (_config_dtype(config) if td is None else td)


def _plan(model_dir: Path, model: nn.Module, refs: list[MoELayerRef], layout: ExpertLayout,
          tensors: dict[str, TensorEntry], expert_entries: dict[int, list[tuple[TensorEntry, ExpertTarget]]],
          capacity: Budget, device: torch.device, pool: str, num_temp_slots: int, top_k: int) -> LoadPlan:
    L, E = len(refs), layout.num_experts
    cc = CacheConfig(num_layers=L, num_experts=E, top_k=top_k, pool=pool, budget=capacity,
                     expert_bytes=layout.expert_bytes)
    skip = _expert_param_ids(refs, layout.base or layout)
    tensors_ = [*(p for p in model.parameters() if id(p) not in skip), *model.buffers()]
    non_expert = sum(t.numel() * t.element_size() for t in tensors_)  # as MemoryReport counts them
    kinds = {"fused" if tgt.expert is None else "per-expert" for ts in expert_entries.values() for _, tgt in ts}
    slots = cc.total_slots
    return LoadPlan(
        model_dir=str(model_dir), device=str(device), dtype=str(layout.act_dtype).removeprefix("torch."),
        expert_format=layout.fmt,
        num_layers=L, num_experts=E, top_k=top_k, expert_bytes=layout.expert_bytes,
        expert_bytes_total=L * E * layout.expert_bytes, non_expert_bytes=non_expert, num_slots=slots,
        num_temp_slots=num_temp_slots, slot_bytes=(slots + num_temp_slots) * layout.expert_bytes,
        device_free=device_free_bytes(device), host_available=host_available_bytes(),
        checkpoint_files=sorted({e.file.name for e in tensors.values()}),
        checkpoint_layout=kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "none"))


def _prepare(name_or_path, capacity, device, dtype, pool, num_temp_slots, revision, expert_dtype="bfloat16"):
    """Skeleton, experts modules, layout (unquantized), checkpoint entries split by destination (with the fp8
    scales), and the plan (sized in ``expert_dtype``)."""
    from expertcast.inference.runtime.engine import _top_k_of

    model_dir = resolve_model_dir(name_or_path, revision)
    config, td = _config_and_dtype(model_dir, dtype, revision)
    block = check_quantization(config, model_dir)
    tensors = checkpoint_tensors(model_dir)
    model = build_skeleton(config, td)
    refs = find_experts_modules(model)
    layout = layout_of(refs[0].module)
    for r in refs[1:]:
        if layout_of(r.module) != layout:
            raise UnsupportedModelError(f"experts module {r.name} differs in shape/dtype from {refs[0].name}")
    ne, ex, unused, scales = _split_entries(tensors, KeyMapper(model, refs, _non_expert_tensors(model, refs, layout)),
                                            fp8=block is not None)
    split = (ne, ex, unused, Fp8Scales(scales, block))
    plan = _plan(model_dir, model, refs, quantized_layout(layout, expert_dtype), tensors, split[1], capacity,
                 torch.device(device), pool, num_temp_slots, _top_k_of(model))
    return model_dir, model, refs, layout, split, plan


def plan_offload(name_or_path: str | os.PathLike, capacity: Budget | float | int, *, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype | None = "auto", pool: str = "per-layer", num_temp_slots: int = 2,
                 revision: str | None = None, expert_dtype: str = "bfloat16") -> LoadPlan:
    """The sizes of offloading ``name_or_path`` at ``capacity`` (a :class:`Budget`, or its number form: a
    fraction of L*E, or int slots) on ``device``, read from config.json and the safetensors headers (no weights)."""
    return _prepare(name_or_path, Budget.parse(capacity), device, dtype, pool, num_temp_slots, revision,
                    ExpertFormat.parse(expert_dtype).name)[-1]


def _place(model: nn.Module, key: str, value: torch.Tensor) -> None:
    """Put ``value`` as parameter/buffer ``key`` of ``model`` (replacing the meta placeholder)."""
    mod_name, _, leaf = key.rpartition(".")
    mod = model.get_submodule(mod_name)
    if leaf in mod._parameters:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[leaf] = value


def _load_non_expert(model: nn.Module, non_expert: dict[str, torch.Tensor], entries: dict[str, TensorEntry],
                     reader: ShardReader, device: torch.device, fp8: Fp8Scales | None = None) -> None:
    """Read every non-expert tensor onto ``device`` (skeleton dtype), tie embeddings where the config
    says so, move the computed buffers; refuse a checkpoint that lacks one."""
    for key, entry in entries.items():
        want = non_expert[key]
        if tuple(entry.shape) != tuple(want.shape):
            raise UsageError(f"checkpoint tensor {entry.key} has shape {list(entry.shape)}, the model expects "
                             f"{list(want.shape)} for {key} (is config.json the checkpoint's?)")
        t = fp8.read(entry, reader) if entry.dtype == FP8 and fp8 is not None else reader.read(entry)
        _place(model, key, t.to(device=device, dtype=want.dtype))
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    state = model.state_dict(keep_vars=True)
    lacking = [k for k in non_expert if state[k].device.type == "meta"]
    if lacking:
        raise UsageError(f"the checkpoint lacks {', '.join(lacking[:4])}{' ...' if len(lacking) > 4 else ''} "
                         "(expected by the model's config)")
    for name, b in model.named_buffers():
        if b.device != device:
            _place(model, name, b.to(device))


def _release_experts(refs: list[MoELayerRef], layout: ExpertLayout, device: torch.device) -> None:
    """Replace the skeleton's meta expert parameters by empty tensors on the compute device."""
    for r in refs:
        for p in layout.parts:
            setattr(r.module, p.name, nn.Parameter(torch.empty(0, dtype=layout.dtype, device=device),
                                                   requires_grad=False))


def _split_entries(tensors: dict[str, TensorEntry], mapper: KeyMapper, fp8: bool = False):
    """(non-expert entries, expert entries by layer, unused keys, fp8 scales by weight key)."""
    non_expert: dict[str, TensorEntry] = {}
    experts: dict[int, list[tuple[TensorEntry, ExpertTarget]]] = {}
    unused: list[str] = []
    scales: dict[str, TensorEntry] = {}
    for key, entry in tensors.items():
        if fp8 and key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in tensors:
            scales[key.removesuffix(SCALE_SUFFIX)] = entry
            continue
        tgt = mapper.map(key)
        if tgt is None:
            unused.append(key)
        elif isinstance(tgt, ExpertTarget):
            experts.setdefault(tgt.layer, []).append((entry, tgt))
        else:
            non_expert[tgt] = entry
    return non_expert, experts, sorted(unused), scales


def _fill_store(layout: ExpertLayout, refs: list[MoELayerRef], fill: Callable[[int, torch.Tensor], None], pin: bool,
                mmap_path: str | os.PathLike | None) -> HostExpertStore:
    """The host store of ``layout`` (the store's, quantized or not) filled layer by layer by ``fill``."""
    L = len(refs)
    if mmap_path is not None:
        write_store_file(Path(mmap_path), [r.name for r in refs], layout, fill)
        return HostExpertStore.open_mmap(mmap_path)
    rows = torch.empty((L, layout.num_experts, layout.row_numel), dtype=layout.dtype, pin_memory=pin)
    for i in range(L):
        fill(i, rows[i])
    return HostExpertStore(rows, layout)


def _tokenizer(model_dir: Path, revision: str | None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False, revision=revision)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"{model_dir}: no usable tokenizer next to the model ({e})") from None


def _generation_config(model: nn.Module, model_dir: Path) -> None:
    if (model_dir / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(model_dir)


@dataclass(frozen=True)
class OffloadOptions:
    """How :func:`load_offloaded` builds the :class:`~expertcast.inference.runtime.engine.OffloadedModel`
    (the same for a streamed checkpoint and for a model built in host memory first)."""

    policy: Any
    """The cache policy (``make_policy(...)``), reset to the model's cache configuration."""
    capacity: Budget
    """Resident experts."""
    device: torch.device
    """Compute device: non-expert weights, slots and workspace live here."""
    pool: str = "per-layer"
    """Slot pools: ``per-layer`` (one pool per MoE layer) or ``shared`` (one pool for all layers)."""
    link_gbps: float | None = None
    """CPU only: emulated host-device bandwidth of the transfer thread in GB/s (None = memory speed)."""
    mmap_path: Path | None = None
    """Store file of the packed experts, memory-mapped (None = experts in host RAM)."""
    num_temp_slots: int = 2
    """Temporary slots (TEMP loads, prefill streaming, selections larger than a pool)."""
    future: Any = None
    """Oracles only (Belady): the access stream (``simulator.build_stream``) of the run to come."""
    cpu_exec_ms: Callable[[int], float] | None = None
    """CPU-device emulation only: ``n_tokens -> ms``, the least time an in-situ CPU execution of a cold
    expert takes (e.g. ``LatencyModel.cpu_ms``)."""
    decode_path: str = "eager"
    """``eager`` (the reference), ``graph`` or ``auto``: the decode step implementation."""
    store_kind: str = "ram"
    """``ram`` (the host store: host RAM, pinned on CUDA, or ``mmap_path``) or ``disk`` (the expert rows in the
    file ``disk_path``, read with direct I/O by a reader pool; docs/design.md, "Disk tier")."""
    disk_path: Path | None = None
    """The disk store file (``store_kind="disk"``): written from the checkpoint, then read."""
    readers: int = READERS
    """Reader threads of the disk store's reader pool."""
    prefetch_chunk_kb: int = PREFETCH_CHUNK_KB
    """The reader pool's block size in KiB of a prefetch read that yields to demand reads (0: whole reads, no
    yielding; :class:`~.disk_store.ReaderPoolEngine`)."""
    disk_io: str = "auto"
    """Disk store I/O: ``auto`` (O_DIRECT where accepted, else buffered + DONTNEED), ``direct`` or ``buffered``."""
    expert_dtype: str = "bfloat16"
    """The experts' format in the stores, slots and transfers (:class:`~.quant.ExpertFormat`: ``bfloat16`` =
    unquantized, the model's dtype; ``int8``, ``int4``, ...; docs/design.md, "Expert formats")."""

    def build(self, model: nn.Module, store: Any = None):
        """The OffloadedModel over ``model`` (with the filled ``store``, or packing one from the model's
        experts into host memory or ``mmap_path``)."""
        from expertcast.inference.runtime.engine import OffloadedModel

        if store is None and self.store_kind == "disk":
            from expertcast.inference.runtime.disk_store import DiskExpertStore, write_disk_store
            from expertcast.inference.runtime.store import _pack_layer

            refs = find_experts_modules(model)
            lay = quantized_layout(layout_of(refs[0].module), self.expert_dtype)
            write_disk_store(self.disk_path, [r.name for r in refs], lay, lambda i, buf: _pack_layer(refs[i].module, lay, buf))
            store = DiskExpertStore(self.disk_path, io=self.disk_io)
        elif store is None and ExpertFormat.parse(self.expert_dtype).quantized:
            store = HostExpertStore.from_model(model, pin_memory=self.device.type == "cuda", mmap_path=self.mmap_path,
                                               fmt=self.expert_dtype)
        return OffloadedModel(model, self.policy, self.capacity, pool=self.pool, device=self.device,
                              link_gbps=self.link_gbps, mmap_path=self.mmap_path, num_temp_slots=self.num_temp_slots,
                              future=self.future, store=store, cpu_exec_ms=self.cpu_exec_ms,
                              decode_path=self.decode_path, readers=self.readers,
                              prefetch_chunk_kb=self.prefetch_chunk_kb)

    def report(self, om: Any, plan: LoadPlan, t0: float, unused: list[str], source: str) -> LoadReport:
        """The :class:`LoadReport` of ``om``, loaded since ``t0`` (``time.perf_counter()``)."""
        dev = self.device
        disk = self.store_kind == "disk"
        bound = None
        if disk:  # host RSS: slots (on the CPU) + non-expert weights + one layer's rows being written + margin
            on_host = plan.slot_bytes + plan.non_expert_bytes if dev.type == "cpu" else 2 * om.transfer.readers * om.store.stride
            bound = on_host + plan.num_experts * plan.expert_bytes + RSS_MARGIN_BYTES
            if om.layout.quantized:  # the writer quantizes from one layer's unquantized rows (QuantizingFill)
                bound += plan.num_experts * om.layout.base.expert_bytes
        return LoadReport(plan=plan, load_seconds=time.perf_counter() - t0, store_pinned=om.store.is_pinned,
                          store_mmap=str(self.mmap_path) if self.mmap_path is not None else None,
                          unused_checkpoint_keys=unused, peak_rss_bytes=peak_rss_bytes(),
                          device_peak_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
                          source=source, store_kind=self.store_kind,
                          disk_path=str(self.disk_path) if disk else None,
                          disk_io_mode=om.store.io_mode if disk else None, readers=self.readers if disk else None,
                          prefetch_chunk_kb=om.transfer.chunk // 1024 if disk else None,  # what its pool runs
                          rss_bound_bytes=bound)


def load_offloaded(name_or_path: str | os.PathLike, policy: Any, capacity: Budget | float | int, *,
                   device: str | torch.device = "cpu", dtype: str | torch.dtype | None = "auto",
                   pool: str = "per-layer", link_gbps: float | None = None, mmap_path: str | os.PathLike | None = None,
                   num_temp_slots: int = 2, future: Any = None, cpu_exec_ms: Callable[[int], float] | None = None,
                   seed: int = 0, revision: str | None = None, decode_path: str = "eager", store: str = "ram",
                   disk_path: str | os.PathLike | None = None, readers: int = READERS, disk_io: str = "auto",
                   expert_dtype: str = "bfloat16", prefetch_chunk_kb: int = PREFETCH_CHUNK_KB):
    """(OffloadedModel, tokenizer, :class:`LoadReport`) of ``name_or_path`` loaded straight to the host store.

    Args:
        name_or_path: a local Hugging Face directory (config.json + safetensors; a fine-tuned export's
            ``model/`` folder, or the export folder itself), a Hub id, or what has no checkpoint to
            stream: a tiny preset name (random init) or an adapter export (merged on load), built in
            host memory, then offloaded.
        policy, capacity, pool, link_gbps, num_temp_slots, future, cpu_exec_ms, decode_path: as
            :class:`~expertcast.inference.runtime.engine.OffloadedModel` (capacity: a :class:`Budget`, or its
            number form: float = fraction of all L*E experts, int = slots); see :class:`OffloadOptions`.
        mmap_path: stream the packed experts into this store file and memory-map it (host RAM holds no
            copy beyond the page cache).
        store, disk_path, readers, disk_io, prefetch_chunk_kb: ``store="disk"`` streams the packed experts into the disk store
            file ``disk_path`` (4096-aligned rows) and reads them back with direct I/O through a pool of
            ``readers`` threads (see :class:`OffloadOptions`); host RSS stays within
            ``LoadReport.rss_bound_bytes`` whatever the file's size.
        expert_dtype: the experts' format (``bfloat16``, ``int8``, ``int4``, ``int4-g32`` ...): quantized layer
            by layer on the way into the store; block-scaled fp8 checkpoints are dequantized per tensor first.
    Raises:
        UsageError: the slots do not fit the device, the experts do not fit the host, or the
            checkpoint does not match its config.
    """
    from expertcast.models.backbone import export_model_dir, is_export_dir
    from expertcast.models.presets import get_preset, is_preset

    t0 = time.perf_counter()
    capacity = Budget.parse(capacity)
    if store not in ("ram", "disk"):
        raise UsageError(f"store must be 'ram' or 'disk', got {store!r}")
    if store == "disk" and (disk_path is None or mmap_path is not None):
        raise UsageError("store='disk' needs disk_path (the expert file) and no mmap_path")
    if store == "disk":  # temporary-slot reads fill the reader pool's depth (docs/design.md, "Compute order")
        num_temp_slots = max(int(num_temp_slots), int(readers))
    opts = OffloadOptions(policy, capacity, torch.device(device), pool=pool, link_gbps=link_gbps,
                          mmap_path=Path(mmap_path).expanduser() if mmap_path is not None else None,
                          num_temp_slots=num_temp_slots, future=future, cpu_exec_ms=cpu_exec_ms,
                          decode_path=decode_path, store_kind=store,
                          disk_path=Path(disk_path).expanduser() if disk_path is not None else None,
                          readers=readers, disk_io=disk_io, expert_dtype=ExpertFormat.parse(expert_dtype).name,
                          prefetch_chunk_kb=prefetch_chunk_kb)
    name = str(name_or_path)
    adapter_export = is_export_dir(name) and export_model_dir(name) is None
    if (is_preset(name) and get_preset(name).size == "tiny") or adapter_export:
        return _load_in_host(name, opts, dtype=dtype, seed=seed, t0=t0)
    dev = opts.device
    model_dir, model, refs, layout, split, plan = _prepare(name_or_path, capacity, dev, dtype, pool,
                                                            num_temp_slots, revision, opts.expert_dtype)
    plan.check_fits(mmap=opts.mmap_path is not None or opts.store_kind == "disk")
    file = opts.mmap_path if opts.mmap_path is not None else opts.disk_path
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(file.parent).free
        if plan.expert_bytes_total > free:
            raise UsageError(f"the expert store file {file} needs {gb(plan.expert_bytes_total)}, its disk "
                             f"has {gb(free)} free")
    non_expert_entries, expert_entries, unused, fp8 = split
    non_expert = _non_expert_tensors(model, refs, layout)
    store_lay = quantized_layout(layout, opts.expert_dtype)
    reader = ShardReader()
    try:
        _load_non_expert(model, non_expert, non_expert_entries, reader, dev, fp8)
        fill = _store_fill(store_lay, ExpertFiller(layout, reader, expert_entries, fp8).fill)
        if opts.store_kind == "disk":
            from expertcast.inference.runtime.disk_store import DiskExpertStore, write_disk_store

            write_disk_store(opts.disk_path, [r.name for r in refs], store_lay, fill)
            store = DiskExpertStore(opts.disk_path, io=opts.disk_io)
        else:
            store = _fill_store(store_lay, refs, fill, dev.type == "cuda", opts.mmap_path)
    finally:
        reader.close()
    _release_experts(refs, layout, dev)
    _generation_config(model, model_dir)
    om = opts.build(model, store)
    return om, _tokenizer(model_dir, revision), opts.report(om, plan, t0, unused, "checkpoint")


def _load_in_host(name: str, opts: OffloadOptions, *, dtype: str | torch.dtype | None, seed: int, t0: float):
    """What has no checkpoint to stream: a tiny random-init preset (``seed``), or a router-adaptation export
    that keeps a peft adapter (merged over its base on load). Built in host memory at ``dtype``, then
    offloaded per ``opts``; ``t0`` is when the load began."""
    from expertcast.models.backbone import load_moe_model

    model, tok = load_moe_model(name, dtype=dtype, device="cpu", seed=seed)
    om = opts.build(model)
    mem = om.memory_report()
    L, E, eb, dev = om.L, om.E, om.layout.expert_bytes, opts.device
    plan = LoadPlan(model_dir=name, device=str(dev), dtype=str(om.layout.act_dtype).removeprefix("torch."),
                    expert_format=om.layout.fmt,
                    num_layers=L, num_experts=E, top_k=om.K, expert_bytes=eb, expert_bytes_total=L * E * eb,
                    non_expert_bytes=mem.device_non_expert_bytes, num_slots=om.cache.num_slots,
                    num_temp_slots=opts.num_temp_slots, slot_bytes=om.pool.nbytes,
                    device_free=device_free_bytes(dev), host_available=host_available_bytes(),
                    checkpoint_layout="none")
    return om, tok, opts.report(om, plan, t0, [], "host")
