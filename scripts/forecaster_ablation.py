"""Ablation of the parts that make the forecaster reduce to the best online baseline (docs/design.md "Online
statistics"): prior start, per-sequence weighting (hedge), held-out residual scale, the prior's own learning rate,
and the online statistics themselves, on two synthetic protocol rows with known character:

- ``sticky a->b``: real-like sticky routing (:class:`StickyRoutingProcess`), fit on one process, evaluated on
  another whose sequences favour their own experts: the learned part has nothing to add;
- ``markov``: a mode-Markov process (:class:`ModeMarkovProcess`), in-domain held-out sequences: the learned part
  has a lot to add (the online statistics cannot see the mode transitions).

    python scripts/forecaster_ablation.py [--steps 120] [--out runs/forecaster-ablation]

Prints recall@K margin over the best online baseline (points) at h1/h2/h4/h8 per variant and row and writes
``ablation.csv`` / ``ablation.json`` (with the command line and settings) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HORIZONS = (1, 2, 4, 8)
FULL = dict(online_half_lives=[0, 2, 8, 16, 32, 128], prior_start=16, online_hedge_rate=1.0, prior_lr=0.05)
VARIANTS = {
    "full": dict(FULL),
    "no hedge": {**FULL, "online_hedge_rate": 0.0},
    "no prior start": {**FULL, "prior_start": None},
    "no residual scale": {**FULL, "holdout": 0.0, "fit_residual_scale": False},
    "prior at network lr": {**FULL, "prior_lr": None},
    "earlier design": dict(online_half_lives=[0, 2, 8, 32, 128], prior_start=None, online_hedge_rate=0.0,
                           prior_lr=None, holdout=0.0, fit_residual_scale=False),
    "no online statistics": dict(online_half_lives=[], holdout=0.0),
}


def rows():
    from expertcast.data.synthetic import ModeMarkovProcess, StickyRoutingProcess
    from expertcast.train.generalisation import in_domain_split, protocol_rows

    a = StickyRoutingProcess.realistic(num_layers=2, num_experts=16, top_k=2, seed=0)
    b = StickyRoutingProcess.realistic(num_layers=2, num_experts=16, top_k=2, seed=7, concentration=0.3)
    fit, ev = a.sample(30, 48, prompt_len=4, seed=1, prefix="a"), b.sample(12, 48, prompt_len=4, seed=2, prefix="b")
    yield "sticky a->b", a.meta(), protocol_rows("sticky a->b", fit, ev, sizes=[None])[0]
    mm = ModeMarkovProcess.random(num_modes=8, num_layers=2, num_experts=16, top_k=4, stickiness=0.2,
                                  concentration=0.2, seed=0)
    seqs, _ = mm.sample(60, 40, prompt_len=4, seed=1)
    f, e = in_domain_split(seqs)
    yield "markov", mm.meta(), protocol_rows("markov", f, e, sizes=[None])[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from expertcast.train.generalisation import margin_over_online, recall_row, train_row_forecaster
    from expertcast.utils.io import print_table, write_csv

    base = dict(hidden_size=32, head_dim=16, state_size=16, num_blocks=1, chunk_size=32, lr=5e-3, kl_weight=0.1,
                direct_horizons=8, max_sampling_rate=0.0)
    lines = []
    for name, meta, row in rows():
        for v in args.variants.split(","):
            kw = {**base, **VARIANTS[v]}
            hold = kw.pop("holdout", 0.2)
            net = train_row_forecaster(meta, row, max_steps=args.steps, window=48, batch_size=8, holdout=hold, **kw)
            tables = recall_row(net, meta, row)
            m = margin_over_online(tables)
            rk = tables["forecaster"].recall("k")
            lines.append({"row": name, "variant": v, **{f"margin h{h}": round(float(m[h - 1]) * 100, 2) for h in HORIZONS},
                          **{f"R@K h{h}": round(float(rk[h - 1]), 4) for h in HORIZONS},
                          "residual_scale": json.dumps(net.config.residual_scale)})
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "ablation.csv", lines)
    (out / "ablation.json").write_text(json.dumps({"argv": sys.argv, "base": base, "variants": VARIANTS,
                                                   "steps": args.steps, "lines": lines}, indent=1))
    print_table(lines, title="forecaster ablation: margin over the best online baseline (points)",
                columns=["row", "variant"] + [f"margin h{h}" for h in HORIZONS] + [f"R@K h{h}" for h in HORIZONS])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
