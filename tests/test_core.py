"""The attention core: reference vs a dense oracle, gradcheck, backends vs reference."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gatlib
from gatlib import DotProductScore, GATScore, GATv2Score, graph_attention, segment_softmax

from testing import backends, hub_graph, random_graph


def unique_graph(n_src, n_dst, p, seed=0):
    """Edges without duplicates (a dense mask cannot hold multiplicities)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n_dst, n_src, generator=g) < p
    dst, src = mask.nonzero(as_tuple=True)
    perm = torch.randperm(src.numel(), generator=g)  # unsorted on purpose
    return torch.stack([src[perm], dst[perm]]), mask


def dense_oracle(logits, mask, v):
    """softmax(S + M) V with M = -inf off the edges; rows without edges give 0.

    logits: [H, N_dst, N_src], mask: [N_dst, N_src], v: [N_src, H, C] -> [N_dst, H, C]
    """
    s = logits.masked_fill(~mask, float("-inf"))
    att = torch.softmax(s, dim=-1).nan_to_num(0.0)  # empty rows: all -inf -> NaN -> 0
    return torch.einsum("hij,jhc->ihc", att, v), att


def make_qkv(n_src, n_dst, H, C, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_dst, H, C, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(n_src, H, C, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(n_src, H, C, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("n_src,n_dst", [(12, 12), (9, 5)])
@pytest.mark.parametrize("H", [1, 3])
def test_dot_product_matches_dense_masked_softmax(n_src, n_dst, H):
    C = 4
    ei, mask = unique_graph(n_src, n_dst, 0.3)
    q, k, v = make_qkv(n_src, n_dst, H, C)
    scale = 1 / math.sqrt(C)
    out, alpha = graph_attention(DotProductScore(q, k, None, scale), v, ei, n_dst,
                                 concat=False, backend="torch", return_attention=True)
    out = out  # [N_dst, C] (mean over heads)
    ref, att = dense_oracle(torch.einsum("ihc,jhc->hij", q, k) * scale, mask, v)
    torch.testing.assert_close(out, ref.mean(1))
    torch.testing.assert_close(alpha, att[:, ei[1], ei[0]].T)
    # gradients w.r.t. q, k, v agree with the oracle's
    w = torch.randn_like(out)
    g1 = torch.autograd.grad((out * w).sum(), (q, k, v))
    g2 = torch.autograd.grad((ref.mean(1) * w).sum(), (q, k, v))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("H", [1, 2])
def test_gat_matches_dense_masked_softmax(H):
    n_src = n_dst = 10
    ei, mask = unique_graph(n_src, n_dst, 0.35, seed=3)
    _, _, v = make_qkv(n_src, n_dst, H, 3)
    a_src = torch.randn(n_src, H, dtype=torch.float64, requires_grad=True)
    a_dst = torch.randn(n_dst, H, dtype=torch.float64, requires_grad=True)
    out = graph_attention(GATScore(a_src, a_dst, None, 0.2), v, ei, n_dst, backend="torch")
    logits = torch.nn.functional.leaky_relu(a_dst.T[:, :, None] + a_src.T[:, None, :], 0.2)
    ref, _ = dense_oracle(logits, mask, v)
    torch.testing.assert_close(out, ref.reshape(n_dst, -1))
    g1 = torch.autograd.grad(out.square().sum(), (a_src, a_dst, v))
    g2 = torch.autograd.grad(ref.square().sum(), (a_src, a_dst, v))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def scorers(n_src, n_dst, E, H, C, dtype=torch.float64, seed=0, edge=True):
    """One scorer of each kind, with leaf tensors that require grad."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    return {
        "gat": GATScore(r(n_src, H), r(n_dst, H), r(E, H) if edge else None, 0.2),
        "gatv2": GATv2Score(r(n_src, H, C), r(n_dst, H, C), r(E, H, C) if edge else None,
                            r(H, C), 0.2),
        "dot": DotProductScore(r(n_dst, H, C), r(n_src, H, C), r(E, H, C) if edge else None,
                               1 / math.sqrt(C)),
    }


def leaves(score):
    return [t for t in vars(score).values() if isinstance(t, torch.Tensor)]


# Triton's CPU interpreter makes gradcheck minutes long here; tests/test_triton.py
# gradchecks the kernels on smaller graphs.
@pytest.mark.parametrize("backend", [b for b in backends() if b != "triton" or torch.cuda.is_available()])
@pytest.mark.parametrize("kind", ["gat", "gatv2", "dot"])
def test_gradcheck_float64(kind, backend):
    n_src, n_dst, H, C = 6, 5, 2, 3
    ei = torch.cat([random_graph(n_src, 14, num_dst=n_dst, seed=1),
                    torch.tensor([[0, 0], [1, 1]])], dim=1)  # with a duplicate edge
    E = ei.size(1)
    score = scorers(n_src, n_dst, E, H, C)[kind]
    v = torch.randn(n_src, H, C, dtype=torch.float64, requires_grad=True)
    ve = torch.randn(E, H, C, dtype=torch.float64, requires_grad=True)
    names = [k for k, t in vars(score).items() if isinstance(t, torch.Tensor)]

    def f(v, ve, *ts):
        s = type(score)(**{**vars(score), **dict(zip(names, ts, strict=True))})
        return graph_attention(s, v, ei, n_dst, value_edge=ve, backend=backend)

    assert torch.autograd.gradcheck(f, (v, ve, *leaves(score)))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("kind", ["gat", "gatv2", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("graph", ["random", "bipartite", "hub", "empty", "isolated"])
def test_backend_matches_reference(backend, kind, dtype, graph):
    H, C = 3, 5
    n_src = n_dst = 40
    if graph == "random":
        ei = random_graph(n_src, 300, seed=2)
    elif graph == "bipartite":
        n_dst = 17
        ei = random_graph(n_src, 200, num_dst=n_dst, seed=3)
    elif graph == "hub":
        n_src = n_dst = 300
        ei = hub_graph(n_src, 3000)
    elif graph == "empty":
        ei = torch.empty(2, 0, dtype=torch.long)
    else:  # nodes 0..9 have no in-edges
        ei = random_graph(n_src, 200, seed=4)
        ei = ei[:, ei[1] >= 10]
    E = ei.size(1)
    score = scorers(n_src, n_dst, E, H, C, dtype=dtype)[kind]
    v = torch.randn(n_src, H, C, dtype=dtype, requires_grad=True)
    ve = torch.randn(E, H, C, dtype=dtype, requires_grad=True)
    ins = [v, ve, *leaves(score)]

    def run(b):
        out, alpha = graph_attention(score, v, ei, n_dst, value_edge=ve, backend=b,
                                     return_attention=True)
        grads = torch.autograd.grad((out * out.detach().sin()).sum(), ins, allow_unused=True)
        return out, alpha, grads

    ref, alpha_ref, g_ref = run("torch")
    out, alpha, g = run(backend)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(alpha, alpha_ref, **tol)
    for a, b in zip(g, g_ref, strict=True):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            torch.testing.assert_close(a, b, **tol)
    assert torch.isfinite(out).all()
    if graph == "isolated":
        assert out[:10].abs().max() == 0  # zero in-degree -> zero output


def test_segment_softmax_huge_logits_and_groups():
    index = torch.tensor([0, 0, 0, 2, 2, 4])
    score = torch.tensor([[1e4], [1e4 - 1], [-1e4], [3e38], [3e38], [-3e38]])
    alpha = segment_softmax(score, index, 5)
    assert torch.isfinite(alpha).all()
    torch.testing.assert_close(alpha[3:5, 0], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(alpha[5, 0], torch.tensor(1.0))
    sums = torch.zeros(5, 1).index_add_(0, index, alpha)
    torch.testing.assert_close(sums[[0, 2, 4]], torch.ones(3, 1))


@pytest.mark.parametrize("backend", backends())
def test_low_precision_rule(backend):
    """bf16/fp16: error vs an fp64 reference at most ~2x the plain PyTorch path's error."""
    n, H, C = 200, 2, 16
    ei = torch.cat([random_graph(n, 3000, seed=5), hub_graph(n, 2000)], dim=1)
    s64 = scorers(n, n, ei.size(1), H, C, seed=7)["dot"]
    v64 = torch.randn(n, H, C, dtype=torch.float64)
    exact = graph_attention(s64, v64, ei, n, backend="torch").detach()
    for dtype in (torch.bfloat16, torch.float16):
        s = DotProductScore(*(t.detach().to(dtype) for t in (s64.query, s64.key, s64.edge)),
                            s64.scale)
        v = v64.to(dtype)
        # the plain PyTorch computation in that dtype, no fp32 upcast anywhere
        e = (s.query[ei[1]] * (s.key[ei[0]] + s.edge)).sum(-1) * s.scale
        naive = torch.zeros(n, H, C, dtype=dtype).index_add_(
            0, ei[1], torch_geometric_softmax(e, ei[1], n).unsqueeze(-1) * v[ei[0]])
        err_naive = (naive.double().reshape(n, -1) - exact).abs().max()
        got = graph_attention(s, v, ei, n, backend=backend)
        assert got.dtype == dtype
        err = (got.double() - exact).abs().max()
        assert err <= 2 * err_naive, (dtype, err, err_naive)


def torch_geometric_softmax(e, index, n):
    from torch_geometric.utils import softmax

    return softmax(e, index, num_nodes=n)


@settings(max_examples=25, deadline=None)
@given(n_src=st.integers(1, 12), n_dst=st.integers(1, 12), E=st.integers(0, 60),
       H=st.integers(1, 3), seed=st.integers(0, 2**16), kind=st.sampled_from(["gat", "gatv2", "dot"]),
       scale=st.sampled_from([1.0, 1e4]))
def test_random_graphs_property(n_src, n_dst, E, H, seed, kind, scale):
    """Any graph (duplicates, isolated nodes, huge logits): finite output, weights
    summing to one over each destination's in-edges, zero rows for no in-edges,
    every backend equal to the reference."""
    ei = random_graph(n_src, E, num_dst=n_dst, seed=seed)
    score = scorers(n_src, n_dst, E, H, 4, dtype=torch.float32, seed=seed)[kind]
    for k, t in vars(score).items():
        if isinstance(t, torch.Tensor):
            setattr(score, k, t.detach() * scale)
    v = torch.randn(n_src, H, 4)
    out, alpha = graph_attention(score, v, ei, n_dst, backend="torch", return_attention=True)
    assert torch.isfinite(out).all() and torch.isfinite(alpha).all()
    sums = torch.zeros(n_dst, H).index_add_(0, ei[1], alpha)
    has_in = torch.zeros(n_dst, dtype=torch.bool)
    has_in[ei[1]] = True
    torch.testing.assert_close(sums[has_in], torch.ones_like(sums[has_in]))
    assert out[~has_in].abs().sum() == 0
    for b in backends():
        o2, a2 = graph_attention(score, v, ei, n_dst, backend=b, return_attention=True)
        torch.testing.assert_close(o2, out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a2, alpha, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", backends())
def test_permutation_equivariance(backend):
    """Relabelling the nodes permutes the output rows (and edge order is irrelevant)."""
    n, H, C = 30, 2, 4
    layer = gatlib.GATConv(8, C, heads=H, backend=backend)
    x = torch.randn(n, 8)
    ei = random_graph(n, 150, seed=9, self_loops=False)
    perm = torch.randperm(n)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)  # node i is called inv[i] after relabelling
    edge_perm = torch.randperm(ei.size(1))
    out = layer(x, ei)
    out_p = layer(x[perm], inv[ei][:, edge_perm])
    torch.testing.assert_close(out_p, out[perm], rtol=1e-5, atol=1e-6)


def test_dropout_only_in_training():
    n, H, C = 20, 2, 3
    ei = random_graph(n, 80, seed=1)
    s = scorers(n, n, ei.size(1), H, C, dtype=torch.float32)["gat"]
    v = torch.randn(n, H, C)
    base = graph_attention(s, v, ei, n, dropout=0.5, training=False)
    torch.testing.assert_close(graph_attention(s, v, ei, n), base)
    torch.manual_seed(0)
    dropped = graph_attention(s, v, ei, n, dropout=0.5, training=True)
    assert not torch.allclose(dropped, base)


def test_auto_backend_rule():
    """The measured rule (benchmarks/NOTES.md): the fused path on CPU; the
    reference on CUDA until the Triton kernels are measured on a GPU."""
    from gatlib._backend import _IMPLS, resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) is _IMPLS["fused"]
    assert resolve_backend("auto", torch.device("cuda")) is _IMPLS["torch"]
    assert resolve_backend("auto", torch.device("meta")) is _IMPLS["torch"]
