"""The embedded default model's pipeline on a tiny recipe: BPE tokenizer + Qwen3-MoE trained for a
few steps, saved as a loadable Hugging Face directory with a report, reused from the cache, resumed
after an interruption; the routing statistics it reports."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from expertcast.train import tiny_default as td

torch.set_num_threads(1)

TINY = td.TinyDefaultConfig(
    vocab_size=320, num_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    moe_intermediate_size=16, num_experts=8, top_k=2, seq_len=64, batch_size=4, lr=1e-2, warmup_steps=3,
    time_budget_s=120.0, max_steps=25, gsm8k_train_limit=150, cot_limit=1, eval_gsm8k_test=8, eval_cot=2,
    eval_max_len=192,
)


@pytest.fixture
def cache(tmp_path, monkeypatch, data_dir):
    monkeypatch.setenv("EXPERTCAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(data_dir))
    return tmp_path / "cache"


def test_build_load_and_reuse(cache, monkeypatch):
    path = td.ensure_default_model(TINY, progress=False, num_threads=1)
    assert path.parent == cache / "tiny-default-v1" and path.name == TINY.key(td._data_files())
    for f in ("config.json", "model.safetensors", "tokenizer.json", "report.json", "train_loss.png"):
        assert (path / f).is_file(), f
    assert not any(p.name.startswith(".") for p in path.parent.iterdir() if p.is_dir())  # no partial dirs left

    rep = json.loads((path / "report.json").read_text())
    assert rep["steps"] == 25 and rep["tokens_seen"] == 25 * 4 * 64
    assert rep["tokens_per_s"] > 0 and rep["train_time_s"] > 0
    ppl, ppl0 = rep["heldout_gsm8k_test"]["perplexity"], rep["heldout_gsm8k_test_init"]["perplexity"]
    assert math.isfinite(ppl) and ppl < ppl0 < 1.5 * 320  # training helped; init is near uniform
    assert rep["spec"]["num_experts"] == 8 and rep["spec"]["num_layers"] == 2
    for domain in ("gsm8k_test", "cot_heldout"):
        layers = rep["routing"][domain]["per_layer"]
        assert len(layers) == 2
        assert all(0 < r["entropy_norm"] <= 1 and 1 / 8 <= r["max_share"] <= 1 for r in layers)

    from expertcast.models.backbone import load_moe_model
    from expertcast.models.spec import MoESpec

    model, tok = load_moe_model(path)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and len(tok) == 320
    assert MoESpec.from_model(model).expert_bytes == 3 * 32 * 16 * 4
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]

    # Second call: served from the cache, no training.
    def boom(*a, **k):
        raise AssertionError("retrained although a cached model exists")

    monkeypatch.setattr(td, "build_default_model", boom)
    assert td.ensure_default_model(TINY, progress=False) == path
    # A changed recipe has another key (so it would retrain).
    assert dataclasses.replace(TINY, lr=2e-2).key(td._data_files()) != TINY.key(td._data_files())


def test_interrupted_build_resumes(cache, monkeypatch):
    calls = {"n": 0}
    orig = td._PackedStream.next_batch

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 13:
            raise KeyboardInterrupt
        return orig(self)

    monkeypatch.setattr(td._PackedStream, "next_batch", flaky)
    cfg = dataclasses.replace(TINY, max_steps=20, eval_gsm8k_test=2, eval_cot=0)
    with pytest.raises(KeyboardInterrupt):
        td.ensure_default_model(cfg, progress=False, checkpoint_every_s=1e-9, num_threads=1)
    partial = cache / "tiny-default-v1" / f".{cfg.key(td._data_files())}.partial" / "ckpt.pt"
    assert partial.is_file()
    path = td.ensure_default_model(cfg, progress=False, checkpoint_every_s=1e-9, num_threads=1)
    rep = td.load_report(path)
    assert rep["resumed"] == 1 and rep["steps"] == 20 and rep["tokens_seen"] == 20 * 4 * 64
    assert not partial.parent.exists()


def test_missing_data_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTCAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(tmp_path / "nodata"))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nodata")):
        td.ensure_default_model(TINY, progress=False)


def test_routing_stats_known_values():
    # One layer, E=4, K=2. Sequence: {0,1},{0,1},{2,3}: usage uniform (1 each of 4 -> entropy 1, share
    # 1/4 ... counts 0:2,1:2,2:1,3:1), overlaps 2/2 then 0/2.
    r = np.array([[[0, 1]], [[1, 0]], [[2, 3]]], dtype=np.int16)
    (row,) = td.routing_stats([r], num_experts=4)
    p = np.array([2, 2, 1, 1]) / 6
    assert row["entropy_norm"] == pytest.approx(float(-(p * np.log(p)).sum() / np.log(4)))
    assert row["max_share"] == pytest.approx(2 / 6)
    assert row["overlap"] == pytest.approx((2 + 0) / (2 * 2))
    # Overlap never crosses sequence boundaries.
    (row2,) = td.routing_stats([r[:2], r[2:]], num_experts=4)
    assert row2["overlap"] == pytest.approx(1.0)


def test_lr_schedule_warms_up_then_decays():
    cfg = td.TinyDefaultConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert td._lr_at(cfg, 0, 0.0) == pytest.approx(0.1)
    assert td._lr_at(cfg, 50, 0.0) == pytest.approx(1.0)
    assert td._lr_at(cfg, 50, 0.5) == pytest.approx(0.55)
    assert td._lr_at(cfg, 50, 1.0) == pytest.approx(0.1)


def test_yaml_recipe_matches_dataclass_defaults(tmp_path):
    from expertcast.utils.paths import REPO_ROOT

    assert td.TinyDefaultConfig.from_yaml(REPO_ROOT / "configs" / "tiny_default" / "default.yaml") == td.TinyDefaultConfig()
    bad = tmp_path / "bad.yaml"
    bad.write_text("vocab_size: 512\nnum_expert: 8\n")
    with pytest.raises(ValueError, match="num_expert"):
        td.TinyDefaultConfig.from_yaml(bad)


def test_cli_builds_then_reuses(cache, tmp_path, capsys):
    import yaml

    y = tmp_path / "tiny.yaml"
    y.write_text(yaml.safe_dump(dataclasses.asdict(dataclasses.replace(TINY, max_steps=4, eval_gsm8k_test=3, eval_cot=1))))
    assert td.main(["--config", str(y), "--no-progress", "--threads", "1"]) == 0
    first = capsys.readouterr().out
    assert "parameters" in first and "default model:" in first and "gsm8k_test" in first
    assert td.main(["--config", str(y), "--no-progress"]) == 0
    second = capsys.readouterr().out
    assert "parameters" not in second and "default model:" in second  # served from the cache
    assert td.main(["--config", str(tmp_path / "missing.yaml")]) == 1
