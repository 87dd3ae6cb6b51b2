"""The bandwidth floor of one layer pass or training step: the bytes (and GEMM flops) a fused
implementation must move, set against each measured time (issue 29, item 5).

Per kernel the floor is max(bytes / bandwidth, flops / GEMM peak), summed over a pass's kernels, in two
variants (lo: gathered rows read once; hi: once per edge). docs/benchmarks.md ("Against the bandwidth floor")
lists every term, tensor by tensor.
"""
from __future__ import annotations

import dataclasses
import re
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

LAYERS = ("gat", "gatv2", "transformer")
PASSES = ("forward", "forward+backward")
STEP = "train_step"  # gatlib compare --scope model


# Bytes and flops of a pass
@dataclass(frozen=True)
class Shape:
    """Sizes of one layer call, named as in docs/benchmarks.md's floor terms (``num_src == num_dst``: one
    ``x``; ``input_grad``: the backward computes ``grad x``)."""

    num_src: int
    num_dst: int
    num_edges: int
    in_channels: int
    heads: int
    channels: int
    dtype_bytes: int = 4
    edge_dim: Optional[int] = None
    input_grad: bool = True

    @property
    def acc_bytes(self) -> int:  # float32 accumulation, float64 for float64 inputs
        return 8 if self.dtype_bytes == 8 else 4

    @property
    def index_bytes(self) -> int:  # int32 wherever every index fits, as gatlib's plans
        return 4 if max(self.num_edges, self.num_src, self.num_dst) < 2**31 - 1 else 8


@dataclass(frozen=True)
class Term:
    """One tensor moved by one kernel: ``lo`` and ``hi`` bytes (equal unless gathered)."""

    tensor: str
    op: str  # "read", "write" or "gather"
    lo: int
    hi: int


@dataclass
class Kernel:
    """One kernel of a pass: what it moves and its GEMM flops."""

    name: str
    terms: List[Term] = field(default_factory=list)
    flops: int = 0

    @property
    def bytes_lo(self) -> int:
        return sum(t.lo for t in self.terms)

    @property
    def bytes_hi(self) -> int:
        return sum(t.hi for t in self.terms)

    def read(self, tensor: str, n: int) -> "Kernel":
        self.terms.append(Term(tensor, "read", n, n))
        return self

    def write(self, tensor: str, n: int) -> "Kernel":
        self.terms.append(Term(tensor, "write", n, n))
        return self

    def gather(self, tensor: str, rows: int, edges: int, row_bytes: int) -> "Kernel":
        """``rows`` distinct rows of ``row_bytes`` each, read along ``edges`` edges."""
        self.terms.append(Term(tensor, "gather", rows * row_bytes, edges * row_bytes))
        return self


@dataclass
class Floor:
    """The kernels of one (layer, pass) and their totals."""

    layer: str
    pass_: str
    shape: Shape
    kernels: List[Kernel]

    @property
    def bytes_lo(self) -> int:
        return sum(k.bytes_lo for k in self.kernels)

    @property
    def bytes_hi(self) -> int:
        return sum(k.bytes_hi for k in self.kernels)

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    def seconds(self, bandwidth: float, flops_per_s: Optional[float] = None
                ) -> Tuple[float, float]:
        """``(lo, hi)`` time floors at ``bandwidth`` bytes/s and a GEMM peak of
        ``flops_per_s`` (``None``: bytes only)."""
        def t(k: Kernel, nbytes: int) -> float:
            compute = k.flops / flops_per_s if flops_per_s else 0.0
            return max(nbytes / bandwidth, compute)

        return (sum(t(k, k.bytes_lo) for k in self.kernels),
                sum(t(k, k.bytes_hi) for k in self.kernels))


def _projection(name: str, rows: int, F: int, outputs: Sequence[Tuple[str, int]], bias: bool,
                s: int, backward: bool, input_grad: bool, x: str = "x") -> Kernel:
    """A GEMM ``x [rows, F] @ W [F, K]`` (+ bias) split into ``outputs`` of the given
    widths, or its backward (``grad W``, ``grad b``, ``grad x`` from the outputs' gradients)."""
    K = sum(w for _, w in outputs)
    k = Kernel(name)
    if not backward:
        k.read(f"{x} [{rows}, {F}]", rows * F * s).read(f"W [{F}, {K}]", F * K * s)
        if bias:
            k.read(f"b [{K}]", K * s)
        for out, w in outputs:
            k.write(f"{out} [{rows}, {w}]", rows * w * s)
        k.flops = 2 * rows * F * K
        return k
    for out, w in outputs:
        k.read(f"grad {out} [{rows}, {w}]", rows * w * s)
    k.read(f"{x} [{rows}, {F}]", rows * F * s).write(f"grad W [{F}, {K}]", F * K * s)
    if bias:
        k.write(f"grad b [{K}]", K * s)
    if input_grad:
        k.read(f"W [{F}, {K}]", F * K * s).write(f"grad {x} [{rows}, {F}]", rows * F * s)
    k.flops = 2 * rows * F * K * (2 if input_grad else 1)
    return k


def _projections(sh: Shape, src_outputs, dst_outputs, bias: bool, backward: bool) -> List[Kernel]:
    """One GEMM over the shared ``x`` (``Ns == Nd``), else one per side."""
    s, F = sh.dtype_bytes, sh.in_channels
    if sh.num_src == sh.num_dst:
        return [_projection("project", sh.num_src, F, [*src_outputs, *dst_outputs], bias, s,
                            backward, sh.input_grad)]
    return [_projection("project.src", sh.num_src, F, src_outputs, bias, s, backward,
                        sh.input_grad, "x_src"),
            _projection("project.dst", sh.num_dst, F, dst_outputs, bias, s, backward,
                        sh.input_grad, "x_dst")]


def _edge_projection(sh: Shape, width: int, name: str, backward: bool) -> Kernel:
    """``edge_attr [E, D] @ W_e [D, width]`` writing ``name [E, width]``, or its
    backward (``grad W_e`` only: ``edge_attr`` takes no gradient)."""
    E, D, s = sh.num_edges, sh.edge_dim, sh.dtype_bytes
    k = Kernel("project.edge", flops=2 * E * D * width)
    k.read(f"edge_attr [E, {D}]", E * D * s)
    if backward:
        return k.read(f"grad {name} [E, {width}]", E * width * s).write(
            f"grad W_e [{D}, {width}]", D * width * s)
    return k.read(f"W_e [{D}, {width}]", D * width * s).write(f"{name} [E, {width}]",
                                                              E * width * s)


def _csr(k: Kernel, sh: Shape) -> Kernel:
    i, E = sh.index_bytes, sh.num_edges
    k.read("CSR ptr", (sh.num_dst + 1) * i).read("CSR src", E * i)
    return k.read("edge ids", E * i) if sh.edge_dim else k


def _csc(k: Kernel, sh: Shape, edge_ids: bool = False) -> Kernel:
    i, E = sh.index_bytes, sh.num_edges
    k.read("CSC ptr", (sh.num_src + 1) * i).read("CSC dst", E * i).read("CSR positions", E * i)
    return k.read("edge ids", E * i) if edge_ids and sh.edge_dim else k


def layer_floor(layer: str, pass_: str, shape: Shape) -> Floor:
    """The kernels of ``layer``'s ``pass_`` (every term: docs/benchmarks.md, "The floor's terms")."""
    if layer not in LAYERS or pass_ not in PASSES:
        raise ValueError(f"layer must be one of {LAYERS} and pass one of {PASSES}; "
                         f"got {layer!r}, {pass_!r}")
    sh = shape
    Ns, Nd, E, H = sh.num_src, sh.num_dst, sh.num_edges, sh.heads
    s, a, HC = sh.dtype_bytes, sh.acc_bytes, sh.heads * sh.channels
    node, head = HC * s, H * s  # one [·, HC] row, one [·, H] row
    training = pass_ == "forward+backward"
    edge = sh.edge_dim is not None
    kernels: List[Kernel] = []

    def project(src_out, dst_out, bias, edge_tensor, edge_width, backward=False):
        kernels.extend(_projections(sh, src_out, dst_out, bias, backward))
        if edge_tensor:
            kernels.append(_edge_projection(sh, edge_width, edge_tensor, backward))

    def fill(k, reads, gathers, rows, edge_tensor, edge_width):
        for name, n in reads:
            k.read(name, n)
        if edge_tensor:
            k.read(f"{edge_tensor} [E, {edge_width}]", E * edge_width * s)
        for name, width in gathers:  # rows along the edges
            k.gather(name, rows, E, width)
        return k

    def attend(reads, gathers, edge_tensor, edge_width):
        k = fill(_csr(Kernel("attend"), sh), reads, gathers, Ns, edge_tensor, edge_width)
        k.write("out [Nd, HC]", Nd * node)
        if training:
            k.write("lse [Nd, H]", Nd * H * a)
        kernels.append(k)

    def backward_dst(reads, gathers, writes, edge_tensor, edge_width):
        k = _csr(Kernel("attend.dst"), sh)
        k.read("g [Nd, HC]", Nd * node).read("out [Nd, HC]", Nd * node)
        k.read("lse [Nd, H]", Nd * H * a)
        fill(k, reads, gathers, Ns, edge_tensor, edge_width)
        k.write("alpha [E, H]", E * H * a).write("dscore [E, H]", E * H * a)
        for name, n in writes:
            k.write(name, n)
        if edge_tensor:
            k.write(f"grad {edge_tensor} [E, {edge_width}]", E * edge_width * s)
        kernels.append(k)

    def backward_src(reads, gathers, writes, edge_tensor=None, edge_width=0):
        k = _csc(Kernel("attend.src"), sh, edge_ids=edge_tensor is not None)
        k.read("alpha [E, H]", E * H * a).read("dscore [E, H]", E * H * a)
        fill(k, reads, gathers, Nd, edge_tensor, edge_width)  # destination rows
        for name, n in writes:
            k.write(name, n)
        kernels.append(k)

    if layer == "gat":
        src_out, dst_out = [("h", HC), ("a_src", H)], [("a_dst", H)]
        e, ew = ("a_edge" if edge else None), H
        project(src_out, dst_out, False, e, ew)
        bias = ("bias [HC]", node)
        attend([("a_dst [Nd, H]", Nd * head), bias], [("a_src", head), ("h", node)], e, ew)
        if training:
            backward_dst([("a_dst [Nd, H]", Nd * head), bias], [("a_src", head), ("h", node)],
                         [("grad a_dst [Nd, H]", Nd * head), ("grad bias [HC]", node)], e, ew)
            backward_src([], [("g", node)],
                         [("grad h [Ns, HC]", Ns * node), ("grad a_src [Ns, H]", Ns * head)])
            project(src_out, dst_out, False, e, ew, backward=True)
    elif layer == "gatv2":
        src_out, dst_out = [("x_l", HC)], [("x_r", HC)]
        e, ew = ("e" if edge else None), HC
        project(src_out, dst_out, True, e, ew)
        params = [("att [HC]", node), ("bias [HC]", node)]
        attend([("x_r [Nd, HC]", Nd * node), *params], [("x_l", node)], e, ew)
        if training:
            backward_dst([("x_r [Nd, HC]", Nd * node), *params], [("x_l", node)],
                         [("grad x_r [Nd, HC]", Nd * node), ("grad att [HC]", node),
                          ("grad bias [HC]", node)], e, ew)
            backward_src([("x_l [Ns, HC]", Ns * node), ("att [HC]", node)],
                         [("g", node), ("x_r", node)], [("grad x_l [Ns, HC]", Ns * node)], e, ew)
            project(src_out, dst_out, True, e, ew, backward=True)
    else:
        src_out, dst_out = [("k", HC), ("v", HC)], [("q", HC), ("r", HC)]
        e, ew = ("e" if edge else None), HC
        project(src_out, dst_out, True, e, ew)
        attend([("q [Nd, HC]", Nd * node), ("r [Nd, HC]", Nd * node)], [("k", node), ("v", node)], e, ew)
        if training:
            backward_dst([("r [Nd, HC]", Nd * node), ("q [Nd, HC]", Nd * node)],
                         [("k", node), ("v", node)], [("grad q [Nd, HC]", Nd * node)], e, ew)
            backward_src([], [("g", node), ("q", node)],
                         [("grad k [Ns, HC]", Ns * node), ("grad v [Ns, HC]", Ns * node)])
            # the skip's gradient is g itself: the GEMM reads it as "grad r"
            project(src_out, dst_out, True, e, ew, backward=True)
    return Floor(layer, pass_, sh, kernels)


def num_parameters(layer: str, in_channels: int, heads: int, channels: int) -> int:
    """PyG's parameters of ``Layer(in_channels, channels, heads=heads)`` (default options,
    heads concatenated or one head): GATConv ``lin`` (no bias), ``att_src``,
    ``att_dst``, ``bias``; GATv2Conv ``lin_l``, ``lin_r`` (with biases), ``att``,
    ``bias``; TransformerConv four linears with biases."""
    F, HC = in_channels, heads * channels
    return {"gat": F * HC + 3 * HC, "gatv2": 2 * (F * HC + HC) + 2 * HC,
            "transformer": 4 * (F * HC + HC)}[layer]


def step_floor(layer: str, shape: Shape, num_classes: int) -> Floor:
    """The kernels of one training step of ``gatlib compare --scope model``'s 2-layer model
    (docs/gpu.md): ``shape`` is conv1's call; conv2 runs on the same graph
    from ``H·C`` inputs to ``num_classes`` channels of one head."""
    sh1 = dataclasses.replace(shape, input_grad=False)
    HC, s, a = sh1.heads * sh1.channels, sh1.dtype_bytes, sh1.acc_bytes
    sh2 = dataclasses.replace(sh1, in_channels=HC, heads=1, channels=num_classes,
                              input_grad=True)
    N, K = sh1.num_dst, num_classes

    def named(prefix: str, fl: Floor) -> List[Kernel]:
        return [dataclasses.replace(k, name=f"{prefix}.{k.name}") for k in fl.kernels]

    conv1 = named("conv1", layer_floor(layer, "forward+backward", sh1))
    conv2 = named("conv2", layer_floor(layer, "forward+backward", sh2))
    n_fwd1, n_fwd2 = (len(layer_floor(layer, "forward", sh).kernels) for sh in (sh1, sh2))
    elu = Kernel("elu").read("h [N, HC]", N * HC * s).write("y [N, HC]", N * HC * s)
    elu_bwd = Kernel("elu.backward").read("grad y [N, HC]", N * HC * s).read(
        "h [N, HC]", N * HC * s).write("grad h [N, HC]", N * HC * s)
    loss = Kernel("cross_entropy").read("logits [N, K]", N * K * s).read(
        "labels [N]", N * 8).write("lse [N]", N * a)
    loss_bwd = Kernel("cross_entropy.backward").read("logits [N, K]", N * K * s).read(
        "labels [N]", N * 8).read("lse [N]", N * a).write("grad logits [N, K]", N * K * s)
    P = (num_parameters(layer, sh1.in_channels, sh1.heads, sh1.channels)
         + num_parameters(layer, HC, 1, num_classes))
    adam = Kernel("adam").read("parameters, gradients, 2 moments", 4 * P * s).write(
        "parameters, 2 moments", 3 * P * s)
    kernels = [*conv1[:n_fwd1], elu, *conv2[:n_fwd2], loss, loss_bwd, *conv2[n_fwd2:], elu_bwd,
               *conv1[n_fwd1:], adam]
    return Floor(layer, STEP, shape, kernels)


# Device bandwidth and GEMM peaks
@dataclass(frozen=True)
class DeviceSpec:
    """A part's published peaks: memory bandwidth (bytes/s) and dense GEMM flops/s
    by math (``fp32`` on CUDA cores, ``tf32``, ``half`` = bf16/fp16 tensor cores)."""

    part: str
    bandwidth: float
    fp32: float
    tf32: float
    half: float
    source: str


_H100 = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet, "
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_L40S = "NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/"
T = 1e12
# (pattern on torch.cuda.get_device_name, spec), first match wins. The datasheets quote
# tensor-core flops "with sparsity": the dense peaks here are half of those. A MIG slice
# ("... MIG 1g.10gb") has a share of the bandwidth, so it never matches: it is "unknown".
DEVICES: Tuple[Tuple[str, DeviceSpec], ...] = (
    (r"H200 NVL", DeviceSpec("H200 NVL", 4.8 * T, 60 * T, 835 / 2 * T, 1671 / 2 * T, _H200)),
    (r"H200", DeviceSpec("H200 SXM", 4.8 * T, 67 * T, 989 / 2 * T, 1979 / 2 * T, _H200)),
    (r"H100 NVL", DeviceSpec("H100 NVL", 3.9 * T, 60 * T, 835 / 2 * T, 1671 / 2 * T, _H100)),
    (r"H100.*PCIe", DeviceSpec("H100 PCIe", 2.0 * T, 51 * T, 756 / 2 * T, 1513 / 2 * T, _H100)),
    # "NVIDIA H100 80GB HBM3" is the SXM5 part (the PCIe card has HBM2e)
    (r"H100.*(HBM3|SXM)", DeviceSpec("H100 SXM", 3.35 * T, 67 * T, 989 / 2 * T, 1979 / 2 * T,
                                     _H100)),
    (r"A100.*SXM4?-80GB", DeviceSpec("A100 SXM 80GB", 2.039 * T, 19.5 * T, 156 * T, 312 * T,
                                     _A100)),
    (r"A100.*80GB.*PCIe", DeviceSpec("A100 PCIe 80GB", 1.935 * T, 19.5 * T, 156 * T, 312 * T,
                                     _A100)),
    (r"A100.*40GB", DeviceSpec("A100 40GB", 1.555 * T, 19.5 * T, 156 * T, 312 * T, _A100)),
    (r"L40S", DeviceSpec("L40S", 0.864 * T, 91.6 * T, 183 * T, 362.05 * T, _L40S)),
)


def published(device_name: str) -> Optional[DeviceSpec]:
    """The published peaks of a CUDA device by its name, ``None`` if not in :data:`DEVICES`."""
    if "MIG" in device_name:
        return None
    return next((spec for pattern, spec in DEVICES if re.search(pattern, device_name, re.I)),
                None)


def gemm_peak(spec: Optional[DeviceSpec], dtype: str, matmul_precision: str = "highest"
              ) -> Optional[Tuple[float, str]]:
    """``(flops/s, math)`` of the GEMMs a run of ``dtype`` did, ``None`` if unknown."""
    if spec is None or dtype == "float64":
        return None
    if dtype in ("bfloat16", "float16"):
        return spec.half, dtype
    return (spec.fp32, "FP32") if matmul_precision == "highest" else (spec.tf32, "TF32")


def measure_copy(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> Dict:
    """A device-to-device copy of ``nbytes`` (less where memory is short), timed with
    CUDA events: ``bytes_per_s`` counts what the copy reads and writes (2·nbytes)."""
    free, _ = torch.cuda.mem_get_info(device)
    n = min(nbytes, free // 4) // 4  # two buffers; leave the layers room
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    seconds = statistics.median(times)
    return {"bytes_per_s": 2 * n * 4 / seconds, "copy_bytes": n * 4, "repeats": repeats,
            "median_s": seconds}


def device_record(device: torch.device) -> Dict:
    """What a CUDA report records of its device's bandwidth: the published peaks (or
    ``None``), the copy measured now, and the float32 matmul precision in force."""
    name = torch.cuda.get_device_name(device)
    spec = published(name)
    rec = {"device_name": name, "published": None if spec is None else vars(spec),
           "measured_copy": None, "float32_matmul_precision": torch.get_float32_matmul_precision()}
    try:
        rec["measured_copy"] = measure_copy(device)
    except Exception as exc:  # noqa: BLE001  the floor is part of the report, not its point
        rec["measured_copy_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        torch.cuda.empty_cache()
    return rec


def bandwidths(device_name: str, record: Optional[Dict] = None
               ) -> Tuple[List[Tuple[str, float]], Optional[DeviceSpec]]:
    """``([(label, bytes/s), ...], spec)``: the published peak (by ``device_name``) and
    the measured copy of ``record`` (:func:`device_record`), whichever are known."""
    spec = published(device_name)
    out = []
    if spec is not None:
        out.append((f"{spec.bandwidth / T:.3g} TB/s published", spec.bandwidth))
    copy = (record or {}).get("measured_copy")
    if copy:
        out.append((f"{copy['bytes_per_s'] / T:.3g} TB/s copy", copy["bytes_per_s"]))
    return out, spec


# Against a `gatlib compare` report
IMPLS = ("pyg", "pyg_compiled", "gatlib", "gatlib_compiled")
HEADERS = ["layer", "pass", "bandwidth", "MB lo", "MB hi", "GFLOP", "floor ms lo",
           "floor ms hi", "PyG", "PyG comp.", "gatlib", "gatlib comp."]
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def report_shape(report: Dict) -> Shape:
    """The :class:`Shape` of a ``gatlib compare`` report's layer calls."""
    g, c = report["graph"], report["config"]
    N = g["num_nodes"]
    return Shape(N, N, g["num_edges_with_self_loops"], g["num_features"], c["heads"],
                 c["channels"], _DTYPE_BYTES[c["dtype"]])


def applies(report: Dict) -> bool:
    """Floors are for CUDA runs that recorded their graph (a comparison that failed early
    leaves a report without it): of one layer (``--scope layer``) or of the 2-layer
    model's training step (``--scope model``, which records its classes)."""
    c = report.get("config") or {}
    scope = c.get("scope", "layer")
    return (c.get("device") == "cuda" and "graph" in report
            and (scope == "layer" or (scope == "model" and bool(c.get("classes")))))


def pass_floor(report: Dict, layer: str, pass_: str) -> Optional[Floor]:
    """The floor of one measured (layer, pass) of a report, ``None`` for a pass it does
    not model."""
    if layer not in LAYERS:
        return None
    if pass_ in PASSES:
        return layer_floor(layer, pass_, report_shape(report))
    if pass_ == STEP:
        return step_floor(layer, report_shape(report), report["config"]["classes"])
    return None


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def _ratios(cell_s: Optional[float], floor_s: Tuple[float, float]) -> str:
    return "-" if not cell_s else f"{cell_s / floor_s[0]:.1f} / {cell_s / floor_s[1]:.1f}"


def _context(report: Dict):
    """``(bandwidths, spec, GEMM peak or None)`` of a report: its bandwidth record
    (``--device cuda`` runs since the floor was added) or, for older reports, the
    published peaks of its device and torch's default float32 matmul precision."""
    record = report.get("bandwidth")
    name = (record or {}).get("device_name") or report["environment"]["device_name"]
    bws, spec = bandwidths(name, record)
    precision = (record or {}).get("float32_matmul_precision", "highest")
    return bws, spec, gemm_peak(spec, report["config"]["dtype"], precision)


def report_floors(report: Dict) -> List[Dict]:
    """Per (layer, pass, bandwidth) of a CUDA report: ``layer``, ``pass``,
    ``bandwidth`` (label), ``floor`` (:class:`Floor`), ``seconds`` (lo, hi) and
    ``median_s`` (by implementation; ``None`` where not measured)."""
    if not applies(report):
        return []
    bws, _, peak = _context(report)
    medians = {(m["layer"], m["impl"], m["pass"]): (m.get("time") or {}).get("median_s")
               for m in report["measurements"]}
    out = []
    for layer, pass_ in dict.fromkeys((m["layer"], m["pass"]) for m in report["measurements"]):
        fl = pass_floor(report, layer, pass_)
        if fl is None:
            continue
        for label, bw in bws:
            out.append({"layer": layer, "pass": pass_, "bandwidth": label, "floor": fl,
                        "seconds": fl.seconds(bw, peak[0] if peak else None),
                        "median_s": {impl: medians.get((layer, impl, pass_)) for impl in IMPLS}})
    return out


def report_rows(report: Dict, names: Optional[Dict[str, str]] = None) -> List[List[str]]:
    """Rows of :data:`HEADERS` (:func:`report_floors`): bytes, GEMM flops, the floors,
    and each side's median time ÷ floor (lo / hi). ``names``: how to print each layer."""
    rows = []
    for r in report_floors(report):
        fl, (lo, hi) = r["floor"], r["seconds"]
        rows.append([(names or {}).get(r["layer"], r["layer"]), r["pass"], r["bandwidth"],
                     _num(fl.bytes_lo / 1e6), _num(fl.bytes_hi / 1e6), _num(fl.flops / 1e9),
                     _num(lo * 1e3), _num(hi * 1e3),
                     *(_ratios(r["median_s"][impl], (lo, hi)) for impl in IMPLS)])
    return rows


def report_note(report: Dict) -> str:
    """What the floor table's numbers are, for the line above it."""
    _, spec, peak = _context(report)
    record = report.get("bandwidth") or {}
    name = record.get("device_name") or report["environment"]["device_name"]
    where = (f"'published': NVIDIA's peak memory bandwidth of the {spec.part}" if spec else
             f"{name} is not in gatlib.bench.floor.DEVICES: no published bandwidth")
    copy = ("'copy': a device-to-device copy measured in this run" if record.get("measured_copy")
            else "no copy bandwidth measured in this run")
    gemm = (f"GEMMs at {peak[0] / T:,.0f} TFLOP/s ({peak[1]}, published)" if peak else
            "GEMM peak unknown: the floors count bytes only")
    return (f"Bandwidth floor of each pass (gatlib.bench.floor): lo moves every tensor once, "
            f"hi reads a gathered row from memory once per edge; {where}; {copy}; {gemm}. "
            f"Cells: median time ÷ floor, lo / hi (1.0 = at the floor)")
