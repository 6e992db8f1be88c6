"""Import directions between the package's layers (docs/design.md "Layout").

Recipes above, library below: only cli.py, commands/ and scripts/ import a job (expertcast.commands) or a recipe
(expertcast.recipes; recipes/ imports its own modules, never a command). Among the library rooms, utils/ is the
floor, data/ imports no model (models/ may read data's formats), models/ imports neither train/ nor inference/,
inference/ does not import train/, train/ does not import inference/;
inference/ and models/ import no lightning or wandb; harness/ (the lm-eval adapter) imports neither nor train/;
only commands/ parses command lines (argparse).
Inside inference/: cache/ (the mechanism) imports nothing above models/, data/ and utils/; policies/ never
imports sim/, runtime/ or commands/; sim/ and runtime/ never import each other.
No import circle anywhere in the package: every import statement counts (function-level and TYPE_CHECKING ones
too), so a lazy import that only dodges a circle is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP = {"tests", "scripts", ".venv", "build", "docs", ".git"}

JOBS = ("expertcast.commands", "expertcast.recipes")
"""The recipe layer: only cli.py, commands/ and scripts/ import it (recipes/ its own modules)."""

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "models": ("expertcast.train", "expertcast.inference", *JOBS, "lightning", "wandb"),
    "data": ("expertcast.models", "expertcast.train", "expertcast.inference", *JOBS),
    "inference": ("expertcast.train", *JOBS, "lightning", "wandb"),
    "train": ("expertcast.inference", *JOBS),
    "utils": ("expertcast.data", "expertcast.models", "expertcast.train", "expertcast.inference",
              "expertcast.harness", *JOBS),
    "harness": ("expertcast.train", *JOBS, "lightning", "wandb"),
    "configs": ("expertcast",),
    "recipes": ("expertcast.commands",),
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["expertcast", *parts])


def import_graph() -> dict[str, dict[str, tuple[Path, int]]]:
    """``{module: {imported package module: (file, line of the first such import)}}`` over every import
    statement of every package module, wherever it stands (module level, in a function, under TYPE_CHECKING;
    relative imports resolved). ``from P import x`` points at the module ``P.x`` when there is one, else at
    ``P``; a module's parent packages, which Python imports first, are not edges."""
    paths = {_module_name(p): p for p in _package_modules()}

    def owner(name: str) -> str | None:  # the longest package module that ``name`` names or lies in
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, tuple[Path, int]]] = {}
    for mod, path in paths.items():
        edges: dict[str, tuple[Path, int]] = {}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in paths]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            else:
                continue
            for t in targets:
                target = owner(t) if t == "expertcast" or t.startswith("expertcast.") else None
                if target is not None and target != mod:
                    edges.setdefault(target, (path.relative_to(REPO), node.lineno))
        graph[mod] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, tuple[Path, int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a set of modules that import one
    another, directly or around a circle), sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def describe_cycle(graph: dict[str, dict[str, tuple[Path, int]]], comp: list[str]) -> str:
    """One circle through the first module of ``comp``, each arrow with the file and line of its import."""
    inside = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in prev:  # breadth first: the shortest way back to ``start``
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w in inside and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    path = [start]
    while True:
        path.append(prev[path[-1]])
        if path[-1] == start:
            break
    path.reverse()
    steps = [f"{a} -> {b} ({graph[a][b][0]}:{graph[a][b][1]})" for a, b in zip(path, path[1:], strict=False)]
    return f"{len(comp)} modules {comp}:\n    " + "\n    ".join(steps)


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


def test_only_the_recipe_layer_imports_jobs():
    """cli.py, commands/ and scripts/ (not a package module, never scanned) import expertcast.commands and
    expertcast.recipes; recipes/ imports its own modules; no library room imports either."""
    bad = []
    for p in _package_modules():
        rel = p.relative_to(REPO)
        room = rel.parts[0] if len(rel.parts) > 1 else rel.name
        allowed = {"cli.py": JOBS, "commands": JOBS, "recipes": ("expertcast.recipes",)}.get(room, ())
        bad += [f"{rel}:{ln} imports {name}" for ln, name in _imports(p)
                if _hits(name, JOBS) and not _hits(name, allowed)]
    assert not bad, "a library module imports a job or recipe:\n" + "\n".join(bad)


def test_import_graph_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    """The graph walker on a package of its own: a relative import, a function-level one and a TYPE_CHECKING
    one are edges; ``from P import sub`` points at the submodule; the circle is found and printed with its
    lines."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("def f():\n    from expertcast.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n")
    (pkg / "c.py").write_text("from .a import f\n")
    (pkg / "d.py").write_text("import expertcast.c\n")
    monkeypatch.setitem(globals(), "REPO", pkg)
    g = import_graph()
    assert g["expertcast.a"] == {"expertcast.sub.b": (Path("a.py"), 2)}
    assert g["expertcast.sub"] == {"expertcast.sub.b": (Path("sub/__init__.py"), 1)}
    assert g["expertcast.sub.b"] == {"expertcast.c": (Path("sub/b.py"), 3)}
    assert set(g["expertcast.d"]) == {"expertcast.c"} and g["expertcast"] == {}
    (cycle,) = import_cycles(g)
    assert cycle == ["expertcast.a", "expertcast.c", "expertcast.sub.b"]
    text = describe_cycle(g, cycle)
    assert "expertcast.a -> expertcast.sub.b (a.py:2)" in text and "expertcast.c -> expertcast.a (c.py:1)" in text


def test_no_import_circle():
    """No circle of imports anywhere in the package (every import statement, wherever it stands)."""
    g = import_graph()
    assert len(g) > 50 and sum(len(e) for e in g.values()) > 200  # the walker found the package's imports
    cycles = import_cycles(g)
    assert not cycles, f"{len(cycles)} import circle(s):\n" + "\n".join(describe_cycle(g, c) for c in cycles)


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
