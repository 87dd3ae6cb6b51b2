"""The fused Triton kernels (gatlib._triton) against the pure-PyTorch reference.

Without a GPU the kernels run in Triton's CPU interpreter on CPU tensors
(slow: the graphs here are small); with CUDA the same tests run on the GPU.
"""
import functools
import os

import torch

# Without CUDA the kernels run in Triton's interpreter, which must be switched on
# before triton is first imported: jit functions, triton.language's own included,
# are built for one mode when they are defined (torch_geometric imports triton,
# so this must precede gatlib too). tests/conftest.py does it for the session;
# repeated here so the module states its own requirement.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

triton = pytest.importorskip("triton")

import gatlib  # noqa: E402
from gatlib import EdgeScore, GraphPlan, _triton, _triton_schedule, graph_attention  # noqa: E402
from gatlib._core import reference_attention  # noqa: E402
from tools import internals  # noqa: E402

from testing import (DEVICE, KINDS, LOW_PRECISION, LOW_PRECISION_BOUND, dtype_id, graph_case,  # noqa: E402
                     graphs, hub_graph, leaves, low_precision_errors, make_score, record_launches, record_tiles, run)

TOL = dict(rtol=1e-4, atol=1e-5)


def compare(score, value, ei, n_dst, value_edge=None, tol=TOL, **kw):
    """Triton against the reference: outputs, weights and every gradient."""
    got = run("triton", score, value, ei, n_dst, value_edge, **kw)
    ref = run("torch", score, value, ei, n_dst, value_edge, **kw)
    (out, alpha, grads), (out_r, alpha_r, grads_r) = got, ref
    torch.testing.assert_close(out, out_r, **tol)
    torch.testing.assert_close(alpha, alpha_r, **tol)
    for a, b in zip(grads, grads_r, strict=True):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            torch.testing.assert_close(a, b, **tol)
    return out


# ---------------------------------------------------------------------------
# Fused forward, alpha and backward against the reference.
# ---------------------------------------------------------------------------
CASES = [  # (graph, heads, edge features + value_edge)
    ("random", 1, False),
    ("random", 3, True),
    ("bipartite", 3, False),
    ("hub", 2, True),
    ("isolated", 3, True),
    ("duplicates", 1, True),
    ("unsorted", 2, False),
    ("empty", 3, True),
    ("no_nodes", 2, True),
    ("no_sources", 2, True),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,H,edge", CASES, ids=[f"{g}-H{h}-{'edge' if e else 'no_edge'}"
                                                     for g, h, e in CASES])
def test_matches_reference(kind, name, H, edge):
    C = 5  # not a power of two: padded channels must stay masked
    ei, n_src, n_dst = graph_case(name, DEVICE)
    E = ei.size(1)
    score = make_score(kind, n_src, n_dst, E, H, C, edge=edge, dtype=torch.float32, device=DEVICE)
    v = torch.randn(n_src, H, C, device=DEVICE, requires_grad=True)
    ve = torch.randn(E, H, C, device=DEVICE, requires_grad=True) if edge else None
    out = compare(score, v, ei, n_dst, ve)
    has_in = torch.zeros(n_dst, dtype=torch.bool, device=DEVICE)
    has_in[ei[1]] = True
    assert out[~has_in].abs().sum() == 0  # no in-edges -> zeros, not NaN


def test_without_alpha_and_without_dst_term():
    """return_attention=False skips the alpha pass; GAT may lack a_dst."""
    ei, n_src, n_dst = graph_case("random", DEVICE)
    s = make_score("gat", n_src, n_dst, ei.size(1), 2, 4, edge=False, dtype=torch.float32, device=DEVICE)
    score = EdgeScore.gat(s.src, None)
    v = torch.randn(n_src, 2, 4, device=DEVICE, requires_grad=True)
    with gatlib.record_kernels() as log:
        out = graph_attention(score, v, ei, n_dst, backend="triton")
        grads = torch.autograd.grad(out.square().sum(), [v, score.src])
    assert log == ["triton", "triton.backward"]
    ref = graph_attention(score, v, ei, n_dst, backend="torch")
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(grads, torch.autograd.grad(ref.square().sum(), [v, score.src]), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_aliased_value_and_edge_tensors():
    """GATv2 layers pass x_src as the value, Transformer layers the edge term as
    value_edge: the kernels load them once and the gradients still add up."""
    ei, n_src, n_dst = graph_case("bipartite", DEVICE)
    E, H, C = ei.size(1), 2, 6
    s2 = make_score("gatv2", n_src, n_dst, E, H, C, edge=False, dtype=torch.float32, device=DEVICE)
    compare(s2, s2.src, ei, n_dst)  # x_src's two gradients summed in the kernel
    hub, n_hub, _ = graph_case("hub", DEVICE)
    hub = hub.flip(0)  # ... also over split source rows: node 0 sends 600 edges
    s3 = make_score("gatv2", n_hub, n_hub, hub.size(1), H, C, edge=True, dtype=torch.float64,
                    device=DEVICE)
    compare(s3, s3.src, hub, n_hub)
    sd = make_score("dot", n_src, n_dst, E, H, C, edge=True, dtype=torch.float32, device=DEVICE)
    v = torch.randn(n_src, H, C, device=DEVICE, requires_grad=True)
    compare(sd, v, ei, n_dst, sd.edge)


@pytest.mark.parametrize("kind", KINDS)
def test_inputs_that_start_off_16_bytes(kind):
    """Inputs that do not start on 16 bytes (a layer's projections cut from one product, at
    some node counts) are computed as aligned ones are: the operators copy them, so Triton's
    alignment specialisation sees one case (tests/test_gpu_tools.py counts the compiles)."""
    ei, n_src, n_dst = graph_case("random", DEVICE)
    E, H, C = ei.size(1), 2, 7

    def off(t):  # the same values, starting one element (4 bytes) into a buffer
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=DEVICE)
        view = buf[1:].view(t.shape).copy_(t.detach())
        assert view.data_ptr() % 16 != 0 and view.is_contiguous()
        return view.requires_grad_()
    s = make_score(kind, n_src, n_dst, E, H, C, edge=False, dtype=torch.float32, device=DEVICE)
    score = s.with_tensors(*(None if t is None else off(t) for t in s.tensors()))
    compare(score, off(torch.randn(n_src, H, C)), ei, n_dst)


@pytest.mark.parametrize("kind", KINDS)
def test_split_hubs_and_gpu_tiles(kind, monkeypatch):
    """Rows and source columns longer than _SPLIT are cut into pieces merged afterwards, with
    a GPU config pinned (the first of each kernel's space: few items per program, so a hub's
    pieces and short rows fall into many programs)."""
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 32)
    monkeypatch.setattr(_triton_schedule, "_PINNED", 0)
    n, H, C = 40, 2, 3
    ei = hub_graph(n, 120).to(DEVICE)  # in-hub 0
    out_hub = torch.stack([torch.full((50,), 7), torch.arange(50) % n])  # out-hub 7
    ei = torch.cat([ei, out_hub.to(DEVICE)], dim=1)
    plan = GraphPlan(ei, num_nodes=n)
    tplan = _triton_schedule._plan(plan)
    for items in (tplan.dst_items, tplan.src_items):
        n_items, n_split = items.bounds.tolist()
        assert n_split > 0 and n_items == int((items.items[:, 2] >= 0).sum())
    E = ei.size(1)
    score = make_score(kind, n, n, E, H, C, edge=True, dtype=torch.float32, device=DEVICE)
    v = torch.randn(n, H, C, device=DEVICE, requires_grad=True)
    ve = torch.randn(E, H, C, device=DEVICE, requires_grad=True)
    tiles = record_tiles(monkeypatch)
    compare(score, v, plan, n, ve)
    assert set(tiles) == {"_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel"}
    for name, kw in tiles.items():
        space = _triton_schedule._space(name, kw)
        assert (kw["BLOCK_R"], kw["num_warps"], kw["num_stages"]) == (
            space[0].kwargs["BLOCK_R"], space[0].num_warps, space[0].num_stages), name


def test_huge_logits_stay_finite():
    ei, n_src, n_dst = graph_case("random", DEVICE)
    s = make_score("dot", n_src, n_dst, ei.size(1), 2, 4, edge=False, dtype=torch.float32,
                   device=DEVICE, scale=30.0)  # logits ~1e3
    v = torch.randn(n_src, 2, 4, device=DEVICE)
    out = compare(s, v, ei, n_dst, tol=dict(rtol=1e-3, atol=1e-2))  # gradients scale with the logits
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------
# gradcheck (float64) of the autograd function, split pieces included; second order.
# ---------------------------------------------------------------------------
def _small_graph():
    return torch.tensor([[0, 1, 2, 3, 4, 4, 1, 2, 0, 0],  # duplicate 4->1, node 3 without in-edges
                         [0, 0, 0, 0, 1, 1, 1, 2, 2, 0]], device=DEVICE)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind, monkeypatch):
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 3)  # rows of 4+ edges are merged pieces
    n_src, n_dst, H, C = 5, 4, 2, 3
    ei = _small_graph()
    E = ei.size(1)
    score = make_score(kind, n_src, n_dst, E, H, C, device=DEVICE)
    v = torch.randn(n_src, H, C, dtype=torch.float64, device=DEVICE, requires_grad=True)
    ve = torch.randn(E, H, C, dtype=torch.float64, device=DEVICE, requires_grad=True)

    def f(v, ve, *ts):
        it = iter(ts)
        s = score.with_tensors(*(None if t is None else next(it) for t in score.tensors()))
        return graph_attention(s, v, ei, n_dst, value_edge=ve, backend="triton",
                               return_attention=True)  # alpha's gradient is checked too

    with gatlib.record_kernels() as log:
        assert torch.autograd.gradcheck(f, (v, ve, *leaves(score)), fast_mode=True)
    assert "triton" in log and "triton.backward" in log


def test_gradcheck_with_dropout():
    """With the seed fixed, dropout is a fixed mask and the function is smooth:
    gradcheck passes only if the backward regenerates the forward's mask."""
    n_src, n_dst, H, C = 5, 4, 2, 3
    ei = _small_graph()[:, :9]
    score = make_score("dot", n_src, n_dst, ei.size(1), H, C, device=DEVICE)
    v = torch.randn(n_src, H, C, dtype=torch.float64, device=DEVICE, requires_grad=True)

    def f(v, q, k, e):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same dropout seed on every call
            return graph_attention(EdgeScore.dot(q, k, e, score.scale), v, ei, n_dst, value_edge=e,
                                   dropout=0.5, training=True, backend="triton")

    assert torch.autograd.gradcheck(f, (v, score.dst, score.src, score.edge), fast_mode=True)


# ---------------------------------------------------------------------------
# Values and keys of one head that every head shares (the layers' input space).
# ---------------------------------------------------------------------------
ONE_HEAD_FORMS = ["gat", "dot", "dot_key_is_value", "dot_key_only"]


def _one_head_call(form, n, n_dst, H, C, dtype, seed=0):
    """``(score, value)`` with the value (and the dot kind's key) of one head:
    GATConv in input space ("gat"), TransformerConv's ("dot_key_is_value": its key
    and value are the inputs x_j), a key and a value of one head each ("dot"), and
    a key of one head with values of H ("dot_key_only")."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()

    if form == "gat":
        return EdgeScore.gat(r(n, H), r(n_dst, H), None, 0.2), r(n, 1, C)
    key = r(n, 1, C)
    score = EdgeScore.dot(r(n_dst, H, C), key, None, 1 / C ** 0.5)
    value = {"dot": lambda: r(n, 1, C), "dot_key_is_value": lambda: key,
             "dot_key_only": lambda: r(n, H, C)}[form]()
    return score, value


@pytest.mark.parametrize("form", ONE_HEAD_FORMS)
def test_values_and_keys_of_one_head_are_read_in_place(form, monkeypatch):
    """A value or key ``[N, 1, C]`` goes to the kernels as it is — no copy per head:
    each item reads row ``j`` for every head (ONE_V, ONE_K), and its gradient is the
    heads' sum — over split rows both ways."""
    hub, n, _ = graph_case("hub", DEVICE)
    ei = torch.cat([hub, hub.flip(0)], 1)  # node 0 receives and sends 600 edges: split rows
    H, C = 3, 5
    score, value = _one_head_call(form, n, n, H, C, torch.float64)
    launched = record_launches(monkeypatch)
    compare(score, value, ei, n, tol=dict(rtol=1e-9, atol=1e-9))
    one_k, one_v = form != "gat", form != "dot_key_only"
    row_kernels = [c for k, c in launched if k in ("_fwd_kernel", "_bwd_dst_kernel")]
    assert len(row_kernels) == 2
    assert all(c["ONE_K"] == one_k and c["ONE_V"] == one_v for c in row_kernels), row_kernels
    assert all(c["SHARE_V"] == (form == "dot_key_is_value") for c in row_kernels)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["gat", "dot_key_is_value"])
def test_one_head_values_gradcheck(form, monkeypatch):
    """gradcheck (float64) of the one-head forms, split pieces and dropout included."""
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 3)
    ei = _small_graph()
    n_src, n_dst, H, C = 5, 4, 2, 3
    score, value = _one_head_call(form, n_src, n_dst, H, C, torch.float64)
    shared = value is score.src

    def f(p, v, *ts):
        it = iter(ts)
        s = score.with_tensors(*(None if t is None else v if shared and t is value else next(it)
                                 for t in score.tensors()))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same dropout seed on every call
            return graph_attention(s, v, ei, n_dst, backend="triton", dropout=p, training=True,
                                   return_attention=True)

    ts = [t for t in leaves(score) if not (shared and t is value)]
    with gatlib.record_kernels() as log:
        for p in (0.0, 0.5):
            assert torch.autograd.gradcheck(functools.partial(f, p), (value, *ts), fast_mode=True)
    assert "triton" in log and "triton.backward" in log


def test_second_order_matches_the_reference():
    """create_graph=True: the backward differentiates the reference with the kernels'
    own dropout mask, so a gradient penalty equals the reference's."""
    n_src, n_dst, H, C = 5, 4, 2, 3
    ei = _small_graph()
    res = {}
    for backend in ("torch", "triton"):
        s = make_score("gatv2", n_src, n_dst, ei.size(1), H, C, device=DEVICE, seed=3)
        torch.manual_seed(0)
        v = torch.randn(n_src, H, C, dtype=torch.float64, device=DEVICE, requires_grad=True)
        with gatlib.record_kernels() as log:
            out = graph_attention(s, v, ei, n_dst, backend=backend)
            gv, = torch.autograd.grad(out.square().sum(), v, create_graph=True)
            gsrc, = torch.autograd.grad(gv.square().sum(), s.src)
        res[backend] = (gv.detach(), gsrc)
        if backend == "triton":
            assert "triton.backward:reference" in log
    for a, b in zip(res["triton"], res["torch"], strict=True):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------
# Attention dropout: one Philox mask, shared by forward and backward.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_dropout_mask_is_consistent(kind):
    p = 0.4
    ei, n_src, n_dst = graph_case("random", DEVICE)
    plan = GraphPlan(ei, num_nodes=n_src)
    E, H, C = ei.size(1), 3, 4
    score = make_score(kind, n_src, n_dst, E, H, C, dtype=torch.float32, device=DEVICE)
    v = torch.randn(n_src, H, C, device=DEVICE, requires_grad=True)
    torch.manual_seed(123)
    out, alpha, grads = run("triton", score, v, plan, n_dst, dropout=p, training=True)
    torch.manual_seed(123)
    keep = internals.dropout_keep_mask(plan, H, p, _triton._draw_seed(torch.device(DEVICE)))  # [E, H]
    assert abs(keep.float().mean().item() - (1 - p)) < 0.07
    src, dst = plan.coo()
    ins = [v, *leaves(score)]
    with torch.enable_grad():
        ref, alpha_ref = reference_attention(score, v, src, dst, n_dst, drop=keep / (1 - p))
        ref = ref.reshape(n_dst, -1)
        g = torch.Generator().manual_seed(11)
        w = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(ref)
        loss = (ref * w).sum() + (alpha_ref * alpha_ref.detach().cos()).sum()
        grads_ref = torch.autograd.grad(loss, ins)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(alpha, alpha_ref, **TOL)  # before dropout
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    torch.manual_seed(123)
    again = graph_attention(score, v, plan, n_dst, dropout=p, training=True, backend="triton")
    torch.testing.assert_close(again, out, rtol=0, atol=0)  # reproducible under manual_seed
    other = graph_attention(score, v, plan, n_dst, dropout=p, training=True, backend="triton")
    assert not torch.equal(other, out)  # a fresh seed per call
    evald = graph_attention(score, v, plan, n_dst, dropout=p, training=False, backend="triton")
    torch.testing.assert_close(evald, graph_attention(score, v, plan, n_dst, backend="torch"), **TOL)


# ---------------------------------------------------------------------------
# Low precision: bounded against float64, as every path is (tests/test_core.py).
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_bound(kind, dtype):
    errs = low_precision_errors(kind, dtype, "triton", n=80, edges=600, hub=300, device=DEVICE)
    assert max(errs) <= LOW_PRECISION_BOUND["triton"], errs


# ---------------------------------------------------------------------------
# Scheduling and declines (plain PyTorch, fast).
# ---------------------------------------------------------------------------
def test_schedule_covers_every_edge_once_longest_first():
    deg = torch.tensor([0, 3, 40, 1, 0, 17, 5, 300, 2, 129])
    ptr = torch.cat([torch.zeros(1, dtype=torch.long), deg.cumsum(0)])
    E = int(ptr[-1])
    (items,) = _triton_schedule._build_schedules([ptr], E, 64)
    # sizes from (N, E) alone: room for N + E // 64 items (padded), E // 65 split rows
    assert items.items.shape == (_triton_schedule._padded(deg.numel() + E // 64), 4)
    assert items.splits.shape == (min(10, E // 65), 3)
    row, start, length, slot = items.items.long().unbind(1)  # an item's fields
    assert (length[:-1] >= length[1:]).all()  # longest first, the unused room (-1) last
    bounds = items.bounds.tolist()
    W = bounds[0]
    assert (length[:W] >= 0).all() and (length[W:] == -1).all()
    assert length.max() <= 64
    covered = torch.zeros(E, dtype=torch.long)
    for r, s, n in zip(row[:W].tolist(), start[:W].tolist(), length[:W].tolist(), strict=True):
        assert ptr[r] <= s and s + n <= ptr[r + 1]
        covered[s:s + n] += 1
    assert (covered == 1).all()
    assert sorted(set(row[:W].tolist())) == list(range(deg.numel()))  # empty rows too
    # the 300-edge row is 5 pieces and the 129-edge row 3, with consecutive slots in
    # row order; the other rows are whole
    assert bounds[1] == 2
    assert items.splits[:2].tolist() == [[7, 0, 5], [9, 5, 3]]  # (row, first slot, pieces)
    assert (items.splits[2:, 2] <= 1).all()  # the other rows: not merged
    assert sorted(slot[slot >= 0].tolist()) == list(range(8))
    for r, first, count in ((7, 0, 5), (9, 5, 3)):
        assert sorted(slot[:W][row[:W] == r].tolist()) == list(range(first, first + count))
    assert items.pieces >= 8


def _schedule_reference(deg, split):
    """The schedule of rows of ``deg`` edges, written out item by item: each row is
    ``max(1, ceil(d / split))`` pieces; a split row's pieces take consecutive slots in
    row order; items longest first (ties in row order), the room after them of length
    -1 and slot -1 at row ``n``; bounds: the items, the split rows; the
    split rows in row order, then the other rows, with each row's first slot (the
    split pieces before it) and piece count."""
    n, ptr, items, slot0, pieces = len(deg), 0, [], [], []
    slots = 0
    for r, d in enumerate(deg):
        k = max(1, -(-d // split))
        slot0.append(slots)
        pieces.append(k)
        for j in range(k):
            items.append((r, ptr + j * split, min(d - j * split, split), slots + j if k > 1 else -1))
        slots += k if k > 1 else 0
        ptr += d
    items.sort(key=lambda item: -item[2])  # (stable)
    bounds = [len(items), sum(k > 1 for k in pieces)]
    order = [r for r in range(n) if pieces[r] > 1] + [r for r in range(n) if pieces[r] == 1]
    return items, bounds, order, slot0, pieces


@pytest.mark.parametrize("split", [4, 64, 256])
def test_schedule_is_its_item_by_item_definition(split):
    """The schedules (built side by side, their ops merged, to launch fewer kernels on a new
    graph) against the definition written out row by row: alone and in pairs over the
    same edges with as many rows or fewer (a bipartite graph's CSR and CSC), on rows of 0
    to 2,000 edges, exact multiples of the split among them, int32 and int64 offsets,
    and no rows at all."""
    gen = torch.Generator().manual_seed(split)

    def spread(E, n):  # n rows over E edges, one of them a hub
        if n == 0:
            return []
        idx = torch.randint(0, n, (E,), generator=gen)
        idx[:E // 3] = n // 2
        return torch.bincount(idx, minlength=n).tolist()

    graphs = [[[]], [[0]], [[split]], [[2 * split, 0, split + 1]], [[0, 0, 0]]]
    for n in (1, 7, 40):
        graphs += [[torch.randint(0, 6, (n,), generator=gen).tolist()],
                   [torch.randint(0, 3 * split, (n,), generator=gen).tolist()],
                   [[*torch.randint(0, 20, (n,), generator=gen).tolist(), 2000]]]
    for E, na, nb in ((0, 0, 3), (900, 40, 40), (900, 40, 7), (3000, 3, 50), (2 * split, 1, 2)):
        graphs.append([spread(E, na), spread(E, nb)])
    for i, pair in enumerate(graphs):
        ptrs = [torch.tensor([0, *torch.tensor(deg, dtype=torch.long).cumsum(0).tolist()])
                for deg in pair]
        ptrs = [q.int() for q in ptrs] if i % 2 else ptrs
        E = int(ptrs[0][-1])
        for deg, s in zip(pair, _triton_schedule._build_schedules(ptrs, E, split), strict=True):
            items, bounds, order, slot0, pieces = _schedule_reference(deg, split)
            n, W = len(deg), len(items)
            assert s.bounds.tolist() == bounds, deg
            # the room: from the sizes alone, padded to whole programs
            assert s.items.shape == (_triton_schedule._padded(n + E // split), 4), deg
            got = s.items.t().long()  # [row, start, length, slot]
            assert got[:, :W].t().tolist() == [list(item) for item in items], deg
            room = got[:, W:]
            assert (room[0] >= n).all() and (room[2] == -1).all() and (room[3] == -1).all(), deg
            S = s.splits.size(0)
            assert s.splits.tolist() == [[r, slot0[r], pieces[r]] for r in order[:S]], deg
            # each array starts on 16 bytes (Triton specialises on it)
            assert s.items.data_ptr() % 16 == 0 and s.splits.data_ptr() % 16 == 0


def test_unsupported_calls_raise_with_the_reason():
    """What the kernels cannot run is said, not handed to another kernel."""
    ei, n_src, n_dst = graph_case("random", DEVICE)
    wide = make_score("dot", n_src, n_dst, ei.size(1), 3, _triton._MAX_TILE // 4 + 1, edge=False,
                      dtype=torch.float32, device=DEVICE, requires_grad=False)
    v = torch.randn(n_src, 3, 8, device=DEVICE)
    assert "at most" in _triton.unsupported(wide, v, None)
    with pytest.raises(ValueError, match=r"backend='triton' cannot run this call: .*at most 4096 "
                                         r"\(padded\) heads x channels per row; got 3 heads of 1025"):
        graph_attention(wide, v, ei, n_dst, backend="triton")
    fits = make_score("dot", n_src, n_dst, ei.size(1), 1, 4096, edge=False, dtype=torch.float32,
                      device=DEVICE, requires_grad=False)
    assert _triton.unsupported(fits, torch.randn(n_src, 1, 4096, device=DEVICE), None) is None


# ---------------------------------------------------------------------------
# Property test over drawn graphs (fewer examples: the interpreter is slow).
# ---------------------------------------------------------------------------
@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graphs(max_nodes=8, max_edges=25, max_hub=300), H=st.integers(1, 3),
       kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16))
def test_property_triton_is_the_reference(graph, H, kind, seed):
    """Any drawn graph (hubs beyond one _SPLIT piece included): the kernels equal
    the reference in float64 — outputs, weights and gradients."""
    ei, n_src, n_dst = graph
    ei = ei.to(DEVICE)
    s = make_score(kind, n_src, n_dst, ei.size(1), H, 3, seed=seed, device=DEVICE)
    v = torch.randn(n_src, H, 3, dtype=torch.float64, device=DEVICE, requires_grad=True)
    compare(s, v, ei, n_dst, tol=dict(rtol=1e-9, atol=1e-9))


def test_kernel_arguments_do_not_shadow_the_launch_binder():
    """Triton's launch binder is generated Python with locals of its own
    (``triton.runtime.jit.create_function_from_signature`` in Triton 3.5-3.9); a
    kernel argument of the same name cannot be launched on a GPU. An argument
    called ``params`` made every real launch of the four main kernels fail,
    unseen by the interpreter, which binds no arguments (found by compiling the
    kernels without a GPU).
    tests/test_triton_compile.py runs the real binder; this is its fast guard."""
    binder_locals = {"params", "specialization", "options", "backend", "specialize_impl",
                     "JITCallable"}
    from gatlib import _triton_kernels

    kernels = [v for v in vars(_triton_kernels).values() if hasattr(v, "arg_names") and hasattr(v, "fn")]
    assert {k.__name__ for k in kernels} >= {"_fwd_kernel", "_alpha_kernel", "_keep_kernel",
                                             "_bwd_dst_kernel", "_bwd_src_kernel", "_merge_kernel"}
    for k in kernels:
        assert not binder_locals & set(k.arg_names), (k.__name__, binder_locals & set(k.arg_names))


# ---------------------------------------------------------------------------
# GATv2's att gradient: per program of 16 work items, in item order.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_parameter_gradients_and_output_bias_over_split_rows(kind, monkeypatch):
    """GATv2's att gradient (summed per program of ``_ATT_ROWS`` items), the output bias the
    dispatcher adds and every other gradient equal the reference's in float64, over a hub
    whose row is split in ten and rows without in-edges (which are the bias alone); and the
    att gradient was summed in the kernels (one partial row per program)."""
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 64)  # the hub's 600 edges: 10 pieces
    ei, n, _ = graph_case("hub", DEVICE)
    ei = torch.cat([ei, torch.tensor([[1, 2], [3, 3]], device=DEVICE)], 1)
    H, C = 3, 4
    score = make_score(kind, n, n, ei.size(1), H, C, device=DEVICE)
    value = score.src if kind == "gatv2" else torch.randn(n, H, C, dtype=torch.float64,
                                                          device=DEVICE, requires_grad=True)
    bias = torch.randn(H * C, dtype=torch.float64, device=DEVICE, requires_grad=True)
    sums = []
    real = torch.Tensor.sum

    def counted(t, *args, **kwargs):  # the host's sum of the att partials
        if t.dim() == 3 and t.shape[1:] == (H, C) and t.dtype == torch.float64:
            sums.append(t.size(0))
        return real(t, *args, **kwargs)
    res = {}
    for backend in ("triton", "torch"):
        out = graph_attention(score, value, ei, n, backend=backend, bias=bias)
        loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                                  dtype=torch.float64).to(out)).sum()
        ins = list(dict.fromkeys([value, bias, *leaves(score)]))
        with monkeypatch.context() as m:
            if backend == "triton":
                m.setattr(torch.Tensor, "sum", counted)
            res[backend] = (out, *torch.autograd.grad(loss, ins))
    for a, b in zip(res["triton"], res["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    has_in = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    has_in[ei[1]] = True
    torch.testing.assert_close(res["triton"][0][~has_in], bias.detach().expand(int((~has_in).sum()), -1))
    items = _triton_schedule._plan(gatlib.GraphPlan(ei, num_nodes=n)).dst_items.items.size(0)
    assert sums == ([items // 16] if kind == "gatv2" else []), sums


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_backward_fake_with_symbolic_sizes(kind):
    """The backward operator's shapes under torch.compile with dynamic sizes, where every size
    is a SymInt (the first GPU run's compiled GATConv/GATv2Conv raised "unhashable type:
    non-nested SymInt" where a fake function put sizes into a set): one gradient per input,
    an empty one where :func:`_returned` leaves it out (GATv2's x_src, summed into its value's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def sym(*shape):
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
        return mode.from_tensor(torch.randn(*shape), symbolic_context=ctx)

    N, E, H, C = 7, 20, 2, 5
    value = sym(N, H, C)
    att = sym(H, C) if kind == 1 else None
    s_src = value if kind == 1 else sym(N, H, *([C] if kind else []))
    s_dst = sym(N, H, *([C] if kind else []))
    ins = (s_src, s_dst, sym(E, H, *([C] if kind else [])), att, value, None)
    with mode:
        graph = [torch.zeros(N + 1, dtype=torch.int32), torch.zeros(E, dtype=torch.int32)]
        out = _triton._fake_backward(sym(N, H, C), None, *ins, None, sym(N, H, C), sym(N, H),
                                     value.new_empty(0), graph, kind, 1.0, 0.2, 0.0, kind == 1,
                                     False, [True, True, True, kind == 1, True, False])
    # GATv2's x_src is its value: one gradient, value's; att's only for GATv2; no value_edge
    want = [kind != 1, True, True, kind == 1, True, False]
    assert len(out) == 6
    for t, got, w in zip(ins, out, want, strict=True):
        if w:
            assert got.shape == t.shape and str(got.size(0)) == str(t.size(0))
        else:
            assert got.numel() == 0


@pytest.mark.parametrize("layer", ["GATConv", "GATv2Conv"])
@pytest.mark.parametrize("heads,concat,residual", [(3, True, False), (1, False, False),
                                                   (3, False, False), (3, True, True)])
def test_layers_output_bias(layer, heads, concat, residual):
    """A GAT layer on the Triton kernels with a trained (non-zero) bias: PyG's result and
    gradients (the reference backend's), the residual added before the bias, as in PyG."""
    n = 40
    ei = torch.cat([hub_graph(n, 150), torch.randint(0, n, (2, 60))], 1).to(DEVICE)
    x = torch.randn(n, 6, dtype=torch.float64, device=DEVICE)
    torch.manual_seed(0)
    ref = getattr(gatlib, layer)(6, 4, heads=heads, concat=concat, residual=residual,
                                 backend="torch").double().to(DEVICE)
    with torch.no_grad():
        ref.bias.normal_()
    ours = getattr(gatlib, layer)(6, 4, heads=heads, concat=concat, residual=residual,
                                  backend="triton").double().to(DEVICE)
    ours.load_state_dict(ref.state_dict())
    res = []
    for m in (ours, ref):
        with gatlib.record_kernels() as log:
            out = m(x, ei)
            res.append((out, *torch.autograd.grad(out.sin().sum(), list(m.parameters()))))
        assert log[0] == ("triton" if m is ours else "torch"), log
    for a, b in zip(*res, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
