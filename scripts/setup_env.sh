#!/usr/bin/env bash
# Creates ./.venv (once) and installs the CPU torch wheel, then the project (editable) with dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# One set-up at a time in a clone: the README's two commands started together would otherwise both create and
# install into the same .venv. The second waits here for the first to finish, then finds the install done.
if command -v flock >/dev/null 2>&1; then
  exec 9>.setup_env.lock
  flock 9
fi
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
if [[ ! -f .venv/.expertcast-installed ]] || [[ pyproject.toml -nt .venv/.expertcast-installed ]]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first: the pinned CPU wheel (an unpinned torch would pull several GB of CUDA wheels).
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch .venv/.expertcast-installed
fi
