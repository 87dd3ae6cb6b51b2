"""Regression tests: behaviours the library once got wrong, each named by what it protects.

Graph inputs stay the caller's
    no edge_index outlives its call; an index buffer rewritten in place is read
    (and range-checked) again; editing a returned edge_index changes nothing.
Grad modes, transforms and autocast
    a graph first used under inference_mode trains afterwards; double backward,
    torch.func.grad and bfloat16 autocast through the default (fused) kernel
    agree with the reference.
Empty graphs
    a graph without nodes or without edges gives what PyG's layer gives.
Kernel selection
    a requested kernel that cannot run a call raises instead of handing it to
    another; "auto" records the kernel that ran.
Compilation and threads
    torch.compile splits a training step no more often than PyG's model does;
    the kernels never change the process-wide thread count.

Related tests elsewhere: the low-precision bounds that also hold the reference
to float64 are tests/test_core.py::test_low_precision_bound and
::test_reference_bound_catches_a_low_precision_reference; the rules that keep
the library apart from its benchmark harness are tests/test_structure.py."""
import gc
import weakref

import numpy as np
import pytest
import torch
import torch_geometric.nn as pyg

import gatlib

from testing import LAYERS, kernels, random_graph


def conv(layer="GATConv", **kw):
    torch.manual_seed(0)
    return getattr(gatlib, layer)(6, 4, heads=2, **kw)


# ---------------------------------------------------------------------------
# Graph inputs stay the caller's
# ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", kernels())
def test_layer_keeps_no_edge_index_alive(backend):
    """A mini-batch loop passes a new edge_index each time: none may outlive its
    batch. Each is freed by reference counting the moment the caller drops it,
    whichever kernel ran (nothing caches derived state keyed by the tensor)."""
    m = conv(backend=backend)
    refs = []
    gc.disable()  # freed by reference counting, the moment the batch is done
    try:
        for i in range(20):
            ei = random_graph(30, 100, seed=i)
            m(torch.randn(30, 6), ei).sum().backward()
            refs.append(weakref.ref(ei))
            del ei
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


@pytest.mark.parametrize("layer", LAYERS)
def test_edge_index_rewritten_in_place_is_read_and_checked_again(layer):
    """A torch.from_numpy buffer refilled in place for the next batch (no version
    bump), or written through another view or .data: the layer computes on the
    new graph, and checks its index range again."""
    m = conv(layer)
    x = torch.randn(20, 6)
    buf = np.zeros((2, 60), dtype=np.int64)
    ei = torch.from_numpy(buf)
    outs = []
    for seed in (1, 2):
        buf[:] = random_graph(20, 60, seed=seed).numpy()
        outs.append(m(x, ei))
        torch.testing.assert_close(outs[-1], m(x, torch.from_numpy(buf.copy())))
    assert not torch.allclose(outs[0], outs[1])
    buf[0, 0] = 20
    with pytest.raises(IndexError, match="contains index 20"):
        m(x, ei)
    view = ei.view(-1)  # another tensor on the same storage, and .data
    ei.data[0, 0] = 0
    view[1] = 25
    with pytest.raises(IndexError, match="contains index 25"):
        m(x, ei)


@pytest.mark.parametrize("layer", LAYERS)
def test_editing_the_returned_edge_index_changes_no_later_call(layer):
    """The edge_index returned with the attention weights is a copy: writing to
    it reaches neither the caller's edge_index nor anything the layer keeps."""
    m = conv(layer)
    x = torch.randn(15, 6)
    ei = random_graph(15, 50, seed=4)
    out, (returned, _) = m(x, ei, return_attention_weights=True)
    returned.fill_(0)
    torch.testing.assert_close(m(x, ei), out)


# ---------------------------------------------------------------------------
# Grad modes, transforms and autocast
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("layer", LAYERS)
def test_graph_first_used_under_inference_mode_then_trains(layer, backend):
    """A graph (a plain edge_index or a GraphPlan) first used under
    inference_mode gives the same output there and trains afterwards: nothing
    derived from it is kept as an inference tensor."""
    m = conv(layer, backend=backend)
    x = torch.randn(15, 6)
    ei = random_graph(15, 50, seed=3)
    plan = gatlib.GraphPlan(ei, num_nodes=15)
    with torch.inference_mode():
        a = m(x, ei)
        b = m(x, plan)
    for g in (ei, plan):  # the same graph, now in training
        out = m(x.requires_grad_(), g)
        out.sum().backward()
        torch.testing.assert_close(out.detach(), a)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.usefixtures("auto_fused")
def test_double_backward_on_the_default_path_matches_the_reference(layer):
    """A gradient penalty through the default (fused) path equals the reference's."""
    x = torch.randn(20, 6, dtype=torch.float64)
    ei = random_graph(20, 70, seed=6)
    res = {}
    for backend in ("auto", "torch"):
        m = conv(layer, backend=backend).double()
        xx = x.clone().requires_grad_()
        with gatlib.record_kernels() as log:
            gx, = torch.autograd.grad(m(xx, ei).square().sum(), xx, create_graph=True)
            gx.square().sum().backward()
        res[backend] = [gx.detach(), *(p.grad for p in m.parameters())]
        assert log[0] == ("fused" if backend == "auto" else "torch")
    for a, b in zip(res["auto"], res["torch"], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.usefixtures("auto_fused")
def test_torch_func_grad_on_the_default_path_matches_the_reference(layer):
    """torch.func.grad of a layer's parameters runs the default (fused) kernel
    and gives the reference's gradients."""
    from torch.func import functional_call, grad

    x = torch.randn(20, 6)
    ei = random_graph(20, 70, seed=7)
    grads = {}
    for backend in ("auto", "torch"):
        m = conv(layer, backend=backend)
        params = {k: v.detach() for k, v in m.named_parameters()}
        with gatlib.record_kernels() as log:
            grads[backend] = grad(lambda p, m=m: functional_call(m, p, (x, ei)).square().sum())(params)
        assert log[0] == ("fused" if backend == "auto" else "torch")
    for k in grads["torch"]:
        torch.testing.assert_close(grads["auto"][k], grads["torch"][k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.usefixtures("auto_fused")
def test_bfloat16_autocast_on_the_default_path_matches_the_reference(layer):
    """Under CPU autocast to bfloat16 the default (fused) kernel runs, forward and
    backward, and gives the reference's output dtype and values."""
    x = torch.randn(20, 6)
    ei = random_graph(20, 70, seed=8)
    outs = {}
    for backend in ("auto", "torch"):
        m = conv(layer, backend=backend)
        with torch.autocast("cpu", dtype=torch.bfloat16), gatlib.record_kernels() as log:
            outs[backend] = m(x.requires_grad_(), ei)
            outs[backend].float().sum().backward()
        assert log[0] == ("fused" if backend == "auto" else "torch")
    assert outs["auto"].dtype == outs["torch"].dtype
    torch.testing.assert_close(outs["auto"], outs["torch"], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("layer", LAYERS)
def test_autocast_takes_features_in_the_autocast_dtype(layer, backend):
    """Under autocast a layer gets a previous layer's output in the autocast dtype while its
    own parameters stay float32 (TransformerConv's output is bfloat16 there): PyG's layer
    takes it, as F.linear does, and so does gatlib's, with PyG's output and gradients.
    Outside autocast the same input is refused, naming the dtypes."""
    m = conv(layer, backend=backend)
    theirs = getattr(pyg, layer)(6, 4, heads=2)
    theirs.load_state_dict(m.state_dict())
    x = torch.randn(20, 6).bfloat16()
    ei = random_graph(20, 70, seed=9)
    outs, grads = {}, {}
    for name, module in (("gatlib", m), ("pyg", theirs)):
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), gatlib.record_kernels() as log:
            outs[name] = module(xx, ei)
        outs[name].float().sum().backward()
        grads[name] = [xx.grad, *(p.grad for p in module.parameters())]
        if name == "gatlib":
            assert log[0] == backend
    assert outs["gatlib"].dtype == outs["pyg"].dtype
    torch.testing.assert_close(outs["gatlib"], outs["pyg"], rtol=2e-2, atol=2e-2)
    for a, b in zip(grads["gatlib"], grads["pyg"], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)
    with pytest.raises(TypeError, match="x has dtype torch.bfloat16 but the layer's parameters "
                                        "are torch.float32"):
        m(x, ei)


@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("extra", ["edge_attr", "pair", "edge_mask"])
@pytest.mark.parametrize("layer", LAYERS)
def test_autocast_across_every_optional_input(layer, extra, backend):
    """Under autocast a layer's optional inputs come in their own dtypes - float32 edge
    features beside a previous layer's bfloat16 output, a float32 destination side of a
    pair, an explainer's float32 edge mask - and PyG's layer takes them all, as F.linear
    does: so does gatlib's, with PyG's output and gradients."""
    from torch_geometric.explain.algorithm.utils import clear_masks, set_masks

    kw = dict(edge_dim=3) if extra == "edge_attr" else {}
    in_channels = (6, 6) if extra == "pair" else 6
    torch.manual_seed(0)
    ours = getattr(gatlib, layer)(in_channels, 4, heads=2, backend=backend, **kw)
    theirs = getattr(pyg, layer)(in_channels, 4, heads=2, **kw)
    theirs.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(3)
    ei = random_graph(20, 70, seed=10)
    x = torch.randn(20, 6, generator=g).bfloat16()  # a previous layer's output
    x_dst = torch.randn(20, 6, generator=g)  # the caller's own features
    edge_attr = torch.randn(70, 3, generator=g)
    mask = torch.randn(70 + (20 if layer != "TransformerConv" else 0), generator=g)
    if backend == "triton" and extra == "edge_mask":  # refused, by name
        set_masks(ours, torch.nn.Parameter(mask[:70].clone()), ei, apply_sigmoid=True)
        with pytest.raises(ValueError, match="the Triton kernels take no edge weights"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ours(x, ei)
        return
    outs, grads = {}, {}
    for name, module in (("gatlib", ours), ("pyg", theirs)):
        xs = [x.clone().requires_grad_(), x_dst.clone().requires_grad_()]
        inputs = (xs[0], xs[1]) if extra == "pair" else xs[0]
        if extra == "edge_mask":
            set_masks(module, torch.nn.Parameter(mask[:70].clone()), ei, apply_sigmoid=True)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs[name] = module(inputs, ei, edge_attr) if kw else module(inputs, ei)
        finally:
            clear_masks(module)
        outs[name].float().square().sum().backward()
        grads[name] = [t.grad for t in xs if t.grad is not None] + [p.grad for p in module.parameters()]
    assert outs["gatlib"].dtype == outs["pyg"].dtype
    torch.testing.assert_close(outs["gatlib"], outs["pyg"], rtol=3e-2, atol=3e-2)
    assert len(grads["gatlib"]) == len(grads["pyg"])
    # (the Triton backward reads the bfloat16 output, as flash attention's does: its
    # gradients round up to ~10x the reference's here, docs/gpu.md)
    atol = 0.15 if backend == "triton" else 6e-2
    for a, b in zip(grads["gatlib"], grads["pyg"], strict=True):
        scale = max(1.0, float(b.float().abs().max()))
        torch.testing.assert_close(a.float(), b.float(), rtol=6e-2, atol=atol * scale)


# ---------------------------------------------------------------------------
# Empty graphs
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
@pytest.mark.parametrize("layer", LAYERS)
def test_graph_without_nodes_or_edges_matches_pyg(layer, concat, backend):
    """Like PyG: a graph without nodes gives [0, H*C] (or [0, C]); without edges,
    the layer's output for isolated nodes. The requested kernel runs it."""
    m = conv(layer, concat=concat, backend=backend)
    theirs = getattr(pyg, layer)(6, 4, heads=2, concat=concat)
    theirs.load_state_dict(m.state_dict())
    for n in (0, 5):
        x = torch.randn(n, 6, requires_grad=True)
        ei = torch.zeros(2, 0, dtype=torch.long)
        with gatlib.record_kernels() as log:
            out = m(x, ei)
            out.sum().backward()
        assert log[0] == backend
        torch.testing.assert_close(out, theirs(x, ei))


# ---------------------------------------------------------------------------
# Kernel selection
# ---------------------------------------------------------------------------
def test_requested_kernel_that_cannot_run_raises_instead_of_falling_back():
    """A kernel that cannot run a call is never replaced by another one."""
    pytest.importorskip("triton")
    from gatlib import _triton

    C = _triton._MAX_TILE + 1  # one head of 4097 channels: a 8192-wide tile
    x = torch.randn(10, C)  # (narrower inputs would be attended in input space, F wide)
    ei = random_graph(10, 30, seed=9)
    m = gatlib.TransformerConv(C, C, backend="triton")
    with pytest.raises(ValueError, match=r"backend='triton' cannot run this call"):
        m(x, ei)


@pytest.mark.usefixtures("auto_fused")
def test_auto_records_which_kernel_ran():
    """auto picks the reference where fused cannot run — and says so."""
    m = conv()
    x = torch.randn(10, 6)
    ei = random_graph(10, 30, seed=9)
    with gatlib.record_kernels() as log:
        m(x, ei)
        torch.func.vmap(lambda t: m(t, ei))(x[None].expand(2, -1, -1))
    assert log == ["fused", "torch"]


@pytest.mark.usefixtures("auto_fused")
def test_a_backward_on_another_thread_is_recorded():
    """On CUDA autograd runs backward passes on a thread of its own, where the
    caller's record_kernels block (a context variable) is not set: the first GPU
    self-test found every fused backward missing from the log. Here the backward
    runs on a new thread (which starts without the caller's context, as CUDA's
    autograd thread does); its entry still reaches the open block, and none
    reaches a block already closed."""
    import threading

    m = conv()
    x = torch.randn(10, 6)
    ei = random_graph(10, 30, seed=9)
    with gatlib.record_kernels() as outer:
        with gatlib.record_kernels() as log:
            out = m(x, ei)
            worker = threading.Thread(target=out.sum().backward)
            worker.start()
            worker.join()
        assert log == ["fused", "fused.backward"]
        out = m(x, ei)
    worker = threading.Thread(target=out.sum().backward)
    worker.start()
    worker.join()
    assert outer == ["fused"]


# ---------------------------------------------------------------------------
# Compilation and threads
# ---------------------------------------------------------------------------
def _two_layer(module, layer):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cls = getattr(module, layer)
            self.conv1 = cls(16, 8, heads=2)
            self.conv2 = cls(16, 3, heads=1, concat=False)

        def forward(self, x, edge_index):
            return self.conv2(torch.nn.functional.elu(self.conv1(x, edge_index)), edge_index)

    torch.manual_seed(0)
    return Net()


@pytest.mark.slow
@pytest.mark.parametrize("layer", LAYERS)
def test_compiled_training_step_breaks_no_more_than_pyg(layer):
    """torch.compile of a full-batch training step splits the graph no more often
    than PyG's same model does, and computes the same loss."""
    import torch._dynamo as dynamo

    x = torch.randn(40, 16)
    ei = random_graph(40, 160, seed=10)
    if layer == "TransformerConv":  # no self-loops of its own
        ei = torch.cat([ei, torch.arange(40).repeat(2, 1)], dim=1)
    y = torch.randint(0, 3, (40,))
    counts = {}
    for name, module in (("pyg", pyg), ("gatlib", gatlib)):
        model = _two_layer(module, layer)

        def step(x, ei, model=model):
            loss = torch.nn.functional.cross_entropy(model(x, ei), y)
            loss.backward()
            return loss

        dynamo.reset()
        counts[name] = dynamo.explain(step)(x, ei).graph_break_count
    dynamo.reset()
    assert counts["gatlib"] <= counts["pyg"], counts
    if layer == "GATConv":  # inductor's compile is slow: one model is enough
        eager = step(x, ei)
        torch.testing.assert_close(torch.compile(step)(x, ei), eager)
        dynamo.reset()


def test_kernels_never_change_the_process_wide_thread_count(monkeypatch):
    """The kernels never call torch.set_num_threads (a process-wide setting)."""
    def forbidden(n):
        raise AssertionError("library code called torch.set_num_threads")

    monkeypatch.setattr(torch, "set_num_threads", forbidden)
    n = 3000  # big enough for the edge blocks of GATv2 and edge features
    ei = random_graph(n, 40000, seed=11)
    x = torch.randn(n, 6)
    for layer in LAYERS:
        m = getattr(gatlib, layer)(6, 4, heads=2, edge_dim=3, backend="fused")
        m(x, ei, torch.randn(ei.size(1), 3)).sum().backward()
