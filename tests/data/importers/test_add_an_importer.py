"""Adding a trace layout is one module and one line (docs/design.md, "Trace importers"): a module that ends with
its ``FormatSpec``, named in ``FORMAT_MODULES``, is detected, listed by ``traces import --format``, refused
without the flags it requires and imported into a trace set, with nothing else edited. Every shipped layout is
built that way: its spec sits in its own module, and no other library module names that module but the registry."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from expertcast.commands.traces import build_parser
from expertcast.commands.traces import main as traces_main
from expertcast.data import importers
from expertcast.data.importers import FORMAT_MODULES, detect_format, registry
from expertcast.data.importers.spec import FormatSpec
from expertcast.data.traces import load_traces

REPO = Path(__file__).resolve().parents[3]

# The whole new importer: a layout of "seq pos e1 e2 ..." lines for a one-layer model.
MODULE = '''
from expertcast.data.importers.common import Imported, RowCollector, csv_int
from expertcast.data.importers.spec import FormatSpec

NAME = "space-rows"
HEADER = ("seq pos experts",)


def read(path, opts):
    col = RowCollector(int(opts.num_experts))
    with open(path, encoding="utf-8") as f:
        next(f)
        for ln, line in enumerate(f, 2):
            seq, pos, *experts = line.split()
            where = f"{path}:{ln}"
            col.add(where, seq, csv_int(pos, "pos", where), 0, [csv_int(e, "expert", where) for e in experts])
    seqs, L, _ = col.build(str(path))
    return Imported(seqs, L, int(opts.num_experts), int(col.K), phase_known=False, records=col.records,
                    **col.dropped())


SPEC = FormatSpec(NAME, "space-separated rows: seq pos experts...", read, csv_headers=(HEADER,),
                  requires={"num_experts": "its records do not name E"})
'''


@pytest.fixture
def added(tmp_path, monkeypatch):
    pkg = tmp_path / "addon"
    pkg.mkdir()
    (pkg / "space_rows.py").write_text(MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(importers, "FORMAT_MODULES", (*FORMAT_MODULES, "space_rows"))  # the one line
    monkeypatch.syspath_prepend(str(pkg))
    yield
    sys.modules.pop("space_rows", None)


def test_a_new_layout_is_one_module_and_one_registry_line(added, tmp_path, capsys):
    assert list(registry())[-1] == "space-rows" and isinstance(registry()["space-rows"], FormatSpec)
    src = tmp_path / "trace.csv"
    src.write_text("seq pos experts\na 0 1 2\na 1 2 3\nb 0 0 3\n", encoding="utf-8")
    assert detect_format(src) == "space-rows"
    assert "space-rows" in build_parser().format_help() or "space-rows" in _import_help()
    assert traces_main(["import", str(src), "--out", str(tmp_path / "no")]) == 2
    assert "--num-experts is required for the space-rows layout (its records do not name E)" in capsys.readouterr().err
    assert traces_main(["import", str(src), "--out", str(tmp_path / "t"), "--num-experts", "4"]) == 0
    assert "imported 2 sequences (space-rows layout, L=1, E=4, K=2, 3 tokens" in capsys.readouterr().out
    meta, seqs = load_traces(tmp_path / "t")
    assert meta.source_format == "space-rows" and [s.expert_ids[:, 0].tolist() for s in seqs] == [[[1, 2], [2, 3]],
                                                                                                   [[0, 3]]]


def _import_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    return sub.choices["import"].format_help()


def test_every_shipped_layout_is_its_own_module_named_once():
    specs = registry()
    assert len(specs) == len(FORMAT_MODULES)
    for module in FORMAT_MODULES:
        mod = sys.modules[module]
        assert isinstance(mod.SPEC, FormatSpec) and specs[mod.SPEC.name] is mod.SPEC
        rel = Path(*module.split(".")[1:]).with_suffix(".py")
        users = [p.relative_to(REPO) for p in REPO.rglob("*.py")
                 if p.relative_to(REPO).parts[0] not in ("tests", "scripts", ".venv", "build") and p.relative_to(REPO) != rel
                 and module in p.read_text(encoding="utf-8")]
        assert users == [Path("data/importers/__init__.py")], (module, users)
