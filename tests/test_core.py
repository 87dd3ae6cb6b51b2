"""The attention core: (a) the reference against a dense masked-softmax oracle,
(b) gradcheck, (c) every fast kernel against the reference, with proof that it
ran; property tests over drawn graphs; low precision bounded against float64."""
import math

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gatlib
import gatlib._core as core
from gatlib import EdgeScore, graph_attention, segment_softmax
from gatlib._dispatch import AttentionCall, select_kernel
from gatlib._plan import GraphPlan

from testing import (GRAPH_CASES, HAS_SCATTER, KINDS, LOW_PRECISION, LOW_PRECISION_BOUND, dtype_id,
                     fast_kernels, graph_case, graphs, kernels, leaves, low_precision_errors, make_score,
                     random_graph, run)

DTYPES = [torch.float32, torch.float64]
# The Triton interpreter is slow: its agreement grid is in tests/test_triton.py.
CPU_FAST = [p for p in fast_kernels() if p.values[0] != "triton"]


def unique_graph(n_src, n_dst, p, seed=0):
    """Edges without duplicates (a dense mask cannot hold multiplicities)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n_dst, n_src, generator=g) < p
    dst, src = mask.nonzero(as_tuple=True)
    perm = torch.randperm(src.numel(), generator=g)  # unsorted on purpose
    return torch.stack([src[perm], dst[perm]]), mask


def dense_oracle(logits, mask, v):
    """softmax(S + M) V with M = -inf off the edges; rows without edges give 0.

    logits: [H, N_dst, N_src], mask: [N_dst, N_src], v: [N_src, H, C] -> [N_dst, H, C]
    """
    s = logits.masked_fill(~mask, float("-inf"))
    att = torch.softmax(s, dim=-1).nan_to_num(0.0)  # empty rows: all -inf -> NaN -> 0
    return torch.einsum("hij,jhc->ihc", att, v), att


# ---------------------------------------------------------------------------
# (a) the reference is the dense masked softmax
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n_src,n_dst", [(12, 12), (9, 5)])
@pytest.mark.parametrize("H", [1, 3])
def test_dot_product_matches_dense_masked_softmax(n_src, n_dst, H):
    C = 4
    ei, mask = unique_graph(n_src, n_dst, 0.3)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, H, C, generator=g, dtype=torch.float64, requires_grad=True)
               for n in (n_dst, n_src, n_src))
    out, alpha = graph_attention(EdgeScore.dot(q, k), v, ei, n_dst, concat=False, backend="torch",
                                 return_attention=True)
    ref, att = dense_oracle(torch.einsum("ihc,jhc->hij", q, k) / math.sqrt(C), mask, v)
    torch.testing.assert_close(out, ref.mean(1))
    torch.testing.assert_close(alpha, att[:, ei[1], ei[0]].T)
    w = torch.randn_like(out)
    g1 = torch.autograd.grad((out * w).sum(), (q, k, v))
    g2 = torch.autograd.grad((ref.mean(1) * w).sum(), (q, k, v))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("H", [1, 2])
def test_gat_matches_dense_masked_softmax(H):
    n = 10
    ei, mask = unique_graph(n, n, 0.35, seed=3)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(n, H, 3, generator=g, dtype=torch.float64, requires_grad=True)
    a_src, a_dst = (torch.randn(n, H, generator=g, dtype=torch.float64, requires_grad=True)
                    for _ in range(2))
    out = graph_attention(EdgeScore.gat(a_src, a_dst), v, ei, n, backend="torch")
    logits = torch.nn.functional.leaky_relu(a_dst.T[:, :, None] + a_src.T[:, None, :], 0.2)
    ref, _ = dense_oracle(logits, mask, v)
    torch.testing.assert_close(out, ref.reshape(n, -1))
    g1 = torch.autograd.grad(out.square().sum(), (a_src, a_dst, v))
    g2 = torch.autograd.grad(ref.square().sum(), (a_src, a_dst, v))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_gatv2_matches_dense_masked_softmax():
    n, H, C = 9, 2, 3
    ei, mask = unique_graph(n, n, 0.4, seed=4)
    s = make_score("gatv2", n, n, 0, H, C, edge=False, seed=5)
    v = torch.randn(n, H, C, dtype=torch.float64)
    out = graph_attention(s, v, ei, n, backend="torch")
    z = torch.nn.functional.leaky_relu(s.dst[:, None] + s.src[None, :], 0.2)  # [i, j, H, C]
    logits = (z * s.att).sum(-1).permute(2, 0, 1)  # [H, i, j]
    ref, _ = dense_oracle(logits, mask, v)
    torch.testing.assert_close(out, ref.reshape(n, -1))


def test_segment_softmax_huge_logits_and_groups():
    index = torch.tensor([0, 0, 0, 2, 2, 4])
    score = torch.tensor([[1e4], [1e4 - 1], [-1e4], [3e38], [3e38], [-3e38]])
    alpha = segment_softmax(score, index, 5)
    assert torch.isfinite(alpha).all()
    torch.testing.assert_close(alpha[3:5, 0], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(alpha[5, 0], torch.tensor(1.0))
    sums = torch.zeros(5, 1).index_add_(0, index, alpha)
    torch.testing.assert_close(sums[[0, 2, 4]], torch.ones(3, 1))


# ---------------------------------------------------------------------------
# (b) gradcheck in float64 (the fused kernels' autograd functions have their own)
# ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", kernels(exclude=("triton",)))
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind, backend):
    n_src, n_dst, H, C = 6, 5, 2, 3
    ei = torch.cat([random_graph(n_src, 14, num_dst=n_dst, seed=1),
                    torch.tensor([[0, 0], [1, 1]])], dim=1)  # with a duplicate edge
    E = ei.size(1)
    score = make_score(kind, n_src, n_dst, E, H, C)
    v = torch.randn(n_src, H, C, dtype=torch.float64, requires_grad=True)
    ve = torch.randn(E, H, C, dtype=torch.float64, requires_grad=True)

    def f(v, ve, *ts):
        it = iter(ts)
        s = score.with_tensors(*(None if t is None else next(it) for t in score.tensors()))
        return graph_attention(s, v, ei, n_dst, value_edge=ve, backend=backend,
                               return_attention=True)

    with gatlib.record_kernels() as log:
        assert torch.autograd.gradcheck(f, (v, ve, *leaves(score)))
    assert log and set(e.split(".")[0] for e in log) == {backend}, log


# ---------------------------------------------------------------------------
# (c) every fast kernel against the reference
# ---------------------------------------------------------------------------
def _compare(backend, kind, dtype, H, ei, n_src, n_dst, scale=1.0, C=5):
    E = ei.size(1)
    s = make_score(kind, n_src, n_dst, E, H, C, dtype=dtype, seed=H, scale=scale)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(n_src, H, C, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    ve = torch.randn(E, H, C, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    ref = run("torch", s, v, ei, n_dst, ve)
    got = run(backend, s, v, ei, n_dst, ve)
    if dtype == torch.float32:
        tol = dict(rtol=1e-4, atol=1e-5) if scale == 1 else dict(rtol=1e-3, atol=1e-3)
    else:
        tol = dict(rtol=1e-7, atol=1e-9) if scale == 1 else dict(rtol=1e-7, atol=1e-6)
    (out, alpha, grads), (out_r, alpha_r, grads_r) = got, ref
    assert out.dtype == out_r.dtype and alpha.dtype == alpha_r.dtype
    torch.testing.assert_close(out, out_r, **tol)
    torch.testing.assert_close(alpha, alpha_r, **tol)
    for i, (a, b) in enumerate(zip(grads, grads_r, strict=True)):
        if b is None:
            assert a is None or a.abs().max() == 0, i
        else:
            bound = max(1.0, b.abs().max().item()) if scale != 1 else 1.0
            torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * bound, msg=str(i))
    assert torch.isfinite(out).all()
    has_in = torch.zeros(n_dst, dtype=torch.bool)
    has_in[ei[1]] = True
    assert out[~has_in].abs().sum() == 0  # zero in-degree -> zero output


@pytest.mark.parametrize("backend", CPU_FAST)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("H", [1, 4], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("graph", GRAPH_CASES)
def test_kernel_matches_reference(backend, kind, dtype, H, graph):
    ei, n_src, n_dst = graph_case(graph)
    _compare(backend, kind, dtype, H, ei, n_src, n_dst)


@pytest.mark.parametrize("backend", CPU_FAST)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_matches_reference_huge_logits(backend, kind):
    ei, n_src, n_dst = graph_case("random")
    _compare(backend, kind, torch.float32, 2, ei, n_src, n_dst, scale=1e4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graphs(), H=st.integers(1, 3), kind=st.sampled_from(KINDS),
       scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**16))
def test_property_every_cpu_kernel_is_the_reference(graph, H, kind, scale, seed):
    """Any drawn graph: finite output, weights summing to one over each
    destination's in-edges, zero rows without in-edges, and every CPU kernel
    (Triton aside) equal to the reference — outputs, weights and gradients."""
    ei, n_src, n_dst = graph
    E = ei.size(1)
    s = make_score(kind, n_src, n_dst, E, H, 4, dtype=torch.float64, seed=seed, scale=scale)
    v = torch.randn(n_src, H, 4, dtype=torch.float64, requires_grad=True)
    out, alpha, grads = run("torch", s, v, ei, n_dst)
    assert torch.isfinite(out).all() and torch.isfinite(alpha).all()
    sums = torch.zeros(n_dst, H, dtype=torch.float64).index_add_(0, ei[1], alpha)
    has_in = torch.zeros(n_dst, dtype=torch.bool)
    has_in[ei[1]] = True
    torch.testing.assert_close(sums[has_in], torch.ones_like(sums[has_in]))
    assert out[~has_in].abs().sum() == 0
    for backend in ["fused"] + (["scatter"] if HAS_SCATTER else []):
        o2, a2, g2 = run(backend, s, v, ei, n_dst)
        torch.testing.assert_close(o2, out, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a2, alpha, rtol=1e-9, atol=1e-9)
        for a, b in zip(g2, grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8 * scale)


# ---------------------------------------------------------------------------
# Low precision: every path, the reference included, against float64.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", [p for p in kernels() if p.values[0] != "triton"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_low_precision_bound(backend, kind, dtype):
    """float16/bfloat16: output and every gradient within LOW_PRECISION_BOUND ulps
    (of the largest exact value) of the float64 computation — for the reference
    as much as for the fast kernels (flash-attention's tests bound their kernel
    against an upcast reference the same way)."""
    errs = low_precision_errors(kind, dtype, backend)
    assert max(errs) <= LOW_PRECISION_BOUND[backend], errs


# ---------------------------------------------------------------------------
# Behaviour.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", kernels())
def test_permutation_equivariance(backend):
    """Relabelling the nodes permutes the output rows (and edge order is irrelevant)."""
    n, H, C = 30, 2, 4
    layer = gatlib.GATConv(8, C, heads=H, backend=backend)
    x = torch.randn(n, 8)
    ei = random_graph(n, 150, seed=9, self_loops=False)
    perm = torch.randperm(n)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)  # node i is called inv[i] after relabelling
    edge_perm = torch.randperm(ei.size(1))
    with gatlib.record_kernels() as log:
        out = layer(x, ei)
        out_p = layer(x[perm], inv[ei][:, edge_perm])
    assert log == [backend, backend]
    torch.testing.assert_close(out_p, out[perm], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", kernels())
def test_dropout_only_in_training(backend):
    n, H, C = 20, 2, 3
    ei = random_graph(n, 80, seed=1)
    s = make_score("gat", n, n, ei.size(1), H, C, dtype=torch.float32, requires_grad=False)
    v = torch.randn(n, H, C)
    base = graph_attention(s, v, ei, n, dropout=0.5, training=False, backend=backend)
    torch.testing.assert_close(graph_attention(s, v, ei, n, backend=backend), base)
    torch.manual_seed(0)
    dropped = graph_attention(s, v, ei, n, dropout=0.5, training=True, backend=backend)
    assert not torch.allclose(dropped, base)


def _call(device="cpu", dtype=torch.float32, channels=2):
    x = torch.zeros(3, 1, channels, dtype=dtype, device=device)
    plan = GraphPlan._owned(torch.tensor([[0, 1], [1, 2]], device=device), 3, 3)
    return AttentionCall(EdgeScore.dot(x, x), x, plan, None, 0.0, False)


def test_auto_rule():
    """The rule written in select_kernel: on CPU fused from FUSED_CPU_MIN_ENTRIES
    [E, H, C] entries, the reference below; the reference on devices other than
    CPU and CUDA and wherever fused cannot run."""
    from gatlib._dispatch import FUSED_CPU_MIN_ENTRIES

    assert select_kernel("auto", _call(channels=FUSED_CPU_MIN_ENTRIES // 2)).name == "fused"
    assert select_kernel("auto", _call(channels=FUSED_CPU_MIN_ENTRIES // 2 - 1)).name == "torch"
    assert select_kernel("auto", _call("meta")).name == "torch"
    n = 300
    x = torch.randn(n, 32)  # (not narrower than a head: no input-space aggregation)
    ei = random_graph(n, FUSED_CPU_MIN_ENTRIES // 64, seed=1)  # with the loops, past the bound
    conv = gatlib.GATConv(32, 32, heads=2)
    with gatlib.record_kernels() as log:
        conv(x, ei)
        torch.func.vmap(lambda t: conv(t, ei))(x[None].expand(2, -1, -1))
    assert log == ["fused", "torch"]  # vmap: fused declines with a reason, auto takes the reference


def test_auto_says_why_and_warns_once_where_it_falls_back(monkeypatch):
    """Where the fused kernel would run but cannot, auto runs the reference with one warning
    per reason (not one per call), and record_kernels' decisions say why: the rule applied
    and each kernel passed over with its reasons."""
    from gatlib._dispatch import FUSED_CPU_MIN_ENTRIES, Dispatch, FallbackWarning

    monkeypatch.setattr(gatlib._dispatch, "_WARNED", set())  # (as in a fresh process)
    n = 300
    x = torch.randn(n, 32)
    ei = random_graph(n, FUSED_CPU_MIN_ENTRIES // 64, seed=1)
    conv = gatlib.GATConv(32, 32, heads=2)
    vmapped = torch.func.vmap(lambda t: conv(t, ei))
    with gatlib.record_kernels() as log:
        with pytest.warns(FallbackWarning, match=r"runs the \[E, H, C\] reference .* 'fused' .*Vmap"):
            vmapped(x[None].expand(2, -1, -1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second time: no warning
            vmapped(x[None].expand(2, -1, -1))
            conv(x, ei)
            conv(x[:20], random_graph(20, 30, seed=2))  # small: the size rule, no fallback
    rule = "CPU, at least FUSED_CPU_MIN_ENTRIES [E, H, C] entries"
    vmap_reason = ("a torch.func transform is active (Vmap); fused kernels support grad/vjp only",)
    assert log.decisions == [
        Dispatch("auto", "torch", rule, {"fused": vmap_reason}),
        Dispatch("auto", "torch", rule, {"fused": vmap_reason}),
        Dispatch("auto", "fused", rule, {}),
        Dispatch("auto", "torch", "CPU, fewer [E, H, C] entries than FUSED_CPU_MIN_ENTRIES", {})]


def test_a_refusal_names_every_reason(monkeypatch):
    """A kernel's reasons are all of them, not the first: a named backend's error lists
    each (here edge weights and a row too wide for the Triton kernels)."""
    pytest.importorskip("triton")
    triton = gatlib._dispatch.KERNELS["triton"]
    monkeypatch.setattr(type(triton), "available", lambda self, device: None)  # as on a GPU
    wide = torch.zeros(3, 3, 1025)
    plan = _call().plan
    call = AttentionCall(EdgeScore.dot(wide, wide), wide, plan, None, 0.0, False, torch.ones(2))
    reasons = triton.reasons(call)
    assert len(reasons) == 2, reasons
    assert reasons[0] == "the Triton kernels take no edge weights (explainer edge masks)"
    assert "at most 4096 (padded) heads x channels per row" in reasons[1]
    with pytest.raises(ValueError, match=r"cannot run this call: the Triton kernels take no edge "
                                         r"weights .*; the Triton kernels take at most 4096"):
        select_kernel("triton", call)


def test_auto_rule_on_cuda(monkeypatch):
    """On CUDA, auto takes the Triton kernels (measured on an H100) and the
    reference only where they decline. No GPU here: the calls claim CUDA."""
    pytest.importorskip("triton")
    monkeypatch.setattr(AttentionCall, "device", property(lambda self: torch.device("cuda")))
    assert select_kernel("auto", _call()).name == "triton"
    call = _call()
    weighted = AttentionCall(call.score, call.value, call.plan, None, 0.0, False, torch.ones(2))
    assert select_kernel("auto", weighted).name == "torch"  # explainer edge masks
    wide = torch.zeros(3, 3, 1025)
    plan = call.plan
    assert select_kernel("auto", AttentionCall(EdgeScore.dot(wide, wide), wide, plan, None, 0.0,
                                               False)).name == "torch"  # > 4096 heads x channels


def test_explicit_backend_never_hands_over():
    """An explicitly named kernel that cannot run the call raises with its reason."""
    x = torch.randn(5, 4)
    ei = random_graph(5, 12, seed=1)
    conv = gatlib.GATConv(4, 2, heads=2, backend="fused")
    with pytest.raises(ValueError, match=r"backend='fused' cannot run this call: .*Vmap"):
        torch.func.vmap(lambda t: conv(t, ei))(x[None].expand(2, -1, -1))
    with pytest.raises(ValueError, match=r"backend='fused' cannot run this call: .*CPU tensors; got meta"):
        select_kernel("fused", _call("meta"))


def test_available_backends():
    names = gatlib.available_backends("cpu")
    assert names[0] == "torch" and "fused" in names
    assert gatlib.available_backends("meta") == ("torch",) + (("scatter",) if HAS_SCATTER else ())


def test_edge_score_checks_its_kind():
    x = torch.zeros(2, 1, 3)
    with pytest.raises(ValueError, match="kind must be one of"):
        EdgeScore("gcn", x, x)
    with pytest.raises(ValueError, match="needs per-destination terms"):
        EdgeScore("dot", x, None)
    with pytest.raises(ValueError, match="att is GATv2's attention vector"):
        EdgeScore("gatv2", x, x)
    assert EdgeScore.dot(x, x).scale == pytest.approx(1 / math.sqrt(3))


@pytest.mark.parametrize("kind", KINDS)
def test_reference_bound_catches_a_low_precision_reference(monkeypatch, kind):
    """The bound protects the specification: a reference that computes in
    bfloat16 (what a one-line change to ``_acc_dtype`` would do) breaks it."""
    bound = LOW_PRECISION_BOUND["torch"]
    assert max(low_precision_errors(kind, torch.bfloat16, "torch")) <= bound
    monkeypatch.setattr(core, "_acc_dtype", lambda dtype: dtype)
    assert max(low_precision_errors(kind, torch.bfloat16, "torch")) > bound


# ---------------------------------------------------------------------------
# Edge weights: PyG's explainer masks, multiplied into the weights after dropout
# ---------------------------------------------------------------------------
def test_edge_weight_is_the_dense_oracle_with_weighted_attention():
    n_src, n_dst, H, C = 7, 5, 2, 3
    ei, mask = unique_graph(n_src, n_dst, 0.5, seed=3)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n_dst, H, C, dtype=torch.float64, generator=g)
    k = torch.randn(n_src, H, C, dtype=torch.float64, generator=g)
    v = torch.randn(n_src, H, C, dtype=torch.float64, generator=g)
    w = torch.rand(ei.size(1), dtype=torch.float64, generator=g)
    out = graph_attention(EdgeScore.dot(q, k, None, 0.5), v, ei, n_dst, edge_weight=w, concat=False,
                          backend="torch")
    _, att = dense_oracle(torch.einsum("ihc,jhc->hij", q, k) * 0.5, mask, v)
    W = torch.zeros(n_dst, n_src, dtype=torch.float64)
    W[ei[1], ei[0]] = w
    want = torch.einsum("hij,ij,jhc->ihc", att, W, v).mean(1)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("backend", CPU_FAST)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("graph", ["random", "hub", "empty", "bipartite"])
def test_edge_weight_every_cpu_kernel_is_the_reference(backend, kind, graph):
    """Output and every gradient — the weights' included — as the reference's,
    with dropout's mask in the same call (training, fixed seed)."""
    ei, n_src, n_dst = graph_case(graph)
    results = []
    for b in ("torch", backend):
        score = make_score(kind, n_src, n_dst, ei.size(1), 2, 3, seed=5)
        v = torch.randn(n_src, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
        v.requires_grad_()
        w = torch.rand(ei.size(1), dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        w.requires_grad_()
        with gatlib.record_kernels() as log:
            out = graph_attention(score, v, ei, n_dst, edge_weight=w, backend=b)
            ins = [*leaves(score), v, w]
            grads = torch.autograd.grad(out.pow(2).sum(), ins, allow_unused=True)
        assert log[:1] == [b]
        results.append((out, grads))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o1, o2)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_edge_weight_checked_and_triton_declines_it(monkeypatch):
    ei, n_src, n_dst = graph_case("random")
    score = make_score("gat", n_src, n_dst, ei.size(1), 2, 3)
    v = torch.randn(n_src, 2, 3, dtype=torch.float64)
    for bad, exc in ((torch.ones(ei.size(1) + 1, dtype=torch.float64), ValueError),
                     (torch.ones(ei.size(1), 2, dtype=torch.float64), ValueError),
                     (torch.ones(ei.size(1), dtype=torch.long), TypeError), ([1.0], TypeError)):
        with pytest.raises(exc, match="edge_weight"):
            graph_attention(score, v, ei, n_dst, edge_weight=bad)
    plan = GraphPlan(ei, size=(n_src, n_dst))
    call = AttentionCall(score, v, plan, None, 0.0, False, torch.ones(ei.size(1), dtype=torch.float64))
    triton = gatlib._dispatch.KERNELS["triton"]
    monkeypatch.setattr(type(triton), "available", lambda self, device: None)  # as on a GPU
    assert triton.supports(call) == "the Triton kernels take no edge weights (explainer edge masks)"


@pytest.mark.parametrize("backend", kernels())
@pytest.mark.parametrize("concat", [True, False])
def test_bias_is_added_to_every_output_row(backend, concat):
    """``bias``: ``out + bias`` on every kernel (the Triton kernels add it themselves
    with concatenated heads), its gradient the sum of the output's over the rows."""
    ei, n_src, n_dst = graph_case("hub")
    score = make_score("gatv2", n_src, n_dst, ei.size(1), 2, 3, seed=1)
    v = torch.randn(n_src, 2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6 if concat else 3, dtype=torch.float64, requires_grad=True)
    with gatlib.record_kernels() as log:
        out = graph_attention(score, v, ei, n_dst, concat=concat, bias=b, backend=backend)
    assert log[:1] == [backend]
    ref = graph_attention(score, v, ei, n_dst, concat=concat, backend="torch") + b
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad((out * w).sum(), [v, b, *leaves(score)]),
                    torch.autograd.grad((ref * w).sum(), [v, b, *leaves(score)]), strict=True):
        torch.testing.assert_close(a, r)


def test_bias_checked():
    ei, n_src, n_dst = graph_case("random")
    score = make_score("gat", n_src, n_dst, ei.size(1), 2, 3)
    v = torch.randn(n_src, 2, 3, dtype=torch.float64)
    for bad, concat, exc, match in ((torch.ones(3, dtype=torch.float64), True, ValueError, r"\[6\]"),
                                    (torch.ones(6, dtype=torch.float64), False, ValueError, r"\[3\]"),
                                    (torch.ones(2, 3, dtype=torch.float64), True, ValueError, r"\[6\]"),
                                    (torch.ones(6, dtype=torch.long), True, TypeError, "floating"),
                                    ([0.0] * 6, True, TypeError, "floating")):
        with pytest.raises(exc, match=f"bias.*{match}"):
            graph_attention(score, v, ei, n_dst, concat=concat, bias=bad)
    with pytest.raises(ValueError, match="bias is on meta but value is on cpu"):
        graph_attention(score, v, ei, n_dst, bias=torch.ones(6, device="meta"))
