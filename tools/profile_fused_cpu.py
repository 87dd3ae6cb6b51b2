"""Where the time of one fused-CPU layer forward+backward goes (docs/design.md,
"Compiled CPU row passes").

    python -m tools.profile_fused_cpu --layer gat --threads 1

Builds the arxiv-like graph (cached by gatlib.bench.synthetic) and its
GraphPlan (checked and sorted once, as in training), runs two warm-up
passes, then prints torch.profiler's per-op table for one forward+backward.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from torch_geometric.utils import to_undirected

import gatlib
from gatlib.bench import synthetic

LAYERS = {"gat": gatlib.GATConv, "gatv2": gatlib.GATv2Conv, "transformer": gatlib.TransformerConv}


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(prog="python -m tools.profile_fused_cpu",
                                description=__doc__.splitlines()[0])
    p.add_argument("--layer", choices=list(LAYERS), default="gat")
    p.add_argument("--graph", default="arxiv-like")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=18, help="ops to list (default: 18)")
    return p


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    g = synthetic.synthetic_graph(args.graph)
    plan = gatlib.GraphPlan(to_undirected(g.edge_index), num_nodes=g.num_nodes)
    layer = LAYERS[args.layer](g.x.size(1), args.channels, heads=args.heads, backend="fused")
    for _ in range(2):
        out = layer(g.x, plan)
        out.backward(torch.ones_like(out))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = layer(g.x, plan)
        out.backward(torch.ones_like(out))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
