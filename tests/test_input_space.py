"""Input-space aggregation (gatlib.layers._input_space): where a layer's input is
narrower than a head (F < C), GATConv and TransformerConv attend the inputs
``x_j`` and project after, ``W_h sum_j alpha_ij x_j``, instead of aggregating
``W_h x_j``. The same function: tested against the projected path (the rule
switched off) on every backend, with gradcheck in float64; the rule's
exclusions; and that the path ran (the value projection is never called)."""
import pytest
import torch

import gatlib
from gatlib import layers

from testing import kernels, random_graph, record_launches

N, N_DST, F_IN, C, H = 40, 30, 3, 8, 3


def graph():
    """Edges into the first ``N_DST - 5`` nodes only: the last five destinations have
    no in-edges (the Transformer adds no self-loops), where the value's bias must
    not be added."""
    ei = random_graph(N, 200, num_dst=N_DST - 5, seed=1)
    return ei


def make(layer, backend, **kw):
    torch.manual_seed(0)
    conv = getattr(gatlib, layer)(F_IN, C, heads=H, backend=backend, **kw).double()
    with torch.no_grad():  # biases away from zero, so that a misplaced one shows
        for p in conv.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return conv


def spy_project_heads(monkeypatch):
    """The calls of the projection after an input-space aggregation: what marks that path
    (a hook on the layer's Linear would itself send it to the projected path)."""
    calls = []
    project_heads = layers._project_heads

    def spy(*args):
        calls.append(1)
        return project_heads(*args)

    monkeypatch.setattr(layers, "_project_heads", spy)
    return calls


def run(conv, x, ei, *, input_space, monkeypatch, **kw):
    """``(out, alpha, grads of x and of every parameter)`` and whether the projected path
    ran (the input-space projection was not called); ``input_space=False`` switches the
    rule off."""
    with monkeypatch.context() as m:
        if not input_space:
            m.setattr(layers, "_input_space", lambda *a: False)
        calls = spy_project_heads(m)
        conv.zero_grad()
        x = x.clone().requires_grad_()
        out, (_, alpha) = conv(x, ei, return_attention_weights=True, **kw)
        w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(5))
        ((out * w).sum() + (alpha * alpha).sum()).backward()
    grads = [x.grad] + [p.grad for p in conv.parameters()]
    return out.detach(), alpha.detach(), grads, not calls


def assert_same(a, b):
    out_a, alpha_a, grads_a, _ = a
    out_b, alpha_b, grads_b, _ = b
    tol = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out_a, out_b, **tol)
    torch.testing.assert_close(alpha_a, alpha_b, **tol)
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert ga is not None and gb is not None  # every parameter takes part (DDP)
        torch.testing.assert_close(ga, gb, **tol)


def assert_input_space_under_the_same_dropout(conv, x, ei, monkeypatch):
    """Input space taken, and the projected path's results under the same seed
    (both draw the same dropout mask)."""
    torch.manual_seed(1)
    got = run(conv, x, ei, input_space=True, monkeypatch=monkeypatch)
    torch.manual_seed(1)
    want = run(conv, x, ei, input_space=False, monkeypatch=monkeypatch)
    assert not got[3]
    assert_same(got, want)


@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
@pytest.mark.parametrize("layer", ["GATConv", "TransformerConv"])
def test_input_space_is_the_projected_path(layer, concat, backend, monkeypatch):
    conv = make(layer, backend, concat=concat)
    x = torch.randn(N, F_IN, dtype=torch.float64)
    ei = graph()
    with gatlib.record_kernels() as log:
        got = run(conv, x, ei, input_space=True, monkeypatch=monkeypatch)
    assert log[0] == backend
    want = run(conv, x, ei, input_space=False, monkeypatch=monkeypatch)
    assert not got[3] and want[3]  # the value projection: never called in input space
    assert_same(got, want)
    if layer == "TransformerConv":  # no in-edges: the skip term alone, no value bias
        alone = conv.lin_skip(x[N_DST - 5:N_DST]).detach() if concat else None
        if alone is not None:
            torch.testing.assert_close(got[0][N_DST - 5:N_DST], alone)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("layer", ["GATConv", "TransformerConv"])
def test_gradcheck_in_input_space(layer, backend, monkeypatch):
    """float64 gradcheck of the layer's output in input space with respect to the
    input and every parameter (through the fused kernel's operators too)."""
    conv = make(layer, backend, concat=False)
    ei = random_graph(12, 40, num_dst=10, seed=2)
    x = torch.randn(12, F_IN, dtype=torch.float64, requires_grad=True)
    names, params = zip(*[(n, p.detach().clone().requires_grad_()) for n, p in conv.named_parameters()], strict=True)

    def f(x, *ps):
        return torch.func.functional_call(conv, dict(zip(names, ps, strict=True)), (x, ei))

    calls = spy_project_heads(monkeypatch)
    assert torch.autograd.gradcheck(f, (x, *params))
    assert calls


@pytest.mark.parametrize("layer", ["GATConv", "TransformerConv"])
def test_inputs_as_wide_as_a_head_are_projected_first(layer, monkeypatch):
    conv = getattr(gatlib, layer)(C, C, heads=H).double()
    x = torch.randn(N, C, dtype=torch.float64)
    assert run(conv, x, graph(), input_space=True, monkeypatch=monkeypatch)[3]


def test_the_transformer_projects_first_where_its_value_bias_needs_projected_weights(monkeypatch):
    """Attention dropout (the kept weights of a row do not sum to one) with a value
    bias, edge features, the values' own dropout: the projected path. Without the
    value bias, dropout stays in input space and draws the same mask."""
    x, ei = torch.randn(N, F_IN, dtype=torch.float64), graph()
    for kw in (dict(dropout=0.5), dict(edge_dim=2), dict(value_dropout=0.5)):
        conv = make("TransformerConv", "fused", **kw).train()
        extra = dict(edge_attr=torch.randn(ei.size(1), 2, dtype=torch.float64)) if "edge_dim" in kw else {}
        torch.manual_seed(1)
        assert run(conv, x, ei, input_space=True, monkeypatch=monkeypatch, **extra)[3], kw
    conv = make("TransformerConv", "fused", dropout=0.5, bias=False).train()
    assert_input_space_under_the_same_dropout(conv, x, ei, monkeypatch)


def test_gat_attention_dropout_and_explainer_masks_stay_in_input_space(monkeypatch):
    """GAT's values have no bias: dropout and an explainer's edge weights multiply
    the weights of a linear sum, so input space holds for both."""
    x, ei = torch.randn(N, F_IN, dtype=torch.float64), graph()
    conv = make("GATConv", "fused", dropout=0.5).train()
    assert_input_space_under_the_same_dropout(conv, x, ei, monkeypatch)

    conv = make("GATConv", "torch").eval()
    conv.explain = True
    attended = gatlib.GraphPlan(ei, num_nodes=N).with_self_loops().num_edges  # (with the loops)
    conv._edge_mask = torch.rand(attended, dtype=torch.float64)
    conv._apply_sigmoid = True
    try:
        got = run(conv, x, ei, input_space=True, monkeypatch=monkeypatch)
        want = run(conv, x, ei, input_space=False, monkeypatch=monkeypatch)
    finally:
        conv.explain = False
    assert not got[3]
    assert_same(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["GATConv", "TransformerConv"])
def test_input_space_compiles_without_a_graph_break(layer):
    """A graph break is dynamo's doing: inductor compiles GATConv's graph (its output is
    checked through inductor's code), aot_eager TransformerConv's."""
    conv = make(layer, "fused").float()
    x, ei = torch.randn(N, F_IN), graph()
    want = conv(x, ei)
    torch._dynamo.reset()
    backend = "inductor" if layer == "GATConv" else "aot_eager"
    got = torch.compile(conv, fullgraph=True, backend=backend)(x, ei)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["GATConv", "TransformerConv"])
def test_input_space_compiled_on_the_triton_kernels(layer, monkeypatch):
    """A compiled training call of the input-space form on the Triton kernels (their
    operators traced with their shape functions: the values ``[N, 1, F]`` of one head,
    the output and the gradients of ``H``): the eager call's output and gradients, and
    the kernels got the one-head values (ONE_V) in the compiled graph too. What the
    operators receive is AOTAutograd's trace, the same under aot_eager as under inductor
    (whose C++ compile the test above covers)."""
    conv = make(layer, "triton").float()
    x, ei = torch.randn(N, F_IN), graph()
    launched = record_launches(monkeypatch)

    def step(fn):
        conv.zero_grad()
        xg = x.clone().requires_grad_()
        out = fn(xg, ei)
        out.square().sum().backward()
        return [out.detach(), xg.grad] + [p.grad.clone() for p in conv.parameters()]

    want = step(conv)
    torch._dynamo.reset()
    launched.clear()
    with gatlib.record_kernels() as log:
        got = step(torch.compile(conv, fullgraph=True, backend="aot_eager"))
    assert "triton" in log and "triton.backward" in log
    seen = [consts.get("ONE_V") for _, consts in launched]  # (the src backward has none)
    assert seen and all(one is not False for one in seen) and True in seen, seen
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_per_head_products_in_place_are_the_einsum():
    """The per-head products of input space (gatlib._heads): one matrix product per
    head in place, against the einsum, forward, backward and double backward
    (gradcheck/gradgradcheck in float64), with ``b`` a transposed view as the
    layers pass it; under torch.func the einsum runs, with the same result."""
    from gatlib import _heads

    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 3 * 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3 * 5, 4, dtype=torch.float64, generator=g, requires_grad=True)

    def b_of(w):
        return w.view(3, 5, 4).transpose(1, 2)  # [H, K=4, M=5]

    out = _heads.per_head_mm(a, b_of(w))
    assert type(out.grad_fn).__name__ == "_PerHeadMMBackward"  # the in-place products ran
    torch.testing.assert_close(out, _heads.per_head_mm_reference(a, b_of(w)), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, w: _heads.per_head_mm(a, b_of(w)), (a, w))
    assert torch.autograd.gradgradcheck(lambda a, w: _heads.per_head_mm(a, b_of(w)), (a, w))
    batched = torch.func.vmap(lambda a: _heads.per_head_mm(a, b_of(w)))(a[None].expand(2, -1, -1))
    torch.testing.assert_close(batched[1], out, rtol=1e-12, atol=1e-12)


def test_compiled_per_head_products_are_one_mm_per_head():
    """Under torch.compile the per-head products trace as one ``mm`` per head, forward
    and backward (the weight gradient of each a product of that head's columns), not the
    einsum's batched product (its weight gradient, compiled, was 4.6x eager's on an
    H100): read from AOT autograd's graphs, and the same numbers as the einsum."""
    from torch._dynamo.backends.common import aot_autograd

    from gatlib import _heads

    H, K, M = 3, 4, 5
    graphs = []

    def record(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    def fn(a, w):
        return _heads.per_head_mm(a, w.view(H, M, K).transpose(1, 2))

    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, H * K, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(H * M, K, dtype=torch.float64, generator=g, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record),
                             fullgraph=True)
    out = compiled(a, w)
    out.backward(torch.ones_like(out))
    got = (out.detach(), a.grad.clone(), w.grad.clone())
    a.grad = w.grad = None
    want = _heads.per_head_mm_reference(a, w.view(H, M, K).transpose(1, 2))
    want.backward(torch.ones_like(want))
    for x, y in zip(got, (want.detach(), a.grad, w.grad), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    fw, bw = graphs
    aten = torch.ops.aten
    assert aten.bmm.default not in fw + bw, (fw, bw)
    assert fw.count(aten.mm.default) == H, fw
    assert bw.count(aten.mm.default) == 2 * H, bw  # each head's input and weight gradient
