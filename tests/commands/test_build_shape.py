"""``expertcast build-shape``: the command writes a loadable random-weight folder and says what it wrote."""

from __future__ import annotations

import json

from expertcast.cli import main as cli


def test_build_shape_command(tmp_path, capsys):
    out = tmp_path / "q"
    sets = ["hidden_size=64", "intermediate_size=128", "moe_intermediate_size=32", "vocab_size=512",
            "num_attention_heads=4", "num_key_value_heads=2", "head_dim=16", "bos_token_id=1", "eos_token_id=2"]
    rc = cli(["build-shape", "qwen3-30b-a3b", "--out", str(out), "--layers", "2", "--seed", "3",
              *[a for s in sets for a in ("--set", s)]])
    text = capsys.readouterr().out
    assert rc == 0
    assert "2 MoE layers x 128 experts" in text and "active per token (top-8)" in text
    prov = json.loads((out / "build_shape.json").read_text())
    assert prov["seed"] == 3 and prov["overrides"]["hidden_size"] == 64 and prov["config"]["num_local_experts"] == 128
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_hidden_layers"] == 2
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()
    rc = cli(["build-shape", "qwen3-30b-a3b", "--out", str(out), "--layers", "2"])
    assert rc == 2 and "already holds a build" in capsys.readouterr().err


def test_bad_set_is_a_one_line_error(tmp_path, capsys):
    rc = cli(["build-shape", "qwen3-30b-a3b", "--out", str(tmp_path / "x"), "--set", "nonsense"])
    assert rc == 2 and "--set 'nonsense': expected KEY=VALUE" in capsys.readouterr().err


SMALL = ["hidden_size=64", "intermediate_size=128", "moe_intermediate_size=32", "vocab_size=512",
         "num_attention_heads=4", "num_key_value_heads=2", "head_dim=16", "num_experts=16", "bos_token_id=1",
         "eos_token_id=2"]


def _error_lines(err: str) -> list[str]:
    """The command's own stderr lines (a logging handler left by another test may add its own)."""
    return [x for x in err.splitlines() if x.startswith("expertcast ") or x.startswith("Traceback (most recent")
            and "Logging error" not in err]


def _sets(*items: str) -> list[str]:
    return [a for s in (*SMALL, *items) for a in ("--set", s)]


def test_a_set_key_the_config_class_lacks_is_refused(tmp_path, capsys):
    """A misspelled key was written into config.json (and ignored by the model) while the build ran."""
    rc = cli(["build-shape", "qwen3-30b-a3b", "--out", str(tmp_path / "x"), "--layers", "1",
              *_sets("hiden_size=256")])
    err = capsys.readouterr().err
    assert rc == 2 and "--set hiden_size: not a field of qwen3_moe's config class (did you mean hidden_size?)" in err
    assert not (tmp_path / "x").exists()


def test_set_values_that_disagree_or_mistype_are_one_line_errors(tmp_path, capsys):
    rc = cli(["build-shape", "qwen3-30b-a3b", "--out", str(tmp_path / "x"), "--layers", "1",
              *_sets("num_experts_per_tok=64")])
    err = capsys.readouterr().err
    assert rc == 2 and "num_experts_per_tok=64 exceeds the 16 routed experts (num_experts)" in err
    assert len(_error_lines(err)) == 1 and not (tmp_path / "x").exists()
    rc = cli(["build-shape", "qwen3-30b-a3b", "--out", str(tmp_path / "x"), "--set", "hidden_size=abc"])
    err = capsys.readouterr().err
    assert rc == 2 and "hidden_size" in err and "expected int" in err and len(_error_lines(err)) == 1


def test_replay_refuses_a_model_whose_config_cannot_run(tmp_path, capsys):
    """A folder whose config.json was edited to K > E: replay says so in one line instead of crashing."""
    out = tmp_path / "m"
    assert cli(["build-shape", "qwen3-30b-a3b", "--out", str(out), "--layers", "1", *_sets()]) == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_experts_per_tok"] = 64
    (out / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    rc = cli(["replay", "--model", str(out), "--synthetic", "random", "--synthetic-size", "1,12",
              "--capacity", "0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and "num_experts_per_tok=64 exceeds the 16 routed experts" in err, err
    assert len(_error_lines(err)) == 1


def test_build_shape_fp8_command(tmp_path, capsys):
    from expertcast.commands.build_shape import main
    from expertcast.inference.runtime.loading import checkpoint_tensors, plan_offload

    out = tmp_path / "f8"
    assert main(["olmoe-tiny", "--out", str(out), "--layers", "1", "--expert-dtype", "fp8"]) == 0
    assert "fp8:" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    ents = checkpoint_tensors(out)
    assert any(k.endswith("weight_scale_inv") for k in ents) and not (tmp_path / ".f8.unquantized").exists()
    plan = plan_offload(out, 0.5, expert_dtype="int4")
    assert plan.expert_format == "int4" and plan.expert_bytes < plan_offload(out, 0.5).expert_bytes / 3
