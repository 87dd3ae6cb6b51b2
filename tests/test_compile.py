"""torch.compile keeps gatlib's fused kernels: the layers compile with
``fullgraph=True`` (no graph break) from a raw ``edge_index`` and from a
``GraphPlan``, the compiled training step runs the fused operators (their own
log entries, written as they run), and it computes what the eager step does."""

import pytest
import torch
import torch.nn.functional as F

import gatlib

from testing import LAYERS, NoHostSync, random_graph

pytestmark = pytest.mark.slow  # inductor compiles: not in the fast lane

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


@pytest.mark.parametrize("backend", ["fused", "triton"])
@pytest.mark.parametrize("as_plan", [False, True], ids=["edge_index", "plan"])
@pytest.mark.parametrize("layer", LAYERS)
def test_fullgraph_training_step_runs_the_fused_operators(layer, as_plan, backend):
    """fullgraph=True raises on any graph break; the log proves the fused operators
    ran in the compiled step (the reference, compiled into the graph instead, logs
    nothing); the loss, outputs, attention weights and gradients are the eager
    step's, dropout masks included (inductor draws them with torch's generator).
    The Triton operators run in Triton's interpreter here, opaque to the compiler as
    on a GPU. Cold plans come out of the compiled calls as they went in (see
    :func:`test_a_compiled_call_keeps_nothing_on_the_plan_it_was_given`)."""
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    model = Net(layer, backend=backend)
    x, ei, ea, bip = inputs(as_plan)
    y = torch.randint(0, 5, (N_DST,))
    names = [backend, backend, f"{backend}.backward", f"{backend}.backward"]
    with gatlib.record_kernels() as log:
        eager = run(model, x, ei, ea, bip, y)
    assert log == names
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x, ei, ea, bip = inputs(as_plan)  # a new plan: derived inside each compiled call
    cold = (_state(ei), _state(bip)) if as_plan else None
    for _ in range(2):
        with gatlib.record_kernels() as log, torch._inductor.config.patch(fallback_random=True):
            got = run(compiled, x, ei, ea, bip, y)
        assert log == names
        if as_plan:
            assert (_state(ei), _state(bip)) == cold
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
    if as_plan:  # (an eager step does change what the check above reads)
        run(model, x, ei, ea, bip, y)
        assert (_state(ei), _state(bip)) != cold


# ---------------------------------------------------------------------------
# Plans under torch.compile: a graph keeps nothing on them; one eager call warms them
# ---------------------------------------------------------------------------
def _model_on_plans(layer: str, backend: str):
    """``(model, x, plan, edge_attr, bipartite plan, labels)``: :class:`Net` on fresh plans."""
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    model = Net(layer, backend=backend)
    x, ei, ea, bip = inputs(as_plan=True)
    return model, x, ei, ea, bip, torch.randint(0, 5, (N_DST,))


def _state(plan) -> tuple:
    """What a plan holds beyond its edges: its layout (and whether that has its CSC
    view), what kernels derived, and its self-loop'ed twins' own state."""
    lay = plan._layout
    return (id(lay), lay is not None and lay.csc is not None,
            tuple((k, id(v)) for k, v in plan._derived.items()),
            tuple((k, _state(v)) for k, v in plan._loops.items()))


@pytest.mark.parametrize("backend", ["fused", "triton"])
@pytest.mark.parametrize("layer", LAYERS)
def test_a_compiled_call_keeps_nothing_on_the_plan_it_was_given(layer, backend):
    """A compiled graph's outputs are its own memory: mode="reduce-overhead" overwrites
    them at the next replay, so a layout, CSC view or schedule that a compiled call
    derived and kept on the caller's plan was read, overwritten, by the next call (on an
    H100: "accessing tensor output of CUDAGraphs that has been overwritten by a
    subsequent run"). The caller's plans come out of compiled calls as they went in:
    here warmed by an eager forward under no_grad (which derives no CSC view on these
    small graphs; the compiled backward reads one); cold plans are checked by
    :func:`test_fullgraph_training_step_runs_the_fused_operators`."""
    model, x, ei, ea, bip, y = _model_on_plans(layer, backend)
    with torch.no_grad():
        model(x, ei, ea, bip)
    before = _state(ei), _state(bip)
    # (what a call keeps on a plan is dynamo's doing, the same whichever backend compiles
    # the graph: aot_eager spares inductor's C++ compile; the step above runs inductor)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch._inductor.config.patch(fallback_random=True):
        for _ in range(2):
            with gatlib.record_kernels() as log:
                run(compiled, x, ei, ea, bip, y)
            assert log == [backend, backend, f"{backend}.backward", f"{backend}.backward"]
            assert (_state(ei), _state(bip)) == before
    torch._dynamo.reset()


def test_a_compiled_call_keeps_no_csc_view_on_a_plans_layout():
    """A small graph's layout derives its CSC view when first read; read inside a
    compiled graph, the view is that call's alone (see above)."""
    plan = gatlib.GraphPlan(random_graph(N, 300, seed=1), num_nodes=N)
    lay = plan.layout()
    assert lay.csc is None  # (small: derived when first read)

    def out_degree(plan):
        return plan.layout().csc_ptr.diff()

    got = torch.compile(out_degree, fullgraph=True)(plan)
    assert plan.layout() is lay and lay.csc is None
    torch._dynamo.reset()
    assert torch.equal(got, out_degree(plan)) and lay.csc is not None  # eager keeps it


@pytest.mark.parametrize("backend", ["fused", "triton"])
@pytest.mark.parametrize("layer", LAYERS)
def test_a_compiled_call_reads_what_an_eager_call_derived(layer, backend):
    """One eager call warms a plan: a compiled call on it then builds no layout (no layout
    operator or sort in its graph, where a cold plan's graph has them), attends over the eager self-loop'ed
    twin (the returned edges are the eager call's: the graph's own loops left out) and
    computes the eager step, edge features' loop fill included."""
    model, x, ei, ea, bip, y = _model_on_plans(layer, backend)
    eager = run(model, x, ei, ea, bip, y)  # warms ei and bip
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def sorts() -> list:
        return [str(n.target) for g in graphs for n in g.graph.nodes
                if n.op in ("call_function", "call_method")
                and ("sort" in str(n.target) or "layout" in str(n.target))]

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    got = run(compiled, x, ei, ea, bip, y)
    assert graphs and not sorts(), sorts()
    for a, b in zip(got[:3], eager[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch.equal(got[3], eager[3])
    for a, b in zip(got[4], eager[4], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    graphs.clear()
    torch._dynamo.reset()
    run(torch.compile(model, backend=backend, fullgraph=True), *inputs(as_plan=True), y)
    assert sorts()  # a cold plan's graph builds its layouts
    torch._dynamo.reset()


@pytest.mark.parametrize("layer", LAYERS)
def test_dynamic_sizes_training_step_on_triton(layer):
    """With dynamic sizes (dynamo's choice once a size changes, or dynamic=True)
    the Triton operators' fake functions see SymInts: a set of them (the backward's
    summed parameter gradients) raised on the first GPU run. The dynamic step gives
    the eager step's loss and gradients. The fake functions run in AOTAutograd's trace,
    whichever backend compiles it: inductor compiles one layer's step, aot_eager the
    others' (inductor's C++ compile adds nothing an operator's fake function sees)."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    model = Net(layer, backend="triton")
    for conv in (model.conv1, model.conv2):  # (a bias the kernels add and differentiate)
        if getattr(conv, "bias", None) is not None:
            torch.nn.init.normal_(conv.bias)
    x, ei, ea, bip = inputs(as_plan=False)
    y = torch.randint(0, 5, (N_DST,))
    eager = run(model, x, ei, ea, bip, y)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True,
                             backend="inductor" if layer == "GATv2Conv" else "aot_eager")
    # dynamic=True makes the layers' float attributes (dropout, slope) symbolic too; the
    # operators take them as Python floats, so dynamo would trace once, specialise them and
    # trace again. Specialised from the start, the graph is the one that second trace makes.
    with gatlib.record_kernels() as log, torch._inductor.config.patch(fallback_random=True), \
            torch._dynamo.config.patch(specialize_float=True):
        got = run(compiled, x, ei, ea, bip, y)
    torch._dynamo.reset()
    assert log == ["triton", "triton", "triton.backward", "triton.backward"]
    torch.testing.assert_close(got[0], eager[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(got[4], eager[4], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Mini-batches: a new graph of another size every call
# ---------------------------------------------------------------------------
def test_neighbor_loader_batches_recompile_a_bounded_number_of_times():
    """20 NeighborLoader batches (sizes change every batch) through one compiled
    model: dynamo compiles the first batch for its sizes, then once more with the
    node and edge counts dynamic, and again only where a size crosses one of the
    kernels' size rules (auto's switch, the layout's index width); the fused
    operators run on every batch."""
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader

    n = 3000
    g = torch.Generator().manual_seed(0)
    data = Data(x=torch.randn(n, F_IN, generator=g), edge_index=random_graph(n, 15000, seed=3),
                num_nodes=n)
    loader = NeighborLoader(data, num_neighbors=[10, 5], batch_size=32, shuffle=True,
                            generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = Net("GATConv")
    compiles = []

    def backend(gm, example_inputs):  # counts dynamo's compiles; runs the captured graph
        compiles.append(len(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model.conv1, backend=backend, fullgraph=True)
    sizes = set()
    for i, batch in zip(range(20), loader, strict=False):
        ea = torch.randn(batch.edge_index.size(1), D)
        with gatlib.record_kernels() as log:
            out = compiled(batch.x, batch.edge_index, ea)
            out.sum().backward()
        assert log == ["fused", "fused.backward"], (i, log)
        sizes.add((batch.num_nodes, batch.edge_index.size(1)))
    torch._dynamo.reset()
    assert len(sizes) >= 15  # the sizes did change
    assert len(compiles) <= 3, compiles


@pytest.mark.parametrize("as_plan", [False, True], ids=["edge_index", "plan"])
@pytest.mark.parametrize("backend", ["fused", "triton"])
@pytest.mark.parametrize("layer", LAYERS)
def test_new_graph_sizes_compile_twice(layer, backend, as_plan):
    """A compiled layer's training call on graphs of 8 sizes (new node and edge counts
    every call, as mini-batches; all on one side of every size rule): dynamo compiles
    the first sizes, then once more with them dynamic, and the dynamic graph holds for
    every later size. Each of these once fixed a size in the graph, so that every new
    one recompiled up to dynamo's limit and then ran eager: torch 2.11's dynamo at an
    ``out=`` product in the projection backward of GATv2Conv and TransformerConv
    (``tests/test_older_torch.py`` runs this file there); the Triton schedule, at an
    index of its last column and at rows padded only where ``M`` was not aligned; a new
    ``GraphPlan``'s self-loop'ed twin, kept under its node count as a dict key."""
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    conv = getattr(gatlib, layer)(F_IN, 4, heads=2, backend=backend)
    compiles = []

    def count(gm, example_inputs):  # counts dynamo's compiles; runs the captured graph
        compiles.append(len(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(conv, backend=count, fullgraph=True)
    for i in range(8):
        n, e = 40 + 23 * i, 90 + 61 * i + 9 * i * i  # (from the 4th, room for split rows)
        x, graph = torch.randn(n, F_IN, requires_grad=True), random_graph(n, e, seed=i)
        with gatlib.record_kernels() as log:
            compiled(x, gatlib.GraphPlan(graph, num_nodes=n) if as_plan else graph).sum().backward()
        assert log == [backend, f"{backend}.backward"], (i, log)
    torch._dynamo.reset()
    assert len(compiles) == 2, compiles


# ---------------------------------------------------------------------------
# CUDA graphs: a warmed step reads nothing back to the host
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["fused", "triton"])
def test_warmed_training_step_on_a_plan_reads_nothing_back(backend):
    """What CUDA graph capture (and torch.compile's reduce-overhead mode) needs: a
    training step's forward and backward on a GraphPlan whose layouts exist reads
    no tensor value back to the host — no item(), nonzero or bool(tensor) around
    the kernels, dropout included. The fused CPU operators run below the mode (on
    CPU their own reads are no device sync); the Triton kernels run in Triton's
    CPU interpreter here, and on a GPU the self-test captures the step. (Adam's
    capturable mode, which the captured step also needs, runs on GPUs only.)"""
    if backend == "triton":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    model = Net("GATConv", backend=backend)
    x, ei, ea, bip = inputs(as_plan=True)
    y = torch.randint(0, 5, (N_DST,))
    run(model, x, ei, ea, bip, y)  # warm: the plans derive their layouts and schedules
    with gatlib.record_kernels() as log, NoHostSync():
        run(model, x, ei, ea, bip, y)
    assert log == [backend, backend, f"{backend}.backward", f"{backend}.backward"]


def test_auto_compiles_its_size_rule():
    """Compiled, ``backend="auto"`` follows the same size rule as eager: the fused
    operators from FUSED_CPU_MIN_ENTRIES [E, H, C] entries on (they log as they
    run), the reference below (compiled into the graph: no log entry)."""
    from gatlib._dispatch import FUSED_CPU_MIN_ENTRIES

    H, C, n = 4, F_IN, 600  # (C > F_IN would attend the inputs: E*H*F_IN entries)
    torch.manual_seed(0)
    conv = gatlib.GATConv(F_IN, C, heads=H)
    compiled = torch.compile(conv, fullgraph=True)
    for e, fused in ((FUSED_CPU_MIN_ENTRIES // (H * C) - n - 100, False),
                     (FUSED_CPU_MIN_ENTRIES // (H * C) - n + 100, True)):
        x, ei = torch.randn(n, F_IN), random_graph(n, e, seed=4, self_loops=False)
        with gatlib.record_kernels() as log:
            out = compiled(x, ei)
            out.sum().backward()
        assert log == (["fused", "fused.backward"] if fused else []), (e, log)
        torch.testing.assert_close(out, conv(x, ei), rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("layer", LAYERS)
def test_compiled_inference_runs_the_fused_operator(layer):
    """Under no_grad (evaluation, layer-wise inference) the compiled layer calls the
    forward operator alone, and gives the eager output."""
    torch.manual_seed(0)
    conv = getattr(gatlib, layer)(F_IN, 4, heads=2, backend="fused").eval()
    x, ei, _, _ = inputs(as_plan=False)
    compiled = torch.compile(conv, fullgraph=True)
    with torch.no_grad(), gatlib.record_kernels() as log:
        got = compiled(x, ei)
    assert log == ["fused"]
    with torch.no_grad():
        torch.testing.assert_close(got, conv(x, ei), rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
