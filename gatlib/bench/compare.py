"""``gatlib compare``: gatlib's layers against their PyTorch Geometric twins, with the same weights, on
the same graph and features: agreement first, then interleaved timing and peak memory of eager and
compiled sides. The method (scopes, steps, what is recorded) is in docs/benchmarks.md ("Method").

Usage::

    gatlib compare --layer all --graph arxiv-like --device cpu --json out.json
    python -m gatlib.bench.compare --layer gat --scope model --graph synthetic:2000:10000:32
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import floor, measure
from .compare_report import (ALL_IMPLS, IMPLS, LAYERS, is_compiled, render_table, summarize)
from .report import command_line, environment, write_json

# torch.compile's defaults, written out so that the report says what ran; the same for
# both libraries, since users compile their model the same way whichever layer it holds.
# JSON values only: they go into the report and the memory children's specs.
COMPILE_OPTIONS: Dict = {"backend": "inductor", "mode": None, "fullgraph": False,
                         "dynamic": None}
# --compile-mode: torch.compile's mode for both compiled sides ("default": None).
# "reduce-overhead" replays each compiled graph as a CUDA graph on CUDA: what a
# user who captures the step runs, with no host time per launch.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
# Calls of a compiled side before one compiles nothing new (see settle()).
SETTLE_CALLS = 4
PASSES = ("forward", "forward+backward")  # --scope layer
TRAIN_STEP = "train_step"  # --scope model
SCOPES = ("layer", "model")
GRAPH_INPUTS = ("plan", "tensor")
GRAPHS = ("cora", "arxiv-like", "products-like")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Per-device defaults for heads/channels: the project's CPU and GPU target configurations.
DEFAULT_HC = {"cpu": (4, 64), "cuda": (3, 256)}
LR = 0.01  # Adam's learning rate in the model scope's training step

# Full precision: both sides sum the same terms in a different order, which
# costs ~1e-6 (norm-wise, float32) even on hubs with 1e4 in-edges.
_FP32_TOL = 1e-4
# Half precision: gatlib's error against a float32 PyG reference may be at most
# twice PyG's own error in that dtype (flash-attention's test rule) plus this floor.
_LOWP_FLOOR = 1e-4
# What the agreement check compares, by scope.
_QUANTITIES = {"layer": ("forward", "input_grad"), "model": ("loss", "weight_grad")}

SCHEMA = "gatlib.compare/3"


# Graphs
@dataclass
class Graph:
    """Features and an undirected, loop-free ``edge_index`` plus where they came from."""

    name: str
    x: Tensor  # [N, F]
    edge_index: Tensor  # [2, E]
    source: str
    params: Dict = field(default_factory=dict)


def _load_cora(data_dir: Path) -> Graph:
    from .data import load_dataset

    # Offline, point $GATLIB_PLANETOID_RAW at a folder with Planetoid/Cora/raw:
    # load_dataset copies the raw files into data_dir (else PyG downloads them).
    data = load_dataset("cora", data_dir).data
    return Graph("cora", data.x, data.edge_index,
                 "gatlib.bench.data.load_dataset('cora'): torch_geometric.datasets.Planetoid, "
                 "public split, NormalizeFeatures", {"data_dir": str(data_dir)})


def load_graph(name: str, data_dir: Path, seed: int = 0) -> Graph:
    """``cora``, ``arxiv-like``, ``products-like`` or ``synthetic:N:E:F``."""
    if name == "cora":
        return _load_cora(data_dir)
    from . import synthetic

    spec = synthetic.parse_spec(name)
    data = synthetic.synthetic_graph(spec, seed=seed, cache_dir=data_dir)
    params = {"num_nodes": spec.num_nodes, "directed_edges_drawn": spec.num_edges,
              "num_features": spec.num_features, "degree_exponent": spec.exponent,
              "max_expected_degree": spec.max_degree, "seed": seed, "undirected": True}
    return Graph(spec.name, data.x, data.edge_index,
                 "gatlib.bench.synthetic (Chung-Lu power-law degrees, made undirected)", params)


def with_self_loops(edge_index: Tensor, num_nodes: int) -> Tensor:
    """``edge_index`` with its self-loops replaced by one per node (PyG's
    ``remove_self_loops`` then ``add_self_loops``): what TransformerConv gets."""
    from torch_geometric.utils import add_self_loops, remove_self_loops

    return add_self_loops(remove_self_loops(edge_index)[0], num_nodes=num_nodes)[0]


def layer_edge_index(layer: str, edge_index: Tensor, edge_index_loops: Tensor) -> Tensor:
    """GAT/GATv2 add self-loops themselves; TransformerConv gets them in its input,
    so all three layers attend over the same ``E + N`` edges."""
    return edge_index_loops if layer == "transformer" else edge_index


def base_impl(impl: str) -> str:
    """The library of an implementation: ``"pyg"`` or ``"gatlib"``."""
    return impl.removesuffix("_compiled")


def graph_input(impl: str, edge_index: Tensor, num_nodes: int, mode: str):
    """What ``impl``'s layer receives as its graph: PyG the ``[2, E]`` tensor;
    gatlib (eager or compiled) a :class:`gatlib.GraphPlan` built here
    (``mode="plan"``) or the tensor."""
    if base_impl(impl) == "gatlib" and mode == "plan":
        import gatlib

        return gatlib.GraphPlan(edge_index, num_nodes=num_nodes)
    return edge_index


def warm_plan(impl: str, module: torch.nn.Module, x: Tensor, graph) -> None:
    """For ``gatlib_compiled`` on a plan: one eager forward and backward of ``module`` on
    ``graph``, so that the plan holds what compiled calls read (docs/compile.md); gradients
    reset to ``None`` after."""
    import gatlib

    if impl != "gatlib_compiled" or not isinstance(graph, gatlib.GraphPlan):
        return
    module = getattr(module, "_orig_mod", module)  # (torch.compile's wrapper: compile nothing)
    module(x, graph).float().sum().backward()
    module.zero_grad(set_to_none=True)
    if x.grad is not None:
        x.grad = None


# Layers, models and the measured calls
class TwoLayer(torch.nn.Module):
    """The model of ``--scope model``: ``conv1 -> ELU -> conv2``, both made by ``make``; with
    ``autocast`` (a dtype) the layers run under ``torch.autocast`` to it, the logits come out in
    float32 (as autocast gives them to ``cross_entropy``)."""

    def __init__(self, make, in_channels: int, heads: int, channels: int, num_classes: int,
                 autocast: Optional[torch.dtype] = None):
        super().__init__()
        self.conv1 = make(in_channels, channels, heads=heads)
        self.conv2 = make(heads * channels, num_classes, heads=1, concat=False)
        self.autocast = autocast

    def forward(self, x: Tensor, edge_index) -> Tensor:
        if self.autocast is None:
            return self.conv2(F.elu(self.conv1(x, edge_index)), edge_index)
        with torch.autocast(x.device.type, dtype=self.autocast):
            return self.conv2(F.elu(self.conv1(x, edge_index)), edge_index).float()


def build_pair(layer: str, in_channels: int, heads: int, channels: int, backend: str,
               device: torch.device, dtype: torch.dtype, seed: int, scope: str = "layer",
               num_classes: Optional[int] = None, autocast: Optional[torch.dtype] = None
               ) -> Dict[str, torch.nn.Module]:
    """PyG's layer (``scope="layer"``) or :class:`TwoLayer` model with
    ``num_classes`` outputs (``scope="model"``, under ``autocast`` if given) and gatlib's,
    with PyG's freshly initialised weights loaded into gatlib's."""
    import torch_geometric.nn as pyg_nn

    import gatlib

    theirs_cls, ours_cls = getattr(pyg_nn, LAYERS[layer]), getattr(gatlib, LAYERS[layer])

    def ours_make(*args, **kwargs):
        return ours_cls(*args, backend=backend, **kwargs)

    torch.manual_seed(seed)
    if scope == "layer":
        theirs = theirs_cls(in_channels, channels, heads=heads)
        ours = ours_make(in_channels, channels, heads=heads)
    else:
        theirs = TwoLayer(theirs_cls, in_channels, heads, channels, num_classes, autocast)
        ours = TwoLayer(ours_make, in_channels, heads, channels, num_classes, autocast)
    ours.load_state_dict(theirs.state_dict())
    return {"pyg": theirs.to(device, dtype), "gatlib": ours.to(device, dtype)}


def with_compiled(pair: Dict[str, torch.nn.Module], impls, options: Dict
                  ) -> Dict[str, torch.nn.Module]:
    """``impls``' modules: :func:`build_pair`'s, and for a compiled side
    ``torch.compile`` of the same module object (nothing compiles until it is called)."""
    return {impl: (torch.compile(pair[base_impl(impl)], **options) if is_compiled(impl)
                   else pair[impl]) for impl in impls}


def _grad_out(num_nodes: int, width: int, dtype, device, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randn(num_nodes, width, generator=g).to(device, dtype)  # [N, H*C]


def random_labels(num_nodes: int, num_classes: int, device, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed + 11)
    return torch.randint(num_classes, (num_nodes,), generator=g).to(device)  # [N]


class _Pass:
    """A layer's ``"forward"`` (inference, no autograd graph) or
    ``"forward+backward"`` (``x`` requires grad; gradients reset to ``None``
    first as ``zero_grad`` does)."""

    def __init__(self, layer, x: Tensor, edge_index, grad_out: Tensor, name: str):
        if name not in PASSES:
            raise ValueError(f"pass must be one of {PASSES}; got {name!r}")
        self.layer, self.x, self.edge_index, self.grad_out, self.name = (
            layer, x, edge_index, grad_out, name)

    def clear(self) -> None:
        self.layer.zero_grad(set_to_none=True)
        self.x.grad = None

    def __call__(self):
        if self.name == "forward":
            with torch.no_grad():
                return self.layer(self.x, self.edge_index)
        self.clear()
        out = self.layer(self.x, self.edge_index)
        out.backward(self.grad_out)
        return out


class _TrainStep:
    """One full-batch training step of a model: forward, cross-entropy, backward, Adam step."""

    name = TRAIN_STEP

    def __init__(self, model, x: Tensor, edge_index, labels: Tensor):
        self.model, self.x, self.edge_index, self.labels = model, x, edge_index, labels
        self.opt = torch.optim.Adam(model.parameters(), lr=LR)

    def clear(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def __call__(self):
        self.clear()
        loss = F.cross_entropy(self.model(self.x, self.edge_index), self.labels)
        loss.backward()
        self.opt.step()
        return loss


def make_pass(module, x: Tensor, edge_index, target: Tensor, name: str):
    """The call that is timed and whose memory is measured (tests wrap it):
    ``target`` is the output gradient of a layer pass or the labels of a training step."""
    if name == TRAIN_STEP:
        return _TrainStep(module, x, edge_index, target)
    return _Pass(module, x, edge_index, target, name)


def measured_call(spec: Dict):
    """The builder of the CPU memory children (:func:`gatlib.bench.measure.child_main`):
    loads the inputs the parent saved and returns the call of ``spec``'s
    (layer, implementation, pass)."""
    dtype = DTYPES[spec["dtype"]]
    if spec.get("deterministic"):  # (a fresh process: nothing to restore)
        torch.use_deterministic_algorithms(True)
    blob = torch.load(spec["inputs"], weights_only=True)
    x = blob["x"]
    N, F_in = x.shape
    edge_index = layer_edge_index(spec["layer"], blob["edge_index"], blob["edge_index_loops"])
    del blob
    impl = spec["impl"]
    pair = build_pair(spec["layer"], F_in, spec["heads"], spec["channels"], spec["backend"],
                      torch.device("cpu"), dtype, spec["seed"], spec["scope"], spec["classes"],
                      DTYPES[spec["autocast"]] if spec.get("autocast") else None)
    module = with_compiled(pair, [impl], spec.get("compile_options") or {})[impl]
    del pair
    if spec["scope"] == "layer":
        x = x.requires_grad_()
        target = _grad_out(N, spec["heads"] * spec["channels"], dtype, "cpu", spec["seed"])
    else:
        target = random_labels(N, spec["classes"], "cpu", spec["seed"])
    graph = graph_input(impl, edge_index, N, spec["graph_input"])
    warm_plan(impl, module, x, graph)
    fn = make_pass(module, x, graph, target, spec["pass"])
    if is_compiled(impl):  # compile now: the warm-up and measured calls must not
        res = settle(fn, torch.device("cpu"))
        if res["status"] != "ok":
            raise RuntimeError(f"{impl} failed before it settled: {res['error']}")
    return fn


@contextlib.contextmanager
def deterministic(on: bool):
    """``torch.use_deterministic_algorithms(True)`` inside the block if ``on``; the caller's
    setting after it."""
    if not on:
        yield
        return
    was, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


# Compiling
@contextlib.contextmanager
def compile_stats():
    """What torch.compile did inside this block, from dynamo's counters (global, so
    one side at a time): ``graphs`` compiled, ``graph_breaks`` and their
    ``break_reasons`` (first lines), and the compile caches' ``cache`` hits and misses."""
    from torch._dynamo.utils import counters

    def snapshot():
        return {group: dict(c) for group, c in counters.items()}

    before, stats = snapshot(), {}
    try:
        yield stats
    finally:
        after = snapshot()

        def delta(group, key):
            return after.get(group, {}).get(key, 0) - before.get(group, {}).get(key, 0)

        breaks = {r: delta("graph_break", r) for r in after.get("graph_break", {})}
        breaks = {r: n for r, n in breaks.items() if n > 0}
        stats.update(
            graphs=delta("stats", "unique_graphs"),
            graph_breaks=sum(breaks.values()),
            break_reasons=sorted({(r.strip().splitlines() or [""])[0][:200] for r in breaks}),
            cache={f"{group}.{key}": delta(group, key) for group in ("aot_autograd", "inductor")
                   for key in after.get(group, {}) if "cache_" in key and delta(group, key)})


def add_stats(total: Dict, stats: Dict) -> Dict:
    """Accumulate :func:`compile_stats` results into ``total``."""
    total["graphs"] = total.get("graphs", 0) + stats["graphs"]
    total["graph_breaks"] = total.get("graph_breaks", 0) + stats["graph_breaks"]
    total["break_reasons"] = sorted({*total.get("break_reasons", []), *stats["break_reasons"]})
    cache = total.setdefault("cache", {})
    for key, n in stats["cache"].items():
        cache[key] = cache.get(key, 0) + n
    return total


def settle(fn, device: torch.device, max_calls: int = SETTLE_CALLS) -> Dict:
    """Call a compiled side's measured call until a call compiles nothing new, so that no compile falls
    into a warm-up (which sizes the timing blocks) or a memory measurement.

    Returns ``status``, ``calls`` (``seconds`` and ``graphs`` per call), ``settled`` and the summed
    :func:`compile_stats`; or the failure of the call that raised.
    """
    calls: List[Dict] = []
    total: Dict = {}
    for _ in range(max_calls):
        with compile_stats() as stats:
            t = measure.time_once(fn, device)
        fn.clear()
        add_stats(total, stats)
        if t["status"] != "ok":
            return {**t, "calls": calls, **total}
        calls.append({"seconds": t["seconds"], "graphs": stats["graphs"]})
        if stats["graphs"] == 0:
            break
    return {"status": "ok", "calls": calls, "settled": calls[-1]["graphs"] == 0, **total}


# Agreement
def _rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def first_weight(model: torch.nn.Module) -> str:
    """Name of conv1's first weight (the input projection), whose gradient the
    model scope's agreement check compares."""
    model = getattr(model, "_orig_mod", model)  # a compiled side: the module it compiles
    return next(f"conv1.{n}" for n, _ in model.conv1.named_parameters() if n.endswith("weight"))


def _layer_outputs(layer, x: Tensor, edge_index, grad_out: Tensor):
    """``(output, input gradient)`` of one forward+backward."""
    xx = x.detach().clone().requires_grad_()
    out = layer(xx, edge_index)
    (grad,) = torch.autograd.grad(out, xx, grad_out)
    return out.detach(), grad


def model_outputs(model, x: Tensor, edge_index, labels: Tensor):
    """``(loss, gradient of conv1's first weight)``."""
    weight = getattr(model, "_orig_mod", model).get_parameter(first_weight(model))
    loss = F.cross_entropy(model(x.detach(), edge_index), labels)
    (grad,) = torch.autograd.grad(loss, weight)
    return loss.detach(), grad


_OUTPUTS = {"layer": _layer_outputs, "model": model_outputs}


def pyg_reference(modules: Dict[str, torch.nn.Module], graphs: Dict, x: Tensor,
                  target: Tensor, scope: str = "layer") -> Dict:
    """What every other side is compared with: eager PyG's outputs (``"pyg"``) and,
    in half precision or under autocast, PyG's in float32 (``"fp32"``, else ``None``)."""
    ref = {"pyg": _OUTPUTS[scope](modules["pyg"], x, graphs["pyg"], target), "fp32": None}
    if x.dtype in (torch.float16, torch.bfloat16) or getattr(modules["pyg"], "autocast", None):
        ref_module = copy.deepcopy(modules["pyg"]).float()
        if scope == "model":
            ref_module.autocast = None
        ref["fp32"] = _OUTPUTS[scope](ref_module, x.float(), graphs["pyg"],
                                      target.float() if target.is_floating_point() else target)
    return ref


def check_agreement(modules: Dict[str, torch.nn.Module], graphs: Dict, x: Tensor,
                    target: Tensor, scope: str = "layer", impl: str = "gatlib",
                    ref: Optional[Dict] = None) -> Dict:
    """Norm-wise relative error of ``impl`` (gatlib, or a compiled side) against eager PyG.

    ``layer``: output and input gradient; ``model``: loss and conv1's first weight's gradient. float32: at most
    ``1e-4``; bfloat16/float16 or under autocast: at most twice PyG's error (both against PyG in float32,
    without autocast) plus ``1e-4``.
    """
    ref = ref if ref is not None else pyg_reference(modules, graphs, x, target, scope)
    got = _OUTPUTS[scope](modules[impl], x, graphs[impl], target)
    res: Dict = {"dtype": str(x.dtype).replace("torch.", "")}
    if scope == "model":
        res["weight"] = first_weight(modules[impl])
    keys = _QUANTITIES[scope]
    for i, key in enumerate(keys):
        if ref["fp32"] is None:
            res[f"{key}_rel_err"] = _rel_err(got[i], ref["pyg"][i])
            res[f"tol_{key}"] = _FP32_TOL
        else:
            err_pyg = _rel_err(ref["pyg"][i], ref["fp32"][i])
            res[f"{key}_rel_err"] = _rel_err(got[i], ref["fp32"][i])
            res[f"{key}_rel_err_pyg_vs_fp32"] = err_pyg
            res[f"tol_{key}"] = 2 * err_pyg + _LOWP_FLOOR
    ok = all(res[f"{key}_rel_err"] <= res[f"tol_{key}"] for key in keys)
    res["status"] = "ok" if ok else "mismatch"
    return res


# CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``gatlib compare``'s options to ``parser``."""
    from gatlib import BACKENDS

    parser.add_argument("--layer", default="all", choices=[*LAYERS, "all"],
                        help="layer type to compare (default: all)")
    parser.add_argument("--scope", default="layer", choices=SCOPES,
                        help="layer: one layer's forward and forward+backward; model: one "
                             "training step of a 2-layer model of that layer type "
                             "(default: layer)")
    parser.add_argument("--graph", default="cora",
                        help=f"one of {', '.join(GRAPHS)}, or synthetic:N:E:F for a power-law "
                             "graph with N nodes, E directed edges (made undirected) and F "
                             "features (default: cora)")
    parser.add_argument("--graph-input", default="plan", choices=GRAPH_INPUTS,
                        help="what gatlib's layers receive: a GraphPlan built once before "
                             "timing, or the edge_index tensor (a plan is then derived in "
                             "every call); PyG always gets the tensor (default: plan)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="(default: cpu)")
    parser.add_argument("--heads", type=int, default=None,
                        help="heads H (default: 4 on CPU, 3 on CUDA)")
    parser.add_argument("--channels", type=int, default=None,
                        help="channels per head C (default: 64 on CPU, 256 on CUDA)")
    parser.add_argument("--classes", type=int, default=40,
                        help="--scope model: output classes, as ogbn-arxiv (default: 40)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="(default: float32)")
    parser.add_argument("--autocast", default=None, choices=["bfloat16", "float16"],
                        help="--scope model: both models' layers run under torch.autocast to "
                             "this dtype, float32 weights (default: off)")
    parser.add_argument("--deterministic", action="store_true",
                        help="run under torch.use_deterministic_algorithms(True): what runs "
                             "at all, and how fast (on CUDA set CUBLAS_WORKSPACE_CONFIG=:4096:8 "
                             "first, as torch asks)")
    parser.add_argument("--backend", default="auto", choices=list(BACKENDS),
                        help="gatlib attention backend (default: auto)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds per implementation and pass (default: 5)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls before timing, at least 1 (default: 1)")
    parser.add_argument("--block-seconds", type=float, default=0.5, metavar="S",
                        help="each timed block repeats the call until it lasts S seconds "
                             "(default: 0.5)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="measure peak extra memory (default: on)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also time torch.compile of both sides' modules (pyg_compiled, "
                             "gatlib_compiled), with torch.compile's defaults (default: on)")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                        help="torch.compile's mode for both compiled sides; 'reduce-overhead' "
                             "replays their graphs as CUDA graphs on CUDA (default: torch.compile's "
                             "default mode)")
    parser.add_argument("--pass", dest="passes", default=None,
                        choices=["forward", "forward+backward", "both"],
                        help="--scope layer: which passes to measure (default: both)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results here")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="dataset cache (default: $GATLIB_DATA or ~/.cache/gatlib); offline, "
                             "set $GATLIB_PLANETOID_RAW to a folder with Planetoid/Cora/raw")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's default, "
                             f"{torch.get_num_threads()} here)")
    parser.add_argument("--seed", type=int, default=0,
                        help="weights, features, labels, graph (default: 0)")
    parser.add_argument("--mem-budget-gb", type=float, default=None,
                        help="CPU: let each process grow by at most this many GB; more "
                             "counts as OOM (default: the free memory less 1 GB)")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)


def _log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def _config(args: argparse.Namespace) -> Dict:
    from .data import resolve_data_dir

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1; got {args.repeats}")
    if args.block_seconds < 0:
        raise ValueError(f"--block-seconds must be >= 0; got {args.block_seconds}")
    if args.scope == "model" and args.passes is not None:
        raise ValueError("--pass applies to --scope layer; --scope model times a training step")
    if args.classes < 1:
        raise ValueError(f"--classes must be >= 1; got {args.classes}")
    if args.autocast and (args.scope != "model" or args.dtype != "float32"):
        raise ValueError("--autocast applies to --scope model with --dtype float32 (autocast "
                         "runs float32 weights in the lower precision)")
    mode = args.compile_mode
    if mode != "default" and not args.compile:
        raise ValueError(f"--compile-mode {mode}: there are no compiled sides with --no-compile")
    device = torch.device(args.device)
    heads, channels = DEFAULT_HC[device.type]
    heads = args.heads if args.heads is not None else heads
    channels = args.channels if args.channels is not None else channels
    if heads < 1 or channels < 1:
        raise ValueError(f"--heads and --channels must be >= 1; got {heads}, {channels}")
    if args.scope == "model":
        passes = [TRAIN_STEP]
    else:
        passes = list(PASSES) if args.passes in (None, "both") else [args.passes]
    return {
        "layers": list(LAYERS) if args.layer == "all" else [args.layer],
        "scope": args.scope, "graph": args.graph, "graph_input": args.graph_input,
        "device": args.device, "heads": heads, "channels": channels,
        "classes": args.classes if args.scope == "model" else None,
        "dtype": args.dtype, "autocast": args.autocast, "deterministic": args.deterministic,
        "backend": args.backend,
        "repeats": args.repeats, "block_s": args.block_seconds, "warmup": max(1, args.warmup),
        "memory": args.memory, "passes": passes,
        "impls": list(ALL_IMPLS if args.compile else IMPLS),
        "compile_options": ({**COMPILE_OPTIONS, **({} if mode == "default" else {"mode": mode})}
                            if args.compile else None),
        "seed": args.seed, "threads": torch.get_num_threads(),
        "data_dir": str(resolve_data_dir(args.data_dir)),
        "mem_budget_bytes": (int(args.mem_budget_gb * 2**30) if args.mem_budget_gb else None),
    }


def run(args: argparse.Namespace) -> int:
    """Run a comparison (docs/benchmarks.md, "Method"). Returns the exit status:
    0 done, 1 an implementation (eager or compiled) disagreed with PyG or failed
    with an error other than OOM, 2 bad arguments."""
    if getattr(args, "_child", None):
        return measure.child_main(args._child)
    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"gatlib compare: error: {exc}", file=sys.stderr)
        return 2
    return _run(args, cfg)


def _run(args: argparse.Namespace, cfg: Dict) -> int:
    device, dtype = torch.device(cfg["device"]), DTYPES[cfg["dtype"]]
    try:
        graph = load_graph(cfg["graph"], Path(cfg["data_dir"]), cfg["seed"])
    except (ValueError, FileNotFoundError) as exc:  # incl. data.DatasetNotFoundError
        print(f"gatlib compare: error: {exc}", file=sys.stderr)
        return 2
    N, F_in = graph.x.shape
    x = graph.x.to(device, dtype)
    if cfg["scope"] == "layer":
        x.requires_grad_()  # the input gradient is part of a layer's backward
    ei = graph.edge_index.to(device)
    ei_loops = with_self_loops(ei, N)
    report = {
        "schema": SCHEMA,
        "command": command_line(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": cfg,
        "environment": environment(device),
        "graph": {
            "name": graph.name, "source": graph.source, "params": graph.params,
            "num_nodes": N, "num_features": F_in, "num_edges": ei.size(1),
            "num_edges_with_self_loops": ei_loops.size(1),
            "self_loops": "GATConv/GATv2Conv add one self-loop per node themselves "
                          "(add_self_loops=True); TransformerConv is given edge_index with "
                          "the same self-loops added, so every layer attends over "
                          "num_edges_with_self_loops edges",
        },
        "checks": {}, "kernels": {}, "plan_bytes": {}, "measurements": [],
        **({"kernels_compiled": {}, "compile": {}} if args.compile else {}),
        "parent_mem_budget_bytes": {},
    }
    if device.type == "cuda":  # what the bandwidth floor of each pass is measured against
        report["bandwidth"] = floor.device_record(device)
    _log(f"graph {graph.name}: N={N:,} E={ei.size(1):,} (+{N:,} self-loops) F={F_in}; "
         f"scope {cfg['scope']}, H={cfg['heads']} C={cfg['channels']} {cfg['dtype']} {device}, "
         f"gatlib backend {cfg['backend']}, graph input {cfg['graph_input']}; "
         f"{', '.join(cfg['impls'])}")
    status = 0
    with tempfile.TemporaryDirectory(prefix="gatlib-compare-") as tmp, \
            deterministic(cfg["deterministic"]):
        workdir = Path(tmp)
        if cfg["memory"] and device.type == "cpu":
            torch.save({"x": graph.x.to(dtype), "edge_index": graph.edge_index,
                        "edge_index_loops": ei_loops.cpu()}, workdir / "inputs.pt")
        for layer in cfg["layers"]:
            # On CPU this process, too, stays within the free memory: a PyG layer that
            # does not fit is then an OOM result instead of a SIGKILL for the whole run.
            with (measure.memory_budget(cfg["mem_budget_bytes"]) if device.type == "cpu"
                  else contextlib.nullcontext()) as budget:
                report["parent_mem_budget_bytes"][layer] = budget
                rc = _compare_layer(layer, cfg, report, x, ei, ei_loops, device, dtype, workdir)
            status = max(status, rc)
            if args.json:  # after every layer: a long run that dies keeps what it measured
                _write_json(report, args.json, complete=False)
            if rc == 1 and report["checks"].get(layer, {}).get("status") != "ok":
                break  # a disagreement aborts the run
    report["summary"] = summarize(report["measurements"])
    print(render_table(report))
    if args.json:
        _write_json(report, args.json, complete=True)
        _log(f"wrote {args.json}")
    return status


def _write_json(report: Dict, path: Union[str, Path], complete: bool) -> None:
    report["summary"] = summarize(report["measurements"])
    report["complete"] = complete
    write_json(path, report)


def _compare_layer(layer: str, cfg: Dict, report: Dict, x: Tensor, ei: Tensor,
                   ei_loops: Tensor, device: torch.device, dtype: torch.dtype,
                   workdir: Path) -> int:
    import gatlib

    N, F_in = x.shape
    H, C, scope, impls = cfg["heads"], cfg["channels"], cfg["scope"], cfg["impls"]
    name = LAYERS[layer]
    compiled = [impl for impl in impls if is_compiled(impl)]
    if compiled:  # each layer type compiles afresh (and far from dynamo's recompile limit)
        torch._dynamo.reset()
    pair = build_pair(layer, F_in, H, C, cfg["backend"], device, dtype, cfg["seed"], scope,
                      cfg["classes"], DTYPES[cfg["autocast"]] if cfg["autocast"] else None)
    modules = with_compiled(pair, impls, cfg["compile_options"] or {})
    del pair
    edge_index = layer_edge_index(layer, ei, ei_loops)
    # Each side its own graph input: a compiled side's first call derives its plan too.
    graphs = {impl: graph_input(impl, edge_index, N, cfg["graph_input"]) for impl in impls}
    for impl in impls:
        warm_plan(impl, modules[impl], x, graphs[impl])
    target = (_grad_out(N, H * C, dtype, device, cfg["seed"]) if scope == "layer"
              else random_labels(N, cfg["classes"], device, cfg["seed"]))
    passes = {(impl, p): make_pass(modules[impl], x, graphs[impl], target, p)
              for impl in impls for p in cfg["passes"]}
    rc = 0

    # 1. CPU memory first: it tells which implementation fits before this process tries.
    memory: Dict = {}

    def record_memory(key, res):
        nonlocal rc
        memory[key] = res
        if res["status"] == "error":
            rc = 1
            _log(f"  error: {res['error']}")

    if cfg["memory"] and device.type == "cpu":
        for (impl, p) in passes:
            _log(f"{name}: peak memory, {impl}, {p}")
            spec = {"builder": "gatlib.bench.compare:measured_call",
                    "inputs": str(workdir / "inputs.pt"),
                    "layer": layer, "impl": impl, "pass": p, "scope": scope,
                    "heads": H, "channels": C, "classes": cfg["classes"],
                    "dtype": cfg["dtype"], "autocast": cfg["autocast"],
                    "deterministic": cfg["deterministic"], "backend": cfg["backend"],
                    "graph_input": cfg["graph_input"], "seed": cfg["seed"],
                    "compile_options": cfg["compile_options"],
                    "threads": cfg["threads"], "mem_budget_bytes": cfg["mem_budget_bytes"]}
            record_memory((impl, p), measure.peak_rss_child(spec, workdir))
    # On CPU, running what did not fit in a child would take this process down.
    too_big = {k for k, m in memory.items() if m["status"] == "OOM"}
    # Sides not timed, with why: a compiled side that failed to compile or disagrees.
    failed: Dict[str, Dict] = {}

    # 2. Agreement, unless one side does not fit; it records which kernels gatlib ran.
    if too_big:
        check = {"status": "skipped", "reason": "an implementation ran out of memory"}
    else:
        _log(f"{name}: checking agreement with torch_geometric.nn.{name}")
        try:
            ref = pyg_reference(modules, graphs, x, target, scope)
            with gatlib.record_kernels() as log:
                check = check_agreement(modules, graphs, x, target, scope, "gatlib", ref)
            report["kernels"][layer] = list(dict.fromkeys(log))
            if isinstance(graphs["gatlib"], gatlib.GraphPlan):
                # what the plan holds once used: part of gatlib's inputs in every
                # measurement below, as edge_index is part of PyG's
                report["plan_bytes"][layer] = graphs["gatlib"].nbytes
        except Exception as exc:  # noqa: BLE001
            check = {**measure.failure(exc),
                     "status": "skipped" if measure.is_oom(exc) else "error"}
            measure.release(device)
        if check["status"] == "ok" and compiled:
            check["compiled"] = {}
            for impl in compiled:
                check["compiled"][impl] = _check_compiled(impl, modules, graphs, x, target,
                                                          scope, ref, device, layer, report)
                if check["compiled"][impl]["status"] in ("mismatch", "error"):
                    failed[impl] = check["compiled"][impl]
                    rc = 1
                    _print_disagreement(impl, check["compiled"][impl], cfg, report, name, scope)
            del ref
    report["checks"][layer] = check
    if check["status"] in ("mismatch", "error"):
        _print_disagreement("gatlib", check, cfg, report, name, scope)
        return 1

    # 3. The compiled sides compile what is left, so that no measurement compiles.
    settled: Dict = {}
    for impl in compiled:
        for p in cfg["passes"]:
            if impl in failed or (impl, p) in too_big:
                continue
            _log(f"{name}: compiling {impl}, {p}")
            settled[impl, p] = res = settle(passes[impl, p], device)
            add_stats(report["compile"].setdefault(layer, {}).setdefault(impl, {}), res)
            if res["status"] != "ok":
                rc = 1 if res["status"] == "error" else rc
                _log(f"  {impl} {p} {res['status']}: {res['error']}")
            elif not res["settled"]:
                _log(f"  {impl} {p}: still compiling after {len(res['calls'])} calls")
    if cfg["memory"] and device.type == "cuda":  # in this process, after compiling
        for (impl, p), fn in passes.items():
            if impl in failed or settled.get((impl, p), {}).get("status", "ok") != "ok":
                continue
            _log(f"{name}: peak memory, {impl}, {p}")
            record_memory((impl, p), measure.peak_cuda(fn, device))

    # 4. Time: gatlib's first call on a freshly built graph input, then the interleaved rounds.
    first_pass = TRAIN_STEP if scope == "model" else "forward+backward"
    first = None
    if first_pass in cfg["passes"] and ("gatlib", first_pass) not in too_big:
        def first_call(module=modules["gatlib"]):  # building the graph input is part of its cost
            fresh = graph_input("gatlib", edge_index, N, cfg["graph_input"])
            return make_pass(module, x, fresh, target, first_pass)()

        first = measure.time_once(first_call, device)
        passes["gatlib", first_pass].clear()
        if first["status"] == "error":
            rc = 1
            _log(f"  gatlib first call error: {first['error']}")
    for p in cfg["passes"]:
        skip = {impl: failed[impl] for impl in failed}
        skip.update({impl: settled[impl, p] for impl in compiled
                     if settled.get((impl, p), {}).get("status", "ok") != "ok"})
        fns = {impl: passes[impl, p] for impl in impls
               if (impl, p) not in too_big and impl not in skip}
        _log(f"{name}: timing {p} ({', '.join(fns) or 'nothing fits'}), {cfg['repeats']} rounds")
        with compile_stats() as while_timing:
            times = (measure.time_interleaved(fns, device, cfg["repeats"], cfg["warmup"],
                                              cfg["block_s"]) if fns else {})
        if compiled:
            report["compile"].setdefault(layer, {}).setdefault("graphs_while_timing", {})[p] = (
                while_timing["graphs"])
            if while_timing["graphs"]:
                _log(f"  {while_timing['graphs']} graphs compiled while timing {p}")
        for impl in impls:
            if impl in skip:
                t = {"status": skip[impl]["status"],
                     "error": f"not timed: {skip[impl].get('error') or 'disagrees with PyG'}"}
            else:
                t = times.get(impl) or {"status": "OOM", "error": "not run in this process: out "
                                        "of memory in its fresh-process memory measurement"}
            if t["status"] == "error" and impl not in skip:
                rc = 1
                _log(f"  {impl} error: {t['error']}")
            entry = {"layer": layer, "impl": impl, "pass": p, "time": t}
            if (impl, p) in memory:
                entry["memory"] = memory[impl, p]
            if impl == "gatlib" and p == first_pass and first is not None:
                entry["first_call_s"] = first.get("seconds")
                if first["status"] != "ok":
                    entry["first_call_failure"] = first
            if is_compiled(impl):
                first_compiled = report["compile"].get(layer, {}).get(impl, {}).get("first_call_s")
                if p == first_pass and first_compiled is not None:
                    entry["first_call_s"] = first_compiled
                if (impl, p) in settled:
                    entry["settle_calls"] = settled[impl, p]["calls"]
            report["measurements"].append(entry)
    del modules, passes, graphs
    measure.release(device)
    return rc


def _check_compiled(impl: str, modules: Dict, graphs: Dict, x: Tensor, target: Tensor,
                    scope: str, ref: Dict, device: torch.device, layer: str,
                    report: Dict) -> Dict:
    """A compiled side's agreement check, its first call (``first_call_s``): records what
    compiled (``report["compile"]``) and gatlib's kernels (``report["kernels_compiled"]``)."""
    import gatlib

    stats_total = report["compile"].setdefault(layer, {}).setdefault(impl, {})
    try:
        with gatlib.record_kernels() as log, compile_stats() as stats:
            measure.sync(device)
            t0 = time.perf_counter()
            res = check_agreement(modules, graphs, x, target, scope, impl, ref)
            measure.sync(device)
            stats_total["first_call_s"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 — e.g. no C++ compiler for inductor
        res = {**measure.failure(exc), "traceback": traceback.format_exc()[-1500:]}
        res["status"] = "skipped" if res["status"] == "OOM" else "error"
        measure.release(device)
    add_stats(stats_total, stats)
    if res["status"] == "ok" and not stats["graphs"]:
        # The caches were reset for this layer: a first call that compiled nothing ran
        # eagerly (TORCHDYNAMO_DISABLE=1, a torch.compile that is not there...).
        res = {**res, "status": "error", "error": "compiled no graph in its first call: it "
                                                  "ran eagerly, and timing it would not say so"}
    if base_impl(impl) == "gatlib":
        report["kernels_compiled"][layer] = list(dict.fromkeys(log))
    return res


def _print_disagreement(impl: str, check: Dict, cfg: Dict, report: Dict, name: str,
                        scope: str) -> None:
    if check["status"] == "mismatch":
        detail = ", ".join(f"{key} rel. error {check[f'{key}_rel_err']:.2e} "
                           f"(tol {check[f'tol_{key}']:.1e})" for key in _QUANTITIES[scope])
    else:
        detail = check["error"]
    what = {"gatlib": f"gatlib.{name}(backend={cfg['backend']!r})",
            "gatlib_compiled": f"torch.compile(gatlib.{name}(backend={cfg['backend']!r}))",
            "pyg_compiled": f"torch.compile(torch_geometric.nn.{name})"}[impl]
    verb = "does not agree with" if check["status"] == "mismatch" else "failed beside"
    print(f"gatlib compare: {what} {verb} torch_geometric.nn.{name} on "
          f"{report['graph']['name']} ({cfg['dtype']}, {cfg['device']}, scope {scope}): "
          f"{detail}. Not timing it.", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m gatlib.bench.compare``: ``gatlib compare`` (:func:`gatlib.bench.cli.main`)."""
    from .cli import main as cli_main

    return cli_main(["compare", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
