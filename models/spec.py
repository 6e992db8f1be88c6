"""`MoESpec`: the numbers of an MoE model that caches, traces and cost models need.

Read from a transformers config (no weights: ``MoESpec.from_config(get_config("qwen3-30b-a3b"))``)
or from a built model (``MoESpec.from_model(model)``, which inspects the actual expert tensors).
Layer indexing: the spec's ``moe_layers`` are decoder-layer indices; traces index MoE layers
0..L-1 in that order (``moe_layers[l]`` is the decoder layer of trace layer ``l``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from expertcast.models.dtypes import parse_dtype
from expertcast.models.families import (
    UnsupportedModelError,
    check_config,
    family,
    family_of,
    registry,
    supported_message,
)

__all__ = ["SPEC_FORMAT_VERSION", "MoESpec", "UnsupportedModelError", "expert_numel", "moe_layer_indices",
           "unsupported_message"]

SPEC_FORMAT_VERSION = 1


def _supported() -> dict[str, str]:
    return {k: s.config_class for k, s in registry().items()}


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_FAMILIES":  # read from the family registry (models/families), never a second list
        return _supported()
    raise AttributeError(name)


def unsupported_message(config: Any) -> str:
    mt = getattr(config, "model_type", None)
    return f"{type(config).__name__} (model_type {mt!r}) is not a supported MoE architecture; {supported_message()}"


def _config_dtype(config: Any) -> torch.dtype:
    d = getattr(config, "dtype", None)
    if d is None:
        d = getattr(config, "torch_dtype", None)
    return parse_dtype(d) or torch.float32


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def moe_layer_indices(config: Any) -> list[int]:
    """Decoder-layer indices that hold a routed-expert MLP, by the rules of the family's transformers modeling
    code (:class:`~expertcast.models.families.spec.FamilySpec`)."""
    return family_of(config).moe_layers(config)


def expert_numel(model_type: str, hidden_size: int, intermediate_size: int) -> int:
    """Elements of ONE routed expert of family ``model_type`` (:meth:`FamilySpec.expert_numel`)."""
    return family(model_type).expert_numel(hidden_size, intermediate_size)


@dataclass
class MoESpec:
    """Sizes of an MoE model's routed experts."""

    model_id: str
    """Hub id, local path or preset name the spec was read from."""
    family: str
    """transformers ``model_type`` (``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``olmoe``, ``deepseek_v2``, ``deepseek_v3``,
    ``gpt_oss``)."""
    moe_layers: list[int]
    """Decoder-layer index of each MoE layer, ascending (trace layer l is decoder layer moe_layers[l])."""
    num_decoder_layers: int
    """All decoder layers, dense ones included."""
    num_experts: int
    """E: routed experts per MoE layer."""
    top_k: int
    """K: routed experts selected per token per MoE layer."""
    num_shared_experts: int
    """Always-active shared experts per MoE layer (Qwen2-MoE: 1; DeepSeek-V2/V3: n_shared_experts; else 0)."""
    hidden_size: int
    expert_intermediate_size: int
    """Intermediate size of one routed expert's MLP."""
    expert_bytes: int
    """Bytes of ONE routed expert's weights at ``dtype`` (biases included where the family has them)."""
    dtype: str
    """Dtype of the expert weights, e.g. ``"bfloat16"``."""
    format_version: int = SPEC_FORMAT_VERSION

    @property
    def num_layers(self) -> int:
        """L: number of MoE layers (= len(moe_layers))."""
        return len(self.moe_layers)

    @property
    def expert_mb(self) -> float:
        """Size of one routed expert in decimal megabytes (1 MB = 1e6 bytes)."""
        return self.expert_bytes / 1e6

    @property
    def total_expert_bytes(self) -> int:
        """Bytes of all routed experts of all MoE layers (L·E·expert_bytes)."""
        return self.num_layers * self.num_experts * self.expert_bytes

    @property
    def total_experts(self) -> int:
        """L·E."""
        return self.num_layers * self.num_experts

    @classmethod
    def from_config(cls, config: Any, dtype: str | torch.dtype | None = None, model_id: str | None = None) -> MoESpec:
        """Spec of a transformers config (no weights needed). ``dtype`` overrides the config's dtype
        (default float32 when the config names none)."""
        fam = family_of(config)
        check_config(config)
        dt = (parse_dtype(dtype) or torch.float32) if dtype is not None else _config_dtype(config)
        H, Ie = int(config.hidden_size), fam.expert_intermediate(config)
        elem = torch.empty((), dtype=dt).element_size()
        return cls(
            model_id=model_id or getattr(config, "_name_or_path", "") or fam.name,
            family=fam.name,
            moe_layers=fam.moe_layers(config),
            num_decoder_layers=int(config.num_hidden_layers),
            num_experts=fam.num_experts(config),
            top_k=int(config.num_experts_per_tok),
            num_shared_experts=fam.shared_experts(config),
            hidden_size=H,
            expert_intermediate_size=Ie,
            expert_bytes=fam.expert_numel(H, Ie) * elem,
            dtype=_dtype_name(dt),
        )

    @classmethod
    def from_model(cls, model: Any, model_id: str | None = None) -> MoESpec:
        """Spec of a built model, read from its modules: MoE layers are the decoder layers whose MLP
        holds fused ``experts``; expert bytes are the expert tensors' bytes divided by E. Raises
        when the model disagrees with its config (the config-only numbers would then be wrong)."""
        config = model.config
        fam = family_of(config)
        layers = _decoder_layers(model)
        moe_layers, per_expert, dtype = [], None, None
        E = fam.num_experts(config)
        for i, layer in enumerate(layers):
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is None:
                continue
            moe_layers.append(i)
            tensors = list(experts.parameters(recurse=False)) or list(experts.parameters())
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if any(t.shape[0] != E for t in tensors):
                raise ValueError(f"layer {i}: expert tensors {[tuple(t.shape) for t in tensors]} do not have "
                                 f"E={E} leading rows")
            if per_expert is None:
                per_expert, dtype = nbytes // E, tensors[0].dtype
            elif nbytes // E != per_expert:
                raise ValueError(f"layer {i}: {nbytes // E} bytes per expert, layer {moe_layers[0]} has {per_expert}")
        if not moe_layers:
            raise UnsupportedModelError(f"{type(model).__name__} has no layer with fused experts")
        spec = cls.from_config(config, dtype=dtype, model_id=model_id or getattr(config, "_name_or_path", None))
        if spec.moe_layers != moe_layers:
            raise ValueError(f"model has MoE layers {moe_layers} but its config implies {spec.moe_layers}")
        if spec.expert_bytes != per_expert:
            raise ValueError(f"model's experts hold {per_expert} bytes each but the config implies {spec.expert_bytes}")
        return spec

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_layers"] = self.num_layers
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoESpec:
        version = d.get("format_version", SPEC_FORMAT_VERSION)
        if version > SPEC_FORMAT_VERSION:
            raise ValueError(f"MoESpec format version {version} is newer than this expertcast ({SPEC_FORMAT_VERSION})")
        missing = [f for f in cls.__dataclass_fields__ if f not in d and f != "format_version"]
        if missing:
            raise ValueError(f"MoESpec dict lacks {missing}")
        spec = cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        if "num_layers" in d and d["num_layers"] != spec.num_layers:
            raise ValueError(f"MoESpec dict: num_layers={d['num_layers']} but moe_layers has {spec.num_layers}")
        return spec


def _decoder_layers(model: Any):
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"{type(model).__name__}: no decoder layers found at .model.layers")
    return layers


def check_model_compatible(meta: Any, model_or_spec: Any) -> None:
    """Raise ValueError (naming both sides) unless the traces' L/E/K and MoE layers (``meta``, a
    :class:`~expertcast.data.trace_format.TraceMeta`) match the model.

    ``model_or_spec``: a transformers MoE model or an :class:`MoESpec`.
    """
    spec = model_or_spec if isinstance(model_or_spec, MoESpec) else MoESpec.from_model(model_or_spec)
    meta.check_compatible(spec.num_layers, spec.num_experts, spec.top_k, what=f"model {spec.model_id!r}")
    if meta.moe_layers is not None and list(meta.moe_layers) != list(spec.moe_layers):
        raise ValueError(f"trace of {meta.model_id!r} has MoE layers {meta.moe_layers} but the model "
                         f"{spec.model_id!r} has {spec.moe_layers}")
