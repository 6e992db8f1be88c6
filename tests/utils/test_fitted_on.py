"""The one guard of what an artefact was fitted on: its sequence ids and the model whose routing it learnt."""

from __future__ import annotations

import pytest
from expertcast.utils.errors import OverlapError
from expertcast.utils.fitted_on import (
    FittedOn,
    ModelMismatchError,
    check_fitted_on,
    guard_note,
    model_of,
    same_model,
    trace_set_model,
)


def test_same_model_by_hash_preset_and_path(tmp_path):
    base = {"path": "/m/base", "files_sha256": "aa"}
    assert same_model(base, {"path": "/elsewhere/base-copy", "files_sha256": "aa"}) is True
    # a router-adapted model: another folder with other files, never its base
    assert same_model(base, {"path": "/m/adapted", "files_sha256": "bb"}) is False
    assert same_model({"path": "qwen3_moe-tiny", "preset": "qwen3_moe-tiny", "init_seed": 0},
                      {"path": "qwen3_moe-tiny", "preset": "qwen3_moe-tiny", "init_seed": 1}) is False
    assert same_model({"path": "qwen3_moe-tiny", "preset": "qwen3_moe-tiny"},
                      {"path": "qwen3_moe-tiny", "preset": "qwen3_moe-tiny", "init_seed": 1}) is True
    (tmp_path / "m").mkdir()
    assert same_model(model_of(None, str(tmp_path / "m")), model_of(None, str(tmp_path / "." / "m"))) is True
    assert same_model(model_of(None, "org/a"), model_of(None, "org/b")) is False
    assert same_model(None, model_of(None, "org/b")) is None


def test_check_refuses_overlap_and_mismatch_unless_allowed():
    fitted = FittedOn("the forecaster X", frozenset({"a", "b"}), {"path": "org/base"})
    ok = check_fitted_on(fitted, ["c"], {"path": "org/base"})
    assert ok["overlap"] == 0 and ok["model_match"] is True
    with pytest.raises(OverlapError, match="1 of the 2 evaluated sequences were used to train the forecaster X"):
        check_fitted_on(fitted, ["a", "c"], {"path": "org/base"})
    with pytest.raises(ModelMismatchError, match="'org/base' but .* come from model 'org/adapted'.*--allow-model-mis"):
        check_fitted_on(fitted, ["c"], {"path": "org/adapted"})
    got = check_fitted_on(fitted, ["a", "c"], {"path": "org/adapted"}, allow_overlap=True, allow_model_mismatch=True)
    assert got["overlap"] == 1 and got["model_match"] is False and got["model_mismatch_allowed"] is True
    note = guard_note({"seqmoe": got})
    assert "--allow-overlap" in note and "--allow-model-mismatch" in note and "org/adapted" in note
    with pytest.raises(OverlapError, match="records no training sequence ids"):
        check_fitted_on(FittedOn("the cue set Y", None, None), ["a"], None)


def test_trace_set_model_reads_the_collect_identity(tmp_path):
    import json

    (tmp_path / "manifest.json").write_text(json.dumps({"run": {"model": {"path": "/m", "files_sha256": "cc"}}}))
    (tmp_path / "trace_meta.json").write_text(json.dumps({"model_id": "/m"}))
    assert trace_set_model(tmp_path, None) == {"path": "/m", "files_sha256": "cc"}
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": {}}))
    assert trace_set_model(tmp_path, None) == {"path": "/m"}


def test_a_router_adapted_model_never_matches_its_base(tmp_path):
    """A router-adaptation export records its base; the adapted model (the export's own files) routes otherwise:
    a forecaster fitted on the base's routing is refused beside it."""
    from expertcast.models.backbone import model_identity
    from expertcast.models.router_export import router_fitted_on
    from expertcast.train.router_module import RouterAdaptationModule

    export = RouterAdaptationModule(model="qwen3_moe-tiny", mode="temporal", init="random", seed=1).export(
        tmp_path / "temporal")
    fitted = router_fitted_on(export)
    assert fitted.model["path"] == "qwen3_moe-tiny" and fitted.ids is None  # exported outside `fit`: no ids
    base = model_identity("qwen3_moe-tiny")
    adapted = model_identity(str(export))
    assert same_model(fitted.model, base) is True and same_model(base, adapted) is False
    forecaster = FittedOn("the forecaster F", frozenset(), base)
    with pytest.raises(ModelMismatchError, match="router-adapted"):
        check_fitted_on(forecaster, ["x"], adapted)
