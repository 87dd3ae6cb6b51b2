"""GPU micro-benchmark: fused Triton attention vs the PyTorch reference.

For each scorer (GAT, GATv2, dot product) and dtype, on an ogbn-arxiv-like
synthetic graph (gatlib.synthetic's power-law preset plus self-loops), times

* the forward pass (``need_alpha=False``, what a layer needs to train), and
* forward + backward (all inputs require grad),

of the fused path (gatlib._triton) and the reference backend ("torch"),
after checking that the two agree. Next to each fused time it prints the
*bandwidth floor*: the bytes the pass must move at least (every input and
output read or written once, no re-reads of gathered rows) divided by the
device-copy bandwidth measured in the same process — how far the kernel is
from being purely memory bound.

Usage (CUDA only; from the repository root)::

    PYTHONPATH=. python benchmarks/triton_bench.py --out benchmarks/results/triton_bench.json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import torch

import gatlib
from gatlib import DotProductScore, GATScore, GATv2Score
from gatlib import _backend, _triton
from gatlib.synthetic import PRESETS, power_law_edges

KINDS = ("gat", "gatv2", "dot")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default="arxiv-like", choices=sorted(PRESETS))
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--channels", type=int, default=64, help="channels per head")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--edge-features", action="store_true",
                   help="add per-edge score terms (and value_edge for the dot product)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time (ms)")
    p.add_argument("--rep", type=int, default=200, help="do_bench measuring time (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/triton_bench.json"))
    return p.parse_args(argv)


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_graph(name: str, seed: int, device) -> tuple[torch.Tensor, int]:
    spec = PRESETS[name]
    ei = power_law_edges(spec.num_nodes, spec.num_edges, exponent=spec.exponent,
                         max_degree=spec.max_degree, seed=seed)
    loops = torch.arange(spec.num_nodes).repeat(2, 1)  # GAT layers add self-loops
    return torch.cat([ei, loops], dim=1).to(device), spec.num_nodes


def make_inputs(kind, N, E, H, C, dtype, edge_features, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).requires_grad_()

    value = r(N, H, C)
    value_edge = None
    if kind == "gat":
        score = GATScore(r(N, H), r(N, H), r(E, H) if edge_features else None, 0.2)
    elif kind == "gatv2":  # as GATv2Conv: the source projection is also the value
        score = GATv2Score(value, r(N, H, C), r(E, H, C) if edge_features else None, r(H, C), 0.2)
    else:  # as TransformerConv: the edge projection enters the key and the value
        edge = r(E, H, C) if edge_features else None
        score = DotProductScore(r(N, H, C), r(N, H, C), edge, 1 / math.sqrt(C))
        value_edge = edge
    return score, value, value_edge


def _f32(t):
    return None if t is None else t.detach().float().requires_grad_()


def leaves(score, value, value_edge):
    ts = [value, value_edge] + [t for t in vars(score).values() if isinstance(t, torch.Tensor)]
    return list(dict.fromkeys(t for t in ts if t is not None))


def min_bytes(kind, N, E, H, C, elt, edge_features, backward) -> int:
    """Bytes a pass must move at least: each input and output once (a perfect
    cache for gathered rows), index arrays included, padding and re-reads not.

    Forward reads the CSR (src + ptr, plus the edge-id map with edge inputs), the
    per-node and per-edge inputs and writes ``out`` and the ``[N, H]`` fp32
    log-sum-exp. Backward reads the inputs again, ``out``, the log-sum-exp, the
    upstream gradient and both CSR and CSC indices, writes every input's
    gradient, and writes then reads the two ``[E, H]`` fp32 edge buffers.
    """
    node = N * H * C * elt
    idx = E * 4 + (N + 1) * 4 + (E * 4 if edge_features else 0)
    if kind == "gat":
        inputs = node + 2 * N * H * elt + (E * H * elt if edge_features else 0)
    elif kind == "gatv2":  # value is x_src: read once
        inputs = 2 * node + H * C * elt + (E * H * C * elt if edge_features else 0)
    else:  # q, k, v (+ the shared edge term)
        inputs = 3 * node + (E * H * C * elt if edge_features else 0)
    fwd = idx + inputs + node + N * H * 4
    if not backward:
        return fwd
    csc = 2 * E * 4 + (N + 1) * 4 + (E * 4 if edge_features else 0)
    bwd = idx + csc + inputs + 2 * node + 2 * N * H * 4 + inputs + 4 * E * H * 4
    return fwd + bwd


def device_bandwidth(device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    import triton.testing

    a = torch.empty(1 << 28, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * a.numel() * 4 / (ms * 1e-3)


def check(kind, dtype, score, value, value_edge, ei, N, fused_fwd, ref_fwd, ref_impl) -> dict:
    """Fused and reference results (out, alpha, every gradient) against the
    reference run on float32 copies of the inputs. Relative error in the
    Frobenius norm: the fused path passes at most 2x the reference's own error
    in the same dtype, or 1e-4 (float32) / one ulp of the dtype if larger."""
    ins = leaves(score, value, value_edge)
    grad = torch.randn(value.shape, device=value.device, dtype=dtype)

    def results(fn, ins):
        out, alpha = fn(True)
        return [out, alpha, *torch.autograd.grad(out, ins, grad.to(out.dtype))]

    s32 = type(score)(**{k: _f32(t) if isinstance(t, torch.Tensor) else t
                         for k, t in vars(score).items()})
    v32, ve32 = _f32(value), _f32(value_edge)
    if kind == "gatv2":
        s32.x_src = v32  # keep the aliasing of the layer
    if kind == "dot" and value_edge is not None:
        ve32 = s32.edge
    exact = results(lambda need_alpha: ref_impl.attention(
        s32, v32, ei, N, value_edge=ve32, dropout=0.0, training=False, need_alpha=need_alpha),
        leaves(s32, v32, ve32))

    def rel(res):
        return max(float((a.detach().float() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30))
                   for a, b in zip(res, exact, strict=True))

    err_fused, err_torch = rel(results(fused_fwd, ins)), rel(results(ref_fwd, ins))
    tol = 1e-4 if dtype == torch.float32 else torch.finfo(dtype).eps
    return dict(rel_error_fused=err_fused, rel_error_torch=err_torch,
                correct=err_fused <= max(2 * err_torch, tol))


def run_case(kind, dtype, ei, N, args, device, bandwidth):
    import triton.testing

    E, H, C = ei.size(1), args.heads, args.channels
    score, value, value_edge = make_inputs(kind, N, E, H, C, dtype, args.edge_features, device,
                                           args.seed)
    ins = leaves(score, value, value_edge)
    ref_impl = _backend.resolve_backend("torch", torch.device(device))
    kw = dict(value_edge=value_edge, dropout=0.0, training=False)

    def fused_fwd(need_alpha=False):  # the autograd function itself, no fallback
        res = _triton.attention(score, value, ei, N, need_alpha=need_alpha, **kw)
        if res is None:
            raise RuntimeError(f"the fused path declined {kind} {dtype}")
        return res

    def ref_fwd(need_alpha=False):
        return ref_impl.attention(score, value, ei, N, need_alpha=need_alpha, **kw)

    row = dict(kind=kind, dtype=str(dtype).replace("torch.", ""), nodes=N, edges=E, heads=H,
               channels=C, edge_features=args.edge_features)
    try:
        row.update(check(kind, dtype, score, value, value_edge, ei, N, fused_fwd, ref_fwd, ref_impl))
    except torch.cuda.OutOfMemoryError:
        row["correct"] = "oom"
        torch.cuda.empty_cache()
    grad = torch.randn(N, H, C, device=device, dtype=dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    for name, fn in (("fused", fused_fwd), ("torch", ref_fwd)):
        for phase in ("fwd", "fwd+bwd"):
            if phase == "fwd":
                def step(fn=fn):
                    with torch.no_grad():
                        fn()
            else:
                def step(fn=fn):
                    out, _ = fn()
                    out.backward(grad)
            try:
                ms = triton.testing.do_bench(step, warmup=args.warmup, rep=args.rep,
                                             grad_to_none=ins, return_mode="median")
                row[f"{name}_{phase}_ms"] = ms
            except torch.cuda.OutOfMemoryError:
                row[f"{name}_{phase}_ms"] = "oom"
                torch.cuda.empty_cache()
    for phase, backward in (("fwd", False), ("fwd+bwd", True)):
        floor = min_bytes(kind, N, E, H, C, elt, args.edge_features, backward) / bandwidth * 1e3
        row[f"floor_{phase}_ms"] = floor
        t = row.get(f"fused_{phase}_ms")
        if isinstance(t, float):
            row[f"fused_{phase}_of_floor"] = floor / t  # 1.0 = at the bandwidth floor
    return row


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("triton_bench.py needs a CUDA device (the Triton interpreter is for tests only)")
    import triton

    device = "cuda"
    torch.manual_seed(args.seed)
    ei, N = make_graph(args.graph, args.seed, device)
    deg = torch.bincount(ei[1], minlength=N)
    bandwidth = device_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: graph {args.graph} N={N} E={ei.size(1)} "
          f"max in-degree {int(deg.max())}, H={args.heads} C={args.channels}, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = []
    for kind in args.kinds:
        for dname in args.dtypes:
            row = run_case(kind, DTYPES[dname], ei, N, args, device, bandwidth)
            rows.append(row)

    def fmt(v, spec=".3f"):
        return format(v, spec) if isinstance(v, float) else str(v)

    head = (f"{'kind':6} {'dtype':9} {'ok':5} | {'fwd fused':>9} {'torch':>8} {'floor':>7} "
            f"| {'f+b fused':>9} {'torch':>8} {'floor':>7}  (ms)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['kind']:6} {r['dtype']:9} {str(r['correct']):5} | "
              f"{fmt(r['fused_fwd_ms']):>9} {fmt(r['torch_fwd_ms']):>8} {fmt(r['floor_fwd_ms']):>7} | "
              f"{fmt(r['fused_fwd+bwd_ms']):>9} {fmt(r['torch_fwd+bwd_ms']):>8} "
              f"{fmt(r['floor_fwd+bwd_ms']):>7}")
    result = dict(
        device=torch.cuda.get_device_name(), copy_bandwidth_bytes_per_s=bandwidth,
        versions=dict(python=platform.python_version(), torch=torch.__version__,
                      triton=triton.__version__, gatlib=gatlib.__version__,
                      cuda=torch.version.cuda),
        git_sha=git_sha(), graph=args.graph, args={k: str(v) for k, v in vars(args).items()},
        max_in_degree=int(deg.max()), results=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
