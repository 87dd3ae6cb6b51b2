#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs gatlib into it. Safe to re-run:
# finished steps are no-ops.
#
#   bash scripts/setup_env.sh        what `gatlib bench` and `gatlib compare` need:
#                                    CPU torch, PyG, the `bench` extra (no compiling)
#   bash scripts/setup_env.sh test   also the test suite's packages: triton, ogb, and
#                                    torch_scatter and torch_sparse, which compile
#                                    (~14 min on 2 cores the first time)
#
# GATLIB_SECOND_TORCH=2.11.0 (with `test`) also makes .venv-torch2.11.0 for the
# compile tests under an older torch (tests/test_older_torch.py; ~4.6 GB); CI sets it.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") LANE=job ;;
  test) LANE=test ;;
  *) echo "usage: bash scripts/setup_env.sh [test]" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# CPU torch first and pinned: an unpinned torch (or any range admitting a newer
# release) pulls the newest CUDA build, several GB. Override with TORCH_VERSION.
python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
if [ "$LANE" = job ]; then
  python -m pip install -q -e ".[bench]"
  python -c "import torch, torch_geometric, gatlib; print('gatlib ready: torch', torch.__version__, '| torch_geometric', torch_geometric.__version__)"
  exit 0
fi
python -m pip install -q -e ".[test,bench,ogb,triton]"
# torch_scatter ships no wheel for this torch: it compiles (~5 min on 2 cores)
# against the installed torch, hence no build isolation. pip's wheel cache
# makes a second install instant.
python -c "import torch_scatter" 2>/dev/null || python -m pip install -q --no-build-isolation torch-scatter
# torch_sparse likewise compiles (~8.5 min on 2 cores): PyG's SparseTensor
# adjacencies (`conv(x, adj_t)`, tested against PyG's own layers) and the
# sampler behind NeighborLoader need it.
python -c "import torch_sparse" 2>/dev/null || python -m pip install -q --no-build-isolation torch-sparse
python -c "import torch, torch_geometric, torch_scatter, torch_sparse, ogb, triton, gatlib; print('gatlib test env ready: torch', torch.__version__, '| torch_geometric', torch_geometric.__version__, '| torch_scatter', torch_scatter.__version__, '| torch_sparse', torch_sparse.__version__, '| ogb', ogb.__version__, '| triton', triton.__version__)"
# A second, older torch for the compile tests (tests/test_older_torch.py): the one a lent GPU
# machine runs (torch 2.11 with Triton 3.6), whose dynamo fails on code that 2.13 traces. Its
# registry build is the CUDA one (~4.6 GB; no CPU build there): made only when asked for.
# numpy < 2.4: Triton 3.6's interpreter converts one-element arrays to scalars, which 2.4 refuses.
SECOND=${GATLIB_SECOND_TORCH:-none}
if [ "$SECOND" != none ] && ! .venv-torch"$SECOND"/bin/python -c "import torch_geometric, triton, hypothesis, numpy; assert tuple(map(int, numpy.__version__.split('.')[:2])) < (2, 4)" 2>/dev/null; then
  "$PYTHON" -m venv .venv-torch"$SECOND"
  .venv-torch"$SECOND"/bin/python -m pip install -q "torch==$SECOND" "triton==3.6.0" \
    "torch_geometric==2.8.0" pytest hypothesis "numpy<2.4"
fi
