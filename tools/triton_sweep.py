"""GPU: the fused Triton attention's time per pass under schedule variants, and
against another checkout's kernels, on one synthetic graph.

Times ``gatlib.graph_attention(..., backend="triton")`` alone (no projections,
no reference, no agreement check: ``gatlib selftest`` and ``gatlib compare``
check the results) for each score kind, forward (no grad) and forward+backward,
with CUDA events (``triton.testing.do_bench``, median). ``--variant
TILE:PROGRAMS[:STAGES[:RESIDENT]]`` sets the row kernels' tile (elements of the
``[R, E, C]`` tile a program holds per step, at every width), programs per SM, the
pipelining stages of their edge loops (1: not pipelined) and the programs their
register cap lets share an SM (every row kernel alike) before timing
(``gatlib.introspect.triton_tiles``; repeatable; ``default``: the library's own);
``--variant NAME=VALUE[,NAME=VALUE]`` sets ``triton_tiles``' arguments by name
(``edges_wide=16``: the forward's schedule at rows of 128 channels as one lane of
16 edges per step, as before it took 4 lanes of 4).
Only the public API is used, so the same script times an older checkout's
kernels: ``PYTHONPATH=<checkout> python tools/triton_sweep.py`` (by its path: ``python
-m`` puts the working directory, and so this checkout's gatlib, ahead of
``PYTHONPATH``; kinds and variants that checkout cannot run are skipped).

Usage (CUDA only; from the repository root)::

    python -m tools.triton_sweep --variant default --variant 2048:4 --json sweep.json
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
import time
from pathlib import Path

import torch

# "gat_inputs", "dot_inputs": GATConv's and TransformerConv's calls in input space
# (F = --in-channels < C): values (and the key) x_j of one head that all heads share;
# "gat_inputs_data": GATConv's first layer, whose inputs need no gradient
KINDS = ("gat", "gat_projected", "gatv2", "dot", "gat_inputs", "gat_inputs_data", "dot_inputs")


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(prog="python -m tools.triton_sweep",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default="arxiv-like")
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--in-channels", type=int, default=128,
                   help="F of the input-space kinds (the arxiv-like graph's features)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--variant", action="append", default=None,
                   help="TILE:PROGRAMS_PER_SM[:STAGES[:RESIDENT]], NAME=VALUE[,NAME=VALUE] "
                        "(introspect.triton_tiles' arguments), or default (repeatable; default: "
                        "default)")
    p.add_argument("--profile", action="store_true",
                   help="also list the GPU time of each kernel in a forward+backward of each "
                        "kind (torch.profiler, the mean of 3), at every variant: each kernel's "
                        "time under each schedule")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time (ms)")
    p.add_argument("--label", default="", help="a name for this checkout in the output")
    p.add_argument("--json", type=Path, default=None)
    return p


def _graph(name: str, device):
    from gatlib.bench.synthetic import PRESETS, power_law_edges

    spec = PRESETS[name]
    ei = power_law_edges(spec.num_nodes, spec.num_edges, exponent=spec.exponent,
                         max_degree=spec.max_degree, seed=0)
    loops = torch.arange(spec.num_nodes).repeat(2, 1)  # as the GAT layers add them
    return torch.cat([ei, loops], dim=1).to(device), spec.num_nodes


def _inputs(kind, N, E, H, C, dtype, device, F=128):
    """``(score, value)`` of one kind's call; the values are ``[N, H, C]``, or in
    input space ``[N, 1, F]`` (one head for all)."""
    from gatlib import EdgeScore

    g = torch.Generator(device=device).manual_seed(0)

    def r(*shape):
        return (0.1 * torch.randn(*shape, generator=g, device=device, dtype=dtype)).requires_grad_()

    if kind in ("gat_inputs", "gat_inputs_data"):
        return EdgeScore.gat(r(N, H), r(N, H)), r(N, 1, F).requires_grad_(kind == "gat_inputs")
    if kind == "dot_inputs":  # the key is the value: x_j
        x = r(N, 1, F)
        return EdgeScore.dot(r(N, H, F), x, None, C ** -0.5), x
    value = r(N, H, C)
    if kind == "gat":
        return EdgeScore.gat(r(N, H), r(N, H)), value
    if kind == "gat_projected":  # GATConv's: the scores' terms formed from the values' rows
        return EdgeScore.gat_projected(value, r(H, C), r(H, C)), value
    if kind == "gatv2":  # GATv2Conv's: the source projection is also the value
        return EdgeScore.gatv2(value, r(N, H, C), r(H, C)), value
    return EdgeScore.dot(r(N, H, C), r(N, H, C)), value


def _tiles(variant: str):
    """The ``introspect.triton_tiles`` block for ``variant`` (``default``: as they are),
    or ``None`` where this checkout has none."""
    from gatlib import introspect

    tiles = getattr(introspect, "triton_tiles", None)
    if tiles is None:
        return contextlib.nullcontext() if variant == "default" else None
    if variant == "default":
        return tiles()
    if "=" in variant:
        named = dict(item.split("=", 1) for item in variant.split(","))
        if not set(named) <= set(inspect.signature(tiles).parameters):
            return None
        return tiles(**{k: int(v) for k, v in named.items()})
    values = [int(v) for v in variant.split(":")]
    if not 2 <= len(values) <= 4:
        raise ValueError(f"--variant: TILE:PROGRAMS[:STAGES[:RESIDENT]] or default, got {variant!r}")
    names = ("tile", "programs_per_sm", "stages", "resident")[:len(values)]
    if not set(names) <= set(inspect.signature(tiles).parameters):
        return None
    return tiles(**dict(zip(names, values, strict=True)))


def _time(kind, plan, N, H, C, dtype, device, args):
    """``(pass, median ms, first call s)`` of one kind's call on ``plan``, per pass."""
    import triton.testing

    from gatlib import graph_attention

    score, value = _inputs(kind, N, plan.num_edges, H, C, dtype, device, args.in_channels)
    grad = torch.randn(N, H * value.size(-1), device=device, dtype=dtype)
    ins = [t for t in (*score.tensors(), value) if t is not None]

    def forward():
        with torch.no_grad():
            graph_attention(score, value, plan, N, backend="triton")

    def forward_backward():
        graph_attention(score, value, plan, N, backend="triton").backward(grad)

    out = []
    for phase in args.passes:
        step = forward if phase == "fwd" else forward_backward
        t0 = time.perf_counter()
        step()  # compile and warm
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ms = triton.testing.do_bench(step, warmup=10, rep=args.rep, grad_to_none=ins,
                                     return_mode="median")
        out.append((phase, ms, first))
    return out


def _profile(kind, plan, N, H, C, dtype, device, F, runs=3):
    """``[(kernel, calls, GPU ms)]`` of a warmed forward+backward (the mean of ``runs``),
    most time first: where a pass's time goes among the row kernels, merges and ATen
    ops."""
    from torch.profiler import ProfilerActivity, profile

    from gatlib import graph_attention

    score, value = _inputs(kind, N, plan.num_edges, H, C, dtype, device, F)
    grad = torch.randn(N, H * value.size(-1), device=device, dtype=dtype)
    graph_attention(score, value, plan, N, backend="triton").backward(grad)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            graph_attention(score, value, plan, N, backend="triton").backward(grad)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        us = e.cuda_time_total if us is None else us
        if us > 0:
            rows.append((e.key, e.count // runs, us / 1e3 / runs))
    return sorted(rows, key=lambda r: -r[2])


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tools.triton_sweep needs a CUDA device")
    import gatlib
    from gatlib import GraphPlan

    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    ei, N = _graph(args.graph, device)
    H, C = args.heads, args.channels
    rows, profiles = [], []
    for variant in args.variant or ["default"]:
        block = _tiles(variant)
        if block is None:
            print(f"[sweep] variant {variant}: this checkout cannot set the tile; skipped")
            continue
        with block as values:
            if values:
                print(f"[sweep] {variant}: {values}", flush=True)
            plan = GraphPlan(ei, num_nodes=N)  # a new plan for each variant
            for kind in args.kinds:
                if kind == "gat_projected" and not hasattr(gatlib.EdgeScore, "gat_projected"):
                    continue
                for phase, ms, first in _time(kind, plan, N, H, C, dtype, device, args):
                    rows.append(dict(label=args.label, variant=variant, kind=kind, phase=phase,
                                     ms=ms, first_s=first, tiles=values))
                    print(f"[sweep] {args.label or '-'} {variant:>10} {kind:>13} {phase:>7}: "
                          f"{ms:8.3f} ms (first call {first:.1f} s)", flush=True)
                if args.profile:
                    kernels = _profile(kind, plan, N, H, C, dtype, device, args.in_channels)
                    profiles.append(dict(variant=variant, kind=kind, kernels=kernels))
                    for name, calls, ms in kernels[:6]:
                        print(f"[profile] {variant:>10} {kind:>13} {ms:8.3f} ms {calls:3d}x "
                              f"{name[:70]}", flush=True)
    result = dict(command=" ".join(sys.argv), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, graph=args.graph, nodes=N, edges=ei.size(1), heads=H,
                  channels=C, in_channels=args.in_channels, dtype=args.dtype, rows=rows, profiles=profiles)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
