"""Input-space against projected aggregation: one attention layer's forward and backward.

    python benchmarks/input_space.py --graph arxiv-like --json benchmarks/results/input_space_arxiv-like_cpu.json
    python benchmarks/input_space.py --device cuda --pass forward --json input_space_arxiv-like_cuda.json

Where the input is narrower than a head (``F < C``), GATConv and TransformerConv
attend the inputs and project after (``W_h sum_j alpha_ij x_j``; the rule is
``gatlib.layers._input_space``). This times
gatlib's GATConv and TransformerConv, which take that form (a forward hook on
the value projection checks it never runs; TransformerConv's rule keeps CUDA
inputs projected, so there its input-space form is forced), against the projected form of the
same layer with the same weights written with the public core
(:func:`gatlib.graph_attention` over a :class:`gatlib.GraphPlan`, as the layers
computed it before), forward and backward (or the forward alone under
``no_grad``, ``--pass forward``), in A B B A rounds, on CPU or CUDA. It also prints
the values each edge moves per head in the fused kernels, ``C`` against ``F``.
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
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--pass", dest="pass_", default="forward+backward",
                   choices=["forward+backward", "forward"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    return p


def layer_steps(x, plan, H, C, backend, forward_only=False):
    """``{form: forward and backward}``: gatlib's GATConv and TransformerConv (which
    attend in input space by their rule: checked by a forward hook on the value
    projection, which must not run), and the projected form of each with the
    same weights, written with the public core as the layers computed it before."""
    N = x.size(0)
    torch.manual_seed(0)
    gat = gatlib.GATConv(x.size(1), C, heads=H, add_self_loops=False, backend=backend).to(x.device)
    tf = gatlib.TransformerConv(x.size(1), C, heads=H, backend=backend).to(x.device)
    scale = 1.0 / math.sqrt(C)

    def attend(score, value):
        return gatlib.graph_attention(score, value, plan, N, backend=backend)  # [N, H*C]

    def gat_projected():
        h = gat.lin(x).view(N, H, C)
        w = gat.lin.weight.view(H, C, -1)  # a_h . W_h x as x @ (W_h^T a_h), as GATConv does
        s = x @ (w * gat.att_src.view(H, C, 1)).sum(1).t()
        t = x @ (w * gat.att_dst.view(H, C, 1)).sum(1).t()
        return attend(EdgeScore.gat(s, t, negative_slope=gat.negative_slope), h) + gat.bias

    def tf_projected():
        q, k, v = (lin(x).view(N, H, C) for lin in (tf.lin_query, tf.lin_key, tf.lin_value))
        return attend(EdgeScore.dot(q, k, scale=scale), v) + tf.lin_skip(x)

    def step(fn):
        def run():
            if forward_only:
                with torch.no_grad():
                    return fn()
            out = fn()
            out.backward(torch.ones_like(out))
        return run

    return {"GAT projected": step(gat_projected), "GAT input-space": step(lambda: gat(x, plan)),
            "Transformer projected": step(tf_projected),
            "Transformer input-space": step(lambda: tf(x, plan))}, (gat.lin, tf.lin_value)


def main() -> None:
    args = build_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = synthetic.synthetic_graph(args.graph)
    x, N, H, C = g.x.to(device), g.x.size(0), args.heads, args.channels
    plan = GraphPlan(g.edge_index.to(device), num_nodes=N).with_self_loops()
    steps, projections = layer_steps(x, plan, H, C, args.backend, args.pass_ == "forward")
    projected = []
    hooks = [p.register_forward_hook(lambda *a: projected.append(1)) for p in projections]
    with gatlib.record_kernels() as log:
        steps["GAT input-space"]()
        steps["Transformer input-space"]()
    for h in hooks:
        h.remove()
    if projected:
        raise SystemExit(f"F={x.size(1)}, C={C}: the layers projected first (input space needs F < C)")
    res = measure.time_interleaved(steps, device, args.repeats)
    rows = [[k, f"{v['median_s'] * 1e3:,.2f}" if v["status"] == "ok" else v["status"]]
            for k, v in res.items()]
    print(f"{args.graph}: N={N:,}, E={plan.num_edges:,} with self-loops, F={x.size(1)}, H={H}, C={C}, "
          f"kernel {log[0]}, {torch.get_num_threads()} threads, median of {args.repeats} rounds")
    print(report.format_table([args.pass_, "ms"], rows, align="<>"))
    print(f"values moved per edge and head: {C} projected, {x.size(1)} in input space")
    if args.json:
        report.write_json(args.json, {
            "command": report.command_line(), "environment": report.environment(device),
            "pass": args.pass_,
            "graph": {"name": args.graph, "num_nodes": N, "num_edges": plan.num_edges,
                      "features": x.size(1)},
            "heads": H, "channels": C, "kernel": log[0], "repeats": args.repeats, "steps": res})


if __name__ == "__main__":
    main()
