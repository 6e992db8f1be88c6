"""Import directions between the package's layers (docs/design.md "Layout").

models/ imports neither train/ nor inference/; data/ imports neither; inference/ does not import train/;
train/ does not import inference/;
inference/ and models/ import no lightning or wandb; harness/ (the lm-eval adapter) imports neither nor train/;
only commands/ parses command lines (argparse).
Inside inference/: cache/ (the mechanism) imports nothing above models/, data/ and utils/; policies/ never
imports sim/, runtime/ or commands/; sim/ and runtime/ never import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP = {"tests", "scripts", ".venv", "build", "docs", ".git"}

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "models": ("expertcast.train", "expertcast.inference", "expertcast.commands", "lightning", "wandb"),
    "data": ("expertcast.train", "expertcast.inference", "expertcast.commands"),
    "inference": ("expertcast.train", "expertcast.commands", "lightning", "wandb"),
    "train": ("expertcast.inference", "expertcast.commands"),
    "utils": ("expertcast.train", "expertcast.inference", "expertcast.commands"),
    "harness": ("expertcast.train", "lightning", "wandb"),
}

ROOMS: dict[str, tuple[str, ...]] = {
    "inference/cache": ("expertcast.inference.policies", "expertcast.inference.sim", "expertcast.inference.runtime",
                        "expertcast.inference.saem", "expertcast.train", "expertcast.commands"),
    "inference/policies": ("expertcast.inference.sim", "expertcast.inference.runtime", "expertcast.commands"),
    "inference/sim": ("expertcast.inference.runtime",),
    "inference/runtime": ("expertcast.inference.sim",),
}
"""Import directions between the rooms of inference/ (docs/design.md, "Layout")."""


def _package_modules() -> list[Path]:
    out = []
    for p in sorted(REPO.rglob("*.py")):
        rel = p.relative_to(REPO)
        if rel.parts[0] in SKIP or any(part.startswith(".") for part in rel.parts):
            continue
        out.append(p)
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _hits(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_package_modules_found():
    assert len(_package_modules()) > 50


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_import_directions(layer):
    bad = []
    for p in _package_modules():
        rel = p.relative_to(REPO)
        if rel.parts[0] != layer:
            continue
        bad += [f"{rel}:{ln} imports {name}" for ln, name in _imports(p) if _hits(name, FORBIDDEN[layer])]
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_room_import_directions(room):
    bad = []
    for p in _package_modules():
        rel = p.relative_to(REPO)
        if rel.parts[:2] != tuple(room.split("/")):
            continue
        bad += [f"{rel}:{ln} imports {name}" for ln, name in _imports(p) if _hits(name, ROOMS[room])]
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_inference_holds_only_its_rooms():
    """inference/ has no loose modules: every module lives in one of its five rooms."""
    loose = sorted(p.name for p in (REPO / "inference").glob("*.py") if p.name != "__init__.py")
    rooms = sorted(p.name for p in (REPO / "inference").iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert not loose, f"loose modules in inference/: {loose}"
    assert rooms == ["cache", "policies", "runtime", "saem", "sim"], rooms


def test_only_commands_parse_command_lines():
    bad = []
    for p in _package_modules():
        rel = p.relative_to(REPO)
        if rel.parts[0] == "commands":
            continue
        bad += [f"{rel}:{ln}" for ln, name in _imports(p) if name == "argparse"]
    assert not bad, "argparse outside commands/:\n" + "\n".join(bad)
