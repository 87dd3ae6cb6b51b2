"""Which score kinds the Triton kernels are launched with, eagerly and inside a
compiled GATConv training call, without a GPU (tests/test_compile.py runs this
in a subprocess: Triton's real launch path, which ``TRITON_INTERPRET=1`` replaces).

The layer runs on CPU tensors through :func:`tools.launches.triton_on_cpu`
(launches bound and skipped); the compiled call is traced by AOT autograd and run, its
graphs calling gatlib's operators, which launch the kernels at run time. Prints
one JSON object: ``{"eager": [KIND, ...], "compiled": [KIND, ...]}`` of the row
kernels' launches. ``--allow``: inside ``internals.compiled_gat_terms_in_kernel()``.
"""
import contextlib
import json
import sys

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import gatlib
from gatlib import _triton
from tools import internals
from tools.launches import Tally, triton_on_cpu


def main() -> None:
    allow = "--allow" in sys.argv
    torch.manual_seed(0)
    # inputs wider than the projection (H*C < F): GATConv forms its terms in-kernel
    N, F_in, H, C = 400, 64, 2, 16
    plan = gatlib.GraphPlan(torch.randint(0, N, (2, 3000)), num_nodes=N)
    conv = gatlib.GATConv(F_in, C, heads=H, backend="triton")
    x = torch.randn(N, F_in)
    kinds, launch = [], _triton._launch

    def spy(name, items, *args, **consts):
        kinds.append(consts["KIND"])
        return launch(name, items, *args, **consts)

    # the operators are opaque to the compiler: the compiled graph's calls of them run
    # their launches at run time, here as in an eager call
    _triton._launch = spy
    try:
        with triton_on_cpu(Tally()):
            conv(x, plan).sum().backward()  # also warms the plan for the compiled call
            eager = kinds[:]
            kinds.clear()
            with internals.compiled_gat_terms_in_kernel() if allow else contextlib.nullcontext():
                torch.compile(conv, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                              fullgraph=True)(x, plan).sum().backward()
    finally:
        _triton._launch = launch
    print(json.dumps({"eager": eager, "compiled": kinds}))


def keep(gm, example_inputs):
    return make_boxed_func(gm.forward)


if __name__ == "__main__":
    main()
