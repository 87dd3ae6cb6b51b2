"""An estimate, not a timing: the dependent memory latencies per SM of one launch of a
Triton row kernel, under schedule variants, on a synthetic graph (CPU, no GPU).

    python -m tools.latency_count --widths 128 256 --variant default --variant edges_wide=16

Each block of lanes a program runs is a chain of dependent loads: its items (row,
start, length), their indices, the rows they gather. In a pipelined edge loop (2
stages) a block costs ``2 + steps`` latencies — the items and the first indices,
then one wait per step for loads issued a step earlier; unpipelined ``2 + 2 steps``;
where a block's items were loaded while its predecessor ran (``ahead``), ``1 + steps``
but for each program's first block.
The blocks (``gatlib.introspect.triton_blocks``: the kernels' own lane numbering
and tiles) are shared by the programs their register cap lets share an SM, over
``--sms`` SMs; the count is the sum over blocks divided by that. It assumes the
kernels are bound by the latency of these chains, not by bandwidth: on an H100 it
ordered the forward's schedules at 256 channels as the timings did where the
programs per SM went from 2 to 4, and not beyond (docs/design.md, "Lanes before
edges"). ``--variant NAME=VALUE[,NAME=VALUE]`` sets
``gatlib.introspect.triton_tiles``' arguments (``default``: the library's own).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from gatlib import GraphPlan, introspect
from gatlib.bench import report
from gatlib.bench.compare import triton_tiles_arguments
from gatlib.bench.synthetic import PRESETS, power_law_edges

KERNELS = ("_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel")


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(prog="python -m tools.latency_count",
                                description=__doc__.splitlines()[0])
    p.add_argument("--graph", default="arxiv-like", choices=sorted(PRESETS))
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--widths", type=int, nargs="+", default=[128, 256],
                   help="row widths (channels of the gathered rows, powers of two)")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--kind", type=int, default=1,
                   help="score KIND (0 GAT from node terms, 1 GATv2, 2 dot, 3 GAT from rows): "
                        "it sets the dst backward's register cap")
    p.add_argument("--variant", action="append", default=None,
                   help="NAME=VALUE[,NAME=VALUE] (introspect.triton_tiles' arguments) or default "
                        "(repeatable; default: default)")
    p.add_argument("--one-value", action="store_true",
                   help="the call's value has one head that every head shares (a layer in "
                        "input space; with --kind 2 the key is that value): the library's "
                        "lanes for it (lane_heads=0 as a variant: a lane per item and head)")
    p.add_argument("--sms", type=int, default=132, help="SMs of the GPU (an H100 SXM: 132)")
    p.add_argument("--json", type=Path, default=None)
    return p


def graph(name: str) -> GraphPlan:
    """The graph ``tools.triton_sweep`` times: the preset's edges and a self-loop
    per node."""
    spec = PRESETS[name]
    ei = power_law_edges(spec.num_nodes, spec.num_edges, exponent=spec.exponent,
                         max_degree=spec.max_degree, seed=0)
    loops = torch.arange(spec.num_nodes).repeat(2, 1)
    return GraphPlan(torch.cat([ei, loops], dim=1), num_nodes=spec.num_nodes)


def variant_tiles(variant: str):
    if variant == "default":
        return introspect.triton_tiles()
    return introspect.triton_tiles(**triton_tiles_arguments(variant))


def count(blocks, stages: int, sms: int) -> float:
    """Dependent latencies per SM of one launch's ``blocks`` (introspect.triton_blocks)."""
    per_step = 1 if stages > 1 else 2
    total = 0.0
    for g in blocks:
        programs = g["resident"] * sms
        n = float((2 - g["ahead"] + per_step * g["steps"]).sum())
        if g["ahead"]:  # each program's first block loads its own items
            n += min(g["steps"].numel(), programs)
        total += n / programs
    return total


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    plan = graph(args.graph)
    rows = []
    for variant in args.variant or ["default"]:
        with variant_tiles(variant) as values:
            for width in args.widths:
                for kernel in args.kernels:
                    blocks = introspect.triton_blocks(plan, args.heads, width, kernel, args.kind,
                                                      one_value=args.one_value)
                    n = count(blocks, values["stages"], args.sms)
                    groups = [f"{g['lanes']}x{g['edges']}:{g['steps'].numel()}" for g in blocks]
                    rows.append(dict(variant=variant, width=width, kernel=kernel,
                                     resident=blocks[0]["resident"], stages=values["stages"],
                                     groups=groups, latencies_per_sm=round(n)))
                    print(f"{variant:>16} C={width:<4} {kernel:>16}: {n:8.0f} latencies per SM "
                          f"({blocks[0]['resident']} resident; lanes x edges:blocks "
                          f"{' '.join(groups)})", flush=True)
    if args.json:
        report.write_json(args.json, {"command": report.command_line(),
                                      "environment": report.environment("cpu"),
                                      "graph": args.graph, "heads": args.heads, "sms": args.sms,
                                      "kind": args.kind, "one_value": args.one_value,
                                      "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
