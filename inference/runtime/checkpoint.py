"""The tensors of a safetensors checkpoint read from their headers, and read into place without pickle
(docs/design.md, "Runtime": loading straight to the host store)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from expertcast.inference.runtime.store import UnsupportedModelError, _read_safetensors_header
from expertcast.utils.errors import UsageError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}
FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
"""Block-scaled FP8 checkpoints (DeepSeek-V3, Qwen3-FP8): ``X.weight`` (e4m3) beside ``X.weight_scale_inv``."""


# --------------------------------------------------------------------------------------------- checkpoint
@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors shard: where its bytes are and what they are."""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset of the data in ``file``."""
    nbytes: int


def checkpoint_tensors(model_dir: str | os.PathLike) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in ``model_dir`` (``model.safetensors``, or the shards listed by
    ``model.safetensors.index.json``), read from the headers only (no pickle, no weights)."""
    d = Path(model_dir)
    if (d / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((d / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UsageError(f"{d / INDEX_FILE}: not a safetensors index ({e})") from None
        files = sorted({d / f for f in weight_map.values()})
    elif (d / SINGLE_FILE).is_file():
        weight_map, files = None, [d / SINGLE_FILE]
    else:
        raise FileNotFoundError(f"model directory {d} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                                "(only safetensors checkpoints can be loaded straight to the host store)")
    out: dict[str, TensorEntry] = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{d / INDEX_FILE} lists shard {f.name}, which does not exist")
        header, start = _read_safetensors_header(f)
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if weight_map is not None and weight_map.get(key) != f.name:
                continue
            if info["dtype"] not in _ST_DTYPES:
                raise UnsupportedModelError(f"{f.name}: tensor {key} has dtype {info['dtype']}, which the loader "
                                            f"does not read (supported: {', '.join(_ST_DTYPES)})")
            b, e = info["data_offsets"]
            out[key] = TensorEntry(key, f, _ST_DTYPES[info["dtype"]], tuple(info["shape"]), start + b, e - b)
    return out


class ShardReader:
    """Reads tensors from safetensors shards with plain ``readinto`` (one open file per shard)."""

    def __init__(self) -> None:
        self._files: dict[Path, Any] = {}

    def _file(self, path: Path):
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "rb")  # noqa: SIM115 - closed by close()
        return f

    def read_into(self, entry: TensorEntry, out: torch.Tensor, start: int = 0) -> None:
        """Fill the contiguous CPU tensor ``out`` with ``out.nbytes`` bytes of ``entry`` from byte ``start``."""
        n = out.numel() * out.element_size()
        if start + n > entry.nbytes:
            raise UsageError(f"{entry.file.name}: tensor {entry.key} is shorter than its shape says")
        f = self._file(entry.file)
        f.seek(entry.offset + start)
        if f.readinto(out.view(-1).view(torch.uint8).numpy()) != n:
            raise UsageError(f"{entry.file.name}: truncated file (tensor {entry.key})")

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor on the CPU (a fresh tensor of the checkpoint's dtype)."""
        t = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(entry, t)
        return t

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
