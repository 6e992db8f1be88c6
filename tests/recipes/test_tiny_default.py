"""The embedded default model's pipeline on a tiny recipe: BPE tokenizer + Qwen3-MoE trained for a
few steps, saved as a loadable Hugging Face directory with a report, reused from the cache, resumed
after an interruption with the weights of an uninterrupted build, built identically twice; the cache
key covers the whole recipe and the data; the routing statistics it reports."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from expertcast.recipes import tiny_default as td
from expertcast.recipes import tiny_default_corpus as tdc

torch.set_num_threads(1)

TINY = td.TinyDefaultConfig(
    vocab_size=320, num_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    moe_intermediate_size=16, num_experts=8, top_k=2, seq_len=64, batch_size=4, lr=1e-2, warmup_steps=3,
    max_steps=25, threads=1, gsm8k_train_limit=150, cot_limit=1, eval_gsm8k_test=8, eval_cot=2, eval_max_len=192,
    arith_train=100, eval_arith=4,
)


def _sha(path, name="model.safetensors") -> str:
    from expertcast.utils.provenance import sha256_file

    return sha256_file(path / name)


@pytest.fixture
def cache(tmp_path, monkeypatch, data_dir):
    monkeypatch.setenv("EXPERTCAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(data_dir))
    return tmp_path / "cache"


def test_build_load_and_reuse(cache, monkeypatch):
    path = td.ensure_default_model(TINY, progress=False)
    assert path.parent == cache / "tiny-default-v1" and path.name == TINY.key(tdc.recipe_files())
    for f in ("config.json", "model.safetensors", "tokenizer.json", "report.json", "train_loss.png"):
        assert (path / f).is_file(), f
    assert not any(p.name.startswith(".") for p in path.parent.iterdir() if p.is_dir())  # no partial dirs left

    rep = json.loads((path / "report.json").read_text())
    assert rep["steps"] == 25 and rep["tokens_seen"] == 25 * 4 * 64
    assert rep["tokens_per_s"] > 0 and rep["train_time_s"] > 0 and rep["threads"] == 1
    # the report records the recipe, the data hashes and the loss curve every LOSS_LOG_EVERY steps
    assert rep["recipe"] == TINY.to_dict() and rep["key"] == path.name
    assert set(rep["data_sha256"]) == {"gsm8k_train", "gsm8k_test", "cot_train", "cot_heldout"}
    assert [h[0] for h in rep["loss_history"]] == [1, 10, 20] and rep["loss_log_every"] == td.LOSS_LOG_EVERY
    assert rep["loss_history"][-1][2] < rep["loss_history"][0][2]
    ppl, ppl0 = rep["heldout_gsm8k_test"]["perplexity"], rep["heldout_gsm8k_test_init"]["perplexity"]
    assert math.isfinite(ppl) and ppl < ppl0 < 1.5 * 320  # training helped; init is near uniform
    assert rep["spec"]["num_experts"] == 8 and rep["spec"]["num_layers"] == 2
    # the arith train problems are in the corpus; the held-out arith accuracy is measured on test problems
    assert rep["corpus_chats"] == {"gsm8k_train": 150, "cot_math153": 1, "arith_train": 100}
    assert rep["arith_sha256"] == tdc.arith_hash(100)
    arith = rep["heldout_arith_test"]
    assert arith["problems"] == 4 and arith["first_id"] == "arith-test-00000" and 0 <= arith["accuracy"] <= 1
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
    assert dataclasses.replace(TINY, lr=2e-2).key(tdc.recipe_files()) != TINY.key(tdc.recipe_files())


def test_interrupted_build_resumes(cache, monkeypatch):
    calls = {"n": 0}
    orig = tdc.PackedStream.next_batch

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 13:
            raise KeyboardInterrupt
        return orig(self)

    monkeypatch.setattr(tdc.PackedStream, "next_batch", flaky)
    cfg = dataclasses.replace(TINY, max_steps=20, eval_gsm8k_test=2, eval_cot=0, eval_arith=0)
    with pytest.raises(KeyboardInterrupt):
        td.ensure_default_model(cfg, progress=False, checkpoint_every_s=1e-9)
    partial = cache / "tiny-default-v1" / f".{cfg.key(tdc.recipe_files())}.partial" / "ckpt.pt"
    assert partial.is_file()
    path = td.ensure_default_model(cfg, progress=False, checkpoint_every_s=1e-9)
    rep = td.load_report(path)
    assert rep["resumed"] == 1 and rep["steps"] == 20 and rep["tokens_seen"] == 20 * 4 * 64
    assert not partial.parent.exists()
    # the resumed build ends with the weights of an uninterrupted one
    monkeypatch.setattr(tdc.PackedStream, "next_batch", orig)
    ref = td.build_default_model(cfg, cache / "uninterrupted", progress=False)
    assert ref["steps"] == 20 and _sha(cache / "uninterrupted") == _sha(path)


def test_missing_data_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTCAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(tmp_path / "nodata"))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nodata")):
        td.ensure_default_model(TINY, progress=False)


def test_lr_schedule_warms_up_then_decays_over_the_steps():
    cfg = td.TinyDefaultConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, max_steps=100)
    assert td._lr_at(cfg, 0) == pytest.approx(0.1)  # warm-up 1/10, cosine at its start
    assert td._lr_at(cfg, 50) == pytest.approx(0.55)  # half-way down the cosine
    assert td._lr_at(cfg, 100) == pytest.approx(0.1)  # the floor at max_steps
    lrs = [td._lr_at(cfg, s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_yaml_recipe_matches_dataclass_defaults(tmp_path):
    from expertcast.utils.paths import REPO_ROOT

    assert td.TinyDefaultConfig.from_yaml(REPO_ROOT / "configs" / "tiny_default" / "default.yaml") == td.TinyDefaultConfig()
    bad = tmp_path / "bad.yaml"
    bad.write_text("vocab_size: 512\nnum_expert: 8\n")
    with pytest.raises(ValueError, match="num_expert"):
        td.TinyDefaultConfig.from_yaml(bad)
    bad.write_text("time_budget_s: 450\n")  # the wall-clock budget is gone: steps are fixed
    with pytest.raises(ValueError, match="time_budget_s was removed"):
        td.TinyDefaultConfig.from_yaml(bad)
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        td.TinyDefaultConfig(threads=0)
    with pytest.raises(ValueError, match="arith_train must be a non-negative integer"):
        td.TinyDefaultConfig(arith_train=-1)


def test_two_builds_are_identical_and_the_key_covers_the_recipe(tmp_path, monkeypatch, data_dir):
    """Same recipe, two fresh caches, 2 threads, one build in this process and one in a child process (a
    different allocator state and thread timing): byte-identical weights and tokenizer."""
    import subprocess
    import sys

    import yaml

    cfg = dataclasses.replace(TINY, max_steps=30, threads=2, hidden_size=64, moe_intermediate_size=64, seq_len=256,
                              gsm8k_train_limit=60, eval_gsm8k_test=0, eval_cot=0, eval_arith=0)
    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(data_dir))
    monkeypatch.setenv("EXPERTCAST_CACHE_DIR", str(tmp_path / "a"))
    a = td.ensure_default_model(cfg, progress=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(dataclasses.asdict(cfg)))
    env = {**os.environ, "EXPERTCAST_CACHE_DIR": str(tmp_path / "b")}
    r = subprocess.run([sys.executable, "-m", "expertcast.cli", "build-default", "--config", str(recipe), "--no-progress"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (b,) = (tmp_path / "b").glob("tiny-default-v1/*/model.safetensors")
    b = b.parent
    assert a != b and a.name == b.name
    assert _sha(a) == _sha(b) and _sha(a, "tokenizer.json") == _sha(b, "tokenizer.json")
    ra, rb = td.load_report(a), td.load_report(b)
    assert [h[2:] for h in ra["loss_history"]] == [h[2:] for h in rb["loss_history"]]  # same losses, step by step
    # every recipe field that changes the weights changes the key
    files = tdc.recipe_files()
    for change in ({"max_steps": 13}, {"seed": 1}, {"threads": 1}, {"lr": 2e-2}, {"seq_len": 32},
                   {"gsm8k_train_limit": 61}, {"arith_train": 7}):
        assert dataclasses.replace(cfg, **change).key(files) != cfg.key(files), change
    # and so does the content of a data file (same name, same size)
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(data_dir / "gsm8k", copy / "gsm8k")
    shutil.copytree(data_dir / "cot", copy / "cot")
    assert cfg.key(tdc.recipe_files(copy)) == cfg.key(files)
    text = (copy / "cot" / "labeled40.jsonl").read_text(encoding="utf-8")
    (copy / "cot" / "labeled40.jsonl").write_text(text.replace("Wait", "Wiat", 1), encoding="utf-8")
    assert cfg.key(tdc.recipe_files(copy)) != cfg.key(files)


def test_cli_builds_then_reuses(cache, tmp_path, capsys):
    import yaml
    from expertcast.commands.build_default import main

    y = tmp_path / "tiny.yaml"
    y.write_text(yaml.safe_dump(dataclasses.asdict(dataclasses.replace(TINY, max_steps=4, eval_gsm8k_test=3, eval_cot=1))))
    assert main(["--config", str(y), "--no-progress"]) == 0
    first = capsys.readouterr().out
    assert "parameters" in first and "default model:" in first and "gsm8k_test" in first
    assert main(["--config", str(y), "--no-progress"]) == 0
    second = capsys.readouterr().out
    assert "parameters" not in second and "default model:" in second  # served from the cache


@pytest.mark.parametrize("argv,words", [
    (["--config", "{tmp}/missing.yaml"], "No such file or directory"),
    (["--config", "{tmp}/budget.yaml"], "time_budget_s was removed"),
    (["--config", "{tmp}/broken.yaml"], "not valid YAML"),
    (["--time-budget", "60"], "unrecognized arguments: --time-budget"),
    (["--threads", "2"], "unrecognized arguments: --threads"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, words):
    from expertcast.commands.build_default import main

    (tmp_path / "budget.yaml").write_text("time_budget_s: 60\n")
    (tmp_path / "broken.yaml").write_text("max_steps: [1\n")
    try:
        rc = main([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("expertcast build-default: error:") and words in err[0], err


@pytest.mark.slow
def test_full_size_builds_in_two_processes_are_identical(tmp_path, data_dir):
    """The default recipe's model size, 40 steps, each build in its own process: identical weights. Without
    deterministic algorithms, 2-thread CPU training drifted apart here after ~20 steps."""
    import subprocess
    import sys

    import yaml

    cfg = dataclasses.replace(td.TinyDefaultConfig(), max_steps=40, gsm8k_train_limit=400, cot_limit=4,
                              eval_gsm8k_test=0, eval_cot=0, eval_arith=0)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(dataclasses.asdict(cfg)))
    digests = []
    for name in ("a", "b"):
        env = {**os.environ, "EXPERTCAST_CACHE_DIR": str(tmp_path / name), "EXPERTCAST_DATA_DIR": str(data_dir)}
        r = subprocess.run([sys.executable, "-m", "expertcast.cli", "build-default", "--config", str(recipe),
                            "--no-progress"], env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        (w,) = (tmp_path / name).glob("tiny-default-v1/*/model.safetensors")
        digests.append(_sha(w.parent))
    assert digests[0] == digests[1]


def test_shipped_report_recipe_hash_equals_the_codes_recipe(data_dir, monkeypatch):
    """The shipped model was built by the recipe the code trains: a recipe (or RECIPE_VERSION, or arith
    generator) change without a rebuild and `build-default --ship` fails here. With the benchmark data of the
    build at hand, the full cache key (recipe + data sha256) matches too."""
    from expertcast.models.names import shipped_default_model
    from expertcast.utils.paths import REPO_ROOT

    report = td.load_report(shipped_default_model())
    code = td.TinyDefaultConfig.from_yaml(REPO_ROOT / "configs" / "tiny_default" / "default.yaml")
    assert code == td.TinyDefaultConfig()  # the shipped YAML is the dataclass defaults
    assert report["recipe_hash"] == code.recipe_hash()
    assert report["recipe"] == code.to_dict() and report["recipe_version"] == td.RECIPE_VERSION
    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(data_dir))
    assert report["data_sha256"] == tdc.data_hashes(tdc.recipe_files())
    assert report["key"] == code.key(tdc.recipe_files())
    assert report["steps"] == code.max_steps and report["heldout_arith_test"]["accuracy"] > 0.5


def test_ship_copies_a_build_with_the_checksums_the_resolver_verifies(cache, tmp_path):
    from expertcast.commands.build_default import compare_with_shipped
    from expertcast.models.names import ModelNotFoundError, shipped_default_model

    cfg = dataclasses.replace(TINY, max_steps=2, eval_gsm8k_test=0, eval_cot=0, eval_arith=0)
    build = td.ensure_default_model(cfg, progress=False)
    dest = td.ship_default_model(build, tmp_path / "shipped")
    assert shipped_default_model(dest) == dest
    rep = td.load_report(dest)
    assert rep["recipe_hash"] == cfg.recipe_hash() and set(rep["shipped_files"]) >= {"model.safetensors", "config.json"}
    for name, want in rep["shipped_files"].items():
        assert _sha(dest, name) == want["sha256"] == _sha(build, name)
    assert "differs from the shipped model" in compare_with_shipped(build)  # not the real default's weights
    with pytest.raises(Exception, match="not a complete default-model build"):
        td.ship_default_model(tmp_path / "nothing", tmp_path / "x")
    (dest / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="model.safetensors has 0 bytes"):
        shipped_default_model(dest)
