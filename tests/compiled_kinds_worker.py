"""Which score kinds the Triton kernels are launched with, eagerly and inside a
compiled GATConv training call, without a GPU (tests/test_compile.py runs this
in a subprocess: Triton's real launch path, which ``TRITON_INTERPRET=1`` replaces).

The layer runs on CPU tensors through :func:`gatlib.bench.launches.triton_on_cpu`
(launches bound and skipped); the compiled call is traced by AOT autograd, whose
forward and backward graphs hold each kernel launch with its constexprs. Prints
one JSON object: ``{"eager": [KIND, ...], "compiled": [KIND, ...]}`` of the row
kernels' launches. ``--allow``: inside ``introspect.compiled_gat_terms_in_kernel()``.
"""
import contextlib
import json
import sys

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import gatlib
from gatlib import _triton, introspect
from gatlib.bench.launches import Tally, triton_on_cpu


def main() -> None:
    allow = "--allow" in sys.argv
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    # inputs wider than the projection (H*C < F): GATConv forms its terms in-kernel
    N, F_in, H, C = 400, 64, 2, 16
    plan = gatlib.GraphPlan(torch.randint(0, N, (2, 3000)), num_nodes=N)
    conv = gatlib.GATConv(F_in, C, heads=H, backend="triton")
    x = torch.randn(N, F_in)
    eager, launch = [], _triton._launch

    def spy(kernel, items, H, width, *args, **consts):
        eager.append(consts["KIND"])
        return launch(kernel, items, H, width, *args, **consts)

    with triton_on_cpu(Tally()):
        _triton._launch = spy
        try:
            conv(x, plan).sum().backward()  # also warms the plan for the compiled call
        finally:
            _triton._launch = launch
        with introspect.compiled_gat_terms_in_kernel() if allow else contextlib.nullcontext():
            torch.compile(conv, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                          fullgraph=True)(x, plan).sum().backward()
    compiled = [n.kwargs["kwargs"]["KIND"] for gm in graphs for n in gm.graph.nodes
                if "triton_kernel_wrapper" in str(n.target) and "KIND" in n.kwargs["kwargs"]]
    print(json.dumps({"eager": eager, "compiled": compiled}))


if __name__ == "__main__":
    main()
