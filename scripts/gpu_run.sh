#!/usr/bin/env bash
# The GPU run, kept ready for a session that is lent a GPU (the `device` tool): one command of at
# most 7 minutes, every step under its own limit and the run's deadline, at most 8 result files in
# $OUT (tools/gpu_run.py has the steps; docs/gpu.md, "The GPU run", what they decide):
#
#   mkdir -p .planetoid && cp -r ../shared/data/Planetoid/Cora .planetoid/   # (.gitignored)
#   device run: command "bash scripts/gpu_run.sh", carry [".planetoid"], timeout_s 480
#
# Then copy $OUT's files into benchmarks/results/<gpu>_<date>/ with a README naming the GPU and
# the commit. The device machine has torch, PyG and Triton but no package registry, so gatlib
# runs from this checkout. `bash scripts/gpu_run.sh --dry-run` runs the same steps on CPU, tiny.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m tools.gpu_run --out "${OUT:-gpu_run}" "$@"
