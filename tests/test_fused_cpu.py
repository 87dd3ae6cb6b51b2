"""The fused CPU kernel (gatlib._fused_cpu): gradcheck and gradgradcheck of its
autograd function, opcheck of its operators, dropout, the layers, and the point
of it: no [E, H, C] tensor saved for backward. (Its compiled row passes one by
one: test_fused_cpu_passes.py.)
(Agreement with the reference over graphs, dtypes and heads is in test_core.py.)"""
import pytest
import torch

import gatlib
from gatlib import _blocks
from gatlib import _fused_cpu as fc
from gatlib import _layout
from gatlib import graph_attention
from gatlib._plan import GraphPlan

from testing import (KINDS, LAYERS, OpCalls, hub_graph, leaves, make_score,
                     random_graph)


@pytest.fixture(params=["large", "tiny_blocks", "small_layout"])
def blocks(request, monkeypatch):
    """Run as a large graph runs ("large": int32 indices, the CSC built with the
    CSR, GAT recomputing its weights in backward, one edge block); with blocks of
    a few edges on two threads ("tiny_blocks"), so that destination rows straddle
    block boundaries and sources are shared between threads even on small graphs
    (the edge-feature terms run in blocks); and as a small graph runs
    ("small_layout": int64 indices, CSC derived when read, the weights saved).

    Returns the mode."""
    mode = request.param
    if mode != "small_layout":
        monkeypatch.setattr(_layout, "SMALL_EDGES", 0)
        monkeypatch.setattr(fc, "RECOMPUTE_MIN_ENTRIES", 0)  # GAT recomputes alpha
    if mode == "tiny_blocks":
        monkeypatch.setattr(_blocks, "CHUNK_BYTES", 200)  # 4-5 edges per block at H*C = 5 or 6, float64
        monkeypatch.setattr(_blocks, "MIN_PART_EDGES", 4)  # and rows split over two threads,
        threads = torch.get_num_threads()  # whatever the machine (or xdist) gave this process
        torch.set_num_threads(2)
        request.addfinalizer(lambda: torch.set_num_threads(threads))
    return mode


def small_graph(n_src=6, n_dst=5, seed=1):
    """Random edges plus a duplicate, with destination 0 isolated (no in-edges)."""
    ei = random_graph(n_src, 13, num_dst=n_dst, seed=seed)
    ei = ei[:, ei[1] != 0]
    return torch.cat([ei, ei[:, :1]], dim=1)


def fused_inputs(kind, edge, n_src=6, n_dst=5, H=2, C=2, p=0.0, seed=4, weighted=False):
    """The arguments of one fc._FusedAttention call in float64 (drop mask fixed) as
    ``(head, tensors, tail)``: ``(kind, scale, slope)``, the seven tensor inputs and
    ``(num_src, keep_lse, *layout)``; ``weighted``: the mask carries edge weights
    (explainer masks) and needs a gradient."""
    ei = small_graph(n_src, n_dst)
    plan = GraphPlan(ei, size=(n_src, n_dst))
    E = ei.size(1)
    s = make_score(kind, n_src, n_dst, E, H, C, edge=edge, seed=seed)
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n_src, H, C, dtype=torch.float64, generator=g, requires_grad=True)
    ve = torch.randn(E, H, C, dtype=torch.float64, generator=g, requires_grad=True) if edge else None
    head = (kind, float(s.scale), float(s.negative_slope))
    tail = (n_src, fc._recomputes_alpha(kind, E, H), *fc.layout_tensors(plan.layout()))
    return head, [*s.tensors(), v, ve, drop_input(E, H, p, weighted, g)], tail


def drop_input(E, H, p, weighted, g):
    """The ``drop [E, H]`` input of a fused call, or None: a dropout mask
    (``keep / (1 - p)``) for ``p > 0``, times edge weights if ``weighted``
    (explainer masks; then it needs a gradient)."""
    drop = None
    if p > 0:
        drop = (torch.rand(E, H, generator=g, dtype=torch.float64) >= p) / (1 - p)
    if weighted:
        w = torch.rand(E, 1, generator=g, dtype=torch.float64) + 0.1
        drop = (w if drop is None else drop * w).expand(E, H).contiguous().requires_grad_()
    return drop


# ---------------------------------------------------------------------------
# (b) gradcheck and gradgradcheck in float64
# ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("edge", [False, True], ids=["no_edge", "edge"])
@pytest.mark.parametrize("p", [0.0, 0.4], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("weighted", [False, True], ids=["", "edge_weights"])
def test_gradcheck(blocks, kind, edge, p, weighted):
    """Both outputs (out and alpha) differentiated, every input, the fused backward."""
    head, ins, tail = fused_inputs(kind, edge, p=p, weighted=weighted)
    diff = [i for i, t in enumerate(ins) if t is not None and t.requires_grad]

    def f(*ts):
        args = list(ins)
        for i, t in zip(diff, ts, strict=True):
            args[i] = t
        return fc._FusedAttention.apply(*head, *args, *tail)

    with gatlib.record_kernels() as log:
        assert torch.autograd.gradcheck(f, [ins[i] for i in diff])
    assert "fused" in log and "fused.backward" in log


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("edge", [False, True], ids=["no_edge", "edge"])
@pytest.mark.parametrize("weighted", [False, True], ids=["", "edge_weights"])
def test_gradgradcheck(kind, edge, weighted):
    """Second derivatives are exact: a backward with create_graph differentiates
    the reference's computation of the same call."""
    head, ins, tail = fused_inputs(kind, edge, p=0.3, weighted=weighted)
    diff = [i for i, t in enumerate(ins) if t is not None and t.requires_grad]

    def f(*ts):
        args = list(ins)
        for i, t in zip(diff, ts, strict=True):
            args[i] = t
        return fc._FusedAttention.apply(*head, *args, *tail)

    with gatlib.record_kernels() as log:
        assert torch.autograd.gradgradcheck(f, [ins[i] for i in diff])
    assert "fused.backward:reference" in log


@pytest.mark.slow
@pytest.mark.parametrize("kind, recompute", [("gat", False), ("gat", True), ("gatv2", False),
                                             ("dot", False)])  # (only GAT recomputes alpha)
@pytest.mark.parametrize("edge", [False, True], ids=["no_edge", "edge"])
def test_operators_pass_opcheck(kind, edge, recompute):
    """torch.library's own checks of the operators: schema (no input written, no
    output aliasing an input), fake implementations against the real ones, the
    registered autograd, and the operator under make_fx/AOT tracing."""
    head, ins, (num_src, _, *layout) = fused_inputs(kind, edge, p=0.3, weighted=True)
    args = (*head, *ins, layout, num_src, recompute)
    torch.library.opcheck(torch.ops.gatlib.fused_cpu_attention.default, args)
    out, alpha, lse = torch.ops.gatlib.fused_cpu_attention.default(*args)
    g_out, g_alpha = torch.randn_like(out), torch.randn_like(alpha)
    need = [t is not None and t.requires_grad for t in ins]
    bargs = (*head, g_out, g_alpha, *[None if t is None else t.detach() for t in ins],
             (lse if recompute else alpha).detach(), recompute, fc._kept_layout(layout, edge),
             num_src, need)
    torch.library.opcheck(torch.ops.gatlib.fused_cpu_attention_backward.default, bargs)
    lay = layout
    torch.library.opcheck(torch.ops.gatlib.csr_layout.default, (lay[1], lay[2], num_src, 5, True))


def test_second_order_through_a_layer_matches_the_reference():
    """A gradient penalty: d/dθ |d out / d x|² through GATConv, fused vs torch."""
    n = 20
    x = torch.randn(n, 6, dtype=torch.float64)
    ei = random_graph(n, 70, seed=3)
    grads = {}
    for backend in ("torch", "fused"):
        torch.manual_seed(0)
        conv = gatlib.GATConv(6, 3, heads=2, backend=backend).double()
        xx = x.clone().requires_grad_()
        with gatlib.record_kernels() as log:
            gx, = torch.autograd.grad(conv(xx, ei).square().sum(), xx, create_graph=True)
            gx.square().sum().backward()
        grads[backend] = [p.grad for p in conv.parameters()]
        assert log[0] == backend
    for a, b in zip(grads["fused"], grads["torch"], strict=True):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------
def test_dropout_is_active_and_reproducible():
    """Training with dropout changes the output, eval does not; the same seed gives
    the same output (the mask comes from torch's generator)."""
    n, H, C = 30, 2, 4
    ei = random_graph(n, 200, seed=1)
    s = make_score("dot", n, n, ei.size(1), H, C, dtype=torch.float32, edge=False, requires_grad=False)
    v = torch.randn(n, H, C)

    def call(**kw):
        return graph_attention(s, v, ei, n, backend="fused", **kw)

    base = call(dropout=0.5, training=False)
    torch.testing.assert_close(base, graph_attention(s, v, ei, n, backend="torch"))
    torch.manual_seed(3)
    d1 = call(dropout=0.5, training=True)
    torch.manual_seed(3)
    d2 = call(dropout=0.5, training=True)
    assert not torch.allclose(d1, base)
    torch.testing.assert_close(d1, d2)


# ---------------------------------------------------------------------------
# Through the layers
# ---------------------------------------------------------------------------
def build(layer, **kw):
    return getattr(gatlib, layer)(12, 5, heads=3, **kw)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("edge_dim", [None, 4], ids=["no_edge_attr", "edge_attr"])
@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
def test_layers_fused_equal_torch(blocks, layer, edge_dim, concat):
    n = 50
    ei = torch.cat([random_graph(n, 400, seed=3), hub_graph(n, 500)], dim=1)
    x = torch.randn(n, 12, requires_grad=True)
    ea = torch.randn(ei.size(1), 4) if edge_dim else None
    torch.manual_seed(0)
    ref = build(layer, edge_dim=edge_dim, concat=concat, backend="torch")
    fused = build(layer, edge_dim=edge_dim, concat=concat, backend="fused")
    fused.load_state_dict(ref.state_dict())
    results = []
    for m, name in ((ref, "torch"), (fused, "fused")):
        with gatlib.record_kernels() as log:
            out, (ei_out, alpha) = m(x, ei, ea, return_attention_weights=True)
            grads = torch.autograd.grad(out.square().sum(), [x, *m.parameters()])
        assert log[0] == name and (name == "torch" or "fused.backward" in log)
        results.append((out, alpha, ei_out, grads))
    (o1, a1, e1, g1), (o2, a2, e2, g2) = results
    torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a2, a1, rtol=1e-4, atol=1e-5)
    assert torch.equal(e1, e2)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# The point of the kernel: no [E, H, C] tensor saved for backward
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
@pytest.mark.parametrize("with_edge", [False, True], ids=["no_edge", "edge"])
def test_no_edge_sized_feature_tensor_saved(kind, with_edge):
    """E*H*C is 10x anything node-sized or [E, H]: no saved tensor reaches it, except
    (with edge features) the caller's own [E, H, C] inputs, saved by reference."""
    n, E, H, C = 40, 2000, 2, 10  # E*H*C = 40000; N*H*C = 800; E*H = 4000
    ei = random_graph(n, E, seed=11)
    s = make_score(kind, n, n, E, H, C, dtype=torch.float32, edge=with_edge)
    v = torch.randn(n, H, C, requires_grad=True)
    ve = torch.randn(E, H, C, requires_grad=True) if with_edge else None
    inputs = [t for t in [ve, *leaves(s)] if t is not None]

    def saved(backend):
        return saved_tensors_during(lambda: graph_attention(
            s, v, ei, n, value_edge=ve, dropout=0.2, training=True, backend=backend,
            return_attention=True)[0].sum().backward())

    limit = E * H * C // 2
    for t in saved("fused"):
        if t.numel() > limit:
            assert any(t.data_ptr() == i.data_ptr() for i in inputs), tuple(t.shape)
    # the test can see [E, H, C]: the reference saves gathered messages
    assert any(t.numel() >= E * H * C and not any(t.data_ptr() == i.data_ptr() for i in inputs)
               for t in saved("torch"))


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_save_no_edge_sized_feature_tensor(layer):
    n, E, H, C = 40, 2000, 3, 5  # E*H*C = 30000
    ei = random_graph(n, E, seed=12)
    x = torch.randn(n, 12, requires_grad=True)
    m = build(layer, backend="fused", dropout=0.1)
    saved = saved_tensors_during(lambda: m(x, ei).sum().backward())
    assert max(t.numel() for t in saved) < E * H * C // 2


def test_gat_keeps_lse_not_alpha_from_recompute_min_entries_on():
    """GAT saves its [N, H] log-normaliser instead of the [E, H] weights on graphs of
    RECOMPUTE_MIN_ENTRIES edges times heads or more (and saves the weights below),
    with the same result and gradients as the reference either way; the forward
    operator computes the log-normaliser only where backward reads it."""
    H, C, n = 4, 8, 300
    assert fc.RECOMPUTE_MIN_ENTRIES == 2**16
    for E, keeps_alpha in ((100, True), (17000, False)):  # (E + n loops) * H vs 2**16
        ei = random_graph(n, E, seed=5)
        x = torch.randn(n, 8, requires_grad=True)
        torch.manual_seed(0)
        fused = gatlib.GATConv(8, C, heads=H, backend="fused")
        ref = gatlib.GATConv(8, C, heads=H, backend="torch")
        ref.load_state_dict(fused.state_dict())
        outs = []
        saved = saved_tensors_during(lambda f=fused, x=x, ei=ei, outs=outs: outs.append(f(x, ei)))
        E_att = GraphPlan(ei, num_nodes=n).with_self_loops().num_edges
        edge_sized = [t for t in saved if t.dim() == 2 and t.shape == (E_att, H) and t.is_floating_point()]
        assert bool(edge_sized) == keeps_alpha, [tuple(t.shape) for t in saved]
        assert any(t.shape == (n, H) for t in saved)  # lse or the scores
        # the log-normaliser is computed only where backward reads it
        with OpCalls("gatlib.fused_cpu_attention.default") as calls:
            fused(x, ei)
        keep_lse, lse = calls[0][0][-1], calls[0][1][2]
        assert keep_lse != keeps_alpha and (lse.numel() == 0) == keeps_alpha
        want = ref(x, ei)
        torch.testing.assert_close(outs[0], want, rtol=1e-4, atol=1e-5)
        g1 = torch.autograd.grad(outs[0].square().sum(), [x, *fused.parameters()])
        g2 = torch.autograd.grad(want.square().sum(), [x, *ref.parameters()])
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_blocks_fixture_layouts_are_those_of_large_and_small_graphs(blocks):
    """The edge-block modes run on layouts as large graphs have them (int32, CSC
    built with the CSR); "small_layout" on a small graph's (int64, CSC when read)."""
    lay = GraphPlan(small_graph(), size=(6, 5)).layout()
    large = blocks != "small_layout"
    assert lay.src.dtype == (torch.int32 if large else torch.int64)
    assert (lay.csc is not None) == large


@pytest.mark.parametrize("layer", LAYERS)
def test_torch_func_grad_runs_the_fused_forward_and_the_reference_backward(layer):
    """torch.func.grad differentiates through the fused operator (its autograd
    function has a setup_context): the forward is fused, and the gradient, which
    torch.func asks to be differentiable, is the reference's — equal to an
    ordinary backward's."""
    n = 30
    ei = random_graph(n, 120, seed=2)
    conv = getattr(gatlib, layer)(4, 3, heads=2, backend="fused").double()
    x = torch.randn(n, 4, dtype=torch.float64)
    with gatlib.record_kernels() as log:
        g = torch.func.grad(lambda t: conv(t, ei).square().sum())(x)
    assert log == ["fused", "fused.backward:reference"]
    xx = x.clone().requires_grad_()
    with gatlib.record_kernels() as log:
        conv(xx, ei).square().sum().backward()
    assert log == ["fused", "fused.backward"]
    torch.testing.assert_close(g, xx.grad)


@pytest.mark.parametrize("edge_dim", [None, 3], ids=["no_edge_attr", "edge_attr"])
def test_backward_keeps_one_copy_of_the_edges(edge_dim, monkeypatch):
    """From forward to backward a layer keeps of its graph only what backward reads
    and cannot cheaply derive: the sources in CSR order and the CSC's edge
    positions (int32 on a large graph), the edge permutation only with edge
    features, and the offsets — not the destinations in either order, and no copy
    of the edge list, even given a raw edge_index (whose plan dies with the call)."""
    monkeypatch.setattr(_layout, "SMALL_EDGES", 0)  # the layout of a large graph: int32 indices
    n = 200
    ei = random_graph(n, 3000, seed=7, self_loops=False)
    E = ei.size(1)
    x = torch.randn(n, 8, requires_grad=True)
    ea = torch.randn(E, 3) if edge_dim else None
    conv = gatlib.GATConv(8, 4, heads=2, edge_dim=edge_dim, backend="fused")
    saved = saved_tensors_during(lambda: conv(x, ei, ea).sum().backward())
    per_edge = sorted(str(t.dtype) for t in {t.untyped_storage().data_ptr(): t for t in saved}.values()
                      if not t.is_floating_point() and t.numel() == E + n)
    assert per_edge == sorted(["torch.int32", "torch.int32"] + (["torch.int64"] if edge_dim else []))
