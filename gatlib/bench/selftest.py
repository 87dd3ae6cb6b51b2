"""``gatlib selftest``: check the Triton kernels against the reference on one device, then compare the
layers with PyG's using them (docs/gpu.md, "Have a GPU?").

Exit status 0 when every check passed and every comparison agreed, 1 otherwise, 2 when the kernels cannot
run here (no CUDA; on CPU, ``TRITON_INTERPRET=1`` not set at the start of the process).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import floor, synthetic
from .report import command_line, environment, format_table, write_json

SCHEMA = "gatlib.selftest/1"
# "gat_inputs", "dot_inputs": GATConv's and TransformerConv's calls in input space, values
# (and the Transformer's key, which is its value) of one head that every head shares
INPUT_KINDS = ("gat_inputs", "dot_inputs")
KINDS = ("gat", "gatv2", "dot", *INPUT_KINDS)
# the kinds whose layers (GATConv, GATv2Conv) have an output bias: the checks add one
BIASED = ("gat", "gatv2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
GRAPHS = ("cora", "arxiv-like", "products-like")

# The kernel-check graph: small enough for Triton's CPU interpreter. C is not a
# power of two, so the kernels' channel masks are exercised.
NUM_NODES, NUM_EDGES, HUB_DEGREE, HEADS, CHANNELS = 60, 240, 300, 2, 12
DROPOUT = 0.3
# With dropout, the output must move by more than this fraction of max|output|
# away from the output without dropout (low-precision noise is ~1e-2).
DROPOUT_EFFECT = 0.1
# ... and <w, out> may differ from <grad, value> by this many ulps of the norm of the sum's terms
# (rounding errors of random sign add up as a norm); a backward with another mask is off by far more.
LINEARITY_ULPS = {torch.float16: 1.0, torch.bfloat16: 1.0, torch.float32: 32.0,
                  torch.float64: 32.0}
# Max abs error allowed, in units of max|reference|, for full precision.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
# Low precision: Triton's error vs float64 <= LOWP_FACTOR x the reference's own error in that dtype
# + LOWP_FLOOR_ULPS ulps of max|reference|: the backward, like FlashAttention's, takes
# Delta_i = <g_i, out_i> from out as stored in low precision (tests/testing.py allows 6 ulps too).
LOWP_FACTOR, LOWP_FLOOR_ULPS = 4.0, 6.0


class CannotRun(Exception):
    """The Triton kernels cannot run on this device in this process."""


# 1. Kernel checks
def kernel_graph(seed: int = 0) -> Tensor:
    """The kernel checks' ``[2, E]`` graph: random edges, duplicates, a hub of :data:`HUB_DEGREE`
    in-edges at node 0, nodes receiving or sending nothing, and an isolated node."""
    g = torch.Generator().manual_seed(seed)
    N = NUM_NODES
    src = torch.randint(0, N - 8, (NUM_EDGES,), generator=g)
    dst = torch.randint(8, N - 1, (NUM_EDGES,), generator=g)
    hub = torch.randint(0, N - 8, (HUB_DEGREE,), generator=g)
    ei = torch.cat([torch.stack([src, dst]), torch.stack([hub, torch.zeros_like(hub)])], dim=1)
    return torch.cat([ei, ei[:, :20]], dim=1)


def _inputs(kind: str, edge: bool, E: int, device, seed: int, heads: int = HEADS,
            channels: int = CHANNELS) -> Dict[str, Tensor]:
    """float64 inputs of score ``kind`` by name (value, scores' tensors, optional edge terms and bias)."""
    g = torch.Generator().manual_seed(seed)
    N, H, C = NUM_NODES, heads, channels

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device)

    # A non-zero mean: a sum accumulated in low precision would drift on the hub.
    t = {"value": 1 + r(N, 1 if kind in INPUT_KINDS else H, C)}
    if kind == "gat_inputs":  # (as GATConv: no value_edge, its bias added after projecting)
        t.update(src=r(N, H), dst=r(N, H), **({"edge": r(E, H)} if edge else {}))
        return t
    if kind == "dot_inputs":  # the key is the value (no edge features in input space)
        t["dst"] = r(N, H, C)
        return t
    per_node = (N, H) if kind == "gat" else (N, H, C)
    t.update(src=r(*per_node), dst=r(*per_node))
    if edge:
        t["value_edge"] = r(E, H, C)
        t["edge"] = r(E, *per_node[1:])
    if kind == "gatv2":
        t["att"] = r(H, C)
    if kind in BIASED:
        t["bias"] = r(H * C)
    return t


def edge_score(kind: str, t: Dict[str, Tensor]):
    from gatlib import EdgeScore

    if kind in ("gat", "gat_inputs"):
        return EdgeScore.gat(t["src"], t["dst"], t.get("edge"))
    if kind == "dot_inputs":
        return EdgeScore.dot(t["dst"], t["value"])
    if kind == "gatv2":
        return EdgeScore.gatv2(t["src"], t["dst"], t["att"], t.get("edge"))
    return EdgeScore.dot(t["dst"], t["src"], t.get("edge"))  # query per dst, key per src


@contextlib.contextmanager
def unwritten_memory_is_nan():
    """Fill every new ``torch.empty`` tensor with NaN inside the block, so a kernel that
    leaves output rows unwritten fails its check instead of passing on a previous call's leftovers."""
    import warnings

    was, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic", category=UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _run(backend: str, kind: str, inputs: Dict[str, Tensor], plan, weights: Dict[str, Tensor],
         alpha: bool, p: float, backward: bool = True) -> Tuple[List[str], Dict[str, Tensor]]:
    """``(kernel log, {quantity: tensor})`` of one call and its backward: ``out``,
    ``alpha`` (if returned) and ``grad <input>`` of every input. The loss is
    ``sum(out * w_out) + sum(alpha * w_alpha)``, so alpha's gradient path counts.
    Unwritten output memory reads as NaN (:func:`unwritten_memory_is_nan`)."""
    import gatlib

    leaves = {k: v.detach().clone().requires_grad_(backward) for k, v in inputs.items()}
    with gatlib.record_kernels() as log, torch.set_grad_enabled(backward), \
            unwritten_memory_is_nan():
        res = gatlib.graph_attention(edge_score(kind, leaves), leaves["value"], plan, NUM_NODES,
                                     value_edge=leaves.get("value_edge"), dropout=p,
                                     training=p > 0, backend=backend, return_attention=alpha,
                                     bias=leaves.get("bias"))
        out, a = res if alpha else (res, None)
        loss = (out * weights["out"].to(out.dtype)).sum()
        if a is not None:
            loss = loss + (a * weights["alpha"].to(a.dtype)).sum()
        grads = torch.autograd.grad(loss, list(leaves.values())) if backward else None
    got = {"out": out.detach(), **({"alpha": a.detach()} if a is not None else {})}
    if grads is not None:
        got.update({f"grad {k}": g for k, g in zip(leaves, grads, strict=True)})
    return list(dict.fromkeys(log)), got


def _max_abs(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _worst_row(a: Tensor, b: Tensor) -> int:
    """Index along the first dimension (a node, or an edge) of the largest difference:
    which row a failed case went wrong in (the check graphs' hub is node 0)."""
    d = (a.double() - b.double()).abs().nan_to_num(math.inf)
    return int(d.reshape(d.size(0), -1).amax(1).argmax()) if d.numel() else -1


def _num(x: float):
    return x if math.isfinite(x) else str(x)  # JSON has no inf/nan


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _ran_triton(log: List[str]) -> Optional[str]:
    if log[:1] != ["triton"] or "triton.backward" not in log:
        return f"the Triton kernel did not run forward and backward (kernels logged: {log})"
    return None


def check_case(kind: str, dtype: torch.dtype, edge: bool, p: float, alpha: bool, plan,
               device, seed: int = 0) -> Dict:
    """One kernel check: its record for the JSON."""
    name = (f"{kind} {_dtype_name(dtype)} {'edge' if edge else 'no-edge'} "
            f"{'dropout' if p else 'no-dropout'} {'alpha' if alpha else 'no-alpha'}")
    rec = {"name": name, "kind": kind, "dtype": _dtype_name(dtype),
           "edge_features": edge, "dropout": p, "attention_weights": alpha}
    try:
        rec.update(_dropout_check(kind, dtype, edge, p, alpha, plan, device, seed) if p else
                   _agreement_check(kind, dtype, edge, alpha, plan, device, seed))
    except Exception as exc:  # noqa: BLE001  a kernel that raises is a failed case, not a crash
        rec.update(status="FAIL", error=None, bound=None,
                   detail=f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}")
    return rec


def case_inputs(kind, dtype, edge, plan, device, seed, heads=HEADS, channels=CHANNELS):
    E = plan.num_edges
    rounded = {k: v.to(dtype) for k, v in _inputs(kind, edge, E, device, seed, heads,
                                                   channels).items()}
    g = torch.Generator().manual_seed(seed + 1)
    w = {"out": torch.randn(NUM_NODES, heads * channels, generator=g, dtype=torch.float64),
         "alpha": torch.randn(E, heads, generator=g, dtype=torch.float64)}
    return rounded, {k: v.to(device, dtype) for k, v in w.items()}  # representable in dtype


def _agreement_check(kind, dtype, edge, alpha, plan, device, seed, heads=HEADS,
                     channels=CHANNELS, relative_to_reference=False) -> Dict:
    """One case against the float64 reference (TOL, LOWP_FACTOR); ``relative_to_reference``:
    the low-precision rule (a multiple of the reference's own error in ``dtype``) in
    float32 too."""
    inputs, weights = case_inputs(kind, dtype, edge, plan, device, seed, heads, channels)
    log, got = _run("triton", kind, inputs, plan, weights, alpha, 0.0)
    exact = _run("torch", kind, {k: v.double() for k, v in inputs.items()}, plan, weights, alpha,
                 0.0)[1]
    low = dtype in (torch.float16, torch.bfloat16) or relative_to_reference
    ref = _run("torch", kind, inputs, plan, weights, alpha, 0.0)[1] if low else None
    worst = None  # (error / bound, quantity, error, bound)
    for q, e in exact.items():
        scale = e.abs().max().item() if e.numel() else 0.0
        if low:
            bound = (LOWP_FACTOR * _max_abs(ref[q], e)
                     + LOWP_FLOOR_ULPS * torch.finfo(dtype).eps * scale)
        else:
            bound = TOL[dtype] * scale
        err = _max_abs(got[q], e)
        ratio = err / bound if bound > 0 and math.isfinite(err) else (0.0 if err == 0 else math.inf)
        if worst is None or ratio > worst[0]:
            worst = (ratio, q, err, bound)
    _, q, err, bound = worst
    detail = _ran_triton(log) or (None if err <= bound else
                                  f"{q}: max abs error {err:.3g} > bound {bound:.3g} "
                                  f"(row {_worst_row(got[q], exact[q])})")
    return {"status": "FAIL" if detail else "ok", "quantity": q, "error": _num(err),
            "bound": bound, "kernels": log, **({"detail": detail} if detail else {})}


def _dropout_check(kind, dtype, edge, p, alpha, plan, device, seed) -> Dict:
    inputs, weights = case_inputs(kind, dtype, edge, plan, device, seed)
    torch.manual_seed(seed)
    log, a = _run("triton", kind, inputs, plan, weights, alpha, p)
    torch.manual_seed(seed)
    b = _run("triton", kind, inputs, plan, weights, alpha, p, backward=False)[1]
    plain = _run("torch", kind, inputs, plan, weights, False, 0.0)[1]["out"]
    err = max(_max_abs(a[q], b[q]) for q in b)
    effect = _max_abs(a["out"], plain)
    # With the mask fixed, out is linear in (value, value_edge, bias), so
    # <w, out> = <grad value, value> + <grad value_edge, value_edge> + <grad bias, bias>
    # holds only if the backward applied the forward's mask. Not for dot_inputs, whose values
    # are also the scores' input (the mask is the others' code).
    linear = kind != "dot_inputs"
    terms = [a["out"].double() * weights["out"].double()]
    terms += [-a[f"grad {k}"].double() * inputs[k].double()
              for k in ("value", "value_edge", "bias") if k in inputs]
    gap = abs(sum(t.sum() for t in terms).item()) if linear else 0.0
    norm = sum(t.square().sum() for t in terms).sqrt().item()
    gap_bound = LINEARITY_ULPS[dtype] * torch.finfo(dtype).eps * norm
    problems = [
        _ran_triton(log),
        None if err == 0 else f"same seed, different results (max abs difference {err:.3g})",
        None if effect > DROPOUT_EFFECT * plain.abs().max().item() else
        f"dropout barely changed the output (max abs change {effect:.3g})",
        *[f"{q} is not finite" for q, t in a.items() if not bool(t.isfinite().all())],
        None if gap <= gap_bound else
        f"the backward's dropout mask is not the forward's (<w, out> - <grad, value> = "
        f"{gap:.3g} > {gap_bound:.3g})",
    ]
    detail = "; ".join(x for x in problems if x)
    return {"status": "FAIL" if detail else "ok", "quantity": "same seed twice",
            "error": _num(err), "bound": 0.0, "dropout_effect": _num(effect),
            "linearity_gap": _num(gap) if linear else None, "linearity_bound": gap_bound,
            "kernels": log,
            **({"detail": detail} if detail else {})}


def kernel_checks(device: torch.device, quick: bool = False, log=print,
                  kinds: Sequence[str] = KINDS, dtypes: Sequence[str] = tuple(DTYPES)) -> Dict:
    """Every kernel check on ``device``: ``{"graph": ..., "cases": [...], "passed", "failed"}``.
    ``quick``: per kind and dtype only two cases (edge features with weights returned,
    dropout without either); ``kinds``, ``dtypes``: those checked (all by default)."""
    import gatlib

    plan = gatlib.GraphPlan(kernel_graph().to(device), num_nodes=NUM_NODES)
    grid = list(dict.fromkeys(
        (kind, dtype, edge and kind != "dot_inputs", p, alpha)  # (it has no edge features)
        for kind in kinds for dtype in (DTYPES[d] for d in dtypes)
        for edge in (True, False) for p in (0.0, DROPOUT) for alpha in (True, False)
        # quick: edge features and weights without dropout; neither with it
        if not quick or edge == alpha == (p == 0)))
    cases = []
    for i, (kind, dtype, edge, p, alpha) in enumerate(grid):
        cases.append(check_case(kind, dtype, edge, p, alpha, plan, device))
        c = cases[-1]
        if c["status"] != "ok" or (i + 1) % 12 == 0 or i + 1 == len(grid):
            log(f"[selftest] kernel check {i + 1}/{len(grid)}: {c['name']}: {c['status']}"
                + (f" ({c['detail']})" if c.get("detail") else ""))
    failed = sum(c["status"] != "ok" for c in cases)
    return {"graph": {"num_nodes": NUM_NODES, "num_edges": plan.num_edges,
                      "hub_in_degree": HUB_DEGREE, "heads": HEADS, "channels": CHANNELS,
                      "isolated": "nodes 1-7 have no in-edges, nodes N-8..N-1 no out-edges",
                      "duplicates": 20},
            "dropout": DROPOUT, "tol": {_dtype_name(k): v for k, v in TOL.items()},
            "lowp_factor": LOWP_FACTOR, "lowp_floor_ulps": LOWP_FLOOR_ULPS,
            "linearity_ulps": {_dtype_name(k): v for k, v in LINEARITY_ULPS.items()},
            "cases": cases, "passed": len(cases) - failed, "failed": failed}


def check_graph(n: int, e: int, seed: int, device) -> Tuple[object, Dict[str, Tensor]]:
    """The GPU checks' graph of ``n`` nodes (a hub with 300 in- and 300 out-edges, so rows split on
    both sides) and its float32 GATv2 inputs; returns ``(GraphPlan, inputs)``."""
    import gatlib

    g = torch.Generator().manual_seed(seed)
    i = torch.arange(300)
    zero = torch.zeros_like(i)
    rest = torch.randint(21, n, (2, e), generator=g)
    ei = torch.cat([torch.stack([i % 10 + 1, zero]), torch.stack([zero, i % 10 + 11]), rest],
                   1).to(device)
    inputs = {k: (v[:n] if v.size(0) == NUM_NODES else v).float()
              for k, v in _inputs("gatv2", False, ei.size(1), device, seed).items()}
    return gatlib.GraphPlan(ei, num_nodes=n), inputs


def check_call(plan, n: int, inputs: Dict[str, Tensor], p: float = 0.5,
               backward: bool = True) -> Tensor:
    """One training call of the GPU checks on the Triton kernels: forward with
    dropout ``p`` (and the bias) and, if ``backward``, every input's gradient."""
    import gatlib

    leaves = {k: v.detach().clone().requires_grad_(backward) for k, v in inputs.items()}
    out = gatlib.graph_attention(edge_score("gatv2", leaves), leaves["value"], plan, n,
                                 dropout=p, training=p > 0, backend="triton",
                                 bias=leaves.get("bias"))
    if backward:
        torch.autograd.grad(out.float().sum(), list(leaves.values()))
    return out


# The layer of each score kind whose compiled training step the GPU checks run, its output layer one head
# of 40 classes as OGB arxiv's: the shape where compiled GAT once disagreed with PyG (docs/design.md,
# "Compiled GAT takes the node terms").
STEP_LAYERS = {"gat": "GATConv", "gatv2": "GATv2Conv", "dot": "TransformerConv"}
STEP_FEATURES, STEP_CLASSES = 64, 40
# ... and its agreement: norm-wise relative error of the loss and each gradient, as gatlib compare's float32
# rule. A gradient far smaller than the largest is measured against STEP_FLOOR times that one: one that is
# zero in exact arithmetic (a key's bias, which the softmax cancels) is rounding noise on both sides.
STEP_TOL, STEP_FLOOR = 1e-4, 1e-4


def compiled_step_check(layer: str, device: torch.device, plan, compile_fn=None) -> Optional[str]:
    """``None`` where a 2-layer model of ``layer`` on the Triton kernels, eager and under
    ``torch.compile``, computes the loss and gradients of its float64 reference within :data:`STEP_TOL`; else
    the worst quantity. Against float64, not eager: two steps wrong alike would agree."""
    import torch.nn.functional as F

    import gatlib

    from .compare import TwoLayer

    cls = getattr(gatlib, layer)
    torch.manual_seed(0)
    model = TwoLayer(lambda *a, **k: cls(*a, backend="triton", **k), STEP_FEATURES, HEADS, 16,
                     STEP_CLASSES).to(device)
    exact = TwoLayer(lambda *a, **k: cls(*a, backend="torch", **k), STEP_FEATURES, HEADS, 16,
                     STEP_CLASSES).to(device, torch.float64)
    exact.load_state_dict(model.state_dict())
    n = plan.num_dst
    x = torch.randn(n, STEP_FEATURES, device=device)
    y = torch.randint(0, STEP_CLASSES, (n,), device=device)

    def step(m, net, dtype=torch.float32):
        net.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x.to(dtype), plan), y)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in net.parameters()]

    ref = [r.float() for r in step(exact, exact, torch.float64)]
    floor = STEP_FLOOR * max(r.norm().item() for r in ref[1:])
    names = ["loss"] + [n for n, _ in model.named_parameters()]

    def worst(m, calls):  # (largest relative error, its quantity) over ``calls`` steps
        out = (0.0, None)
        for _ in range(calls):
            for name, g, r in zip(names, step(m, model), ref, strict=True):
                err = ((g - r).norm() / max(r.norm().item(), floor, 1e-30)).item()
                if not err <= out[0]:  # (a NaN is the worst)
                    out = (err, name)
        return out

    with gatlib.record_kernels() as log:
        # the eager step also derives what the compiled calls read from the plan
        errors = {"eager": worst(model, 1)}
        torch._dynamo.reset()
        errors["compiled"] = worst((compile_fn or torch.compile)(model), 3)
    if "triton" not in log or "triton.backward" not in log:
        return f"the step did not run the Triton kernels (ran {sorted(set(log))})"
    bad = [f"{how} {err:.2e} ({where})" for how, (err, where) in errors.items()
           if not err <= STEP_TOL]
    if bad:
        return f"largest relative error against float64 > {STEP_TOL:.0e}: " + ", ".join(bad)
    return None


# Configs per row kernel's space at most (gatlib._triton_schedule._space): the check below pins
# each index; a smaller space repeats its configs.
MAX_CONFIGS = 4


def configs_check(kind: str, device: torch.device, plan) -> Optional[str]:
    """``None`` where every config of the row kernels' spaces (each pinned in turn) and the
    tuner's choice give score ``kind``'s call (float32, edge features, weights; the graph's hub
    split) the same bits: output, weights and every gradient; else which differ. The tuned
    knobs must not change what a program sums nor in what order (docs/gpu.md, "Tuning")."""
    from gatlib import introspect

    inputs, weights = case_inputs(kind, torch.float32, kind != "dot_inputs", plan, device, 0)
    runs = {"tuned": _run("triton", kind, inputs, plan, weights, True, 0.0)[1]}
    for i in range(MAX_CONFIGS):
        with introspect.triton_config(i):
            runs[f"config {i}"] = _run("triton", kind, inputs, plan, weights, True, 0.0)[1]
    base = runs["tuned"]
    bad = [f"{name}: {q}" for name, got in runs.items() for q in base
           if not torch.equal(got[q].nan_to_num(), base[q].nan_to_num())]
    return ("not the tuned config's bits: " + ", ".join(bad[:4])) if bad else None


def output_layer_check(kind: str, device: torch.device, plan) -> Optional[str]:
    """``None`` where score ``kind`` at an output layer's shape (one head of
    :data:`STEP_CLASSES` channels) computes the float64 reference on ``plan``; else what differs. The bound is a
    multiple of the float32 reference's own error, which the hub's 300-row sums push past the kernel checks' 1e-5."""
    res = _agreement_check(kind, torch.float32, False, False, plan, device, 0, heads=1,
                           channels=STEP_CLASSES, relative_to_reference=True)
    return res.get("detail")


def gpu_checks(device: torch.device, kinds: Sequence[str] = KINDS) -> List[Dict]:
    """What only a GPU can show, each ``{"name", "status", "detail"}``: no host sync, no recompile
    for a graph of other sizes, a new dropout mask per CUDA-graph replay, output layers and training steps."""
    from gatlib import introspect

    call = check_call

    def graph(n, e, seed):
        return check_graph(n, e, seed, device)

    def compiled() -> int:
        every = introspect.triton_kernels()
        kernels = (every["_fwd_kernel"], every["_bwd_dst_kernel"], every["_bwd_src_kernel"])
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    checks = []

    def check(name, fn):
        try:
            detail = fn()
        except Exception as exc:  # a failed check, reported with its error
            detail = f"{type(exc).__name__}: {str(exc)[:300]}"
        checks.append({"name": name, "status": "FAIL" if detail else "ok", "detail": detail})

    plan, inputs = graph(NUM_NODES, 4 * (NUM_NODES - 21), 0)
    call(plan, NUM_NODES, inputs)  # plan derived, kernels compiled
    torch.cuda.synchronize(device)

    def no_sync():
        torch.cuda.set_sync_debug_mode("error")
        try:
            call(plan, NUM_NODES, inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return None

    def no_recompile():
        plan2, inputs2 = graph(NUM_NODES - 13, 4 * (NUM_NODES - 34) + 7, 1)
        plan2.layout()
        introspect.triton_schedule(plan2)  # the schedule is the plan's, built before the count
        before = compiled()
        call(plan2, NUM_NODES - 13, inputs2)
        torch.cuda.synchronize(device)
        grown = compiled() - before
        return f"{grown} kernel(s) compiled for a new graph" if grown else None

    def cuda_graph():
        static = {k: v.detach() for k, v in inputs.items()}
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.no_grad():
            call(plan, NUM_NODES, static, backward=False)  # warm-up off the capture
        torch.cuda.current_stream(device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad():
            out = call(plan, NUM_NODES, static, backward=False)
        g.replay()
        first = out.clone()
        g.replay()
        if not torch.isfinite(out).all():
            return "non-finite output on replay"
        return "two replays drew the same dropout mask" if torch.equal(first, out) else None

    check("no host sync once the plan exists (forward + backward, dropout)", no_sync)
    check("no recompile for a new graph", no_recompile)
    check("dropout in a captured CUDA graph draws a new mask per replay", cuda_graph)
    for kind in kinds:
        check(f"{kind}: an output layer's call (1 head of {STEP_CLASSES}) computes the reference",
              lambda kind=kind: output_layer_check(kind, device, plan))
        check(f"{kind}: every config of the row kernels' spaces gives the tuned config's bits",
              lambda kind=kind: configs_check(kind, device, plan))
    for kind in kinds:
        if kind in STEP_LAYERS:
            check(f"a compiled {STEP_LAYERS[kind]} training step computes the eager step",
                  lambda layer=STEP_LAYERS[kind]: compiled_step_check(layer, device, plan))
    return checks


# 2. Comparison with PyG, one child process per graph
def compare_graph(graph: str, args: argparse.Namespace, out: Path) -> Dict:
    """``gatlib compare --layer all --backend triton --no-compile`` on ``graph`` in a child process:
    ``{"graph", "status": ok/mismatch/error, "returncode", "report"}``; its JSON goes to ``out``."""
    from . import measure

    # Eager sides only: this checks the Triton kernels against PyG, and its table shows the
    # eager columns (`gatlib compare --device cuda` times the compiled sides).
    cmd = [sys.executable, "-m", "gatlib.bench.compare", "--layer", "all", "--backend", "triton",
           "--device", args.device, "--graph", graph, "--repeats", str(args.repeats),
           "--block-seconds", str(args.block_seconds), "--json", str(out),
           "--memory" if args.memory else "--no-memory", "--no-compile"]
    for flag, value in (("--data-dir", args.data_dir), ("--heads", args.heads),
                        ("--channels", args.channels)):
        if value is not None:
            cmd += [flag, str(value)]
    # The child's progress goes to our stderr as it comes; its last lines are kept.
    tail: collections.deque = collections.deque(maxlen=20)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=measure.child_env())
    for line in proc.stderr:
        sys.stderr.write(line)
        tail.append(line)
    rc = proc.wait()
    report = json.loads(out.read_text()) if out.exists() else None
    checks = (report or {}).get("checks", {})
    if report is None or not report.get("complete"):
        status = "error"
    elif any(c.get("status") == "mismatch" for c in checks.values()):
        status = "mismatch"
    else:
        status = "ok" if rc == 0 else "error"
    res = {"graph": graph, "status": status, "returncode": rc, "report": report}
    if status != "ok":  # what compare said about it (a disagreement's errors, a traceback)
        res["stderr_tail"] = "".join(tail)
    return res


# 3. Table, CLI
def render_markdown(result: Dict) -> str:
    """The Markdown summary: kernel checks (failures listed), then the comparison rows."""
    from .compare_report import LAYERS, TABLE_HEADERS, table_rows

    kc, env = result["kernel_checks"], result["environment"]
    lines = [f"## gatlib selftest on {env['device_name']} ({env['device']}"
             f"{', Triton interpreter' if result['interpreter'] else ''})", "",
             f"Kernel checks, triton vs torch: {kc['passed']} passed, {kc['failed']} failed "
             f"(of {len(kc['cases'])}).", ""]
    failures = [c for c in kc["cases"] if c["status"] != "ok"]
    if failures:
        lines += [format_table(["failed case", "quantity", "max abs error", "bound", "detail"],
                               [[c["name"], c.get("quantity", "-"), _fmt(c.get("error")),
                                 _fmt(c.get("bound")), c.get("detail", "")] for c in failures],
                               align="<<>><", markdown=True), ""]
    gpu = result.get("gpu_checks")
    if isinstance(gpu, list):
        lines += [format_table(["GPU check", "status", "detail"],
                               [[c["name"], c["status"], c["detail"] or ""] for c in gpu],
                               align="<<<", markdown=True), ""]
    elif gpu:
        lines += [f"GPU checks {gpu}.", ""]
    rows = []
    for comp in result["comparisons"]:
        if comp["report"]:
            rows += [[comp["graph"], *row] for row in table_rows(comp["report"])]
    if result["comparisons"]:
        lines += ["Comparison with PyG (gatlib backend triton): "
                  + "; ".join(map(_comparison_status, result["comparisons"])), ""]
    if rows:
        lines.append(format_table(["graph", *TABLE_HEADERS], rows, align="<<<" + ">" * 8,
                                  markdown=True))
    # On CUDA: each pass against the bandwidth floor (the comparisons ran eagerly, so the
    # compiled columns stay empty; `gatlib compare --device cuda` fills them).
    comps = [c for c in result["comparisons"] if c["report"]]
    floor_rows = [[c["graph"], *row] for c in comps
                  for row in floor.report_rows(c["report"], LAYERS)]
    if floor_rows:
        notes = dict.fromkeys(floor.report_note(c["report"]) for c in comps
                              if floor.applies(c["report"]))
        lines += ["", *(f"{note}." for note in notes), "",
                  format_table(["graph", *floor.HEADERS], floor_rows, align="<<<<" + ">" * 9,
                               markdown=True)]
    return "\n".join(lines).rstrip() + "\n"


def _comparison_status(comp: Dict) -> str:
    """``graph status``, with the layers whose agreement check did not pass."""
    from .compare_report import LAYERS

    checks = (comp["report"] or {}).get("checks", {})
    bad = [f"{LAYERS[k]} {c.get('status')}" for k, c in checks.items() if c.get("status") != "ok"]
    return f"{comp['graph']} {comp['status']}" + (f" ({', '.join(bad)})" if bad else "")


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x if x is not None else "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``gatlib selftest``'s options to ``parser``."""
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda, or cpu under TRITON_INTERPRET=1 (default: cuda)")
    parser.add_argument("--graphs", default=",".join(GRAPHS),
                        help="comma-separated graphs to compare with PyG on: cora, arxiv-like, "
                             "products-like, synthetic:N:E:F; '' for none (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds per comparison (default: 5)")
    # On CPU the kernels run in the interpreter: its times and memory say nothing about
    # them, so by default the comparison there checks agreement and times one call.
    parser.add_argument("--block-seconds", type=float, default=None, metavar="S",
                        help="comparison: each timed block lasts S seconds (default: 0.5 on "
                             "CUDA, 0 on CPU)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                        help="comparison: measure peak memory (default: on CUDA, off on CPU)")
    parser.add_argument("--heads", type=int, default=None,
                        help="comparison heads H (default: compare's, 3 on CUDA)")
    parser.add_argument("--channels", type=int, default=None,
                        help="comparison channels per head C (default: compare's, 256 on CUDA)")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="dataset cache (default: $GATLIB_DATA or ~/.cache/gatlib)")
    parser.add_argument("--quick", action="store_true",
                        help="kernel checks: two cases per kind and dtype instead of 16")
    # Compiling dominates a GPU's kernel checks: one process per kind runs them in parallel.
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="comma-separated score kinds the kernel checks cover "
                             "(default: %(default)s)")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="comma-separated dtypes the kernel checks cover (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", dest="json_path",
                        help="write everything here (after every step)")
    parser.add_argument("--table", default=None, metavar="PATH",
                        help="also write the Markdown table here")


def _preflight(device: torch.device) -> None:
    """Raise :class:`CannotRun` with what to do when the kernels cannot run here."""
    from gatlib import introspect

    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CannotRun("--device cuda: no CUDA device is available here (torch "
                        f"{torch.__version__}, built for CUDA {torch.version.cuda})")
    if device.type == "cuda" and interpreting:
        raise CannotRun("TRITON_INTERPRET=1 is set: the kernels would run in Triton's CPU "
                        "interpreter, not on the GPU; unset it")
    if device.type == "cpu" and not interpreting and importlib.util.find_spec("triton"):
        raise CannotRun("--device cpu runs the Triton kernels in Triton's CPU interpreter, which "
                        "needs TRITON_INTERPRET=1 set at the start of the process: "
                        "TRITON_INTERPRET=1 gatlib selftest --device cpu ...")
    reason = introspect.kernel("triton").available(device)
    if reason is not None:
        raise CannotRun(reason)
    if device.type == "cpu":
        try:
            introspect.check_triton_interpreter()
        except RuntimeError as exc:
            raise CannotRun(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run the self-test; returns the exit status (module docstring)."""
    device = torch.device(args.device)
    graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    cuda = device.type == "cuda"
    args = argparse.Namespace(**{  # the per-device defaults, resolved
        **vars(args), "memory": cuda if args.memory is None else args.memory,
        "block_seconds": (0.5 if cuda else 0.0) if args.block_seconds is None
        else args.block_seconds})
    try:
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1; got {args.repeats}")
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown or not kinds:
            raise ValueError(f"--kinds takes a comma-separated subset of {','.join(KINDS)}; "
                             f"got {args.kinds!r}")
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        if set(dtypes) - set(DTYPES) or not dtypes:
            raise ValueError(f"--dtypes takes a comma-separated subset of {','.join(DTYPES)}; "
                             f"got {args.dtypes!r}")
        for graph in graphs:  # a typo fails now, not after the kernel checks
            if graph != "cora":
                synthetic.parse_spec(graph)
        _preflight(device)
    except (CannotRun, ValueError) as exc:
        print(f"gatlib selftest: error: {exc}", file=sys.stderr)
        return 2
    result = {
        "schema": SCHEMA, "command": command_line(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"device": args.device, "graphs": graphs, "repeats": args.repeats,
                   "block_seconds": args.block_seconds, "memory": args.memory,
                   "heads": args.heads, "channels": args.channels, "quick": args.quick,
                   "kinds": kinds, "dtypes": dtypes,
                   # GATLIB_TRITON_AUTOTUNE=0: every row kernel at its default config
                   "triton_autotune": os.environ.get("GATLIB_TRITON_AUTOTUNE", "1") != "0"},
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "environment": environment(device),
        "kernel_checks": None, "comparisons": [], "status": None,
    }

    def save() -> None:
        if args.json_path:
            write_json(args.json_path, result)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    return _checks(args, device, cuda, kinds, dtypes, graphs, result, save, log)


def _checks(args, device, cuda, kinds, dtypes, graphs, result, save, log) -> int:
    t0 = time.perf_counter()
    result["kernel_checks"] = kernel_checks(device, args.quick, log, kinds, dtypes)
    result["kernel_checks"]["seconds"] = time.perf_counter() - t0
    save()
    if cuda:
        result["gpu_checks"] = gpu_checks(device, kinds)
        for c in result["gpu_checks"]:
            log(f"[selftest] {c['name']}: {c['status']}" + (f" ({c['detail']})" if c["detail"] else ""))
    else:
        result["gpu_checks"] = ("not run: host syncs, recompiles, CUDA graphs and compiled "
                                "kernels need a GPU")
    save()
    with tempfile.TemporaryDirectory(prefix="gatlib-selftest-") as tmp:
        for i, graph in enumerate(graphs):
            log(f"[selftest] comparison with PyG on {graph}")
            result["comparisons"].append(compare_graph(graph, args, Path(tmp) / f"{i}.json"))
            save()
    ok = (result["kernel_checks"]["failed"] == 0
          and all(c["status"] == "ok" for c in result["comparisons"])
          and all(c["status"] == "ok" for c in result["gpu_checks"]
                  if isinstance(result["gpu_checks"], list)))
    result["status"] = "ok" if ok else "FAIL"
    save()
    table = render_markdown(result)
    print(table, end="")
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(table)
    if args.json_path:
        log(f"[selftest] wrote {args.json_path}")
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m gatlib.bench.selftest``: ``gatlib selftest`` (:func:`gatlib.bench.cli.main`)."""
    from .cli import main as cli_main

    return cli_main(["selftest", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
