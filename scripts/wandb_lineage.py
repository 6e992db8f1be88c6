"""Print the W&B lineage of offline runs: the artifacts each used (its inputs: exports, trace sets, cue
sets, declared by ``use_input``) and logged (its outputs: exports, checkpoints), one row each.

    python scripts/wandb_lineage.py RUN_DIR [RUN_DIR ...]

``RUN_DIR``: an offline run folder (``wandb/offline-run-*``), or a folder holding such runs (``$WANDB_DIR``
or its ``wandb/``), each listed. Columns: run, direction (used / logged), type, name, sha256 (the content hash
the command's outputs record; logged artifacts: none), path (the input's folder or file; logged: its files).
Plain text, never cut, so that hashes can be compared with a command's summary. Then the graph's edges across
the listed runs: ``RUN_A -> ARTIFACT -> RUN_B`` for each artifact one run logged and another used (by name:
``fit`` logs an export as ``<type>-<16 hex of its export hash>``, every consumer uses that name).
"""

from __future__ import annotations

import sys
from pathlib import Path

from expertcast.utils.tracking import offline_run_contents

COLUMNS = ("run", "direction", "type", "name", "sha256", "path")


def run_dirs(path: Path) -> list[Path]:
    """``path`` itself when it is an offline run, else the offline runs below it (``wandb/offline-run-*``)."""
    if any(path.glob("run-*.wandb")):
        return [path]
    return sorted({*path.glob("offline-run-*"), *path.glob("wandb/offline-run-*")})


def lineage_rows(run_dir: Path) -> list[dict[str, str]]:
    """One row per artifact the run used or logged, used ones first."""
    got = offline_run_contents(run_dir)
    rows = [{"run": run_dir.name, "direction": "used" if a["used"] else "logged", "type": a["type"],
             "name": a["name"], "sha256": a["sha256"] or "-",
             "path": a["path"] if a["used"] else ",".join(a["files"]) or "-"} for a in got["artifacts"]]
    return sorted(rows, key=lambda r: r["direction"] != "used")


def edges(rows: list[dict[str, str]]) -> list[str]:
    """``logger -> artifact -> user`` for every artifact name one run logged and another used."""
    logged = {}
    for r in rows:
        if r["direction"] == "logged":
            logged.setdefault(r["name"], []).append(r["run"])
    return [f"{src} -> {r['name']} -> {r['run']}" for r in rows if r["direction"] == "used"
            for src in logged.get(r["name"], []) if src != r["run"]]


def format_table(rows: list[dict[str, str]]) -> str:
    widths = {c: max([len(c), *(len(r[c]) for r in rows)]) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in COLUMNS) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or any(a.startswith("-") for a in args):
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    rows = []
    for a in args:
        found = run_dirs(Path(a))
        if not found:
            print(f"wandb_lineage: {a}: no offline W&B run (no run-*.wandb, no wandb/offline-run-*)", file=sys.stderr)
            return 2
        for d in found:
            rows += lineage_rows(d)
    print(format_table(rows) if rows else "no artifacts used or logged")
    graph = edges(rows)
    if graph:
        print("edges:\n" + "\n".join(f"  {e}" for e in graph))
    return 0


if __name__ == "__main__":
    sys.exit(main())
