"""GraphPlan: what it derives equals a direct construction, it owns its state
(nothing aliases the caller's tensors), it does not re-sort sorted input, and it
works across grad modes, pickling and DataLoader workers."""
import pickle

import pytest
import torch
from hypothesis import given, settings
from torch_geometric import EdgeIndex
from torch_geometric.utils import add_self_loops, remove_self_loops

import gatlib
from gatlib import GraphPlan
from gatlib import _layout
from gatlib._layout import build_layout

from testing import count_sorts, graphs, random_graph

FIELDS = ["ptr", "src", "dst", "perm", "csc_ptr", "csc_edge", "csc_dst"]


def layout_by_definition(ei, n_src, n_dst):
    """CSR/CSC by their definition, in plain Python."""
    edges = list(zip(ei[0].tolist(), ei[1].tolist(), strict=True))
    order = sorted(range(len(edges)), key=lambda k: (edges[k][1], k))  # stable by destination
    pos = {k: p for p, k in enumerate(order)}
    ptr = [sum(1 for e in edges if e[1] < i) for i in range(n_dst + 1)]
    csc = sorted(range(len(edges)), key=lambda k: (edges[k][0], pos[k]))  # by source, then CSR position
    csc_ptr = [sum(1 for e in edges if e[0] < j) for j in range(n_src + 1)]
    return dict(ptr=ptr, src=[edges[k][0] for k in order], dst=[edges[k][1] for k in order],
                perm=order, csc_ptr=csc_ptr, csc_edge=[pos[k] for k in csc],
                csc_dst=[edges[k][1] for k in csc])


def assert_layout(lay, want):
    for f in FIELDS:
        assert getattr(lay, f).tolist() == want[f], f


@settings(max_examples=200, deadline=None)
@given(graph=graphs(max_nodes=9, max_edges=30, max_hub=20))
def test_layout_is_csr_and_csc_by_definition(graph):
    ei, n_src, n_dst = graph
    assert_layout(GraphPlan(ei, size=(n_src, n_dst)).layout(), layout_by_definition(ei, n_src, n_dst))


@settings(max_examples=200, deadline=None)
@given(graph=graphs(max_nodes=9, max_edges=30, max_hub=20))
def test_self_loops_merged_into_the_layout_equal_a_fresh_build(graph):
    """with_self_loops: PyG's edge list (remove_self_loops then add_self_loops), and
    a layout merged in O(E) that equals the one built from that list by sorting."""
    ei, n_src, n_dst = graph
    n = min(n_src, n_dst)
    want = add_self_loops(remove_self_loops(ei)[0], num_nodes=n)[0] if n else remove_self_loops(ei)[0]
    for merged in (True, False):
        plan = GraphPlan(ei, size=(n_src, n_dst))
        if merged:
            plan.layout()  # the base layout exists, so the looped one is merged from it
        looped = plan.with_self_loops()
        assert torch.equal(looped.edge_index, want)
        assert_layout(looped.layout(), layout_by_definition(want, n_src, n_dst))


def test_a_plan_owns_its_indices():
    """Editing the tensor a plan was built from, or the edge_index it returns,
    changes nothing in the plan or in a layer's result."""
    n = 12
    ei = random_graph(n, 40, seed=1)
    plan = GraphPlan(ei, num_nodes=n)
    conv = gatlib.GATConv(4, 3, heads=2)
    x = torch.randn(n, 4)
    before = conv(x, plan)
    ei[:, :10] = 0  # the caller's tensor, with and without a version bump
    ei.numpy()[1, 10:] = 0
    plan.edge_index.zero_()
    _, (returned, _) = conv(x, plan, return_attention_weights=True)
    returned.zero_()
    torch.testing.assert_close(conv(x, plan), before)
    assert not any(t.data_ptr() == ei.data_ptr() for t in (*plan.coo(), plan.layout().src))




def test_sorted_input_is_not_sorted_again(monkeypatch):
    """A destination-sorted edge list is used in its order: the only sort left is
    the one by source for the CSC view, when that is first read. Self-loops are
    merged, not sorted in."""
    n = 30
    ei = random_graph(n, 120, seed=2)
    ei = ei[:, ei[1].argsort(stable=True)]
    calls = count_sorts(monkeypatch)
    plan = GraphPlan(ei, num_nodes=n)
    lay = plan.layout()
    assert len(calls) == 0 and lay.perm.tolist() == list(range(ei.size(1)))
    _ = lay.csc_edge  # the CSC view, derived now
    assert len(calls) == 1
    plan.with_self_loops().layout()
    assert len(calls) == 1
    lay = GraphPlan(ei.flip(1), num_nodes=n).layout()  # unsorted: by destination
    assert len(calls) == 2
    _ = lay.csc_ptr, lay.csc_dst  # then by source, once
    assert len(calls) == 3


@pytest.mark.parametrize("order", ["col", "row"])
def test_sorted_edge_index_supplies_its_own_csc(monkeypatch, order):
    """A PyG EdgeIndex sorted by column (destination) is already our CSR; sorted
    by row, its transpose (which PyG caches on it) is. Either way the plan does
    not sort by destination, and the result equals a plain build."""
    n = 25
    ei = random_graph(n, 90, seed=3)
    e = EdgeIndex(ei, sparse_size=(n, n)).sort_by(order)[0]
    e.get_csc()  # PyG's own (cached) work
    calls = count_sorts(monkeypatch)
    lay = GraphPlan(e, num_nodes=n).layout()
    assert len(calls) == 0
    _ = lay.csc_ptr
    assert len(calls) == 1  # the CSC (by source) view only, when it is read
    plain = e.as_tensor()
    want = build_layout(plain[0], plain[1], n, n)
    for f in ("ptr", "dst", "csc_ptr", "csc_dst"):
        assert torch.equal(getattr(lay, f), getattr(want, f)), f
    # within a row the EdgeIndex may order edges its own way: compare as edge sets
    assert torch.equal(plain[0][lay.perm], lay.src.long())


def test_edge_index_size_mismatch():
    ei = EdgeIndex(torch.tensor([[0, 1], [1, 2]]), sparse_size=(3, 3))
    with pytest.raises(ValueError, match=r"EdgeIndex of sparse_size \(3, 3\) but the inputs have 4"):
        gatlib.GATConv(4, 2)(torch.randn(4, 4), ei)


def test_inferred_sizes_and_bipartite():
    ei = torch.tensor([[0, 4], [1, 2]])
    assert (GraphPlan(ei).num_src, GraphPlan(ei).num_dst) == (5, 5)
    p = GraphPlan(ei, size=(5, 3))
    assert (p.num_src, p.num_dst, p.num_edges) == (5, 3, 2)
    assert GraphPlan(torch.empty(2, 0, dtype=torch.long)).num_src == 0


def test_first_used_under_inference_mode_then_trained():
    """Everything a plan derives is a normal tensor, even when first derived
    under inference_mode, so the same plan trains afterwards."""
    n = 15
    plan = GraphPlan(random_graph(n, 50, seed=4), num_nodes=n)
    conv = gatlib.GATConv(4, 3, heads=2)
    x = torch.randn(n, 4)
    with torch.inference_mode():
        ref = conv(x, plan)
    assert not plan.layout().src.is_inference()
    out = conv(x.requires_grad_(), plan)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), ref)


def test_pickle_and_to():
    n = 10
    plan = GraphPlan(random_graph(n, 30, seed=5), num_nodes=n)
    plan.layout()
    again = pickle.loads(pickle.dumps(plan))
    assert torch.equal(again.edge_index, plan.edge_index) and again.num_src == n
    assert_layout(again.layout(), layout_by_definition(plan.edge_index, n, n))
    assert plan.to("cpu") is plan


class _Graphs(torch.utils.data.Dataset):
    """Each item: a fresh random graph run through a fused layer in the worker."""

    def __init__(self, conv):
        self.conv = conv

    def __len__(self):
        return 4

    def __getitem__(self, i):
        ei = random_graph(20, 60, seed=100 + i)
        x = torch.randn(20, 4, generator=torch.Generator().manual_seed(i))
        with torch.no_grad(), gatlib.record_kernels() as log:
            out = self.conv(x, GraphPlan(ei, num_nodes=20))
        return out, log


@pytest.mark.usefixtures("auto_fused")
def test_layers_in_dataloader_workers():
    torch.manual_seed(0)
    conv = gatlib.GATConv(4, 3, heads=2)
    ds = _Graphs(conv)
    got = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    for i, (out, log) in enumerate(got):
        assert log == ["fused"]
        torch.testing.assert_close(out, ds[i][0])


def test_no_reference_cycles():
    """A plan and what it derives are freed by reference counting alone, the
    moment they are dropped (a cycle would keep their tensors until the cyclic
    garbage collector happens to run)."""
    import gc
    import weakref

    gc.disable()
    try:
        n = 12
        plan = GraphPlan(random_graph(n, 40, seed=6), num_nodes=n)
        looped = plan.with_self_loops()
        looped.layout()
        gatlib.GATConv(4, 3, backend="fused")(torch.randn(n, 4), plan).sum().backward()
        refs = [weakref.ref(plan), weakref.ref(looped), weakref.ref(looped.layout().src)]
        del plan, looped
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_nbytes_counts_what_the_plan_derived(monkeypatch):
    n, E = 20, 60
    plan = GraphPlan(random_graph(n, E, seed=7), num_nodes=n)
    assert plan.nbytes == 2 * E * 8  # the int64 edge list
    lay = plan.layout()  # a small graph: int64 ptr [N+1], src/dst/perm [E]
    assert plan.nbytes == 2 * E * 8 + 8 * ((n + 1) + 3 * E)
    _ = lay.csc_ptr  # + int64 csc_ptr [N+1], csc_edge/csc_dst [E], derived when first read
    assert plan.nbytes == 2 * E * 8 + 8 * (2 * (n + 1) + 5 * E)
    monkeypatch.setattr(_layout, "SMALL_EDGES", E)  # as a large graph: int32, CSC with the CSR
    plan = GraphPlan(random_graph(n, E, seed=7), num_nodes=n)
    lay = plan.layout()
    assert lay.csc is not None and lay.src.dtype == torch.int32 and lay.perm.dtype == torch.int64
    assert plan.nbytes == 2 * E * 8 + 4 * (2 * (n + 1) + 4 * E) + 8 * E
    before = plan.nbytes
    gatlib.GATConv(4, 3, heads=2, backend="fused")(torch.randn(n, 4), plan)
    assert plan.nbytes > before  # + the self-loop'ed twin and its layout
