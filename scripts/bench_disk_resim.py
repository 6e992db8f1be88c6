"""The simulator's card for a finished `bench_disk` run, again, on a link at another disk figure.

Reads a run's ``bench_disk.json`` (or a stopped run's ``bench_disk.partial.json``: its finished cells) and
replays each of its full-depth rows' cells through the simulator
(``recipes.bench_disk.resimulate``: the same settings, routing, slots and policy arming as the run's own ``sim_*``
columns) with the link at ``--link``: ``one-pass`` (the run's one-pass disk measurement), ``bound`` (the run's bound
figure: the highest rate any of its runs achieved; what ``bench_disk`` itself uses now) or a number in GB/s. Prints
each row's measured tokens/s beside the simulated one; this is how docs/results.md, "The simulator's link at the
run's disk figure", compares the two link figures on runs H and I without rebuilding the model.

    python scripts/bench_disk_resim.py --record docs/bench/ds-v2-lite-i/bench_disk.json --link one-pass bound

Needs the record's traces (and its forecaster, for learned policies) where it names them. ``--json`` (a new file, or
this script's own earlier output) records the table with the command and the code version.
"""

from __future__ import annotations

import argparse
import json
import sys


def link_figure(record: dict, which: str) -> float:
    """GB/s of ``which``: ``one-pass``, ``bound`` or a positive number."""
    if which == "one-pass":
        return float(record["machine"]["disk_gbps"])
    if which == "bound":
        if "disk_gbps_bound" not in record:
            raise ValueError("the record has no bound disk figure (a run older than the bound)")
        return float(record["disk_gbps_bound"])
    try:
        g = float(which)
    except ValueError:
        raise ValueError(f"--link {which!r}: expected one-pass, bound or GB/s") from None
    if not g > 0:
        raise ValueError(f"--link {which!r}: GB/s must be positive")
    return g


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", required=True,
                    help="a run's bench_disk.json (or a stopped run's bench_disk.partial.json)")
    ap.add_argument("--link", nargs="+", default=["bound"], help="one-pass, bound or GB/s (several: one table each)")
    ap.add_argument("--json", default=None, help="write the tables here (a new file or this script's own output)")
    a = ap.parse_args(argv)

    from expertcast.inference.sim.simulator import build_stream
    from expertcast.recipes.bench_disk import resimulate
    from expertcast.utils.errors import UsageError
    from expertcast.utils.io import atomic_write_json, print_table
    from expertcast.utils.outdir import claim_output_file
    from expertcast.utils.provenance import code_version

    out = None
    if a.json:
        try:
            out = claim_output_file(a.json, "--json", "bench_disk_resim --json")
        except UsageError as e:
            sys.exit(f"error: {e}")
    try:
        with open(a.record, encoding="utf-8") as f:
            record = json.load(f)
        links = [(w, link_figure(record, w)) for w in a.link]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"error: {a.record}: {e}")
    tables = {}
    for which, gbps in links:
        try:
            rows = resimulate(record, gbps, build_stream)
        except (OSError, ValueError) as e:
            sys.exit(f"error: {e}")
        tables[which] = {"link_gbps": gbps, "rows": rows}
        print_table(rows, title=f"{a.record}: the simulator on a {gbps:.2f} GB/s link ({which}) beside the measured "
                    f"tokens/s", columns=["policy", "budget", "format", "tokens_per_s", "recorded_sim_tokens_per_s",
                                          "sim_tokens_per_s", "sim_vs_measured", "sim_hit", "sim_stall_ms_per_token"],
                    floatfmt="{:.3g}")
    if out is not None:
        atomic_write_json(out.path, {"command": "bench_disk_resim", "argv": sys.argv, "code_version": code_version(),
                                     "record": a.record, "record_code_version":
                                         record.get("provenance", {}).get("code_version"), "tables": tables})
        out.written()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
