"""One full-batch training step of a 3-layer GAT on a graph of ogbn-products' size, on CPU.

    python benchmarks/products_step.py --json benchmarks/results/products_step_cpu.json

ogbn-products has 2,449,029 nodes and 61,859,140 edges (123.7M after adding
reverse edges; OGB cannot be downloaded here, so the graph is
:func:`gatlib.bench.synthetic.synthetic_graph`'s ``products-like`` preset with
those sizes and 100 features). The model is three ``gatlib.GATConv`` layers,
4 heads x 32 channels in the hidden layers, one head over 47 classes at the
top, ELU (and optionally feature dropout) in between, Adam; the loss is over a random
8 % of the nodes (ogbn-products' training split is 8 %). PyG's ``GATConv``
would build ``[E', H, C]`` messages: 126M x 4 x 32 floats = 60 GiB per hidden layer.

Every phase — generating the graph, building the plan, forward, backward, the
optimiser step — is timed, and its peak resident memory is read from
``VmHWM`` after resetting it (``/proc/self/clear_refs``) at the phase's start,
so each phase's peak is its own; the process peak is the largest of them.

``--graph-input plan`` (the default) builds one ``GraphPlan`` that the three
layers share; ``--graph-input tensor`` hands each layer the ``edge_index``
tensor, as a quick start writes it (``conv(x, edge_index)``), so each layer
derives its own plan inside its call.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.nn.functional as F

import gatlib
from gatlib import GraphPlan
from gatlib.bench import report, synthetic
from gatlib.bench.measure import proc_status

GiB = 2**30


class GAT3(torch.nn.Module):
    """Three GATConv layers (hidden: ``heads`` x ``hidden``; top: one head), ELU
    and feature dropout between them."""

    def __init__(self, in_channels: int, num_classes: int, hidden: int = 32, heads: int = 4,
                 dropout: float = 0.5):
        super().__init__()
        self.dropout = dropout
        self.convs = torch.nn.ModuleList([
            gatlib.GATConv(in_channels, hidden, heads=heads),
            gatlib.GATConv(heads * hidden, hidden, heads=heads),
            gatlib.GATConv(heads * hidden, num_classes, heads=1, concat=False)])

    def forward(self, x, graph):
        for conv in self.convs[:-1]:
            x = F.dropout(x, self.dropout, self.training)
            x = F.elu(conv(x, graph))
        x = F.dropout(x, self.dropout, self.training)
        return self.convs[-1](x, graph)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS to the current RSS
        f.write("5")


def _gib(field: str) -> float:
    return round(proc_status()[field] / GiB, 3)


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", default="products-like")
    p.add_argument("--classes", type=int, default=47)
    p.add_argument("--dropout", type=float, default=0.0,
                   help="feature dropout before each layer (default: 0; 0.5 keeps ~4 GiB more "
                        "of masks and dropped copies at this size)")
    p.add_argument("--graph-input", default="plan", choices=["plan", "tensor"],
                   help="one GraphPlan shared by the layers, or the edge_index tensor given to "
                        "each layer (default: plan)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    phases = []
    state = {}

    def phase(name, fn):
        gc.collect()
        _reset_peak()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        row = {"phase": name, "seconds": round(seconds, 2), "peak_rss_gib": _gib("VmHWM"),
               "rss_after_gib": _gib("VmRSS")}
        phases.append(row)
        print(f"{name:>10}: {seconds:7.1f} s   peak {row['peak_rss_gib']:6.2f} GiB   "
              f"after {row['rss_after_gib']:6.2f} GiB", flush=True)

    def generate():
        g = synthetic.synthetic_graph(args.graph, seed=args.seed)
        state["x"], state["edge_index"] = g.x, g.edge_index
        N = g.x.size(0)
        state["y"] = torch.randint(0, args.classes, (N,))
        state["train"] = torch.randperm(N)[: int(0.08 * N)]

    def plan():
        if args.graph_input == "tensor":  # each layer derives its own plan in its call
            state["num_edges"] = state["edge_index"].size(1)
            state["plan"], state["plan_gib"] = state.pop("edge_index"), None
            return
        ei = state.pop("edge_index")
        state["num_edges"] = ei.size(1)
        graph = GraphPlan(ei, num_nodes=state["x"].size(0))
        del ei  # the plan holds its own copy
        graph.with_self_loops().layout()  # what GATConv attends over
        state["plan"] = graph
        state["plan_gib"] = round(graph.nbytes / GiB, 3)

    def forward():
        state["model"] = model = GAT3(state["x"].size(1), args.classes, dropout=args.dropout)
        state["opt"] = torch.optim.Adam(model.parameters(), lr=0.005)
        model.train()
        with gatlib.record_kernels() as log:
            out = model(state["x"], state["plan"])
            state["loss"] = F.cross_entropy(out[state["train"]], state["y"][state["train"]])
        state["kernels"] = list(log)

    def backward():
        with gatlib.record_kernels() as log:
            state.pop("loss").backward()
        state["kernels"] += list(log)

    def step():
        state["opt"].step()

    phase("generate", generate)
    phase("plan", plan)
    phase("forward", forward)
    phase("backward", backward)
    phase("optimiser", step)
    peak = max(r["peak_rss_gib"] for r in phases)
    x = state["x"]
    res = {
        "graph": args.graph, "num_nodes": x.size(0), "num_edges": state["num_edges"],
        "num_features": x.size(1), "classes": args.classes, "model": "GAT3 (4x32, 4x32, 1x47)",
        "dropout": args.dropout, "graph_input": args.graph_input,
        "phases": phases, "peak_rss_gib": peak, "plan_gib": state["plan_gib"],
        "kernels": list(dict.fromkeys(state["kernels"])),
        "step_seconds": round(sum(r["seconds"] for r in phases[2:]), 2),
        **report.environment(torch.device("cpu")),
    }
    print(f"plan {res['plan_gib']} GiB; kernels {res['kernels']}")
    print(f"training step (forward + backward + optimiser): {res['step_seconds']} s; "
          f"process peak {peak} GiB")
    if args.json:
        report.write_json(args.json, res)


if __name__ == "__main__":
    main()
