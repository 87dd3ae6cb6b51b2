"""Sparse adjacencies as ``edge_index``, as PyG takes them: ``adj_t`` of shape
``[N_dst, N_src]`` in torch.sparse COO, CSR or CSC layout or as a
``torch_sparse.SparseTensor``. Each gives PyG's layer's outputs, gradients and
returned attention weights, and gatlib's own ``[2, E]`` results; what PyG cannot
do (or does differently from its other inputs) raises a clear error."""
import itertools

import pytest
import torch
import torch_geometric.nn as pyg
from torch_geometric.typing import WITH_TORCH_SPARSE, SparseTensor
from torch_geometric.utils import (to_edge_index, to_torch_coo_tensor, to_torch_csc_tensor,
                                   to_torch_csr_tensor)

import gatlib
from gatlib import GraphPlan
from gatlib._layout import build_layout

from testing import LAYERS, count_sorts, kernels

requires_torch_sparse = pytest.mark.skipif(not WITH_TORCH_SPARSE, reason="torch_sparse is not installed")

N_SRC, N_DST, F_SRC, F_DST, EDGE_DIM = 9, 6, 5, 3, 2
FORMATS = ["coo", "coo_t", "csr", "csc", pytest.param("sparse_tensor", marks=requires_torch_sparse)]
TORCH_FORMATS = ["coo", "coo_t", "csr", "csc"]
BACKENDS = kernels(exclude=("scatter", "triton"))  # the reference and the fused CPU kernel


def graph(n_src, n_dst, seed=0):
    """A ``[2, E]`` edge list without repeated edges (a sparse matrix has none), with
    a few self-loops (which layers adding loops drop)."""
    g = torch.Generator().manual_seed(seed)
    cells = torch.randperm(n_src * n_dst, generator=g)[: 3 * n_dst]
    ei = torch.stack([cells % n_src, cells // n_src])
    loops = torch.tensor([[1, 2], [1, 2]])
    ei = torch.cat([ei[:, ei[0] != ei[1]], loops], dim=1)
    return ei[:, torch.randperm(ei.size(1), generator=g)]


def adjacency(fmt, ei, n_src, n_dst, value=None):
    """PyG's ``adj_t`` ``[n_dst, n_src]`` of the edges ``ei`` (``value``: per edge of
    ``ei``), built as PyG's tests and docs build it."""
    if fmt == "coo":  # coalesced: sorted by destination
        return to_torch_coo_tensor(ei.flip(0), value, (n_dst, n_src))
    if fmt == "coo_t":  # the transpose of a coalesced COO: sorted by source, not flagged coalesced
        return to_torch_coo_tensor(ei, value, (n_src, n_dst)).transpose(0, 1)
    hybrid = value is not None and value.dim() > 1  # torch cannot transpose those compressed
    if fmt == "csr" and hybrid:
        return to_torch_csr_tensor(ei.flip(0), value, (n_dst, n_src))
    if fmt == "csr":  # PyG's tests: to_torch_csc_tensor(...).t() is a CSR
        return to_torch_csc_tensor(ei, value, (n_src, n_dst)).t()
    if fmt == "csc" and hybrid:
        return to_torch_csc_tensor(ei.flip(0), value, (n_dst, n_src))
    if fmt == "csc":
        return to_torch_csr_tensor(ei, value, (n_src, n_dst)).t()
    assert fmt == "sparse_tensor"
    return SparseTensor.from_edge_index(ei, value, sparse_sizes=(n_src, n_dst)).t()


def stored(adj):
    """``([2, E] (source, destination), values)`` of an adjacency, in the order it
    stores its entries (PyG's to_edge_index order; on a copy, which it may mark
    coalesced)."""
    if isinstance(adj, SparseTensor):
        row, col, value = adj.coo()
        return torch.stack([col, row]), value
    idx, value = to_edge_index(adj.clone())
    return idx.flip(0), value


def inputs(bipartite, seed=0):
    """``(x, in_channels, n_src, n_dst)``; ``"src-only"`` is GATConv's ``(x_src, None)``."""
    g = torch.Generator().manual_seed(seed)
    if bipartite == "none":
        return torch.randn(N_SRC, F_SRC, generator=g), F_SRC, N_SRC, N_SRC
    if bipartite == "pair":
        x = (torch.randn(N_SRC, F_SRC, generator=g), torch.randn(N_DST, F_DST, generator=g))
        return x, (F_SRC, F_DST), N_SRC, N_DST
    return (torch.randn(N_SRC, F_SRC, generator=g), None), F_SRC, N_SRC, N_DST


def call(layer, x, graph, edge_attr=None, **kw):
    """``(out, attention, gradients of x, edge_attr and every parameter, kernel log)``."""
    xs = [t.clone().requires_grad_() for t in (x if isinstance(x, tuple) else (x,)) if t is not None]
    xin = (xs[0], xs[1] if len(xs) > 1 else None) if isinstance(x, tuple) else xs[0]
    ea = None if edge_attr is None else edge_attr.clone().requires_grad_()
    with gatlib.record_kernels() as log:
        out, att = layer(xin, graph, ea, return_attention_weights=True, **kw)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        leaves = xs + ([ea] if ea is not None else []) + [p for _, p in sorted(layer.named_parameters())]
        grads = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True)
    return out, att, grads, log


def assert_close_grads(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        if a is None or b is None:  # unused on one side: a zero gradient on the other
            assert a is None and b is None or (a if a is not None else b).abs().max() == 0
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def compressed(adj):
    """The index tensors of a torch.sparse adjacency, in its layout."""
    if adj.layout == torch.sparse_csr:
        return adj.crow_indices(), adj.col_indices()
    if adj.layout == torch.sparse_csc:
        return adj.ccol_indices(), adj.row_indices()
    return (adj._indices(),)


def assert_same_attention(ours, theirs):
    """Our returned attention is PyG's: a SparseTensor holding alpha, or
    ``(adjacency, alpha)`` with the adjacency in the same layout, entries and
    values (alpha; for TransformerConv the input's own)."""
    if isinstance(theirs, SparseTensor):
        assert isinstance(ours, SparseTensor) and ours.sizes() == theirs.sizes()
        (r1, c1, v1), (r2, c2, v2) = ours.coo(), theirs.coo()
        assert torch.equal(r1, r2) and torch.equal(c1, c2)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-6)
        return
    (adj1, a1), (adj2, a2) = ours, theirs
    assert adj1.layout == adj2.layout and adj1.shape == adj2.shape
    for i1, i2 in zip(compressed(adj1), compressed(adj2), strict=True):
        assert torch.equal(i1, i2)
    if adj1.layout == torch.sparse_coo:
        assert adj1.is_coalesced() == adj2.is_coalesced()
    torch.testing.assert_close(adj1._values() if adj1.layout == torch.sparse_coo else adj1.values(),
                               adj2._values() if adj2.layout == torch.sparse_coo else adj2.values(),
                               rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(a1, a2, rtol=1e-4, atol=1e-6)


def dense_attention(att, n_src, n_dst, alpha_values=True):
    """``[n_dst, n_src, H]``: the attention weights whatever form they came back in
    (``alpha_values``: a returned torch.sparse adjacency holds them, in its order;
    else the alpha beside it is in the adjacency's stored order)."""
    if isinstance(att, SparseTensor):
        row, col, alpha = att.coo()
    elif att[0].layout == torch.strided:  # ([2, E] edge_index, alpha)
        (col, row), alpha = att
    else:
        (col, row), values = stored(att[0])
        alpha = values if alpha_values else att[1]
    out = torch.zeros(n_dst, n_src, alpha.size(-1), dtype=alpha.dtype)
    return out.index_put_((row, col), alpha.detach(), accumulate=True)


def layer_pair(layer, in_ch, backend="auto", **kw):
    torch.manual_seed(0)
    theirs = getattr(pyg, layer)(in_ch, 4, heads=2, **kw).eval()
    ours = getattr(gatlib, layer)(in_ch, 4, heads=2, backend=backend, **kw).eval()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def pyg_takes(fmt, layer, loops):
    """Whether PyG 2.8.1's layer takes the adjacency: never a CSC (the collect it
    generates raises "Received invalid layout", remove_self_loops "Unexpected sparse
    tensor layout"), and an uncoalesced COO only when self-loops are added (it is
    rebuilt coalesced then; otherwise reading its indices() raises)."""
    if fmt == "csc":
        return False
    return fmt != "coo_t" or (loops and layer != "TransformerConv")


def assert_pyg_refuses(theirs, x, adj, *args):
    with pytest.raises((ValueError, RuntimeError), match="layout|uncoalesced"):
        theirs(x, adj, *args)


CASES = [c for c in itertools.product(LAYERS, ["none", "pair", "src-only"], [True, False])
         if not (c[1] == "src-only" and c[0] != "GATConv")  # only GATConv takes (x_src, None)
         and not (c[2] is False and c[0] == "TransformerConv")]  # it adds no self-loops anyway


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layer,bipartite,loops", CASES)
def test_parity(layer, bipartite, loops, fmt, backend):
    """PyG's layer given the same adjacency: same output, gradients and returned
    attention; gatlib given the [2, E] edge list: the same too. The kernel asked
    for runs, backward included."""
    x, in_ch, n_src, n_dst = inputs(bipartite)
    ei = graph(n_src, n_dst)
    kw = {} if layer == "TransformerConv" else {"add_self_loops": loops}
    ours, theirs = layer_pair(layer, in_ch, backend, **kw)

    out, att, grads, log = call(ours, x, adjacency(fmt, ei, n_src, n_dst))
    assert log[:1] == [backend], log
    if backend == "fused":
        assert "fused.backward" in log, log
    holds_alpha = layer != "TransformerConv"

    # The [2, E] edge list in the adjacency's order: the same graph for gatlib.
    edges, _ = stored(adjacency(fmt, ei, n_src, n_dst))
    size = {"size": (n_src, n_dst)} if bipartite == "src-only" else {}
    out3, att3, grads3, _ = call(ours, x, edges, **size)
    torch.testing.assert_close(out, out3, rtol=1e-5, atol=1e-6)
    assert_close_grads(grads, grads3)
    torch.testing.assert_close(dense_attention(att, n_src, n_dst, holds_alpha),
                               dense_attention(att3, n_src, n_dst))

    if pyg_takes(fmt, layer, loops):
        out2, att2, grads2, _ = call(theirs, x, adjacency(fmt, ei, n_src, n_dst))
        assert_same_attention(att, att2)
    else:  # gatlib takes what PyG refuses: PyG's result on the same edges
        assert_pyg_refuses(theirs, x, adjacency(fmt, ei, n_src, n_dst))
        out2, att2, grads2, _ = call(theirs, x, edges, **size)
        torch.testing.assert_close(dense_attention(att, n_src, n_dst, holds_alpha),
                                   dense_attention(att2, n_src, n_dst), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out, out2, rtol=1e-4, atol=1e-5)
    assert_close_grads(grads, grads2)


def test_pygs_own_test():
    """The checks of PyG's test_gat_conv: 4 nodes, 4 edges, 3 self-loops added."""
    x = torch.randn(4, 8)
    ei = torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1]])
    conv = gatlib.GATConv(8, 32, heads=2)
    out = conv(x, ei)
    result = conv(x, to_torch_csc_tensor(ei, size=(4, 4)).t(), return_attention_weights=True)
    torch.testing.assert_close(result[0], out)
    assert result[1][0].size() == torch.Size([4, 4, 2]) and result[1][0]._nnz() == 7
    if WITH_TORCH_SPARSE:
        result = conv(x, SparseTensor.from_edge_index(ei, sparse_sizes=(4, 4)).t(),
                      return_attention_weights=True)
        torch.testing.assert_close(result[0], out)
        assert result[1].sizes() == [4, 4, 2] and result[1].nnz() == 7


# --- values and edge features ------------------------------------------------------
@pytest.mark.parametrize("fmt", TORCH_FORMATS)
@pytest.mark.parametrize("layer,loops,fill", [("GATConv", True, "mean"), ("GATConv", True, 0.5),
                                              ("GATConv", False, "mean"), ("GATv2Conv", True, "max"),
                                              ("GATv2Conv", False, "mean"), ("TransformerConv", False, None)])
def test_hybrid_values_are_the_edge_features(layer, loops, fill, fmt):
    """A torch.sparse adjacency with [nnz, D] values: PyG takes them as edge_attr
    (self-loops get fill_value), and so does gatlib — PyG's output and gradients
    (PyG given them as a CSR: it takes no CSC, and no return_attention_weights
    with such values), and gatlib's own result for the [2, E] edge list with those
    rows as edge_attr."""
    x, in_ch, n_src, n_dst = inputs("none")
    ei = graph(n_src, n_dst)
    feats = torch.randn(ei.size(1), EDGE_DIM, generator=torch.Generator().manual_seed(3))
    kw = dict(edge_dim=EDGE_DIM)
    if layer != "TransformerConv":
        kw.update(add_self_loops=loops, fill_value=fill)
    ours, theirs = layer_pair(layer, in_ch, **kw)
    with_grad = fmt != "coo_t"  # an uncoalesced COO: no gradient reaches its values (nor in PyG)

    def run(layer_, fmt_, **kw):
        v = feats.clone().requires_grad_(with_grad)
        res = layer_(x, adjacency(fmt_, ei, n_src, n_dst, v), **kw)
        out = res[0] if kw else res
        return res, torch.autograd.grad(out.square().sum(), v)[0] if with_grad else torch.ones(1)

    if not with_grad:
        v = feats.clone().requires_grad_()
        with pytest.raises(ValueError, match="uncoalesced COO tensor whose values are the edge features"):
            ours(x, adjacency(fmt, ei, n_src, n_dst, v))
    (out, att), grad = run(ours, fmt, return_attention_weights=True)
    out2, grad2 = run(theirs, "csr")
    torch.testing.assert_close(out, out2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, grad2, rtol=1e-4, atol=1e-5)
    assert not with_grad or grad.abs().sum() > 0

    holds_alpha = layer != "TransformerConv"
    assert att[0].layout == adjacency(fmt, ei, n_src, n_dst).layout
    assert att[0].shape == ((n_dst, n_src, 2) if holds_alpha else (n_dst, n_src, EDGE_DIM))
    edges, values = stored(adjacency(fmt, ei, n_src, n_dst, feats))
    out3, att3 = ours(x, edges, values, return_attention_weights=True)
    torch.testing.assert_close(out3, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dense_attention(att, n_src, n_dst, holds_alpha), dense_attention(att3, n_src, n_dst))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layer", LAYERS)
def test_explicit_edge_attr_without_self_loops(layer, fmt):
    """edge_attr next to an adjacency: one row per stored entry, in stored order (PyG
    uses it as it is; the adjacency's 1-D values are weights, not features)."""
    x, in_ch, n_src, n_dst = inputs("pair")
    ei = graph(n_src, n_dst)
    kw = dict(edge_dim=EDGE_DIM) if layer == "TransformerConv" else dict(edge_dim=EDGE_DIM, add_self_loops=False)
    ours, theirs = layer_pair(layer, in_ch, **kw)
    ea = torch.randn(ei.size(1), EDGE_DIM, generator=torch.Generator().manual_seed(4))
    weights = torch.rand(ei.size(1))
    out, att, grads, _ = call(ours, x, adjacency(fmt, ei, n_src, n_dst, weights), ea)
    holds_alpha = layer != "TransformerConv"
    if pyg_takes(fmt, layer, loops=False):
        out2, att2, grads2, _ = call(theirs, x, adjacency(fmt, ei, n_src, n_dst, weights), ea)
        assert_same_attention(att, att2)
    else:
        assert_pyg_refuses(theirs, x, adjacency(fmt, ei, n_src, n_dst, weights), ea)
        out2, att2, grads2, _ = call(theirs, x, stored(adjacency(fmt, ei, n_src, n_dst))[0], ea)
        torch.testing.assert_close(dense_attention(att, n_src, n_dst, holds_alpha),
                                   dense_attention(att2, n_src, n_dst), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out, out2, rtol=1e-4, atol=1e-5)
    assert_close_grads(grads, grads2)


@requires_torch_sparse
@pytest.mark.parametrize("layer", LAYERS)
def test_sparse_tensor_values_are_the_edge_features(layer):
    """A SparseTensor's [nnz, D] values are its edge_attr, in PyG and in gatlib."""
    x, in_ch, n_src, n_dst = inputs("none")
    ei = graph(n_src, n_dst)
    value = torch.randn(ei.size(1), EDGE_DIM, generator=torch.Generator().manual_seed(5))
    kw = {} if layer == "TransformerConv" else {"add_self_loops": False}
    ours, theirs = layer_pair(layer, in_ch, edge_dim=EDGE_DIM, **kw)
    out, att, grads, _ = call(ours, x, adjacency("sparse_tensor", ei, n_src, n_dst, value))
    out2, att2, grads2, _ = call(theirs, x, adjacency("sparse_tensor", ei, n_src, n_dst, value))
    torch.testing.assert_close(out, out2, rtol=1e-4, atol=1e-5)
    assert_close_grads(grads, grads2)
    assert_same_attention(att, att2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layer", LAYERS)
def test_edge_weights_are_ignored(layer, fmt):
    """1-D values (edge weights) do not change attention, in PyG and in gatlib."""
    x, in_ch, n_src, n_dst = inputs("none")
    ei = graph(n_src, n_dst)
    ours, theirs = layer_pair(layer, in_ch)
    weights = torch.rand(ei.size(1)) + 0.5
    weighted = ours(x, adjacency(fmt, ei, n_src, n_dst, weights))
    torch.testing.assert_close(weighted, ours(x, adjacency(fmt, ei, n_src, n_dst)))
    if pyg_takes(fmt, layer, loops=True):
        torch.testing.assert_close(weighted, theirs(x, adjacency(fmt, ei, n_src, n_dst, weights)),
                                   rtol=1e-4, atol=1e-5)


# --- what PyG refuses, or does differently from its other inputs --------------------------
@requires_torch_sparse
@pytest.mark.parametrize("given", ["features", "weights", "nothing", "edge_attr"])
@pytest.mark.parametrize("layer,bipartite", [("GATConv", "none"), ("GATConv", "pair"),
                                             ("GATConv", "src-only"), ("GATv2Conv", "none"),
                                             ("GATv2Conv", "pair")])
def test_sparse_tensor_edge_features_with_self_loops_raise(layer, bipartite, given):
    """PyG raises NotImplementedError on a SparseTensor with edge_dim and self-loops,
    whatever the edge features; gatlib's refusal is caught as that and as the
    ValueError of its other refusals."""
    x, in_ch, n_src, n_dst = inputs(bipartite)
    ei = graph(n_src, n_dst)
    value = {"features": torch.randn(ei.size(1), EDGE_DIM),
             "weights": torch.rand(ei.size(1))}.get(given)
    ea = torch.randn(ei.size(1), EDGE_DIM) if given == "edge_attr" else None
    ours, theirs = layer_pair(layer, in_ch, edge_dim=EDGE_DIM)
    with pytest.raises(NotImplementedError):
        theirs(x, adjacency("sparse_tensor", ei, n_src, n_dst, value), ea)
    match = r"edge_index is a SparseTensor.*edge_dim.*add_self_loops=True"
    for caught in (NotImplementedError, ValueError, gatlib.UnsupportedInputError):
        with pytest.raises(caught, match=match):
            ours(x, adjacency("sparse_tensor", ei, n_src, n_dst, value), ea)


@pytest.mark.parametrize("fmt", TORCH_FORMATS)
@pytest.mark.parametrize("layer", ["GATConv", "GATv2Conv"])
def test_edge_attr_with_a_torch_sparse_adjacency_and_self_loops_raises(layer, fmt):
    x, in_ch, n_src, n_dst = inputs("none")
    ei = graph(n_src, n_dst)
    ours, theirs = layer_pair(layer, in_ch, edge_dim=EDGE_DIM)
    ea = torch.randn(ei.size(1), EDGE_DIM)
    with pytest.raises((AssertionError, ValueError)):  # PyG: assert edge_attr is None
        theirs(x, adjacency(fmt, ei, n_src, n_dst), ea)
    with pytest.raises(ValueError, match="edge_attr cannot be combined with a torch.sparse edge_index"):
        ours(x, adjacency(fmt, ei, n_src, n_dst), ea)


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layer", LAYERS)
def test_missing_edge_features_raise(layer, fmt, weights):
    """edge_dim set, no edge_attr and no [nnz, D] values: PyG's GAT layers drop the
    edge term (its TransformerConv asserts); gatlib says edge_attr is required."""
    x, in_ch, n_src, n_dst = inputs("none")
    ei = graph(n_src, n_dst)
    kw = {} if layer == "TransformerConv" else {"add_self_loops": False}
    ours, theirs = layer_pair(layer, in_ch, edge_dim=1, **kw)
    value = torch.rand(ei.size(1)) if weights else None
    with pytest.raises(ValueError, match=r"edge_attr is required.*edge_index \(a sparse adjacency\)"):
        ours(x, adjacency(fmt, ei, n_src, n_dst, value))
    if layer != "TransformerConv" and pyg_takes(fmt, layer, loops=False):  # PyG: no edge term
        edges = stored(adjacency(fmt, ei, n_src, n_dst))[0]
        torch.testing.assert_close(theirs(x, adjacency(fmt, ei, n_src, n_dst, value)),
                                   ours(x, edges, torch.zeros(edges.size(1), 1)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layer", LAYERS)
def test_edge_features_without_edge_dim_raise(layer, fmt):
    x, in_ch, n_src, n_dst = inputs("none")
    ei = graph(n_src, n_dst)
    ours = getattr(gatlib, layer)(in_ch, 4)
    with pytest.raises(ValueError, match=r"edge_index's values have shape \(\d+, 2\).*edge_dim=None"):
        ours(x, adjacency(fmt, ei, n_src, n_dst, torch.randn(ei.size(1), 2)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_edge_features_of_the_wrong_width_raise(fmt):
    x, in_ch, n_src, n_dst = inputs("none")
    ei = graph(n_src, n_dst)
    ours = gatlib.TransformerConv(in_ch, 4, edge_dim=EDGE_DIM + 1)
    with pytest.raises(ValueError, match="edge_index's values are the edge features.*edge_dim=3"):
        ours(x, adjacency(fmt, ei, n_src, n_dst, torch.randn(ei.size(1), EDGE_DIM)))


@pytest.mark.parametrize("layer", ["GATConv", "GATv2Conv"])
def test_repeated_entries(layer):
    """A COO with a repeated entry: PyG merges it into one edge when it adds
    self-loops, and gatlib refuses; without self-loops both keep every entry."""
    x, in_ch, n_src, n_dst = inputs("none")
    ei = torch.cat([graph(n_src, n_dst), torch.tensor([[0], [3]]), torch.tensor([[0], [3]])], dim=1)

    def adj():
        return torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.size(1)), (n_dst, n_src))

    assert not adj().is_coalesced()
    ours, theirs = layer_pair(layer, in_ch)
    with pytest.raises(ValueError, match="repeated entries.*add_self_loops=True"):
        ours(x, adj())
    torch.testing.assert_close(theirs(x, adj()), ours(x, adj().coalesce()), rtol=1e-4, atol=1e-5)
    ours, theirs = layer_pair(layer, in_ch, add_self_loops=False)
    out, att, grads, _ = call(ours, x, adj())
    out2, att2, grads2, _ = call(theirs, x, ei)  # (PyG reads no uncoalesced COO without loops)
    torch.testing.assert_close(out, out2, rtol=1e-4, atol=1e-5)
    assert_close_grads(grads, grads2)
    torch.testing.assert_close(att[1], att2[1], rtol=1e-4, atol=1e-6)


# --- bad input ------------------------------------------------------------------------
def csr(crow, col, size):
    return torch.sparse_csr_tensor(torch.tensor(crow), torch.tensor(col), torch.ones(len(col)), size)


# Some of these break torch's sparse invariants on purpose (gatlib's own checks are
# under test): built with torch's checks explicitly off, as they are by default.
with torch.sparse.check_sparse_tensor_invariants(enable=False):
    BAD = [
        (torch.sparse_coo_tensor(torch.zeros(3, 2, dtype=torch.long), torch.ones(2), (6, 6, 6)),
         ValueError, r"edge_index must be a 2-D sparse adjacency.*3 sparse"),
        (torch.eye(6).expand(2, 6, 6).to_sparse_csr(), ValueError, r"edge_index must be a 2-D sparse adjacency"),
        (torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.ones(1), (5, 6)),
         ValueError, r"edge_index is a sparse adjacency of shape \[5, 6\].*6 destination nodes"),
        (torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.ones(1), (6, 7)),
         ValueError, r"edge_index is a sparse adjacency of shape \[6, 7\].*6 source nodes"),
        (csr([0, 1, 1, 1, 1, 1, 2], [0, 7], (6, 6)), IndexError,
         r"edge_index's column \(source\) indices contains index 7, out of range for 6 source"),
        (torch.sparse_csc_tensor(torch.tensor([0, 1, 1, 1, 1, 1, 1]), torch.tensor([6]), torch.ones(1), (6, 6)),
         IndexError, r"edge_index's row \(destination\) indices contains index 6"),
        (torch.sparse_coo_tensor(torch.tensor([[0], [9]]), torch.ones(1), (6, 6), check_invariants=False),
         IndexError, r"edge_index's column \(source\) indices contains index 9"),
        (torch.sparse_coo_tensor(torch.tensor([[-1], [0]]), torch.ones(1), (6, 6), check_invariants=False),
         IndexError, r"edge_index contains a negative index"),
        (csr([0, 2, 1, 1, 1, 1, 2], [0, 1], (6, 6)), ValueError,
         r"edge_index's crow_indices must run from 0 to the number of entries \(2\) without decreasing"),
        (csr([0, 1, 1, 1, 1, 1, 3], [0, 1], (6, 6)), ValueError, r"edge_index's crow_indices must run from 0"),
        (torch.eye(6), TypeError, r"edge_index must have dtype torch.int64"),  # a dense float adjacency
        (torch.eye(6).to_sparse_bsr((2, 2)), TypeError, r"edge_index must be a dense .* COO, CSR or CSC"),
    ]


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("bad,exc,match", BAD)
def test_bad_adjacency(layer, bad, exc, match):
    with pytest.raises(exc, match=match):
        getattr(gatlib, layer)(4, 3, heads=2)(torch.randn(6, 4), bad)


def test_bad_adjacency_in_a_plan():
    adj = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.ones(1), (5, 6))
    with pytest.raises(ValueError, match=r"shape \[5, 6\].*6 destination nodes"):
        GraphPlan(adj, num_nodes=6)
    with pytest.raises(ValueError, match="edge_index is a GraphPlan of a graph with 6 source and 5"):
        gatlib.GATConv(4, 3)(torch.randn(6, 4), GraphPlan(adj))


def test_size_must_agree_with_the_adjacency():
    x = torch.randn(N_SRC, F_SRC)
    adj = adjacency("csr", graph(N_SRC, N_DST), N_SRC, N_DST)
    conv = gatlib.GATConv(F_SRC, 4)
    torch.testing.assert_close(conv((x, None), adj, size=(N_SRC, N_DST)), conv((x, None), adj))
    with pytest.raises(ValueError, match=r"shape \[6, 9\].*7 destination nodes"):
        conv((x, None), adj, size=(N_SRC, N_DST + 1))


@pytest.mark.parametrize("fmt", ["csr", "csc"])
def test_int32_indices(fmt):
    x, in_ch, n_src, n_dst = inputs("none")
    adj = adjacency(fmt, graph(n_src, n_dst), n_src, n_dst)
    idx = compressed(adj)
    make = torch.sparse_csr_tensor if fmt == "csr" else torch.sparse_csc_tensor
    adj32 = make(idx[0].int(), idx[1].int(), adj.values(), adj.shape)
    conv = gatlib.GATConv(in_ch, 4, heads=2)
    torch.testing.assert_close(conv(x, adj32), conv(x, adj))


# --- the plan -------------------------------------------------------------------------


def forbid(monkeypatch, name):
    def fail(*a, **kw):
        raise AssertionError(f"{name} ran")

    for module in (gatlib._plan, gatlib._layout):  # wherever the name is looked up
        if hasattr(module, name):
            monkeypatch.setattr(module, name, fail)


@pytest.mark.parametrize("fmt", ["csr", pytest.param("sparse_tensor", marks=requires_torch_sparse), "csc"])
def test_compressed_adjacency_is_the_layout(monkeypatch, fmt):
    """A CSR (or SparseTensor) is the plan's CSR as it is, a CSC its source-sorted
    side: the sort-based builder never runs and one sort is left (by source for a
    CSR, by destination for a CSC), none for the self-loops. The layout is the one
    the builder makes of the same edge list."""
    ei = graph(30, 30, seed=7)
    adj = adjacency(fmt, ei, 30, 30)
    edges, _ = stored(adj)
    want, want_looped = build_layout(edges[0], edges[1], 30, 30), GraphPlan(edges, 30).with_self_loops().layout()
    forbid(monkeypatch, "build_layout")
    if fmt == "csc":
        forbid(monkeypatch, "_with_csc")
    calls = count_sorts(monkeypatch)
    plan = GraphPlan(adj)
    assert (plan.num_src, plan.num_dst) == (30, 30) and torch.equal(plan.edge_index, edges)
    lay, looped = plan.layout(), plan.with_self_loops().layout()
    assert len(calls) == 1
    for f in ("ptr", "src", "dst", "perm", "csc_ptr", "csc_edge", "csc_dst"):
        assert torch.equal(getattr(lay, f), getattr(want, f)), f
        assert torch.equal(getattr(looped, f), getattr(want_looped, f)), f
    # and a layer given the adjacency builds its throw-away plan the same way
    conv = gatlib.GATConv(4, 4, backend="fused")
    with gatlib.record_kernels() as log:
        conv(torch.randn(30, 4), adjacency(fmt, ei, 30, 30))
    assert log == ["fused"]


def test_csc_with_unsorted_rows_still_gives_the_layout():
    """A CSC whose rows are not ascending within a column (torch allows it): its
    source-sorted side is sorted like any edge list's."""
    ccol, row = torch.tensor([0, 3, 4, 6]), torch.tensor([2, 0, 1, 1, 2, 0])
    adj = torch.sparse_csc_tensor(ccol, row, torch.ones(6), (3, 3))
    edges, _ = stored(adj)
    lay, want = GraphPlan(adj).layout(), build_layout(edges[0], edges[1], 3, 3)
    for f in ("ptr", "src", "dst", "perm", "csc_ptr", "csc_edge", "csc_dst"):
        assert torch.equal(getattr(lay, f), getattr(want, f)), f


def test_plan_holds_nothing_of_the_adjacency():
    """The plan copies the indices: rewriting the adjacency afterwards (before its
    layout is built) changes nothing in it."""
    adj = adjacency("csr", graph(12, 12), 12, 12)
    plan = GraphPlan(adj)
    edges = plan.edge_index
    adj.col_indices().zero_()
    adj.crow_indices().zero_()
    lay = plan.layout()
    assert torch.equal(plan.edge_index, edges) and torch.equal(lay.src.long(), edges[0])
    assert torch.equal(lay.ptr.long(), torch.ops.aten._convert_indices_from_coo_to_csr(edges[1], 12))


@pytest.mark.parametrize("fmt", FORMATS)
def test_layer_given_a_plan_of_an_adjacency(fmt):
    """A plan built from an adjacency is a plan: the layer's result is the adjacency's,
    and it returns the plan's [2, E'] edge list (self-loops appended) with alpha."""
    x, in_ch, n_src, n_dst = inputs("pair")
    adj = adjacency(fmt, graph(n_src, n_dst), n_src, n_dst)
    conv = gatlib.GATConv(in_ch, 4, heads=2)
    plan = GraphPlan(adj)
    out, (ei, alpha) = conv(x, plan, return_attention_weights=True)
    torch.testing.assert_close(out, conv(x, adj))
    assert ei.shape == (2, plan.num_edges - 2 + min(n_src, n_dst)) and alpha.shape == (ei.size(1), 2)
