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


def test_first_step_compiles_its_spaces_and_a_new_graph_nothing(tmp_path):
    """``tools.tuning_cost`` through Triton's launch path (a stand-in GPU): a layer's first
    training step compiles one config per row kernel's key untuned and more tuned (each config of
    its space); mini-batches of other sizes compile nothing, 7-class rows included, whose
    projections start off 16 bytes for some node counts (the operators copy those), and a graph of
    another degree bucket is tuned anew (new keys) without compiling."""
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
        assert r["new_graph"] == {}, r
        # the last graph's degree bucket is new: its keys too, each a row kernel's
        assert r["classes"] == 7 and sum(r["first_step_keys"].values()) >= 5
        assert {k: 2 * n for k, n in r["first_step_keys"].items()} == r["new_graph_keys"]
    for tuned, untuned in zip(rows[::2], rows[1::2], strict=True):
        assert tuned["tuned"] and not untuned["tuned"]
        for k, keys in untuned["first_step_keys"].items():
            assert untuned["first_step"][k] == keys  # the default alone per key
            assert tuned["first_step"][k] >= keys
        assert tuned["first_step"]["_fwd_kernel"] > untuned["first_step"]["_fwd_kernel"]
