"""The command layer: one module per ``expertcast`` subcommand, each with ``main(argv) -> int``.

Only this package parses command lines (argparse) and resolves user-facing names (model names,
capacities) into library calls; ``models/``, ``data/``, ``inference/`` and ``train/`` carry no argparse.
"""
