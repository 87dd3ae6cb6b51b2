"""The fused Triton kernels (gatlib._triton) against the pure-PyTorch reference.

Without a GPU the kernels run in Triton's CPU interpreter on CPU tensors
(slow: the graphs here are small); with CUDA the same tests run on the GPU.
"""
import os

import torch

# Without CUDA the kernels run in Triton's interpreter, which must be switched on
# before triton is first imported: jit functions, triton.language's own included,
# are built for one mode when they are defined (torch_geometric imports triton,
# so this must precede gatlib too). tests/conftest.py does it for the session;
# repeated here so the module states its own requirement.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from gatlib import DotProductScore, GATScore, GATv2Score, _triton  # noqa: E402
from gatlib._core import segment_aggregate, segment_softmax  # noqa: E402

from testing import hub_graph, random_graph  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ["gat", "gatv2", "dot"]


# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------
def make_score(kind, n_src, n_dst, E, H, C, *, dtype=torch.float32, edge=True, seed=0):
    """A scorer with random leaf tensors (requiring grad) on DEVICE."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()

    if kind == "gat":
        return GATScore(r(n_src, H), r(n_dst, H), r(E, H) if edge else None, 0.2)
    if kind == "gatv2":
        return GATv2Score(r(n_src, H, C), r(n_dst, H, C), r(E, H, C) if edge else None, r(H, C), 0.2)
    return DotProductScore(r(n_dst, H, C), r(n_src, H, C), r(E, H, C) if edge else None,
                           1 / math.sqrt(C))


def leaves(*objs):
    out = []
    for o in objs:
        ts = vars(o).values() if not isinstance(o, torch.Tensor) else [o]
        out += [t for t in ts if isinstance(t, torch.Tensor) and t.requires_grad]
    return list(dict.fromkeys(out))  # aliased tensors once


def reference(score, value, ei, n_dst, value_edge=None, keep=None, p=0.0):
    """The specification (gatlib._core); ``keep`` applies a given dropout mask."""
    src, index = ei[0], ei[1]
    alpha = segment_softmax(score.edge_scores(src, index), index, n_dst)
    a = alpha if keep is None else alpha * keep / (1 - p)
    return segment_aggregate(a, value, src, index, n_dst, value_edge), alpha


def fused(score, value, ei, n_dst, value_edge=None, dropout=0.0, training=False, need_alpha=True):
    res = _triton.attention(score, value, ei, n_dst, value_edge=value_edge, dropout=dropout,
                            training=training, need_alpha=need_alpha)
    assert res is not None, "the fused path declined"
    return res


def loss_and_grads(out, alpha, ins, seed=0):
    """Gradients of a random linear function of ``out`` and ``alpha``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out)
    loss = (out * w).sum()
    if alpha is not None and alpha.numel():
        loss = loss + (alpha * torch.randn(alpha.shape, generator=g, dtype=torch.float64).to(alpha)).sum()
    return torch.autograd.grad(loss, ins, allow_unused=True)


def assert_grads_close(got, want, **tol):
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            torch.testing.assert_close(a, b, **tol)


def graph(name, seed=0):
    """(edge_index, n_src, n_dst) of the named edge case, on DEVICE."""
    if name == "random":  # with self-loops and a few repeated edges
        ei, n_src, n_dst = random_graph(30, 150, seed=seed), 30, 30
    elif name == "bipartite":
        ei, n_src, n_dst = random_graph(25, 90, num_dst=11, seed=seed), 25, 11
    elif name == "hub":  # 300 in-edges into node 0: more than one _SPLIT piece
        ei, n_src, n_dst = hub_graph(60, 300), 60, 60
    elif name == "isolated":  # destinations 0..7 without in-edges, sources without out-edges
        ei = random_graph(30, 120, seed=seed)
        ei, n_src, n_dst = ei[:, (ei[1] >= 8) & (ei[0] < 25)], 30, 30
    elif name == "duplicates":  # one edge 12 times, one row made only of duplicates
        dup = torch.tensor([[3] * 12 + [5, 5], [0] * 12 + [1, 1]])
        ei, n_src, n_dst = torch.cat([dup, random_graph(10, 30, seed=seed)], dim=1), 10, 10
    elif name == "empty":
        ei, n_src, n_dst = torch.empty(2, 0, dtype=torch.long), 7, 5
    else:
        raise ValueError(name)
    return ei.to(DEVICE), n_src, n_dst


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
    ("empty", 3, True),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,H,edge", CASES)
def test_matches_reference(kind, name, H, edge):
    C = 5  # not a power of two: padded channels must stay masked
    ei, n_src, n_dst = graph(name)
    E = ei.size(1)
    score = make_score(kind, n_src, n_dst, E, H, C, edge=edge)
    v = torch.randn(n_src, H, C, device=DEVICE, requires_grad=True)
    ve = torch.randn(E, H, C, device=DEVICE, requires_grad=True) if edge else None
    ins = leaves(score, v, *([ve] if edge else []))

    out, alpha = fused(score, v, ei, n_dst, ve)
    ref, alpha_ref = reference(score, v, ei, n_dst, ve)
    tol = dict(rtol=1e-4, atol=1e-5)
    assert out.shape == (n_dst, H, C) and out.dtype == v.dtype
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(alpha, alpha_ref, **tol)  # original edge order
    assert_grads_close(loss_and_grads(out, alpha, ins), loss_and_grads(ref, alpha_ref, ins), **tol)
    has_in = torch.zeros(n_dst, dtype=torch.bool, device=DEVICE)
    has_in[ei[1]] = True
    assert out[~has_in].abs().sum() == 0  # no in-edges -> zeros, not NaN


def test_without_alpha_and_without_dst_term():
    """need_alpha=False returns None and skips the alpha pass; GAT may lack a_dst."""
    ei, n_src, n_dst = graph("random", seed=3)
    score = make_score("gat", n_src, n_dst, ei.size(1), 2, 4, edge=False)
    score.dst = None
    v = torch.randn(n_src, 2, 4, device=DEVICE, requires_grad=True)
    out, alpha = fused(score, v, ei, n_dst, need_alpha=False)
    assert alpha is None
    ref, _ = reference(score, v, ei, n_dst)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    ins = leaves(score, v)
    assert_grads_close(loss_and_grads(out, None, ins), loss_and_grads(ref, None, ins),
                       rtol=1e-4, atol=1e-5)


def test_aliased_value_and_edge_tensors():
    """GATv2 layers pass x_src as the value, Transformer layers the edge term as
    value_edge: the kernels load them once and the gradients still add up."""
    ei, n_src, n_dst = graph("bipartite", seed=1)
    E, H, C = ei.size(1), 2, 6
    s2 = make_score("gatv2", n_src, n_dst, E, H, C, edge=False)
    out, alpha = fused(s2, s2.x_src, ei, n_dst)
    ref, alpha_ref = reference(s2, s2.x_src, ei, n_dst)
    ins = leaves(s2)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert_grads_close(loss_and_grads(out, alpha, ins), loss_and_grads(ref, alpha_ref, ins),
                       rtol=1e-4, atol=1e-5)
    sd = make_score("dot", n_src, n_dst, E, H, C, edge=True)
    v = torch.randn(n_src, H, C, device=DEVICE, requires_grad=True)
    out, alpha = fused(sd, v, ei, n_dst, sd.edge)
    ref, alpha_ref = reference(sd, v, ei, n_dst, sd.edge)
    ins = leaves(sd, v)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert_grads_close(loss_and_grads(out, alpha, ins), loss_and_grads(ref, alpha_ref, ins),
                       rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_split_hubs_and_gpu_tiles(kind, monkeypatch):
    """Rows and source columns longer than _SPLIT are cut into pieces merged
    afterwards; with the GPU's tile sizes every launch has several programs."""
    monkeypatch.setattr(_triton, "_SPLIT", 32)
    monkeypatch.setattr(_triton, "_TILE_INTERPRETER", _triton._TILE)
    monkeypatch.setattr(_triton, "_MAX_ROWS_INTERPRETER", _triton._MAX_ROWS)
    n, H, C = 40, 2, 3
    ei = hub_graph(n, 120).to(DEVICE)  # in-hub 0
    out_hub = torch.stack([torch.full((50,), 7), torch.arange(50) % n])  # out-hub 7
    ei = torch.cat([ei, out_hub.to(DEVICE)], dim=1)
    plan = _triton._plan(ei, n, n)
    assert plan.dst_items.num_pieces > 0 and plan.src_items.num_pieces > 0
    assert len(plan.dst_items.buckets) >= 2 and len(plan.src_items.buckets) == 3
    E = ei.size(1)
    score = make_score(kind, n, n, E, H, C, edge=True)
    v = torch.randn(n, H, C, device=DEVICE, requires_grad=True)
    ve = torch.randn(E, H, C, device=DEVICE, requires_grad=True)
    ins = leaves(score, v, ve)
    out, alpha = fused(score, v, ei, n, ve)
    ref, alpha_ref = reference(score, v, ei, n, ve)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(alpha, alpha_ref, rtol=1e-4, atol=1e-5)
    assert_grads_close(loss_and_grads(out, alpha, ins), loss_and_grads(ref, alpha_ref, ins),
                       rtol=1e-4, atol=1e-5)


def test_wide_channels_narrow_the_edge_tile(monkeypatch):
    """When BLOCK_E * BLOCK_C exceeds the tile budget the edge tile shrinks
    (here 64 -> 8 edges per step) and rows take more steps."""
    monkeypatch.setattr(_triton, "_TILE_INTERPRETER", 256)
    n, H, C = 12, 1, 20
    ei = torch.cat([hub_graph(n, 40), torch.tensor([[1, 2], [3, 3]])], dim=1).to(DEVICE)
    E = ei.size(1)
    score = make_score("gatv2", n, n, E, H, C, edge=True)
    v = torch.randn(n, H, C, device=DEVICE, requires_grad=True)
    ins = leaves(score, v)
    out, alpha = fused(score, v, ei, n)
    ref, alpha_ref = reference(score, v, ei, n)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert_grads_close(loss_and_grads(out, alpha, ins), loss_and_grads(ref, alpha_ref, ins),
                       rtol=1e-4, atol=1e-5)


def test_huge_logits_stay_finite():
    ei, n_src, n_dst = graph("random", seed=5)
    score = make_score("dot", n_src, n_dst, ei.size(1), 2, 4, edge=False)
    score.query = (score.query.detach() * 1e3).requires_grad_()  # logits ~1e5
    v = torch.randn(n_src, 2, 4, device=DEVICE)
    out, alpha = fused(score, v, ei, n_dst)
    ref, alpha_ref = reference(score, v, ei, n_dst)
    assert torch.isfinite(out).all() and torch.isfinite(alpha).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# gradcheck (float64) of the autograd function, split pieces included.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind, monkeypatch):
    monkeypatch.setattr(_triton, "_SPLIT", 3)  # rows of 4+ edges are merged pieces
    n_src, n_dst, H, C = 5, 4, 2, 3
    ei = torch.tensor([[0, 1, 2, 3, 4, 4, 1, 2, 0, 0],  # duplicate 4->1, node 3 without in-edges
                       [0, 0, 0, 0, 1, 1, 1, 2, 2, 0]], device=DEVICE)
    E = ei.size(1)
    score = make_score(kind, n_src, n_dst, E, H, C, dtype=torch.float64)
    names = [k for k, t in vars(score).items() if isinstance(t, torch.Tensor)]
    v = torch.randn(n_src, H, C, dtype=torch.float64, device=DEVICE, requires_grad=True)
    ve = torch.randn(E, H, C, dtype=torch.float64, device=DEVICE, requires_grad=True)

    def f(v, ve, *ts):
        s = type(score)(**{**vars(score), **dict(zip(names, ts, strict=True))})
        return fused(s, v, ei, n_dst, ve)  # (out, alpha): alpha's gradient is checked too

    assert torch.autograd.gradcheck(f, (v, ve, *[getattr(score, k) for k in names]),
                                    fast_mode=True)


def test_gradcheck_with_dropout():
    """With the seed fixed, dropout is a fixed mask and the function is smooth:
    gradcheck passes only if the backward regenerates the forward's mask."""
    n_src, n_dst, H, C = 5, 4, 2, 3
    ei = torch.tensor([[0, 1, 2, 3, 4, 4, 1, 2, 0], [0, 0, 0, 0, 1, 1, 1, 2, 2]], device=DEVICE)
    score = make_score("dot", n_src, n_dst, ei.size(1), H, C, dtype=torch.float64)
    v = torch.randn(n_src, H, C, dtype=torch.float64, device=DEVICE, requires_grad=True)

    def f(v, q, k, e):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same dropout seed on every call
            return fused(DotProductScore(q, k, e, score.scale), v, ei, n_dst, e, dropout=0.5,
                         training=True)

    assert torch.autograd.gradcheck(f, (v, score.query, score.key, score.edge), fast_mode=True)


# ---------------------------------------------------------------------------
# Attention dropout: one Philox mask, shared by forward and backward.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_dropout_mask_is_consistent(kind):
    p = 0.4
    ei, n_src, n_dst = graph("random", seed=2)
    E, H, C = ei.size(1), 3, 4
    score = make_score(kind, n_src, n_dst, E, H, C)
    v = torch.randn(n_src, H, C, device=DEVICE, requires_grad=True)
    ins = leaves(score, v)
    torch.manual_seed(123)
    out, alpha = fused(score, v, ei, n_dst, dropout=p, training=True)
    torch.manual_seed(123)
    keep = _triton.dropout_keep_mask(ei, n_src, n_dst, H, p, _triton._draw_seed())  # [E, H]
    assert abs(keep.float().mean().item() - (1 - p)) < 0.07
    ref, alpha_ref = reference(score, v, ei, n_dst, keep=keep, p=p)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(alpha, alpha_ref, rtol=1e-4, atol=1e-5)  # before dropout
    assert_grads_close(loss_and_grads(out, alpha, ins), loss_and_grads(ref, alpha_ref, ins),
                       rtol=1e-4, atol=1e-5)
    torch.manual_seed(123)
    again, _ = fused(score, v, ei, n_dst, dropout=p, training=True)
    torch.testing.assert_close(again, out, rtol=0, atol=0)  # reproducible under manual_seed
    other, _ = fused(score, v, ei, n_dst, dropout=p, training=True)
    assert not torch.equal(other, out)  # a fresh seed per call
    evald, _ = fused(score, v, ei, n_dst, dropout=p, training=False)
    torch.testing.assert_close(evald, reference(score, v, ei, n_dst)[0], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Low precision: error vs float64 at most ~2x the reference path's error.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_rule(kind, dtype):
    """fp16/bf16 output and gradients: error vs float64 at most 2x the error of
    the reference path in the same dtype, plus one rounding step of the dtype at
    the result's magnitude — both paths accumulate in fp32 and round only at the
    end, so without that step the rule would compare two sub-ulp rounding errors."""
    n, H, C = 80, 2, 16
    ei = torch.cat([random_graph(n, 600, seed=5), hub_graph(n, 300)], dim=1).to(DEVICE)
    E = ei.size(1)
    s64 = make_score(kind, n, n, E, H, C, dtype=torch.float64, seed=7)
    g = torch.Generator().manual_seed(8)
    v64 = torch.randn(n, H, C, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    ins64 = leaves(s64, v64)
    exact, _ = reference(s64, v64, ei, n)
    g_exact = loss_and_grads(exact, None, ins64)

    def cast(t):
        return t.detach().to(dtype).requires_grad_()

    low = type(s64)(**{k: cast(t) if isinstance(t, torch.Tensor) else t for k, t in vars(s64).items()})
    v = cast(v64)
    ins = leaves(low, v)
    out, _ = fused(low, v, ei, n)
    ref, _ = reference(low, v, ei, n)  # the plain PyTorch path in the same dtype
    assert out.dtype == dtype
    eps = torch.finfo(dtype).eps

    def check(got, want, exact):
        err, err_ref = [(t.double() - exact).abs().max().item() for t in (got, want)]
        assert err <= 2 * err_ref + eps * exact.abs().max().item(), (err, err_ref)

    check(out, ref, exact)
    for got, want, g64 in zip(loss_and_grads(out, None, ins), loss_and_grads(ref, None, ins),
                              g_exact, strict=True):
        assert got.dtype == dtype
        check(got, want, g64)


# ---------------------------------------------------------------------------
# Scheduling and declines (plain PyTorch, fast).
# ---------------------------------------------------------------------------
def test_schedule_covers_every_edge_once_longest_first():
    deg = torch.tensor([0, 3, 40, 1, 0, 17, 5, 300, 2])
    ptr = torch.cat([torch.zeros(1, dtype=torch.long), deg.cumsum(0)])
    items = _triton._build_schedule(ptr, 64)
    length, start, row = items.length.long(), items.start.long(), items.row.long()
    assert (length[:-1] >= length[1:]).all()  # longest first
    assert length.max() <= 64
    covered = torch.zeros(int(ptr[-1]), dtype=torch.long)
    for r, s, n in zip(row.tolist(), start.tolist(), length.tolist(), strict=True):
        assert ptr[r] <= s and s + n <= ptr[r + 1]
        covered[s:s + n] += 1
    assert (covered == 1).all()
    assert sorted(set(row.tolist())) == list(range(deg.numel()))  # empty rows too
    # the 300-edge row is split into 5 pieces with their own slots, the rest are whole
    assert items.split_rows.tolist() == [7] and items.num_pieces == 5
    assert sorted(items.slot[items.slot >= 0].tolist()) == list(range(5))
    assert (items.piece_group == 0).all()
    # buckets tile the items in order, each with the tile width its lengths need
    first = 0
    for b_first, count, block_e in items.buckets:
        assert b_first == first
        seg = length[b_first:b_first + count]
        assert seg.max() <= block_e or block_e == 64
        first += count
    assert first == row.numel()


def test_declines_what_it_does_not_handle():
    ei, n_src, n_dst = graph("random")
    H, C = 2, 4
    v = torch.randn(n_src, H, C, device=DEVICE)
    kw = dict(value_edge=None, dropout=0.0, training=False, need_alpha=False)

    class Custom:  # any other scorer runs on the reference
        pass

    assert _triton.attention(Custom(), v, ei, n_dst, **kw) is None
    score = make_score("dot", n_src, n_dst, ei.size(1), H, C, edge=False)
    assert _triton.attention(score, v.to(torch.int32), ei, n_dst, **kw) is None
    wide = make_score("dot", n_src, n_dst, ei.size(1), 1, _triton._MAX_C + 1, edge=False)
    assert _triton.attention(wide, torch.randn(n_src, 1, 8, device=DEVICE), ei, n_dst, **kw) is None
