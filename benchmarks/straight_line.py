"""How fast the small-graph GATConv call could be without gatlib's structure.

The same ATen ops as gatlib's fused CPU path on a new ``edge_index`` (checks,
self-loops, projections, scores, the softmax's scatter reductions on the
unsorted edge list, aggregation, and a hand-written backward: what
``_fused_cpu._SmallGAT`` runs), written as one straight function with a
minimal autograd function: no plan object, no dispatch, no layer checks. Its output
equals gatlib's GATConv exactly (asserted), and it is timed against gatlib's
and PyG's layers, alternated in short rounds in one process (the machine's
speed drifts between runs). The gap between "straight" and "gatlib" is what
gatlib's Python structure costs per call. A diagnostic, not part of the
library: GAT only, no dropout, no edge features.

    python benchmarks/straight_line.py --batch-size 1
"""
import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from gatlib.bench import synthetic
from gatlib.bench.compare import build_pair
from per_batch import _layer_call, sample_batches


class _Straight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, t, v, src, dst, num_dst, slope):
        e = F.leaky_relu_(s.index_select(0, src).add_(t.index_select(0, dst)), slope)
        shape = (num_dst, e.size(1))
        m = e.new_full(shape, -math.inf).scatter_reduce_(0, dst[:, None].expand_as(e), e, "amax")
        e.sub_(m.index_select(0, dst)).exp_()
        den = e.new_zeros(shape).index_add_(0, dst, e)
        alpha = e.div_(den.index_select(0, dst))
        x = v.index_select(0, src).mul_(alpha.unsqueeze(-1))
        out = v.new_zeros(num_dst, *v.shape[1:]).index_add_(0, dst, x)
        ctx.slope, ctx.num_dst = slope, num_dst
        ctx.save_for_backward(s, t, v, alpha, src, dst)
        return out

    @staticmethod
    def backward(ctx, g_out):
        s, t, v, alpha, src, dst = ctx.saved_tensors
        g_e = g_out.contiguous().index_select(0, dst)
        ad = (g_e * v.index_select(0, src)).sum(-1)
        dv = torch.zeros_like(v).index_add_(0, src, g_e.mul_(alpha.unsqueeze(-1)))
        ad.mul_(alpha)
        delta = ad.new_zeros(ctx.num_dst, ad.size(1)).index_add_(0, dst, ad)
        de = ad.sub_(delta.index_select(0, dst).mul_(alpha))
        z = s.index_select(0, src).add_(t.index_select(0, dst))
        dz = torch.ops.aten.leaky_relu_backward(de, z, ctx.slope, False)
        ds = torch.zeros_like(s).index_add_(0, src, dz)
        dt = torch.zeros_like(t).index_add_(0, dst, dz)
        return ds, dt, dv, None, None, None, None


def straight_gat(conv):
    """A function ``(x, edge_index) -> out`` computing ``conv`` (a gatlib GATConv
    with self-loops, concat=True) the straight way."""
    H, C = conv.heads, conv.out_channels

    def fn(x, ei):
        n = x.size(0)
        ei = ei.to(torch.int64, copy=True)
        lo, hi = torch.aminmax(ei)
        if lo.item() < 0 or hi.item() >= n:
            raise IndexError("edge_index out of range")
        keep = ei[0] != ei[1]
        if not bool(keep.all()):
            ei = ei[:, keep]
        looped = torch.cat([ei, torch.arange(n).expand(2, n)], 1)
        h = conv.lin(x).view(n, H, C)
        s, t = (h * conv.att_src).sum(-1), (h * conv.att_dst).sum(-1)
        out = _Straight.apply(s, t, h, looped[0], looped[1], n, conv.negative_slope)
        return out.view(n, H * C) + conv.bias

    return fn


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--threads", type=int, default=2)
    return p


def main():
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    graph = synthetic.synthetic_graph("arxiv-like", seed=0)
    batches = sample_batches(graph, args.batch_size, [10, 5], 8, 0)
    pair = build_pair("gat", graph.x.size(1), 4, 64, "fused", torch.device("cpu"), torch.float32, 0)
    straight = straight_gat(pair["gatlib"])
    x0, ei0 = batches[0]
    torch.testing.assert_close(straight(x0, ei0), pair["gatlib"](x0, ei0),
                               rtol=0, atol=0)

    fns = {k: _layer_call(f, batches)
           for k, f in (("pyg", pair["pyg"]), ("gatlib", pair["gatlib"]), ("straight", straight))}
    for f in fns.values():
        for _ in range(30):
            f()
    t0 = time.perf_counter()
    fns["pyg"]()
    reps = max(2, int(0.05 / (time.perf_counter() - t0)))
    res = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                f()
            res[k].append((time.perf_counter() - t) / reps * 1e3)
    edges = statistics.mean(ei.size(1) for _, ei in batches)
    print(f"batch {args.batch_size}, {edges:.0f} edges; ms per forward+backward (median of "
          f"{args.rounds} rounds) and PyG / x (median of the per-round ratios):")
    for k, v in res.items():
        ratio = statistics.median(p / q for p, q in zip(res["pyg"], v, strict=True))
        print(f"  {k:9s} {statistics.median(v):7.3f} ms  {ratio:5.2f}x")


if __name__ == "__main__":
    main()
