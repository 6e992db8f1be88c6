#!/usr/bin/env bash
# The prepared GPU check (docs/design.md, "Runtime"): one run on one H100/H200-class GPU, under 8 minutes, one line per check
#   PASS|FAIL|SKIP name figure
# and exit status 1 when any check failed. Needs no download: presets, synthetic traces and the repo's files.
#
#   bash scripts/gpu_check.sh [--dry-run] [--out DIR] [--skip name,...] [--layers N]
#
# Checks: gpu-extra (installs mamba-ssm/causal-conv1d from .whl/ or the index when missing), gpu-tests (every
# `gpu`-marked test), forecaster-epoch (bf16 epoch with the mamba-ssm kernels asserted in use, and its step
# time vs the PyTorch fallback), token-identity (offloaded greedy tokens on CUDA equal the full-load model's,
# qwen3_moe-tiny and gpt_oss-tiny), disk-cuda (the disk store's reader pool feeding pinned bounce buffers and
# device slots: forced-routing logits equal the pinned RAM store's, reads == counted loads), bench (scripts/bench_runtime.py --device cuda on a random-weight
# Qwen3-30B-A3B-shaped model, --layers MoE layers, forced synthetic staged routing: % of full-load tokens/s at
# 25% and 45% residency for lru, static and seqmoe, real pinned-memory transfers), peak-memory (the
# benchmark's peak device memory vs its memory report), eval-graph (`expertcast eval --decode-path graph` on
# qwen3_moe-tiny: on CUDA it captures and replays the decode layers' CUDA Graphs; completions equal the eager
# path's), router-fsdp2 (`expertcast fit` of configs/router/qwen3-30b-a3b.yaml's FSDP2 strategy as shipped, on
# one GPU with qwen3_moe-tiny: layers sharded, run finished, export written), graph (scripts/gpu_check_graph.py,
# the CUDA-graph decode path), quant (scripts/gpu_check_quant.py: int8/int4 offloaded == full-load quantized on
# CUDA, the CUDA int4 kernel and FP8 _scaled_mm at the DeepSeek-V2-Lite expert shapes vs bf16).
# --dry-run: nothing needs CUDA; every step resolves its inputs and runs its code on the CPU at tiny sizes.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
OUT=${OUT:-runs/gpu_check}
SKIP=""
LAYERS=${LAYERS:-12}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT=$2; shift ;;
    --skip) SKIP=$2; shift ;;
    --layers) LAYERS=$2; shift ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export HF_HUB_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
mkdir -p "$OUT"
FAILED=0
say() { echo "$1 $2 $3"; [ "$1" != FAIL ] || FAILED=1; }
skipped() { case ",$SKIP," in *",$1,"*) say SKIP "$1" "(--skip)"; return 0 ;; esac; return 1; }
# run_step NAME LOG CMD...: run a step whose own output ends in PASS/FAIL lines; FAIL when it prints none
run_step() {
  local name=$1 log=$2; shift 2
  "$@" >"$log" 2>&1
  local rc=$? lines
  lines=$(grep -E '^(PASS|FAIL|SKIP) ' "$log")
  if [ -n "$lines" ]; then echo "$lines"; grep -q '^FAIL ' <<<"$lines" && FAILED=1
  else say FAIL "$name" "exit $rc, no result line (see $log)"; fi
  return 0
}

# -- 0. the gpu extra --------------------------------------------------------------------------------------
if ! skipped gpu-extra; then
  if [ $DRY = 1 ]; then
    say PASS gpu-extra "dry-run: would install $( [ -d .whl ] && echo "from .whl/ ($(ls .whl | wc -l) wheels)" || echo "'.[gpu]' from the index") when mamba_ssm is missing; torch $($PY -c 'import torch; print(torch.__version__)')"
  else
    if ! $PY -c "import mamba_ssm, causal_conv1d" 2>/dev/null; then
      if [ -d .whl ]; then $PY -m pip install -q --no-index --find-links .whl mamba-ssm causal-conv1d >"$OUT/pip.log" 2>&1
      else $PY -m pip install -q -e '.[gpu]' >"$OUT/pip.log" 2>&1; fi
    fi
    if v=$($PY -c "import torch, mamba_ssm, causal_conv1d; assert torch.cuda.is_available(); print(f'torch {torch.__version__} cuda {torch.version.cuda} {torch.cuda.get_device_name()} mamba-ssm {mamba_ssm.__version__}')" 2>>"$OUT/pip.log"); then
      say PASS gpu-extra "$v"
    else say FAIL gpu-extra "mamba-ssm/causal-conv1d not importable or no CUDA (see $OUT/pip.log)"; fi
  fi
fi

# -- 1. the gpu-marked tests ----------------------------------------------------------------------------------
if ! skipped gpu-tests; then
  mapfile -t GPU_TESTS < <(grep -rlE 'pytest\.mark\.gpu|mark\.gpu\b' tests --include='test_*.py' | sort)
  if [ $DRY = 1 ]; then
    say PASS gpu-tests "dry-run: ${#GPU_TESTS[@]} files with gpu-marked tests (${GPU_TESTS[*]##*/})"
  else
    $PY -m pytest -q -p no:cacheprovider -m gpu "${GPU_TESTS[@]}" >"$OUT/gpu_tests.log" 2>&1
    rc=$?; summary=$(tail -n 1 "$OUT/gpu_tests.log")
    if [ $rc = 0 ]; then say PASS gpu-tests "$summary"; else say FAIL gpu-tests "$summary (see $OUT/gpu_tests.log)"; fi
  fi
fi

# -- 2. forecaster epoch on GPU, bf16, mamba-ssm kernels --------------------------------------------------
if ! skipped forecaster-epoch; then
  run_step forecaster-epoch "$OUT/forecaster.log" $PY scripts/gpu_check_steps.py forecaster $( [ $DRY = 1 ] && echo --dry-run )
fi

# -- 3. runtime token identity on CUDA, two families ---------------------------------------------------------
if ! skipped token-identity; then
  T=tests/inference/runtime/test_engine_cuda.py::test_cuda_offloaded_generation_equals_full_load
  if [ $DRY = 1 ]; then
    n=$($PY -m pytest -q -p no:cacheprovider --collect-only "$T" 2>/dev/null | grep -c '::')
    if [ "$n" = 2 ]; then say PASS token-identity "dry-run: $n cases resolve ($T)"; else say FAIL token-identity "dry-run: $n cases"; fi
  else
    $PY -m pytest -q -p no:cacheprovider "$T" >"$OUT/token_identity.log" 2>&1
    rc=$?; summary=$(tail -n 1 "$OUT/token_identity.log")
    if [ $rc = 0 ] && ! grep -q skipped <<<"$summary"; then say PASS token-identity "qwen3_moe-tiny, gpt_oss-tiny: $summary"
    else say FAIL token-identity "$summary (see $OUT/token_identity.log)"; fi
  fi
fi

# -- 3b. disk store on CUDA: disk -> pinned bounce buffers -> device slots (docs/design.md, "Disk tier") -----------
if ! skipped disk-cuda; then
  T=tests/inference/runtime/test_disk_store.py::test_cuda_disk_reads_equal_ram
  if [ $DRY = 1 ]; then
    n=$($PY -m pytest -q -p no:cacheprovider --collect-only "$T" 2>/dev/null | grep -c '::')
    if [ "$n" = 1 ]; then say PASS disk-cuda "dry-run: $n case resolves ($T)"; else say FAIL disk-cuda "dry-run: $n cases"; fi
  else
    $PY -m pytest -q -p no:cacheprovider "$T" >"$OUT/disk_cuda.log" 2>&1
    rc=$?; summary=$(tail -n 1 "$OUT/disk_cuda.log")
    if [ $rc = 0 ] && ! grep -q skipped <<<"$summary"; then say PASS disk-cuda "reader pool on CUDA, logits equal the pinned RAM store's: $summary"
    else say FAIL disk-cuda "$summary (see $OUT/disk_cuda.log)"; fi
  fi
fi

# -- 4. runtime benchmark: Qwen3-30B-A3B shape, random weights, forced routing; 5. peak memory -------------------
if ! skipped bench; then
  if [ $DRY = 1 ]; then
    SHAPE=(--device cpu --hidden 64 --moe-intermediate 32 --experts 16 --top-k 2 --layers 2 --tokens 6 --sequences 1
           --repeats 1 --train-forecaster-epochs 1)
  else  # Qwen3-30B-A3B: hidden 2048, 128 experts of intermediate 768, top-8 (9.44 MB per bf16 expert)
    SHAPE=(--device cuda --dtype bfloat16 --hidden 2048 --moe-intermediate 768 --experts 128 --top-k 8
           --layers "$LAYERS" --tokens 64 --sequences 2 --repeats 2 --train-forecaster-epochs 4)
  fi
  $PY scripts/bench_runtime.py "${SHAPE[@]}" --synthetic --residency 0.25 0.45 --ratios 2 \
      --policies lru static seqmoe --out "$OUT/bench" >"$OUT/bench.log" 2>&1
  rc=$?
  if [ $rc = 0 ] && [ -f "$OUT/bench/residency.json" ]; then
    fig=$($PY - "$OUT/bench/residency.json" <<'PYEOF'
import json, sys
rows = json.load(open(sys.argv[1]))
print("; ".join(f"{r['policy']}@{r['residency']:.0%} {r['pct_full']:.1f}%" for r in rows))
PYEOF
)
    if [ $DRY = 1 ]; then  # 6 tokens of a 2-layer toy on the CPU: the ratios are timing noise, not speeds
      say PASS bench "dry-run: ran lru, static, seqmoe at 25% and 45% (CPU toy, ratios not a speed figure: $fig)"
    else say PASS bench "% of full-load tokens/s: $fig"; fi
  else say FAIL bench "exit $rc (see $OUT/bench.log)"; fi
  if ! skipped peak-memory; then
    run_step peak-memory "$OUT/memory.log" $PY scripts/gpu_check_steps.py memory "$OUT/bench" $( [ $DRY = 1 ] && echo --dry-run )
  fi
fi

# -- 6. the eval command on the graph decode path (on CUDA it captures and replays the decode layers' CUDA Graphs) --
if ! skipped eval-graph; then
  DATA=${EXPERTCAST_DATA_DIR:-}
  for d in "$DATA" ../shared/data shared/data; do [ -n "$d" ] && [ -f "$d/gsm8k/test.jsonl" ] && { DATA=$d; break; }; done
  if [ -z "$DATA" ] || [ ! -f "$DATA/gsm8k/test.jsonl" ]; then
    say SKIP eval-graph "no local gsm8k (set EXPERTCAST_DATA_DIR)"
  else
    DEV=$( [ $DRY = 1 ] && echo cpu || echo cuda )
    EVAL=(-m expertcast.cli eval --model qwen3_moe-tiny --benchmark gsm8k --data-dir "$DATA" --policy lru
          --capacity 0.5 --limit 4 --batch-size 2 --max-new-tokens 8 --no-progress --device "$DEV" --baseline none)
    ok=1
    for path in eager graph; do
      rm -rf "$OUT/eval_$path"
      $PY "${EVAL[@]}" --decode-path $path --out "$OUT/eval_$path" >"$OUT/eval_$path.log" 2>&1 || ok=0
    done
    if [ $ok = 1 ] && grep -q "decode path: graph" "$OUT/eval_graph.log"; then
      fig=$($PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
rows = {p: [json.loads(ln)["completion"] for ln in (Path(sys.argv[1]) / f"eval_{p}" / "samples.jsonl").open()]
        for p in ("eager", "graph")}
print(("equal" if rows["graph"] == rows["eager"] else "DIFFER") + f" ({len(rows['graph'])} samples)")
PYEOF
)
      what=$( [ $DRY = 1 ] && echo "dry-run: CPU graph path, no capture" || echo "CUDA Graphs captured and replayed" )
      if [ "${fig%% *}" = equal ]; then say PASS eval-graph "expertcast eval --decode-path graph ($what): completions vs the eager path's: $fig"
      else say FAIL eval-graph "completions of --decode-path graph vs eager: $fig"; fi
    else say FAIL eval-graph "eval failed or did not run the graph path (see $OUT/eval_graph.log, $OUT/eval_eager.log)"; fi
  fi
fi

# -- 7. the shipped real-size router strategy (FSDP2, bf16-true) on one GPU, with the tiny preset --------------------
if ! skipped router-fsdp2; then
  RDATA=${EXPERTCAST_DATA_DIR:-}
  for d in "$RDATA" ../shared/data shared/data; do [ -n "$d" ] && [ -f "$d/gsm8k/train.jsonl" ] && { RDATA=$d; break; }; done
  if [ -z "$RDATA" ] || [ ! -f "$RDATA/gsm8k/train.jsonl" ]; then
    say SKIP router-fsdp2 "no local gsm8k train split (set EXPERTCAST_DATA_DIR)"
  else
    run_step router-fsdp2 "$OUT/router.log" $PY scripts/gpu_check_steps.py router "$OUT" "$RDATA" $( [ $DRY = 1 ] && echo --dry-run )
  fi
fi

# -- 8. CUDA-graph decode path (the Graph step: scripts/gpu_check_graph.py prints its own PASS/FAIL lines) ------
if ! skipped graph; then
  if [ -f scripts/gpu_check_graph.py ]; then
    run_step graph "$OUT/graph.log" $PY scripts/gpu_check_graph.py --out "$OUT/graph" --layers "$LAYERS" $( [ $DRY = 1 ] && echo --dry-run )
  else say SKIP graph "scripts/gpu_check_graph.py not present"; fi
fi

# -- 9. expert formats on CUDA (scripts/gpu_check_quant.py prints its own PASS/FAIL/SKIP lines) ----------------
if ! skipped quant; then
  run_step quant "$OUT/quant.log" $PY scripts/gpu_check_quant.py $( [ $DRY = 1 ] && echo --dry-run )
fi

exit $FAILED
