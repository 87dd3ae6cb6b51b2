"""GPU micro-benchmark: fused Triton attention vs the PyTorch reference.

For each scorer (GAT, GATv2, dot product) and dtype, on an ogbn-arxiv-like
synthetic graph (gatlib.bench.synthetic's power-law preset plus self-loops), times

* the forward pass (no attention weights returned, what a layer needs to train), and
* forward + backward (all inputs require grad),

of ``gatlib.graph_attention`` with ``backend="triton"`` (the fused kernels;
an explicit backend never falls back) and ``backend="torch"`` (the reference),
over one :class:`gatlib.GraphPlan`, after checking that the two agree; beside them, for GAT,
the *two-pass* candidate for narrow rows (an output layer's): scores and softmax over ``[E, H]``,
then the aggregation as ``torch.sparse.mm`` on the plan's CSR (cuSPARSE), its backward on the CSC
(:func:`two_pass_gat`); and ``torch.sparse.mm`` alone with the call's attention weights as its
values: the aggregation, no scores or softmax, forward and the value's gradient (the practical
floor of narrow rows). Next to each fused time it prints the
*bandwidth floor*: the bytes the pass must move at least (every input and
output read or written once, no re-reads of gathered rows) divided by the
device-copy bandwidth measured in the same process — how far the kernel is
from being purely memory bound.

Usage (CUDA only; from the repository root)::

    python -m tools.triton_bench --out benchmarks/results/triton_bench.json
    python -m tools.triton_bench --heads 1 --channels 40 --dtypes float32 --out classes.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from gatlib import EdgeScore, GraphPlan, graph_attention, record_kernels, segment_softmax
from gatlib.bench.report import command_line, environment, format_table, write_json
from gatlib.bench.synthetic import PRESETS, parse_spec, power_law_edges

KINDS = ("gat", "gatv2", "dot")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(prog="python -m tools.triton_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default="arxiv-like",
                   help=f"one of {sorted(PRESETS)} or synthetic:N:E:F (default: %(default)s)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the kernels in Triton's interpreter (TRITON_INTERPRET=1), timed by "
                        "the clock: a dry run of the tool, its times say nothing (default: cuda)")
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
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def make_graph(name: str, seed: int, device) -> tuple[torch.Tensor, int]:
    spec = parse_spec(name)
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
        score = EdgeScore.gat(r(N, H), r(N, H), r(E, H) if edge_features else None)
    elif kind == "gatv2":  # as GATv2Conv: the source projection is also the value
        score = EdgeScore.gatv2(value, r(N, H, C), r(H, C), r(E, H, C) if edge_features else None)
    else:  # as TransformerConv: the edge projection enters the key and the value
        edge = r(E, H, C) if edge_features else None
        score = EdgeScore.dot(r(N, H, C), r(N, H, C), edge)
        value_edge = edge
    return score, value, value_edge


def _f32(t):
    return None if t is None else t.detach().float().requires_grad_()


def float32_copies(kind, score, value, value_edge):
    """float32 copies of the inputs that keep the layers' aliasing."""
    src, dst, edge, att = (_f32(t) for t in score.tensors())
    v32, ve32 = _f32(value), _f32(value_edge)
    if kind == "gatv2":
        src = v32  # GATv2's source projection is also its value
    if kind == "dot" and value_edge is not None:
        ve32 = edge  # the transformer's edge term enters key and value
    return score.with_tensors(src, dst, edge, att), v32, ve32


def leaves(score, value, value_edge):
    ts = [value, value_edge, *score.tensors()]
    return list(dict.fromkeys(t for t in ts if t is not None))


def attend(backend, score, value, value_edge, plan, need_alpha=False):
    """``(out [N, H*C], alpha [E, H] or None)`` of one attention call on ``backend``."""
    res = graph_attention(score, value, plan, plan.num_dst, value_edge=value_edge, backend=backend,
                          return_attention=need_alpha)
    return res if need_alpha else (res, None)


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


def sparse_mm_call(plan: GraphPlan, alpha: torch.Tensor, value: torch.Tensor):
    """``out [N, H*C] = A_h @ value[:, h]`` per head by ``torch.sparse.mm``, ``A_h`` the plan's
    graph as a CSR (destination rows) with ``alpha[:, h]`` as values: the attention call's
    aggregation with its weights given (``alpha [E, H]`` in edge-list order, ``value [N, H, C]``)."""
    src, dst = plan.edge_index
    size = (plan.num_dst, plan.num_src)
    # coalesced (a row's sources sorted, repeated edges summed), as torch's CSR requires
    mats = [torch.sparse_coo_tensor(torch.stack([dst, src]), alpha.detach()[:, h].to(value.dtype),
                                    size).coalesce().to_sparse_csr()
            for h in range(value.size(1))]

    def call():
        return torch.cat([torch.sparse.mm(a, value[:, h]) for h, a in enumerate(mats)], dim=1)
    return call


class CsrAggregate(torch.autograd.Function):
    r"""``out_h = A_h v_h`` by ``torch.sparse.mm``, ``A_h`` the plan's CSR (destination rows)
    holding ``alpha[:, h]`` (``[E, H]`` in CSR order). Backward: ``dv_h = A_h^T g_h`` on the CSC,
    ``dalpha_ij = <g_i, v_j>`` sampled at the edges (``sampled_addmm``): no atomics.

    Inputs: the layout's ``ptr, src, dst, csc_ptr, csc_edge``, ``alpha``, ``value [N_src, H, C]``.
    Output ``[N_dst, H, C]``."""

    @staticmethod
    def forward(ctx, ptr, src, dst, csc_ptr, csc_edge, alpha, value):
        size = (ptr.numel() - 1, value.size(0))
        ctx.save_for_backward(ptr, src, dst, csc_ptr, csc_edge, alpha, value)
        return torch.stack([torch.sparse.mm(_csr(ptr, src, alpha[:, h], size), value[:, h])
                            for h in range(value.size(1))], 1)

    @staticmethod
    def backward(ctx, g):
        ptr, src, dst, csc_ptr, csc_edge, alpha, value = ctx.saved_tensors
        N, M = ptr.numel() - 1, value.size(0)
        g = g.contiguous()
        heads = range(value.size(1))
        dv = torch.stack([torch.sparse.mm(_csr(csc_ptr, dst.index_select(0, csc_edge),
                                               alpha[:, h].index_select(0, csc_edge), (M, N)), g[:, h])
                          for h in heads], 1)
        pattern = _csr(ptr, src, torch.ones_like(alpha[:, 0]), (N, M))
        da = torch.stack([torch.sparse.sampled_addmm(pattern, g[:, h], value[:, h].t(), beta=0.0).values()
                          for h in heads], 1)
        return None, None, None, None, None, da, dv


def _csr(ptr, col, values, size):
    return torch.sparse_csr_tensor(ptr.long(), col.long(), values, size)


def two_pass_gat(score: EdgeScore, value: torch.Tensor, plan: GraphPlan) -> torch.Tensor:
    """GAT's narrow rows in two passes: the scores and their softmax over ``[E, H]`` (the
    reference's, in CSR order), then the aggregation as :class:`CsrAggregate`: ``[N_dst, H * C]``."""
    lay = plan.layout()
    src, dst = lay.src.long(), lay.dst.long()
    alpha = segment_softmax(score.edge_scores(src, dst), dst, plan.num_dst)
    return CsrAggregate.apply(lay.ptr, lay.src, lay.dst, lay.csc_ptr, lay.csc_edge, alpha,
                              value).flatten(1)


def device_bandwidth(device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    import triton.testing

    a = torch.empty(1 << 28, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * a.numel() * 4 / (ms * 1e-3)


def check(kind, dtype, score, value, value_edge, plan, fused_fwd, ref_fwd) -> dict:
    """Fused and reference results (out, alpha, every gradient) against the
    reference run on float32 copies of the inputs. Relative error in the
    Frobenius norm: the fused path passes at most 2x the reference's own error
    in the same dtype, or 1e-4 (float32) / one ulp of the dtype if larger.
    Also records the kernels that ran the fused call (``triton``,
    ``triton.backward``)."""
    ins = leaves(score, value, value_edge)
    N, H, C = value.shape
    grad = torch.randn(N, H * C, device=value.device, dtype=dtype)  # of out, heads concatenated

    def results(fn, ins):
        out, alpha = fn(True)
        return [out, alpha, *torch.autograd.grad(out, ins, grad.to(out.dtype))]

    s32, v32, ve32 = float32_copies(kind, score, value, value_edge)
    exact = results(lambda need_alpha: attend("torch", s32, v32, ve32, plan, need_alpha),
                    leaves(s32, v32, ve32))

    def rel(res):
        return max(float((a.detach().float() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30))
                   for a, b in zip(res, exact, strict=True))

    with record_kernels() as log:
        err_fused = rel(results(fused_fwd, ins))
    err_torch = rel(results(ref_fwd, ins))
    tol = 1e-4 if dtype == torch.float32 else torch.finfo(dtype).eps
    return dict(rel_error_fused=err_fused, rel_error_torch=err_torch,
                correct=err_fused <= max(2 * err_torch, tol), kernels=list(dict.fromkeys(log)))


def _clock_bench(fn, warmup, rep, grad_to_none, return_mode):
    """``do_bench``'s stand-in off CUDA: the median of ``rep`` calls' wall-clock milliseconds."""
    import statistics

    fn()
    times = []
    for _ in range(max(1, rep)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_case(kind, dtype, plan, args, device, bandwidth, bench=None):
    import triton.testing

    bench = bench or triton.testing.do_bench

    N, E, H, C = plan.num_dst, plan.num_edges, args.heads, args.channels
    score, value, value_edge = make_inputs(kind, N, E, H, C, dtype, args.edge_features, device,
                                           args.seed)
    ins = leaves(score, value, value_edge)

    def fused_fwd(need_alpha=False):  # backend="triton" raises instead of falling back
        return attend("triton", score, value, value_edge, plan, need_alpha)

    def ref_fwd(need_alpha=False):
        return attend("torch", score, value, value_edge, plan, need_alpha)

    row = dict(kind=kind, dtype=str(dtype).replace("torch.", ""), nodes=N, edges=E, heads=H,
               channels=C, edge_features=args.edge_features)
    try:
        row.update(check(kind, dtype, score, value, value_edge, plan, fused_fwd, ref_fwd))
    except torch.cuda.OutOfMemoryError:
        row["correct"] = "oom"
        torch.cuda.empty_cache()
    grad = torch.randn(N, H * C, device=device, dtype=dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    with torch.no_grad():
        alpha = fused_fwd(need_alpha=True)[1]
    spmm = sparse_mm_call(plan, alpha, value)
    del alpha

    def spmm_fwd(need_alpha=False):
        return spmm(), None

    def two_pass(need_alpha=False):
        return two_pass_gat(score, value, plan), None

    sides = [("fused", fused_fwd), ("torch", ref_fwd), ("sparse_mm", spmm_fwd)]
    if kind == "gat" and not args.edge_features:  # (the candidate for GAT's narrow output layers)
        row["two_pass_rel_error"] = _two_pass_error(score, value, plan, grad, ins)
        sides.append(("two_pass", two_pass))
    for name, fn in sides:
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
                ms = bench(step, warmup=args.warmup, rep=args.rep, grad_to_none=ins,
                           return_mode="median")
                row[f"{name}_{phase}_ms"] = ms
            except torch.cuda.OutOfMemoryError:
                row[f"{name}_{phase}_ms"] = "oom"
                torch.cuda.empty_cache()
            except (RuntimeError, NotImplementedError) as exc:
                if name not in ("sparse_mm", "two_pass"):
                    raise
                # (torch's sparse.mm lacks some dtypes on some devices: bfloat16 on CPU)
                row[f"{name}_{phase}_ms"] = f"error: {str(exc).splitlines()[0][:120]}"
    for phase, backward in (("fwd", False), ("fwd+bwd", True)):
        floor = min_bytes(kind, N, E, H, C, elt, args.edge_features, backward) / bandwidth * 1e3
        row[f"floor_{phase}_ms"] = floor
        t = row.get(f"fused_{phase}_ms")
        if isinstance(t, float):
            row[f"fused_{phase}_of_floor"] = floor / t  # 1.0 = at the bandwidth floor
    return row


def _two_pass_error(score, value, plan, grad, ins) -> float:
    """The two-pass candidate's largest norm-wise error (output, every gradient) against the
    reference in the same dtype."""
    res = []
    for fn in (lambda: two_pass_gat(score, value, plan), lambda: attend("torch", score, value, None, plan)[0]):
        try:
            out = fn()
        except (RuntimeError, NotImplementedError) as exc:  # (a dtype cuSPARSE or CPU lacks)
            return f"error: {str(exc).splitlines()[0][:120]}"
        res.append([out, *torch.autograd.grad(out, ins, grad.to(out.dtype))])
    return max(float((a.detach().float() - b.detach().float()).norm()
                     / b.detach().float().norm().clamp_min(1e-30)) for a, b in zip(*res, strict=True))


def table(rows) -> str:
    """The rows' times beside each other, per pass: fused, reference, two-pass, sparse.mm, floor."""
    def fmt(v, spec=".3f"):
        return format(v, spec) if isinstance(v, float) else str(v if v is not None else "-")

    names = ("fused", "torch", "two_pass", "sparse_mm", "floor")
    return format_table(
        ["kind", "dtype", "ok", "fwd fused ms", "torch", "two-pass", "sparse.mm", "floor",
         "f+b fused ms", "torch", "two-pass", "sparse.mm", "floor"],
        [[r["kind"], r["dtype"], r["correct"], *(fmt(r.get(f"{name}_{phase}_ms"))
          for phase in ("fwd", "fwd+bwd") for name in names)] for r in rows],
        align="<<<" + ">" * 10)


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("tools.triton_bench --device cuda needs a CUDA device")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("tools.triton_bench --device cpu runs the kernels in Triton's interpreter: "
                 "set TRITON_INTERPRET=1")
    torch.manual_seed(args.seed)
    ei, N = make_graph(args.graph, args.seed, device)
    plan = GraphPlan(ei, num_nodes=N)  # checked and sorted once; the kernels' schedule lives on it
    deg = torch.bincount(ei[1], minlength=N)
    bandwidth = device_bandwidth(device) if device == "cuda" else 1e11  # (the dry run's: any)
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}: graph {args.graph} N={N} E={ei.size(1)} "
          f"max in-degree {int(deg.max())}, H={args.heads} C={args.channels}, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    bench = None if device == "cuda" else _clock_bench
    rows = [run_case(kind, DTYPES[dname], plan, args, device, bandwidth, bench)
            for kind in args.kinds for dname in args.dtypes]

    print(table(rows))
    result = dict(
        command=command_line(), **environment(device), copy_bandwidth_bytes_per_s=bandwidth,
        graph=args.graph, args={k: str(v) for k, v in vars(args).items()},
        max_in_degree=int(deg.max()), results=rows,
    )
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
