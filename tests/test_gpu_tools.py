"""The GPU run's instruments, on CPU: ``torch.sparse.mm`` and the two-pass candidate beside the
attention call (``tools.triton_bench``: the narrow rows' practical floor and their other form),
and what a first step compiles (``tools.tuning_cost``)."""
from __future__ import annotations

import pytest
import torch

from gatlib import GraphPlan, graph_attention
from tools.triton_bench import CsrAggregate, make_inputs, sparse_mm_call, two_pass_gat

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")


@pytest.mark.parametrize("heads,channels", [(1, 40), (3, 8)])
def test_two_pass_gat_is_the_reference(heads, channels):
    """The two-pass candidate for GAT's narrow rows (scores and softmax over ``[E, H]``, the
    aggregation by ``torch.sparse.mm``): the reference's output and the gradients of the values
    and both node terms in float64, over a hub, duplicate edges and rows without in-edges; and
    aggregation's autograd function passes gradcheck."""
    N = 60
    g = torch.Generator().manual_seed(3)
    ei = torch.randint(0, N - 5, (2, 300), generator=g)
    ei = torch.cat([ei, ei[:, :20], torch.stack([torch.arange(40), torch.zeros(40, dtype=torch.long)])], 1)
    plan = GraphPlan(ei, num_nodes=N)
    score, value, _ = make_inputs("gat", N, ei.size(1), heads, channels, torch.float64, False, "cpu", 0)
    ins = [value, score.src, score.dst]
    out = two_pass_gat(score, value, plan)
    ref = graph_attention(score, value, plan, N, backend="torch")
    torch.testing.assert_close(out, ref)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, ins, w), torch.autograd.grad(ref, ins, w), strict=True):
        torch.testing.assert_close(a, b)
    few = GraphPlan(torch.tensor([[0, 1, 2, 3, 3, 5, 1], [1, 1, 1, 2, 0, 0, 4]]), num_nodes=6).layout()
    leaves = [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
              for shape in ((7, heads), (6, heads, 3))]
    assert torch.autograd.gradcheck(
        lambda a, v: CsrAggregate.apply(few.ptr, few.src, few.dst, few.csc_ptr, few.csc_edge, a, v),
        leaves, fast_mode=True)


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
    # each pass of fused, reference and sparse.mm, and GAT's two-pass: but in bfloat16 the
    # sparse ones (CPU's sparse.mm lacks it: raised at its first call)
    assert len(calls) == 2 * (4 + 3) + 2 * (2 + 2)
    for r in rows:
        assert r["kernels"][0] == "triton" and r["fused_fwd_ms"] == r["torch_fwd+bwd_ms"] == 1.0
        assert ("two_pass_fwd_ms" in r) == (r["kind"] == "gat")
        if r["dtype"] == "float32":
            assert r["correct"] is True, r
            assert r["sparse_mm_fwd_ms"] == r["sparse_mm_fwd+bwd_ms"] == 1.0
            if r["kind"] == "gat":
                assert r["two_pass_fwd_ms"] == r["two_pass_fwd+bwd_ms"] == 1.0
                assert r["two_pass_rel_error"] < 1e-5, r
        else:  # (the tool's rule, twice the reference's error, is not the kernels' bfloat16 bound)
            assert r["sparse_mm_fwd_ms"].startswith("error: ")
    out = triton_bench.table(rows)
    assert "sparse.mm" in out and out.count("\n") == len(rows) + 1


def test_first_step_compiles_its_spaces_and_a_new_graph_nothing(tmp_path):
    """``tools.tuning_cost`` through Triton's launch path (a stand-in GPU): a layer's first
    training step compiles each config of each row kernel's space for each of its keys tuned,
    and one per key untuned; mini-batches of other sizes and of a higher degree compile and
    tune nothing, 7-class rows included, whose projections start off 16 bytes for some node
    counts (the operators copy those)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(root), env.get("PYTHONPATH", "")]),
               TRITON_DEFAULT_FP_FUSION="1")
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, "-m", "tools.tuning_cost", "--shapes", "cora",
                           "--layers", "gatv2", "transformer", "--json", str(out)],
                          env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4
    for r in rows:
        assert r["new_graph"] == {} and r["new_graph_keys"] == r["first_step_keys"], r
        assert r["classes"] == 7
    for tuned, untuned in zip(rows[::2], rows[1::2], strict=True):
        assert tuned["tuned"] and not untuned["tuned"]
        assert not any(untuned["first_step_keys"].values())  # (the tuners were bypassed)
        keys = tuned["first_step_keys"]
        assert sum(keys.values()) >= 5  # two layers, three row kernels (GATv2's src: one key)
        for k, n in keys.items():
            assert untuned["first_step"][k] == n  # the default alone per key
            assert tuned["first_step"][k] > n  # each config of the key's space
