"""Detection cost per token of the streaming stage detector, against plain per-token decoding measured
in the same run.

    python scripts/bench_stages.py [--tokenizer DIR] [--cues cues.json] [--texts FILE] [--field thinking]
                                   [--n 20] [--batch 8]

Baselines on the same token ids: ``tokenizer.decode([id])`` (what a runtime would call to read the
token) and the detector's own id -> bytes lookup (memoized). Rows: µs per token (wall clock, and CPU
time of this process, which a busy shared machine inflates less) and the ratio of the detector to the
``decode([id])`` baseline. Cue sets: 2 paper cues, the model's calibrated set (``--cues``, default
``cues.json`` in the tokenizer's directory when there is one) and all default candidates. Without
``--tokenizer`` a byte-level BPE is trained on the texts first (a few seconds). Writes JSON + CSV
under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--cues", default=None, help="calibrated cue-set JSON (default: <tokenizer dir>/cues.json)")
    ap.add_argument("--texts", default=None, help="JSONL with CoT texts (default: shared cot/math153.jsonl)")
    ap.add_argument("--field", default="thinking")
    ap.add_argument("--n", type=int, default=20, help="texts to use")
    ap.add_argument("--batch", type=int, default=8, help="sequences fed in lockstep for the batched row")
    ap.add_argument("--out", default="results/bench_stages", help="output folder (JSON + CSV)")
    args = ap.parse_args(argv)

    from expertcast.inference.saem.cues import DEFAULT_CANDIDATES
    from expertcast.inference.saem.stages import StageDetector, TokenDecoder
    from expertcast.models.tokenizer import load_tokenizer
    from expertcast.utils.io import read_jsonl, report
    from expertcast.utils.paths import data_dir

    path = Path(args.texts) if args.texts else (data_dir() or Path("missing")) / "cot" / "math153.jsonl"
    if not path.is_file():
        print(f"bench_stages: texts file {path} not found (give --texts)", file=sys.stderr)
        return 2
    rows = read_jsonl(path)
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

    def timed(fn) -> tuple[float, float]:
        """(wall µs, process CPU µs) per token."""
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        return (time.perf_counter() - t0) * 1e6 / n_tok, (time.process_time() - c0) * 1e6 / n_tok

    def best(fn, n: int) -> tuple[float, float]:
        runs = [timed(fn) for _ in range(n)]
        return min(r[0] for r in runs), min(r[1] for r in runs)

    def baseline_decode() -> None:
        for seq in ids:
            for t in seq:
                tok.decode([t], skip_special_tokens=True)

    def baseline_lookup() -> None:
        for seq in ids:
            for t in seq:
                dec(t)

    results = []
    us_decode, cpu_decode = best(baseline_decode, 2)

    def row(what: str, cues: int, us: tuple[float, float]) -> dict:
        return {"what": what, "cues": cues, "us_per_token": us[0], "cpu_us_per_token": us[1],
                "ratio": us[1] / cpu_decode}

    results.append(row("baseline: tokenizer.decode of one id", 0, (us_decode, cpu_decode)))
    results.append(row("id -> bytes lookup (memoized)", 0, best(baseline_lookup, 3)))
    sets = [("paper", ["Wait", "Alternatively"])]
    cue_file = Path(args.cues) if args.cues else (Path(args.tokenizer) / "cues.json" if args.tokenizer else None)
    if cue_file is not None and cue_file.is_file():
        from expertcast.inference.saem.cues import CueSet

        sets.append(("calibrated", list(CueSet.load(cue_file).cues)))
    elif args.cues:
        print(f"bench_stages: cue set {cue_file} not found", file=sys.stderr)
        return 2
    sets.append(("all candidates", list(DEFAULT_CANDIDATES)))
    for set_name, cues in sets:
        det = StageDetector(cues, dec)

        def detect_one(det=det) -> None:
            for seq in ids:
                det.reset(1)
                for t in seq:
                    det.feed_token(0, t)
                det.flush()

        results.append(row(f"detector ({set_name}), one sequence", len(cues), best(detect_one, 3)))
        bdet = StageDetector(cues, dec, batch_size=args.batch)

        def detect_batch(bdet=bdet) -> None:
            for i in range(0, len(ids), args.batch):
                grp = ids[i:i + args.batch]
                bdet.reset(args.batch)
                for s in range(max(len(x) for x in grp)):
                    bdet.step([x[s] if s < len(x) else None for x in grp] + [None] * (args.batch - len(grp)))

        results.append(row(f"detector ({set_name}), batch {args.batch} lockstep", len(cues), best(detect_batch, 3)))
    out = Path(args.out)
    report(results, title=f"stage detection cost per token ({n_tok} tokens, {len(texts)} texts; {tok_name}; "
           f"{os.cpu_count()} CPUs)", json_path=out / "bench_stages.json", csv_path=out / "bench_stages.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
