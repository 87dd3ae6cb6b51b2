r"""Count the kernel launches of a layer call and of a training step, without a GPU.

On a small graph (Cora: 2,708 nodes) a GPU step is launch-bound: its time is
the host's, per launched kernel. This module counts what a CUDA run would
launch, on CPU tensors:

* **Triton launches**: the layers run with ``backend="triton"`` on CPU tensors
  through Triton's real launch path under the stand-in NVIDIA driver of
  :mod:`tools.triton_compile`. Its ``jit_cache_hook`` counts every
  launch attempt and skips the compile and the launch — so nothing is ever
  cached and the hook sees each launch, not each specialisation. The kernels'
  configs are the GPU's (those of the compiled kernels, not the interpreter's),
  so the number of launches per call is what a GPU gets; the grid size is the
  interpreter's (it does not change the number of launches).
* **ATen ops**, through a ``TorchDispatchMode`` that also looks inside gatlib's
  operators (the Triton wrapper's host code, the plan's layout ops), each
  classified by the rule of
  :func:`classify`: an op **launches** a device kernel when it writes device
  memory — an in-place or ``out=`` op, or one whose output is fresh storage
  other than a bare allocation; it is **free** when it only makes views or
  aliases (``view``, ``detach``, ``to`` of a tensor already in that dtype, a
  ``contiguous`` tensor's ``contiguous``), only allocates (``empty``,
  ``empty_strided``, ``new_empty``, ``empty_like``: the CUDA caching allocator
  launches nothing, whereas ``zeros`` launches a fill), produces no tensor
  (sizes, ``promote_types``), or has nothing but empty outputs (a CUDA
  TensorIterator over no elements launches nothing). One ATen op is counted as
  one launch: a lower bound for the few ops that launch several kernels on
  CUDA (sort, cumsum and nonzero use CUB's multi-kernel passes). A ``_foreach_``
  op is one launch (CUDA's multi-tensor apply packs a small model's tensors
  into one kernel).
* **Host ops**: torch.optim keeps Adam's step counts on the CPU (unless
  ``capturable`` or ``fused``), so on CUDA the ops on them — ``_foreach_add_``
  of the counts and the per-parameter ``item()`` that reads them — run on the
  host and launch nothing. The step counts are declared host tensors; an op all
  of whose tensors are host tensors or 0-dim constants is a host op.
* **Syncs**: an op that reads a device value back to the host (``item()``,
  ``nonzero``, boolean-mask indexing, ``unique``, ...) — a CUDA stream sync,
  which a CUDA graph cannot capture. Counted, not refused. ``Tensor.tolist`` and
  ``numpy``, which a CPU tensor serves without an ATen op, are counted too. The
  kernels' outputs are never written under the skip hook (they hold whatever
  ``torch.empty`` gave), so a value read is meaningless here, but it runs and
  is counted.

Code that branches on the device type takes its CPU branch here. In the counted
calls that is only the index check of a new ``[2, E]`` tensor
(``_validate._check_range``): two ``item()`` on CPU, a ``stack`` and one read on
CUDA — the ``gatlib_tensor`` rows count one launch fewer and one sync more than
a GPU run.

The workload (:func:`measure`): one layer call, forward and backward (the
input's and all weights' gradients, as ``gatlib compare --scope layer``), and a
warmed training step of the 2-layer model of ``gatlib compare --scope model``
(conv1 -> ELU -> conv2, cross-entropy, Adam, lr 0.01) on a Cora-sized
synthetic graph (:func:`cora_like`), gatlib's three layers with the Triton
backend and a :class:`~gatlib.GraphPlan` (``gatlib``, as ``gatlib compare``) or
the ``[2, E]`` tensor (``gatlib_tensor``: a new plan, layout and schedule in
every call), PyG's three layers with the ``[2, E]`` tensor (the Transformer
layers get the graph with self-loops, so all attend over the same edges). Every
counted call runs
once uncounted first (the plan's schedule, lazy modules and Adam's state are
built then). Adam runs with ``foreach=True``: on CUDA tensors that is its
default (torch.optim's ``_default_to_fused_or_foreach``), on CPU tensors it is
not, and the per-parameter loop it would take instead is a different op
sequence.

``python -m tools.launches --json benchmarks/results/launches_cpu_standin.json``
writes every count; ``tests/test_launches.py`` holds them to a budget.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

LAYERS = ("gat", "gatv2", "transformer")
# gatlib given a GraphPlan (built once, as gatlib compare does), gatlib given the
# [2, E] tensor (as PyG's layers are: a new plan, layout and schedule in every
# call), and PyG
LIBRARIES = ("gatlib", "gatlib_tensor", "pyg")
# (heads, channels per head) of the counted layer calls: the GPU target
# configuration (gatlib compare's CUDA default) and Cora's GAT (8 heads of 8).
LAYER_CONFIGS = ((3, 256), (8, 8))
STEP_CONFIG = (3, 256)  # the 2-layer step of the H100 measurements
CORA = {"num_nodes": 2708, "num_edges": 10556, "num_features": 1433, "num_classes": 7}
LR = 0.01

# Ops that read a device value back to the host. Boolean-mask indexing is one
# too (it runs nonzero inside): see _reads_back.
SYNCS = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal",
                   "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique",
                   "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
                   "aten::bincount", "aten::allclose"})
# Bare allocations: the caching allocator hands out memory without a kernel (and
# resize_/set_ only re-point a tensor at memory, although their schemas write it).
ALLOCATIONS = frozenset({"aten::empty", "aten::empty_strided", "aten::new_empty",
                         "aten::new_empty_strided", "aten::empty_like", "aten::resize_",
                         "aten::set_"})
# gatlib's operators (the Triton kernels' and the plan's layouts): their Python
# implementation, the same on every device, runs under the mode, so that their
# own ATen ops are counted (the launches inside the Triton ones are Triton's).
_LOOK_INSIDE = "gatlib::"


@dataclass
class Tally:
    """What one counted call did: Triton launches per kernel, and ATen ops per
    name in the four classes of :func:`classify` (``launch``, ``free``,
    ``host``) plus the value reads (``syncs``, also in their class)."""

    triton: collections.Counter = field(default_factory=collections.Counter)
    launch: collections.Counter = field(default_factory=collections.Counter)
    free: collections.Counter = field(default_factory=collections.Counter)
    host: collections.Counter = field(default_factory=collections.Counter)
    syncs: collections.Counter = field(default_factory=collections.Counter)
    operators: collections.Counter = field(default_factory=collections.Counter)

    @property
    def triton_launches(self) -> int:
        return sum(self.triton.values())

    @property
    def aten_launches(self) -> int:
        return sum(self.launch.values())

    @property
    def launches(self) -> int:
        """Kernels a CUDA run launches: Triton's and the ATen ops that write device memory."""
        return self.triton_launches + self.aten_launches

    def as_dict(self) -> Dict:
        def counts(c):
            return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))

        return {"launches": self.launches, "triton_launches": self.triton_launches,
                "aten_launches": self.aten_launches, "free_ops": sum(self.free.values()),
                "host_ops": sum(self.host.values()), "syncs": sum(self.syncs.values()),
                "triton": counts(self.triton), "launch_ops": counts(self.launch),
                "free": counts(self.free), "host": counts(self.host), "sync_ops": counts(self.syncs),
                "operators": counts(self.operators)}


def _tensors(tree) -> List[Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _reads_back(name: str, args, kwargs) -> bool:
    if name in SYNCS:
        return True
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if name == "aten::repeat_interleave":  # the output size, unless given
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    return False


def classify(func, args, kwargs, out, host: WeakIdKeyDictionary) -> str:
    """``"launch"``, ``"free"`` or ``"host"`` for one ATen op (the module
    docstring gives the rule); ``host`` holds the host tensors, to which a host
    op's outputs are added."""
    ins = _tensors((args, kwargs))
    outs = _tensors(out)
    if any(t in host for t in ins) and all(t in host or t.dim() == 0 for t in ins):
        for t in outs:
            host[t] = True
        return "host"
    name = func._schema.name
    if name in ALLOCATIONS:
        return "free"
    # (positional arguments are a prefix of the schema's; the rest came as keywords)
    written = [t for a, t in zip(func._schema.arguments, args, strict=False)
               if a.alias_info is not None and a.alias_info.is_write]
    written += [kwargs[a.name] for a in func._schema.arguments
                if a.alias_info is not None and a.alias_info.is_write and a.name in kwargs]
    written = _tensors(written)
    if written:  # in place or out=
        return "launch" if any(t.numel() for t in written) else "free"
    fresh = [t for t in outs if t.numel() and _storage(t) not in {_storage(i) for i in ins}]
    return "launch" if fresh else "free"


class _Recorder(TorchDispatchMode):
    def __init__(self, tally: Tally, host: Iterable[Tensor] = ()):
        super().__init__()
        self.tally = tally
        self.host = WeakIdKeyDictionary()
        for t in host:
            self.host[t] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith(_LOOK_INSIDE):
            from torch._library.custom_ops import OPDEFS

            if name in OPDEFS:
                self.tally.operators[name] += 1
                with self:
                    return OPDEFS[name]._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        kind = classify(func, args, kwargs, out, self.host)
        label = str(func)
        getattr(self.tally, kind)[label] += 1
        if kind != "host" and _reads_back(name, args, kwargs):
            self.tally.syncs[label] += 1
        return out


@contextlib.contextmanager
def triton_on_cpu(tally: Tally):
    """Inside: gatlib's Triton backend takes CPU tensors and runs its host code,
    with every launch counted into ``tally.triton`` and skipped.

    The Triton backend admits CPU tensors only under Triton's interpreter;
    :func:`tools.internals.triton_admits_cpu_tensors` lifts that for the block
    — the kernels are Triton's compiled ones, bound and specialised by its real
    launcher against a stand-in sm_90 driver
    (:func:`tools.triton_compile.stand_in_driver`)."""
    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        tally.triton[fn.name] += 1
        return True  # skip the compile, and so the launch: nothing is cached

    with _launch_path_on_cpu(hook, "counting Triton launches"):
        yield


@contextlib.contextmanager
def _launch_path_on_cpu(hook, what: str):
    """Inside: Triton's real launch path against the stand-in driver, with CPU tensors
    admitted and ``hook`` as Triton's ``jit_cache_hook`` (called where a launch would
    compile; returning true skips that compile and launch)."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # (read when triton was first imported)
        raise RuntimeError(f"{what} needs Triton's launch path, which TRITON_INTERPRET=1 "
                           "replaces: unset it")
    from triton import knobs

    from tools import internals
    from tools.triton_compile import stand_in_driver

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        with stand_in_driver(), internals.triton_admits_cpu_tensors():
            yield
    finally:
        knobs.runtime.jit_cache_hook = previous


# Value reads that a CPU tensor serves without dispatching an ATen op (on CUDA they
# copy to the host: a sync, which the mode would not see on CPU)
_UNDISPATCHED_READS = ("tolist", "numpy")


@contextlib.contextmanager
def _reads_counted(recorder: "_Recorder"):
    """Inside: ``Tensor.tolist``/``numpy`` of a tensor that is not a host tensor
    count as syncs of ``recorder``."""
    for name in _UNDISPATCHED_READS:
        assert name not in torch.Tensor.__dict__  # (torch's own: on TensorBase)
        real = getattr(torch.Tensor, name)

        def read(t, *args, _real=real, _name=name, **kwargs):
            if t not in recorder.host:
                recorder.tally.syncs[f"Tensor.{_name}"] += 1
            return _real(t, *args, **kwargs)

        setattr(torch.Tensor, name, read)
    try:
        yield
    finally:
        for name in _UNDISPATCHED_READS:
            delattr(torch.Tensor, name)


def count(fn: Callable[[], object], host: Iterable[Tensor] = ()) -> Tally:
    """The launches and ops of ``fn()`` (see the module docstring); ``host``: the
    tensors that a CUDA run keeps on the host (Adam's step counts)."""
    tally = Tally()
    recorder = _Recorder(tally, host)
    with triton_on_cpu(tally), _reads_counted(recorder), recorder:
        fn()
    return tally


class _StandInBinary:
    """What Triton's kernel cache holds for a specialisation under
    :func:`triton_warm_on_cpu`: a compiled kernel's launch interface (Triton's
    ``JITFunction.run`` calls ``launch_metadata`` and ``run``) that launches
    nothing and counts its launches into ``launched``."""

    function = packed_metadata = None

    def __init__(self, name: str, launched: collections.Counter):
        self.name, self.launched = name, launched

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        self.launched[self.name] += 1


@contextlib.contextmanager
def triton_warm_on_cpu(launched: collections.Counter,
                       compiled: Optional[collections.Counter] = None):
    """Inside: as :func:`triton_on_cpu`, but where that skips every launch at the
    compile its specialisation would need, here the first launch of each
    specialisation puts a :class:`_StandInBinary` into Triton's kernel cache and
    every later one takes Triton's cached path, as a warmed GPU run does — its
    argument binding and specialisation, the cache key, the binary's launch call —
    and is counted into ``launched``; each specialisation placed (what a GPU would
    compile) is counted into ``compiled``. The stand-ins leave the cache on exit."""
    from triton.runtime import driver

    placed = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        cache = fn.jit_function.device_caches[driver.active.get_current_device()][0]
        cache[key] = _StandInBinary(fn.name, launched)
        placed.append((cache, key))
        if compiled is not None:
            compiled[fn.name] += 1
        return True  # this launch is skipped; the next finds the stand-in

    try:
        with _launch_path_on_cpu(hook, "timing Triton's launch path"):
            yield
    finally:
        for cache, key in placed:
            if isinstance(cache.get(key), _StandInBinary):
                del cache[key]


# ---------------------------------------------------------------------------
# The workload
# ---------------------------------------------------------------------------
@dataclass
class Graph:
    x: Tensor  # [N, F]
    edge_index: Tensor  # [2, E] undirected, no self-loops
    edge_index_loops: Tensor  # with one self-loop per node
    num_classes: int
    source: str


def cora_like(seed: int = 0) -> Graph:
    """A synthetic graph of Cora's size (:mod:`gatlib.bench.synthetic`, Chung-Lu
    power-law degrees, made undirected), its directed edge count chosen so that
    the undirected graph has about Cora's 10,556 edges; Cora's 1,433 features
    and 7 classes. (Launch counts depend on the graph only through whether it
    can have split rows: any graph of more than ``tools.internals.TRITON_SPLIT`` edges.)"""
    from gatlib.bench import synthetic
    from gatlib.bench.compare import with_self_loops

    n, e, f = CORA["num_nodes"], CORA["num_edges"], CORA["num_features"]
    spec = synthetic.GraphSpec("cora-like", n, e // 2, f)
    data = synthetic.synthetic_graph(spec, seed=seed)
    return Graph(data.x, data.edge_index, with_self_loops(data.edge_index, n), CORA["num_classes"],
                 f"gatlib.bench.synthetic {spec}")


def _modules(layer: str, graph: Graph, heads: int, channels: int, scope: str) -> Dict:
    from gatlib.bench.compare import build_pair

    return build_pair(layer, graph.x.size(1), heads, channels, "triton", torch.device("cpu"),
                      torch.float32, 0, scope, graph.num_classes)


def _graph_input(lib: str, layer: str, graph: Graph):
    import gatlib

    from gatlib.bench.compare import layer_edge_index

    ei = layer_edge_index(layer, graph.edge_index, graph.edge_index_loops)
    return gatlib.GraphPlan(ei, num_nodes=graph.x.size(0)) if lib == "gatlib" else ei


def _module(lib: str, layer: str, graph: Graph, heads: int, channels: int, scope: str):
    return _modules(layer, graph, heads, channels, scope)["pyg" if lib == "pyg" else "gatlib"]


def layer_call(lib: str, layer: str, graph: Graph, heads: int, channels: int) -> Tally:
    """One layer call, forward and backward (``x`` and all weights get gradients),
    counted after one uncounted call."""
    module = _module(lib, layer, graph, heads, channels, "layer")
    x = graph.x.clone().requires_grad_()
    ei = _graph_input(lib, layer, graph)
    grad = torch.randn(x.size(0), heads * channels, generator=torch.Generator().manual_seed(7))

    def call():
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x, ei).backward(grad)

    with triton_on_cpu(Tally()):
        call()
    return count(call)


def _training_step(lib: str, layer: str, graph: Graph, heads: int, channels: int):
    """``(step, opt)``: one step of the 2-layer model — zero_grad, forward,
    cross-entropy, backward, Adam(foreach=True) — and its optimizer."""
    model = _module(lib, layer, graph, heads, channels, "model")
    ei = _graph_input(lib, layer, graph)
    labels = torch.randint(graph.num_classes, (graph.x.size(0),),
                           generator=torch.Generator().manual_seed(11))
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(graph.x, ei), labels).backward()
        opt.step()

    return step, opt


def training_step(lib: str, layer: str, graph: Graph, heads: int, channels: int) -> Tally:
    """One step of the 2-layer model (:func:`_training_step`), counted after one
    uncounted step."""
    step, opt = _training_step(lib, layer, graph, heads, channels)
    with triton_on_cpu(Tally()):
        step()
    steps = [s["step"] for s in opt.state.values()]
    return count(step, host=steps)


# (heads, channels per head, input features) of the host-time steps: narrow, so that
# the CPU doing the ATen ops' own work adds little to the host's
HOST_CONFIG = (3, 8, 16)


def host_time(lib: str, layer: str, graph: Graph, calls: int = 50, repeats: int = 5) -> Dict:
    """Host time of a warmed 2-layer training step (as :func:`training_step`'s) with
    no kernel run: gatlib's Triton launches take Triton's cached path to a stand-in
    binary (:func:`triton_warm_on_cpu`), the ATen ops run on CPU tensors of
    :data:`HOST_CONFIG`'s narrow widths (their work is small, not nothing: PyG's
    rows, all ATen ops, are an upper bound of its host time; ``gatlib_tensor``'s
    include the CPU sorting each call's new plan, a GPU's work). ``median_ms`` and
    ``min_ms`` of ``repeats`` blocks of ``calls`` steps; ``triton_launches`` per step,
    every one through the cached path."""
    heads, channels, features = HOST_CONFIG
    graph = Graph(graph.x[:, :features].contiguous(), graph.edge_index, graph.edge_index_loops,
                  graph.num_classes, graph.source)
    step, _ = _training_step(lib, layer, graph, heads, channels)
    launched: collections.Counter = collections.Counter()
    with triton_warm_on_cpu(launched):
        for _ in range(3):  # the plan's schedule, Adam's state, the stand-ins in the cache
            step()
        launched.clear()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                step()
            times.append((time.perf_counter() - start) / calls * 1e3)
    return {"library": lib, "layer": layer, "median_ms": round(statistics.median(times), 3),
            "min_ms": round(min(times), 3), "calls": calls, "repeats": repeats,
            "triton_launches": sum(launched.values()) / (calls * repeats)}


def measure(layers: Sequence[str] = LAYERS, libraries: Sequence[str] = LIBRARIES,
            layer_configs: Sequence = LAYER_CONFIGS, step: bool = True, seed: int = 0,
            progress: Optional[Callable[[str], None]] = None) -> Dict:
    """Every count: ``{"graph": ..., "layer": [rows], "step": [rows]}``, a row per
    (library, layer, config) with :meth:`Tally.as_dict`'s fields."""
    graph = cora_like(seed)
    out: Dict = {"graph": {"source": graph.source, "num_nodes": graph.x.size(0),
                           "num_edges": graph.edge_index.size(1), "num_features": graph.x.size(1),
                           "num_classes": graph.num_classes},
                 "layer": [], "step": []}
    runs = [("layer", lib, layer, h, c) for layer in layers for h, c in layer_configs
            for lib in libraries]
    if step:
        runs += [("step", lib, layer, *STEP_CONFIG) for layer in layers for lib in libraries]
    for scope, lib, layer, h, c in runs:
        start = time.perf_counter()
        fn = layer_call if scope == "layer" else training_step
        tally = fn(lib, layer, graph, h, c)
        out[scope].append({"library": lib, "layer": layer, "heads": h, "channels": c,
                           **tally.as_dict()})
        if progress is not None:
            progress(f"{scope} {lib} {layer} H={h} C={c}: {tally.launches} launches "
                     f"({tally.triton_launches} Triton + {tally.aten_launches} ATen), "
                     f"{sum(tally.syncs.values())} syncs ({time.perf_counter() - start:.1f} s)")
    return out


# ---------------------------------------------------------------------------
# Report and CLI
# ---------------------------------------------------------------------------
HEADERS = ["scope", "layer", "H", "C", "gatlib: launches (Triton + ATen)", "syncs",
           "gatlib, tensor input: launches", "syncs", "PyG: launches", "syncs"]


def table_rows(report: Dict) -> List[List[str]]:
    rows = []
    for scope in ("layer", "step"):
        by = {(r["library"], r["layer"], r["heads"], r["channels"]): r for r in report[scope]}
        for (lib, layer, h, c), r in by.items():
            if lib != "gatlib":
                continue
            row = [scope, layer, str(h), str(c),
                   f"{r['launches']} ({r['triton_launches']} + {r['aten_launches']})", str(r["syncs"])]
            for other in ("gatlib_tensor", "pyg"):
                o = by.get((other, layer, h, c))
                row += [str(o["launches"]), str(o["syncs"])] if o else ["-", "-"]
            rows.append(row)
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.launches",
        description="Count the kernel launches (Triton and ATen) of a layer call and of a "
                    "Cora-sized training step, gatlib's and PyG's, on CPU (no GPU needed).")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every count here")
    parser.add_argument("--layers", default=",".join(LAYERS),
                        help=f"comma-separated, of {', '.join(LAYERS)} (default: all)")
    parser.add_argument("--libraries", default=",".join(LIBRARIES),
                        help=f"comma-separated, of {', '.join(LIBRARIES)} (default: all)")
    parser.add_argument("--no-step", action="store_true", help="skip the training steps")
    parser.add_argument("--ops", action="store_true",
                        help="also print every launching op of gatlib's rows")
    parser.add_argument("--host-time", action="store_true",
                        help="instead of counting: time each library's warmed training step on "
                             "the host, no kernel run (gatlib's Triton launches through "
                             "Triton's cached path; see host_time)")
    parser.add_argument("--calls", type=int, default=50, help="--host-time: steps per block")
    parser.add_argument("--repeats", type=int, default=5, help="--host-time: blocks")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from gatlib.bench.report import command_line, environment, format_table, write_json

    parser = _parser()
    args = parser.parse_args(argv)
    layers = [name for name in args.layers.split(",") if name]
    if not layers or any(name not in LAYERS for name in layers):
        parser.error(f"--layers: choose from {', '.join(LAYERS)}; got {args.layers!r}")
    libraries = [name for name in args.libraries.split(",") if name]
    if not libraries or any(name not in LIBRARIES for name in libraries):
        parser.error(f"--libraries: choose from {', '.join(LIBRARIES)}; got {args.libraries!r}")
    if args.host_time:
        return _main_host_time(args, layers, libraries)
    start = time.perf_counter()
    counts = measure(layers, libraries, step=not args.no_step,
                     progress=lambda line: print(f"[launches] {line}", file=sys.stderr, flush=True))
    report = {"schema": "gatlib.launches/1", "command": command_line(),
              "environment": environment("cpu"), "seconds": round(time.perf_counter() - start, 1),
              "adam": {"lr": LR, "foreach": True}, "step_config": list(STEP_CONFIG), **counts}
    print(format_table(HEADERS, table_rows(report), align="<<>>>>>>>>"))
    if args.ops:
        for scope in ("layer", "step"):
            for r in report[scope]:
                if r["library"] == "gatlib":
                    print(f"\n{scope} {r['layer']} H={r['heads']} C={r['channels']}: "
                          f"triton {r['triton']}\n  launch {r['launch_ops']}\n  free {r['free']}"
                          + (f"\n  syncs {r['sync_ops']}" if r["syncs"] else ""))
    if args.json:
        write_json(args.json, report)
    return 0


def _main_host_time(args, layers: Sequence[str], libraries: Sequence[str]) -> int:
    from gatlib.bench.report import command_line, environment, format_table, write_json

    if args.calls < 1 or args.repeats < 1:
        raise ValueError(f"--calls and --repeats must be >= 1; got {args.calls}, {args.repeats}")
    start = time.perf_counter()
    graph = cora_like()
    rows = []
    for layer in layers:
        for lib in libraries:
            row = host_time(lib, layer, graph, args.calls, args.repeats)
            rows.append(row)
            print(f"[launches] host time {lib} {layer}: {row['median_ms']:.3f} ms per step "
                  f"({row['triton_launches']:g} Triton launches)", file=sys.stderr, flush=True)
    heads, channels, features = HOST_CONFIG
    print(format_table(["layer", "library", "host ms per step (median)", "min", "Triton launches"],
                       [[r["layer"], r["library"], f"{r['median_ms']:.3f}", f"{r['min_ms']:.3f}",
                         f"{r['triton_launches']:g}"] for r in rows], align="<<>>>"))
    if args.json:
        write_json(args.json, {
            "schema": "gatlib.host_time/1", "command": command_line(),
            "environment": environment("cpu"), "seconds": round(time.perf_counter() - start, 1),
            "graph": {"source": graph.source, "num_nodes": graph.x.size(0),
                      "num_edges": graph.edge_index.size(1), "num_features": features,
                      "num_classes": graph.num_classes},
            "heads": heads, "channels": channels, "torch_threads": torch.get_num_threads(),
            "adam": {"lr": LR, "foreach": True}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
