"""gatlib's layers where PyG looks for a ``MessagePassing`` module: ``to_hetero``,
``HeteroConv``, explainers, subclasses that override an extension point, hooks.

Each is compared with PyG's own layer given the same weights and inputs."""
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg_nn
from torch import Tensor
from torch_geometric.explain import Explainer
from torch_geometric.explain.algorithm import AttentionExplainer, GNNExplainer, GraphMaskExplainer
from torch_geometric.explain.algorithm.utils import clear_masks, set_masks
from torch_geometric.nn import HeteroConv, MessagePassing, to_hetero
from torch_geometric.utils import softmax

import gatlib

LAYERS = {"gat": (gatlib.GATConv, pyg_nn.GATConv),
          "gatv2": (gatlib.GATv2Conv, pyg_nn.GATv2Conv),
          "transformer": (gatlib.TransformerConv, pyg_nn.TransformerConv)}


def small_graph(n=12, e=40, f=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g)
    ei = torch.randint(0, n, (2, e), generator=g)
    return x, ei


def close(a, b, tol=1e-5):
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", LAYERS)
def test_layers_are_message_passing(name):
    ours, _ = LAYERS[name]
    conv = ours(6, 4, heads=2)
    assert isinstance(conv, MessagePassing)
    assert conv.node_dim == 0 and conv.aggr == "add"


# --- the propagate path: hooks, overrides, explain mode ---------------------------------------
def _out_and_grads(conv, x, ei, **kw):
    x = x.clone().requires_grad_()
    out, (ei_out, alpha) = conv(x, ei, return_attention_weights=True, **kw)
    out.pow(2).sum().backward()
    return out.detach(), alpha.detach(), x.grad, [p.grad.clone() for p in conv.parameters()]


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("hook", ["message_forward", "propagate_forward_pre", "edge_update_forward",
                                  "aggregate_forward"])
def test_a_registered_hook_runs_through_propagate_and_fires(name, hook):
    """A hook is never silently skipped: the call runs PyG's propagate (logged), the
    hook fires, and the result equals the attention core's."""
    ours, _ = LAYERS[name]
    torch.manual_seed(0)
    conv = ours(6, 4, heads=2)
    x, ei = small_graph()
    with gatlib.record_kernels() as log:
        fast = _out_and_grads(conv, x, ei)
    assert "propagate" not in log and log  # a kernel ran
    conv.zero_grad()
    fired = []
    register = getattr(conv, f"register_{hook}_hook")
    handle = register(lambda *args: fired.append(1))
    with gatlib.record_kernels() as log:
        slow = _out_and_grads(conv, x, ei)
    if hook == "edge_update_forward" and name == "transformer":
        assert not fired  # PyG's TransformerConv has no edge_updater call either
    else:
        assert fired
    assert log == ["propagate"]
    for a, b in zip(fast[:3], slow[:3], strict=True):
        close(a, b)
    for a, b in zip(fast[3], slow[3], strict=True):
        close(a, b)
    handle.remove()
    with gatlib.record_kernels() as log:
        conv(x, ei)
    assert "propagate" not in log


@pytest.mark.parametrize("name", LAYERS)
def test_explicit_backend_refuses_what_only_propagate_honours(name):
    ours, _ = LAYERS[name]
    conv = ours(6, 4, heads=2, backend="fused")
    x, ei = small_graph()
    conv(x, ei)
    conv.register_message_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match="backend='fused' cannot run this call: a message forward hook"):
        conv(x, ei)


def test_instance_level_override_is_honoured():
    conv = gatlib.GATConv(6, 4, heads=2)
    x, ei = small_graph()
    base = conv(x, ei)
    conv.message = lambda x_j, alpha: 2 * alpha.unsqueeze(-1) * x_j
    with gatlib.record_kernels() as log:
        doubled = conv(x, ei)
    assert log == ["propagate"]
    close(doubled - conv.bias, 2 * (base - conv.bias))


# PyG's robustness example (examples/contrib/rbcd_attack.py) weights edges by overriding
# edge_update of GATConv; the same subclass body on either base class (PyG's inspector
# finds a method by its __name__, hence the name).
def edge_update(self, alpha_j: Tensor, alpha_i: Optional[Tensor],
                          edge_attr: Optional[Tensor], index: Tensor, ptr: Optional[Tensor],
                          size_i: Optional[int]) -> Tensor:
    alpha = alpha_j if alpha_i is None else alpha_j + alpha_i
    alpha = F.leaky_relu(alpha, self.negative_slope)
    if edge_attr is not None:
        alpha = alpha + torch.log2(edge_attr.view(-1, 1))
    alpha = softmax(alpha, index, ptr, size_i)
    return F.dropout(alpha, p=self.dropout, training=self.training)


class OurWeightedGAT(gatlib.GATConv):
    edge_update = edge_update


class PyGWeightedGAT(pyg_nn.GATConv):
    edge_update = edge_update


@pytest.mark.parametrize("self_loops", [True, False])
def test_subclass_overriding_edge_update_matches_pyg(self_loops):
    torch.manual_seed(0)
    theirs = PyGWeightedGAT(6, 4, heads=2, add_self_loops=self_loops, fill_value=1.0)
    ours = OurWeightedGAT(6, 4, heads=2, add_self_loops=self_loops, fill_value=1.0)
    ours.load_state_dict(theirs.state_dict())
    x, ei = small_graph()
    w = torch.rand(ei.size(1)) + 0.1
    with gatlib.record_kernels() as log:
        got = _out_and_grads(ours, x, ei, edge_attr=w)
    assert log == ["propagate"]
    want = _out_and_grads(theirs, x, ei, edge_attr=w)
    for a, b in zip(got[:3], want[:3], strict=True):
        close(a, b)
    for a, b in zip(got[3], want[3], strict=True):
        close(a, b)
    # The weights matter: the same call without them differs.
    assert not torch.allclose(ours(x, ei, edge_attr=torch.ones_like(w)), got[0])


def test_transformer_alpha_attribute_as_pyg():
    conv = gatlib.TransformerConv(6, 4, heads=2)
    assert conv._alpha is None
    x, ei = small_graph()
    seen = []
    conv.register_message_forward_hook(lambda m, inputs, out: seen.append(m._alpha.clone()))
    out, (_, alpha) = conv(x, ei, return_attention_weights=True)
    assert len(seen) == 1 and seen[0].shape == (ei.size(1), 2)
    close(seen[0], alpha)
    assert conv._alpha is None  # taken back by forward, as PyG's layer does


# --- heterogeneous models -----------------------------------------------------------------------
def hetero_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {"paper": torch.randn(10, 5, generator=g), "author": torch.randn(7, 3, generator=g)}
    ei = {("author", "writes", "paper"): torch.stack([torch.randint(0, 7, (20,), generator=g),
                                                      torch.randint(0, 10, (20,), generator=g)]),
          ("paper", "cites", "paper"): torch.randint(0, 10, (2, 25), generator=g),
          ("paper", "rev_writes", "author"): torch.stack([torch.randint(0, 10, (20,), generator=g),
                                                          torch.randint(0, 7, (20,), generator=g)])}
    return x, ei


class TwoLayer(torch.nn.Module):
    def __init__(self, conv_cls, **kw):
        super().__init__()
        self.conv1 = conv_cls((-1, -1), 8, heads=2, **kw)
        self.conv2 = conv_cls((-1, -1), 4, heads=1, **kw)

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)


HETERO_KW = {"gat": {"add_self_loops": False}, "gatv2": {"add_self_loops": False},
             "transformer": {}}


@pytest.mark.parametrize("name", LAYERS)
def test_to_hetero_matches_pyg(name):
    ours_cls, pyg_cls = LAYERS[name]
    x, ei = hetero_data()
    metadata = (list(x), list(ei))
    torch.manual_seed(0)
    theirs = to_hetero(TwoLayer(pyg_cls, **HETERO_KW[name]), metadata)
    ours = to_hetero(TwoLayer(ours_cls, **HETERO_KW[name]), metadata)
    want = theirs(x, ei)  # lazy shapes resolved
    ours(x, ei)
    ours.load_state_dict(theirs.state_dict())
    with gatlib.record_kernels() as log:
        got = ours(x, ei)
    assert set(got) == set(want) == {"paper", "author"}  # keyed by node type
    assert log and "propagate" not in log
    for k in want:
        close(got[k], want[k])
    sum(v.pow(2).sum() for v in got.values()).backward()
    sum(v.pow(2).sum() for v in want.values()).backward()
    ours_p, theirs_p = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert set(ours_p) == set(theirs_p)
    for k in theirs_p:
        close(ours_p[k].grad, theirs_p[k].grad, tol=1e-4)


@pytest.mark.parametrize("name", LAYERS)
def test_hetero_conv_matches_pyg_with_attention(name):
    ours_cls, pyg_cls = LAYERS[name]
    x, ei = hetero_data(1)
    torch.manual_seed(0)
    kw = HETERO_KW[name]
    theirs = HeteroConv({et: pyg_cls((-1, -1), 4, heads=2, **kw) for et in ei}, aggr="sum")
    ours = HeteroConv({et: ours_cls((-1, -1), 4, heads=2, **kw) for et in ei}, aggr="sum")
    want = theirs(x, ei)
    ours(x, ei)
    ours.load_state_dict(theirs.state_dict())
    got = ours(x, ei)
    for k in want:
        close(got[k], want[k])
    for et in ei:  # attention weights per edge type
        src, _, dst = et
        _, (e1, a1) = ours.convs[et]((x[src], x[dst]), ei[et], return_attention_weights=True)
        _, (e2, a2) = theirs.convs[et]((x[src], x[dst]), ei[et], return_attention_weights=True)
        assert torch.equal(e1, e2)
        close(a1, a2)


# --- explainers ---------------------------------------------------------------------------------
class NodeModel(torch.nn.Module):
    def __init__(self, conv_cls, heads=2, **kw):
        super().__init__()
        self.conv1 = conv_cls(6, 4, heads=heads, **kw)
        self.conv2 = conv_cls(4 * heads, 3, heads=1, **kw)

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)


def twin_models(name, heads=2):
    """PyG's and gatlib's NodeModel of layer ``name`` with the same weights, in eval mode."""
    ours_cls, pyg_cls = LAYERS[name]
    torch.manual_seed(0)
    theirs = NodeModel(pyg_cls, heads=heads).eval()
    ours = NodeModel(ours_cls, heads=heads).eval()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _explain(model, algorithm, x, ei):
    explainer = Explainer(model, algorithm, explanation_type="model", edge_mask_type="object",
                          node_mask_type=None,
                          model_config=dict(mode="multiclass_classification",
                                            task_level="node", return_type="raw"))
    torch.manual_seed(0)
    return explainer(x, ei, index=3)


@pytest.mark.parametrize("name,self_loops", [("gat", True), ("gat", False), ("gatv2", True),
                                              ("gatv2", False), ("transformer", False)])
@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_edge_mask_reaches_the_attention_as_in_pyg(name, backend, self_loops):
    """PyG's explainers set a mask on every MessagePassing layer; gatlib's kernels
    weigh each edge's attention by it (self-loops the way PyG handles them), with
    the same output and the same mask gradient as PyG's layer."""
    ours_cls, pyg_cls = LAYERS[name]
    kw = {} if name == "transformer" else {"add_self_loops": self_loops}
    x, ei = small_graph(seed=4)
    ei[:, :3] = torch.tensor([[1, 2, 3], [1, 2, 3]])  # self-loops in the input too
    torch.manual_seed(0)
    theirs = pyg_cls(6, 4, heads=2, **kw)
    ours = ours_cls(6, 4, heads=2, backend=backend, **kw)
    ours.load_state_dict(theirs.state_dict())
    mask = torch.randn(ei.size(1))
    results = []
    for conv in (ours, theirs):
        m = torch.nn.Parameter(mask.clone())
        set_masks(conv, m, ei, apply_sigmoid=True)
        with gatlib.record_kernels() as log:
            out = conv(x, ei)
            out.pow(2).sum().backward()
        clear_masks(conv)
        results.append((out.detach(), m.grad, log))
    (out1, g1, log), (out2, g2, _) = results
    assert log == [backend, f"{backend}.backward"] if backend == "fused" else log == [backend]
    close(out1, out2)
    close(g1, g2)
    if self_loops:  # the input's own self-loops are replaced: their mask entries get no gradient
        assert torch.all(g1[:3] == 0) and torch.any(g1[3:] != 0)
    with gatlib.record_kernels() as log:  # mask cleared: the layer is itself again
        close(ours(x, ei), theirs(x, ei))
    assert log == [backend]


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.usefixtures("auto_fused")
def test_gnn_explainer_matches_pyg(name):
    x, ei = small_graph(seed=2)
    ours, theirs = twin_models(name)
    with gatlib.record_kernels() as log:
        got = _explain(ours, GNNExplainer(epochs=30), x, ei)
    assert "fused" in log and "propagate" not in log  # the masks ran on the fused kernel
    want = _explain(theirs, GNNExplainer(epochs=30), x, ei)
    assert got.edge_mask.shape == (ei.size(1),)
    close(got.edge_mask, want.edge_mask, tol=1e-4)
    assert got.edge_mask.max() > 0  # something was explained


@pytest.mark.parametrize("name", ["gat", "gatv2"])
def test_graphmask_explainer_matches_pyg(name):
    """GraphMaskExplainer replaces explain_message on each layer: honoured through
    propagate. (It reads messages as [E, C], i.e. one head: with more, PyG's own
    layers fail inside it too.)"""
    x, ei = small_graph(seed=5)
    ours, theirs = twin_models(name, heads=1)
    algorithm = lambda: GraphMaskExplainer(2, epochs=5, log=False)  # noqa: E731
    with gatlib.record_kernels() as log:
        got = _explain(ours, algorithm(), x, ei)
    assert "propagate" in log
    want = _explain(theirs, algorithm(), x, ei)
    close(got.edge_mask, want.edge_mask, tol=1e-4)


@pytest.mark.parametrize("name", LAYERS)
def test_attention_explainer_matches_pyg(name):
    x, ei = small_graph(seed=3)
    ours, theirs = twin_models(name)
    got = _explain(ours, AttentionExplainer(), x, ei)
    want = _explain(theirs, AttentionExplainer(), x, ei)
    close(got.edge_mask, want.edge_mask)
    assert got.edge_mask.sum() > 0


# --- torch.jit.trace ----------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("backend", ["auto", "torch", "scatter", "fused"])
def test_jit_trace_on_cpu_paths(name, backend):
    """A traced layer replays the call on new features and a new graph with the
    kernel it was traced with — forward and backward — as the eager layer does."""
    if backend not in ("auto", "fused") and backend not in gatlib.available_backends("cpu"):
        pytest.skip(f"backend {backend!r} is not installed here")
    ours, _ = LAYERS[name]
    conv = ours(6, 4, heads=2, backend=backend)
    x, ei = small_graph()
    traced = torch.jit.trace(conv, (x, ei), check_trace=False)
    x2, ei2 = small_graph(seed=9)
    ran = "torch" if backend == "auto" else backend  # auto traces the reference: it saves
    with gatlib.record_kernels() as log:
        got = traced(x2, ei2)
        got.pow(2).sum().backward()
    if ran == "fused":  # one Python op in the trace, replayed: the fused kernel runs again
        assert log == ["fused", "fused.backward"]
        assert "^_FusedAttention" in str(traced.inlined_graph)
    else:  # the reference's trace is aten ops only
        assert log == [] and "^_FusedAttention" not in str(traced.inlined_graph)
    grads = [p.grad.clone() for p in conv.parameters()]
    conv.zero_grad()
    want = conv(x2, ei2)
    want.pow(2).sum().backward()
    close(got, want)
    for g, p in zip(grads, conv.parameters(), strict=True):
        close(g, p.grad)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_jit_trace_of_auto_can_be_saved(tmp_path):
    conv = gatlib.GATConv(6, 4, heads=2)
    x, ei = small_graph()
    traced = torch.jit.trace(conv, (x, ei), check_trace=False)
    torch.jit.save(traced, tmp_path / "gat.pt")
    loaded = torch.jit.load(tmp_path / "gat.pt")
    close(loaded(x, ei), conv(x, ei))
