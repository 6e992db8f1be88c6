"""Detection cost per token of the streaming stage detector, against plain per-token decoding measured
in the same run.

    python scripts/bench_stages.py [--tokenizer DIR] [--texts FILE] [--field thinking] [--n 20] [--batch 8]

Baselines on the same token ids: ``tokenizer.decode([id])`` (what a runtime would call to read the
token) and the detector's own id -> bytes lookup (memoized). Rows: µs per token and the ratio of the
detector to the ``decode([id])`` baseline. Without ``--tokenizer`` a byte-level BPE is trained on the
texts first (a few seconds). Writes JSON + CSV under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--texts", default=None, help="JSONL with CoT texts (default: shared cot/math153.jsonl)")
    ap.add_argument("--field", default="thinking")
    ap.add_argument("--n", type=int, default=20, help="texts to use")
    ap.add_argument("--batch", type=int, default=8, help="sequences fed in lockstep for the batched row")
    ap.add_argument("--out-dir", default="results/bench_stages")
    args = ap.parse_args(argv)

    from expertcast.inference.cues import DEFAULT_CANDIDATES, load_tokenizer
    from expertcast.inference.stages import StageDetector, TokenDecoder
    from expertcast.utils.io import report
    from expertcast.utils.paths import data_dir

    path = Path(args.texts) if args.texts else (data_dir() or Path("missing")) / "cot" / "math153.jsonl"
    if not path.is_file():
        print(f"bench_stages: texts file {path} not found (give --texts)", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    all_texts = [r[args.field] for r in rows]
    texts = all_texts[: args.n]
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
        tok_name = args.tokenizer
    else:
        from expertcast.models.tokenizer import train_bpe_tokenizer

        tok = train_bpe_tokenizer(all_texts, vocab_size=4096)
        tok_name = f"byte-level BPE (4096) trained on {path.name}"
    dec = TokenDecoder(tok)
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    n_tok = sum(len(x) for x in ids)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6 / n_tok

    def baseline_decode() -> None:
        for seq in ids:
            for t in seq:
                tok.decode([t], skip_special_tokens=True)

    def baseline_lookup() -> None:
        for seq in ids:
            for t in seq:
                dec(t)

    results = []
    us_decode = min(timed(baseline_decode) for _ in range(2))
    us_lookup = min(timed(baseline_lookup) for _ in range(3))
    results.append({"what": "baseline: tokenizer.decode([id])", "cues": 0, "us_per_token": us_decode, "ratio": 1.0})
    results.append({"what": "id -> bytes lookup (memoized)", "cues": 0, "us_per_token": us_lookup,
                    "ratio": us_lookup / us_decode})
    for cues in (["Wait", "Alternatively"], list(DEFAULT_CANDIDATES)):
        det = StageDetector(cues, dec)

        def detect_one(det=det) -> None:
            for seq in ids:
                det.reset(1)
                for t in seq:
                    det.feed_token(0, t)
                det.flush()

        us = min(timed(detect_one) for _ in range(3))
        results.append({"what": "detector, one sequence", "cues": len(cues), "us_per_token": us, "ratio": us / us_decode})
        bdet = StageDetector(cues, dec, batch_size=args.batch)

        def detect_batch(bdet=bdet) -> None:
            for i in range(0, len(ids), args.batch):
                grp = ids[i:i + args.batch]
                bdet.reset(args.batch)
                for s in range(max(len(x) for x in grp)):
                    bdet.step([x[s] if s < len(x) else None for x in grp] + [None] * (args.batch - len(grp)))

        us = min(timed(detect_batch) for _ in range(3))
        results.append({"what": f"detector, batch {args.batch} lockstep", "cues": len(cues), "us_per_token": us,
                        "ratio": us / us_decode})
    out = Path(args.out_dir)
    report(results, title=f"stage detection cost per token ({n_tok} tokens, {len(texts)} texts; {tok_name}; "
           f"{os.cpu_count()} CPUs)", json_path=out / "bench_stages.json", csv_path=out / "bench_stages.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
