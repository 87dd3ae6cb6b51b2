"""What a GraphPlan costs to build, step by step, and what it holds.

    python benchmarks/plan_cost.py --graph arxiv-like --json benchmarks/results/plan_cost_arxiv-like_cpu.json

A layer given a plain ``[2, E]`` tensor builds all of this on every call; given
a :class:`gatlib.GraphPlan`, on its first call only. Each step is timed alone
(median of ``--repeats`` runs after one warm-up, on fresh objects each time):
checking and copying the edge list; the CSR/CSC layout of unsorted and of
destination-sorted input; the self-loop'ed twin's edge list and layout (sorted
directly, and merged into an existing base layout), the last being everything a
GATConv call derives. The merged step starts from a plan whose base layout is
built, untimed (so it leaves out checking and copying the edge list, which the
other steps include). The plan's bytes are reported beside the edge list's own.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gatlib import GraphPlan
from gatlib.bench import report, synthetic


def timed(fn, repeats: int, setup=None) -> float:
    """Median seconds of ``fn()`` (of ``fn(setup())`` if ``setup`` is given, a fresh
    untimed ``setup()`` before each run) over ``repeats`` runs after one warm-up."""
    def once() -> float:
        arg = () if setup is None else (setup(),)
        t0 = time.perf_counter()
        fn(*arg)
        return time.perf_counter() - t0

    once()
    return statistics.median(once() for _ in range(repeats))


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", default="arxiv-like", help="a gatlib.bench.synthetic preset or synthetic:N:E:F")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = synthetic.synthetic_graph(args.graph)
    ei, N = g.edge_index, g.x.size(0)
    ei_sorted = ei[:, ei[1].argsort(stable=True)]

    def with_base_layout():  # (untimed) a plan whose base layout exists already
        plan = GraphPlan(ei, num_nodes=N)
        plan.layout()
        return plan

    def plan(edges=ei):
        return GraphPlan(edges, num_nodes=N)

    steps = {
        "check and copy the edge list": plan,
        "CSR/CSC layout, unsorted input (2 sorts)": lambda: plan().layout(),
        "CSR/CSC layout, destination-sorted input (1 sort)": lambda: plan(ei_sorted).layout(),
        "self-loops: edge list": lambda: plan().with_self_loops(),
        "self-loops: edge list + layout, sorted directly": lambda: plan().with_self_loops().layout(),
        "self-loops: edge list + layout, merged into the base": (
            lambda p: p.with_self_loops().layout(), with_base_layout),
    }
    rows, results = [], {}
    for name, step in steps.items():
        fn, setup = step if isinstance(step, tuple) else (step, None)
        s = timed(fn, args.repeats, setup)
        results[name] = s
        rows.append([name, f"{s * 1e3:.1f}"])
    plan = GraphPlan(ei, num_nodes=N)
    plan.with_self_loops().layout()  # all a GATConv call derives
    sizes = {"edge list [2, E] int64 (MiB)": ei.numel() * 8 / 2**20,
             "plan after a GATConv call (MiB)": plan.nbytes / 2**20}
    print(f"{args.graph}: N={N:,}, E={ei.size(1):,} (+{N:,} self-loops), "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(report.format_table(["step", "ms"], rows, align="<>"))
    print(report.format_table(["held", "MiB"], [[k, f"{v:,.1f}"] for k, v in sizes.items()], align="<>"))
    if args.json:
        report.write_json(args.json, {
            "command": report.command_line(), "environment": report.environment("cpu"),
            "graph": {"name": args.graph, "num_nodes": N, "num_edges": ei.size(1)},
            "repeats": args.repeats, "seconds": results, "mib": sizes})


if __name__ == "__main__":
    main()
