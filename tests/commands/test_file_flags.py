"""Every file-valued output flag of every command follows ``--out``'s rules: a foreign file at the path is never
replaced (one-line error, exit status 2, the file intact), before any work starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from expertcast.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
FILE_FLAGS = ("--json", "--csv", "--plot", "--disk-path")
"""The flags that name a file a command writes (``--out`` of ``stages calibrate`` is one too, covered below)."""

TINY = ["--model", "qwen3_moe-tiny"]
CASES: list[tuple[str, list[str]]] = [
    # (command file, argv with {p} for the precious file and {w} for a scratch folder)
    ("replay.py", ["replay", *TINY, "--synthetic", "zipf", "--json", "{p}"]),
    ("replay.py", ["replay", *TINY, "--synthetic", "zipf", "--csv", "{p}"]),
    ("replay.py", ["replay", *TINY, "--synthetic", "zipf", "--store", "disk", "--disk-path", "{p}"]),
    ("evaluate.py", ["eval", *TINY, "--benchmark", "gsm8k", "--policy", "lru", "--capacity", "0.5", "--limit", "1",
                     "--max-new-tokens", "4", "--store", "disk", "--disk-path", "{p}", "--out", "{w}/evD"]),
    ("collect.py", ["collect", *TINY, "--limit", "1", "--out", "{w}/c", "--json", "{p}"]),
    ("collect.py", ["collect", *TINY, "--limit", "1", "--out", "{w}/c", "--csv", "{p}"]),
    ("traces.py", ["traces", "stats", "{w}/t", "--json", "{p}"]),
    ("traces.py", ["traces", "stats", "{w}/t", "--csv", "{p}"]),
    ("traces.py", ["traces", "stats", "{w}/t", "--plot", "{p}"]),
    ("stages.py", ["stages", "calibrate", "--traces", "{w}/t", "--out", "{p}"]),
]


def _flag(argv: list[str]) -> str:
    return argv[argv.index("{p}") - 1]


@pytest.fixture
def work(tmp_path) -> Path:
    from expertcast.data.synthetic import zipf_traces
    from expertcast.data.traces import write_traces

    tr = zipf_traces(num_sequences=2, num_tokens=16, num_layers=2, num_experts=8, top_k=2)
    write_traces(tmp_path / "t", tr.meta, tr.sequences)
    return tmp_path


@pytest.mark.parametrize("source,argv", CASES, ids=[f"{a[0]}-{_flag(a)}" for _, a in CASES])
def test_foreign_file_at_a_file_flag_is_refused(work, source, argv, capsys):
    precious = work / "precious.txt"
    precious.write_text("notes\n")
    rc = cli_main([a.format(p=precious, w=work) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert _flag(argv) in err[0] and "precious.txt" in err[0] and "refusing to replace" in err[0], err
    assert precious.read_text() == "notes\n"
    assert not (work / "evD").exists() and not (work / "c").exists()  # refused before any work


def test_every_file_flag_of_every_command_is_covered():
    """A new file-valued flag in commands/ needs its case above (and a claim_output_file call)."""
    found = set()
    for p in sorted((REPO / "commands").glob("*.py")):
        for flag in re.findall(r"add_argument\(\s*\"(--[a-z-]+)\"", p.read_text(encoding="utf-8")):
            if flag in FILE_FLAGS:
                found.add((p.name, flag))
    covered = {(src, _flag(a)) for src, a in CASES}
    assert found <= covered, sorted(found - covered)


def test_own_earlier_output_is_replaced(work, capsys):
    """`traces stats --json` twice on one path: the second run replaces the first's file."""
    out = work / "stats.json"
    assert cli_main(["traces", "stats", str(work / "t"), "--json", str(out)]) == 0
    out.write_text(out.read_text() + " ")  # edited by hand: no longer what expertcast wrote
    assert cli_main(["traces", "stats", str(work / "t"), "--json", str(out)]) == 2
    assert "--json" in capsys.readouterr().err
    out.unlink()
    assert cli_main(["traces", "stats", str(work / "t"), "--json", str(out)]) == 0
    first = out.stat().st_mtime_ns
    assert cli_main(["traces", "stats", str(work / "t"), "--json", str(out)]) == 0
    assert out.stat().st_mtime_ns >= first
    assert cli_main(["traces", "stats", str(work / "t"), "--csv", str(out)]) == 2  # another kind's file
    assert "traces stats --json" in capsys.readouterr().err
