"""One training step of the ogbn-products GAT on NeighborLoader batches: gatlib's
hop-trimmed SampledGAT, the same model on the whole subgraph, and PyG's layers.

    python benchmarks/sampled_step.py --graph arxiv-like --json benchmarks/results/sampled_step_arxiv-like_cpu.json

The model is :class:`gatlib.models.SampledGAT` as ``gatlib bench --loader
neighbor`` trains it (3 layers, 4 heads x 128 channels, skip linears; fan-outs
10, 10, 5; 512 seeds per batch). Three ways to run a step (forward, cross-entropy
on the seeds, backward) on the same pre-sampled batches:

* ``gatlib trimmed``: layer ``l`` only on the bipartite block its successors
  need (what the benchmark trains with);
* ``gatlib whole``: every layer on the whole subgraph, seeds sliced at the end
  (PyG's example's forward), gatlib's layers;
* ``PyG whole``: the same, with PyG's ``GATConv`` holding the same weights.

The three agree on the seeds' logits (checked before timing, in eval mode);
then they are timed in interleaved rounds, a new batch every call.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import statistics

import torch
import torch.nn.functional as F

from gatlib.bench import report, synthetic
from gatlib.bench.measure import time_interleaved
from gatlib.bench.sampled import batch_hop_counts, neighbor_loader
from gatlib.models import SampledGAT


def sample(graph, fanouts, batch_size: int, count: int, seed: int):
    """``count`` batches: ``(x, edge_index, hop counts)``."""
    from torch_geometric.data import Data

    data = Data(x=graph.x, edge_index=graph.edge_index, num_nodes=graph.x.size(0))
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randperm(data.num_nodes, generator=g)[: batch_size * count]
    torch.manual_seed(seed)
    loader = neighbor_loader(data, input_nodes=seeds, num_neighbors=list(fanouts),
                             batch_size=batch_size, shuffle=False)
    return [(b.x, b.edge_index, batch_hop_counts(b, len(fanouts)))
            for b in itertools.islice(loader, count)]


def pyg_twin(model: SampledGAT) -> SampledGAT:
    """``model`` with PyG's GATConv layers holding the same weights."""
    from torch_geometric.nn import GATConv

    twin = copy.deepcopy(model)
    for i, conv in enumerate(model.convs):
        pyg = GATConv(conv.in_channels, conv.out_channels, heads=conv.heads, concat=conv.concat)
        pyg.load_state_dict(conv.state_dict())
        twin.convs[i] = pyg
    return twin


def step_fn(model, batches, trimmed: bool, num_classes: int):
    labels = [torch.randint(0, num_classes, (counts[0],)) for _, _, counts in batches]
    it = itertools.cycle(range(len(batches)))

    def fn():
        i = next(it)
        x, ei, counts = batches[i]
        out = model(x, ei, counts) if trimmed else model(x, ei)[: counts[0]]
        F.cross_entropy(out, labels[i]).backward()

    return fn


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default="arxiv-like", help="synthetic preset or synthetic:N:E:F")
    p.add_argument("--fanouts", default="10,10,5")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--batches", type=int, default=6, help="pre-sampled batches cycled through")
    p.add_argument("--classes", type=int, default=47)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None, help="keep the synthetic graph here")
    p.add_argument("--json", default=None)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    fanouts = [int(f) for f in args.fanouts.split(",")]
    graph = synthetic.synthetic_graph(args.graph, cache_dir=args.cache_dir)
    batches = sample(graph, fanouts, args.batch_size, args.batches, seed=0)
    torch.manual_seed(0)
    model = SampledGAT(graph.x.size(1), args.classes, num_layers=len(fanouts))
    twin = pyg_twin(model)

    model.eval()
    twin.eval()
    with torch.no_grad():
        worst = 0.0
        for x, ei, counts in batches[:2]:
            ref = model(x, ei)[: counts[0]]
            for out in (model(x, ei, counts), twin(x, ei)[: counts[0]]):
                worst = max(worst, float((out - ref).abs().max() / ref.abs().max()))
    assert worst < 1e-4, f"the three forwards disagree: max relative difference {worst:.2e}"
    model.train()
    twin.train()

    fns = {"gatlib trimmed": step_fn(model, batches, True, args.classes),
           "gatlib whole": step_fn(model, batches, False, args.classes),
           "PyG whole": step_fn(twin, batches, False, args.classes)}
    res = time_interleaved(fns, torch.device("cpu"), args.repeats)
    nodes = statistics.mean(b[0].size(0) for b in batches)
    edges = statistics.mean(b[1].size(1) for b in batches)
    hops = [statistics.mean(b[2][k] for b in batches) for k in range(len(fanouts) + 1)]
    base = res["PyG whole"]["median_s"]
    rows = [[k, f"{1000 * v['median_s']:.0f}", f"{base / v['median_s']:.2f}x",
             f"{min(v['times_s']) * 1000:.0f}-{max(v['times_s']) * 1000:.0f}"] for k, v in res.items()]
    print(f"{args.graph}: fan-outs {args.fanouts}, {args.batch_size} seeds; per batch "
          f"{nodes:.0f} nodes (per hop {', '.join(f'{h:.0f}' for h in hops)}), {edges:.0f} edges")
    print(report.format_table(["step", "median ms", "vs PyG", "rounds ms"], rows, align="<>>>"))
    if args.json:
        report.write_json(args.json, {
            **report.environment("cpu"), "command": report.command_line(), "graph": args.graph,
            "fanouts": fanouts, "batch_size": args.batch_size, "mean_nodes": nodes,
            "mean_edges": edges, "mean_nodes_per_hop": hops, "agreement_rel": worst,
            "results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
