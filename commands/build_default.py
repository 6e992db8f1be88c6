"""`expertcast build-default`: rebuild the embedded default MoE model (into the cache) and compare it with the shipped one.

The recipe of the job: read the YAML recipe (``configs/tiny_default/default.yaml``, the defaults of
:class:`expertcast.recipes.tiny_default.TinyDefaultConfig`), build the model or reuse the cached build
(:func:`~expertcast.recipes.tiny_default.ensure_default_model`), print its report and whether its files are
identical to the shipped model's (``models/shipped/tiny-default``, what ``--model tiny-default`` names);
``--ship`` replaces the shipped files with the build. The recipe fixes the optimizer steps, the seed and the torch thread
count, so every machine builds the same weights; the cache key covers the whole recipe, the sha256 of the
data files and the code format (docs/design.md "Embedded default model").
"""

from __future__ import annotations

from typing import Any

from expertcast.commands.common import CommandParser, run_command
from expertcast.utils.paths import CACHE_DIR_ENV, DATA_DIR_ENV

PROG = "expertcast build-default"


def build_parser() -> CommandParser:
    p = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--config", default=None,
                   help="YAML recipe (fields of TinyDefaultConfig); when omitted: the values of "
                        "configs/tiny_default/default.yaml)")
    p.add_argument("--force", action="store_true", help="rebuild even when the cache holds this recipe's model")
    p.add_argument("--data-dir", default=None,
                   help=f"benchmark data folder; when omitted: ${DATA_DIR_ENV}, else ../shared/data beside the checkout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while training")
    p.add_argument("--ship", action="store_true",
                   help="copy the build into models/shipped/tiny-default (what `tiny-default` names), with the sha256 "
                        "of every file in its report")
    p.epilog = f"The model is cached under ${CACHE_DIR_ENV} (default ~/.cache/expertcast)/tiny-default-v1/<key>."
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from expertcast.recipes.tiny_default import TinyDefaultConfig, ensure_default_model, load_report

        cfg = TinyDefaultConfig.from_yaml(args.config) if args.config else TinyDefaultConfig()
        path = ensure_default_model(cfg, force=args.force, progress=not args.no_progress, data_root=args.data_dir)
        print(f"default model: {path}")
        print_report(load_report(path))
        print(compare_with_shipped(path))
        if args.ship:
            from expertcast.recipes.tiny_default import ship_default_model

            print(f"shipped: {ship_default_model(path)}")
        return 0

    return run_command(PROG, body)


def compare_with_shipped(path) -> str:
    """One line: is the build at ``path`` file-for-file the shipped model (sha256 of every shipped file)?"""
    from expertcast.models.names import SHIPPED_DEFAULT_DIR, ModelNotFoundError, shipped_default_model
    from expertcast.recipes.tiny_default import load_report
    from expertcast.utils.provenance import sha256_file

    try:
        shipped = shipped_default_model()
    except ModelNotFoundError as e:
        return f"no verified shipped model to compare with ({e})"
    listed = load_report(shipped)["shipped_files"]
    differ = [n for n, want in sorted(listed.items())
              if n != "train_loss.png" and (not (path / n).is_file() or sha256_file(path / n) != want["sha256"])]
    if differ:
        return f"this build differs from the shipped model at {SHIPPED_DEFAULT_DIR} in: {', '.join(differ)}"
    return f"this build is identical to the shipped model at {SHIPPED_DEFAULT_DIR} (sha256 of every file but the plot)"


def print_report(report: dict[str, Any]) -> None:
    """Summary and per-layer load-balance table of a build's ``report.json`` in the terminal."""
    from expertcast.utils.io import print_table

    ppl = report.get("heldout_gsm8k_test") or {}
    ppl0 = report.get("heldout_gsm8k_test_init") or {}
    arith = report.get("heldout_arith_test") or {}
    print_table([{
        "train_s": report["train_time_s"], "steps": report["steps"], "tokens_seen": report["tokens_seen"],
        "tokens_per_s": report["tokens_per_s"], "epochs": report["epochs"],
        "gsm8k_test_ppl": ppl.get("perplexity"), "init_ppl": ppl0.get("perplexity"),
        "arith_test_acc": arith.get("accuracy"),
    }], title=f"tiny-default {report['key']}", floatfmt="{:.2f}")
    rows = []
    for domain, res in report.get("routing", {}).items():
        if domain == "domain_js_bits":
            continue
        init = report.get("routing_init", {}).get(domain, {})
        for r, r0 in zip(res["per_layer"], init.get("per_layer", res["per_layer"]), strict=True):
            rows.append({"text": domain, "layer": r["layer"], "entropy_norm": r["entropy_norm"],
                         "max_share": r["max_share"], "overlap": r["overlap"],
                         "init_entropy": r0["entropy_norm"], "init_max_share": r0["max_share"],
                         "init_overlap": r0["overlap"]})
    if rows:
        print_table(rows, title=f"expert load balance and step-to-step overlap (uniform overlap = "
                                f"{report['uniform_overlap']:.3f})", floatfmt="{:.3f}")
    if "domain_js_bits" in report.get("routing", {}):
        js = report["routing"]["domain_js_bits"]
        js0 = report.get("routing_init", {}).get("domain_js_bits", [float("nan")] * len(js))
        print("expert-usage divergence GSM8K vs CoT (JS bits) per layer: trained "
              + ", ".join(f"{v:.3f}" for v in js) + " | init " + ", ".join(f"{v:.3f}" for v in js0))
