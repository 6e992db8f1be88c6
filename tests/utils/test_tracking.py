"""W&B beyond scalars, offline: a command's table and plot, and an export as an artifact with its JSON
config, read back from the offline run directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from expertcast.utils.tracking import log_export_to_loggers


def _runs(d: Path) -> list[Path]:
    return sorted((d / "wandb").glob("offline-run-*"))



def test_simulate_logs_its_table_and_plot(tmp_path, wandb_dir, offline_contents):
    from expertcast.commands.simulate import main

    rc = main(["--synthetic", "zipf", "--synthetic-shape", "2,8,2,3,24", "--policies", "lru,belady",
               "--capacity", "0.5", "--out", str(tmp_path / "sim"), "--wandb", "--wandb-project", "t"])
    assert rc == 0
    [run] = _runs(wandb_dir)
    got = offline_contents(run, lambda c: c["tables"] and c["images"])
    [table] = [t for t in got["tables"] if Path(t).name.startswith("simulate")]
    logged = json.loads((run / table).read_text())
    records = json.loads((tmp_path / "sim" / "simulate.json").read_text())
    assert [r[logged["columns"].index("policy")] for r in logged["data"]] == [r["policy"] for r in records]
    assert any(Path(i).name.startswith("hit_vs_capacity") for i in got["images"])


def test_a_run_left_open_by_another_caller_is_not_reused(tmp_path, wandb_dir, offline_contents):
    """A trainer's WandbLogger (or any caller) may leave a run open in the process; a command's table goes to
    the command's own run, and the open run is left as it was."""
    import wandb
    from expertcast.commands.simulate import main

    other = wandb.init(project="other", dir=str(wandb_dir))
    try:
        assert main(["--synthetic", "zipf", "--synthetic-shape", "2,8,2,3,24", "--policies", "lru",
                     "--capacity", "0.5", "--out", str(tmp_path / "sim"), "--wandb", "--wandb-project", "t"]) == 0
        runs = _runs(wandb_dir)
        assert len(runs) == 2
        mine = [r for r in runs if other.id not in r.name]
        assert len(mine) == 1
        got = offline_contents(mine[0], lambda c: c["tables"])
        assert any(Path(t).name.startswith("simulate") for t in got["tables"])
    finally:
        other.finish()


def test_fit_export_is_an_artifact_with_its_config(tmp_path, wandb_dir, offline_contents):
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
    from expertcast.models.forecaster_export import save_forecaster
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    torch.manual_seed(0)
    model = ExpertForecaster(ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=16, head_dim=8,
                                              state_size=4, num_blocks=1))
    export = Path(save_forecaster(model, tmp_path / "exp", source={"model_id": "synthetic"}))
    (export / ".expertcast-output.json").write_text("{}")  # an output-folder marker: not part of the artifact
    wb = WandbLogger(project="t", save_dir=str(wandb_dir), offline=True)
    log_export_to_loggers([CSVLogger(tmp_path / "csv"), wb], export)  # what `expertcast fit` calls
    wb.experiment.finish()
    [run] = _runs(wandb_dir)
    [art] = [a for a in offline_contents(run, lambda c: c["artifacts"])["artifacts"]
             if a["type"] == "forecaster-export"]
    files = sorted(p.name for p in export.iterdir() if p.is_file() and not p.name.startswith("."))
    from expertcast.models.forecaster_export import verify_export

    # one artifact per export, named by its content hash: the name every consumer uses
    assert sorted(art["files"]) == files and art["name"] == f"forecaster-export-{verify_export(export)[:16]}"
    assert set(art["metadata"]) == {p[:-5] for p in files if p.endswith(".json")} | {"path", "sha256", "kind"}


def test_a_transaction_log_cut_inside_a_record_yields_the_records_before_it(tmp_path):
    """wandb's service may still be writing the log when it is read: a record the file ends inside is left out,
    never handed to the protobuf parser truncated."""
    import struct

    from expertcast.utils.tracking import _wandb_records

    def rec(data: bytes) -> bytes:
        return struct.pack("<IHB", 0, len(data), 1) + data  # a FULL record

    whole = b"W" * 7 + rec(b"first") + rec(b"second record")
    log = tmp_path / "run-x.wandb"
    log.write_bytes(whole)
    assert list(_wandb_records(log)) == [b"first", b"second record"]
    log.write_bytes(whole[:-4])  # the second record's last bytes not written yet
    assert list(_wandb_records(log)) == [b"first"]
