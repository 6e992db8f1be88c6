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
