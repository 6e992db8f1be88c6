"""`expertcast forecast-eval`: evaluates only sequences the export never saw by default, refuses (or, when
allowed, reports) an overlap with the export's training ids, and fails with one line on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from expertcast.commands.forecast_eval import main
from expertcast.data.synthetic import zipf_traces
from expertcast.data.traces import write_traces
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.models.forecaster_export import save_forecaster
from expertcast.utils.outdir import claim_output_dir


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A trace set of 8 sequences and an export trained (per its training block) on the first 5 of them."""
    root = tmp_path_factory.mktemp("fe")
    tr = zipf_traces(8, 16, num_layers=2, num_experts=8, top_k=2, prompt_len=4, seed=1)
    traces = write_traces(root / "traces", tr.meta, tr.sequences)
    ids = [s.seq_id for s in tr.sequences]
    torch.manual_seed(0)
    model = ExpertForecaster(ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=16, head_dim=8,
                                              state_size=4, num_blocks=1, direct_horizons=2)).eval()
    training = {"traces": [str(traces)], "split": {"seed": 0, "val_fraction": 0.2, "test_fraction": 0.0},
                "train_ids": ids[:4], "val_ids": ids[4:5]}
    export = save_forecaster(model, root / "export", source={"model_id": tr.meta.model_id}, training=training)
    everything = save_forecaster(model, root / "seen-all", source={"model_id": tr.meta.model_id},
                                 training={**training, "train_ids": ids[:7], "val_ids": ids[7:]})
    return {"traces": traces, "export": export, "seen_all": everything, "ids": ids, "root": root}


def _run(data, tmp_path, *extra) -> int:
    return main(["--forecaster", str(data["export"]), "--traces", str(data["traces"]), "--horizons", "2",
                 "--out", str(tmp_path / "out"), *extra])


def _summary(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "recall_summary.json").read_text())


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_default_evaluates_only_sequences_the_export_never_saw(data, tmp_path):
    assert _run(data, tmp_path) == 0
    s = _summary(tmp_path)
    assert s["split"] == "held-out" and s["sequences"] == 3
    assert s["overlap"]["forecaster"] == {"overlap": 0, "evaluated": 3, "allowed": False, "model_match": True,
                                          "model_mismatch_allowed": False, "fitted_model": {"path": "synthetic-zipf"},
                                          "scored_model": {"path": "synthetic-zipf"}}
    assert s["overlap"]["baselines"]["overlap"] == 0 and len(s["export_hash"]) == 64
    assert {r["predictor"] for r in s["rows"]} == {"forecaster", "repeat-last", "frequency", "transition",
                                                   "recent-freq", "recent-count", "cross-layer", "cross-x-recent",
                                                   "mlp-reference"}
    # the reference MLP's and the forecaster's cost per decode step, and the MLP's fit time
    assert s["cost"]["mlp-reference"]["parameters"] > 0 and s["cost"]["mlp-reference"]["fit_s"] >= 0
    assert s["cost"]["forecaster"]["step_flops"] > 0
    assert (tmp_path / "out" / "recall.png").read_bytes()[:4] == b"\x89PNG"


def test_overlap_is_an_error_unless_allowed_then_reported(data, tmp_path, capsys):
    assert _run(data, tmp_path, "--split", "all") == 2
    err = _err(capsys)
    assert "5 of the 8 evaluated sequences were used to train the forecaster" in err and "--allow-overlap" in err
    assert _run(data, tmp_path, "--split", "all", "--allow-overlap") == 0
    assert "forecaster trained on 5 of the 8 evaluated sequences (--allow-overlap)" in capsys.readouterr().out
    s = _summary(tmp_path)
    assert {k: s["overlap"]["forecaster"][k] for k in ("overlap", "evaluated", "allowed", "model_match")} == \
        {"overlap": 5, "evaluated": 8, "allowed": True, "model_match": True}


def test_another_models_routing_is_refused_unless_allowed_then_reported(data, tmp_path, capsys):
    """The export records the routing's model (a base model); traces of a router-adapted model (another folder,
    other files) route differently: refused, or with --allow-model-mismatch reported in the title and JSON."""
    from expertcast.data.traces import iter_traces, read_meta

    base, adapted = tmp_path / "base", tmp_path / "adapted"
    for d, w in ((base, b"base"), (adapted, b"adapted")):
        d.mkdir()
        (d / "model.safetensors").write_bytes(w)
    torch.manual_seed(0)
    model = ExpertForecaster(ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=16, head_dim=8,
                                              state_size=4, num_blocks=1, direct_horizons=2)).eval()
    from expertcast.models.backbone import model_identity

    training = {"traces": [str(data["traces"])], "split": {"seed": 0, "val_fraction": 0.2},
                "train_ids": data["ids"][:4], "val_ids": data["ids"][4:5], "model": model_identity(str(base))}
    export = save_forecaster(model, tmp_path / "export", source={"model_id": str(base)}, training=training)
    meta = read_meta(data["traces"])
    meta.model_id = str(adapted)
    traces = write_traces(tmp_path / "adapted-traces", meta, list(iter_traces(data["traces"], read_meta(data["traces"]))))
    argv = ["--forecaster", str(export), "--traces", str(traces), "--horizons", "2", "--mlp-steps", "0"]
    assert main([*argv, "--out", str(tmp_path / "o1")]) == 2
    err = _err(capsys)
    assert "was fitted on model" in err and "adapted" in err and "--allow-model-mismatch" in err
    assert main([*argv, "--out", str(tmp_path / "out"), "--allow-model-mismatch"]) == 0
    assert "(--allow-model-mismatch)" in capsys.readouterr().out
    fc = _summary(tmp_path)["overlap"]["forecaster"]
    assert fc["model_match"] is False and fc["scored_model"]["path"] == str(adapted)
    assert fc["fitted_model"]["files_sha256"] == model_identity(str(base))["files_sha256"]


def test_an_export_without_training_ids_needs_allow_overlap(data, tmp_path, capsys):
    torch.manual_seed(0)
    no_ids = save_forecaster(ExpertForecaster(ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=16,
                                                               head_dim=8, state_size=4, num_blocks=1)),
                             tmp_path / "no-ids", extra={"split": {"split_seed": 0, "val_fraction": 0.5}})
    argv = ["--forecaster", str(no_ids), "--traces", str(data["traces"]), "--horizons", "2", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "records no training sequence ids" in _err(capsys)
    assert main(argv + ["--allow-overlap"]) == 0
    s = json.loads((tmp_path / "o" / "recall_summary.json").read_text())
    assert s["split"] == "val" and s["overlap"]["forecaster"]["overlap"] is None
    assert "the forecaster records no training ids (--allow-overlap)" in capsys.readouterr().out


def test_baselines_fitted_on_evaluated_sequences_count_as_overlap(data, tmp_path, capsys):
    assert _run(data, tmp_path, "--fit-traces", str(data["traces"])) == 2
    assert "were used to train the baselines" in _err(capsys)


def test_nothing_held_out_is_an_error_naming_the_way_out(data, tmp_path, capsys):
    rc = main(["--forecaster", str(data["seen_all"]), "--traces", str(data["traces"]), "--out", str(tmp_path / "o")])
    assert rc == 2
    err = _err(capsys)
    assert "every sequence of" in err and "test split" in err and "--allow-overlap" in err


@pytest.mark.parametrize("extra, message", [
    (["--horizons", "0"], "--horizons: expected a positive integer"),
    (["--max-sequences", "-1"], "--max-sequences: expected a positive integer"),
    (["--split", "train"], "argument --split: invalid choice"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
])
def test_bad_input_exits_2_with_one_line(data, tmp_path, capsys, extra, message):
    assert _run(data, tmp_path, *extra) == 2
    assert message in _err(capsys)


def test_missing_or_foreign_export_and_concurrent_run(data, tmp_path, capsys):
    assert main(["--forecaster", str(data["traces"]), "--traces", str(data["traces"])]) == 2
    assert "forecaster.json not found" in _err(capsys)
    with claim_output_dir(tmp_path / "out", "forecast-eval"):
        assert _run(data, tmp_path) == 2
    assert "is in use by another expertcast run" in _err(capsys)
    edited = Path(data["root"]) / "edited"
    save_forecaster(ExpertForecaster(ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=16,
                                                      head_dim=8, state_size=4, num_blocks=1)), edited)
    cfg = json.loads((edited / "forecaster.json").read_text())
    cfg["config"]["temperature"] = 3.0
    (edited / "forecaster.json").write_text(json.dumps(cfg))
    assert main(["--forecaster", str(edited), "--traces", str(data["traces"])]) == 2
    assert "forecaster.json" in _err(capsys)


def test_wandb_run_declares_the_export_and_the_traces(data, tmp_path, wandb_dir, offline_contents):
    from expertcast.data.trace_format import sequences_fingerprint
    from expertcast.data.traces import load_traces

    assert _run(data, tmp_path, "--wandb", "--wandb-project", "t") == 0
    [run] = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    got = offline_contents(run, lambda c: len([a for a in c["artifacts"] if a["used"]]) == 2 and c["tables"])
    used = {a["type"]: a for a in got["artifacts"] if a["used"]}
    assert used["forecaster-export"]["sha256"] == _summary(tmp_path)["export_hash"]
    assert used["trace-set"]["sha256"] == sequences_fingerprint(load_traces(data["traces"])[1])
    assert got["step_axes"]["forecaster/recall@K"] == "horizon"


def test_within_token_reach_is_reported_beside_the_recall_and_can_be_skipped(tmp_path, capsys):
    """L = 4, trigger layer 0: the reach table scores layers 2-3 (distances 1 and 2; 4 and 8 are not below L) from
    tables fitted on the baselines' sequences, in the JSON, a CSV and the printed table; ``--reach-distances`` with
    no value skips it."""
    tr = zipf_traces(8, 16, num_layers=4, num_experts=8, top_k=2, prompt_len=4, seed=1)
    traces = write_traces(tmp_path / "traces", tr.meta, tr.sequences)
    ids = [s.seq_id for s in tr.sequences]
    torch.manual_seed(0)
    model = ExpertForecaster(ForecasterConfig(num_layers=4, num_experts=8, top_k=2, hidden_size=16, head_dim=8,
                                              state_size=4, num_blocks=1, direct_horizons=2, trigger_layer=0)).eval()
    export = save_forecaster(model, tmp_path / "export", source={"model_id": tr.meta.model_id},
                             training={"traces": [str(traces)], "split": {"seed": 0, "val_fraction": 0.2},
                                       "train_ids": ids[:4], "val_ids": ids[4:5]})
    base = ["--forecaster", str(export), "--traces", str(traces), "--horizons", "2", "--mlp-steps", "0"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    s = json.loads((tmp_path / "a" / "recall_summary.json").read_text())
    reach = s["reach"]
    assert reach["layers"] == [2, 3] and reach["targets"] == 3 * 12 * 2  # 3 held-out x 12 decode positions x 2
    assert [r["predictor"] for r in reach["rows"]] == ["repeat-last", "recent-freq", "layer 0 (trigger)",
                                                       "layer 0 (trigger) x recent", "1 back", "1 back x recent",
                                                       "2 back", "2 back x recent"]
    assert all(0.0 <= r["R@K"] <= r["R@K+3"] <= 1.0 for r in reach["rows"])
    assert "within-token reach: layers 2-3" in capsys.readouterr().out
    assert (tmp_path / "a" / "reach.csv").read_text().splitlines()[0].startswith("predictor,R@K,R@K+3,targets")
    assert main([*base, "--out", str(tmp_path / "b"), "--reach-distances"]) == 0
    assert json.loads((tmp_path / "b" / "recall_summary.json").read_text())["reach"] is None
    assert not (tmp_path / "b" / "reach.csv").exists()
