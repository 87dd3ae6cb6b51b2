"""The fused CPU backend (gatlib._fused_cpu): gradcheck of each autograd function,
the backend against the reference, the layers, and no ``[E, H, C]`` saved for backward."""
import math

import pytest
import torch

import gatlib
from gatlib import DotProductScore, GATScore, GATv2Score, graph_attention
from gatlib import _fused_cpu as fc

from testing import hub_graph, random_graph

KINDS = ["gat", "gatv2", "dot"]


@pytest.fixture(params=["one_block", "tiny_blocks"])
def blocks(request, monkeypatch):
    """Run with the default edge blocks and with blocks of a few edges, so that
    destination rows straddle block boundaries, split over threads even on small graphs."""
    if request.param == "tiny_blocks":
        monkeypatch.setattr(fc, "_CHUNK_BYTES", 200)  # 4-5 edges per block at H*C = 5 or 6, float64
        monkeypatch.setattr(fc, "_MIN_PART_EDGES", 8)
    return request.param


def make_scorer(kind, n_src, n_dst, E, H, C, dtype=torch.float64, seed=0, edge=True, scale=1.0):
    """A scorer of ``kind`` whose tensors are leaves that require grad."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    if kind == "gat":
        return GATScore(r(n_src, H), r(n_dst, H), r(E, H) if edge else None, 0.2)
    if kind == "gatv2":
        return GATv2Score(r(n_src, H, C), r(n_dst, H, C), r(E, H, C) if edge else None, r(H, C), 0.2)
    return DotProductScore(r(n_dst, H, C), r(n_src, H, C), r(E, H, C) if edge else None,
                           1 / math.sqrt(C))


def leaves(score):
    return [t for t in vars(score).values() if isinstance(t, torch.Tensor)]


def small_graph(n_src=6, n_dst=5, seed=1):
    """Random edges plus a duplicate, with destination 0 isolated (no in-edges)."""
    ei = random_graph(n_src, 13, num_dst=n_dst, seed=seed)
    ei = ei[:, ei[1] != 0]
    return torch.cat([ei, ei[:, :1]], dim=1)


# ---------------------------------------------------------------------------
# (b) gradcheck in float64 on every autograd function
# ---------------------------------------------------------------------------
def head_layout(ei, n_src, n_dst, H):
    return fc._head_layout(ei, n_src, n_dst, H)


@pytest.mark.parametrize("edge", [False, True])
def test_gradcheck_gat_score(blocks, edge):
    n_src, n_dst, H = 6, 5, 2
    ei = small_graph(n_src, n_dst)
    lay = head_layout(ei, n_src, n_dst, H).lay
    s = make_scorer("gat", n_src, n_dst, ei.size(1), H, 1, edge=edge)
    assert torch.autograd.gradcheck(lambda a, b, c: fc._GATEdgeScore.apply(a, b, c, lay, 0.2),
                                    (s.src, s.dst, s.edge))


@pytest.mark.parametrize("edge", [False, True])
def test_gradcheck_gatv2_score(blocks, edge):
    n_src, n_dst, H, C = 6, 5, 2, 2
    ei = small_graph(n_src, n_dst)
    lay = head_layout(ei, n_src, n_dst, H).lay
    s = make_scorer("gatv2", n_src, n_dst, ei.size(1), H, C, edge=edge)
    assert torch.autograd.gradcheck(
        lambda x, y, w, att: fc._GATv2EdgeScore.apply(x, y, w, att, lay, 0.2),
        (s.x_src, s.x_dst, s.edge, s.att))


@pytest.mark.parametrize("edge", [False, True])
def test_gradcheck_dot_score(blocks, edge):
    n_src, n_dst, H, C = 6, 5, 2, 2
    ei = small_graph(n_src, n_dst)
    hl = head_layout(ei, n_src, n_dst, H)
    s = make_scorer("dot", n_src, n_dst, ei.size(1), H, C, edge=edge)
    assert torch.autograd.gradcheck(
        lambda q, k, w: fc._DotEdgeScore.apply(q, k, w, hl, 0.5), (s.query, s.key, s.edge))


@pytest.mark.parametrize("edge", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.4])
def test_gradcheck_softmax_aggregate(blocks, edge, p):
    """Both outputs (out and alpha) differentiated; with dropout the mask is fixed by
    seeding, so forward and backward must use the same one for the check to pass."""
    n_src, n_dst, H, C = 6, 5, 2, 2
    ei = small_graph(n_src, n_dst)
    hl = head_layout(ei, n_src, n_dst, H)
    E = ei.size(1)
    g = torch.Generator().manual_seed(4)
    e = torch.randn(E, H, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(n_src, H, C, dtype=torch.float64, generator=g, requires_grad=True)
    u = torch.randn(E, H, C, dtype=torch.float64, generator=g, requires_grad=True) if edge else None

    def f(e, v, u):
        torch.manual_seed(0)
        return fc._SoftmaxAggregate.apply(e, v, u, hl, p)

    assert torch.autograd.gradcheck(f, (e, v, u))


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_end_to_end_with_dropout(kind):
    """All inputs through the backend entry point, dropout active, mask fixed by seeding."""
    n_src, n_dst, H, C = 6, 5, 2, 2
    ei = small_graph(n_src, n_dst)
    s = make_scorer(kind, n_src, n_dst, ei.size(1), H, C)
    v = torch.randn(n_src, H, C, dtype=torch.float64, requires_grad=True)
    ve = torch.randn(ei.size(1), H, C, dtype=torch.float64, requires_grad=True)
    names = [k for k, t in vars(s).items() if isinstance(t, torch.Tensor)]

    def f(v, ve, *ts):
        torch.manual_seed(0)
        sc = type(s)(**{**vars(s), **dict(zip(names, ts, strict=True))})
        out, alpha = fc.attention(sc, v, ei, n_dst, value_edge=ve, dropout=0.3, training=True,
                                  need_alpha=True)
        return out, alpha

    assert torch.autograd.gradcheck(f, (v, ve, *leaves(s)), fast_mode=True)


# ---------------------------------------------------------------------------
# (c) the fused backend against the reference
# ---------------------------------------------------------------------------
def graph_case(name):
    """(edge_index, n_src, n_dst, feature scale) of an edge case."""
    if name == "random":
        return random_graph(40, 300, seed=2), 40, 40, 1.0
    if name == "bipartite":
        return random_graph(40, 200, num_dst=17, seed=3), 40, 17, 1.0
    if name == "hub":  # node 0 has 3000 in-edges
        return hub_graph(300, 3000), 300, 300, 1.0
    if name == "empty":
        return torch.empty(2, 0, dtype=torch.long), 40, 40, 1.0
    if name == "isolated":  # nodes 0..9 have no in-edges, and no out-edges either
        ei = random_graph(40, 300, seed=4)
        return ei[:, (ei[1] >= 10) & (ei[0] >= 10)], 40, 40, 1.0
    if name == "duplicates":  # 3 nodes, 60 edges: more edges than cells in the matrix
        return random_graph(3, 60, seed=5), 3, 3, 1.0
    if name == "unsorted":  # every edge of a sorted graph, in reverse order
        ei = random_graph(30, 200, seed=6)
        return ei[:, ei[1].argsort(descending=True)], 30, 30, 1.0
    if name == "huge_logits":
        return random_graph(30, 200, seed=7), 30, 30, 1e4
    raise ValueError(name)


GRAPHS = ["random", "bipartite", "hub", "empty", "isolated", "duplicates", "unsorted", "huge_logits"]


def run_backend(backend, s, v, ve, ei, n_dst, ins, w):
    out, alpha = graph_attention(s, v, ei, n_dst, value_edge=ve, backend=backend,
                                 return_attention=True)
    # a loss through both outputs, so alpha's own gradient path is checked too
    loss = (out * w).sum() + (alpha * alpha.detach().cos()).sum()
    grads = torch.autograd.grad(loss, ins, allow_unused=True)
    return out, alpha, grads


# Default blocks: every combination. Tiny blocks (rows straddling block and
# thread boundaries) exercise the same code for any dtype and H: one of each.
REFERENCE_CASES = [
    (blocks, kind, dtype, H, graph)
    for blocks in ["one_block", "tiny_blocks"]
    for kind in KINDS
    for dtype in [torch.float32, torch.float64]
    for H in [1, 4]
    for graph in GRAPHS
    if blocks == "one_block" or (dtype == torch.float64 and H == 1)
]


@pytest.mark.parametrize(("blocks", "kind", "dtype", "H", "graph"), REFERENCE_CASES, indirect=["blocks"])
def test_matches_reference(blocks, kind, dtype, H, graph):
    ei, n_src, n_dst, scale = graph_case(graph)
    C, E = 5, ei.size(1)
    s = make_scorer(kind, n_src, n_dst, E, H, C, dtype=dtype, seed=H, scale=scale)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(n_src, H, C, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    ve = torch.randn(E, H, C, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(n_dst, H * C, generator=g, dtype=torch.float64).to(dtype)
    ins = [v, ve, *leaves(s)]
    ref, alpha_ref, g_ref = run_backend("torch", s, v, ve, ei, n_dst, ins, w)
    out, alpha, grads = run_backend("fused", s, v, ve, ei, n_dst, ins, w)
    assert out.dtype == ref.dtype and alpha.dtype == alpha_ref.dtype
    if dtype == torch.float32:
        # huge logits: scores ~1e8 agree to ~1e-7 relative, i.e. ~10 absolute
        tol = dict(rtol=1e-4, atol=1e-4) if scale == 1 else dict(rtol=1e-3, atol=1e-3)
    else:
        tol = dict(rtol=1e-7, atol=1e-9) if scale == 1 else dict(rtol=1e-7, atol=1e-6)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(alpha, alpha_ref, **tol)
    for name, a, b in zip(["v", "ve"] + [k for k, t in vars(s).items() if torch.is_tensor(t)],
                          grads, g_ref, strict=True):
        if b is None:
            assert a is None or a.abs().max() == 0, name
        else:
            bound = b.abs().max().item() if scale != 1 else 1.0
            torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * bound, msg=name)
    assert torch.isfinite(out).all()
    has_in = torch.zeros(n_dst, dtype=torch.bool)
    has_in[ei[1]] = True
    assert out.view(n_dst, -1)[~has_in].abs().sum() == 0  # zero in-degree -> zero


@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_rule(kind):
    """bfloat16/float16: the fused error (output and every gradient) vs a float64
    computation on the same rounded inputs is at most ~2x the error of the reference
    backend run in that dtype (as flash-attention's tests compare against an upcast
    reference: GATv2's gradients jump at the LeakyReLU kink, so a reference on the
    unrounded inputs would measure rounding of the inputs, not of the computation)."""
    n, H, C = 200, 2, 16
    ei = torch.cat([random_graph(n, 3000, seed=5), hub_graph(n, 2000)], dim=1)
    E = ei.size(1)
    s64 = make_scorer(kind, n, n, E, H, C, seed=7)
    g = torch.Generator().manual_seed(8)
    v64 = torch.randn(n, H, C, generator=g, dtype=torch.float64)
    ve64 = torch.randn(E, H, C, generator=g, dtype=torch.float64)
    w = torch.randn(n, H * C, generator=g, dtype=torch.float64)

    def cast(dtype):
        s = type(s64)(**{k: (t.detach().to(dtype).requires_grad_() if torch.is_tensor(t) else t)
                         for k, t in vars(s64).items()})
        return s, v64.to(dtype).requires_grad_(), ve64.to(dtype).requires_grad_()

    def run(backend, s, v, ve):
        out = graph_attention(s, v, ei, n, value_edge=ve, backend=backend)
        grads = torch.autograd.grad((out * w.to(out.dtype)).sum(), [v, ve, *leaves(s)])
        return [out.detach().double(), *[t.double() for t in grads]]

    for dtype in (torch.bfloat16, torch.float16):
        s, v, ve = cast(dtype)
        exact = run("torch", *(type(s)(**{k: (t.detach().double().requires_grad_()
                                              if torch.is_tensor(t) else t)
                                           for k, t in vars(s).items()}),
                               v.detach().double().requires_grad_(),
                               ve.detach().double().requires_grad_()))
        ref = run("torch", s, v, ve)
        got = run("fused", s, v, ve)
        for i, (x, r, ex) in enumerate(zip(got, ref, exact, strict=True)):
            err, err_ref = (x - ex).abs().max(), (r - ex).abs().max()
            assert err <= 2 * err_ref + 1e-6 * ex.abs().max(), (dtype, i, err, err_ref)


def test_dropout_is_active_and_consistent():
    """Training with dropout changes the output, eval does not; the same seed gives
    the same output (the mask comes from torch's generator)."""
    n, H, C = 30, 2, 4
    ei = random_graph(n, 200, seed=1)
    s = make_scorer("dot", n, n, ei.size(1), H, C, dtype=torch.float32, edge=False)
    v = torch.randn(n, H, C)
    kw = dict(value_edge=None, need_alpha=False)
    base = fc.attention(s, v, ei, n, dropout=0.5, training=False, **kw)[0]
    ref = graph_attention(s, v, ei, n, backend="torch").view(n, H, C)
    torch.testing.assert_close(base, ref)
    torch.manual_seed(3)
    d1 = fc.attention(s, v, ei, n, dropout=0.5, training=True, **kw)[0]
    torch.manual_seed(3)
    d2 = fc.attention(s, v, ei, n, dropout=0.5, training=True, **kw)[0]
    assert not torch.allclose(d1, base)
    torch.testing.assert_close(d1, d2)
    all_dropped = fc.attention(s, v, ei, n, dropout=1.0, training=True, **kw)[0]
    assert all_dropped.abs().max() == 0


def test_declines_unsupported_dtypes():
    n, H, C = 5, 1, 2
    ei = random_graph(n, 10)
    s = DotProductScore(torch.ones(n, H, C, dtype=torch.complex64),
                        torch.ones(n, H, C, dtype=torch.complex64), None, 1.0)
    assert fc.attention(s, torch.ones(n, H, C, dtype=torch.complex64), ei, n, value_edge=None,
                        dropout=0.0, training=False, need_alpha=False) is None


# ---------------------------------------------------------------------------
# Through the layers
# ---------------------------------------------------------------------------
LAYERS = {
    "gat": lambda **kw: gatlib.GATConv(12, 5, heads=3, **kw),
    "gatv2": lambda **kw: gatlib.GATv2Conv(12, 5, heads=3, **kw),
    "transformer": lambda **kw: gatlib.TransformerConv(12, 5, heads=3, **kw),
}


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("edge_dim", [None, 4])
@pytest.mark.parametrize("concat", [True, False])
def test_layers_fused_equal_torch(layer, edge_dim, concat):
    n = 50
    ei = torch.cat([random_graph(n, 400, seed=3), hub_graph(n, 500)], dim=1)
    x = torch.randn(n, 12, requires_grad=True)
    ea = torch.randn(ei.size(1), 4) if edge_dim else None
    torch.manual_seed(0)
    ref = LAYERS[layer](edge_dim=edge_dim, concat=concat, backend="torch")
    fused = LAYERS[layer](edge_dim=edge_dim, concat=concat, backend="fused")
    fused.load_state_dict(ref.state_dict())
    results = []
    for m in (ref, fused):
        out, (ei_out, alpha) = m(x, ei, ea, return_attention_weights=True)
        grads = torch.autograd.grad(out.square().sum(), [x, *m.parameters()])
        results.append((out, alpha, ei_out, grads))
    (o1, a1, e1, g1), (o2, a2, e2, g2) = results
    torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a2, a1, rtol=1e-4, atol=1e-5)
    assert torch.equal(e1, e2)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# The point of the backend: no [E, H, C] tensor saved for backward
# ---------------------------------------------------------------------------
def saved_tensors_during(fn):
    """Every tensor autograd saves for backward while ``fn()`` runs."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("with_edge", [False, True])
def test_no_edge_sized_feature_tensor_saved(kind, with_edge):
    """E*H*C is 10x anything node-sized or [E, H]: no saved tensor reaches it, except
    (with edge features) the caller's own [E, H, C] inputs, saved by reference."""
    n, E, H, C = 40, 2000, 2, 10  # E*H*C = 40000; N*H*C = 800; E*H = 4000
    ei = random_graph(n, E, seed=11)
    s = make_scorer(kind, n, n, E, H, C, dtype=torch.float32, edge=with_edge)
    v = torch.randn(n, H, C, requires_grad=True)
    ve = torch.randn(E, H, C, requires_grad=True) if with_edge else None
    inputs = [t for t in [ve, *leaves(s)] if t is not None]

    def run(backend):
        return saved_tensors_during(lambda: graph_attention(
            s, v, ei, n, value_edge=ve, dropout=0.2, training=True, backend=backend,
            return_attention=True)[0].sum().backward())

    limit = E * H * C // 2
    for t in run("fused"):
        if t.numel() > limit:
            assert any(t.data_ptr() == i.data_ptr() for i in inputs), tuple(t.shape)
    # the test can see [E, H, C]: the reference saves gathered messages
    assert any(t.numel() >= E * H * C and not any(t.data_ptr() == i.data_ptr() for i in inputs)
               for t in run("torch"))


@pytest.mark.parametrize("layer", list(LAYERS))
def test_layers_save_no_edge_sized_feature_tensor(layer):
    n, E, H, C = 40, 2000, 3, 5  # E*H*C = 30000
    ei = random_graph(n, E, seed=12)
    x = torch.randn(n, 12, requires_grad=True)
    m = LAYERS[layer](backend="fused", dropout=0.1)
    saved = saved_tensors_during(lambda: m(x, ei).sum().backward())
    assert max(t.numel() for t in saved) < E * H * C // 2
