"""Drop-in parity with PyG: same state_dict -> same outputs, gradients and attention."""
import itertools

import pytest
import torch
import torch_geometric.nn as pyg

import gatlib

from testing import LAYERS, kernels, random_graph

# Parity of the default path is parity of the fused kernel: auto takes it on these
# small graphs too (conftest.auto_fused).
pytestmark = pytest.mark.usefixtures("auto_fused")

N_SRC, N_DST, F_SRC, F_DST, EDGE_DIM = 23, 17, 7, 5, 3


def inputs(bipartite, edge_dim, seed=0):
    """x (tensor or pair), in_channels, edge_index with a few self-loops and duplicates."""
    g = torch.Generator().manual_seed(seed)
    if bipartite == "none":
        x = torch.randn(N_SRC, F_SRC, generator=g)
        in_channels, n_dst = F_SRC, N_SRC
    elif bipartite == "pair":  # different widths: in_channels is a pair
        x = (torch.randn(N_SRC, F_SRC, generator=g), torch.randn(N_DST, F_DST, generator=g))
        in_channels, n_dst = (F_SRC, F_DST), N_DST
    else:  # "pair-int": a pair of inputs with the same width and an int in_channels
        x = (torch.randn(N_SRC, F_SRC, generator=g), torch.randn(N_DST, F_SRC, generator=g))
        in_channels, n_dst = F_SRC, N_DST
    ei = random_graph(N_SRC, 90, num_dst=n_dst, seed=seed)
    ei = torch.cat([ei, torch.tensor([[1, 2, 2], [1, 2, 2]])], dim=1)  # loops + a duplicate
    ea = torch.randn(ei.size(1), edge_dim, generator=g) if edge_dim else None
    return x, in_channels, ei, ea


def leaves_of(x, ea):
    xs = list(x) if isinstance(x, tuple) else [x]
    return [t.clone().requires_grad_() for t in xs], (None if ea is None else ea.clone().requires_grad_())


def check_parity(ours, theirs, x, ei, ea, expect="fused", graph=None, **fw):
    """Same outputs, returned edge_index, attention weights and gradients as PyG's
    layer; ``expect`` is the kernel that must run in ours (``"fused"``: what
    ``auto`` picks on CPU); ``graph`` is what ours gets instead of ``ei`` (a
    GraphPlan, an EdgeIndex)."""
    ours.load_state_dict(theirs.state_dict())
    results = []
    for layer in (theirs, ours):
        xs, ea_ = leaves_of(x, ea)
        xin = tuple(xs) if isinstance(x, tuple) else xs[0]
        with gatlib.record_kernels() as log:
            g = ei if layer is theirs or graph is None else graph
            out, (ei_out, alpha) = layer(xin, g, ea_, return_attention_weights=True, **fw)
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            params = [p for _, p in sorted(layer.named_parameters())]
            leaves = xs + ([ea_] if ea_ is not None else []) + params
            grads = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True)
        if layer is ours:
            assert log[:1] == [expect], log
        results.append((out, ei_out, alpha, grads))
    (o1, e1, a1, g1), (o2, e2, a2, g2) = results
    torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-5)
    assert torch.equal(e2, e1)
    torch.testing.assert_close(a2, a1, rtol=1e-4, atol=1e-6)
    for a, b in zip(g2, g1, strict=True):
        if a is None or b is None:
            assert a is None and b is None or (a if a is not None else b).abs().max() == 0
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


GAT_GRID = list(itertools.product(
    [1, 3],  # heads
    [True, False],  # concat
    [True, False],  # add_self_loops
    [None, EDGE_DIM],  # edge_dim
    ["none", "pair", "pair-int"],  # bipartite
    [False, True],  # residual
))


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("heads,concat,loops,edge_dim,bipartite,residual", GAT_GRID)
def test_gatconv_parity(heads, concat, loops, edge_dim, bipartite, residual, fold, monkeypatch):
    """Also with the attention vectors folded into the weights (which these small
    inputs would not get: FOLD_MIN_ENTRIES), checking which way each score ran."""
    from gatlib import _scores as S

    real, folded = S.folds, []
    monkeypatch.setattr(S, "FOLD_MIN_ENTRIES", 0 if fold else S.FOLD_MIN_ENTRIES)
    monkeypatch.setattr(S, "folds", lambda *a: folded.append(real(*a)) or folded[-1])
    x, in_ch, ei, ea = inputs(bipartite, edge_dim)
    kw = dict(heads=heads, concat=concat, add_self_loops=loops, edge_dim=edge_dim,
              residual=residual, negative_slope=0.1, dropout=0.3)
    torch.manual_seed(0)
    theirs = pyg.GATConv(in_ch, 4, **kw).eval()
    ours = gatlib.GATConv(in_ch, 4, **kw).eval()
    check_parity(ours, theirs, x, ei, ea)
    # the source projection is 4*heads wide against F_SRC = 7 input features
    assert folded and all(f == (fold and 4 * heads >= F_SRC) for f in folded), folded


@pytest.mark.parametrize("fill_value", ["mean", "add", "max", 0.5, torch.tensor([1.0, -2.0, 0.5])])
@pytest.mark.parametrize("layer", ["GATConv", "GATv2Conv"])
def test_fill_value_parity(layer, fill_value):
    x, in_ch, ei, ea = inputs("none", EDGE_DIM)
    torch.manual_seed(0)
    theirs = getattr(pyg, layer)(in_ch, 4, heads=2, edge_dim=EDGE_DIM, fill_value=fill_value)
    ours = getattr(gatlib, layer)(in_ch, 4, heads=2, edge_dim=EDGE_DIM, fill_value=fill_value)
    check_parity(ours, theirs, x, ei, ea)


def test_gatconv_bias_false_and_size():
    x, in_ch, ei, _ = inputs("pair", None)
    torch.manual_seed(0)
    theirs, ours = pyg.GATConv(in_ch, 4, heads=2, bias=False), gatlib.GATConv(in_ch, 4, heads=2,
                                                                             bias=False)
    check_parity(ours, theirs, x, ei, None, size=(N_SRC, N_DST))
    assert ours.bias is None


def test_gatconv_missing_destination_features():
    """(x_src, None): PyG infers destinations from edge_index and scores sources only."""
    x, in_ch, ei, _ = inputs("pair-int", None)
    torch.manual_seed(0)
    theirs, ours = pyg.GATConv(in_ch, 4, heads=2), gatlib.GATConv(in_ch, 4, heads=2)
    ours.load_state_dict(theirs.state_dict())
    for size in (None, (N_SRC, N_DST)):
        torch.testing.assert_close(ours((x[0], None), ei, size=size),
                                   theirs((x[0], None), ei, size=size), rtol=1e-4, atol=1e-5)


GATV2_GRID = [c for c in itertools.product(
    [1, 3], [True, False], [True, False], [None, EDGE_DIM], ["none", "pair", "pair-int"],
    [False, True],  # residual
    [False, True],  # share_weights
    [True, False],  # bias
) if not (c[6] and c[4] == "pair")]  # sharing needs equal widths: "pair-int" covers it


@pytest.mark.parametrize("heads,concat,loops,edge_dim,bipartite,residual,share,bias", GATV2_GRID)
def test_gatv2conv_parity(heads, concat, loops, edge_dim, bipartite, residual, share, bias):
    x, in_ch, ei, ea = inputs(bipartite, edge_dim)
    kw = dict(heads=heads, concat=concat, add_self_loops=loops, edge_dim=edge_dim,
              residual=residual, share_weights=share, bias=bias, dropout=0.2)
    torch.manual_seed(0)
    theirs = pyg.GATv2Conv(in_ch, 4, **kw).eval()
    ours = gatlib.GATv2Conv(in_ch, 4, **kw).eval()
    assert set(ours.state_dict()) == set(theirs.state_dict())
    check_parity(ours, theirs, x, ei, ea)


TRANSFORMER_GRID = list(itertools.product(
    [1, 3], [True, False],
    [False, True],  # beta
    [True, False],  # root_weight
    [None, EDGE_DIM], ["none", "pair", "pair-int"],
    [True, False],  # bias
))


@pytest.mark.parametrize("heads,concat,beta,root,edge_dim,bipartite,bias", TRANSFORMER_GRID)
def test_transformerconv_parity(heads, concat, beta, root, edge_dim, bipartite, bias):
    x, in_ch, ei, ea = inputs(bipartite, edge_dim)
    kw = dict(heads=heads, concat=concat, beta=beta, root_weight=root, edge_dim=edge_dim,
              bias=bias, dropout=0.1)
    torch.manual_seed(0)
    theirs = pyg.TransformerConv(in_ch, 4, **kw).eval()
    ours = gatlib.TransformerConv(in_ch, 4, **kw).eval()
    assert set(ours.state_dict()) == set(theirs.state_dict())
    check_parity(ours, theirs, x, ei, ea)


@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("layer", LAYERS)
def test_parity_every_backend(layer, backend):
    x, in_ch, ei, ea = inputs("pair", EDGE_DIM, seed=4)
    torch.manual_seed(0)
    theirs = getattr(pyg, layer)(in_ch, 8, heads=2, edge_dim=EDGE_DIM)
    ours = getattr(gatlib, layer)(in_ch, 8, heads=2, edge_dim=EDGE_DIM, backend=backend)
    check_parity(ours, theirs, x, ei, ea, expect=backend)


@pytest.mark.parametrize("graph", ["plan", "edge_index_sorted", "edge_index_unsorted"])
@pytest.mark.parametrize("bipartite", ["none", "pair"])
@pytest.mark.parametrize("layer", LAYERS)
def test_parity_with_a_plan_or_an_edge_index(layer, bipartite, graph):
    """A GraphPlan or a PyG EdgeIndex in place of the [2, E] tensor: PyG's results."""
    from torch_geometric import EdgeIndex

    x, in_ch, ei, ea = inputs(bipartite, EDGE_DIM, seed=5)
    n_src, n_dst = (x[0].size(0), x[1].size(0)) if isinstance(x, tuple) else (x.size(0),) * 2
    if graph == "plan":
        g = gatlib.GraphPlan(ei, size=(n_src, n_dst))
    else:
        g = EdgeIndex(ei, sparse_size=(n_src, n_dst))
        if graph == "edge_index_sorted":  # PyG's inputs get the same edge order
            g, order = g.sort_by("col")
            ei, ea = g.as_tensor(), ea[order]
    torch.manual_seed(0)
    theirs = getattr(pyg, layer)(in_ch, 8, heads=2, edge_dim=EDGE_DIM)
    ours = getattr(gatlib, layer)(in_ch, 8, heads=2, edge_dim=EDGE_DIM)
    for _ in range(2):  # the second call reuses what the plan derived in the first
        check_parity(ours, theirs, x, ei, ea, graph=g)


@pytest.mark.parametrize("layer", ["GATConv", "GATv2Conv", "TransformerConv"])
def test_lazy_in_channels(layer):
    x, _, ei, _ = inputs("none", None)
    torch.manual_seed(0)
    theirs, ours = getattr(pyg, layer)(-1, 4, heads=2), getattr(gatlib, layer)(-1, 4, heads=2)
    theirs(x, ei)  # materialise PyG's lazy weights, then copy them
    ours(x, ei)
    check_parity(ours, theirs, x, ei, None)


@pytest.mark.parametrize("layer", ["GATConv", "GATv2Conv", "TransformerConv"])
def test_training_mode_dropout_matches_in_expectation_shape(layer):
    """With dropout in training mode outputs are random but shaped like PyG's."""
    x, in_ch, ei, _ = inputs("none", None)
    ours = getattr(gatlib, layer)(in_ch, 4, heads=2, dropout=0.5).train()
    theirs = getattr(pyg, layer)(in_ch, 4, heads=2, dropout=0.5).train()
    ours.load_state_dict(theirs.state_dict())
    assert ours(x, ei).shape == theirs(x, ei).shape
    ours.eval()
    torch.testing.assert_close(ours(x, ei), theirs.eval()(x, ei), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layer", ["GATConv", "GATv2Conv", "TransformerConv"])
def test_repr_and_reset(layer):
    ours = getattr(gatlib, layer)(16, 32, heads=2)
    assert repr(ours) == f"{layer}(16, 32, heads=2)"
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    ours.reset_parameters()
    changed = [k for k, v in ours.state_dict().items()
               if "weight" in k and not torch.equal(v, before[k])]
    assert changed, "reset_parameters did not re-initialise any weight"
