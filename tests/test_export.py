"""``torch.export`` of gatlib's layers: one exported program for graphs of every size.

A program exported with the node and edge counts left free (``torch.export.Dim``) must
hold for every size in their range. gatlib chooses some things by size (the fused kernel
or the reference, the layout's index width, folding GAT's attention vectors, saving or
recomputing GAT's weights); eagerly and compiled each choice guards on the example's
sizes, which would confine the program to one side (export fails: "Constraints
violated"). Under export a free size takes the side that serves every size
(``gatlib._layout.at_least``); the Triton kernels, whose schedule export cannot trace
for free sizes, say so."""
import io

import pytest
import torch

import gatlib

from testing import LAYERS, random_graph

F_IN, H, C, D = 16, 2, 8, 3


def _graph(n, e, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, F_IN, generator=g), random_graph(n, e, seed=seed), torch.randn(e, D, generator=g)


def _free(max_nodes=None, max_edges=None):
    """Free node and edge counts for ``conv(x, edge_index, edge_attr)``."""
    n = torch.export.Dim("n", min=2, max=max_nodes) if max_nodes else torch.export.Dim("n", min=2)
    e = torch.export.Dim("e", min=2, max=max_edges) if max_edges else torch.export.Dim("e", min=2)
    return {"x": {0: n}, "edge_index": {1: e}, "edge_attr": {0: e}}


def _gatlib_ops(ep):
    """gatlib's operators in the program (strict export keeps an autograd function's
    body in a subgraph of its own)."""
    return sorted({str(node.target) for gm in ep.graph_module.modules()
                   if isinstance(gm, torch.fx.GraphModule) for node in gm.graph.nodes
                   if "gatlib" in str(node.target)})


@pytest.mark.slow
@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("layer", LAYERS)
def test_one_exported_program_serves_every_graph_size(layer, strict):
    """Exported on a 50-node graph with edge features, the program computes the eager
    layer's output on graphs from 3 nodes to past every size rule (over 2^16 edges),
    and runs the fused kernel on all of them: on the small ones too, where eager calls
    run the reference."""
    torch.manual_seed(0)
    conv = getattr(gatlib, layer)(F_IN, C, heads=H, edge_dim=D).eval()
    ep = torch.export.export(conv, _graph(50, 200, 0), dynamic_shapes=_free(), strict=strict)
    assert "gatlib.fused_cpu_attention.default" in _gatlib_ops(ep)
    program = ep.module()
    for n, e, seed in ((3, 2, 1), (300, 2000, 2), (3000, 70000, 3)):
        x, ei, ea = _graph(n, e, seed)
        with torch.no_grad(), gatlib.record_kernels() as log:
            got = program(x, ei, ea)
        assert log == ["fused"], (n, e, log)
        with torch.no_grad():
            want = conv(x, ei, ea)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_range_below_the_size_rules_keeps_the_reference():
    """Where the Dims' maxima keep every graph below auto's switch to the fused kernel,
    the program is the reference's ATen ops: the range decides as a size does."""
    torch.manual_seed(0)
    conv = gatlib.GATConv(F_IN, C, heads=H, edge_dim=D).eval()
    ep = torch.export.export(conv, _graph(50, 200, 0), dynamic_shapes=_free(100, 1000))
    assert _gatlib_ops(ep) == []
    x, ei, ea = _graph(90, 900, 1)
    with torch.no_grad(), gatlib.record_kernels() as log:
        got = ep.module()(x, ei, ea)
    assert log == []
    torch.testing.assert_close(got, conv(x, ei, ea).detach(), rtol=1e-4, atol=1e-5)


def test_a_saved_program_loads_and_runs():
    """``torch.export.save``/``load`` round trip (gatlib imported: its operators are
    registered), then a graph of another size."""
    torch.manual_seed(0)
    conv = gatlib.GATv2Conv(F_IN, C, heads=H, edge_dim=D).eval()
    buf = io.BytesIO()
    torch.export.save(torch.export.export(conv, _graph(50, 200, 0), dynamic_shapes=_free()), buf)
    buf.seek(0)
    program = torch.export.load(buf).module()
    x, ei, ea = _graph(120, 700, 4)
    with torch.no_grad():
        torch.testing.assert_close(program(x, ei, ea), conv(x, ei, ea), rtol=1e-4, atol=1e-5)


def test_the_triton_kernels_export_static_sizes_and_refuse_free_ones():
    """With static sizes the program runs the Triton kernels on another graph of those
    sizes; with free ones the layer says why it cannot (a ValueError naming export and
    what to do) instead of torch's unprovable guards on the schedule's sizes. (In
    Triton's interpreter here; on CUDA ``backend="auto"`` then takes the reference.)"""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    conv = gatlib.GATConv(F_IN, C, heads=H, edge_dim=D, backend="triton").eval()
    ep = torch.export.export(conv, _graph(50, 200, 0))
    x, ei, ea = _graph(50, 200, 5)
    with torch.no_grad(), gatlib.record_kernels() as log:
        got = ep.module()(x, ei, ea)
    assert log == ["triton"]
    torch.testing.assert_close(got, conv(x, ei, ea).detach(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="torch.export with free node or edge counts"):
        torch.export.export(conv, _graph(50, 200, 0), dynamic_shapes=_free())
