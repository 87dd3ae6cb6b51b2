"""Per-batch cost: one attention layer on NeighborLoader subgraphs, a new graph every call.

    python benchmarks/per_batch.py --graph arxiv-like --json benchmarks/results/per_batch_arxiv-like_cpu.json

Mini-batch training hands a layer a new, small graph on every call, so nothing
derived from a graph can be reused: gatlib builds its plan (checks, CSR/CSC
layout, self-loops) inside each call. PyG's
``NeighborLoader`` samples subgraphs of a synthetic graph with OGB's sizes
(fan-outs as PyG's and DGL's ogbn-products examples); for each batch size, the
same pre-sampled batches cycle through PyG's layer and gatlib's — as users
run it (``auto``, which picks the reference or the fused kernel by the graph's
size), with the fused CPU kernel and with the reference (``torch``) — forward
and backward of the input features, timed in interleaved rounds: "PyG / auto"
is the ratio of the medians, "per round" the median of each round's ratio (the
more robust of the two on a machine whose speed drifts). The fused and
reference columns show where auto's size rule should switch. What a fused call
derives from its graph (the plan with self-loops, its CSR/CSC layout) is timed
alone.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from gatlib import GraphPlan
from gatlib.bench import report, synthetic
from gatlib.bench.compare import LAYERS, build_pair
from gatlib.bench.measure import time_interleaved


def sample_batches(graph, batch_size: int, fanouts, count: int, seed: int):
    """``count`` NeighborLoader subgraphs: ``(x, edge_index)`` each (edges of every hop)."""
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader

    data = Data(x=graph.x, edge_index=graph.edge_index, num_nodes=graph.x.size(0))
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randperm(data.num_nodes, generator=g)[: batch_size * count]
    loader = NeighborLoader(data, num_neighbors=list(fanouts), batch_size=batch_size,
                            input_nodes=seeds, shuffle=False)
    return [(b.x, b.edge_index) for b in itertools.islice(loader, count)]


def _layer_call(module, batches):
    """Forward and backward of ``module`` on the next batch, with a new
    ``edge_index`` tensor each call (as a loader gives)."""
    xs = [x.clone().requires_grad_() for x, _ in batches]
    it = itertools.cycle(range(len(batches)))

    def fn():
        i = next(it)
        out = module(xs[i], batches[i][1].clone())
        out.backward(torch.ones_like(out))

    return fn


def _plan_ms(batches) -> float:
    """Milliseconds per batch to derive what a fused call needs from a new graph:
    the checked plan with self-loops and its CSR/CSC layout."""
    def derive():
        for x, ei in batches:
            GraphPlan(ei, num_nodes=x.size(0)).with_self_loops().layout()

    derive()
    t0 = time.perf_counter()
    derive()
    return 1e3 * (time.perf_counter() - t0) / len(batches)


def _paired(times, a: str, b: str) -> float:
    """Median over the rounds of ``a``'s time / ``b``'s time in the same round."""
    return statistics.median(x / y for x, y in zip(times[a]["times_s"], times[b]["times_s"],
                                                   strict=True))


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", default="arxiv-like", help="a gatlib.bench.synthetic preset or synthetic:N:E:F")
    p.add_argument("--layer", default="gat", choices=list(LAYERS))
    p.add_argument("--batch-sizes", default="64,256,1024,4096")
    p.add_argument("--fanouts", default="15,10,5",
                   help="neighbours per hop (default: 15,10,5, as DGL's ogbn-products GAT example)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--batches", type=int, default=8, help="pre-sampled batches per size (default: 8)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    graph = synthetic.synthetic_graph(args.graph, seed=args.seed)
    fanouts = [int(f) for f in args.fanouts.split(",")]
    H, C = args.heads, args.channels
    impls = {"pyg": ("pyg", None), "auto": ("gatlib", "auto"), "fused": ("gatlib", "fused"),
             "torch": ("gatlib", "torch")}
    modules = {name: build_pair(args.layer, graph.x.size(1), H, C, backend or "torch",
                                torch.device("cpu"), torch.float32, args.seed)[side]
               for name, (side, backend) in impls.items()}
    rows, results = [], []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        batches = sample_batches(graph, bs, fanouts, args.batches, args.seed)
        n = statistics.mean(x.size(0) for x, _ in batches)
        e = statistics.mean(ei.size(1) for _, ei in batches)
        fns = {name: _layer_call(m, batches) for name, m in modules.items()}
        t = time_interleaved(fns, torch.device("cpu"), args.repeats, warmup=2, min_block_s=0.3)
        plan_ms = _plan_ms(batches)
        ms = {k: (1e3 * v["median_s"] if v["status"] == "ok" else None) for k, v in t.items()}
        # The rounds run A B B A, so each round's PyG and fused blocks are neighbours
        # in time: the median of per-round ratios cancels the machine's slow drift,
        # which the ratio of the two medians does not.
        res = {"batch_size": bs, "mean_nodes": n, "mean_edges": e, "ms": ms, "plan_ms": plan_ms,
               "pyg_over_auto_paired": _paired(t, "pyg", "auto"),
               "torch_over_fused_paired": _paired(t, "torch", "fused"),
               "rounds": {k: v.get("times_s") for k, v in t.items()}}
        results.append(res)
        rows.append([bs, f"{n:,.0f}", f"{e:,.0f}", f"{ms['pyg']:.2f}", f"{ms['auto']:.2f}",
                     f"{ms['fused']:.2f}", f"{ms['torch']:.2f}", f"{ms['pyg'] / ms['auto']:.2f}×",
                     f"{res['pyg_over_auto_paired']:.2f}×", f"{res['torch_over_fused_paired']:.2f}×",
                     f"{plan_ms:.2f}"])
        print(f"batch {bs}: {rows[-1]}", flush=True)
    headers = ["batch", "nodes", "edges", "PyG ms", "auto ms", "fused ms", "torch ms", "PyG / auto",
               "per round", "torch / fused", "plan ms"]
    print(report.format_table(headers, rows, align=">" * len(headers)))
    if args.json:
        report.write_json(args.json, {
            "command": report.command_line(), "environment": report.environment("cpu"),
            "config": {**vars(args), "threads": torch.get_num_threads()},
            "graph": {"name": args.graph, "num_nodes": graph.x.size(0),
                      "num_edges": graph.edge_index.size(1)},
            "layer": LAYERS[args.layer], "heads": H, "channels": C, "results": results})


if __name__ == "__main__":
    main()
