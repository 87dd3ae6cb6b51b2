"""Whole-layer forward+backward of gatlib's fused CPU backend against PyG, on an arxiv-like graph.

Scratch benchmark for the CPU fused path (benchmarks/NOTES.md, "CPU fused path"); the
project-wide comparison is ``gatlib compare``. For each layer it

1. builds PyG's layer and gatlib's with the same weights, checks that outputs and
   input gradients agree (on a small graph, and on the benchmark graph),
2. times forward+backward interleaved in one process (A B B A ..., medians), and
3. measures peak extra memory of one forward+backward in a fresh process per
   (implementation, layer): ``VmHWM`` after resetting it (``/proc/self/clear_refs``)
   once the inputs exist, minus the RSS at that point.

Usage::

    python benchmarks/fused_cpu_micro.py --layers gat gatv2 transformer --repeats 3 \\
        --json benchmarks/results/fused_cpu_micro.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gatlib  # noqa: E402


def arxiv_like(num_nodes=169_343, num_edges=1_166_243, seed=0, exponent=0.8):
    """Random power-law graph shaped like ogbn-arxiv: ``num_edges`` draws from a
    Zipf-like node distribution, made undirected, then one self-loop per node.
    (~2.37M edges for the defaults.)"""
    from torch_geometric.utils import add_self_loops, remove_self_loops, to_undirected

    g = torch.Generator().manual_seed(seed)
    w = (torch.arange(num_nodes, dtype=torch.float64) + 1).pow(-exponent)
    ends = torch.multinomial(w, 2 * num_edges, replacement=True, generator=g).view(2, -1)
    ei = torch.randperm(num_nodes, generator=g)[ends]  # hubs at random ids
    ei = remove_self_loops(to_undirected(ei, num_nodes=num_nodes))[0]
    return add_self_loops(ei, num_nodes=num_nodes)[0]


def make_layers(kind, in_ch, out_ch, heads, backend):
    """(pyg_layer, gatlib_layer) with identical weights. The graph already has its
    self-loops, so the GAT layers add none."""
    import torch_geometric.nn as pyg

    torch.manual_seed(0)
    if kind == "gat":
        a = pyg.GATConv(in_ch, out_ch, heads=heads, add_self_loops=False)
        b = gatlib.GATConv(in_ch, out_ch, heads=heads, add_self_loops=False, backend=backend)
    elif kind == "gatv2":
        a = pyg.GATv2Conv(in_ch, out_ch, heads=heads, add_self_loops=False)
        b = gatlib.GATv2Conv(in_ch, out_ch, heads=heads, add_self_loops=False, backend=backend)
    else:
        a = pyg.TransformerConv(in_ch, out_ch, heads=heads)
        b = gatlib.TransformerConv(in_ch, out_ch, heads=heads, backend=backend)
    b.load_state_dict(a.state_dict())
    return a, b


def fwd_bwd(layer, x, ei, w):
    """One training step's worth of the layer: forward, then backward of <out, w>."""
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    out = layer(x, ei)
    (out * w).sum().backward()
    return out.detach(), x.grad


def check(kind, heads, channels, x, ei, backend, rtol=1e-3, atol=1e-4):
    a, b = make_layers(kind, x.size(1), channels, heads, backend)
    torch.manual_seed(1)
    w = torch.randn(x.size(0), heads * channels)
    oa, ga = fwd_bwd(a, x, ei, w)
    ob, gb = fwd_bwd(b, x, ei, w)
    torch.testing.assert_close(ob, oa, rtol=rtol, atol=atol)
    torch.testing.assert_close(gb, ga, rtol=rtol, atol=atol)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=rtol, atol=atol * 10, msg=n)


def _status(key):
    return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def memory_child(args):
    """Run in a fresh process: peak extra MiB of one forward+backward."""
    ei, x = load_inputs(args)
    impl, kind = args.memory_child
    a, b = make_layers(kind, x.size(1), args.channels, args.heads, args.backend)
    layer = a if impl == "pyg" else b
    x.requires_grad_()
    w = torch.randn(x.size(0), args.heads * args.channels)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status("VmRSS")
    t = time.perf_counter()
    fwd_bwd(layer, x, ei, w)
    t = time.perf_counter() - t
    print(json.dumps({"extra_mib": _status("VmHWM") - base, "base_mib": base, "seconds": t}))


def load_inputs(args):
    cache = Path(args.cache)
    if cache.exists():
        ei = torch.load(cache)
    else:
        ei = arxiv_like(args.nodes, args.edges)
        torch.save(ei, cache)
    x = torch.randn(args.nodes, args.features, generator=torch.Generator().manual_seed(2))
    return ei, x


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", nargs="+", default=["gat", "gatv2", "transformer"],
                    choices=["gat", "gatv2", "transformer"])
    ap.add_argument("--nodes", type=int, default=169_343)
    ap.add_argument("--edges", type=int, default=1_166_243)
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--backend", default="fused")
    ap.add_argument("--repeats", type=int, default=3, help="timed A B B A rounds per layer")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--cache", default="/tmp/gatlib_arxiv_like.pt")
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        return memory_child(args)

    # correctness first: a small graph, then the benchmark graph itself
    small = arxiv_like(2000, 15000, seed=3)
    xs = torch.randn(2000, args.features, requires_grad=True)
    for kind in args.layers:
        check(kind, args.heads, args.channels, xs, small, args.backend)
    ei, x = load_inputs(args)
    x.requires_grad_()
    print(f"graph: {args.nodes} nodes, {ei.size(1)} edges (with self-loops), "
          f"F={args.features}, H={args.heads}, C={args.channels}; threads={torch.get_num_threads()}")
    results = {}
    for kind in args.layers:
        res = results.setdefault(kind, {})
        if not args.no_time:
            check(kind, args.heads, args.channels, x, ei, args.backend)
            a, b = make_layers(kind, x.size(1), args.channels, args.heads, args.backend)
            w = torch.randn(x.size(0), args.heads * args.channels)
            fwd_bwd(b, x, ei, w)  # warm-up: builds and caches the layouts
            times = {"pyg": [], "gatlib": []}
            for _ in range(args.repeats):
                for name, layer in (("pyg", a), ("gatlib", b), ("gatlib", b), ("pyg", a)):
                    t = time.perf_counter()
                    fwd_bwd(layer, x, ei, w)
                    times[name].append(time.perf_counter() - t)
            ratios = [p / g for p, g in zip(times["pyg"], times["gatlib"])]
            res.update(pyg_s=median(times["pyg"]), gatlib_s=median(times["gatlib"]),
                       speedup=median(ratios), times=times)
            print(f"{kind:12s} fwd+bwd  pyg {res['pyg_s']:7.2f}s  gatlib {res['gatlib_s']:7.2f}s  "
                  f"speedup (median of paired ratios) {res['speedup']:.2f}x", flush=True)
        if not args.no_memory:
            for impl in ("pyg", "gatlib"):
                cmd = [sys.executable, __file__, "--memory-child", impl, kind] + [
                    f"--{k}={getattr(args, k)}" for k in
                    ("nodes", "edges", "features", "heads", "channels", "backend", "cache")]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:  # killed for memory counts as a result
                    res[f"{impl}_extra_mib"] = "OOM" if proc.returncode in (-9, 137) else \
                        f"error: {proc.stderr.strip().splitlines()[-1:]}"
                else:
                    res[f"{impl}_extra_mib"] = json.loads(proc.stdout.strip().splitlines()[-1])["extra_mib"]
            pm, gm = res["pyg_extra_mib"], res["gatlib_extra_mib"]
            ratio = pm / gm if isinstance(pm, float) and isinstance(gm, float) else None
            res["memory_ratio"] = ratio
            print(f"{kind:12s} peak extra memory  pyg {pm} MiB  gatlib {gm} MiB  "
                  f"ratio {ratio if ratio is None else round(ratio, 2)}", flush=True)
    if args.json:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        meta = {"device": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "threads": torch.get_num_threads(), "torch": torch.__version__,
                "torch_geometric": __import__("torch_geometric").__version__,
                "gatlib": gatlib.__version__, "git_sha": sha, "args": vars(args)}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
