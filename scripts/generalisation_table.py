"""The generalisation table: recall@K by horizon and Hit by capacity, per protocol row and fit size.

Rows (docs/design.md "Generalisation protocol"): ``cot->cot`` (in-domain: a sha256 split of the CoT traces),
``gsm8k->cot`` (fit on GSM8K train, evaluated on the same held-out CoT sequences as the in-domain row),
``cot->gsm8k`` (fit on the in-domain row's CoT fit sequences, evaluated on GSM8K test) and ``granite`` (the
real-model fixture: fit on every prompt but the last, evaluated on the last), each with 10 / 50 / all fit
sequences where the fit set has more. Per row and size: a forecaster trained on the fit sequences only
(:func:`~expertcast.train.generalisation.train_row_forecaster`: the model block of ``--config``, ``--steps``
optimizer steps, a fifth of the fit sequences held out for the temperature and the residual scale), its
recall@K at every horizon against the four baselines (fitted parts on the fit set, online ones on the evaluated
sequences), and ``expertcast simulate --fit-traces`` of seqmoe (that export) vs LRU, LFU and Belady at the
capacities whose per-layer pool holds a layer's top-K (granite: K/E = 8/32, so 0.15 is left out).

    python scripts/generalisation_table.py --cot traces/cot --gsm8k-train traces/gsm8k-train \\
        --gsm8k-test traces/gsm8k-test --granite ../shared/data/traces/granite-3.0-1b-a400m/moe_expert_trace.json \\
        --steps 300 --out runs/generalisation

Writes ``--out``/table.csv (one line per row, size and predictor/policy), table.json (with the command line,
git state and every setting) and the exports, trace sets and simulate runs it made; prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
HORIZONS = (1, 2, 4, 8)
PREDICTORS = ("forecaster", "repeat-last", "transition", "frequency", "recent-freq", "recent-count")
POLICIES = ("seqmoe", "lru", "lfu", "belady")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cot", help="trace set of CoT text (in-domain row and both cross-domain rows)")
    ap.add_argument("--gsm8k-train", help="trace set of GSM8K train prompts")
    ap.add_argument("--gsm8k-test", help="trace set of GSM8K test prompts")
    ap.add_argument("--granite", help="the granite expert-trace JSON (imported with data.importers.granite)")
    ap.add_argument("--rows", default="cot->cot,gsm8k->cot,cot->gsm8k,granite")
    ap.add_argument("--sizes", default="10,50,all", help="fit sizes (all = every fit sequence)")
    ap.add_argument("--config", default=str(REPO / "configs" / "forecaster" / "tiny.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a model init arg (ablations), e.g. --set online_hedge_rate=0")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--capacity", default="0.15,0.25,0.45")
    ap.add_argument("--no-simulate", action="store_true", help="recall only")
    ap.add_argument("--simulate-sizes", default=None, help="run simulate only for these fit sizes (default: all sizes)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-batch", type=int, default=64, help="evaluated sequences per recall batch")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def load_rows(args: argparse.Namespace) -> list[tuple[str, Any, list, list]]:
    """[(name, meta, fit sequences, evaluated sequences)] for the rows asked for and given."""
    from expertcast.train.forecaster_data import load_trace_dirs
    from expertcast.train.generalisation import in_domain_split

    want = [r.strip() for r in args.rows.split(",") if r.strip()]
    out = []
    cot = load_trace_dirs(args.cot) if args.cot else None
    cot_fit, cot_eval = in_domain_split(cot[1]) if cot else ([], [])
    for name in want:
        if name == "cot->cot" and cot:
            out.append((name, cot[0], cot_fit, cot_eval))
        elif name == "gsm8k->cot" and cot and args.gsm8k_train:
            meta, fit = load_trace_dirs(args.gsm8k_train)
            out.append((name, meta, fit, cot_eval))
        elif name == "cot->gsm8k" and cot and args.gsm8k_test:
            out.append((name, cot[0], cot_fit, load_trace_dirs(args.gsm8k_test)[1]))
        elif name == "granite" and args.granite:
            from expertcast.data.importers.granite import GRANITE_1B_EXPERT_BYTES, read_expert_trace_json

            meta, seqs = read_expert_trace_json(args.granite, expert_bytes=GRANITE_1B_EXPERT_BYTES)
            out.append((name, meta, seqs[:-1], seqs[-1:]))
        else:
            print(f"row {name}: its trace sets were not given; skipped")
    return out


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    cfg = yaml.safe_load(Path(args.config).read_text())
    kw = dict(cfg["model"]["init_args"])
    kw.pop("export_dir", None)
    for s in args.set:
        k, v = s.split("=", 1)
        kw[k] = json.loads(v)
    trigger = cfg.get("data", {}).get("init_args", {}).get("trigger_layer")
    return {**kw, "trigger_layer": trigger}


def simulate(args, meta, row, net, work: Path) -> dict[tuple[str, float], float]:
    """Hit per (policy, capacity) from ``expertcast simulate --fit-traces`` on the row's evaluated sequences."""
    from expertcast.data.traces import is_trace_dir, write_traces
    from expertcast.models.forecaster_export import save_forecaster

    tag = f"{row.name.replace('->', '-to-')}-n{'all' if row.n_fit is None else row.n_fit}"
    ev_dir, fit_dir = work / "traces" / f"{row.name.replace('->', '-to-')}-eval", work / "traces" / f"{tag}-fit"
    if not is_trace_dir(ev_dir):
        write_traces(ev_dir, meta, row.evaluated, run={"source": "generalisation_table", "row": row.name})
    if not is_trace_dir(fit_dir):
        write_traces(fit_dir, meta, row.fit, run={"source": "generalisation_table", "row": row.name})
    export = work / "exports" / tag
    save_forecaster(net, export, source={"model_id": meta.model_id, "expert_bytes": meta.expert_bytes},
                    training={"train_ids": sorted(s.seq_id for s in row.fit), "val_ids": [],
                              "note": "generalisation_table: fit sequences (incl. the held-out fifth)"})
    out = work / "simulate" / tag
    caps = [c for c in args.capacity.split(",") if float(c) * meta.num_experts >= meta.top_k]  # a layer's top-K fits
    if not caps:
        return {}
    cmd = [sys.executable, "-m", "expertcast.cli", "simulate", "--traces", str(ev_dir), "--fit-traces", str(fit_dir),
           "--policies", ",".join(POLICIES), "--forecaster", str(export), "--capacity", ",".join(caps),
           "--out", str(out), "--overwrite"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        print(r.stdout[-2000:], r.stderr[-4000:])
        raise SystemExit(f"simulate failed for {tag}")
    recs = json.loads((out / "simulate.json").read_text())
    recs = recs["records"] if isinstance(recs, dict) else recs
    return {(rec["policy"].split(":")[0].split("(")[0], float(rec["capacity"])): float(rec["hit"]) for rec in recs}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    from expertcast.train.generalisation import (
        margin_over_online,
        protocol_rows,
        recall_row,
        train_row_forecaster,
    )
    from expertcast.utils.io import print_table, write_csv

    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    sizes = [None if s.strip() == "all" else int(s) for s in args.sizes.split(",")]
    kw = model_kwargs(args)
    lines: list[dict[str, Any]] = []
    for name, meta, fit, ev in load_rows(args):
        for row in protocol_rows(name, fit, ev, sizes=sizes):
            t0 = time.time()
            net = train_row_forecaster(meta, row, max_steps=args.steps, window=args.window, batch_size=args.batch_size,
                                       **kw)
            tables = recall_row(net, meta, row, horizons=max(HORIZONS), batch_size=args.eval_batch)
            margin = margin_over_online(tables)
            base = {"row": name, "n_fit": "all" if row.n_fit is None else row.n_fit, "fit": len(row.fit),
                    "eval": len(row.evaluated), "residual_scale": json.dumps(net.config.residual_scale)}
            for p in PREDICTORS:
                rk = tables[p].recall("k")
                lines.append({**base, "what": p, **{f"R@K h{h}": round(float(rk[h - 1]), 4) for h in HORIZONS}})
            lines.append({**base, "what": "margin vs best online", **{f"R@K h{h}": round(float(margin[h - 1]), 4)
                                                                       for h in HORIZONS}})
            sim_sizes = None if args.simulate_sizes is None else \
                [None if v.strip() == "all" else int(v) for v in args.simulate_sizes.split(",")]
            if not args.no_simulate and (sim_sizes is None or row.n_fit in sim_sizes):
                hits = simulate(args, meta, row, net, work)
                for pol in POLICIES:
                    lines.append({**base, "what": f"Hit {pol}", **{f"cap {c:g}": round(v, 4) for (q, c), v in
                                                                   sorted(hits.items()) if q == pol}})
            print(f"{row.label}: {time.time() - t0:.0f} s; margin h1/h2/h4/h8 "
                  + " ".join(f"{margin[h - 1] * 100:+.1f}" for h in HORIZONS), flush=True)
            write_csv(work / "table.csv", lines)
    cols = ["row", "n_fit", "fit", "eval", "what"] + [f"R@K h{h}" for h in HORIZONS] + \
        sorted({k for ln in lines for k in ln if k.startswith("cap ")})
    print_table(lines, title="generalisation protocol (recall@K by horizon; Hit by capacity)", columns=cols)
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True,
                                text=True).stdout.strip())
    (work / "table.json").write_text(json.dumps({"argv": sys.argv, "git": git, "dirty": dirty, "model_kwargs": kw,
                                                 "lines": lines}, indent=1))
    print(f"wrote {work / 'table.csv'} and {work / 'table.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
