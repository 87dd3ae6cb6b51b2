"""Shared test helpers: kernels, dtypes, graphs (fixed cases and hypothesis
strategies), scores, a runner that proves which kernel ran, and Triton's launch
path and compiler in a subprocess."""
from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import gatlib
from gatlib import EdgeScore, graph_attention
from gatlib.bench.selftest import unwritten_memory_is_nan

HAS_SCATTER = importlib.util.find_spec("torch_scatter") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ["gat", "gatv2", "dot"]
LAYERS = ["GATConv", "GATv2Conv", "TransformerConv"]
ALL_KERNELS = ["torch", "scatter", "fused", "triton"]
LOW_PRECISION = [torch.bfloat16, torch.float16]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def dtype_id(dtype) -> str:
    return str(dtype).replace("torch.", "")


def kernels(device: str = "cpu", exclude=()):
    """Every kernel as a test parameter; one that cannot run here is a visible skip
    with its reason, never a test that was quietly not generated."""
    out = []
    for name in ALL_KERNELS:
        if name in exclude:
            continue
        reason = gatlib._dispatch.KERNELS[name].available(torch.device(device))
        out.append(pytest.param(name, id=name, marks=pytest.mark.skipif(reason is not None,
                                                                         reason=str(reason))))
    return out


def fast_kernels(device: str = "cpu"):
    """The kernels other than the reference (the ones tested against it)."""
    return kernels(device, exclude=("torch",))


# ---------------------------------------------------------------------------
# Graphs.
# ---------------------------------------------------------------------------
def random_graph(num_nodes, num_edges, *, num_dst=None, seed=0, device="cpu", self_loops=True):
    """A random ``[2, E]`` edge_index (unsorted, may repeat edges) on ``num_nodes`` sources
    and ``num_dst`` (default ``num_nodes``) destinations."""
    g = torch.Generator().manual_seed(seed)
    num_dst = num_nodes if num_dst is None else num_dst
    src = torch.randint(0, num_nodes, (num_edges,), generator=g)
    dst = torch.randint(0, num_dst, (num_edges,), generator=g)
    ei = torch.stack([src, dst])
    if not self_loops:
        ei = ei[:, ei[0] != ei[1]]
    return ei.to(device)


def hub_graph(num_nodes, hub_degree, *, hub=0, device="cpu"):
    """A star: ``hub_degree`` edges from random sources into node ``hub``, plus a ring."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, num_nodes, (hub_degree,), generator=g)
    ring = torch.arange(num_nodes)
    ei = torch.cat([torch.stack([src, torch.full_like(src, hub)]),
                    torch.stack([ring, (ring + 1) % num_nodes])], dim=1)
    return ei.to(device)


def graph_case(name, device="cpu"):
    """``(edge_index, n_src, n_dst)`` of a named edge case."""
    if name == "random":  # with self-loops and a few repeated edges
        ei, ns, nd = random_graph(30, 150, seed=2), 30, 30
    elif name == "bipartite":
        ei, ns, nd = random_graph(25, 90, num_dst=11, seed=3), 25, 11
    elif name == "hub":  # node 0 has 600 in-edges: several Triton pieces, a long CSR row
        ei, ns, nd = hub_graph(60, 600), 60, 60
    elif name == "isolated":  # destinations 0..7 without in-edges, sources 25.. without out-edges
        ei = random_graph(30, 120, seed=4)
        ei, ns, nd = ei[:, (ei[1] >= 8) & (ei[0] < 25)], 30, 30
    elif name == "duplicates":  # more edges than the matrix has cells
        ei, ns, nd = random_graph(3, 40, seed=5), 3, 3
    elif name == "unsorted":  # destination-sorted descending
        ei = random_graph(30, 150, seed=6)
        ei, ns, nd = ei[:, ei[1].argsort(descending=True)], 30, 30
    elif name == "empty":
        ei, ns, nd = torch.empty(2, 0, dtype=torch.long), 7, 5
    elif name == "no_nodes":
        ei, ns, nd = torch.empty(2, 0, dtype=torch.long), 0, 0
    elif name == "no_sources":  # destinations but no source nodes (an empty value tensor)
        ei, ns, nd = torch.empty(2, 0, dtype=torch.long), 0, 4
    else:
        raise ValueError(name)
    return ei.to(device), ns, nd


GRAPH_CASES = ["random", "bipartite", "hub", "isolated", "duplicates", "unsorted", "empty", "no_nodes",
               "no_sources"]


@st.composite
def graphs(draw, max_nodes: int = 10, max_edges: int = 40, max_hub: int = 60):
    """``(edge_index, n_src, n_dst)``: a graph drawn edge by edge, so hypothesis
    shrinks a failure to few nodes and edges. Covers empty graphs and graphs
    without nodes, bipartite graphs, duplicate edges, self-loops, isolated
    nodes, unsorted edge lists and a hub (node 0 with up to ``max_hub`` extra
    in-edges)."""
    n_src = draw(st.integers(0, max_nodes))
    n_dst = draw(st.integers(0, max_nodes)) if draw(st.booleans()) else n_src
    if n_src == 0 or n_dst == 0:
        return torch.empty(2, 0, dtype=torch.long), n_src, n_dst
    pairs = draw(st.lists(st.tuples(st.integers(0, n_src - 1), st.integers(0, n_dst - 1)),
                          max_size=max_edges))
    hub = draw(st.lists(st.integers(0, n_src - 1), max_size=max_hub)) if draw(st.booleans()) else []
    pairs = pairs + [(j, 0) for j in hub]
    if draw(st.booleans()):
        pairs = sorted(pairs, key=lambda e: e[1])  # destination-sorted input
    if not pairs:
        return torch.empty(2, 0, dtype=torch.long), n_src, n_dst
    return torch.tensor(pairs, dtype=torch.long).t().contiguous(), n_src, n_dst


# ---------------------------------------------------------------------------
# Scores and runs.
# ---------------------------------------------------------------------------
def make_score(kind, n_src, n_dst, E, H, C, *, dtype=torch.float64, seed=0, edge=True, scale=1.0,
               device="cpu", requires_grad=True):
    """An :class:`EdgeScore` of ``kind`` whose tensors are fresh leaves."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        t = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)
        return t.requires_grad_(requires_grad)

    if kind == "gat":
        return EdgeScore.gat(r(n_src, H), r(n_dst, H), r(E, H) if edge else None, 0.2)
    if kind == "gatv2":
        return EdgeScore.gatv2(r(n_src, H, C), r(n_dst, H, C), r(H, C), r(E, H, C) if edge else None, 0.2)
    return EdgeScore.dot(r(n_dst, H, C), r(n_src, H, C), r(E, H, C) if edge else None, 1 / math.sqrt(C))


def leaves(score: EdgeScore):
    return [t for t in score.tensors() if t is not None]


def cast_score(score: EdgeScore, dtype, requires_grad=True) -> EdgeScore:
    """The same score over fresh leaf copies of its tensors in ``dtype``."""
    return score.with_tensors(*(None if t is None else t.detach().to(dtype).requires_grad_(requires_grad)
                                for t in score.tensors()))


def run(backend, score, value, edge_index, n_dst, value_edge=None, *, expect=None, weights=None,
        **kw):
    """``(out [N_dst, H*C], alpha, grads of every leaf)`` of one call on ``backend``.

    The loss goes through both outputs, so alpha's own gradient path is checked
    too. Memory a kernel leaves unwritten reads as NaN, not as whatever an earlier
    test left there (``unwritten_memory_is_nan``). ``expect`` (default: ``backend``)
    must be the kernel that ran — forward and, for fused kernels, backward — or the
    test fails.
    """
    ins = [t for t in (value, value_edge, *score.tensors()) if t is not None and t.requires_grad]
    ins = list(dict.fromkeys(ins))
    with gatlib.record_kernels() as log, unwritten_memory_is_nan():
        out, alpha = graph_attention(score, value, edge_index, n_dst, value_edge=value_edge,
                                     backend=backend, return_attention=True, **kw)
        grads = ()
        if ins:
            g = torch.Generator().manual_seed(11)
            w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out) if weights is None else weights
            loss = (out * w).sum() + (alpha * alpha.detach().cos()).sum()
            grads = torch.autograd.grad(loss, ins, allow_unused=True)
    expect = expect or backend
    assert log[:1] == [expect], f"expected kernel {expect!r} to run; ran {log}"
    if ins and expect in ("fused", "triton"):
        assert f"{expect}.backward" in log, f"the {expect} backward did not run: {log}"
    return out, alpha, grads


# ---------------------------------------------------------------------------
# Low precision.
# ---------------------------------------------------------------------------
# Error bounds in ulps of the largest exact value. One ulp: the result's own
# rounding costs up to half of that, and the reference, torch_scatter and fused
# CPU paths compute everything else in float32. The Triton backward, like
# FlashAttention's, takes Delta_i = <g_i, out_i> from the output as stored in
# float16/bfloat16, whose rounding reaches the gradients (measured up to 4.6
# ulps in the interpreter, whose bfloat16 stores also truncate).
LOW_PRECISION_BOUND = {"torch": 1.0, "scatter": 1.0, "fused": 1.0, "triton": 6.0}


def low_precision_errors(kind, dtype, backend, *, n=200, edges=3000, hub=2000, H=2, C=16,
                         device="cpu"):
    """Error of one call in ``dtype`` (output and every input gradient) against the
    same computation in float64 on the same rounded inputs, in units of
    ``eps(dtype) * max|exact|``. The graph has a hub of ``hub`` in-edges whose
    values have a non-zero mean, so a sum accumulated in the low-precision dtype
    drifts from the exact one."""
    ei = torch.cat([random_graph(n, edges, seed=5), hub_graph(n, hub)], dim=1).to(device)
    E = ei.size(1)
    s = cast_score(make_score(kind, n, n, E, H, C, seed=7, device=device), dtype)
    g = torch.Generator().manual_seed(8)
    v = (1 + torch.randn(n, H, C, generator=g, dtype=torch.float64)).to(device, dtype).requires_grad_()
    ve = torch.randn(E, H, C, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    w = torch.randn(n, H * C, generator=g, dtype=torch.float64).to(device)

    def go(s, v, ve, b):
        out = graph_attention(s, v, ei, n, value_edge=ve, backend=b)
        gr = torch.autograd.grad((out * w.to(out.dtype)).sum(), [v, ve, *leaves(s)])
        return [out.detach().double(), *[t.double() for t in gr]]

    exact = go(cast_score(s, torch.float64), v.detach().double().requires_grad_(),
               ve.detach().double().requires_grad_(), "torch")
    with gatlib.record_kernels() as log:
        got = go(s, v, ve, backend)
    assert log[0] == backend, log
    eps = torch.finfo(dtype).eps
    return [((x - e).abs().max() / (e.abs().max() * eps)).item() for x, e in zip(got, exact, strict=True)]


def count_sorts(monkeypatch):
    """A list that gets one entry per ``torch.sort`` call from now on (for tests
    that an input already in order is not sorted again)."""
    calls = []
    real = torch.sort

    def sort(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(torch, "sort", sort)
    return calls


def record_launches(monkeypatch):
    """A list that gets ``(kernel, constexprs)`` for each row-kernel launch of the
    Triton path (``gatlib._triton._launch``) from now on."""
    from gatlib import _triton

    launched = []
    launch = _triton._launch

    def record(kernel, *args, **consts):
        launched.append((kernel, consts))
        return launch(kernel, *args, **consts)

    monkeypatch.setattr(_triton, "_launch", record)
    return launched


def record_tiles(monkeypatch):
    """A dict that gets, for each row kernel the Triton path launches from now on (by
    name), the constexprs and options of its config as launched (``BLOCK_R``,
    ``num_warps``, ``num_stages``, ...; the last launch's) where a config is pinned,
    untuned or interpreted (a tuned launch picks its config inside the autotuner)."""
    from gatlib import _triton_kernels

    tiles = {}
    cls = type(_triton_kernels._fwd_kernel)  # JITFunction, or the interpreter's
    getitem = cls.__getitem__

    def bind(kernel, grid):
        launch = getitem(kernel, grid)

        def recorded(*args, **kw):
            if "BLOCK_R" in kw:  # (a row kernel)
                tiles[kernel.fn.__name__] = kw
            return launch(*args, **kw)
        return recorded

    monkeypatch.setattr(cls, "__getitem__", bind)
    return tiles


# The ops that read a tensor's value back to the host (item(), bool(tensor), nonzero, ...).
HOST_SYNCS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique",
              "aten.is_nonzero", "aten.equal", "aten.item")


# Operators whose implementation the modes below look into: the Triton kernels'
# operators run their ATen ops on the GPU, where a value read would break a
# captured graph (the fused CPU operators' own reads are no device sync).
LOOK_INSIDE = "gatlib::triton_"


def _run_op(mode, func, args, kwargs):
    """``func(*args, **kwargs)``, with an operator of :data:`LOOK_INSIDE` run by
    its Python implementation under ``mode``, so that its own ops are seen."""
    name = func.name() if hasattr(func, "name") else ""
    if name.startswith(LOOK_INSIDE):
        from torch._library.custom_ops import OPDEFS

        with mode:
            return OPDEFS[name]._init_fn(*args, **(kwargs or {}))
    return func(*args, **(kwargs or {}))


class NoHostSync(TorchDispatchMode):
    """Fails on the first op inside the block that reads a tensor's value back to
    the host (:data:`HOST_SYNCS`): what a CUDA graph cannot capture. The Triton
    operators' own ops are seen (:data:`LOOK_INSIDE`), the fused CPU operators' not."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(HOST_SYNCS):
            raise AssertionError(f"{func} reads a value back to the host")
        return _run_op(self, func, args, kwargs)


class OpCalls(TorchDispatchMode):
    """The ``(args, outputs)`` of every call of the op named ``name`` (e.g.
    ``"gatlib.fused_cpu_attention.default"``) inside the block."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.calls = name, []

    def __enter__(self):
        super().__enter__()
        return self.calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) == self.name:
            self.calls.append((args, out))
        return out


class AtenOps(TorchDispatchMode):
    """The names of the ops run inside the block (``with AtenOps() as ops``),
    the Triton operators' own included (:data:`LOOK_INSIDE`)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return _run_op(self, func, args, kwargs)


# ---------------------------------------------------------------------------
# Triton's real launch path and compiler (without TRITON_INTERPRET, in a subprocess).
# ---------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
TRITON_KERNELS = {"_fwd_kernel", "_alpha_kernel", "_bwd_dst_kernel", "_bwd_src_kernel", "_merge_kernel"}


def run_without_interpreter(args, python=sys.executable, **kw):
    """``python args`` from the repository root without ``TRITON_INTERPRET`` (which this test
    process has, conftest): Triton's launch binder and compiler run there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    return subprocess.run([str(python), *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          **kw)


def compile_budget(tmp_path, python=sys.executable) -> dict:
    """``python -m tools.triton_compile`` (the users' calls, every config, sm_90) under ``python``
    (another venv's Triton) must pass the compile budget (tools.triton_compile.budget_problems);
    its report, after checking what it covered."""
    out = tmp_path / "budget.json"
    proc = run_without_interpreter(["-m", "tools.triton_compile", "--json", str(out)],
                                   python=python, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert not report["problems"] and not [r for r in rows if "error" in r]
    # what it covered: every kernel, the three layers' kinds at the users' widths in float32 and
    # bfloat16, the input-space calls and an output layer, every config of every row kernel's space
    assert {r["kernel"] for r in rows} == TRITON_KERNELS
    labels = {c for r in rows for c in r["cases"]}
    for kind, dtype, c in itertools.product(("gat", "gatv2", "dot"), ("float32", "bfloat16"),
                                            (8, 40, 64, 128, 256)):
        assert f"{kind} {dtype} H=3 C={c}" in labels, (kind, dtype, c)
    assert {"gat_inputs float32 H=3 C=128", "dot_inputs float32 H=3 C=128",
            "gat float32 H=1 C=40"} <= labels
    row = [r for r in rows if r["config"]]
    assert all(sum(x["layer"] == r["layer"] for x in row) == len(r["space"]) for r in row)
    assert {r["config"][1] for r in row} == {1, 3} and max(r["registers"] for r in rows) <= 255
    return report
