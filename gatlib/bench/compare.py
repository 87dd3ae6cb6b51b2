"""``gatlib compare``: gatlib's layers against their PyTorch Geometric twins.

For each layer type (GATConv, GATv2Conv, TransformerConv) PyG's and gatlib's
are built with the *same weights* (``gatlib.load_state_dict(pyg.state_dict())``)
and run on the same graph and features. What is compared (``--scope``):

* ``layer``: one layer, Layer(F, C, heads=H). Two passes: ``forward``
  (inference, ``torch.no_grad``) and ``forward+backward`` (a training step's
  forward and backward, gradients reset to ``None`` first as ``zero_grad`` does).
* ``model``: one full-batch training step (``train_step``) of a 2-layer model,
  conv1 = Layer(F, C, heads=H) -> ELU -> conv2 = Layer(H*C, classes, heads=1,
  concat=False): forward, cross-entropy on random (seeded) labels, backward and
  an Adam step (lr 0.01).

GATConv and GATv2Conv add one self-loop per node themselves; TransformerConv is
given the ``edge_index`` with the same self-loops added, so every layer attends
over the same ``E + N`` edges.

The graph is an input like the features: PyG's layer receives the ``[2, E]``
tensor; gatlib's receives a :class:`gatlib.GraphPlan` built from it once before
anything is measured (``--graph-input plan``, the default), or the same tensor
(``--graph-input tensor``), from which it then derives a plan inside every call.
A plan derives its CSR layout and self-loops on first use and keeps them, so
gatlib's ``forward+backward`` (or ``train_step``) measurement also records
``first_call_s``: the time of one call on a freshly built plan (or tensor),
taken once after the agreement check and before the warm-up.

Steps, per layer type:

1. **peak extra memory** of each (implementation, pass) after a warm-up call
   (:mod:`gatlib.bench.measure`; on CPU in a fresh child process per
   measurement, run as ``python -m gatlib.bench.compare --_child SPEC``);
2. **agreement**: gatlib's output and input gradient (``layer``), or loss and
   gradient of conv1's first weight (``model``), must match PyG's (norm-wise
   relative error, tolerance by dtype), else the run aborts — timing something
   that computes something else is meaningless. The kernels gatlib ran here are
   recorded (``kernels``);
3. **time**: warm-up, then ``--repeats`` interleaved rounds (A B B A) of at
   least ``--block-seconds`` each. Reported: medians, speedup = PyG / gatlib
   median, and the per-round ratios, whose spread says how much the machine's
   load moved the numbers.

Out-of-memory is a result ("OOM"), not a crash. On CPU this process runs under
:func:`gatlib.bench.measure.memory_budget` (the free memory, or
``--mem-budget-gb``); the memory children run first, and an implementation
that ran out of memory there is not run again here. Results are written to
``--json`` after every layer type, so a long run that dies keeps what it
measured (``"complete": false``).

Usage::

    gatlib compare --layer all --graph arxiv-like --device cpu --json out.json
    python -m gatlib.bench.compare --layer gat --scope model --graph synthetic:2000:10000:32
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import measure
from .report import command_line, environment, format_table, write_json

LAYERS = {"gat": "GATConv", "gatv2": "GATv2Conv", "transformer": "TransformerConv"}
IMPLS = ("pyg", "gatlib")
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

SCHEMA = "gatlib.compare/2"


# ---------------------------------------------------------------------------
# Graphs
# ---------------------------------------------------------------------------
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


def _with_self_loops(edge_index: Tensor, num_nodes: int) -> Tensor:
    from torch_geometric.utils import add_self_loops, remove_self_loops

    return add_self_loops(remove_self_loops(edge_index)[0], num_nodes=num_nodes)[0]


def layer_edge_index(layer: str, edge_index: Tensor, edge_index_loops: Tensor) -> Tensor:
    """GAT/GATv2 add self-loops themselves; TransformerConv gets them in its input,
    so all three layers attend over the same ``E + N`` edges."""
    return edge_index_loops if layer == "transformer" else edge_index


def graph_input(impl: str, edge_index: Tensor, num_nodes: int, mode: str):
    """What ``impl``'s layer receives as its graph: PyG the ``[2, E]`` tensor;
    gatlib a :class:`gatlib.GraphPlan` built here (``mode="plan"``) or the tensor."""
    if impl == "gatlib" and mode == "plan":
        import gatlib

        return gatlib.GraphPlan(edge_index, num_nodes=num_nodes)
    return edge_index


# ---------------------------------------------------------------------------
# Layers, models and the measured calls
# ---------------------------------------------------------------------------
class TwoLayer(torch.nn.Module):
    """The model of ``--scope model``: ``conv1 -> ELU -> conv2``, both made by ``make``."""

    def __init__(self, make, in_channels: int, heads: int, channels: int, num_classes: int):
        super().__init__()
        self.conv1 = make(in_channels, channels, heads=heads)
        self.conv2 = make(heads * channels, num_classes, heads=1, concat=False)

    def forward(self, x: Tensor, edge_index) -> Tensor:
        return self.conv2(F.elu(self.conv1(x, edge_index)), edge_index)


def build_pair(layer: str, in_channels: int, heads: int, channels: int, backend: str,
               device: torch.device, dtype: torch.dtype, seed: int, scope: str = "layer",
               num_classes: Optional[int] = None) -> Dict[str, torch.nn.Module]:
    """PyG's layer (``scope="layer"``) or :class:`TwoLayer` model with
    ``num_classes`` outputs (``scope="model"``) and gatlib's, with PyG's freshly
    initialised weights loaded into gatlib's."""
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
        theirs = TwoLayer(theirs_cls, in_channels, heads, channels, num_classes)
        ours = TwoLayer(ours_make, in_channels, heads, channels, num_classes)
    ours.load_state_dict(theirs.state_dict())
    return {"pyg": theirs.to(device, dtype), "gatlib": ours.to(device, dtype)}


def _grad_out(num_nodes: int, width: int, dtype, device, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randn(num_nodes, width, generator=g).to(device, dtype)  # [N, H*C]


def _labels(num_nodes: int, num_classes: int, device, seed: int) -> Tensor:
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


def _make_pass(module, x: Tensor, edge_index, target: Tensor, name: str):
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
    blob = torch.load(spec["inputs"], weights_only=True)
    x = blob["x"]
    N, F_in = x.shape
    edge_index = layer_edge_index(spec["layer"], blob["edge_index"], blob["edge_index_loops"])
    del blob
    module = build_pair(spec["layer"], F_in, spec["heads"], spec["channels"], spec["backend"],
                        torch.device("cpu"), dtype, spec["seed"], spec["scope"],
                        spec["classes"])[spec["impl"]]
    if spec["scope"] == "layer":
        x = x.requires_grad_()
        target = _grad_out(N, spec["heads"] * spec["channels"], dtype, "cpu", spec["seed"])
    else:
        target = _labels(N, spec["classes"], "cpu", spec["seed"])
    graph = graph_input(spec["impl"], edge_index, N, spec["graph_input"])
    return _make_pass(module, x, graph, target, spec["pass"])


# ---------------------------------------------------------------------------
# Agreement
# ---------------------------------------------------------------------------
def _rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def first_weight(model: torch.nn.Module) -> str:
    """Name of conv1's first weight (the input projection), whose gradient the
    model scope's agreement check compares."""
    return next(f"conv1.{n}" for n, _ in model.conv1.named_parameters() if n.endswith("weight"))


def _layer_outputs(layer, x: Tensor, edge_index, grad_out: Tensor):
    """``(output, input gradient)`` of one forward+backward."""
    xx = x.detach().clone().requires_grad_()
    out = layer(xx, edge_index)
    (grad,) = torch.autograd.grad(out, xx, grad_out)
    return out.detach(), grad


def _model_outputs(model, x: Tensor, edge_index, labels: Tensor):
    """``(loss, gradient of conv1's first weight)``."""
    weight = model.get_parameter(first_weight(model))
    loss = F.cross_entropy(model(x.detach(), edge_index), labels)
    (grad,) = torch.autograd.grad(loss, weight)
    return loss.detach(), grad


def check_agreement(modules: Dict[str, torch.nn.Module], graphs: Dict, x: Tensor,
                    target: Tensor, scope: str = "layer") -> Dict:
    """Norm-wise relative error of gatlib vs PyG.

    ``layer``: output and input gradient; ``model``: loss and gradient of conv1's
    first weight. float32: each error at most ``1e-4``. bfloat16/float16: both
    are compared with PyG in float32; gatlib's error may be at most twice PyG's
    plus ``1e-4``.
    """
    outputs = _layer_outputs if scope == "layer" else _model_outputs
    dtype = x.dtype
    out = {impl: outputs(modules[impl], x, graphs[impl], target) for impl in IMPLS}
    res: Dict = {"dtype": str(dtype).replace("torch.", "")}
    if scope == "model":
        res["weight"] = first_weight(modules["gatlib"])
    keys = _QUANTITIES[scope]
    if dtype not in (torch.float16, torch.bfloat16):
        for i, key in enumerate(keys):
            res[f"{key}_rel_err"] = _rel_err(out["gatlib"][i], out["pyg"][i])
            res[f"tol_{key}"] = _FP32_TOL
    else:
        ref_module = copy.deepcopy(modules["pyg"]).float()
        ref = outputs(ref_module, x.float(), graphs["pyg"],
                      target.float() if target.is_floating_point() else target)
        del ref_module
        for i, key in enumerate(keys):
            err_pyg = _rel_err(out["pyg"][i], ref[i])
            res[f"{key}_rel_err"] = _rel_err(out["gatlib"][i], ref[i])
            res[f"{key}_rel_err_pyg_vs_fp32"] = err_pyg
            res[f"tol_{key}"] = 2 * err_pyg + _LOWP_FLOOR
    ok = all(res[f"{key}_rel_err"] <= res[f"tol_{key}"] for key in keys)
    res["status"] = "ok" if ok else "mismatch"
    return res


# ---------------------------------------------------------------------------
# Summary and table
# ---------------------------------------------------------------------------
def summarize(measurements: List[Dict]) -> List[Dict]:
    """Per (layer, pass): speedup = PyG time / gatlib time, mem_ratio = gatlib / PyG memory."""
    by = {(m["layer"], m["impl"], m["pass"]): m for m in measurements}
    rows = []
    for layer, p in dict.fromkeys((m["layer"], m["pass"]) for m in measurements):
        a, b = by.get((layer, "pyg", p)), by.get((layer, "gatlib", p))
        if a is None or b is None:
            continue
        ta, tb = a["time"], b["time"]
        ma, mb = a.get("memory"), b.get("memory")
        speed = (ta["median_s"] / tb["median_s"]
                 if ta.get("median_s") and tb.get("median_s") else None)
        # Per-round ratios pair measurements taken seconds apart, under the same
        # load; their spread shows how far to trust the speedup on a shared machine.
        paired = speed is not None and len(ta["times_s"]) == len(tb["times_s"])
        rounds = ([x / y for x, y in zip(ta["times_s"], tb["times_s"], strict=True)]
                  if paired else [])
        mem = (mb["peak_extra_bytes"] / ma["peak_extra_bytes"]
               if ma and mb and ma.get("status") == mb.get("status") == "ok"
               and ma["peak_extra_bytes"] > 0 else None)
        rows.append({"layer": layer, "pass": p, "speedup": speed,
                     "speedup_rounds": rounds,
                     "speedup_paired_median": statistics.median(rounds) if rounds else None,
                     "mem_ratio": mem})
    return rows


def _fmt_ms(r: Dict) -> str:
    if r.get("status") != "ok":
        return r.get("status", "-")
    return f"{r['median_s'] * 1e3:,.1f}" if r.get("median_s") is not None else "-"


def _fmt_mib(r: Optional[Dict]) -> str:
    if not r:
        return "-"
    if r.get("status") != "ok":
        return r["status"]
    return f"{r['peak_extra_bytes'] / 2**20:,.1f}"


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _spread(row: Dict) -> str:
    r = row.get("speedup_rounds") or []
    return f"{min(r):.2f}-{max(r):.2f}" if r else "-"


TABLE_HEADERS = ["layer", "pass", "PyG ms", "gatlib ms", "gatlib 1st ms", "speedup", "rounds",
                 "PyG MiB", "gatlib MiB", "mem"]


def table_rows(report: Dict) -> List[List[str]]:
    """One row per (layer, pass) of a report, in the columns of :data:`TABLE_HEADERS`
    (also what ``benchmarks/compare_table.py`` renders)."""
    by = {(m["layer"], m["impl"], m["pass"]): m for m in report["measurements"]}
    rows = []
    for row in report["summary"]:
        a, b = by[(row["layer"], "pyg", row["pass"])], by[(row["layer"], "gatlib", row["pass"])]
        first = b.get("first_call_s")
        rows.append([LAYERS[row["layer"]], row["pass"], _fmt_ms(a["time"]), _fmt_ms(b["time"]),
                     "-" if first is None else f"{first * 1e3:,.1f}",
                     _ratio(row["speedup"]), _spread(row), _fmt_mib(a.get("memory")),
                     _fmt_mib(b.get("memory")), _ratio(row["mem_ratio"])])
    return rows


def render_table(report: Dict) -> str:
    """The plain-text report printed at the end of a run."""
    g, c, env = report["graph"], report["config"], report["environment"]
    kernels = "; ".join(f"{LAYERS[k]} {', '.join(v) or '-'}" for k, v in report["kernels"].items())
    what = ("one layer" if c["scope"] == "layer" else
            f"training step of a 2-layer model ({c['classes']} classes, Adam)")
    lines = [
        f"graph {g['name']}: N={g['num_nodes']:,}, E={g['num_edges']:,} "
        f"(undirected, no self-loops), E+N={g['num_edges_with_self_loops']:,} attended, "
        f"F={g['num_features']}",
        f"{what}, H={c['heads']} C={c['channels']} {c['dtype']} on {env['device_name']} "
        f"(threads={env['num_threads']}); gatlib backend={c['backend']}, "
        f"graph input {c['graph_input']}",
        f"gatlib kernels: {kernels or '-'}",
        *([("gatlib plan (built once, an input like PyG's edge_index; not in 'gatlib MiB'): "
            + "; ".join(f"{LAYERS[k]} {v / 2**20:,.1f} MiB"
                        for k, v in report.get("plan_bytes", {}).items()))]
          if report.get("plan_bytes") else []),
        "speedup = PyG time / gatlib time (medians; rounds: range of the per-round ratios); "
        "gatlib 1st = its first call on a freshly built graph input; "
        "mem = gatlib peak extra / PyG peak extra",
        "",
    ]
    return "\n".join(lines) + format_table(TABLE_HEADERS, table_rows(report), align="<<" + ">" * 8)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------
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
        "dtype": args.dtype, "backend": args.backend,
        "repeats": args.repeats, "block_s": args.block_seconds, "warmup": max(1, args.warmup),
        "memory": args.memory, "passes": passes,
        "seed": args.seed, "threads": torch.get_num_threads(),
        "data_dir": str(resolve_data_dir(args.data_dir)),
        "mem_budget_bytes": (int(args.mem_budget_gb * 2**30) if args.mem_budget_gb else None),
    }


def run(args: argparse.Namespace) -> int:
    """Run a comparison (see the module docstring). Returns the exit status:
    0 done, 1 an implementation disagreed with PyG or failed with an error
    other than OOM, 2 bad arguments."""
    if getattr(args, "_child", None):
        return measure.child_main(args._child)
    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"gatlib compare: error: {exc}", file=sys.stderr)
        return 2
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
    ei_loops = _with_self_loops(ei, N)
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
        "parent_mem_budget_bytes": {},
    }
    _log(f"graph {graph.name}: N={N:,} E={ei.size(1):,} (+{N:,} self-loops) F={F_in}; "
         f"scope {cfg['scope']}, H={cfg['heads']} C={cfg['channels']} {cfg['dtype']} {device}, "
         f"gatlib backend {cfg['backend']}, graph input {cfg['graph_input']}")
    status = 0
    with tempfile.TemporaryDirectory(prefix="gatlib-compare-") as tmp:
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
    H, C, scope = cfg["heads"], cfg["channels"], cfg["scope"]
    name = LAYERS[layer]
    modules = build_pair(layer, F_in, H, C, cfg["backend"], device, dtype, cfg["seed"], scope,
                         cfg["classes"])
    edge_index = layer_edge_index(layer, ei, ei_loops)
    graphs = {impl: graph_input(impl, edge_index, N, cfg["graph_input"]) for impl in IMPLS}
    target = (_grad_out(N, H * C, dtype, device, cfg["seed"]) if scope == "layer"
              else _labels(N, cfg["classes"], device, cfg["seed"]))
    passes = {(impl, p): _make_pass(modules[impl], x, graphs[impl], target, p)
              for impl in IMPLS for p in cfg["passes"]}
    rc = 0

    # 1. Memory first: on CPU it tells which implementation fits before this process tries.
    memory: Dict = {}
    if cfg["memory"]:
        # On CUDA the calls are measured in this process, and a training step moves the
        # weights: the agreement check needs them as built.
        initial = ({impl: copy.deepcopy(m.state_dict()) for impl, m in modules.items()}
                   if scope == "model" and device.type == "cuda" else None)
        for (impl, p), fn in passes.items():
            _log(f"{name}: peak memory, {impl}, {p}")
            if device.type == "cuda":
                memory[impl, p] = measure.peak_cuda(fn, device)
            else:
                spec = {"builder": "gatlib.bench.compare:measured_call",
                        "inputs": str(workdir / "inputs.pt"),
                        "layer": layer, "impl": impl, "pass": p, "scope": scope,
                        "heads": H, "channels": C, "classes": cfg["classes"],
                        "dtype": cfg["dtype"], "backend": cfg["backend"],
                        "graph_input": cfg["graph_input"], "seed": cfg["seed"],
                        "threads": cfg["threads"], "mem_budget_bytes": cfg["mem_budget_bytes"]}
                memory[impl, p] = measure.peak_rss_child(spec, workdir)
            if memory[impl, p]["status"] == "error":
                rc = 1
                _log(f"  error: {memory[impl, p]['error']}")
        if initial is not None:
            for impl, module in modules.items():
                module.load_state_dict(initial[impl])
            del initial
    # On CPU, running what did not fit in a child would take this process down.
    too_big = ({k for k, m in memory.items() if m["status"] == "OOM"}
               if device.type == "cpu" else set())

    # 2. Agreement, unless one side does not fit; it records which kernels gatlib ran.
    if any(m["status"] == "OOM" for m in memory.values()):
        check = {"status": "skipped", "reason": "an implementation ran out of memory"}
    else:
        _log(f"{name}: checking agreement with torch_geometric.nn.{name}")
        try:
            with gatlib.record_kernels() as log:
                check = check_agreement(modules, graphs, x, target, scope)
            report["kernels"][layer] = list(dict.fromkeys(log))
            if isinstance(graphs["gatlib"], gatlib.GraphPlan):
                # what the plan holds once used: part of gatlib's inputs in every
                # measurement below, as edge_index is part of PyG's
                report["plan_bytes"][layer] = graphs["gatlib"].nbytes
        except Exception as exc:  # noqa: BLE001
            check = {**measure.failure(exc),
                     "status": "skipped" if measure.is_oom(exc) else "error"}
            measure.release(device)
    report["checks"][layer] = check
    if check["status"] in ("mismatch", "error"):
        if check["status"] == "mismatch":
            detail = ", ".join(f"{key} rel. error {check[f'{key}_rel_err']:.2e} "
                               f"(tol {check[f'tol_{key}']:.1e})" for key in _QUANTITIES[scope])
        else:
            detail = check["error"]
        print(f"gatlib compare: gatlib.{name}(backend={cfg['backend']!r}) does not agree with "
              f"torch_geometric.nn.{name} on {report['graph']['name']} "
              f"({cfg['dtype']}, {device}, scope {scope}): {detail}. Not timing it.",
              file=sys.stderr)
        return 1

    # 3. Time: gatlib's first call on a freshly built graph input, then the interleaved rounds.
    first_pass = TRAIN_STEP if scope == "model" else "forward+backward"
    first = None
    if first_pass in cfg["passes"] and ("gatlib", first_pass) not in too_big:
        def first_call(module=modules["gatlib"]):  # building the graph input is part of its cost
            fresh = graph_input("gatlib", edge_index, N, cfg["graph_input"])
            return _make_pass(module, x, fresh, target, first_pass)()

        first = measure.time_once(first_call, device)
        passes["gatlib", first_pass].clear()
        if first["status"] == "error":
            rc = 1
            _log(f"  gatlib first call error: {first['error']}")
    for p in cfg["passes"]:
        fns = {impl: passes[impl, p] for impl in IMPLS if (impl, p) not in too_big}
        _log(f"{name}: timing {p} ({', '.join(fns) or 'nothing fits'}), {cfg['repeats']} rounds")
        times = (measure.time_interleaved(fns, device, cfg["repeats"], cfg["warmup"],
                                          cfg["block_s"]) if fns else {})
        for impl in IMPLS:
            t = times.get(impl) or {"status": "OOM", "error": "not run in this process: out of "
                                    "memory in its fresh-process memory measurement"}
            if t["status"] == "error":
                rc = 1
                _log(f"  {impl} error: {t['error']}")
            entry = {"layer": layer, "impl": impl, "pass": p, "time": t}
            if (impl, p) in memory:
                entry["memory"] = memory[impl, p]
            if impl == "gatlib" and p == first_pass and first is not None:
                entry["first_call_s"] = first.get("seconds")
                if first["status"] != "ok":
                    entry["first_call_failure"] = first
            report["measurements"].append(entry)
    del modules, passes, graphs
    measure.release(device)
    return rc


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m gatlib.bench.compare``: same options as ``gatlib compare``."""
    parser = argparse.ArgumentParser(
        prog="python -m gatlib.bench.compare",
        description="Compare gatlib's GATConv/GATv2Conv/TransformerConv with PyG's: "
                    "agreement, time and peak memory, of a layer or of a 2-layer model's "
                    "training step.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
