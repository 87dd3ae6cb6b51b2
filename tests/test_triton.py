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
from gatlib import EdgeScore, GraphPlan, _layout, _triton, _triton_schedule, graph_attention  # noqa: E402
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
    """Rows and source columns longer than _SPLIT are cut into pieces merged
    afterwards; with a GPU config (the first of each kernel's space, pinned) and three
    programs, every program runs several blocks."""
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 32)
    monkeypatch.setattr(_triton_schedule, "_PINNED", 0)
    n, H, C = 40, 2, 3
    ei = hub_graph(n, 120).to(DEVICE)  # in-hub 0
    out_hub = torch.stack([torch.full((50,), 7), torch.arange(50) % n])  # out-hub 7
    ei = torch.cat([ei, out_hub.to(DEVICE)], dim=1)
    plan = GraphPlan(ei, num_nodes=n)
    monkeypatch.setattr(_triton_schedule, "_PROGRAMS_INTERPRETER", 3)  # several blocks per program
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
    assert {k: c["BLOCK_R"] for k, c in tiles.items()} == {
        k: _triton_schedule._space(k, c)[0].kwargs["BLOCK_R"] for k, c in tiles.items()}
    assert set(tiles) == {"_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel"}


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


@pytest.mark.parametrize("slots", [False, True], ids=["step_sums", "slot_sums"])
@pytest.mark.parametrize("form", ONE_HEAD_FORMS)
def test_values_and_keys_of_one_head_are_read_in_place(form, slots, monkeypatch):
    """A value or key ``[N, 1, C]`` goes to the kernels as it is — no copy per head:
    each lane reads row ``j`` for every head (ONE_V, ONE_K), and its gradient is the
    heads' sum — over split rows both ways, with the backward's sums per step or
    per edge slot (as at wide rows)."""
    monkeypatch.setattr(_triton, "_slot_sums", lambda width: slots)
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
    (items,) = _layout._build_schedules([ptr], E, 64)
    # sizes from (N, E) alone: room for N + E // 64 items, E // 65 split rows
    assert items.items.shape == (deg.numel() + E // 64, 4) and items.max_split == min(10, E // 65)
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
    assert items.split_row[:2].tolist() == [7, 9]
    assert items.split_first[:2].tolist() == [0, 5] and items.split_count[:2].tolist() == [5, 3]
    assert sorted(slot[slot >= 0].tolist()) == list(range(8))
    for r, first, count in ((7, 0, 5), (9, 5, 3)):
        assert sorted(slot[:W][row[:W] == r].tolist()) == list(range(first, first + count))
    assert items.max_pieces >= 8


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
        for deg, s in zip(pair, _layout._build_schedules(ptrs, E, split), strict=True):
            items, bounds, order, slot0, pieces = _schedule_reference(deg, split)
            n, W = len(deg), len(items)
            assert s.bounds.tolist() == bounds, deg
            assert s.items.shape == (n + E // split, 4), deg  # the room: from the sizes alone
            got = s.items.t().long()  # [row, start, length, slot]
            assert got[:, :W].t().tolist() == [list(item) for item in items], deg
            room = got[:, W:]
            assert (room[0] >= n).all() and (room[2] == -1).all() and (room[3] == -1).all(), deg
            assert s.split_row.tolist() == order[:s.max_split], deg
            assert s.split_first.tolist() == [slot0[r] for r in order[:s.max_split]], deg
            assert s.split_count.tolist() == [pieces[r] for r in order[:s.max_split]], deg
            # each array starts on 16 bytes (Triton specialises on it: test_triton_compile.py)
            assert all(t.data_ptr() % 16 == 0 for t in (s.items, s.bounds,
                                                        s.split_row, s.split_first, s.split_count))


@pytest.mark.parametrize("kind", ["gatv2", "gat_projected"])
def test_partials_of_a_launch_of_fewer_programs_than_slots(kind, monkeypatch):
    """The backward's buffers of per-lane parameter partials hold rows for the most lanes
    and programs any config runs (``_partial_rows``), whatever the launch runs: each
    program zeroes the rows no program of the launch writes. With 3 times the rows, every
    gradient (``att``'s, KIND 3's two vectors', the output bias's) equals the reference's,
    and every allocation of the call is poisoned with NaN first, so an unwritten row would
    show."""
    real_empty = torch.empty
    rows = _triton_schedule._partial_rows

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(_triton, "_partial_rows", lambda device, H: 3 * rows(device, H))
    ei, n, _ = graph_case("hub", DEVICE)
    H, C = 3, 4
    score, value = _bias_score(kind, ei, n, H, C)
    bias = torch.randn(H * C, dtype=torch.float64, device=DEVICE, requires_grad=True)
    res = {}
    for backend in ("triton", "torch"):
        out, _ = _attend(score, value, ei, n, backend, bias)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64).to(out)
        ins = list(dict.fromkeys([value, bias, *leaves(score)]))
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", poisoned)
            res[backend] = torch.autograd.grad((out * w).sum(), ins)
    for a, b in zip(res["triton"], res["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_unsupported_calls_raise_with_the_reason():
    """What the kernels cannot run is said, not handed to another kernel."""
    ei, n_src, n_dst = graph_case("random", DEVICE)
    wide = make_score("dot", n_src, n_dst, ei.size(1), 1, _triton._MAX_C + 1, edge=False,
                      dtype=torch.float32, device=DEVICE, requires_grad=False)
    v = torch.randn(n_src, 1, 8, device=DEVICE)
    assert "at most" in _triton.unsupported(wide, v, None)
    with pytest.raises(ValueError, match=r"backend='triton' cannot run this call: .*at most 1024 channels"):
        graph_attention(wide, v, ei, n_dst, backend="triton")


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
                                             "_bwd_dst_kernel", "_bwd_src_kernel"}
    for k in kernels:
        assert not binder_locals & set(k.arg_names), (k.__name__, binder_locals & set(k.arg_names))


# ---------------------------------------------------------------------------
# GAT over projected rows (EdgeScore.gat_projected): the terms formed in-kernel.
# ---------------------------------------------------------------------------
def _projected(n, E, H, C, edge, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()
    h, a_s, a_d = r(n, H, C), r(1, H, C), r(1, H, C)
    return h, a_s, a_d, (r(E, H) if edge else None)


def _kinds_launched(monkeypatch):
    kinds = []
    launch = _triton._launch

    def counted(kernel, *args, **kwargs):
        kinds.append(kwargs["KIND"])
        return launch(kernel, *args, **kwargs)
    monkeypatch.setattr(_triton, "_launch", counted)
    return kinds


@pytest.mark.parametrize("case", ["random", "hub", "hub_sources", "isolated", "duplicates", "empty_rows"])
@pytest.mark.parametrize("H,C,edge", [(1, 3, False), (3, 4, True), (2, 8, True)])
def test_projected_gat_is_the_reference(case, H, C, edge, monkeypatch):
    """Outputs, weights and the gradients of h, both attention vectors and the
    edge terms equal the reference's (the per-node terms formed outside), over
    split destination rows (hub) and split source rows (hub_sources), nodes
    without in- or out-edges; and the kernels ran KIND 3 (no per-node terms)."""
    name = {"hub_sources": "hub", "empty_rows": "isolated"}.get(case, case)
    ei, n, _ = graph_case(name, DEVICE)
    if case == "hub_sources":
        ei = ei.flip(0)  # node 0 sends 600 edges: several pieces of one source row
    h, a_s, a_d, e = _projected(n, ei.size(1), H, C, edge)
    kinds = _kinds_launched(monkeypatch)
    res = {}
    for backend in ("triton", "torch"):
        kinds.clear()
        score = EdgeScore.gat_projected(h, a_s, a_d, e)
        with gatlib.record_kernels() as log:
            out, alpha = graph_attention(score, h, ei, n, backend=backend, return_attention=True)
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                            dtype=torch.float64).to(out)
            loss = (out * w).sum() + (alpha * alpha.detach().cos()).sum()
            ins = [h, a_s, a_d] + ([e] if edge else [])
            grads = torch.autograd.grad(loss, ins)
        res[backend] = (out, alpha, *grads)
        if backend == "triton":
            assert log[:1] == ["triton"] and "triton.backward" in log, log
            assert kinds and set(kinds) == {3}, kinds
    for a, b in zip(res["triton"], res["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_projected_gat_gradcheck_and_second_order():
    ei = _small_graph()
    n = int(ei.max()) + 1
    h, a_s, a_d, e = _projected(n, ei.size(1), 2, 3, True)

    def f(h, a_s, a_d, e):
        return graph_attention(EdgeScore.gat_projected(h, a_s, a_d, e), h, ei, n, backend="triton",
                               return_attention=True)
    with gatlib.record_kernels() as log:
        assert torch.autograd.gradcheck(f, (h, a_s, a_d, e), fast_mode=True)
    assert "triton" in log and "triton.backward" in log
    res = {}
    for backend in ("torch", "triton"):
        out = graph_attention(EdgeScore.gat_projected(h, a_s, a_d, e), h, ei, n, backend=backend)
        gh, = torch.autograd.grad(out.square().sum(), h, create_graph=True)
        res[backend] = (gh.detach(), *torch.autograd.grad(gh.square().sum(), (a_s, a_d)))
    for a, b in zip(res["triton"], res["torch"], strict=True):
        torch.testing.assert_close(a, b)


def test_projected_gat_with_dropout_and_dropped_values(monkeypatch):
    """Attention dropout: the kernels' one mask, as for per-node terms. Values
    other than h (a layer's value dropout) take the per-node terms (no KIND 3)."""
    ei, n, _ = graph_case("random", DEVICE)
    h, a_s, a_d, e = _projected(n, ei.size(1), 2, 4, True)
    kinds = _kinds_launched(monkeypatch)
    outs = []
    for score in (EdgeScore.gat_projected(h, a_s, a_d, e), EdgeScore.gat_projected(h, a_s, a_d, e).node_terms()):
        torch.manual_seed(5)
        outs.append(graph_attention(score, h, ei, n, backend="triton", dropout=0.5, training=True))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    assert kinds == [3, 0], kinds
    kinds.clear()
    graph_attention(EdgeScore.gat_projected(h, a_s, a_d, e), h * 2, ei, n, backend="triton")
    assert kinds == [0], kinds
    # fewer destinations than nodes (a plan over the first n - 5): the terms, as the reference
    kinds.clear()
    few = ei[:, ei[1] < n - 5]
    score = EdgeScore.gat_projected(h, a_s, a_d, e[:few.size(1)])
    got = graph_attention(score, h, few, n - 5, backend="triton")
    torch.testing.assert_close(got, graph_attention(score, h, few, n - 5, backend="torch"))
    assert kinds == [0], kinds


# ---------------------------------------------------------------------------
# A layer's output bias, added by the kernels as they store each row; its
# gradient summed with the other parameters' (gatlib._dispatch.attend_planned).
# ---------------------------------------------------------------------------
def _bias_flags(monkeypatch):
    """``HAS_BIAS`` of each forward launch and ``NEED_BIAS`` of each destination
    backward's, in launch order (the source kernel has neither)."""
    flags = []
    launch = _triton._launch

    def counted(kernel, *args, **kwargs):
        flags.extend(kwargs[k] for k in ("HAS_BIAS", "NEED_BIAS") if k in kwargs)
        return launch(kernel, *args, **kwargs)
    monkeypatch.setattr(_triton, "_launch", counted)
    return flags


def _attend(score, value, ei, n_dst, backend, bias, concat=True, **kw):
    plan = gatlib._plan.as_plan(ei, value.size(0), n_dst, value.device)
    with gatlib.record_kernels() as log:
        out, alpha = gatlib._dispatch.attend_planned(score, value, plan, None, 0.0, False, concat,
                                                     backend, True, bias=bias, **kw)
    assert log[:1] == [backend], log
    return out, alpha


def _bias_score(kind, ei, n, H, C, seed=0):
    if kind == "gat_projected":
        h, a_s, a_d, e = _projected(n, ei.size(1), H, C, True, seed)
        return EdgeScore.gat_projected(h, a_s, a_d, e), h
    score = make_score(kind, n, n, ei.size(1), H, C, device=DEVICE, seed=seed)
    if kind == "gatv2":  # the layer's values are its source projection
        return score, score.src
    return score, torch.randn(n, H, C, dtype=torch.float64, device=DEVICE, requires_grad=True)


@pytest.mark.parametrize("case", ["hub", "isolated", "random"])
@pytest.mark.parametrize("kind", ["gat", "gatv2", "gat_projected"])
def test_output_bias_is_added_by_the_kernels(kind, case, monkeypatch):
    """``out + bias`` and every gradient, the bias's included, equal the reference's
    with the bias added after; rows without in-edges are the bias; a hub's split
    row gets it once (in the merge) and adds its gradient once (on its first piece);
    and the kernels added it (HAS_BIAS forward, NEED_BIAS backward), so nothing
    else could have."""
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 64)  # the hub's 600 edges: 10 pieces
    ei, n, _ = graph_case(case, DEVICE)
    H, C = 3, 4
    score, value = _bias_score(kind, ei, n, H, C)
    bias = torch.randn(H * C, dtype=torch.float64, device=DEVICE, requires_grad=True)
    flags = _bias_flags(monkeypatch)
    res = {}
    for backend in ("triton", "torch"):
        flags.clear()
        out, alpha = _attend(score, value, ei, n, backend, bias)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64).to(out)
        ins = list(dict.fromkeys([value, bias, *leaves(score)]))
        grads = torch.autograd.grad((out * w).sum() + alpha.cos().sum(), ins)
        res[backend] = (out, alpha, *grads)
        if backend == "triton":
            assert flags == [True, True], flags
    for a, b in zip(res["triton"], res["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    if case == "isolated":  # destinations 0..7 have no in-edges: the bias alone
        torch.testing.assert_close(res["triton"][0][:8], bias.detach().expand(8, -1), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gat", "gatv2", "gat_projected"])
def test_output_bias_gradcheck_and_second_order(kind, monkeypatch):
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 3)  # rows of 4+ edges are merged pieces
    ei = _small_graph()
    n, H, C = 5, 2, 3
    score, value = _bias_score(kind, ei, n, H, C, seed=2)
    bias = torch.randn(H * C, dtype=torch.float64, device=DEVICE, requires_grad=True)
    ins = list(dict.fromkeys([value, bias, *leaves(score)]))

    def f(*ts):
        sub = dict(zip(map(id, ins), ts, strict=True))
        s = score.with_tensors(*(None if t is None else sub[id(t)] for t in score.tensors()))
        return _attend(s, sub[id(value)], ei, n, "triton", sub[id(bias)])
    assert torch.autograd.gradcheck(f, tuple(ins), fast_mode=True)
    res = {}
    for backend in ("torch", "triton"):  # a gradient penalty: the differentiable backward
        out, _ = _attend(score, value, ei, n, backend, bias)
        gv, gb = torch.autograd.grad(out.square().sum(), (value, bias), create_graph=True)
        res[backend] = (gv.detach(), gb.detach(),
                        *torch.autograd.grad(gv.square().sum() + gb.square().sum(), (value, bias)))
    for a, b in zip(res["triton"], res["torch"], strict=True):
        torch.testing.assert_close(a, b)


def test_output_bias_where_the_kernels_do_not_add_it(monkeypatch):
    """The dispatcher adds the bias after the heads are combined where the kernels
    cannot: averaged heads, a bias in another dtype, another kernel — the same
    result, no HAS_BIAS launch."""
    ei, n, _ = graph_case("random", DEVICE)
    H, C = 3, 4
    score, value = _bias_score("gatv2", ei, n, H, C)
    flags = _bias_flags(monkeypatch)
    for concat, bias in ((False, torch.randn(C, dtype=torch.float64)),
                         (True, torch.randn(H * C, dtype=torch.float32))):
        flags.clear()
        out, _ = _attend(score, value, ei, n, "triton", bias.to(DEVICE), concat=concat)
        ref, _ = _attend(score, value, ei, n, "torch", None, concat=concat)
        torch.testing.assert_close(out, ref + bias.to(DEVICE))
        assert out.dtype == torch.promote_types(value.dtype, bias.dtype)
        assert flags and not any(flags), flags


@pytest.mark.parametrize("need", ["bias", "att", "both", "other_width"])
def test_output_bias_gradient_with_or_without_the_att_gradient(need, monkeypatch):
    """GATv2's att and bias partials share one buffer and one sum where they are one
    width; a value wider than the scorer's rows (other_width) sums them apart;
    either alone is summed alone."""
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 64)
    ei, n, _ = graph_case("hub", DEVICE)
    H, C = 2, 4
    CV = 8 if need == "other_width" else C
    score = make_score("gatv2", n, n, ei.size(1), H, C, device=DEVICE, edge=False)
    score.att.requires_grad_(need != "bias")
    value = torch.randn(n, H, CV, dtype=torch.float64, device=DEVICE, requires_grad=True)
    bias = torch.randn(H * CV, dtype=torch.float64, device=DEVICE, requires_grad=need != "att")
    ins = [t for t in (value, bias, score.att) if t.requires_grad]
    res = {}
    for backend in ("triton", "torch"):
        out, _ = _attend(score, value, ei, n, backend, bias)
        res[backend] = (out, *torch.autograd.grad(out.sin().sum(), ins))
    for a, b in zip(res["triton"], res["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["gatv2", "gat_projected"])
def test_output_bias_leaves_the_other_gradients_as_they_were(kind, monkeypatch):
    """In bfloat16 the other inputs' gradients with a bias are those without it, bit
    for bit: the backward reads the output as it was before the bias (taking the bias
    off the rounded biased output would round Delta at the biased output's scale)."""
    monkeypatch.setattr(_triton_schedule, "_SPLIT", 64)
    ei, n, _ = graph_case("hub", DEVICE)
    H, C = 2, 8
    if kind == "gat_projected":
        h, a_s, a_d, e = _projected(n, ei.size(1), H, C, True, dtype=torch.bfloat16)
        score = EdgeScore.gat_projected(h, a_s, a_d, e)
    else:
        score = make_score(kind, n, n, ei.size(1), H, C, device=DEVICE, dtype=torch.bfloat16)
    value = score.src
    bias = (4 * torch.randn(H * C, dtype=torch.float64)).to(DEVICE, torch.bfloat16)
    w = torch.randn(n, H * C, dtype=torch.float64).to(DEVICE, torch.bfloat16)
    ins = list(dict.fromkeys([value, *leaves(score)]))
    res = []
    for b in (bias, None):
        out, _ = _attend(score, value, ei, n, "triton", b)
        res.append(torch.autograd.grad((out * w).sum(), ins))
    for a, b in zip(*res, strict=True):
        assert torch.equal(a, b)


def test_output_bias_of_the_wrong_shape_is_refused():
    ei, n, _ = graph_case("random", DEVICE)
    score, value = _bias_score("gatv2", ei, n, 2, 4)
    plan = gatlib._plan.as_plan(ei, n, n, value.device)
    with pytest.raises(ValueError, match=r"bias must be \[H \* C\] = \[8\]"):
        _triton.attention(score, value, plan, None, 0.0, False, torch.zeros(4, dtype=value.dtype))



@pytest.mark.parametrize("kind", [0, 1, 3])
def test_backward_fake_with_symbolic_sizes(kind):
    """The backward operator's shapes under torch.compile with dynamic sizes, where
    every size is a SymInt: the first GPU run's compiled GATConv/GATv2Conv raised
    ("unhashable type: non-nested SymInt") where the summed parameter gradients'
    widths went into a set. The fake function gives the summed gradients as one
    ``[k, H, width]`` tensor (att and bias partials one width here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def sym(*shape):
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
        return mode.from_tensor(torch.randn(*shape), symbolic_context=ctx)

    N, E, H, C = 7, 20, 2, 5
    value = sym(N, H, C)
    att = {0: None, 1: sym(H, C), 3: sym(2, H, C)}[kind]
    s_src = value if kind == 3 else sym(N, H, 1 if kind == 0 else C)
    s_dst = None if kind == 3 else sym(N, H, 1 if kind == 0 else C)
    ins = (s_src, s_dst, None, att, value, None, sym(H * C))
    with mode:
        graph = [torch.zeros(N + 1, dtype=torch.int32), torch.zeros(E, dtype=torch.int32)]
        out = _triton._fake_backward(sym(N, H * C), None, *ins, None, sym(N, H * C), sym(N, H),
                                     value.new_empty(0), graph, kind, 1.0, 0.2, 0.0, kind == 1,
                                     False, [True] * 7)
    summed = out[-1]
    names = {0: 1, 1: 2, 3: 3}[kind]  # bias; att and bias; att_src, att_dst and bias
    assert summed.dim() == 3 and summed.size(0) == names
    assert str(summed.size(2)) == str(value.size(2))
@pytest.mark.parametrize("layer", ["GATConv", "GATv2Conv"])
@pytest.mark.parametrize("heads,concat,residual", [(3, True, False), (1, False, False),
                                                   (3, False, False), (3, True, True)])
def test_layers_output_bias_in_the_kernels(layer, heads, concat, residual, monkeypatch):
    """A GAT layer on the Triton kernels with a trained (non-zero) bias: PyG's result
    and gradients (the reference backend's), the bias added by the kernels where the
    heads are concatenated or one and nothing comes between (a residual is added
    first, as in PyG)."""
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
    flags = _bias_flags(monkeypatch)
    res = []
    for m in (ours, ref):
        out = m(x, ei)
        res.append((out, *torch.autograd.grad(out.sin().sum(), list(m.parameters()))))
    for a, b in zip(*res, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    fused = (concat or heads == 1) and not residual
    assert flags and set(flags) == {fused}, flags
