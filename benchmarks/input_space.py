"""Input-space against projected aggregation: one attention layer's forward and backward.

    python benchmarks/input_space.py --graph arxiv-like --heads 3 --channels 256 --threads 2 --json benchmarks/results/input_space_arxiv-like_cpu.json

Where the input is narrower than a head (``F < C``), GATConv and TransformerConv
attend the inputs and project after (``W_h sum_j alpha_ij x_j``; the rule is
``gatlib.layers._input_space``). This times both forms of the same layer through
the public core (:func:`gatlib.graph_attention` over a :class:`gatlib.GraphPlan`),
projections included, forward and backward, in A B B A rounds: GAT's form
(scores from per-node terms) and the Transformer's (dot-product scores; in input
space the key projection moves to the query). It also prints the values each
edge moves per head in the fused kernels, ``C`` against ``F``.
"""
from __future__ import annotations

import argparse
import math

import torch

import gatlib
from gatlib import EdgeScore, GraphPlan
from gatlib.bench import measure, report, synthetic


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", default="arxiv-like", help="a gatlib.bench.synthetic preset or synthetic:N:E:F")
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--channels", type=int, default=256, help="channels per head C (the rule needs F < C)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    return p


def project(agg, w, H):
    """``W_h agg_h`` per head, heads concatenated: ``[N, H*F] -> [N, H*C]``."""
    N, (HC, F) = agg.size(0), w.shape
    return torch.einsum("nhf,hcf->nhc", agg.view(N, H, F), w.view(H, HC // H, F)).reshape(N, HC)


def layer_steps(x, plan, H, C, backend):
    """``{form: forward and backward}`` of GAT's and the Transformer's layer."""
    N, F = x.shape
    g = torch.Generator().manual_seed(0)

    def param(*shape):
        return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).requires_grad_()

    W, Wq, Wk, att_s, att_d = param(H * C, F), param(H * C, F), param(H * C, F), param(H, C), param(H, C)
    x1 = x.unsqueeze(1)  # [N, 1, F]: every head's values (and keys) in input space
    scale = 1.0 / math.sqrt(C)

    def attend(score, value):
        return gatlib.graph_attention(score, value, plan, N, backend=backend)  # [N, H * width]

    def gat_scores():  # a_h . W_h x as x @ (W_h^T a_h), the same in both forms
        w = W.view(H, C, F)
        return x @ (w * att_s[..., None]).sum(1).t(), x @ (w * att_d[..., None]).sum(1).t()

    def gat_projected():
        s, t = gat_scores()
        return attend(EdgeScore.gat(s, t), (x @ W.t()).view(N, H, C))

    def gat_input():
        s, t = gat_scores()
        return project(attend(EdgeScore.gat(s, t), x1), W, H)

    def dot_projected():
        q, k, v = ((x @ m.t()).view(N, H, C) for m in (Wq, Wk, W))
        return attend(EdgeScore.dot(q, k, scale=scale), v)

    def dot_input():
        q_in = torch.einsum("nhc,hcf->nhf", (x @ Wq.t()).view(N, H, C), Wk.view(H, C, F))
        return project(attend(EdgeScore.dot(q_in, x1, scale=scale), x1), W, H)

    def step(fn):
        def run():
            out = fn()
            out.backward(torch.ones_like(out))
        return run

    return {"GAT projected": step(gat_projected), "GAT input-space": step(gat_input),
            "Transformer projected": step(dot_projected), "Transformer input-space": step(dot_input)}


def main() -> None:
    args = build_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = synthetic.synthetic_graph(args.graph)
    x, N, H, C = g.x, g.x.size(0), args.heads, args.channels
    plan = GraphPlan(g.edge_index, num_nodes=N).with_self_loops()
    steps = layer_steps(x, plan, H, C, args.backend)
    with gatlib.record_kernels() as log:
        steps["GAT input-space"]()
    res = measure.time_interleaved(steps, torch.device("cpu"), args.repeats)
    rows = [[k, f"{v['median_s'] * 1e3:,.0f}" if v["status"] == "ok" else v["status"]]
            for k, v in res.items()]
    print(f"{args.graph}: N={N:,}, E={plan.num_edges:,} with self-loops, F={x.size(1)}, H={H}, C={C}, "
          f"kernel {log[0]}, {torch.get_num_threads()} threads, median of {args.repeats} rounds")
    print(report.format_table(["forward + backward", "ms"], rows, align="<>"))
    print(f"values moved per edge and head: {C} projected, {x.size(1)} in input space")
    if args.json:
        report.write_json(args.json, {
            "command": report.command_line(), "environment": report.environment("cpu"),
            "graph": {"name": args.graph, "num_nodes": N, "num_edges": plan.num_edges,
                      "features": x.size(1)},
            "heads": H, "channels": C, "kernel": log[0], "repeats": args.repeats, "steps": res})


if __name__ == "__main__":
    main()
