#!/usr/bin/env bash
# Accuracy benchmarks of the issue's done-criteria: 100 seeds each, on CPU.
#   bash benchmarks/run_accuracy.sh                 # all four, one after another
#   bash benchmarks/run_accuracy.sh cora:gat        # just one (dataset:model ...)
# Results: benchmarks/results/<dataset>_<model>_cpu.json (rewritten after every
# run, so an interrupted job keeps what finished) and a .log beside it; then
# benchmarks/make_tables.py rebuilds benchmarks/results/accuracy.md.
# Offline, the raw Planetoid files are copied from $GATLIB_PLANETOID_RAW
# (default: ../shared/data/Planetoid beside the repository, if present).
# THREADS (default 1: two jobs side by side on 2 cores) and RUNS override.
set -euo pipefail
cd "$(dirname "$0")/.."
shared="$(cd .. && pwd)/shared/data/Planetoid"
if [ -z "${GATLIB_PLANETOID_RAW:-}" ] && [ -d "$shared" ]; then
    export GATLIB_PLANETOID_RAW="$shared"
fi
GATLIB=${GATLIB:-.venv/bin/gatlib}
jobs=("$@")
[ ${#jobs[@]} -gt 0 ] || jobs=(cora:gat citeseer:gat cora:gatv2 cora:transformer)
for job in "${jobs[@]}"; do
    dataset=${job%%:*} model=${job##*:}
    out="benchmarks/results/${dataset}_${model}_cpu"
    "$GATLIB" bench --dataset "$dataset" --model "$model" --runs "${RUNS:-100}" --device cpu \
        --threads "${THREADS:-1}" --no-progress --json "$out.json" 2>&1 | tee "$out.log"
done
.venv/bin/python benchmarks/make_tables.py
