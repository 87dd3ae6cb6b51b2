#!/usr/bin/env bash
# The GPU run, kept ready for a session that is lent a GPU (the `device` tool), in three calls of
# at most 9 minutes each (each part's limits sum to at most 530 s), every step under its own
# limit, results in $OUT. The parts are in order of what decides most: a lease fits part 1; the
# next parts run in the same lease if its time allows, else in the next one.
#
# Part 1: correctness of the flagship first: `gatlib selftest` of GATConv's kind at the default
# configs (its kernels against the reference, the output layer's call, the compiled 2-layer step
# checked per parameter against float64); then the 2-layer training step of every layer against
# PyG eager and compiled on the arxiv-like graph, whose warm-up tunes every row kernel's key
# (triton.autotune; each eager and compiled side is checked against PyG before it is timed); then
# the output layer's call (1 head, 40 classes) beside torch.sparse.mm on the same graph (issue 56,
# item 5). Part 2: Cora's step with both compiled sides replayed as CUDA graphs, the arxiv-like
# step under bfloat16 autocast, and under torch.use_deterministic_algorithms (PyG where it runs).
# Part 3: the self-test of the other five kinds (the compiled GATv2Conv and TransformerConv steps
# among its checks).
# Each key's tuning is printed (TRITON_PRINT_AUTOTUNING) and every config's time is kept in
# Triton's autotune cache, copied to $OUT/autotune/ (one JSON per key and kernel, and the GPU's
# name in device.json; read them with `python -m tools.autotune_report DIR`, and ship the choices
# to that GPU's users with its `--ship gatlib/tuned`).
#
#   mkdir -p .planetoid && cp -r ../shared/data/Planetoid/Cora .planetoid/   # (.gitignored)
#   device run: command "bash scripts/gpu_run.sh", carry [".planetoid"], timeout_s 570
#   device run: command "bash scripts/gpu_run.sh 2", carry [".planetoid"], timeout_s 570 (and 3)
#
# Then copy the files from $OUT into benchmarks/results/<gpu>_<date>/ with a README naming the
# GPU and the commit. The device machine has torch, PyG and Triton but no package registry, so
# gatlib runs from this checkout (PYTHONPATH=.). `bash scripts/gpu_run.sh --print [PART]` prints
# a part's commands.
set -uo pipefail
cd "$(dirname "$0")/.."
PRINT=0
[[ "${1:-}" == "--print" ]] && { PRINT=1; shift; }
PART=${1:-1}
[[ $PART =~ ^[123]$ ]] || { echo "usage: $0 [--print] [1|2|3]" >&2; exit 2; }
OUT=${OUT:-gpu_run}
PY=${PYTHON:-python3}  # (the device machine's python3 holds torch)
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_PRINT_AUTOTUNING=1
export GATLIB_PLANETOID_RAW=${GATLIB_PLANETOID_RAW:-.planetoid}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/gatlib_triton_cache}

if [[ $PRINT == 1 ]]; then
  gpu="gpu"
else
  mkdir -p "$OUT"
  gpu=$($PY -c "import torch; n = torch.cuda.get_device_name(0).lower(); \
print(next((g for g in ('h200', 'h100', 'a100', 'l40s') if g in n), 'gpu'))") || exit 1
  $PY -c "import sys, torch, torch_geometric, triton; print(sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'pyg', torch_geometric.__version__, 'triton', \
triton.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$OUT/log.txt"
fi

status=0
step() {  # step SECONDS [VAR=VALUE...] COMMAND...: run COMMAND for at most SECONDS (or print it)
  local limit=$1
  shift
  if [[ $PRINT == 1 ]]; then
    printf '%q ' "$@"
    echo
    return
  fi
  echo "== part $PART: $* (at most $limit s)" | tee -a "$OUT/log.txt"
  local t0=$SECONDS
  timeout "$limit" env "$@" 2>&1 | tee -a "$OUT/log.txt"
  local rc=${PIPESTATUS[0]}
  echo "== exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
  [[ $rc == 0 ]] || status=1
}

ARXIV=(--scope model --layer all --graph arxiv-like --device cuda --backend triton --no-memory)
SELFTEST=(-m gatlib.bench.selftest --device cuda --graphs "" --quick)
if [[ $PART == 1 ]]; then
  step 150 GATLIB_TRITON_AUTOTUNE=0 "$PY" "${SELFTEST[@]}" --kinds gat_projected \
    --json "$OUT/selftest_gat_projected_$gpu.json"
  step 260 "$PY" -m gatlib.bench.compare "${ARXIV[@]}" --repeats 3 \
    --json "$OUT/compare_arxiv-like_model_cuda_$gpu.json"
  step 110 "$PY" -m tools.triton_bench --heads 1 --channels 40 --kinds gat gatv2 dot \
    --dtypes float32 --rep 100 --out "$OUT/classes_sparse_mm_$gpu.json"
elif [[ $PART == 2 ]]; then
  step 150 "$PY" -m gatlib.bench.compare --scope model --layer all --graph cora --device cuda \
    --backend triton --repeats 5 --no-memory --compile-mode reduce-overhead \
    --json "$OUT/compare_cora_model_cuda_reduce-overhead_$gpu.json"
  step 220 "$PY" -m gatlib.bench.compare "${ARXIV[@]}" --repeats 2 --autocast bfloat16 \
    --json "$OUT/compare_arxiv-like_model_cuda_autocast-bf16_$gpu.json"
  step 160 CUBLAS_WORKSPACE_CONFIG=:4096:8 "$PY" -m gatlib.bench.compare "${ARXIV[@]}" \
    --repeats 2 --no-compile --deterministic \
    --json "$OUT/compare_arxiv-like_model_cuda_deterministic_$gpu.json"
else
  step 520 GATLIB_TRITON_AUTOTUNE=0 "$PY" "${SELFTEST[@]}" --kinds gat,gatv2,dot,gat_inputs,dot_inputs \
    --json "$OUT/selftest_other_kinds_$gpu.json"
fi
if [[ $PRINT == 0 ]]; then
  mkdir -p "$OUT/autotune"
  find "$TRITON_CACHE_DIR" -name '*.autotune.json' -exec cp --backup=numbered {} "$OUT/autotune/" \;
  # what `python -m tools.autotune_report DIR --ship gatlib/tuned` records the choices as
  $PY -c "import json, subprocess, sys, torch, triton; from tools import internals; \
git = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True).stdout.strip(); \
json.dump({'device': torch.cuda.get_device_name(0), 'kernels_sha256': \
internals.triton_tuned().kernels_digest(), \
'torch': torch.__version__, 'triton': triton.__version__, 'git_sha': git or None}, \
open(sys.argv[1], 'w'))" "$OUT/autotune/device.json" || status=1
fi
exit $status
