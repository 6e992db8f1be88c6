"""End to end on a tiny preset: `expertcast fit` with the router YAML (LoRA through peft), export,
reload without Lightning, teacher-forced recording, and simulator replay of the router policies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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


def test_reload_and_live_routers_on_the_fitted_export(fitted):
    """The fitted export loads without Lightning (LoRA merged into ``model/``), and its trained routers drive
    router-full live in the runtime: the same greedy tokens as full load, proactive loads issued, and the
    simulator replaying the recorded run (routing and router outputs) ends with equal counters."""
    from expertcast.data.trace_format import TraceMeta
    from expertcast.inference.cache.counters import COUNTER_NAMES
    from expertcast.inference.cache.driver import RecordedTransport
    from expertcast.inference.policies import make_policy
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.inference.runtime.live_routers import LiveRouterScores
    from expertcast.inference.sim.simulator import build_stream, replay
    from expertcast.models.backbone import load_adaptation_export
    from expertcast.models.presets import build_tiny

    model, _, routers, info = load_adaptation_export(fitted)
    assert routers is not None and routers.mode == "full" and info["router_mode"] == "full"
    init = build_tiny("qwen3_moe-tiny")  # the LoRA was merged: the exported model differs from its random init
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, init.model.layers[0].self_attn.q_proj.weight)
    ids = torch.randint(40, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    live = LiveRouterScores(model, routers)
    om = OffloadedModel(model, make_policy("router-full", replay=live, R=4), 6)
    try:
        res = om.generate(ids, torch.ones_like(ids), max_new_tokens=10, eos_token_id=None, pad_token_id=0,
                          record=True, seq_ids=["a", "b"])
        recorded = live.recorded(res.traces)
        meta = TraceMeta("tiny", om.L, om.E, om.K, om.layout.expert_bytes)
        sim = replay(build_stream(meta, res.traces, batch_size=2), make_policy("router-full", replay=recorded, R=4),
                     om.cache_config, transport=RecordedTransport(res.landings))
        st = om.stats
    finally:
        om.restore()
        live.remove()
    assert torch.equal(res.sequences, ref)
    assert st.P > 0, "the trained routers' pre-access refinement should issue proactive loads"
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(st, k), getattr(sim, k)), k


def test_router_eval_cli_on_export(fitted, tmp_path):
    from expertcast.commands.router_eval import main

    rc = main(["--exports", str(fitted), "--out", str(tmp_path), "--limit", "48", "--heldout", "0.2",
               "--max-length", "96", "--R", "3", "5", "--prompts", "4", "--max-new-tokens", "6"])
    assert rc == 0
    rows = json.loads((tmp_path / "all_rows.json").read_text())
    assert {r["train_overlap"] for r in rows} == {0}  # held-out texts only, checked against the export's ids
    # the prompts were checked against the texts the fit recorded (source reloaded): none of them leaks
    assert {r["prompt_overlap"] for r in rows} == {0}
    assert {r["policy"] for r in rows} == {"lru", "router-full"}
    assert sorted(r["R"] for r in rows if r["policy"] == "router-full") == [3, 5]
    assert all(r["identical_to_full"] for r in rows)  # offloaded decoding = full load, every row
    assert (tmp_path / "table2.png").stat().st_size > 1000
    assert (tmp_path / "table2.csv").is_file()
    assert not (tmp_path / "table3.csv").exists()  # one export, one budget B: Table 3 (other budgets) is empty


def test_wrong_budget_is_refused():
    from expertcast.train.router_module import RouterAdaptationModule

    with pytest.raises(ValueError, match="below the native top-K"):
        RouterAdaptationModule(model="qwen3_moe-tiny", mode="temporal", budget=2)
