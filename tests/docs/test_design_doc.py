"""The documents under docs/ as the code cites them (docs/design.md, "Layout").

Code comments, docstrings, tests and the README cite sections of the specification by title
(``docs/design.md, "Cache semantics"``, ``docs/design.md "Forecaster", "Generalisation protocol"``) and of
docs/results.md the same way: every quoted title right after such a reference must be a heading of that
document. docs/ and the README carry no issue numbers.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("design.md", "results.md")
SCAN_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".sbatch", ".cfg", ".txt"}
SKIP_PARTS = {".git", ".venv", "build", "node_modules"}

_REF = re.compile(r"docs/(design|results)\.md")
_CONT = re.compile(r"\n[ \t]*(?:#+[ \t]*)?")  # a line break inside a citation, with a comment's leading '#'
_SEP = re.compile(r"[`\s,;:]*")
_QUOTED = re.compile(r"\"([^\"\n]{1,120})\"|'([^'\n]{1,120})'")


def _headings(doc: str) -> list[str]:
    text = (REPO / "docs" / doc).read_text(encoding="utf-8")
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+?)\s*$", line)):
            out.append(m.group(1))
    return out


def _files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout.split("\n")
        paths = [REPO / p for p in listed if p]
    except (OSError, subprocess.CalledProcessError):  # not a checkout: walk the tree
        paths = [p for p in REPO.rglob("*") if p.is_file()]
    here = Path(__file__).resolve()  # its parser examples are no citations
    return sorted(p for p in paths if p.suffix in SCAN_SUFFIXES and p.is_file() and p.resolve() != here
                  and not SKIP_PARTS.intersection(p.relative_to(REPO).parts))


def citations(text: str) -> list[tuple[str, str, int]]:
    """(document, cited title, line) for every quoted title chained right after a docs/<doc>.md reference;
    a title broken over two lines (a wrapped docstring or comment) is joined with one space."""
    found = []
    for m in _REF.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        tail = _CONT.sub(" ", text[m.end():m.end() + 400])
        pos = 0
        while True:
            sep = _SEP.match(tail, pos)
            q = _QUOTED.match(tail, sep.end())
            if q is None:
                break
            found.append((f"{m.group(1)}.md", q.group(1) or q.group(2), line))
            pos = q.end()
    return found


def _all_citations() -> list[tuple[str, str, str]]:
    out = []
    for p in _files():
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        out += [(doc, title, f"{p.relative_to(REPO)}:{line}") for doc, title, line in citations(text)]
    return out


def test_citation_parser():
    text = ('"""Driver (docs/design.md,\n"Driver").\n"""\n# see docs/design.md, "Cache\n# semantics"\n'
            'x  # ``docs/design.md``, "Arithmetic in the corpus", for the figures\n'
            "(docs/design.md 'Routing traces'; docs/design.md \"Forecaster\", \"Generalisation protocol\")\n"
            '(docs/design.md, "Runtime",\ngraph-compatible decode path) docs/results.md, "Unaligned weights"\n'
            "docs/design.md, cache semantics")
    assert [(d, t) for d, t, _ in citations(text)] == [
        ("design.md", "Driver"), ("design.md", "Cache semantics"), ("design.md", "Arithmetic in the corpus"),
        ("design.md", "Routing traces"), ("design.md", "Forecaster"), ("design.md", "Generalisation protocol"),
        ("design.md", "Runtime"), ("results.md", "Unaligned weights")]


def test_code_cites_the_specification():
    assert len([c for c in _all_citations() if c[0] == "design.md"]) >= 20  # the scan found the citations


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_section_exists(doc):
    titles = set(_headings(doc))
    missing = [f"{where}: {doc} has no section {title!r}" for d, title, where in _all_citations()
               if d == doc and title not in titles]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS)
def test_section_titles_are_unique(doc):
    heads = _headings(doc)
    assert len(heads) == len(set(heads)), sorted({h for h in heads if heads.count(h) > 1})


def test_no_issue_numbers_in_docs():
    bad = []
    for p in [*(REPO / "docs").glob("*.md"), REPO / "README.md"]:
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bissues?\b\s*(#\s*)?\d|(?<![\w&])#\d+\b|/issues/|/pull/", line, re.IGNORECASE):
                bad.append(f"{p.relative_to(REPO)}:{n}: {line.strip()}")
    assert not bad, "issue numbers in the docs:\n" + "\n".join(bad)


def test_cited_documents_exist():
    named = set()
    for p in _files():
        try:
            named |= set(re.findall(r"\bdocs/([\w-]+\.md)\b", p.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    missing = sorted(n for n in named if not (REPO / "docs" / n).is_file())
    assert not missing, f"cited but absent under docs/: {missing}"
