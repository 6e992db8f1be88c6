"""Forecaster export: round trip without Lightning; foreign, corrupt, altered and mismatched exports refused;
the manifest guards every file; training ids read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.models.forecaster_export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    ForecasterExportError,
    load_forecaster,
    save_forecaster,
    training_ids,
)
from expertcast.utils.provenance import EXPORT_MANIFEST, write_export_manifest

torch.set_num_threads(1)


@pytest.fixture
def model() -> ExpertForecaster:
    torch.manual_seed(0)
    cfg = ForecasterConfig(num_layers=2, num_experts=8, top_k=2, trigger_layer=0, hidden_size=32, head_dim=16,
                           state_size=8, num_blocks=1)
    return ExpertForecaster(cfg).eval()


def test_round_trip_same_predictions(tmp_path, model):
    out = save_forecaster(model, tmp_path / "exp", source={"model_id": "tiny"}, extra={"note": 1})
    exp = load_forecaster(out)
    assert exp.config == model.config and exp.source["model_id"] == "tiny" and exp.extra["note"] == 1
    x = torch.rand(2, 5, 2, 8)
    with torch.no_grad():
        assert torch.equal(exp.model(x), model(x))
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["format"] == "expertcast-forecaster" and cfg["format_version"] == 5
    exp.check_compatible(2, 8, 2)
    with pytest.raises(ValueError, match="another model"):
        exp.check_compatible(48, 128, 8, what="trace")


def test_foreign_json_refused(tmp_path, model):
    out = save_forecaster(model, tmp_path / "exp")
    (out / CONFIG_NAME).write_text(json.dumps({"format": "something-else", "format_version": 1}))
    with pytest.raises(ForecasterExportError, match="not a forecaster export"):
        load_forecaster(out)
    (out / CONFIG_NAME).write_text("not json at all")
    with pytest.raises(ForecasterExportError, match="not valid JSON"):
        load_forecaster(out)
    with pytest.raises(ForecasterExportError, match="not found"):
        load_forecaster(tmp_path / "missing")


def test_newer_version_refused(tmp_path, model):
    out = save_forecaster(model, tmp_path / "exp")
    cfg = json.loads((out / CONFIG_NAME).read_text())
    cfg["format_version"] = 99
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ForecasterExportError, match="version 99"):
        load_forecaster(out)


def test_corrupt_weights_refused(tmp_path, model):
    out = save_forecaster(model, tmp_path / "exp")
    blob = bytearray((out / WEIGHTS_NAME).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (out / WEIGHTS_NAME).write_bytes(bytes(blob))
    with pytest.raises(ForecasterExportError, match="corrupt"):
        load_forecaster(out)


def _rewrite(out, cfg) -> None:
    """Write ``cfg`` as the export's JSON with a matching manifest (a consistent but wrong export)."""
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    write_export_manifest(out, [CONFIG_NAME, WEIGHTS_NAME])


def test_config_weight_mismatch_refused(tmp_path, model):
    out = save_forecaster(model, tmp_path / "exp")
    cfg = json.loads((out / CONFIG_NAME).read_text())
    cfg["config"]["hidden_size"] = 64
    _rewrite(out, cfg)
    with pytest.raises(ForecasterExportError, match="shape"):
        load_forecaster(out)
    cfg["config"]["hidden_size"] = 32
    cfg["config"]["bogus"] = 1
    _rewrite(out, cfg)
    with pytest.raises(ForecasterExportError, match="bogus"):
        load_forecaster(out)


@pytest.mark.parametrize("key, value", [("temperature", 0.5), ("trigger_layer", 1)])
def test_edited_config_refused_by_the_manifest(tmp_path, model, key, value):
    out = save_forecaster(model, tmp_path / "exp")
    h = load_forecaster(out).export_hash
    assert h and len(h) == 64
    cfg = json.loads((out / CONFIG_NAME).read_text())
    cfg["config"][key] = value
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ForecasterExportError, match=f"{CONFIG_NAME} was modified"):
        load_forecaster(out)


def test_extra_file_missing_manifest_and_escaping_weights_refused(tmp_path, model):
    out = save_forecaster(model, tmp_path / "exp")
    (out / "notes.txt").write_text("x")
    with pytest.raises(ForecasterExportError, match="notes.txt is not part of the export"):
        load_forecaster(out)
    (out / "notes.txt").unlink()
    # the weights entry must stay inside the export, even with a consistent manifest
    (tmp_path / "x").write_bytes((out / WEIGHTS_NAME).read_bytes())
    cfg = json.loads((out / CONFIG_NAME).read_text())
    cfg["weights"] = "../x"
    _rewrite(out, cfg)
    with pytest.raises(ForecasterExportError, match="outside the export"):
        load_forecaster(out)
    (out / EXPORT_MANIFEST).unlink()
    with pytest.raises(ForecasterExportError, match="re-export"):
        load_forecaster(out)


def test_training_ids_are_train_and_val(tmp_path, model):
    assert training_ids(save_forecaster(model, tmp_path / "plain")) is None
    block = {"traces": ["t"], "trace_fingerprint": "f", "train_ids": ["a", "b"], "val_ids": ["c"], "test_ids": ["d"]}
    out = save_forecaster(model, tmp_path / "exp", training=block)
    assert training_ids(out) == {"a", "b", "c"}
    assert load_forecaster(out).training == block


def test_online_statistics_round_trip_and_format_1_exports_still_load(tmp_path, model):
    """Format 2 carries the online prior (config + tensors); a format-1 export (no online statistics)
    loads as the same forecaster without them."""
    cfg = ForecasterConfig(**{**model.config.to_dict(), "online_half_lives": [0.0, 8.0]})
    online = ExpertForecaster(cfg).eval()
    with torch.no_grad():
        online.online.mix.normal_()
        online.head.weight.normal_()
    exp = load_forecaster(save_forecaster(online, tmp_path / "online"))
    assert exp.config.online_half_lives == [0.0, 8.0]
    x = torch.rand(2, 5, 2, 8)
    with torch.no_grad():
        assert torch.equal(exp.model(x), online(x))
    old = save_forecaster(model, tmp_path / "v1")
    c = json.loads((old / CONFIG_NAME).read_text())
    c["format_version"] = 1
    del c["config"]["online_half_lives"]
    (old / CONFIG_NAME).write_text(json.dumps(c))
    write_export_manifest(old, [WEIGHTS_NAME, CONFIG_NAME])
    exp1 = load_forecaster(old)
    assert exp1.model.online is None
    with torch.no_grad():
        assert torch.equal(exp1.model(x), model(x))


FIXTURE = Path(__file__).parent / "fixtures" / "forecaster-format4"
"""A format-4 export written by expertcast when the backbone was transformers' Mamba2Model (L=3, E=8, K=2, two
blocks, G=1, two direct heads, online statistics; every backbone tensor moved off its initial value) and, in
``outputs.safetensors``, that expertcast's outputs on the inputs ``x`` stored beside them: the window forward (all
heads), the same elements one step at a time, a rollout after them, and two state tensors."""


def test_format4_export_loads_and_reproduces_its_outputs(tmp_path):
    from safetensors.torch import load_file

    exp = load_forecaster(FIXTURE / "export")
    want = load_file(FIXTURE / "outputs.safetensors")
    x = want["x"]
    with torch.no_grad():
        full = exp.model(x, all_horizons=True)
        st = exp.model.init_state(2)
        steps = torch.stack([exp.model.step(x[:, i], st, all_horizons=True)[0] for i in range(x.shape[1])], 1)
        roll = exp.model.rollout(steps[:, -1], st, 4)
    for name, got in {"full": full, "steps": steps, "rollout": roll, "ssm0": st.ssm[0], "conv1": st.conv[1]}.items():
        torch.testing.assert_close(got, want[name], atol=1e-5, rtol=1e-5, msg=name)
    # re-exported: format 5, without transformers' unused embedding, same outputs
    out = save_forecaster(exp.model, tmp_path / "again")
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["format_version"] == 5 and "use_mambapy" not in cfg["config"]
    assert "backbone.embeddings.weight" not in load_file(out / WEIGHTS_NAME)
    with torch.no_grad():
        assert torch.equal(load_forecaster(out).model(x, all_horizons=True), full)


def test_mamba1_export_is_refused_naming_the_format(tmp_path):
    import shutil

    d = tmp_path / "m1"
    shutil.copytree(FIXTURE / "export", d)
    cfg = json.loads((d / CONFIG_NAME).read_text())
    cfg["config"]["backbone"] = "mamba"
    (d / CONFIG_NAME).write_text(json.dumps(cfg))
    write_export_manifest(d, [WEIGHTS_NAME, CONFIG_NAME])
    with pytest.raises(ForecasterExportError, match=r"format 4 with backbone 'mamba' \(transformers' Mamba-1\)") as e:
        load_forecaster(d)
    assert "\n" not in str(e.value)


def test_element_branch_round_trips_and_exports_without_it_still_load(tmp_path, model):
    """The per-element branch (``skip_hidden``) travels in the export (config + ``skip.*`` tensors; same outputs,
    recurrent state included); an export written before it (no ``skip_hidden`` key) loads as the forecaster without
    it; a branch whose tensors are missing is refused."""
    cfg = ForecasterConfig(**{**model.config.to_dict(), "skip_hidden": 6, "direct_horizons": 2})
    torch.manual_seed(1)
    skip = ExpertForecaster(cfg).eval()
    out = save_forecaster(skip, tmp_path / "skip")
    exp = load_forecaster(out)
    assert exp.config.skip_hidden == 6 and exp.model.skip is not None
    from safetensors.torch import load_file

    assert {"skip.hidden.weight", "skip.out.weight"} <= set(load_file(out / WEIGHTS_NAME))
    x = torch.rand(2, 5, 2, 8)
    with torch.no_grad():
        assert torch.equal(exp.model(x, all_horizons=True), skip(x, all_horizons=True))
        sa, sb = exp.model.init_state(2), skip.init_state(2)
        for t in range(5):
            assert torch.equal(exp.model.step(x[:, t], sa)[0], skip.step(x[:, t], sb)[0])
        assert torch.equal(sa.skip, sb.skip)
    old = save_forecaster(model, tmp_path / "before")
    c = json.loads((old / CONFIG_NAME).read_text())
    del c["config"]["skip_hidden"]
    (old / CONFIG_NAME).write_text(json.dumps(c))
    write_export_manifest(old, [WEIGHTS_NAME, CONFIG_NAME])
    before = load_forecaster(old)
    assert before.config.skip_hidden == 0 and before.model.skip is None
    with torch.no_grad():
        assert torch.equal(before.model(x), model(x))
    c["config"]["skip_hidden"] = 6  # a branch the weights do not hold
    (old / CONFIG_NAME).write_text(json.dumps(c))
    write_export_manifest(old, [WEIGHTS_NAME, CONFIG_NAME])
    with pytest.raises(ForecasterExportError, match="missing.*skip"):
        load_forecaster(old)


def test_cross_layer_component_round_trips_and_exports_without_it_keep_their_components(tmp_path, model):
    """The cross-layer component travels in the export (config + ``components.cross``; same outputs with it
    selected); an export written before it (no ``component_cross_layer`` key, no tensor) loads with the components
    and indices it had: the same names, the same outputs with its per-sequence leader (which runs over every
    component) on; a config that asks for it over weights without the table is refused."""
    from expertcast.data.synthetic import StickyRoutingProcess
    from expertcast.models.forecaster_components import component_names

    proc = StickyRoutingProcess.realistic(num_layers=2, num_experts=8, top_k=2, seed=0)
    seqs = proc.sample(4, 20, prompt_len=4, seed=1)
    kw = {**model.config.to_dict(), "direct_horizons": 2, "component_half_lives": [16.0], "switch_half_life": 8.0}
    x = torch.rand(2, 9, 2, 8)
    cfg = ForecasterConfig(**{**kw, "component_cross_layer": True, "selection": [[5, -1], [5, 2]]})
    torch.manual_seed(1)
    cross = ExpertForecaster(cfg).eval()
    cross.components.fit(seqs, 0)
    exp = load_forecaster(save_forecaster(cross, tmp_path / "cross"))
    assert exp.config.component_cross_layer and exp.model.components.names[-1] == "cross-layer"
    assert torch.equal(exp.model.components.cross, cross.components.cross)
    with torch.no_grad():
        assert torch.equal(exp.model(x, all_horizons=True), cross(x, all_horizons=True))
    torch.manual_seed(1)
    before = ExpertForecaster(ForecasterConfig(**{**kw, "selection": [[4, -1], [3, 2]]})).eval()
    before.components.fit(seqs, 0)
    old = save_forecaster(before, tmp_path / "before")
    c = json.loads((old / CONFIG_NAME).read_text())
    del c["config"]["component_cross_layer"]
    (old / CONFIG_NAME).write_text(json.dumps(c))
    write_export_manifest(old, [WEIGHTS_NAME, CONFIG_NAME])
    from safetensors.torch import load_file

    assert not any("cross" in k for k in load_file(old / WEIGHTS_NAME))
    got = load_forecaster(old)
    assert not got.config.component_cross_layer and got.model.components.names == component_names([16.0])
    assert got.model.leads
    with torch.no_grad():
        assert torch.equal(got.model(x, all_horizons=True), before(x, all_horizons=True))
    c["config"]["component_cross_layer"] = True  # a table the weights do not hold
    (old / CONFIG_NAME).write_text(json.dumps(c))
    write_export_manifest(old, [WEIGHTS_NAME, CONFIG_NAME])
    with pytest.raises(ForecasterExportError, match="missing.*components.cross"):
        load_forecaster(old)
