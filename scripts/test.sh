#!/usr/bin/env bash
# The README's test command: set up the environment, then run the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -m "not gpu" "$@"
