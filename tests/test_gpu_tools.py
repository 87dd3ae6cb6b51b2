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


def test_a_case_of_the_classes_step_runs_through(monkeypatch):
    """The GPU run's 40-class step, its code path on CPU (the kernels in Triton's interpreter,
    a stand-in for ``do_bench``): each case checks the fused call, times fused, reference and
    sparse.mm per pass and prints; a dtype sparse.mm lacks here (bfloat16 on CPU) is a row's
    error, not the run's end."""
    testing = pytest.importorskip("triton.testing")

    from tools import triton_bench

    calls = []

    def bench(fn, warmup, rep, grad_to_none, return_mode):
        fn()
        calls.append(1)
        return 1.0
    monkeypatch.setattr(testing, "do_bench", bench)
    args = triton_bench.parse_args(["--heads", "1", "--channels", "40", "--kinds", "gat", "dot"])
    N, E = 40, 200
    ei = torch.randint(0, N, (2, E), generator=torch.Generator().manual_seed(5))
    plan = GraphPlan(ei, num_nodes=N)
    rows = [triton_bench.run_case(kind, dtype, plan, args, "cpu", bandwidth=1e11)
            for kind in args.kinds for dtype in (torch.float32, torch.bfloat16)]
    assert len(calls) == 4 * 6 - 2 * 2  # (bfloat16 sparse.mm raised at its first call)
    for r in rows:
        assert r["kernels"][0] == "triton" and r["fused_fwd_ms"] == r["torch_fwd+bwd_ms"] == 1.0
        if r["dtype"] == "float32":
            assert r["correct"] is True, r
            assert r["sparse_mm_fwd_ms"] == r["sparse_mm_fwd+bwd_ms"] == 1.0
        else:  # (the tool's rule, twice the reference's error, is not the kernels' bfloat16 bound)
            assert r["sparse_mm_fwd_ms"].startswith("error: ")
    out = triton_bench.table(rows)
    assert "sparse.mm" in out and out.count("\n") == len(rows) + 1
