"""Write block-scaled FP8 checkpoints (docs/design.md, "Expert formats"): what DeepSeek-V3 and Qwen3-FP8 ship,
made from an unquantized safetensors checkpoint, shard by shard, for the loader's tests and demos.

Every linear projection weight (a 2-D ``*_proj.weight``, or Mixtral's ``w1``/``w2``/``w3``) becomes an e4m3
tensor beside its float32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]; embeddings, norms, routers and the
LM head stay as they were; config.json gains ``quantization_config`` (``quant_method: fp8``,
``weight_block_size: [128, 128]``, ``fmt: e4m3``, ``activation_scheme: dynamic``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from expertcast.inference.runtime.checkpoint import (
    INDEX_FILE,
    SCALE_SUFFIX,
    SINGLE_FILE,
    ShardReader,
    checkpoint_tensors,
)
from expertcast.inference.runtime.quant import quantize_fp8_blocks
from expertcast.utils.errors import UsageError

FP8_BLOCK = (128, 128)


def fp8_target(key: str, shape: tuple[int, ...]) -> bool:
    """Whether checkpoint tensor ``key`` is a linear projection weight an FP8 checkpoint stores in e4m3."""
    parts = key.split(".")
    if len(shape) != 2 or len(parts) < 2 or parts[-1] != "weight":
        return False
    return parts[-2].endswith("_proj") or parts[-2] in ("w1", "w2", "w3")


def write_fp8_checkpoint(src: str | os.PathLike, out: str | os.PathLike, block: tuple[int, int] = FP8_BLOCK,
                         overwrite: bool = False) -> Path:
    """Convert the unquantized checkpoint folder ``src`` into a block-scaled FP8 one at ``out`` (the other
    files copied); one shard in memory at a time. Returns ``out``."""
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise UsageError(f"{src}: no config.json")
    config = json.loads(cfg_path.read_text())
    if config.get("quantization_config"):
        raise UsageError(f"{src}: already quantized ({config['quantization_config'].get('quant_method')!r})")
    if out.exists():
        if not overwrite:
            raise UsageError(f"{out} exists (pass overwrite)")
        shutil.rmtree(out)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    entries = checkpoint_tensors(src)
    by_file: dict[Path, list] = {}
    for e in entries.values():
        by_file.setdefault(e.file, []).append(e)
    reader = ShardReader()
    weight_map: dict[str, str] = {}
    try:
        for f, es in sorted(by_file.items()):
            tensors = {}
            for e in sorted(es, key=lambda x: x.offset):
                t = reader.read(e)
                if fp8_target(e.key, e.shape) and t.is_floating_point():
                    q, s = quantize_fp8_blocks(t, block)
                    tensors[e.key], tensors[e.key + SCALE_SUFFIX] = q, s
                else:
                    tensors[e.key] = t
            save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, f.name))
            del tensors
    finally:
        reader.close()
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", INDEX_FILE):
            shutil.copy2(p, tmp / p.name)
    if (src / INDEX_FILE).is_file() or not (src / SINGLE_FILE).is_file():
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))},
                                                 indent=2))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, out)
    return out


def dequantized_state(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an FP8 checkpoint with its e4m3 weights dequantized to float32 (tests: the reference
    weights the loader must reproduce; holds the whole checkpoint)."""
    from expertcast.inference.runtime.quant import dequantize_fp8_blocks

    d = Path(model_dir)
    block = tuple(json.loads((d / "config.json").read_text())["quantization_config"]["weight_block_size"])
    entries = checkpoint_tensors(d)
    reader = ShardReader()
    try:
        out = {}
        for k, e in entries.items():
            if k.endswith(SCALE_SUFFIX):
                continue
            t = reader.read(e)
            if e.dtype == torch.float8_e4m3fn:
                t = dequantize_fp8_blocks(t, reader.read(entries[k + SCALE_SUFFIX]), block)
            out[k] = t
        return out
    finally:
        reader.close()
