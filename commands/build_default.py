"""`expertcast build-default`: train (or load the cached) embedded default MoE model.

The recipe (``configs/tiny_default/default.yaml``, the defaults of
:class:`expertcast.train.tiny_default.TinyDefaultConfig`) fixes the optimizer steps, the seed and the
torch thread count, so every machine builds the same weights; the cache key covers the whole recipe,
the sha256 of the data files and the code format.
"""

from __future__ import annotations

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
    p.epilog = f"The model is cached under ${CACHE_DIR_ENV} (default ~/.cache/expertcast)/tiny-default-v1/<key>."
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from expertcast.train.tiny_default import (
            TinyDefaultConfig,
            ensure_default_model,
            load_report,
            print_report,
        )

        cfg = TinyDefaultConfig.from_yaml(args.config) if args.config else TinyDefaultConfig()
        path = ensure_default_model(cfg, force=args.force, progress=not args.no_progress, data_root=args.data_dir)
        print(f"default model: {path}")
        print_report(load_report(path))
        return 0

    return run_command(PROG, body)
