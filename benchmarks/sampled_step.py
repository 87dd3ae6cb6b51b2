"""One training step of the ogbn-products GAT on NeighborLoader batches: gatlib's
hop-trimmed SampledGAT against PyG trimming the same way, and both on the whole subgraph.

    python benchmarks/sampled_step.py --graph arxiv-like --json benchmarks/results/sampled_step_arxiv-like_cpu.json

The model is :class:`gatlib.models.SampledGAT` as ``gatlib bench --loader
neighbor`` trains it (3 layers, 4 heads x 128 channels, skip linears; fan-outs
10, 10, 5; 512 seeds per batch). Ways to run a step (forward, cross-entropy on
the seeds, backward) on the same pre-sampled batches, every one with the same weights:

* ``gatlib trimmed``: layer ``l`` only on the bipartite block its successors
  need, ``(x, x[:num_dst])`` with the in-edges of the ``num_dst`` destinations
  (what the benchmark trains with);
* ``PyG trimmed``: the same forward on the same blocks, PyG's ``GATConv`` in
  place of gatlib's (the like-for-like comparison);
* ``PyG trim_to_layer``: what PyG documents for this (``examples/hierarchical_sampling.py``,
  ``BasicGNN``): before layer ``l``, ``torch_geometric.utils.trim_to_layer`` drops the
  ``l`` outermost hops' nodes and edges, and the layer runs on what is left, every
  remaining node a destination;
* ``PyG trim_to_layer compiled``: that model under ``torch.compile(dynamic=True)``
  (one graph for every batch size), compiled on every batch before timing;
* ``gatlib whole`` and ``PyG whole``: every layer on the whole subgraph, seeds
  sliced at the end (PyG's ogbn-products example's forward).

All of them agree on the seeds' logits (checked before timing, in eval mode);
then they are timed in interleaved rounds, a new batch every call. Ratios are
against ``PyG trimmed``.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import os
import statistics
import time

import torch
import torch.nn.functional as F

from gatlib.bench import report, synthetic
from gatlib.bench.measure import failure, time_interleaved
from gatlib.bench.sampled import batch_hop_counts, neighbor_loader
from gatlib.models import SampledGAT

BASE = "PyG trimmed"


def edge_hop_counts(edge_index: torch.Tensor, node_counts) -> list:
    """Edges per hop, ``[hop 1, ..., hop L]``: the edges into the nodes of hop ``k - 1`` (what
    pyg-lib's sampler reports as ``num_sampled_edges``; the torch_sparse one reports nothing).
    Checks, and raises ``RuntimeError`` otherwise, that the edges come hop by hop, which
    ``trim_to_layer`` relies on."""
    bounds = torch.tensor(list(itertools.accumulate(node_counts))[:-1])
    hop = torch.bucketize(edge_index[1], bounds, right=True)  # [E]: hop of each destination
    if bool((hop[1:] < hop[:-1]).any()):
        raise RuntimeError("the sampled edges are not ordered hop by hop: trim_to_layer cannot trim them")
    return torch.bincount(hop, minlength=len(node_counts) - 1)[: len(node_counts) - 1].tolist()


def sample(graph, fanouts, batch_size: int, count: int, seed: int):
    """``count`` batches: ``(x, edge_index, nodes per hop, edges per hop)``."""
    from torch_geometric.data import Data

    data = Data(x=graph.x, edge_index=graph.edge_index, num_nodes=graph.x.size(0))
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randperm(data.num_nodes, generator=g)[: batch_size * count]
    torch.manual_seed(seed)
    loader = neighbor_loader(data, input_nodes=seeds, num_neighbors=list(fanouts),
                             batch_size=batch_size, shuffle=False)
    batches = []
    for b in itertools.islice(loader, count):
        nodes = batch_hop_counts(b, len(fanouts))
        edges = getattr(b, "num_sampled_edges", None)
        edges = [int(e) for e in edges] if edges is not None else edge_hop_counts(b.edge_index, nodes)
        batches.append((b.x, b.edge_index, nodes, edges))
    return batches


def pyg_convs(model: SampledGAT) -> torch.nn.ModuleList:
    """PyG ``GATConv`` layers holding ``model``'s layers' weights."""
    from torch_geometric.nn import GATConv

    convs = torch.nn.ModuleList()
    for conv in model.convs:
        pyg = GATConv(conv.in_channels, conv.out_channels, heads=conv.heads, concat=conv.concat)
        pyg.load_state_dict(conv.state_dict())
        convs.append(pyg)
    return convs


def pyg_twin(model: SampledGAT) -> SampledGAT:
    """``model`` with PyG's GATConv layers holding the same weights: the same forward,
    trimmed to the same blocks (``GATConv((x_src, x_dst), edge_index)``) or on the whole graph."""
    twin = copy.deepcopy(model)
    twin.convs = pyg_convs(model)
    return twin


class TrimToLayerGAT(torch.nn.Module):
    """``SampledGAT`` as a PyG user trims it: ``trim_to_layer`` before every layer (as PyG's
    ``BasicGNN`` does given ``num_sampled_nodes_per_hop``/``num_sampled_edges_per_hop``), PyG's
    ``GATConv`` and the skip linear on the trimmed graph. Logits of every node left after the
    last trim (seeds and hop 1); the caller slices the seeds."""

    def __init__(self, model: SampledGAT):
        super().__init__()
        self.num_layers, self.dropout = model.num_layers, model.dropout
        self.convs = pyg_convs(model)
        self.skips = copy.deepcopy(model.skips)

    def forward(self, x, edge_index, num_sampled_nodes_per_hop, num_sampled_edges_per_hop):
        from torch_geometric.utils import trim_to_layer

        for i in range(self.num_layers):
            x, edge_index, _ = trim_to_layer(i, num_sampled_nodes_per_hop,
                                             num_sampled_edges_per_hop, x, edge_index)
            x = self.convs[i](x, edge_index) + self.skips[i](x)
            if i < self.num_layers - 1:
                x = F.dropout(F.elu(x), self.dropout, self.training)
        return x


def seed_logits(kind: str, model, batch):
    """The seeds' logits of one variant's forward."""
    x, ei, nodes, edges = batch
    if kind == "trimmed":
        return model(x, ei, nodes)
    if kind == "trim_to_layer":
        return model(x, ei, nodes, edges)[: nodes[0]]
    return model(x, ei)[: nodes[0]]


def step_fn(kind: str, model, batches, num_classes: int):
    labels = [torch.randint(0, num_classes, (b[2][0],)) for b in batches]
    it = itertools.cycle(range(len(batches)))

    def fn():
        i = next(it)
        F.cross_entropy(seed_logits(kind, model, batches[i]), labels[i]).backward()

    return fn


def compile_warm(fn, calls: int):
    """Calls ``fn`` ``calls`` times (every batch, train mode) so that no compile falls into the
    timing: ``{"status", "seconds", "calls": [{"seconds", "graphs"}], "settled"}`` and what
    :func:`gatlib.bench.compare.compile_stats` counted (graphs, graph breaks and their reasons);
    ``settled``: the last ``calls // 2`` calls compiled nothing."""
    from gatlib.bench.compare import add_stats, compile_stats

    per_call, total = [], {}
    t0 = time.perf_counter()
    for _ in range(calls):
        with compile_stats() as stats:
            t = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 — recorded and reported
                return {**failure(exc), "calls": per_call, **total}
        add_stats(total, stats)
        per_call.append({"seconds": time.perf_counter() - t, "graphs": stats["graphs"]})
    settled = not any(c["graphs"] for c in per_call[calls - calls // 2:])
    return {"status": "ok", "seconds": time.perf_counter() - t0, "calls": per_call,
            "settled": settled, **total}


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
    p.add_argument("--no-compile", action="store_true",
                   help="leave out PyG's trim_to_layer model under torch.compile")
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
    trim = TrimToLayerGAT(model)
    # name: (how it runs, the module)
    variants = {"gatlib trimmed": ("trimmed", model), BASE: ("trimmed", twin),
                "PyG trim_to_layer": ("trim_to_layer", trim)}
    if not args.no_compile:
        variants["PyG trim_to_layer compiled"] = ("trim_to_layer", torch.compile(trim, dynamic=True))
    variants.update({"gatlib whole": ("whole", model), "PyG whole": ("whole", twin)})

    # Agreement: every variant's seed logits against gatlib on the whole subgraph, eval mode.
    agreement, compiled = {}, {}
    for module in (model, twin, trim):
        module.eval()
    with torch.no_grad():
        for batch in batches[:2]:
            ref = seed_logits("whole", model, batch)
            for name, (kind, module) in list(variants.items()):
                try:
                    out = seed_logits(kind, module, batch)
                except Exception as exc:  # noqa: BLE001 — a compiled side that cannot compile
                    if not name.endswith("compiled"):
                        raise
                    compiled[name] = {**failure(exc), "when": "agreement check (eval mode)"}
                    del variants[name]
                    continue
                err = float((out - ref).abs().max() / ref.abs().max())
                agreement[name] = max(agreement.get(name, 0.0), err)
    worst = max(agreement.values())
    assert worst < 1e-4, f"the forwards disagree: max relative difference per variant {agreement}"
    for module in (model, twin, trim):
        module.train()

    fns = {name: step_fn(kind, module, batches, args.classes) for name, (kind, module) in variants.items()}
    for name in [n for n in fns if n.endswith("compiled")]:
        compiled[name] = compile_warm(fns[name], 2 * len(batches))
        c = compiled[name]
        print(f"{name}: {len(c['calls'])} warm-up steps (every batch twice) {c.get('seconds', 0):.0f} s, "
              f"{c.get('graphs')} graphs, {c.get('graph_breaks')} graph breaks, settled: {c.get('settled')}"
              + (f" ({c['status']}: {c.get('error')})" if c["status"] != "ok" else ""))
        if c["status"] != "ok":
            del fns[name]
    load = {"before": os.getloadavg()}  # another job on the machine shows here
    res = time_interleaved(fns, torch.device("cpu"), args.repeats)
    load["after"] = os.getloadavg()
    nodes = statistics.mean(b[0].size(0) for b in batches)
    edges = statistics.mean(b[1].size(1) for b in batches)
    hops = [statistics.mean(b[2][k] for b in batches) for k in range(len(fanouts) + 1)]
    edge_hops = [statistics.mean(b[3][k] for b in batches) for k in range(len(fanouts))]
    base = res[BASE]["median_s"]
    rows = [[k, f"{1000 * v['median_s']:.0f}", f"{base / v['median_s']:.2f}x",
             f"{min(v['times_s']) * 1000:.0f}-{max(v['times_s']) * 1000:.0f}"]
            if v["status"] == "ok" else [k, v["status"], "-", "-"] for k, v in res.items()]
    print(f"{args.graph}: fan-outs {args.fanouts}, {args.batch_size} seeds; per batch "
          f"{nodes:.0f} nodes (per hop {', '.join(f'{h:.0f}' for h in hops)}), {edges:.0f} edges "
          f"(per hop {', '.join(f'{h:.0f}' for h in edge_hops)})")
    print(report.format_table(["step", "median ms", f"vs {BASE}", "rounds ms"], rows, align="<>>>"))
    if args.json:
        report.write_json(args.json, {
            **report.environment("cpu"), "command": report.command_line(), "graph": args.graph,
            "fanouts": fanouts, "batch_size": args.batch_size, "mean_nodes": nodes,
            "mean_edges": edges, "mean_nodes_per_hop": hops, "mean_edges_per_hop": edge_hops,
            "baseline": BASE, "agreement_rel": worst, "agreement_rel_per_variant": agreement,
            "compile": {name: {"options": {"dynamic": True}, **c} for name, c in compiled.items()},
            "loadavg_1_5_15_min": load, "results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
