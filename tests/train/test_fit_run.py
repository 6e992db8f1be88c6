"""Every shipped training YAML parses against its classes' signatures (LightningCLI, nothing
instantiated: the real-size ones name models and GPUs this machine lacks) and keeps run files inside
the run directory: no ckpt_path, no fixed checkpoint folder, no logger save_dir, no export_dir."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from expertcast.train.cli import FitCLI, FitOptions, _check_held
from expertcast.train.fit_run import StopRequest

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for sub in ("forecaster", "router") for p in (REPO / "configs" / sub).glob("*.yaml"))


class ParseOnlyCLI(FitCLI):
    def instantiate_classes(self) -> None:
        _check_held(self.config["trainer"]["logger"], self.config["trainer"]["callbacks"])


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["expertcast"])  # LightningCLI warns when argv and args both hold options


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_config_parses_and_keeps_runs_apart(config):
    cli = ParseOnlyCLI(["--config", str(config)], FitOptions(), StopRequest())
    assert cli.config["ckpt_path"] is None
    assert cli.config["model"]["init_args"]["export_dir"] is None
    raw = yaml.safe_load(config.read_text())
    assert "ckpt_path" not in raw and "export_dir" not in raw["model"]["init_args"]
    assert raw["trainer"]["default_root_dir"].startswith(f"runs/{config.parent.name}/")


def test_a_fixed_checkpoint_folder_is_refused(tmp_path):
    from expertcast.utils.errors import UsageError

    cfg = yaml.safe_load((REPO / "configs/forecaster/tiny.yaml").read_text())
    cfg["trainer"]["callbacks"][0]["init_args"]["dirpath"] = "runs/forecaster/tiny/checkpoints"
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(UsageError, match="remove dirpath"):
        ParseOnlyCLI(["--config", str(path)], FitOptions(), StopRequest())
    with pytest.raises(UsageError, match="ckpt_path: last is not supported"):
        FitCLI(["--config", str(REPO / "configs/forecaster/tiny.yaml"), "--ckpt_path", "last"], FitOptions(),
               StopRequest())
