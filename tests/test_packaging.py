"""Packaging: every subpackage is listed in pyproject, shipped YAMLs parse, README and CI agree."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_subpackage_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {"expertcast"}
    for init in REPO.rglob("__init__.py"):
        rel = init.parent.relative_to(REPO)
        if rel.parts and rel.parts[0] in {"tests", "scripts", ".venv", "build"}:
            continue
        if any(p.startswith(".") for p in rel.parts):
            continue
        found.add(".".join(("expertcast", *rel.parts)) if rel.parts else "expertcast")
    missing = found - listed
    assert not missing, f"subpackages missing from [tool.setuptools].packages: {sorted(missing)}"
    stale = {p for p in listed if not (REPO.joinpath(*p.split(".")[1:]) / "__init__.py").is_file()}
    assert not stale, f"listed packages without __init__.py: {sorted(stale)}"


def test_package_dir_maps_repo_root():
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {"expertcast": "."}


def test_every_shipped_yaml_parses():
    yamls = sorted((REPO / "configs").rglob("*.yaml"))
    assert yamls, "no YAML configs shipped"
    for y in yamls:
        doc = yaml.safe_load(y.read_text())
        assert isinstance(doc, dict) and doc, f"{y} is empty or not a mapping"


def test_readme_commands_match_ci():
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/quickstart.sh" in readme
    assert "bash scripts/test.sh" in readme
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_inference_and_models_import_no_lightning_or_wandb():
    import ast

    for sub in ("inference", "models"):
        for py in (REPO / sub).rglob("*.py"):
            tree = ast.parse(py.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                for n in names:
                    root = n.split(".")[0]
                    assert root not in {"lightning", "pytorch_lightning", "wandb"}, f"{py} imports {n}"


def test_cli_help_lists_subcommands(capsys):
    from expertcast.cli import SUBCOMMANDS, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_cli_help_names_every_subcommand_of_a_group(capsys):
    """`expertcast --help` once listed `traces` as "import | stats" while it also has card and synth."""
    from expertcast.cli import main
    from expertcast.commands.traces import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    assert main(["--help"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("traces"))
    assert all(name in line for name in sub.choices), line
