"""Two-pass trace collection on a tiny model: padding-safe batching, resume, completions mode, CLI errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from expertcast.commands.collect import collect_traces
from expertcast.commands.collect import main as collect_main
from expertcast.data.traces import load_traces, read_manifest
from expertcast.models.routing import capture_routing
from expertcast.recipes.collect import CollectConfig, generate_batch

MODEL = "mixtral-tiny"


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_tok():
    from expertcast.recipes.collect import load_model

    return load_model(MODEL, device="cpu")


def _cfg(tmp_path, name, data_dir, **kw) -> CollectConfig:
    base = dict(model=MODEL, out=str(tmp_path / name), benchmark="gsm8k", split="test", limit=5, max_new_tokens=6,
                batch_size=3, shard_size=3, data_dir=str(data_dir), device="cpu", progress=False)
    base.update(kw)
    return CollectConfig(**base)


def test_batched_padded_collection_equals_one_at_a_time(tmp_path, data_dir, model_tok):
    model, tok = model_tok
    cfg = _cfg(tmp_path, "t", data_dir, router_probs=True)
    res = collect_traces(cfg, model, tok)
    assert (res.shards_written, res.shards_skipped, res.sequences) == (2, 0, 5)
    assert res.generate_tokens_per_s > 0 and res.route_tokens_per_s > 0
    meta, seqs = load_traces(cfg.out)
    assert (meta.num_layers, meta.num_experts, meta.top_k, meta.has_router_probs) == (2, 8, 2, True)
    assert meta.dataset == "gsm8k" and meta.split == "test" and meta.expert_bytes > 0
    assert [s.seq_id for s in seqs] == [f"gsm8k-test-{i:05d}" for i in range(5)]
    from expertcast.data.benchmarks import load_benchmark
    from expertcast.data.prompts import build_prompt

    problems = load_benchmark("gsm8k", "test", data_dir=data_dir, limit=5)
    lengths = set()
    eos = {tok.eos_token_id}
    for p, s in zip(problems, seqs, strict=True):
        prompt_ids = tok(build_prompt(tok, p.question, "gsm8k"), add_special_tokens=False)["input_ids"]
        lengths.add(len(prompt_ids))
        assert s.prompt_len == len(prompt_ids) and s.token_ids[:s.prompt_len].tolist() == prompt_ids
        # pass 1 with left padding generated what the prompt alone generates
        alone = generate_batch(model, tok, [prompt_ids], cfg, eos)[0]
        assert s.token_ids[s.prompt_len:].tolist() == alone
        # pass 2 with right padding routed real tokens as the sequence alone does
        cap = capture_routing(model, torch.tensor(s.token_ids, dtype=torch.long)[None], router_probs=True)
        assert np.array_equal(cap.expert_ids[0].numpy().astype(np.int16), s.expert_ids)
        np.testing.assert_allclose(cap.expert_weights[0].numpy(), s.expert_weights.astype(np.float32), atol=2e-3)
        np.testing.assert_allclose(cap.router_probs[0].numpy(), s.router_probs.astype(np.float32), atol=2e-3)
    assert len(lengths) > 1, "prompts of one length would not exercise padding"


def test_resume_after_interrupt_gives_the_same_traces(tmp_path, data_dir, model_tok):
    model, tok = model_tok
    kw = dict(shard_size=2, batch_size=2, do_sample=True, seed=7, temperature=1.0)
    full = collect_traces(_cfg(tmp_path, "full", data_dir, **kw), model, tok)
    assert full.shards_written == 3

    cfg = _cfg(tmp_path, "cut", data_dir, **kw)

    class Killed(RuntimeError):
        pass

    def kill_after_shard_1(index, path):
        if index == 1:
            raise Killed(f"killed after {path.name}")

    with pytest.raises(Killed):
        collect_traces(cfg, model, tok, on_shard=kill_after_shard_1)
    assert read_manifest(cfg.out)["complete"] is False
    again = collect_traces(cfg, model, tok)
    assert (again.shards_skipped, again.shards_written) == (2, 1)
    assert read_manifest(cfg.out)["complete"] is True
    _, a = load_traces(tmp_path / "full")
    _, b = load_traces(cfg.out)
    ids = [s.seq_id for s in b]
    assert len(ids) == len(set(ids)) == 5
    for x, y in zip(a, b, strict=True):
        assert x.seq_id == y.seq_id and x.prompt_len == y.prompt_len
        assert np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.expert_ids, y.expert_ids)
    # a finished run is not redone
    assert collect_traces(cfg, model, tok).shards_written == 0


def test_completions_mode_cli(tmp_path, data_dir, capsys):
    out = tmp_path / "cot"
    summary = tmp_path / "summary.json"
    rc = collect_main(["--model", MODEL, "--completions", str(data_dir / "cot" / "labeled40.jsonl"),
                       "--text-field", "thinking", "--prompt-field", "prompt", "--completion-prefix", "<think>\n",
                       "--limit", "3", "--max-tokens", "400", "--shard-size", "2", "--out", str(out),
                       "--device", "cpu", "--no-progress", "--json", str(summary)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tokens_per_s" in printed and "route" in printed
    rows = json.loads(summary.read_text())
    assert rows[0]["tokens"] > 0 and rows[0]["tokens_per_s"] > 0
    meta, seqs = load_traces(out)
    assert len(seqs) == 3 and meta.dataset == "labeled40.jsonl" and meta.generation["source"] == "completions"
    from expertcast.models.tokenizer import THINK_OPEN, byte_level_tokenizer

    think = byte_level_tokenizer().convert_tokens_to_ids(THINK_OPEN)
    for s in seqs:
        assert s.num_tokens == 400  # R1 thinking is far longer than 400 tokens: truncated
        assert 0 < s.prompt_len < 400 and s.token_ids[s.prompt_len] == think
    first = json.loads((data_dir / "cot" / "labeled40.jsonl").open().readline())
    assert seqs[0].seq_id == str(first["id"])


def test_cli_collects_every_registered_benchmark_including_arith(tmp_path, capsys):
    from expertcast.commands.collect import build_parser
    from expertcast.data.benchmarks import BENCHMARKS

    action = next(a for a in build_parser()._actions if a.dest == "benchmark")
    assert list(action.choices) == list(BENCHMARKS) and "arith" in action.choices
    out = tmp_path / "arith"
    rc = collect_main(["--model", MODEL, "--benchmark", "arith", "--split", "test", "--limit", "3",
                       "--max-new-tokens", "4", "--out", str(out), "--device", "cpu", "--no-progress"])
    assert rc == 0
    assert "accuracy of the generated completions: " in capsys.readouterr().out  # graded against arith's golds
    meta, seqs = load_traces(out)
    assert meta.dataset == "arith" and meta.split == "test"
    assert [s.seq_id for s in seqs] == [f"arith-test-{i:05d}" for i in range(3)]


def test_cli_errors(tmp_path, data_dir, capsys):
    rc = collect_main(["--model", MODEL, "--out", str(tmp_path / "x"), "--data-dir", str(tmp_path / "none"),
                       "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "looked for" in err and str(tmp_path / "none") in err
    rc = collect_main(["--model", MODEL, "--completions", str(tmp_path / "missing.jsonl"), "--out",
                       str(tmp_path / "y")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "hello"}) + "\n")
    rc = collect_main(["--model", MODEL, "--completions", str(bad), "--out", str(tmp_path / "z"), "--no-progress"])
    assert rc == 2 and "no field 'thinking'" in capsys.readouterr().err
    # resuming into a directory made with other settings is refused
    args = ["--model", MODEL, "--completions", str(data_dir / "cot" / "labeled40.jsonl"), "--limit", "1",
            "--max-tokens", "300", "--out", str(tmp_path / "r"), "--device", "cpu", "--no-progress"]
    assert collect_main(args) == 0
    capsys.readouterr()
    args[args.index("300")] = "320"
    assert collect_main(args) == 2
    assert "other settings: max_tokens: 300 (saved) vs 320 (now)" in capsys.readouterr().err
