"""GPU: where the time of one 2-layer training step goes, kernel by kernel.

``gatlib compare --scope model`` times the step of PyG's and gatlib's models, eager
and under ``torch.compile``; this lists, for each side, the GPU time of each
kernel in one warmed step (``torch.profiler``, the sum over its launches), so
that a step's time can be split between the attention kernels, the GEMMs and
everything else. Same models, weights, graph and inputs as ``gatlib compare``
(its helpers build them). It also prints each side's relative difference from
eager PyG in the gradient of the first layer's weight before any step (what
``gatlib compare`` checks at its tolerance), as a diagnosis.

A step that takes longer than its GPU time waits on the host. For that, each side
also lists where one step's host time goes: the profiler's operators and CUDA
runtime calls by their own CPU time (``host_ops``), and the Python functions of a
few steps under ``cProfile`` by their own time (``host_python``; both profilers
slow the host, so read the rankings, not the sums).

Usage (CUDA only; from the repository root)::

    python -m tools.profile_step --layer gat --json profile.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    from gatlib.bench.compare import ALL_IMPLS, COMPILE_MODES, LAYERS

    p = argparse.ArgumentParser(prog="python -m tools.profile_step",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", nargs="+", default=["gat"], choices=list(LAYERS))
    p.add_argument("--graph", default="arxiv-like")
    p.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                   help="torch.compile's mode for both compiled sides, as gatlib compare's "
                        "(reduce-overhead: each step replayed as CUDA graphs)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the step timing")
    p.add_argument("--impls", nargs="+", default=list(ALL_IMPLS), choices=list(ALL_IMPLS),
                   help="sides (pyg, eager PyG, is the gradients' reference: always run)")
    p.add_argument("--top", type=int, default=15,
                   help="kernels, host operators and Python functions listed per side")
    p.add_argument("--json", type=Path, default=None)
    return p


def _profile(step) -> list:
    """``[(kernel, launches, GPU ms)]`` of one call of ``step``, most time first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[2])


def _host_ops(step, top: int) -> list:
    """``[(operator or CUDA runtime call, calls, own CPU ms)]`` of one call of ``step``,
    most time first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()
            if e.self_cpu_time_total > 0]
    return sorted(rows, key=lambda r: -r[2])[:top]


def _host_python(step, top: int, calls: int = 5) -> list:
    """``[(function, calls, own ms per step)]`` of ``calls`` calls of ``step`` under
    ``cProfile``, most time first."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, own s, cum s, callers)}
    rows = [(f"{Path(file).name}:{line}({name})", n // calls, own * 1e3 / calls)
            for (file, line, name), (_, n, own, _, _) in stats.items()]
    return sorted(rows, key=lambda r: -r[2])[:top]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.impls = ["pyg", *(i for i in args.impls if i != "pyg")]
    if not torch.cuda.is_available():
        sys.exit("tools.profile_step needs a CUDA device")
    from gatlib.bench import compare as c
    from gatlib.bench import measure
    from gatlib.bench.data import resolve_data_dir

    device = torch.device("cuda")
    graph = c.load_graph(args.graph, resolve_data_dir(None), 0)
    N, F_in = graph.x.shape
    x = graph.x.to(device)
    ei = graph.edge_index.to(device)
    ei_loops = c.with_self_loops(ei, N)
    H, C = c.DEFAULT_HC["cuda"]
    labels = c.random_labels(N, 40, device, 0)
    out = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "graph": args.graph, "compile_mode": args.compile_mode,
           "layers": {}}
    for layer in args.layer:
        torch._dynamo.reset()
        pair = c.build_pair(layer, F_in, H, C, "triton", device, torch.float32, 0, "model", 40)
        options = {**c.COMPILE_OPTIONS,
                   **({} if args.compile_mode == "default" else {"mode": args.compile_mode})}
        modules = c.with_compiled(pair, args.impls, options)
        edge_index = c.layer_edge_index(layer, ei, ei_loops)
        graphs = {impl: c.graph_input(impl, edge_index, N, "plan") for impl in args.impls}
        grads, sides, steps = {}, {}, {}
        for impl in args.impls:  # before any step: a compiled side shares its eager twin's weights
            c.warm_plan(impl, modules[impl], x, graphs[impl])
            grads[impl] = c.model_outputs(modules[impl], x, graphs[impl], labels)[1]
        for impl in args.impls:
            step = steps[impl] = c.make_pass(modules[impl], x, graphs[impl], labels,
                                             c.TRAIN_STEP)
            if c.is_compiled(impl):  # until a call compiles nothing (and records its graphs)
                settled = c.settle(step, device)
                if settled["status"] != "ok":
                    raise RuntimeError(f"{layer} {impl}: {settled['error']}")
            for _ in range(3):  # warm (reduce-overhead records its CUDA graphs here)
                step()
            kernels = _profile(step)
            total = sum(ms for _, _, ms in kernels)
            err = ((grads[impl] - grads["pyg"]).norm() / grads["pyg"].norm()).item()
            host_ops, host_python = _host_ops(step, args.top), _host_python(step, args.top)
            sides[impl] = {"gpu_ms": total, "kernels": kernels, "weight_grad_rel_err": err,
                           "host_ops": host_ops, "host_python": host_python}
            print(f"== {layer} {impl}: {total:.2f} ms of GPU time in "
                  f"{sum(n for _, n, _ in kernels)} launches; conv1 weight grad vs eager PyG "
                  f"{err:.2e}", flush=True)
            for name, n, ms in kernels[:args.top]:
                print(f"  {ms:8.3f} ms {n:4d}x  {name[:100]}", flush=True)
            for title, rows in (("host: operators and CUDA runtime calls, own CPU time",
                                 host_ops),
                                ("host: Python functions, own time per step (cProfile)",
                                 host_python)):
                print(f"  -- {title}", flush=True)
                for name, n, ms in rows:
                    print(f"  {ms:8.3f} ms {n:4d}x  {name[:100]}", flush=True)
        times = measure.time_interleaved(steps, device, args.repeats)
        for impl, t in times.items():
            if t["status"] != "ok":
                raise RuntimeError(f"{layer} {impl}: {t['error']}")
            sides[impl]["step_ms"] = t["median_s"] * 1e3
            print(f"== {layer} {impl}: step {t['median_s'] * 1e3:.2f} ms, GPU busy "
                  f"{sides[impl]['gpu_ms']:.2f} ms of it", flush=True)
        out["layers"][layer] = sides
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
