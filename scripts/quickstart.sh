#!/usr/bin/env bash
# The README's main job: set up the environment, then run the pipeline on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/expertcast quickstart "$@"
