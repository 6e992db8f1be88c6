#!/usr/bin/env bash
# `expertcast fit` on several processes with torchrun (DDP, or FSDP2 for the router recipe): one node, or one
# node of several (slurm.sbatch runs this script once per node).
#
#   CONFIG=configs/forecaster/qwen3-30b-a3b.yaml RUN_DIR=runs/forecaster/q3-8gpu NPROC=8 \
#     bash scripts/launch/torchrun.sh [more `expertcast fit` arguments]
#
# Every rank shares RUN_DIR (EXPERTCAST_FIT_RUN_DIR): rank 0 writes run.json, config.yaml, checkpoints/ and the
# export there. When RUN_DIR already holds a run (run.json), the fit resumes from its last checkpoint with
# `--resume RUN_DIR`, so rerunning the same line after a crash, a SIGTERM or a SLURM requeue continues it
# (only with the same settings and data; `expertcast fit` refuses and names the difference otherwise).
#
# Settings (environment): CONFIG, RUN_DIR (required); NPROC (processes per node; default: the GPUs nvidia-smi
# lists, else 1); NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (multi-node; default one node on 127.0.0.1:29500);
# STRATEGY (default ddp_find_unused_parameters_true: the Mamba2 backbone's unused token embedding; `config` keeps
# the config's own strategy: the router recipe's FSDP2 block); TORCHRUN, EXPERTCAST (the executables); DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

: "${CONFIG:?set CONFIG to a fit config, e.g. configs/forecaster/qwen3-30b-a3b.yaml}"
: "${RUN_DIR:?set RUN_DIR to the run directory all ranks share (new, or one to resume)}"
if [ -z "${NPROC:-}" ]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "${NPROC:-0}" -ge 1 ] || NPROC=1
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
STRATEGY=${STRATEGY:-ddp_find_unused_parameters_true}
TORCHRUN=${TORCHRUN:-torchrun}
EXPERTCAST=${EXPERTCAST:-expertcast}

export EXPERTCAST_FIT_RUN_DIR="$RUN_DIR"
strategy=(--trainer.strategy "$STRATEGY")
[ "$STRATEGY" != config ] || strategy=()
resume=()
if [ -f "$RUN_DIR/run.json" ]; then
  resume=(--resume "$RUN_DIR")
fi
cmd=("$TORCHRUN" --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC"
     --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --no-python
     "$EXPERTCAST" fit --config "$CONFIG" --trainer.devices "$NPROC" --trainer.num_nodes "$NNODES"
     "${strategy[@]}" "${resume[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
