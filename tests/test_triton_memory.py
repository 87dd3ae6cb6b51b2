"""The Triton path's memory model (docs/gpu.md, "Memory of the Triton kernels"),
checked against the allocations a call makes.

Every tensor that PyTorch allocates during a forward or a backward call is
recorded by a dispatch mode — outside the kernels: inside a kernel the
interpreter's own copies stand for a GPU's registers and are not recorded.
The model's formula bounds the bytes allocated; no single temporary may be
larger than the ``[E, H]`` scores or the call's outputs and gradients; in
bfloat16, no ``[N, H, C]`` float32 tensor may appear at all.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gatlib import GraphPlan, graph_attention
from gatlib import _triton
from gatlib import _triton_schedule

from testing import HOST_SYNCS, AtenOps, hub_graph, make_score

pytest.importorskip("triton")
KINDS = ("gat", "gatv2", "dot")
OPERATORS = {"gatlib::triton_attention": _triton._attention_op,
             "gatlib::triton_attention_backward": _triton._attention_backward_op}


class Allocations(TorchDispatchMode):
    """New storages made by ATen ops (views and in-place ops make none)."""

    def __init__(self, known):
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in known}
        self.paused = False
        self.allocs = []  # (shape, dtype, bytes)
        self.launches = 0  # kernel launches while recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "gatlib":  # the kernels' operators: their own allocations too
            with self:
                out = OPERATORS[func.name()]._init_fn(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        if not self.paused:
            # a view or an in-place result shares an argument's storage
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self.seen.add(t.untyped_storage().data_ptr())
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in self.seen:
                        self.seen.add(ptr)
                        self.allocs.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return out


@pytest.fixture
def recorder(monkeypatch):
    """``recorder(known)``: an Allocations mode, paused while a kernel runs."""
    from triton.runtime.interpreter import GridExecutor

    active = []
    run = GridExecutor.__call__

    def paused_run(self, *args, **kwargs):
        if not active:
            return run(self, *args, **kwargs)
        active[-1].paused = True
        active[-1].launches += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            active[-1].paused = False

    monkeypatch.setattr(GridExecutor, "__call__", paused_run)

    def make(known):
        active.append(Allocations(known))
        return active[-1]

    return make


def model(kind, N, E, H, C, dtype, P, Q, *, alpha, att_rows=0):
    """docs/gpu.md's formula: (forward bytes, backward bytes, largest temporary)
    of one call, excluding its inputs and the graph's plan. ``P`` and ``Q`` are the
    partial-result slots of split rows and columns (fixed by the graph's sizes),
    ``att_rows`` the rows of GATv2's ``att`` partials (one per program of 16 work items)."""
    s = torch.empty((), dtype=dtype).element_size()
    a = 8 if dtype == torch.float64 else 4
    W = 1 if kind == "gat" else C  # per-node score width
    merge_f = P * H * (C + 1) * a  # split rows' partial (out, lse)
    fwd = N * H * C * s + N * H * a + (E * H * s if alpha else 0) + merge_f + 8
    # the inputs' gradients, in their dtype (GATv2 with edge features, the
    # Transformer's with its edge term also added to the values) — and
    # autograd's sum for a tensor used twice: the Transformer's edge term is its
    # value's edge term (GATv2's x_src, its value, gets one gradient: the kernel
    # sums the two)
    grads = {"gat": 2 * N * H + E * H + N * H * C,  # a_src, a_dst, a_edge, value
             "gatv2": 2 * N * H * C + E * H * C + H * C,  # x_src (= value), x_dst, e, att
             "dot": 3 * N * H * C + 2 * E * H * C + E * H * C}[kind] * s  # q, k, v, e, u
    # split rows' and columns' partial sums (GATv2: the columns' value and source
    # gradients in one)
    merge_b = (P * H * W + Q * H * (C + (0 if kind == "gatv2" else W))) * a
    # GATv2's att gradient: one [H, C] partial per program, summed, cast to att's dtype
    att_partials = att_rows * H * C * a if kind == "gatv2" else 0
    att = att_partials + H * C * a if kind == "gatv2" else 0
    galpha = (N * H + 2 * E * H) * a if alpha else 0
    # the softmax gradient per edge, [E, 2, H]: the weights and the score gradients
    bwd = 2 * E * H * a + grads + merge_b + att + galpha
    largest_temp = max(2 * E * H * a, att_partials)
    return fwd, bwd, largest_temp


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [False, True], ids=["out", "alpha"])
@pytest.mark.parametrize("kind", KINDS)
def test_allocations_follow_the_memory_model(kind, alpha, recorder, monkeypatch):
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 32)  # split rows and columns, as hubs are
    n, H, C, dtype = 60, 2, 8, torch.bfloat16
    ei = hub_graph(n, 100)
    ei = torch.cat([ei, torch.stack([torch.full((70,), 5), torch.arange(70) % n])], 1)
    E = ei.size(1)
    plan = GraphPlan(ei, num_nodes=n)
    score = make_score(kind, n, n, E, H, C, dtype=dtype, edge=True)
    value = score.src if kind == "gatv2" else torch.randn(n, H, C, dtype=dtype, requires_grad=True)
    value_edge = score.edge if kind == "dot" else None
    graph_attention(score, value, plan, n, value_edge=value_edge, backend="triton")  # derive the plan
    tplan = _triton_schedule._plan(plan)
    P, Q = tplan.dst_items.pieces, tplan.src_items.pieces
    assert int(tplan.dst_items.bounds[1]) > 0 and int(tplan.src_items.bounds[1]) > 0  # split rows
    inputs = [t for t in (*score.tensors(), value, value_edge) if t is not None]

    rec = recorder(inputs)
    with rec:
        res = graph_attention(score, value, plan, n, value_edge=value_edge, backend="triton",
                              return_attention=alpha)
    out, att = res if alpha else (res, None)
    fwd = rec.allocs
    # the forward: one launch over all the work items, one merge of the split rows
    assert rec.launches == 1 + 1 + (1 if alpha else 0)  # (+ the weights' kernel)
    outs = [out] + ([att] if alpha else [])
    grads = [torch.randn(t.shape, dtype=t.dtype) for t in outs]
    known = inputs + outs + grads
    rec = recorder(known)
    with rec:
        torch.autograd.grad(outs, inputs, grads)
    bwd = rec.allocs
    # the backward: one launch per direction and three merges (destination, value,
    # source; GATv2's value and source gradients are one)
    assert rec.launches == 2 + (2 if kind == "gatv2" else 3)
    att_rows = tplan.dst_items.items.size(0) // 16
    f_model, b_model, largest = model(kind, n, E, H, C, dtype, P, Q, alpha=alpha, att_rows=att_rows)
    f_bytes = sum(b for *_, b in fwd)
    b_bytes = sum(b for _, _, b in bwd)
    assert f_bytes <= f_model, (f_bytes, f_model, fwd)
    assert b_bytes <= b_model, (b_bytes, b_model, P, Q, E, "\n".join(map(str, bwd)))
    # the model is not vacuous: the kept buffers are most of it
    assert f_bytes >= n * H * C * 2 + n * H * 4
    assert b_bytes >= 2 * E * H * 4
    # no temporary larger than the [E, H] scores, the output or an input's gradient
    biggest_io = max(t.untyped_storage().nbytes() for t in known)
    assert max(b for *_, b in fwd + bwd) <= max(largest, biggest_io)
    # and no [N, H, C] float32 temporary (the output and gradients are bfloat16)
    assert not [a for a in fwd + bwd if a[0] == (n, H, C) and a[1] == torch.float32]


@pytest.mark.parametrize("form", ["gat", "dot_key_is_value"])
def test_values_of_one_head_are_not_copied_per_head(form, recorder):
    """A value (and the dot kind's key) of one head that every head shares, as the
    layers in input space pass it, goes to the kernels as it is: the forward allocates
    one ``[N, H, C]`` tensor, its output, and no per-head copy of the values."""
    from gatlib import EdgeScore

    n, H, C = 40, 3, 8
    ei = hub_graph(n, 60)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, C, generator=g, requires_grad=True)
    if form == "gat":
        score = EdgeScore.gat(torch.randn(n, H, generator=g), torch.randn(n, H, generator=g))
    else:
        score = EdgeScore.dot(torch.randn(n, H, C, generator=g), x)
    plan = GraphPlan(ei, num_nodes=n)
    graph_attention(score, x, plan, n, backend="triton")  # derive the plan
    rec = recorder([t for t in (*score.tensors(), x) if t is not None])
    with rec:
        out = graph_attention(score, x, plan, n, backend="triton")
    assert out.shape == (n, H * C)
    assert [a[0] for a in rec.allocs].count((n, H, C)) == 1, rec.allocs


# ATen ops that make a CUDA stream wait for the host: reading a value
# (.item(), bool(), int()), or output sizes that depend on values


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_no_host_sync_once_the_plan_exists(kind, monkeypatch):
    """A training call (dropout, attention weights with a gradient, split hubs)
    on a plan whose kernels' schedule exists reads nothing back to the host."""
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 32)
    n, H, C = 50, 2, 4
    ei = hub_graph(n, 80)
    # and a source hub: both schedules have split rows, so all four merges launch
    ei = torch.cat([ei, torch.stack([torch.full((40,), 5), torch.arange(40) % n])], 1)
    plan = GraphPlan(ei, num_nodes=n)
    score = make_score(kind, n, n, ei.size(1), H, C, dtype=torch.float32, edge=True)
    value = torch.randn(n, H, C, requires_grad=True)

    def call():
        out, att = graph_attention(score, value, plan, n, backend="triton", dropout=0.3,
                                   training=True, return_attention=True)
        return out.sum() + att.sum()

    call().backward()  # derives the plan's layout and the kernels' schedule
    merged = []  # whether each merge of split pieces was the forward's softmax merge
    merge = _triton._merge

    def counted(splits, part, out, part_lse=None, lse=None):
        if splits.size(0):  # (a graph this size can have split rows: the merge launches)
            merged.append(lse is not None)
        merge(splits, part, out, part_lse, lse)
    monkeypatch.setattr(_triton, "_merge", counted)
    with AtenOps() as ops:
        loss = call()
        loss.backward()
    assert not [op for op in ops.names if op.startswith(HOST_SYNCS)]
    assert merged == [True, False, False, False]  # forward, then 3 gradients


@pytest.mark.parametrize("hubs, expect", [
    ((), []),
    (("dst",), ["forward", "gradient"]),  # the destination gradient; no source row is split
    (("src",), ["gradient", "gradient"]),  # the value and source gradients
    (("dst", "src"), ["forward", "gradient", "gradient", "gradient"]),
])
def test_merges_launch_only_where_rows_are_split(hubs, expect, recorder, monkeypatch):
    """A plan reads once whether its schedules split any row; where neither does
    (a graph without hubs, as Cora's) no merge launches, forward or backward, and
    the launches are the three kernels' alone (the results: test_triton.py)."""
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 32)
    n, H, C = 50, 2, 4
    ring = torch.arange(n)
    ei = torch.stack([ring, (ring + 1) % n])
    if "dst" in hubs:
        ei = torch.cat([ei, torch.stack([torch.arange(40) % n, torch.zeros(40, dtype=torch.long)])], 1)
    if "src" in hubs:
        ei = torch.cat([ei, torch.stack([torch.full((40,), 5), torch.arange(40) % n])], 1)
    plan = GraphPlan(ei, num_nodes=n)
    score = make_score("gat", n, n, ei.size(1), H, C, dtype=torch.float32, edge=False)
    value = torch.randn(n, H, C, requires_grad=True)
    graph_attention(score, value, plan, n, backend="triton").sum().backward()  # reads the splits
    merged = []
    merge = _triton._merge

    def counted(splits, part, out, part_lse=None, lse=None):
        if splits.size(0):  # (the merge launches)
            merged.append("forward" if lse is not None else "gradient")
        merge(splits, part, out, part_lse, lse)
    monkeypatch.setattr(_triton, "_merge", counted)
    rec = recorder([value, *(t for t in score.tensors() if t is not None)])
    with rec:
        graph_attention(score, value, plan, n, backend="triton").sum().backward()
    assert merged == expect
    assert rec.launches == 3 + len(expect)  # a launch per kernel, and the merges
