#!/usr/bin/env bash
# Compare gatlib's three layers with PyG's on every tracked graph and backend, write
# benchmarks/results/compare_<graph>_<backend>_<device>.json and render compare.md.
#
#   benchmarks/compare_all.sh                          # CPU: cora + arxiv-like, auto/torch/fused
#   DEVICE=cuda GRAPHS="arxiv-like products-like" BACKENDS="auto torch fused" benchmarks/compare_all.sh
#
# Environment: DEVICE (cpu), GRAPHS ("cora arxiv-like"), BACKENDS ("auto torch fused"),
# REPEATS (5), EXTRA (more `gatlib compare` options, e.g. "--dtype bfloat16", or "--no-compile"
# to time the eager sides only: compiling takes a while, in every memory child too).
# A backend that cannot run here (no torch_scatter, triton on a machine without CUDA, ...)
# fails with gatlib compare's message; a run that fails does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cpu}
GRAPHS=${GRAPHS:-"cora arxiv-like"}
BACKENDS=${BACKENDS:-"auto torch fused"}
REPEATS=${REPEATS:-5}
EXTRA=${EXTRA:-}
# Offline machines: the Planetoid raw files beside the repository (gatlib.bench.data copies them).
if [[ -z "${GATLIB_PLANETOID_RAW:-}" && -d ../shared/data/Planetoid ]]; then
  export GATLIB_PLANETOID_RAW=../shared/data/Planetoid
fi
PY=${PYTHON:-python}
mkdir -p benchmarks/results

status=0
for graph in $GRAPHS; do
  for backend in $BACKENDS; do
    out=benchmarks/results/compare_${graph}_${backend}_${DEVICE}.json
    echo "== $graph / $backend / $DEVICE -> $out" >&2
    # shellcheck disable=SC2086  # EXTRA is a list of options
    if ! $PY -m gatlib.bench.compare --layer all --graph "$graph" --device "$DEVICE" \
        --backend "$backend" --repeats "$REPEATS" --json "$out" $EXTRA; then
      echo "== $graph / $backend: gatlib compare failed (see above)" >&2
      status=1
    fi
  done
done
$PY benchmarks/compare_table.py || status=1
exit $status
