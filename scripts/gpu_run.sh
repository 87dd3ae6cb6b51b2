#!/usr/bin/env bash
# The GPU run, kept ready for a session that is lent a GPU (the `device` tool), in one call:
# the Triton kernels checked against the reference, then gatlib against PyG, each eager and under
# torch.compile, on the 2-layer training step (the GPU targets: arxiv-like under torch.compile's
# default mode; Cora, launch-bound, with both compiled sides replayed as CUDA graphs:
# mode="reduce-overhead", the captured step) and on one layer (arxiv-like: each pass against its
# bandwidth floor). The steps' limits add up to 580 s, within the call's 590:
#
#   mkdir -p .planetoid && cp -r ../shared/data/Planetoid/Cora .planetoid/   # (.gitignored)
#   device run: command "bash scripts/gpu_run.sh", carry [".planetoid"], timeout_s 590
#
# Then copy the files from $OUT into benchmarks/results/ and write down the commit they ran on
# (benchmarks/NOTES.md): the device machine's copy of the repository may carry other git metadata.
# The device machine has torch, PyG and Triton but no package registry and no ../shared, so gatlib
# runs from this checkout (PYTHONPATH=.) and Cora's raw files travel in .planetoid. Each step has
# its own time limit, so a step that overruns leaves the others' results; all output goes to
# $OUT/log.txt too. `bash scripts/gpu_run.sh --print` prints the commands instead of running them.
set -uo pipefail
cd "$(dirname "$0")/.."
PRINT=0
[[ "${1:-}" == "--print" ]] && PRINT=1
OUT=${OUT:-gpu_run}
PY=${PYTHON:-python3}  # (the device machine's python3 holds torch)
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export GATLIB_PLANETOID_RAW=${GATLIB_PLANETOID_RAW:-.planetoid}

if [[ $PRINT == 1 ]]; then
  gpu="gpu"
else
  mkdir -p "$OUT"
  gpu=$($PY -c "import torch; n = torch.cuda.get_device_name(0).lower(); \
print(next((g for g in ('h200', 'h100', 'a100', 'l40s') if g in n), 'gpu'))") || exit 1
  $PY -c "import sys, torch, torch_geometric, triton; print(sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'pyg', torch_geometric.__version__, 'triton', \
triton.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee "$OUT/log.txt"
fi

status=0
step() {  # step SECONDS COMMAND...: run COMMAND for at most SECONDS (or print it)
  local limit=$1
  shift
  if [[ $PRINT == 1 ]]; then
    printf '%q ' "$@"
    echo
    return
  fi
  echo "== $* (at most $limit s)" | tee -a "$OUT/log.txt"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/log.txt"
  local rc=${PIPESTATUS[0]}
  echo "== exit $rc" | tee -a "$OUT/log.txt"
  [[ $rc == 0 ]] || status=1
}

# 1. the kernels against the reference (two cases per kind and dtype; no PyG comparison here)
step 170 "$PY" -m gatlib.bench.selftest --device cuda --graphs "" --quick \
  --json "$OUT/selftest_$gpu.json" --table "$OUT/selftest_$gpu.md"
# 2. the training step against PyG, eager and compiled: time first (memory children recompile)
step 180 "$PY" -m gatlib.bench.compare --scope model --layer all --graph arxiv-like --device cuda \
  --backend triton --repeats 5 --no-memory --json "$OUT/compare_arxiv-like_model_cuda_$gpu.json"
step 110 "$PY" -m gatlib.bench.compare --scope model --layer all --graph cora --device cuda \
  --backend triton --repeats 5 --no-memory --compile-mode reduce-overhead \
  --json "$OUT/compare_cora_model_cuda_reduce-overhead_$gpu.json"
# 3. one layer, forward and forward+backward, with the bandwidth floor of each pass
step 120 "$PY" -m gatlib.bench.compare --scope layer --layer all --graph arxiv-like --device cuda \
  --backend triton --pass both --repeats 5 --json "$OUT/compare_arxiv-like_cuda_$gpu.json"
exit $status
