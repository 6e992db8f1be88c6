"""End to end on a tiny preset: `expertcast fit` with the router YAML (LoRA through peft), export,
reload without Lightning, teacher-forced recording, and simulator replay of the router policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    from expertcast.commands.fit import main as fit_main

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("router_fit")
    rc = fit_main([
        "fit", "--config", str(REPO / "configs/router/tiny.yaml"),
        "--model.init_args.model", "qwen3_moe-tiny",
        "--model.init_args.mode", "full",
        "--model.init_args.budget", "6",
        "--model.init_args.lora", '{"r": 4, "alpha": 8}',
        "--model.init_args.export_dir", str(out / "export"),
        "--data.init_args.limit", "48", "--data.init_args.heldout", "0.2", "--data.init_args.max_length", "96",
        "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
        "--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out / "runs"),
    ])
    assert rc == 0
    return out / "export"


def test_fit_exports_merged_model_and_routers(fitted):
    from expertcast.models.router_export import read_adaptation_export, training_ids

    info = read_adaptation_export(fitted)  # the manifest over model, routers and JSON checks out
    assert info["mode"] == "full" and info["budget"] == 6 and info["steps"] == 4
    t = info["training"]
    assert t["source"] == "gsm8k" and t["train_ids"] and t["val_ids"] and not set(t["train_ids"]) & set(t["val_ids"])
    assert training_ids(fitted) == set(t["train_ids"]) | set(t["val_ids"])
    assert (fitted.parent / "runs").is_dir() and t["run_dir"].startswith(str(fitted.parent / "runs"))
    assert (fitted / "model" / "model.safetensors").is_file()
    meta = json.loads((fitted / "routers" / "cache_routers.json").read_text())
    assert meta["format_version"] == 1 and meta["mode"] == "full"


def test_reload_record_and_replay(fitted):
    from expertcast.inference.policies import make_policy
    from expertcast.inference.simulator import simulate
    from expertcast.train.router_data import LMExample
    from expertcast.train.router_eval import load_export, record_heldout

    model, tok, routers, info = load_export(fitted)
    assert routers is not None and routers.mode == "full"
    # the LoRA was merged: the exported model differs from the random init it started from
    from expertcast.models.presets import build_tiny

    init = build_tiny("qwen3_moe-tiny")
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, init.model.layers[0].self_attn.q_proj.weight)
    g = torch.Generator().manual_seed(0)
    ex = [LMExample(torch.randint(4, 500, (6,), generator=g).tolist(), torch.randint(4, 500, (20,), generator=g).tolist())
          for _ in range(3)]
    meta, seqs, rp, lm = record_heldout(model, routers, ex, batch_size=2)
    assert len(seqs) == 3 and seqs[0].expert_ids.shape == (26, 4, 4)
    assert rp["heldout-00000"].p_S.shape == (26, 4, 16) and lm > 0
    # the recorded routing is the model's own: the trace's experts are a top-K of the native distribution
    # (p_R is stored in float16, so two experts may tie at the K-th place)
    p_r = torch.from_numpy(rp["heldout-00001"].p_R.astype("float32"))
    chosen = torch.zeros_like(p_r, dtype=torch.bool).scatter_(-1, torch.from_numpy(seqs[1].expert_ids.astype("int64")), True)
    assert int(chosen.sum(-1).min()) == 4
    assert bool((p_r.masked_fill(~chosen, 2.0).amin(-1) >= p_r.masked_fill(chosen, -1.0).amax(-1)).all())
    recs = simulate((meta, seqs), ["lru", make_policy("router-full", replay=rp, R=4),
                                   make_policy("router-temporal", replay=rp)],
                    capacities=None, slots_per_layer=[6], progress=False)
    assert [r["decoded_tokens"] for r in recs] == [60, 60, 60]
    assert recs[1]["proactive_loads"] > 0 and recs[0]["proactive_loads"] == 0


def test_router_eval_cli_on_export(fitted, tmp_path):
    from expertcast.commands.router_eval import main

    rc = main(["--exports", str(fitted), "--out", str(tmp_path), "--limit", "48", "--heldout", "0.2",
               "--max-length", "96", "--R", "3", "5"])
    assert rc == 0
    rows = json.loads((tmp_path / "all_rows.json").read_text())
    assert {r["train_overlap"] for r in rows} == {0}  # held-out texts only, checked against the export's ids
    assert {r["policy"] for r in rows} == {"lru", "router-full"}
    assert sorted(r["R"] for r in rows if r["policy"] == "router-full") == [3, 5]
    assert (tmp_path / "tradeoff.png").stat().st_size > 1000
    assert (tmp_path / "table2.csv").is_file() and (tmp_path / "table3.csv").is_file()


def test_wrong_budget_is_refused():
    from expertcast.train.router_module import RouterAdaptationModule

    with pytest.raises(ValueError, match="below the native top-K"):
        RouterAdaptationModule(model="qwen3_moe-tiny", mode="temporal", budget=2)
