"""torch.compile keeps gatlib's fused kernels: the layers compile with
``fullgraph=True`` (no graph break) from a raw ``edge_index`` and from a
``GraphPlan``, the compiled training step runs the fused operators (their own
log entries, written as they run), and it computes what the eager step does."""
import pytest
import torch
import torch.nn.functional as F

import gatlib

from testing import LAYERS, random_graph

N, N_DST, F_IN, D = 60, 25, 8, 3


class Net(torch.nn.Module):
    """Every option of a layer in one model: edge features, attention dropout and
    the attention weights returned (``conv1``, on a graph with self-loops of its
    own); then a bipartite layer (``conv2``: all nodes to the first ``N_DST``)."""

    def __init__(self, layer: str, backend: str = "fused"):
        super().__init__()
        cls = getattr(gatlib, layer)
        self.conv1 = cls(F_IN, 4, heads=2, edge_dim=D, dropout=0.3, backend=backend)
        self.conv2 = cls((8, F_IN), 5, heads=2, concat=False, backend=backend)

    def forward(self, x, graph, edge_attr, bipartite):
        h, (ei, alpha) = self.conv1(x, graph, edge_attr, return_attention_weights=True)
        out = self.conv2((F.elu(h), x[:N_DST]), bipartite)
        return out, ei, alpha


def inputs(as_plan: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, F_IN, generator=g)
    ei = torch.cat([random_graph(N, 300, seed=1), torch.tensor([[3, 7], [3, 7]])], dim=1)
    bip = random_graph(N, 200, num_dst=N_DST, seed=2)
    ea = torch.randn(ei.size(1), D, generator=g)
    if as_plan:
        ei, bip = gatlib.GraphPlan(ei, num_nodes=N), gatlib.GraphPlan(bip, size=(N, N_DST))
    return x, ei, ea, bip


def run(model, x, ei, ea, bip, y, seed=0):
    """One training step's forward and backward: ``(loss, out, alpha, grads)``."""
    torch.manual_seed(seed)
    model.zero_grad()
    out, ei_out, alpha = model(x, ei, ea, bip)
    loss = F.cross_entropy(out, y) + (alpha * alpha).sum()
    loss.backward()
    return loss.detach(), out.detach(), alpha.detach(), ei_out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("as_plan", [False, True], ids=["edge_index", "plan"])
@pytest.mark.parametrize("layer", LAYERS)
def test_fullgraph_training_step_runs_the_fused_operators(layer, as_plan):
    """fullgraph=True raises on any graph break; the log proves the fused operators
    ran in the compiled step (the reference, compiled into the graph instead, logs
    nothing); the loss, outputs, attention weights and gradients are the eager
    step's, dropout masks included (inductor draws them with torch's generator)."""
    torch.manual_seed(0)
    model = Net(layer)
    x, ei, ea, bip = inputs(as_plan)
    y = torch.randint(0, 5, (N_DST,))
    with gatlib.record_kernels() as log:
        eager = run(model, x, ei, ea, bip, y)
    assert log == ["fused", "fused", "fused.backward", "fused.backward"]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x, ei, ea, bip = inputs(as_plan)  # a new plan: derived inside the compiled call
    for _ in range(2):  # (a plan's derived layouts are inputs the second time)
        with gatlib.record_kernels() as log, torch._inductor.config.patch(fallback_random=True):
            got = run(compiled, x, ei, ea, bip, y)
        assert log == ["fused", "fused", "fused.backward", "fused.backward"]
        for a, b in zip(got[:2], eager[:2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        alpha, ei_out = got[2], got[3]
        if layer != "TransformerConv":  # (the layers that add self-loops)
            # Compiled, the graph's own self-loops stay in the returned edges with weight
            # 0 (the added loops replace them); eager leaves them out, as PyG does.
            E = ea.size(0)
            own_loop = torch.cat([ei_out[0, :E] == ei_out[1, :E], torch.zeros(N, dtype=torch.bool)])
            assert int(own_loop.sum()) >= 2 and bool((alpha[own_loop] == 0).all())
            alpha, ei_out = alpha[~own_loop], ei_out[:, ~own_loop]
        torch.testing.assert_close(alpha, eager[2], rtol=1e-4, atol=1e-5)
        assert torch.equal(ei_out, eager[3])
        for a, b in zip(got[4], eager[4], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
