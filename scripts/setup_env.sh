#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs gatlib with everything its tests,
# benchmarks and notebooks use. Safe to re-run: finished steps are no-ops.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# CPU torch first and pinned: an unpinned torch (or any range admitting a newer
# release) pulls the newest CUDA build, several GB. Override with TORCH_VERSION.
python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[test,bench,ogb,triton]"
# torch_scatter ships no wheel for this torch: it compiles (~5 min on 2 cores)
# against the installed torch, hence no build isolation. pip's wheel cache
# makes a second install instant.
python -c "import torch_scatter" 2>/dev/null || python -m pip install -q --no-build-isolation torch-scatter
# torch_sparse likewise compiles (~8.5 min on 2 cores): PyG's SparseTensor
# adjacencies (`conv(x, adj_t)`, tested against PyG's own layers) need it, and
# so will NeighborLoader later.
python -c "import torch_sparse" 2>/dev/null || python -m pip install -q --no-build-isolation torch-sparse
python -c "import torch, torch_geometric, torch_scatter, torch_sparse, ogb, triton, gatlib; print('gatlib env ready: torch', torch.__version__, '| torch_geometric', torch_geometric.__version__, '| torch_scatter', torch_scatter.__version__, '| torch_sparse', torch_sparse.__version__, '| ogb', ogb.__version__, '| triton', triton.__version__)"
# A second, older torch for the compile tests (tests/test_older_torch.py): the one a lent GPU
# machine runs (torch 2.11 with Triton 3.6), whose dynamo fails on code that 2.13 traces. Its
# registry build is the CUDA one (~4.6 GB; no CPU build there). GATLIB_SECOND_TORCH=none skips it.
# numpy < 2.4: Triton 3.6's interpreter converts one-element arrays to scalars, which 2.4 refuses.
SECOND=${GATLIB_SECOND_TORCH:-2.11.0}
if [ "$SECOND" != none ] && ! .venv-torch"$SECOND"/bin/python -c "import torch_geometric, triton, hypothesis, numpy; assert tuple(map(int, numpy.__version__.split('.')[:2])) < (2, 4)" 2>/dev/null; then
  "$PYTHON" -m venv .venv-torch"$SECOND"
  .venv-torch"$SECOND"/bin/python -m pip install -q "torch==$SECOND" "triton==3.6.0" \
    "torch_geometric==2.8.0" pytest hypothesis "numpy<2.4"
fi
