"""Float64 at huge logits, against an exact computation (mpmath, 40 digits).

At keys and queries of size 1e4 a Transformer's logits are ~1e8, which float64
holds only to ~1e-8: every implementation's softmax weights are that far off,
and where the exact gradient of the scores vanishes (tied edges: duplicates, or
a saturated softmax) what any of them returns is rounding noise of that size.
So no backend is tested against another here, but each against the exact
answer, within the bound of docs/design.md ("Float64 at huge logits"): with
dalpha_ij = <g_i, v_j>, Delta_i = sum_j alpha_ij dalpha_ij and
b_ij = alpha_ij (|dalpha_ij| + |Delta_i| + |s_ij| |dalpha_ij - Delta_i|) / sqrt(C),

    |got - exact|(dW_q) <= K * eps * sum_i (sum_j b_ij |k_j|) |x_i|

(and dW_k likewise, with |q_i| and |x_j|): the rounding of Delta against
dalpha, and the logits' own rounding (eps |s|) times what it multiplies.
A kernel that drops or misweights a term is off by far more.
"""

import mpmath
import pytest
import torch

import gatlib

from testing import kernels, random_graph

K = 4.0  # the largest ratio measured is 0.43 (docs/design.md)
EPS = torch.finfo(torch.float64).eps
F, H, C = 8, 2, 4


def _case(name):
    """``(edge_index, n, x)``: float64 features of size 1e4, so that the layer's
    logits are ~1e8."""
    g = torch.Generator().manual_seed(0)
    if name == "ties":  # 3 nodes, 40 edges: each destination's sources repeat
        n, ei = 3, random_graph(3, 40, seed=5)
    else:
        n, ei = 12, random_graph(12, 60, seed=6)
    x = torch.randn(n, F, generator=g, dtype=torch.float64) * 1e4
    if name == "near_ties":  # features 1e4 apart by 1e-4: logits differ by O(1)
        x = x[:1] + 1e-4 * torch.randn(n, F, generator=g, dtype=torch.float64)
    return ei, n, x


def _exact(conv, ei, n, x, w):
    """``{name: (exact gradient, bound / eps)}`` of ``conv``'s query and key weights
    for loss = <w, conv(x, ei)>, with mpmath."""
    mpmath.mp.dps = 40
    M = mpmath.mpf
    X = [[M(t) for t in row] for row in x.tolist()]

    def project(lin):
        W, b = lin.weight.tolist(), lin.bias.tolist()
        return [[[mpmath.fsum(M(W[h * C + c][f]) * X[i][f] for f in range(F)) + M(b[h * C + c])
                  for c in range(C)] for h in range(H)] for i in range(n)]

    Q, Kt, V = project(conv.lin_query), project(conv.lin_key), project(conv.lin_value)
    Wg = [[[M(t) for t in row] for row in node] for node in w.view(n, H, C).tolist()]
    r = 1 / mpmath.sqrt(C)
    src, dst = ei[0].tolist(), ei[1].tolist()
    dq, dk = torch.zeros(n, H, C, dtype=torch.float64), torch.zeros(n, H, C, dtype=torch.float64)
    bq, bk = torch.zeros_like(dq), torch.zeros_like(dq)
    for i in range(n):
        js = [j for j, d in zip(src, dst, strict=True) if d == i]
        for h in range(H) if js else ():
            s = [mpmath.fsum(Q[i][h][c] * Kt[j][h][c] for c in range(C)) * r for j in js]
            m = max(s)
            ex = [mpmath.exp(t - m) for t in s]
            a = [t / mpmath.fsum(ex) for t in ex]
            da = [mpmath.fsum(Wg[i][h][c] * V[j][h][c] for c in range(C)) for j in js]
            delta = mpmath.fsum(p * d for p, d in zip(a, da, strict=True))
            for j, aj, daj, sj in zip(js, a, da, s, strict=True):
                ds = aj * (daj - delta) * r
                size = float(aj * (abs(daj) + abs(delta) + abs(sj) * abs(daj - delta)) * r)
                for c in range(C):
                    dq[i, h, c] += float(ds * Kt[j][h][c])
                    dk[j, h, c] += float(ds * Q[i][h][c])
                    bq[i, h, c] += size * abs(float(Kt[j][h][c]))
                    bk[j, h, c] += size * abs(float(Q[i][h][c]))
    ax = x.abs()
    return {"lin_query.weight": (dq.view(n, -1).t() @ x, bq.view(n, -1).t() @ ax),
            "lin_key.weight": (dk.view(n, -1).t() @ x, bk.view(n, -1).t() @ ax)}


@pytest.mark.parametrize("backend", kernels(exclude=("scatter",)))
@pytest.mark.parametrize("name", ["ties", "near_ties", "saturated"])
def test_gradients_at_huge_logits_meet_the_conditioning_bound(name, backend):
    """TransformerConv's query and key weight gradients in float64 at logits ~1e8
    (the hostile-input case where the fused kernel and the reference disagreed)."""
    ei, n, x = _case(name)
    torch.manual_seed(0)
    conv = gatlib.TransformerConv(F, C, heads=H, backend=backend).double()
    w = torch.randn(n, H * C, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    with gatlib.record_kernels() as log:
        (conv(x, ei) * w).sum().backward()
    assert log[0] == backend and (backend == "torch" or f"{backend}.backward" in log), log
    for param, (exact, bound) in _exact(conv, ei, n, x, w).items():
        got = conv.get_parameter(param).grad
        err = (got - exact).abs()
        assert bool((err <= K * EPS * bound).all()), (param, (err / (EPS * bound)).max())
