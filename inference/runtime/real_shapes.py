"""Random-weight checkpoints of real MoE configurations, written without holding the model in RAM
(docs/design.md, "Real shapes").

It lives beside the loader it writes for (its keys are checked with the loader's own mapping). A *shape* is
a registered preset (:mod:`expertcast.models.presets`; the real ones are written from the
released ``config.json`` values: ``deepseek-v2-lite``, ``qwen3-30b-a3b``, ...). :func:`build_shape` writes a
Hugging Face model folder of that configuration with random weights:

1. the model is instantiated with every parameter on the meta device (:func:`~expertcast.inference.runtime.loading.build_skeleton`),
   which gives every tensor's name, shape and dtype and allocates none of them;
2. the checkpoint keys are the ones a released checkpoint of the family has: non-expert tensors under their
   state-dict names, routed experts as per-expert tensors (``...experts.3.gate_proj.weight``) wherever
   transformers' checkpoint conversion mapping fuses them on load (the inverse of that mapping), fused
   tensors otherwise; every key is checked to map back, through the runtime's own
   :class:`~expertcast.inference.runtime.loading.KeyMapper`, to the tensor it was made for;
3. each tensor is generated in blocks of :data:`BLOCK_NUMEL` elements, block ``j`` of tensor ``key`` from a
   generator seeded by ``sha256(seed, key, j)``: the values depend on the seed and the tensor's name only (not
   on the shard layout or on the other tensors), so a build is deterministic and any tensor can be
   regenerated alone (:func:`tensor_values`). Matrices are N(0, ``initializer_range``), 1-D weights (norms)
   ones, biases zeros; persistent buffers are written as the skeleton computes them;
4. shards (``model-0000i-of-0000n.safetensors``, at most ``shard_bytes`` each, with
   ``model.safetensors.index.json`` as transformers writes it) are streamed block by block, so the memory a
   build takes is the skeleton plus one block, whatever the model size; their sha256 is computed on the way;
5. ``config.json``, ``generation_config.json``, the byte-level tokenizer (so that every command can open the
   folder; token ids of forced-routing replays come from the traces) and ``build_shape.json`` (the
   provenance: shape, config values, seed, dtype, layers, code version, shard hashes) are written beside the
   shards, all in a temporary folder renamed into place at the end. The free disk space is checked against
   the computed size before anything is written.

    >>> report = build_shape("deepseek-v2-lite", "/data/ds-v2-lite-random", layers=4)
    >>> report.checkpoint_bytes, report.num_params
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

PROVENANCE_FILE = "build_shape.json"
"""The build's provenance, beside the shards; also what marks a folder as written by :func:`build_shape`."""
BUILD_FORMAT_VERSION = 1
BLOCK_NUMEL = 1 << 24
"""Elements generated per block (16 Mi: 64 MiB of float32 while it is generated)."""
DEFAULT_SHARD_BYTES = 4 * 10**9
"""Bytes per shard at most (transformers' own default is 5 GB); a single larger tensor gets a shard of its own."""
DISK_MARGIN_BYTES = 64 * 2**20
"""Free space kept beyond the computed size (config, tokenizer, index, provenance, file-system slack)."""
INDEX_FILE = "model.safetensors.index.json"

_ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


@dataclass(frozen=True)
class PlannedTensor:
    """One checkpoint tensor of a build: its key, what it is, and how its values are made."""

    key: str
    """Checkpoint key (what a released checkpoint of the family names it)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str
    """``normal`` (N(0, std)), ``ones``, ``zeros`` or ``buffer`` (the skeleton's computed values)."""
    std: float = 0.0
    expert: bool = False
    """A routed-expert tensor (it goes to the expert store on load)."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class CheckpointPlan:
    """Every tensor a build writes, in write order, with the skeleton it was read from."""

    config: Any
    tensors: list[PlannedTensor]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Persistent buffers' values (small; e.g. DeepSeek-V3's ``e_score_correction_bias``)."""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors if t.init != "buffer")

    @property
    def expert_params(self) -> int:
        return sum(t.numel for t in self.tensors if t.expert)


@dataclass
class BuildReport:
    """What :func:`build_shape` wrote."""

    out: str
    shape: str
    num_params: int
    """Parameters written (all tensors but persistent buffers)."""
    routed_expert_params: int
    non_expert_params: int
    active_params_per_token: int
    """Non-expert parameters + K routed experts of every MoE layer (what one token computes with)."""
    checkpoint_bytes: int
    """Bytes of tensor data in the shards."""
    num_shards: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    """Bytes of one routed expert (one store row)."""
    seconds: float
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``{file: {"bytes", "sha256", "tensors"}}``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------- config
def shape_config(shape: str, layers: int | None = None, overrides: dict[str, Any] | None = None):
    """The transformers config of preset ``shape`` with ``overrides`` applied, truncated to ``layers`` decoder
    layers (None: all). UsageError (one line) for an unknown shape or a truncation that leaves no MoE layer."""
    from expertcast.models.families import config_keys, config_problems
    from expertcast.models.presets import get_config, get_preset, list_presets
    from expertcast.models.spec import UnsupportedModelError, moe_layer_indices
    from expertcast.utils.errors import UsageError

    try:
        preset = get_preset(shape)
    except KeyError:
        raise UsageError(f"unknown shape {shape!r}; shapes: {', '.join(list_presets('real'))} "
                         f"(or a tiny preset: {', '.join(list_presets('tiny'))})") from None
    kwargs = dict(overrides or {})
    known = config_keys(preset.model_type) | set(preset.config)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        import difflib

        near = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
        raise UsageError(f"--set {', '.join(unknown)}: not a field of {preset.model_type}'s config class"
                         + "".join(f" (did you mean {m[0]}?)" for m in near.values() if m)
                         + " (a misspelled key would be written into config.json and ignored)")
    try:
        config = get_config(shape, **kwargs)
    except Exception as e:  # the config class's own validation: TypeError, ValueError, huggingface_hub's
        first = " ".join(str(e).split())  # StrictDataclassFieldValidationError (an Exception)
        raise UsageError(f"shape {shape!r} with overrides {kwargs}: {first}") from None
    n = int(config.num_hidden_layers)
    if layers is not None:
        if not 1 <= layers <= n:
            raise UsageError(f"--layers {layers}: shape {shape!r} has {n} decoder layers (give 1..{n})")
        config.num_hidden_layers = layers
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:layers]
    try:
        moe = moe_layer_indices(config)
    except UnsupportedModelError as e:
        raise UsageError(str(e)) from None
    problems = [p for p in config_problems(config) if "no decoder layer" not in p]
    if problems:
        raise UsageError(f"shape {shape!r} with overrides {kwargs}: {'; '.join(problems)}")
    if not moe:
        raise UsageError(f"shape {shape!r} truncated to {config.num_hidden_layers} layers has no MoE layer "
                         f"(its dense layers come first): give more --layers")
    return config


# --------------------------------------------------------------------------------------------- plan
def checkpoint_plan(config: Any, dtype: torch.dtype = torch.bfloat16) -> CheckpointPlan:
    """Every tensor of a checkpoint of ``config`` at ``dtype``, from the meta-device skeleton (no weights
    allocated), under the keys of a released checkpoint; each key checked to load back where it belongs."""
    from expertcast.inference.runtime.loading import (
        ExpertTarget,
        KeyMapper,
        _concat_dim,
        _non_expert_tensors,
        build_skeleton,
    )
    from expertcast.inference.runtime.store import find_experts_modules, layout_of
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    model = build_skeleton(config, dtype)
    refs = find_experts_modules(model)
    layout = layout_of(refs[0].module)
    non_expert = _non_expert_tensors(model, refs, layout)
    mapper = KeyMapper(model, refs, non_expert)
    converters = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightConverter)]
    std = float(getattr(config.get_text_config(), "initializer_range", 0.02) or 0.02)
    tensors: list[PlannedTensor] = []
    buffers: dict[str, torch.Tensor] = {}
    expected: dict[str, Any] = {}
    expert_of = {f"{r.name}.{p.name}": (li, r, p) for li, r in enumerate(refs) for p in layout.parts}
    done_modules: set[str] = set()
    seen_ids: set[int] = set()
    for key, t in model.state_dict(keep_vars=True).items():
        if key in expert_of:
            li, r, _ = expert_of[key]
            if r.name in done_modules:
                continue
            done_modules.add(r.name)
            for e in range(layout.num_experts):
                for p in layout.parts:
                    for ck, shape, tgt in _expert_keys(f"{r.name}.{p.name}", p.shape, e, li, converters,
                                                       _concat_dim, ExpertTarget):
                        if tgt.expert is None and e > 0:
                            continue  # a fused tensor holds every expert: written once
                        full = (layout.num_experts, *p.shape) if tgt.expert is None else shape
                        tensors.append(PlannedTensor(ck, tuple(full), layout.dtype, "normal", std, expert=True))
                        expected[ck] = tgt
            continue
        if id(t) in seen_ids:
            continue  # a tied weight (e.g. lm_head = embed_tokens): the loader ties it
        seen_ids.add(id(t))
        if t.device.type != "meta":
            buffers[key] = t.detach().clone()
            tensors.append(PlannedTensor(key, tuple(t.shape), t.dtype, "buffer"))
        elif t.ndim >= 2:
            tensors.append(PlannedTensor(key, tuple(t.shape), t.dtype, "normal", std))
        else:
            tensors.append(PlannedTensor(key, tuple(t.shape), t.dtype, "zeros" if key.endswith("bias") else "ones"))
        expected[key] = key
    for pt in tensors:  # every key must land where it was made for, by the loader's own mapping
        got = mapper.map(pt.key)
        if got != expected[pt.key]:
            raise RuntimeError(f"build plan: checkpoint key {pt.key} would load as {got}, not {expected[pt.key]}")
    return CheckpointPlan(config, tensors, buffers)


def _expert_keys(target: str, part_shape: tuple[int, ...], e: int, layer: int, converters, concat_dim, ExpertTarget):
    """Checkpoint keys of expert ``e``'s share of the fused parameter ``target`` (``...experts.gate_up_proj``):
    the converter's per-expert sources (gate then up, split along the concatenated dim) where one fuses it,
    else the fused key itself. Yields (key, shape, the ExpertTarget the loader must map it to)."""
    part = target.rpartition(".")[2]
    for conv in converters:
        tp = next((p for p in conv.target_patterns if target.endswith(p)), None)
        if tp is None or "*" in tp:
            continue
        prefix = target[: len(target) - len(tp)]
        dim = concat_dim(conv)
        n = len(conv.source_patterns)
        shape = list(part_shape)
        if shape[dim] % n:
            raise RuntimeError(f"{target}: dim {dim} of {part_shape} does not split into {n} sources")
        shape[dim] //= n
        for c, src in enumerate(conv.source_patterns):
            yield prefix + src.replace("*", str(e)), tuple(shape), ExpertTarget(layer, part, e, c, n, dim)
        return
    yield target, tuple(part_shape), ExpertTarget(layer, part, None)


# --------------------------------------------------------------------------------------------- values
def _block_seed(seed: int, key: str, block: int) -> int:
    h = hashlib.sha256(f"expertcast-real-shape\0{seed}\0{key}\0{block}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _blocks(t: PlannedTensor, seed: int, buffers: dict[str, torch.Tensor]) -> Iterator[torch.Tensor]:
    """The values of ``t``, flat, block by block (each block a fresh CPU tensor of ``t.dtype``)."""
    if t.init == "buffer":
        yield buffers[t.key].reshape(-1).to(t.dtype).contiguous()
        return
    for j, a in enumerate(range(0, t.numel, BLOCK_NUMEL)):
        n = min(BLOCK_NUMEL, t.numel - a)
        if t.init == "ones":
            yield torch.ones(n, dtype=t.dtype)
        elif t.init == "zeros":
            yield torch.zeros(n, dtype=t.dtype)
        else:
            g = torch.Generator().manual_seed(_block_seed(seed, t.key, j))
            x = torch.randn(n, generator=g, dtype=torch.float32)
            yield x.mul_(t.std).to(t.dtype)


def tensor_values(t: PlannedTensor, seed: int, buffers: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Tensor ``t`` of a build with ``seed``, regenerated alone (what the shard holds, bit for bit)."""
    flat = torch.cat(list(_blocks(t, seed, buffers or {}))) if t.numel else torch.empty(0, dtype=t.dtype)
    return flat.view(t.shape)


# --------------------------------------------------------------------------------------------- shards
def _assign_shards(tensors: list[PlannedTensor], shard_bytes: int) -> list[list[PlannedTensor]]:
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(tensors: list[PlannedTensor]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        header[t.key] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    return hb + b" " * ((-len(hb)) % 8)


def _write_shard(path: Path, tensors: list[PlannedTensor], seed: int, buffers: dict[str, torch.Tensor],
                 progress: Any = None) -> str:
    """Stream ``tensors`` into the safetensors file ``path``; returns its sha256."""
    h = hashlib.sha256()
    hb = _header(tensors)
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(hb)), hb):
            f.write(chunk)
            h.update(chunk)
        for t in tensors:
            for block in _blocks(t, seed, buffers):
                mv = block.view(torch.uint8).numpy().data if block.numel() else b""
                f.write(mv)
                h.update(mv)
            if progress is not None:
                progress(t)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- build
def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    from expertcast.models.dtypes import parse_dtype

    out = parse_dtype(dtype)
    if out not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"--dtype {dtype}: a build writes bfloat16, float16 or float32")
    return out


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def build_shape(shape: str, out: str | os.PathLike, *, layers: int | None = None, seed: int = 0,
                dtype: str | torch.dtype = "bfloat16", overrides: dict[str, Any] | None = None,
                shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, progress: bool = False) -> BuildReport:
    """Write a random-weight checkpoint of shape ``shape`` to the folder ``out`` (see the module docstring).

    Args:
        shape: a preset name (``deepseek-v2-lite``, ``qwen3-30b-a3b``, ... or a tiny preset).
        layers: keep the first ``layers`` decoder layers (None: all), for runs that fit in RAM.
        seed: the weights' seed (with each tensor's name).
        dtype: dtype of the weights (router weights that the family keeps in float32 stay float32).
        overrides: config fields replaced (e.g. a reduced width for tests); recorded in the provenance.
        shard_bytes: bytes per shard at most.
        overwrite: replace ``out`` when it holds an earlier build (a folder with ``build_shape.json``).
    Raises:
        UsageError: ``out`` exists (and is not an earlier build with ``overwrite``), the disk lacks room, or
            the shape/layers/overrides are invalid.
    """
    from expertcast.models.presets import get_preset
    from expertcast.models.spec import MoESpec
    from expertcast.models.tokenizer import byte_level_tokenizer
    from expertcast.utils.errors import UsageError
    from expertcast.utils.io import atomic_write_json, replace_dir
    from expertcast.utils.provenance import code_version
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    out = Path(out).expanduser()
    if out.exists():
        if not (out.is_dir() and (out / PROVENANCE_FILE).is_file()):
            raise UsageError(f"{out} exists and is not a build-shape output; choose a new folder")
        if not overwrite:
            raise UsageError(f"{out} already holds a build (see its {PROVENANCE_FILE}); pass --overwrite to replace it")
    td = _dtype(dtype)
    config = shape_config(shape, layers, overrides)
    config.dtype = td
    plan = checkpoint_plan(config, td)
    shards = _assign_shards(plan.tensors, shard_bytes)
    total = plan.total_bytes + sum(len(_header(s)) + 8 for s in shards)
    free = _free_bytes(out.parent)
    if total + DISK_MARGIN_BYTES > free:
        raise UsageError(f"not enough disk space for shape {shape!r}: the checkpoint needs {_size(total)} "
                         f"(+{DISK_MARGIN_BYTES / 2**20:.0f} MiB margin), {out.parent} has {_size(free)} free")
    spec = MoESpec.from_config(config, dtype=td, model_id=str(out))
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    written = [0]

    def tick(t: PlannedTensor) -> None:
        written[0] += t.nbytes
        step = written[0] * 10 // max(total, 1)
        if progress and step != (written[0] - t.nbytes) * 10 // max(total, 1):
            print(f"  {10 * step:3d}%  {written[0] / 1e9:7.2f} / {total / 1e9:.2f} GB  {time.perf_counter() - t0:6.1f} s",
                  flush=True)

    try:
        n = len(shards)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)] if n > 1 else ["model.safetensors"]
        shard_info: dict[str, dict[str, Any]] = {}
        weight_map: dict[str, str] = {}
        for name, ts in zip(names, shards, strict=True):
            digest = _write_shard(tmp / name, ts, seed, plan.buffers, tick)
            shard_info[name] = {"bytes": (tmp / name).stat().st_size, "sha256": digest, "tensors": len(ts)}
            weight_map.update({t.key: name for t in ts})
        if n > 1:
            atomic_write_json(tmp / INDEX_FILE, {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map})
        preset = get_preset(shape)
        config.architectures = [_architecture(config)]
        config._name_or_path = str(out)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        byte_level_tokenizer().save_pretrained(tmp)
        moe = spec.num_layers
        K, E = spec.top_k, spec.num_experts
        expert_params = plan.expert_params
        per_expert = expert_params // max(moe * E, 1)
        report = BuildReport(
            out=str(out), shape=shape, num_params=plan.num_params, routed_expert_params=expert_params,
            non_expert_params=plan.num_params - expert_params,
            active_params_per_token=plan.num_params - expert_params + moe * K * per_expert,
            checkpoint_bytes=plan.total_bytes, num_shards=n, num_moe_layers=moe, num_experts=E, top_k=K,
            expert_bytes=spec.expert_bytes, seconds=0.0, shards=shard_info)
        report.seconds = time.perf_counter() - t0
        atomic_write_json(tmp / PROVENANCE_FILE, {
            "format": "expertcast-build-shape", "format_version": BUILD_FORMAT_VERSION,
            "shape": shape, "hub_id": preset.hub_id, "seed": seed, "dtype": str(td).removeprefix("torch."),
            "layers": layers, "overrides": dict(overrides or {}), "shard_bytes": shard_bytes,
            "init": {"matrices": f"normal(0, {plan.tensors[0].std if plan.tensors else 0})", "norms": "ones",
                     "biases": "zeros", "buffers": "as computed by the model", "block_numel": BLOCK_NUMEL,
                     "block_seed": "sha256('expertcast-real-shape', seed, key, block)[:8]"},
            "config": config.to_dict(), "spec": spec.to_dict(), "code": code_version(), "report": report.to_dict(),
            "note": "random weights: outputs are meaningless; the tokenizer is expertcast's byte-level one "
                    "(forced-routing replays take their token ids from the traces)"})
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _architecture(config: Any) -> str:
    """The causal-LM class name transformers maps ``config`` to (e.g. ``DeepseekV2ForCausalLM``)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__


def read_provenance(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``build_shape.json`` of a built folder, or None when ``model_dir`` is not one."""
    f = Path(model_dir) / PROVENANCE_FILE
    if not f.is_file():
        return None
    return json.loads(f.read_text(encoding="utf-8"))
