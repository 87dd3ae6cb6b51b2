"""The GPU run's instruments, on CPU: ``torch.sparse.mm`` beside the attention call
(``tools.triton_bench``, the narrow rows' practical floor). The autotune report's test is
beside the tuner's (tests/test_triton_configs.py), which writes the files it reads."""
from __future__ import annotations

import pytest
import torch

from gatlib import GraphPlan, graph_attention
from tools.triton_bench import make_inputs, sparse_mm_call


@pytest.mark.parametrize("kind", ["gat", "gatv2", "dot"])
@pytest.mark.parametrize("heads,channels", [(1, 40), (3, 8)])
def test_sparse_mm_aggregates_the_calls_weights_on_its_csr(kind, heads, channels):
    """With the call's attention weights as values, sparse.mm over the plan's CSR gives the
    call's output; its gradient is the value's through those weights held fixed."""
    N, E = 60, 400
    ei = torch.randint(0, N, (2, E), generator=torch.Generator().manual_seed(3))
    plan = GraphPlan(ei, num_nodes=N)
    score, value, _ = make_inputs(kind, N, E, heads, channels, torch.float32, False, "cpu", 0)
    out, alpha = graph_attention(score, value, plan, N, backend="torch", return_attention=True)
    spmm = sparse_mm_call(plan, alpha, value)()
    torch.testing.assert_close(spmm, out.detach())
    g = torch.randn_like(spmm)
    (got,) = torch.autograd.grad(spmm, value, g)
    src, dst = ei
    want = torch.zeros(N, heads, channels).index_add_(
        0, src, alpha.detach()[:, :, None] * g.view(N, heads, channels)[dst])
    torch.testing.assert_close(got, want)
