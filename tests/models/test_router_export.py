"""Router exports: a manifest over every file (routers and the whole adaptation export), altered files
refused, training ids read back."""

from __future__ import annotations

import json

import pytest
import torch
from expertcast.models.cache_routers import CacheRouters
from expertcast.models.presets import build_tiny
from expertcast.models.router_export import (
    ADAPTATION_FILE,
    CONFIG_FILE,
    load_routers,
    read_adaptation_export,
    save_routers,
    training_ids,
)
from expertcast.utils.provenance import EXPORT_MANIFEST

torch.set_num_threads(1)


def test_router_json_edit_and_missing_manifest_refused(tmp_path):
    qwen = build_tiny("qwen3_moe-tiny")
    d = save_routers(tmp_path / "routers", CacheRouters.for_model(qwen, mode="temporal"), qwen, extra={"budget": 4})
    _, meta = load_routers(d, model=qwen)
    assert len(meta["export_hash"]) == 64
    cfg = json.loads((d / CONFIG_FILE).read_text())
    cfg["extra"]["budget"] = 8
    (d / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"{CONFIG_FILE} was modified"):
        load_routers(d)
    (d / EXPORT_MANIFEST).unlink()
    with pytest.raises(ValueError, match="re-export"):
        load_routers(d)


def test_adaptation_export_manifest_and_training_ids(tmp_path):
    from expertcast.train.router_module import RouterAdaptationModule

    module = RouterAdaptationModule(model="qwen3_moe-tiny", mode="temporal", budget=6)
    block = {"source": "gsm8k", "train_ids": ["gsm8k-train-00001", "gsm8k-train-00003"],
             "val_ids": ["gsm8k-train-00002"]}
    d = module.export(tmp_path / "export", training=block)
    info = read_adaptation_export(d)
    assert info["training"] == block and info["routers_dir"] == "routers" and len(info["export_hash"]) == 64
    assert training_ids(d) == {"gsm8k-train-00001", "gsm8k-train-00002", "gsm8k-train-00003"}
    load_routers(d / "routers")  # the routers folder keeps its own manifest too
    # the top-level manifest covers the model weights as well
    weights = next((d / "model").glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"model/{weights.name} was modified"):
        read_adaptation_export(d)
    weights.write_bytes(bytes(raw[:-1]) + bytes([raw[-1] ^ 0xFF]))
    read_adaptation_export(d)
    plain = module.export(tmp_path / "plain")
    assert training_ids(plain) is None
    (plain / ADAPTATION_FILE).write_text("{}")
    with pytest.raises(ValueError, match=f"{ADAPTATION_FILE} was modified"):
        training_ids(plain)
