"""Every shipped training YAML goes through LightningCLI itself (``expertcast fit``'s FitCLI, ``run=False``):
model, data module, run directory and trainer (strategy, precision, logger, callbacks) are instantiated for
real, so a typo or a wrong class path fails CI. The real-size configs run with what this machine can hold
substituted: a tiny preset for the Qwen3-30B-A3B backbone (with a cache budget that fits its 16 experts), a
tiny synthetic trace folder for the forecaster traces, ``accelerator: cpu`` with one device; everything else
(FSDP2 strategy and its decoder-layer class, precision, LoRA targets, W&B logger, checkpoint callbacks) is the
shipped value. The default model's recipe (``configs/tiny_default/default.yaml``) is not a Lightning config: it
is read the way ``expertcast build-default --config`` reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for sub in ("forecaster", "router") for p in (REPO / "configs" / sub).glob("*.yaml"))
ROUTER = ["--model.init_args.model", "qwen3_moe-tiny", "--model.init_args.budget", "4",
          "--data.init_args.limit", "16"]
"""The router backbone (the embedded default model would be trained on first use, Qwen3-30B-A3B downloaded)."""
ON_CPU = ["--trainer.accelerator", "cpu", "--trainer.devices", "1"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    from expertcast.data.synthetic import ModeMarkovProcess
    from expertcast.data.traces import write_traces

    proc = ModeMarkovProcess.random(num_modes=4, num_layers=2, num_experts=8, top_k=2, seed=0)
    seqs, _ = proc.sample(12, 24, prompt_len=4, seed=0)
    return write_traces(tmp_path_factory.mktemp("cfg_traces") / "traces", proc.meta(), seqs)


def _overrides(config: Path, traces: Path) -> list[str]:
    raw = yaml.safe_load(config.read_text())
    extra = list(ROUTER) if config.parent.name == "router" else ["--data.init_args.traces", str(traces)]
    if raw["trainer"].get("accelerator") != "cpu":
        extra += ON_CPU
    return extra


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_yaml_instantiates_through_lightning_cli(config, traces, tmp_path, monkeypatch):
    from expertcast.train.cli import build_cli
    from expertcast.train.fit_run import RUN_DIR_ENV
    from lightning.pytorch.callbacks import ModelCheckpoint

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["expertcast"])
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)  # a set variable would name the run directory to use
    torch.set_num_threads(1)
    raw = yaml.safe_load(config.read_text())
    cli = build_cli(["--config", str(config), *_overrides(config, traces)])
    try:
        model, data, trainer = cli.model, cli.datamodule, cli.trainer
        assert type(model).__name__ == raw["model"]["class_path"].rpartition(".")[2]
        assert type(data).__name__ == raw["data"]["class_path"].rpartition(".")[2]
        run_dir = cli.plan.run_dir.resolve()
        assert run_dir.parent == (tmp_path / raw["trainer"]["default_root_dir"]).resolve()
        strategy = raw["trainer"].get("strategy", "auto")
        if isinstance(strategy, dict):  # a class from the YAML, with its init_args
            assert type(trainer.strategy).__name__ == strategy["class_path"].rpartition(".")[2]
            layer = strategy["init_args"]["layer_class"].rpartition(".")[2]
            assert trainer.strategy.layer_cls.__name__ == layer  # FSDP2 units: one per decoder layer
            assert any(type(m).__name__ == layer for m in model.backbone.modules())
            assert trainer.strategy.reshard_after_forward == strategy["init_args"]["reshard_after_forward"]
            assert trainer.strategy.activation_checkpointing == strategy["init_args"]["activation_checkpointing"]
        assert trainer.precision == str(raw["trainer"].get("precision", "32-true"))
        logger = raw["trainer"]["logger"]["class_path"].rpartition(".")[2]
        assert type(trainer.logger).__name__ == logger and Path(trainer.logger.save_dir).resolve() == run_dir
        checkpoints = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
        assert all(Path(c.dirpath).resolve() == run_dir / "checkpoints" for c in checkpoints)
        assert len(checkpoints) == sum("ModelCheckpoint" in c["class_path"] for c in raw["trainer"].get("callbacks", []))
        assert {k: model.hparams[k] for k in raw["model"]["init_args"] if k != "lora"} == {
            k: v for k, v in raw["model"]["init_args"].items() if k != "lora"} | {
            k: model.hparams[k] for k in ("model", "budget") if config.parent.name == "router"}
        if config.parent.name == "router":  # the forecaster's network is built from the traces' shape at setup
            assert sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
        lora = (raw["model"]["init_args"].get("lora") or {})
        if lora:  # the LoRA targets of the recipe exist on the backbone's family (peft wrapped them)
            names = {n for n, p in model.backbone.named_parameters() if p.requires_grad and "lora_" in n}
            owners = list(lora["target_modules"]) + [t.rpartition(".")[0] for t in lora.get("target_parameters", [])]
            for owner in owners:  # q_proj, ..., and the modules holding the target parameters (mlp.experts, mlp.gate)
                assert any(f".{owner}." in n for n in names), owner
            assert sorted(model.backbone.peft_config["default"].target_parameters) == sorted(lora["target_parameters"])
    finally:
        cli.plan.release()


def test_default_model_recipe_reads_as_build_default_does():
    from expertcast.recipes.tiny_default import TinyDefaultConfig

    path = REPO / "configs/tiny_default/default.yaml"
    cfg = TinyDefaultConfig.from_yaml(path)
    raw = yaml.safe_load(path.read_text())
    assert {k: getattr(cfg, k) for k in raw} == raw


COMMAND_CONFIGS = sorted(p for sub in ("eval", "sweep", "simulate") for p in (REPO / "configs" / sub).glob("*.yaml"))
LEFT_TO_THE_COMMAND_LINE = {"configs/sweep/study.yaml": ["--model", "qwen3_moe-tiny"]}
"""Flags a shipped example leaves to the command line (the README's sweep takes ``--model $M``)."""


def _command(config: Path):
    from expertcast.commands import evaluate, simulate, sweep

    return {"eval": evaluate, "sweep": sweep, "simulate": simulate}[config.parent.name]


def test_every_long_command_ships_an_example():
    assert {p.parent.name for p in COMMAND_CONFIGS} == {"eval", "sweep", "simulate"}


@pytest.mark.parametrize("config", COMMAND_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_command_yaml_parses_through_its_command_parser(config):
    """Every key is a flag of the command, typed and checked as that flag; the parsed arguments equal those of
    the command line spelling the same values out (switches as bare flags)."""
    rel = str(config.relative_to(REPO))
    extra = LEFT_TO_THE_COMMAND_LINE.get(rel, [])
    parser = _command(config).build_parser()
    got = vars(parser.parse_args(["--config", str(config), *extra]))
    argv = list(extra)
    for key, value in yaml.safe_load(config.read_text()).items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [] if value is False else [flag, str(value)]
    want = vars(_command(config).build_parser().parse_args(argv))
    assert got.pop("config") == str(config) and want.pop("config") is None
    assert got == want


def test_shipped_simulate_example_runs(tmp_path, capsys):
    from expertcast.commands.simulate import SETTINGS_FILE, main

    config = REPO / "configs/simulate/tiny.yaml"
    assert main(["--config", str(config), "--out", str(tmp_path / "sim")]) == 0
    saved = json.loads((tmp_path / "sim" / SETTINGS_FILE).read_text())
    assert saved["config"]["path"] == str(config.resolve())
