"""Valid edge cases through the layers, on every backend: finite, correct shapes,
and equal to the reference backend."""
import pytest
import torch

import gatlib

from testing import LAYERS, OpCalls, kernels, hub_graph, random_graph

def build(layer, backend, in_ch=8, out=4, heads=2, **kw):
    torch.manual_seed(0)
    return getattr(gatlib, layer)(in_ch, out, heads=heads, backend=backend, **kw)


def graphs():
    n = 50
    ring = torch.stack([torch.arange(n), (torch.arange(n) + 1) % n])
    return {
        "no_nodes": (0, torch.empty(2, 0, dtype=torch.long)),
        "empty": (n, torch.empty(2, 0, dtype=torch.long)),
        "isolated": (n, random_graph(n, 100, seed=1)[:, :40].clamp(max=n - 11)),  # last 10 unreached
        "duplicates": (n, torch.cat([ring, ring, ring[:, :5]], dim=1)),
        "hub": (2000, hub_graph(2000, 5000)),
        "unsorted": (n, random_graph(n, 300, seed=2)[:, torch.randperm(300)]),
    }


@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("case", list(graphs()))
@pytest.mark.parametrize("self_loops", [True, False])
def test_edge_cases_finite_and_match_reference(layer, backend, case, self_loops):
    n, ei = graphs()[case]
    kw = {} if layer == "TransformerConv" else dict(add_self_loops=self_loops)
    x = torch.randn(n, 8, requires_grad=True)
    ref = build(layer, "torch", **kw)
    m = build(layer, backend, **kw)
    m.load_state_dict(ref.state_dict())
    out_ref = ref(x, ei)
    with gatlib.record_kernels() as log:
        out = m(x, ei)
    assert log == [backend]
    assert out.shape == (n, 8)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
    gx, = torch.autograd.grad(out.square().sum(), x)
    gx_ref, = torch.autograd.grad(out_ref.square().sum(), x)
    assert torch.isfinite(gx).all()
    torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-5)
    if case == "isolated" and not self_loops and layer != "TransformerConv":
        # no in-edges: the attention term is zero, only the bias remains
        torch.testing.assert_close(out[-10:], m.bias.expand(10, -1))


@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("layer", LAYERS)
def test_huge_features_do_not_overflow(layer, backend):
    n = 30
    ei = random_graph(n, 120, seed=3)
    x = torch.randn(n, 8) * 1e4
    out, (_, alpha) = build(layer, backend)(x, ei, return_attention_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(alpha).all()
    assert alpha.min() >= 0 and alpha.max() <= 1


@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_float64_and_bfloat16(layer, backend, dtype):
    n = 40
    ei = random_graph(n, 200, seed=4)
    x = torch.randn(n, 8)
    ref = build(layer, "torch").double()
    m = build(layer, backend).to(dtype)
    out = m(x.to(dtype), ei)
    assert out.dtype == dtype and torch.isfinite(out).all()
    exact = ref(x.double(), ei)
    tol = 1e-10 if dtype == torch.float64 else 0.1
    assert (out.double() - exact).abs().max() < tol


@pytest.mark.parametrize("layer", LAYERS)
def test_attention_weights_are_a_softmax_per_destination(layer):
    n = 25
    ei = random_graph(n, 100, seed=5)
    out, (ei_out, alpha) = build(layer, "torch", heads=3)(torch.randn(n, 8), ei,
                                                          return_attention_weights=True)
    assert alpha.shape == (ei_out.size(1), 3)
    sums = torch.zeros(n, 3).index_add_(0, ei_out[1], alpha)
    has_in = torch.bincount(ei_out[1], minlength=n) > 0
    torch.testing.assert_close(sums[has_in], torch.ones_like(sums[has_in]))


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("flag", [None, False])
def test_return_attention_weights_only_when_truthy(layer, flag):
    """Unlike PyG's TransformerConv, False returns the output alone, like None."""
    n = 10
    out = build(layer, "torch")(torch.randn(n, 8), random_graph(n, 30),
                                return_attention_weights=flag)
    assert isinstance(out, torch.Tensor)


@pytest.mark.parametrize("layer", LAYERS)
def test_concat_false_averages_heads(layer):
    n = 12
    ei = random_graph(n, 40, seed=6)
    x = torch.randn(n, 8)
    kw = {} if layer == "TransformerConv" else dict(bias=False)
    cat = build(layer, "torch", heads=3, concat=True, **kw)
    avg = build(layer, "torch", heads=3, concat=False, **kw)
    shared = {k: v for k, v in cat.state_dict().items() if "skip" not in k}
    avg.load_state_dict(shared, strict=False)
    if layer == "TransformerConv":  # the skip term differs in width; compare without it
        cat.root_weight = avg.root_weight = False
    out_cat, out_avg = cat(x, ei), avg(x, ei)
    assert out_avg.shape == (n, 4)
    torch.testing.assert_close(out_avg, out_cat.view(n, 3, 4).mean(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("layer", LAYERS)
def test_value_dropout_drops_aggregated_features_only(layer, backend):
    """One in-edge per destination, so alpha = 1 and out_i - bias = Θ_s x_j:
    with value dropout each entry is either 0 or Θ_s x_j / (1 - p); in eval
    mode the layer is the plain one."""
    n, p = 40, 0.5
    ei = torch.stack([torch.randperm(n), torch.arange(n)])
    x = torch.randn(n, 8)
    if layer == "TransformerConv":  # no self-loops, no root term, biases inside the projections
        m = build(layer, backend, root_weight=False, value_dropout=p)
        lin, bias = m.lin_value, 0.0
    else:  # GATv2: lin_l's bias is in the value, as in PyG
        m = build(layer, backend, add_self_loops=False, value_dropout=p)
        lin, bias = (m.lin if layer == "GATConv" else m.lin_l), m.bias
    value = lin(x)[ei[0]].detach()  # Θ_s x_j of each destination's one source
    m.eval()
    torch.testing.assert_close((m(x, ei) - bias).detach(), value, rtol=1e-5, atol=1e-6)
    m.train()
    torch.manual_seed(1)
    got = (m(x, ei) - bias).detach()
    kept = got != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(got[kept], (value / (1 - p))[kept], rtol=1e-5, atol=1e-6)


def test_a_plan_derives_its_graph_structure_once():
    """With a GraphPlan, self-loops and the CSR/CSC layout are built in the first
    call and reused; with a tensor, every call derives them afresh (nothing is
    cached on the tensor)."""
    n = 20
    ei = random_graph(n, 60, seed=7)
    plan = gatlib.GraphPlan(ei, num_nodes=n)
    m = build("GATConv", "fused")
    x = torch.randn(n, 8)
    with OpCalls("gatlib.csr_layout.default") as built:
        out1, (e1, _) = m(x, plan, return_attention_weights=True)
        out2, (e2, _) = m(x, plan, return_attention_weights=True)
        assert len(built) == 1 and plan.with_self_loops() is plan.with_self_loops()
        assert e1 is not e2 and torch.equal(e1, e2)  # a new tensor each time
        out3 = m(x, ei)
        out4 = m(x, ei)
        assert len(built) == 3
    for o in (out2, out3, out4):
        torch.testing.assert_close(o, out1)


def test_layers_in_a_pyg_model_train():
    """gatlib layers inside a PyG Sequential learn a simple task."""
    from torch_geometric.nn import Sequential

    torch.manual_seed(0)
    n = 60
    ei = random_graph(n, 400, seed=8)
    x = torch.randn(n, 8)
    y = (x[:, 0] > 0).long()
    model = Sequential("x, edge_index", [
        (gatlib.GATConv(8, 8, heads=2), "x, edge_index -> x"),
        torch.nn.ELU(),
        (gatlib.GATv2Conv(16, 8), "x, edge_index -> x"),
        torch.nn.ELU(),
        (gatlib.TransformerConv(8, 2), "x, edge_index -> x"),
    ])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x, ei), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
