"""lm-evaluation-harness model ``expertcast``: the harness's gsm8k from the local files through the offloading
runtime reports its accuracy and the cache metrics; generation honours ``until`` and ``max_gen_toks`` and equals
the runtime's; loglikelihood equals the plain model's; the local task files are the harness's own."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from expertcast.commands.lm_eval import harness_argv
from expertcast.harness.lm_eval_adapter import MODEL_NAME, ExpertcastLM
from expertcast.harness.local_tasks import LOCAL_TASKS, TASKS_DIR
from expertcast.utils.errors import UsageError
from expertcast.utils.io import read_jsonl

REPO = Path(__file__).resolve().parents[2]
TINY = "model=qwen3_moe-tiny,policy=lru,capacity=0.5,max_gen_toks=6"


@pytest.fixture(scope="module")
def lm() -> ExpertcastLM:
    return ExpertcastLM(model="qwen3_moe-tiny", policy="lru", capacity=0.5, device="cpu", max_gen_toks=12)


def _req(context: str, **gen: object) -> SimpleNamespace:
    return SimpleNamespace(args=(context, gen))


def test_gsm8k_from_local_files_reports_accuracy_and_cache_metrics(data_dir, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(data_dir))
    out = simple_evaluate(model=MODEL_NAME, model_args=TINY, tasks=["gsm8k"], limit=2, num_fewshot=0, device="cpu",
                          task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
                          log_samples=True)
    res = out["results"]["gsm8k"]
    assert 0.0 <= res["exact_match,strict-match"] <= 1.0 and 0.0 <= res["exact_match,flexible-extract"] <= 1.0
    first = next(iter(read_jsonl(data_dir / "gsm8k" / "test.jsonl")))
    docs = {s["doc_id"]: s["doc"] for s in out["samples"]["gsm8k"]}  # one sample per doc and filter
    assert sorted(docs) == [0, 1] and docs[0]["question"] == first["question"]  # the local copy, not the Hub
    m = out["config"]["expertcast"]
    assert m["accesses"] > 0 and m["decoded_tokens"] > 0 and 0 <= m["demand_misses"] <= m["accesses"]
    assert m["hit"] == pytest.approx(1 - m["demand_misses"] / m["accesses"])
    assert m["mb_per_token"] == pytest.approx(m["demand_misses"] * m["expert_bytes"] / 1e6 / m["decoded_tokens"])
    assert m["settings"]["policy"] == "lru" and m["settings"]["capacity"] == {"capacity": 0.5}
    # % of full speed: the paired passes ran on the first 2 contexts, each offloaded pass between two baselines
    sp = m["speed"]
    assert sp["speed_samples"] == 2 and len(sp["offloaded_passes"]) == 3 and len(sp["baseline_passes"]) == 4
    assert sp["baseline"] == m["baseline"] == "all-resident" and sp["tokens_match"]
    assert m["pct_full_min"] <= m["pct_full_measured"] <= m["pct_full_max"] and m["pct_full_measured"] > 0
    assert m["pct_full"] == (None if sp["flag"] else sp["pct_full"]) and m["tokens_per_s"] == sp["tokens_per_s"]
    for k in ("exposed_misses_per_token", "miss_free_token_frac", "read_mb_per_token", "ttft_p50_s", "tpot_p99_ms"):
        assert m[k] is not None and m[k] >= 0, k  # the metrics users compare by, as `expertcast eval` gives them
    per = m["per_task"]["gsm8k"]  # per task: one task here, so the task's figures are the aggregate's
    assert per["hit"] == m["hit"] and per["decoded_tokens"] == m["decoded_tokens"] and per["tpot_p90_ms"] is not None
    assert all(p["decoded_tokens"] == sp["decoded_tokens"] > 0 for p in sp["offloaded_passes"] + sp["baseline_passes"])


def test_generation_is_the_runtimes_and_honours_until_and_max_gen_toks(lm):
    from expertcast.inference.runtime.eval_run import generated

    ctx = "Question: What is 12 + 7?\nAnswer:"
    enc = lm.tok([ctx], return_tensors="pt", add_special_tokens=False)
    res = lm.om.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=12, eos_token_id=lm.eos)
    ids = generated(res.sequences, enc["input_ids"].shape[1], lm.eos)[0]
    full = lm.tok.decode(ids, skip_special_tokens=True)
    never = "\x00never\x00"
    assert lm.generate_until([_req(ctx, until=[never])], disable_tqdm=True) == [full]
    short = lm.generate_until([_req(ctx, until=[never], max_gen_toks=3)], disable_tqdm=True)[0]
    assert len(ids) > 3 and short == lm.tok.decode(ids[:3], skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = lm.generate_until([_req(ctx, until=[stop])], disable_tqdm=True)[0]
    assert cut == full.split(stop, 1)[0]
    other = "Compute 3 x 4."
    alone = lm.generate_until([_req(other, until=[never])], disable_tqdm=True)
    lm._batch_size = 2
    try:  # one left-padded batch, answers in request order
        assert lm.generate_until([_req(other, until=[never]), _req(ctx, until=[never])], disable_tqdm=True) \
            == [*alone, full]
    finally:
        lm._batch_size = 1


def test_loglikelihood_is_the_plain_models(lm):
    from expertcast.models.backbone import load_moe_model

    model, _ = load_moe_model("qwen3_moe-tiny", device="cpu", seed=0)
    ctx, cont = "Question: What is 2 + 2?\nAnswer:", " 4, so the answer is 4."
    (ll, greedy), = lm.loglikelihood([SimpleNamespace(args=(ctx, cont))], disable_tqdm=True)
    c, t = lm._encode_pair(ctx, cont)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([c + t])).logits[0].float(), -1)
    ref = logp[len(c) - 1:-1].gather(-1, torch.tensor(t)[:, None]).sum()
    assert ll == pytest.approx(float(ref), abs=1e-3)
    assert greedy == bool((logp[len(c) - 1:-1].argmax(-1) == torch.tensor(t)).all())
    assert lm.loglikelihood_rolling([SimpleNamespace(args=(ctx + cont,))], disable_tqdm=True)[0] < 0


@pytest.mark.parametrize("kwargs, says", [
    ({"capacity": 0.5, "temperature_x": 1}, "unknown argument(s) temperature_x"),
    ({}, "give capacity=F"),
    ({"capacity": 0.5, "slots": 2}, "give capacity=F"),
    ({"capacity": 0.5, "budget_gb": 1}, "slots=N or budget_gb=G, one of them (got capacity, budget_gb)"),
    ({"budget_gb": "lots"}, "budget_gb='lots': expected a positive number of GB"),
    ({"budget_gb": 1e-9}, "--budget-gb 1e-09: budget 1e-09 GB"),
    ({"capacity": 0.5, "policy": "nosuch"}, "nosuch"),
    ({"capacity": 0.5, "batch_size": "auto"}, "fixed batch size"),
])
def test_bad_model_args_are_one_line_usage_errors(kwargs, says):
    with pytest.raises(UsageError) as e:
        ExpertcastLM(model="qwen3_moe-tiny", device="cpu", **kwargs)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_sampling_is_refused(lm):
    with pytest.raises(UsageError, match="greedily"):
        lm.generate_until([_req("x", do_sample=True, temperature=0.7)], disable_tqdm=True)
    with pytest.raises(UsageError, match="top_p"):
        lm.generate_until([_req("x", top_p=0.9)], disable_tqdm=True)


def _comparable(cfg: dict, folder: Path, package: str) -> dict:
    """A task config read with its ``!function`` references unresolved (resolving minerva's imports lm-eval's
    math extra), each as the dotted name it resolves to: ``folder/<ref>`` -> ``package.<ref>``."""
    def name(v: object) -> object:
        if isinstance(v, str) and v.startswith(str(folder) + os.sep):
            return ".".join(p for p in (package, v[len(str(folder)) + 1:].replace(os.sep, ".")) if p)
        if isinstance(v, dict):
            return {k: name(x) for k, x in v.items()}
        return v
    return {k: name(v) for k, v in cfg.items()}


@pytest.mark.parametrize("task, harness_file", [("gsm8k", "gsm8k/gsm8k.yaml"),
                                                ("minerva_math500", "minerva_math/minerva_math500.yaml")])
def test_local_task_files_are_the_harness_tasks(task, harness_file):
    """Every key as the installed harness ships it; the local files add only ``custom_dataset``."""
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    tasks = Path(lm_eval.__file__).parent / "tasks"
    ours = _comparable(load_yaml(TASKS_DIR / f"{task}.yaml", resolve_func=False), TASKS_DIR, "")
    theirs = _comparable(load_yaml(tasks / harness_file, resolve_func=False), (tasks / harness_file).parent,
                         f"lm_eval.tasks.{Path(harness_file).parent.name}")
    assert ours.pop("custom_dataset").startswith("expertcast.harness.local_tasks.")
    assert ours == theirs


def test_arith_task_is_the_projects_prompt_and_grader():
    from expertcast.data.benchmarks import arith_benchmark
    from expertcast.data.prompts import build_prompt
    from expertcast.harness import local_tasks
    from expertcast.models.tokenizer import load_tokenizer

    p = arith_benchmark("test", 1)[0]
    doc = local_tasks.arith()["test"][0]
    assert (doc["id"], doc["question"], doc["answer"]) == (p.id, p.question, p.answer)
    tok = load_tokenizer("qwen3_moe-tiny")
    chat = tok.apply_chat_template([{"role": "user", "content": local_tasks.arith_text(doc)}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == build_prompt(tok, p.question, "arith", use_chat_template=True)
    assert local_tasks.arith_results(doc, [f"so it is {p.answer}.\n#### {p.answer}"]) == {"exact_match": 1}
    assert local_tasks.arith_results(doc, [f"#### {int(p.answer) + 1}"]) == {"exact_match": 0}


def test_local_loader_names_a_missing_file(tmp_path):
    from expertcast.data.benchmarks import DatasetNotFoundError
    from expertcast.harness import local_tasks

    with pytest.raises(DatasetNotFoundError, match=r"gsm8k/train\.jsonl"):
        local_tasks.gsm8k(data_dir=str(tmp_path))


def test_command_adds_model_device_and_the_local_tasks():
    argv = harness_argv(["--tasks", "gsm8k", "--model_args", TINY])
    assert argv[:4] == ["--tasks", "gsm8k", "--model_args", TINY]
    assert argv[4:] == ["--model", "expertcast", "--device", "auto", "--include_path", str(TASKS_DIR)]
    assert harness_argv(["--model=hf", "--device", "cpu"])[:3] == ["--model=hf", "--device", "cpu"]
    with pytest.raises(UsageError, match="include_path"):
        harness_argv(["--include_path", "/elsewhere"])
    assert {p.stem for p in TASKS_DIR.glob("*.yaml")} == set(LOCAL_TASKS)


def test_entry_point_names_the_registered_model():
    from lm_eval.api.registry import get_model

    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["lm_eval.models"]
    module, _, attr = eps[MODEL_NAME].partition(":")
    assert getattr(importlib.import_module(module), attr) is get_model(MODEL_NAME) is ExpertcastLM


@pytest.mark.slow
def test_cli_writes_the_results_json_with_the_cache_metrics(tmp_path, data_dir):
    """``expertcast lm-eval`` end to end (lm_eval's CLI indexes every harness task: tens of seconds)."""
    env = {"EXPERTCAST_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "expertcast.cli", "lm-eval", "--model_args", TINY, "--tasks",
                           "expertcast_arith", "--limit", "2", "--output_path", str(tmp_path)],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "expertcast cache metrics" in proc.stdout and "expertcast_arith" in proc.stdout
    (path,) = tmp_path.rglob("results_*.json")
    out = json.loads(path.read_text())
    assert 0.0 <= out["results"]["expertcast_arith"]["exact_match,none"] <= 1.0
    assert out["config"]["expertcast"]["decoded_tokens"] > 0


# -- the fitted-on guard: the harness scores no problem a forecaster was fitted on ---------------------------
def _forecaster(tmp: Path, trained: list[str], model_id: str = "qwen3_moe-tiny") -> Path:
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
    from expertcast.models.forecaster_export import save_forecaster

    cfg = ForecasterConfig(num_layers=4, num_experts=16, top_k=4, hidden_size=16, num_blocks=1, state_size=8,
                           head_dim=8, chunk_size=16, direct_horizons=2)
    return save_forecaster(ExpertForecaster(cfg), tmp / "fc", source={"model_id": model_id},
                           training={"train_ids": trained, "val_ids": []})


def test_problem_ids_are_evals():
    from expertcast.data.benchmarks import load_benchmark
    from expertcast.harness.lm_eval_adapter import problem_id

    assert problem_id("gsm8k", 12, {}) == "gsm8k-test-00012" == load_benchmark("gsm8k", "test", limit=13)[12].id
    arith = load_benchmark("arith", "test", limit=1)[0]
    assert problem_id("expertcast_arith", 0, {"id": arith.id}) == arith.id
    assert problem_id("some_other_task", 3, {}) is None


def test_scoring_a_forecasters_fit_problems_is_refused_unless_allowed(tmp_path, data_dir):
    from expertcast.utils.errors import OverlapError
    from expertcast.utils.fitted_on import ModelMismatchError

    fc = _forecaster(tmp_path, ["gsm8k-test-00000"])
    kw = {"model": "qwen3_moe-tiny", "policy": f"seqmoe:forecaster={fc}", "capacity": 0.5, "device": "cpu",
          "max_gen_toks": 2, "speed_samples": 0}
    req = [SimpleNamespace(args=("2 + 2 =", {"until": ["\n"]}), task_name="gsm8k", doc_id=0, doc={})]
    lm = ExpertcastLM(**kw)
    with pytest.raises(OverlapError, match="gsm8k-test-00000"):
        lm.generate_until(req)
    assert lm._batches == []  # refused before any generation
    lm = ExpertcastLM(**kw, allow_overlap="true")
    lm.generate_until(req)
    g = lm.get_model_info()[MODEL_NAME]["guard"]
    assert g["checks"]["forecaster"]["overlap"] == 1 and "--allow-overlap" in g["note"] and g["scored_problems"] == 1
    other = _forecaster(tmp_path / "o", [], model_id="olmoe-tiny")
    with pytest.raises(ModelMismatchError, match="olmoe-tiny"):  # refused before the model loads
        ExpertcastLM(**{**kw, "policy": f"seqmoe:forecaster={other}"})


def test_cli_refuses_the_overlap_in_one_line(tmp_path, data_dir, monkeypatch, capsys):
    from expertcast.commands.lm_eval import main

    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(data_dir))
    fc = _forecaster(tmp_path, ["gsm8k-test-00001"])
    rc = main(["--model_args", f"model=qwen3_moe-tiny,policy=seqmoe:forecaster={fc},capacity=0.5,max_gen_toks=2",
               "--tasks", "gsm8k", "--limit", "2", "--num_fewshot", "0", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("expertcast lm-eval: error:"), err[-5:]
    assert "were used to train" in err[-1] and "gsm8k-test-00001" in err[-1], err[-1]
    assert "--model_args allow_overlap=true" in err[-1], err[-1]


def test_unknown_task_is_one_line(capsys):
    from expertcast.commands.lm_eval import main

    rc = main(["--model_args", TINY, "--tasks", "nosuchtask", "--limit", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("expertcast lm-eval: error: --tasks: Tasks not found"), err[-5:]
    assert "nosuchtask" in err[-1] and "expertcast_arith" in err[-1]
    assert not any(line.startswith("ValueError: Tasks not found") for line in err), err  # lm_eval's traceback's end


@pytest.mark.slow
def test_int4_experts_through_the_harness(data_dir, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(data_dir))
    out = simple_evaluate(model=MODEL_NAME, model_args=TINY + ",expert_dtype=int4,speed_repeats=1", tasks=["gsm8k"],
                          limit=1, num_fewshot=0, device="cpu",
                          task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False))
    m = out["config"]["expertcast"]
    assert m["expert_dtype"] == "int4" and m["load"]["plan"]["expert_format"] == "int4"
    assert m["speed"]["baseline"] == "all-resident" and m["speed"]["tokens_match"]  # the same int4 kernels
    assert m["guard"]["checks"] == {} and m["guard"]["scored_problems"] == 1
