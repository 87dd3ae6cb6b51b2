"""How much of a library's own Python one layer call runs: the distinct functions and the calls
whose code lives in the package (gatlib's under ``gatlib/``, PyG's under ``torch_geometric/``),
counted with ``sys.setprofile`` over one plain CPU forward with a raw ``[2, E]`` ``edge_index``
after a warm-up call, for gatlib's three layers and PyG's with the same weights.

    python benchmarks/call_count.py --json benchmarks/results/call_count_cpu.json

Two graphs: a small one (auto runs the reference) and one past ``FUSED_CPU_MIN_ENTRIES`` (the
fused CPU kernel). ``--list`` prints every function counted, with its calls.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
import torch_geometric
import torch_geometric.nn as pyg_nn

import gatlib
from gatlib.bench import report

LAYERS = ("GATConv", "GATv2Conv", "TransformerConv")
ROOTS = {"gatlib": os.path.dirname(gatlib.__file__) + os.sep,
         "PyG": os.path.dirname(torch_geometric.__file__) + os.sep}


def count(fn, root: str) -> collections.Counter:
    """``{(file, line, function): calls}`` of the Python functions under ``root`` that
    ``fn()`` runs."""
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(root):
                calls[(os.path.relpath(code.co_filename, root), code.co_firstlineno,
                       code.co_qualname)] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--list", action="store_true", help="print every function counted")
    p.add_argument("--json", default=None)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    graphs = {"small": (200, 1_000), "large": (4_000, 40_000)}
    rows, results = [], {}
    for graph, (n, e) in graphs.items():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, args.features, generator=g)
        ei = torch.randint(0, n, (2, e), generator=g)
        for name in LAYERS:
            torch.manual_seed(0)
            ours = getattr(gatlib, name)(args.features, args.channels, heads=args.heads)
            theirs = getattr(pyg_nn, name)(args.features, args.channels, heads=args.heads)
            theirs.load_state_dict(ours.state_dict())
            for lib, layer in (("gatlib", ours), ("PyG", theirs)):
                with torch.no_grad():
                    # warm-up (lazy imports, the native build, PyG's templates), recording the
                    # kernel; the counted call records nothing (recording runs code of its own)
                    with gatlib.record_kernels() as log:
                        layer(x, ei)
                    calls = count(lambda layer=layer, x=x, ei=ei: layer(x, ei), ROOTS[lib])
                key = f"{graph} {name} {lib}"
                results[key] = {"functions": len(calls), "calls": sum(calls.values()),
                                "kernels": list(log) if lib == "gatlib" else None,
                                "counted": {f"{f}:{line} {q}": c for (f, line, q), c in sorted(calls.items())}}
                rows.append([graph, name, lib, str(len(calls)), str(sum(calls.values())),
                             ",".join(log) if lib == "gatlib" else "-"])
                if args.list:
                    print(f"-- {key}")
                    for (f, line, q), c in sorted(calls.items()):
                        print(f"   {c:3d}  {f}:{line} {q}")
    print(f"one forward, features {args.features}, {args.heads} heads x {args.channels} channels; "
          f"graphs: " + ", ".join(f"{k} {n:,} nodes / {e:,} edges" for k, (n, e) in graphs.items()))
    print(report.format_table(["graph", "layer", "library", "functions", "calls", "kernel"], rows,
                              align="<<<>><"))
    if args.json:
        report.write_json(args.json, {**report.environment("cpu"), "command": report.command_line(),
                                      "graphs": graphs, "features": args.features, "heads": args.heads,
                                      "channels": args.channels, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
