"""Bad input: a clear TypeError/ValueError/IndexError naming the argument, raised
before anything is computed."""
import pytest
import torch

import gatlib

LAYERS = ["GATConv", "GATv2Conv", "TransformerConv"]


def make(layer, *args, **kw):
    return getattr(gatlib, layer)(*args, **kw)


@pytest.fixture
def graph():
    x = torch.randn(6, 4)
    ei = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]])
    return x, ei


# --- edge_index ---------------------------------------------------------------
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("bad,exc,match", [
    (torch.tensor([0, 1, 2]), ValueError, r"edge_index must have shape \[2, num_edges\]"),
    (torch.zeros(3, 4, dtype=torch.long), ValueError, r"edge_index must have shape \[2, num_edges\]"),
    (torch.zeros(2, 3, 1, dtype=torch.long), ValueError, r"edge_index must have shape"),
    (torch.zeros(2, 3), TypeError, r"edge_index must have dtype torch.int64"),
    (torch.zeros(2, 3, dtype=torch.bool), TypeError, r"edge_index must have dtype"),
    ([[0, 1], [1, 0]], TypeError, r"edge_index must be a torch.Tensor"),
    (torch.tensor([[0, -1], [1, 0]]), IndexError, r"edge_index contains a negative index"),
    (torch.tensor([[0, 6], [1, 0]]), IndexError, r"edge_index\[0\] \(source\) contains index 6"),
    (torch.tensor([[0, 1], [1, 9]]), IndexError, r"edge_index\[1\] \(destination\) contains index 9"),
])
def test_bad_edge_index(layer, graph, bad, exc, match):
    x, _ = graph
    with pytest.raises(exc, match=match):
        make(layer, 4, 3, heads=2)(x, bad)


@pytest.mark.parametrize("layer", LAYERS)
def test_edge_index_out_of_range_bipartite(layer):
    x = (torch.randn(5, 4), torch.randn(3, 4))
    ei = torch.tensor([[4, 0], [2, 3]])  # destination 3 >= 3 destination nodes
    with pytest.raises(IndexError, match=r"out of range for 3 destination nodes"):
        make(layer, 4, 3)(x, ei)


def test_int32_edge_index_accepted(graph):
    x, ei = graph
    layer = gatlib.GATConv(4, 3)
    torch.testing.assert_close(layer(x, ei.int()), layer(x, ei))


# --- x ------------------------------------------------------------------------
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("bad,exc,match", [
    (torch.randn(6, 5), ValueError, r"x must have 4 features"),
    (torch.randn(6), ValueError, r"x must have shape \[num_nodes, num_features\]"),
    (torch.randn(2, 6, 4), ValueError, r"x must have shape \[num_nodes, num_features\]"),
    (torch.ones(6, 4, dtype=torch.long), TypeError, r"x must be a floating-point tensor"),
    (torch.randn(6, 4, dtype=torch.float64), TypeError, r"x has dtype torch.float64 but"),
    ("features", TypeError, r"x must be a tensor"),
    ((torch.randn(6, 4),), TypeError, r"x must be a tensor \[N, F\] or a pair"),
    ((torch.randn(6, 4), torch.randn(6, 7)), ValueError, r"x\[1\] \(destination features\) must have 4"),
    ((torch.randn(6, 3), torch.randn(6, 4)), ValueError, r"x\[0\] \(source features\) must have 4"),
])
def test_bad_x(layer, graph, bad, exc, match):
    _, ei = graph
    with pytest.raises(exc, match=match):
        make(layer, 4, 3, heads=2)(bad, ei)


@pytest.mark.parametrize("layer", ["GATv2Conv", "TransformerConv"])
def test_missing_destination_features(layer, graph):
    x, ei = graph
    with pytest.raises(TypeError, match=r"x\[1\] \(destination features\) must be a torch.Tensor"):
        make(layer, 4, 3)((x, None), ei)


# --- edge_attr ----------------------------------------------------------------
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("bad,exc,match", [
    (torch.randn(5, 2), ValueError, r"edge_attr must have one row per edge \(6 edges"),
    (torch.randn(6, 3), ValueError, r"edge_attr must have edge_dim=2 columns"),
    (torch.randn(6), ValueError, r"edge_attr must have shape \[num_edges, edge_dim=2\]"),
    (torch.ones(6, 2, dtype=torch.long), TypeError, r"edge_attr must be a floating-point"),
    (torch.randn(6, 2, dtype=torch.float64), TypeError, r"edge_attr has dtype torch.float64"),
    (None, ValueError, r"edge_attr is required"),
    ([[0.0, 1.0]] * 6, TypeError, r"edge_attr must be a torch.Tensor"),
])
def test_bad_edge_attr(layer, graph, bad, exc, match):
    x, ei = graph
    with pytest.raises(exc, match=match):
        make(layer, 4, 3, edge_dim=2)(x, ei, bad)


@pytest.mark.parametrize("layer", LAYERS)
def test_edge_attr_without_edge_dim(layer, graph):
    x, ei = graph
    with pytest.raises(ValueError, match="edge_attr was given but the layer was built with edge_dim=None"):
        make(layer, 4, 3)(x, ei, torch.randn(6, 2))


@pytest.mark.parametrize("layer", ["GATConv", "GATv2Conv"])
def test_one_dim_edge_attr_with_edge_dim_1(layer, graph):
    x, ei = graph
    m = make(layer, 4, 3, edge_dim=1)
    ea = torch.randn(6)
    torch.testing.assert_close(m(x, ei, ea), m(x, ei, ea.view(-1, 1)))


# --- constructor ----------------------------------------------------------------
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("kw,exc,match", [
    (dict(heads=0), ValueError, r"heads must be >= 1; got 0"),
    (dict(heads=-2), ValueError, r"heads must be >= 1"),
    (dict(heads=2.0), TypeError, r"heads must be an int"),
    (dict(heads=True), TypeError, r"heads must be an int"),
    (dict(dropout=1.0), ValueError, r"dropout must be in \[0, 1\); got 1.0"),
    (dict(dropout=-0.1), ValueError, r"dropout must be in \[0, 1\)"),
    (dict(dropout="0.5"), TypeError, r"dropout must be a float"),
    (dict(backend="cuda-magic"), ValueError, r"backend must be one of"),
    (dict(backend=3), TypeError, r"backend must be a string"),
    (dict(edge_dim=0), ValueError, r"edge_dim must be >= 1"),
])
def test_bad_constructor(layer, kw, exc, match):
    with pytest.raises(exc, match=match):
        make(layer, 4, 3, **kw)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("p,exc", [(1.0, ValueError), (-0.5, ValueError), ("0.5", TypeError)])
def test_bad_value_dropout(layer, p, exc):
    with pytest.raises(exc, match=r"value_dropout must be"):
        make(layer, 4, 3, value_dropout=p)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("args,exc,match", [
    ((0, 3), ValueError, r"in_channels must be >= 1 \(or -1"),
    ((4, 0), ValueError, r"out_channels must be >= 1"),
    (("4", 3), TypeError, r"in_channels must be an int"),
    (((4, 4, 4), 3), ValueError, r"in_channels must be an int or a \(source, destination\) pair"),
])
def test_bad_channels(layer, args, exc, match):
    with pytest.raises(exc, match=match):
        make(layer, *args)


@pytest.mark.parametrize("layer", ["GATConv", "GATv2Conv"])
@pytest.mark.parametrize("kw,exc,match", [
    (dict(fill_value="median"), ValueError, r"fill_value must be a number, a tensor or one of"),
    (dict(fill_value=[1.0]), TypeError, r"fill_value must be a float"),
    (dict(fill_value=torch.ones(5), edge_dim=2), ValueError, r"fill_value tensor must have 1 or edge_dim=2"),
    (dict(negative_slope="0.2"), TypeError, r"negative_slope must be a real number"),
])
def test_bad_gat_options(layer, kw, exc, match):
    with pytest.raises(exc, match=match):
        make(layer, 4, 3, **kw)


def test_share_weights_needs_equal_widths():
    with pytest.raises(ValueError, match="share_weights=True needs equal"):
        gatlib.GATv2Conv((4, 5), 3, share_weights=True)


def test_bad_size(graph):
    x, ei = graph
    with pytest.raises(ValueError, match="size must be a pair"):
        gatlib.GATConv(4, 3)(x, ei, size=(6,))
    with pytest.raises(ValueError, match="does not match"):
        gatlib.GATConv(4, 3)(x, ei, size=(6, 7))


def test_unavailable_backend_is_a_clear_error(monkeypatch, graph):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_scatter" else real(name, *a))
    with pytest.raises(ValueError, match=r"backend='scatter' is not available: torch_scatter is not installed"):
        gatlib.GATConv(4, 3, backend="scatter")


def test_triton_backend_on_cpu_without_interpreter(monkeypatch, graph):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, ei = graph
    layer = gatlib.GATConv(4, 3, backend="triton")
    with pytest.raises(ValueError, match=r"backend='triton' cannot run this call: Triton kernels need "
                                         r"a CUDA device \(or TRITON_INTERPRET=1 on CPU\); got cpu"):
        layer(x, ei)


@pytest.mark.parametrize("layer", LAYERS)
def test_nothing_changed_by_a_failed_call(layer, graph):
    """A rejected call leaves parameters (and their grads) untouched."""
    x, ei = graph
    m = make(layer, 4, 3, heads=2)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(IndexError):
        m(x, torch.tensor([[0, 7], [1, 0]]))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in m.parameters())


def test_in_place_edit_of_edge_index_is_rechecked(graph):
    """Every call checks the tensor it is given: an edit between calls is seen,
    whether or not it bumps the tensor's version counter."""
    x, ei = graph
    m = gatlib.GATConv(4, 3)
    ei = ei.clone()
    m(x, ei)
    ei[0, 0] = 99
    with pytest.raises(IndexError, match="contains index 99"):
        m(x, ei)
    ei[0, 0] = 0
    m(x, ei)
    ei.numpy()[0, 0] = 98  # no version bump
    with pytest.raises(IndexError, match="contains index 98"):
        m(x, ei)


@pytest.mark.parametrize("layer", LAYERS)
def test_plan_of_other_sizes_is_rejected(layer, graph):
    x, ei = graph
    plan = gatlib.GraphPlan(ei, num_nodes=7)  # x has 6 nodes
    with pytest.raises(ValueError, match=r"GraphPlan of a graph with 7 source and 7 destination "
                                         r"nodes, but the inputs have 6"):
        make(layer, 4, 3)(x, plan)


def test_bad_plan_arguments():
    ei = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="either num_nodes or size"):
        gatlib.GraphPlan(ei, num_nodes=3, size=(3, 3))
    with pytest.raises(IndexError, match=r"edge_index\[1\] \(destination\) contains index 2"):
        gatlib.GraphPlan(ei, size=(3, 2))
    with pytest.raises(TypeError, match="already a GraphPlan"):
        gatlib.GraphPlan(gatlib.GraphPlan(ei))
    with pytest.raises(ValueError, match=r"num_nodes must be in \[0, 3\]"):
        gatlib.GraphPlan(ei, num_nodes=3).with_self_loops(4)


# --- graph_attention's tensors -------------------------------------------------
def _attention_inputs():
    ei = torch.tensor([[0, 1, 2, 3, 4, 4, 1], [0, 0, 1, 2, 2, 3, 3]])  # 5 sources, 4 destinations
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)
    return ei, r


@pytest.mark.parametrize("backend", ["torch", "fused", "triton"])
@pytest.mark.parametrize("case,match", [
    ("gat src rows", r"score's src must have shape \[N_src=5, H=2\]; got \(3, 2\)"),
    ("gat src too many", r"score's src must have shape \[N_src=5, H=2\]; got \(7, 2\)"),
    ("gat dst rows", r"score's dst must have shape \[num_dst=4, H=2\]; got \(5, 2\)"),
    ("gat edge rows", r"score's edge must have shape \[E=7, H=2\]; got \(6, 2\)"),
    ("value heads", r"value has 3 heads; the score has 2 \(or 1, shared\)"),
    ("value dims", r"value must be a \[N_src, H, C\] tensor"),
    ("dot key channels", r"score's src must have shape \[N_src=5, H=2 or 1, C=4\]; got \(5, 2, 3\)"),
    ("gatv2 att", r"score's att must have shape \[H=2, C=4\]; got \(2, 3\)"),
    ("value_edge rows", r"value_edge must have shape \[E=7, H=2, C=3\]; got \(5, 2, 3\)"),
])
def test_graph_attention_tensors_that_disagree_with_the_graph(backend, case, match):
    """Each of a call's tensors has the rows of what it is indexed by (sources,
    destinations, edges) and the score's heads and channels: a row too few would be
    read past its end by the kernels, a row too many would get a gradient no kernel
    writes (the Triton backward's, uninitialised)."""
    ei, r = _attention_inputs()
    S = gatlib.EdgeScore
    value = r(5, 2, 3)
    value_edge = None
    score = {"gat src rows": lambda: S.gat(r(3, 2), r(4, 2)),
             "gat src too many": lambda: S.gat(r(7, 2), r(4, 2)),
             "gat dst rows": lambda: S.gat(r(5, 2), r(5, 2)),
             "gat edge rows": lambda: S.gat(r(5, 2), r(4, 2), r(6, 2)),
             "dot key channels": lambda: S.dot(r(4, 2, 4), r(5, 2, 3)),
             "gatv2 att": lambda: S.gatv2(r(5, 2, 4), r(4, 2, 4), r(2, 3))}.get(case)
    score = score() if score else S.gat(r(5, 2), r(4, 2))
    if case == "value heads":
        value = r(5, 3, 3)
    elif case == "value dims":
        value = r(5, 6)
    elif case == "value_edge rows":
        value_edge = r(5, 2, 3)
    with pytest.raises(ValueError, match=match):
        gatlib.graph_attention(score, value, ei, 4, value_edge=value_edge, backend=backend)
