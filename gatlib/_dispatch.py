r"""The one switch: which kernel runs a call of the attention core.

Each implementation is a :class:`Kernel` whose :meth:`Kernel.supports` says whether it can run
a call and why not. :func:`select_kernel` applies ``backend=``: a named backend runs the call or
raises ``ValueError`` with the kernel's reason, never handing it to another; ``"auto"`` takes
the first of a preference list (written where it is applied) that supports it. Inside
``gatlib.record_kernels()`` each kernel logs its name when its own code runs (fused backward
passes ``"<name>.backward"``, or ``"<name>.backward:reference"``). Kernels never import this module.
"""
from __future__ import annotations

import abc
import functools
import importlib.util
import os
import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

from . import _core
from . import _fused_cpu
from . import _record
from . import _validate as V
from ._core import EdgeScore
from ._layout import at_least
from ._plan import GraphPlan, as_plan
from ._record import record_kernels  # noqa: F401  (gatlib.record_kernels)

BACKENDS = ("auto", "torch", "scatter", "fused", "triton")

class AttentionCall(NamedTuple):
    """One call of the attention core, as every kernel sees it: :func:`graph_attention`'s
    arguments on a plan, ``p`` the dropout in effect."""

    score: EdgeScore
    value: Tensor
    plan: GraphPlan
    value_edge: Optional[Tensor]
    p: float
    need_alpha: bool
    edge_weight: Optional[Tensor] = None

    @property
    def device(self) -> torch.device:
        return self.value.device

    def tensors(self) -> Tuple[Tensor, ...]:
        return tuple(t for t in (self.value, self.value_edge, self.edge_weight,
                                 *self.score.tensors()) if t is not None)


def _transforms() -> Tuple[str, ...]:
    """Names of the torch.func transforms around this call (``"Grad"``, ``"Vmap"``, ...)."""
    return tuple(str(i.key()).rsplit(".", 1)[-1] for i in torch._C._functorch.get_interpreter_stack() or ())


def _transformed() -> Optional[str]:
    """Why a fused kernel cannot run here, if a torch.func transform other than
    grad/vjp is active; else ``None``."""
    if not torch._C._are_functorch_transforms_active():  # (the usual case, without a Python call)
        return None
    other = [t for t in _transforms() if t != "Grad"]
    if other:
        return f"a torch.func transform is active ({', '.join(other)}); fused kernels support grad/vjp only"
    return None


def _fused_context(call: AttentionCall) -> List[str]:
    """Why no fused kernel runs ``call`` in this context (transforms other than
    grad/vjp, forward-mode AD); empty if none. Their operators have a backward (and a
    differentiable one for higher orders), no jvp or vmap rule."""
    reason = _transformed()
    reasons = [] if reason is None else [reason]
    # dual tensors exist only inside a dual_level() block (its level is >= 0 there)
    if (getattr(fwAD, "_current_level", 0) >= 0
            and any(fwAD.unpack_dual(t).tangent is not None for t in call.tensors())):
        reasons.append("forward-mode AD (dual tensors): fused kernels have no jvp")
    return reasons


class Kernel(abc.ABC):
    """An implementation of the three stages for the calls it supports."""

    name = ""

    def available(self, device: torch.device) -> Optional[str]:
        """``None`` when this kernel can run on ``device`` here (its package is
        installed, ...); else the reason it cannot."""
        return None

    def reasons(self, call: AttentionCall) -> List[str]:
        """Every reason this kernel does not run ``call``; empty when it does."""
        reason = self.available(call.device)
        return [] if reason is None else [reason]

    def supports(self, call: AttentionCall) -> Optional[str]:
        """``None`` when this kernel runs ``call``; else its reasons, joined."""
        reasons = self.reasons(call)
        return "; ".join(reasons) if reasons else None

    @abc.abstractmethod
    def run(self, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
        """``(out [N_dst, H, C] in value's dtype, alpha [E, H] in edge-list order or None)``."""


class ReferenceKernel(Kernel):
    """The pure-PyTorch specification (:func:`gatlib._core.reference_attention`).
    Runs every call: any device and floating dtype, autograd to any order,
    torch.func transforms, autocast, torch.compile."""

    name = "torch"

    softmax = staticmethod(_core.segment_softmax)
    aggregate = staticmethod(_core.segment_aggregate)

    def run(self, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
        if self.name == "torch":  # (the scatter kernel logs from its aggregation)
            _record.log(self.name)
        src, index = call.plan.coo()
        out, alpha = _core.reference_attention(call.score, call.value, src, index, call.plan.num_rows,
                                               call.value_edge, p=call.p,
                                               edge_weight=call.edge_weight, softmax=self.softmax,
                                               aggregate=self.aggregate)
        return out, (alpha if call.need_alpha else None)


def _torch_scatter_reduce(x: Tensor, index: Tensor, num_segments: int, reduce: str) -> Tensor:
    """:func:`gatlib._core.segment_reduce` with torch_scatter's ``scatter`` (0, not
    ``-inf``, in an empty segment's max: no edge reads it)."""
    from torch_scatter import scatter

    return scatter(x, index, 0, dim_size=num_segments, reduce="max" if reduce == "amax" else "sum")


def _scatter_aggregate(*args, **kwargs) -> Tensor:
    """The reference's aggregation with torch_scatter's sum; logs the kernel (once
    per call, from the code that runs torch_scatter)."""
    _record.log("scatter")
    return _core.segment_aggregate(*args, segment_reduce=_torch_scatter_reduce, **kwargs)


class ScatterKernel(ReferenceKernel):
    """The reference with torch_scatter's scatter kernels as its segment reductions."""

    name = "scatter"

    def available(self, device: torch.device) -> Optional[str]:
        if not _installed("torch_scatter"):
            return "torch_scatter is not installed (pip install 'gatlib[scatter]')"
        return None

    def reasons(self, call: AttentionCall) -> List[str]:
        reasons = super().reasons(call)
        if torch.compiler.is_compiling():
            reasons.append("torch_scatter's operators are not traced by torch.compile")
        if _transforms():
            reasons.append("torch_scatter's operators have no torch.func (functorch) rules")
        return reasons

    softmax = staticmethod(functools.partial(_core.segment_softmax,
                                             segment_reduce=_torch_scatter_reduce))
    aggregate = staticmethod(_scatter_aggregate)


class FusedCPUKernel(Kernel):
    """Fused CSR attention for CPU tensors (:mod:`gatlib._fused_cpu`)."""

    name = "fused"

    def available(self, device: torch.device) -> Optional[str]:
        if device.type != "cpu":
            return f"the fused CPU kernel runs on CPU tensors; got {device} (on CUDA: 'triton')"
        return None

    def reasons(self, call: AttentionCall) -> List[str]:
        reasons = super().reasons(call) + _fused_context(call)
        if not reasons:  # (builds the compiled passes on the first call: only where they could run)
            reason = _fused_cpu.unsupported(call.score, call.value, call.value_edge)
            reasons += [] if reason is None else [reason]
        return reasons

    def run(self, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
        return _fused_cpu.attention(call.score, call.value, call.plan, call.value_edge, call.p,
                                    call.need_alpha, call.edge_weight)


class TritonKernel(Kernel):
    """Fused Triton kernels (:mod:`gatlib._triton`): CUDA tensors, or CPU tensors
    under ``TRITON_INTERPRET=1`` (how CI tests the kernels)."""

    name = "triton"

    def available(self, device: torch.device) -> Optional[str]:
        if not _installed("triton"):
            return "triton is not installed (pip install 'gatlib[triton]')"
        if not (device.type == "cuda" or (device.type == "cpu" and _interpreting())):
            return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU); got {device}"
        return None

    def reasons(self, call: AttentionCall) -> List[str]:
        reasons = super().reasons(call)
        if reasons:  # (no triton, or a device it cannot take: nothing more to ask of it)
            return reasons
        reasons += _fused_context(call)
        if torch.jit.is_tracing():
            reasons.append("torch.jit.trace of the Triton kernels has not been tried")
        if call.edge_weight is not None:
            reasons.append("the Triton kernels take no edge weights (explainer edge masks)")
        if torch.compiler.is_exporting() and any(
                isinstance(s, torch.SymInt) for s in (call.plan.num_edges, call.plan.num_dst)):
            # (the schedule's sizes are integer arithmetic on the node and edge counts whose
            # guards export's solver cannot prove for every size: docs/compile.md)
            reasons.append("torch.export with free node or edge counts cannot trace the Triton "
                           "kernels' work schedule: export with static sizes, or with "
                           "backend='torch'")
        from . import _triton

        reason = _triton.unsupported(call.score, call.value, call.value_edge)
        return reasons + ([] if reason is None else [reason])

    def run(self, call: AttentionCall) -> Tuple[Tensor, Optional[Tensor]]:
        from . import _triton

        return _triton.attention(call.score, call.value, call.plan, call.value_edge, call.p,
                                 call.need_alpha)


@torch.compiler.assume_constant_result
def _installed(name: str) -> bool:
    # (a constant to torch.compile: dynamo before torch 2.13 cannot trace find_spec,
    # and broke the graph at every attention call)
    return importlib.util.find_spec(name) is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


KERNELS: Dict[str, Kernel] = {k.name: k for k in (ReferenceKernel(), ScatterKernel(),
                                                    FusedCPUKernel(), TritonKernel())}


def check_backend_name(backend) -> str:
    """Validate a ``backend=`` argument (at construction time, too)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {BACKENDS}; got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend in ("scatter", "triton"):
        name = {"scatter": "torch_scatter", "triton": "triton"}[backend]
        if not _installed(name):
            raise ValueError(f"backend={backend!r} is not available: {name} is not installed "
                             f"(pip install 'gatlib[{backend}]')")
    return backend


# "auto" on CPU runs the reference below this many [E, H, C] entries, counted with the
# self-loops (see select_kernel): below it, on NeighborLoader subgraphs, the fused
# operators' fixed cost outweighs what they save (docs/design.md, "Which kernel auto runs").
FUSED_CPU_MIN_ENTRIES = 1 << 18


class Dispatch(NamedTuple):
    """How one call's kernel was chosen (:func:`gatlib.record_kernels`' ``decisions``):
    ``backend=`` as asked, the kernel that ran, the rule ``"auto"`` applied (``""`` for a
    named backend), and every reason of each kernel tried before it."""

    backend: str
    kernel: str
    rule: str
    refused: Dict[str, Tuple[str, ...]]


# The reasons auto has warned of, once each: a fallback to the [E, H, C] reference where a
# fused kernel would run is told, not hidden (a fast path quietly lost is a regression).
_WARNED: set = set()


def select_kernel(backend: str, call: AttentionCall) -> Kernel:
    """The kernel that runs ``call`` for ``backend=`` (a name :func:`check_backend_name` has
    passed: the layers check theirs when built, :func:`graph_attention` its own)."""
    dev = call.device.type
    refused: Dict[str, Tuple[str, ...]] = {}
    if backend == "auto":
        # The rule (its measurements: docs/design.md, "Which kernel auto runs"):
        #   CPU:  "fused" from FUSED_CPU_MIN_ENTRIES [E, H, C] entries (far less memory than
        #         PyG's, and faster); below, "torch" (on NeighborLoader's small subgraphs the
        #         fused kernel's layouts and operator calls cost more than they save). "torch"
        #         also where fused cannot run (torch.func vmap/jvp, forward-mode AD, non-float
        #         dtypes, no C++ compiler) and under torch.jit.trace (its trace of aten ops is
        #         what torch.jit.save can write). Under torch.export a free node or edge count
        #         takes "fused" (the size rule's large side, _layout.at_least).
        #   CUDA: "triton" (no size rule: none measured); "torch" where it cannot run (no
        #         triton, torch.func vmap/jvp, forward-mode AD, torch.jit.trace, edge weights,
        #         over 1024 channels, non-float dtypes, torch.export with free sizes).
        #   Other devices: "torch".
        # Where the fused kernel of the device is refused, the reference runs with a warning
        # (once per reason).
        if dev == "cpu":
            entries = call.plan.num_edges * call.score.heads * call.value.shape[2]
            if torch.jit.is_tracing():
                order, rule = ("torch",), "CPU under torch.jit.trace: the reference"
            elif not at_least(entries, FUSED_CPU_MIN_ENTRIES):
                order, rule = ("torch",), "CPU, fewer [E, H, C] entries than FUSED_CPU_MIN_ENTRIES"
            else:
                order, rule = ("fused", "torch"), "CPU, at least FUSED_CPU_MIN_ENTRIES [E, H, C] entries"
        elif dev == "cuda":
            order, rule = ("triton", "torch"), "CUDA"
        else:
            order, rule = ("torch",), f"{dev}: the reference"
        for name in order:
            reasons = [] if name == "torch" else KERNELS[name].reasons(call)  # (it runs every call)
            if not reasons:
                break
            refused[name] = tuple(reasons)
        if refused:
            _warn_fallback(refused)
    else:
        # "fused" names the family that never builds [E, H, C]: the CSR kernel on CPU,
        # the Triton kernels on CUDA.
        name, rule = ("triton" if backend == "fused" and dev == "cuda" else backend), ""
        reasons = KERNELS[name].reasons(call)
        if reasons:
            raise ValueError(f"backend={backend!r} cannot run this call: {'; '.join(reasons)}")
    _record.decide(lambda: Dispatch(backend, name, rule, refused))
    return KERNELS[name]


def _warn_fallback(refused: Dict[str, Tuple[str, ...]]) -> None:
    """Warn, once per kernel and reasons, that ``"auto"`` runs the ``[E, H, C]`` reference
    where the fused kernel ``refused`` names would run. Not while torch.compile traces (a
    warning breaks the graph; the eager call warns)."""
    if torch.compiler.is_compiling():
        return
    for name, reasons in refused.items():
        key = (name, reasons)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"backend='auto' runs the [E, H, C] reference for this call, where "
                          f"the {name!r} kernel would run but cannot: {'; '.join(reasons)}",
                          FallbackWarning, stacklevel=4)


class FallbackWarning(UserWarning):
    """``backend="auto"`` ran the ``[E, H, C]`` reference where a fused kernel would run."""


def available_backends(device: Union[torch.device, str] = "cpu") -> Tuple[str, ...]:
    """Names of the kernels that can run on ``device`` here (``"torch"`` always
    can); whether one runs a particular call is :meth:`Kernel.supports`'s to say."""
    device = torch.device(device)
    return tuple(n for n, k in KERNELS.items() if k.available(device) is None)


def graph_attention(
    score: EdgeScore,
    value: Tensor,
    edge_index: Union[Tensor, GraphPlan],
    num_dst: int,
    *,
    value_edge: Optional[Tensor] = None,
    dropout: float = 0.0,
    training: bool = False,
    concat: bool = True,
    backend: str = "auto",
    return_attention: bool = False,
    edge_weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Sparse multi-head attention over the edges of a graph.

    .. math::
        \alpha_{ij} = \operatorname{softmax}_{j \in \mathcal{N}(i)}(e_{ij}),
        \qquad
        h_i' = \big\Vert_{h=1}^{H} \text{ or } \tfrac{1}{H}\sum_{h=1}^{H}
        \; \sum_{j \in \mathcal{N}(i)} \alpha^{h}_{ij}\,(v^{h}_j + u^{h}_{ij})

    Args:
        score: an :class:`EdgeScore` holding the per-node terms of ``e_ij`` (``H`` heads;
            the dot product's key may have one, shared).
        value: ``[N_src, H, C]`` source values, or ``[N_src, 1, C]`` shared by every head.
        edge_index: ``[2, E]`` ``(src, dst)`` pairs, a PyG ``EdgeIndex``, a sparse adjacency
            ``[num_dst, N_src]`` (PyG's ``adj_t``) or a :class:`GraphPlan`.
        num_dst: number of destination nodes ``N_dst``.
        value_edge: optional ``[E, H, C]`` term added to each edge's value.
        dropout, training: attention dropout probability, active in training only.
        concat: concatenate heads (``[N, H*C]``) or average them (``[N, C]``).
        backend: one of :data:`BACKENDS` (see :func:`gatlib.available_backends`).
        return_attention: also return the ``[E, H]`` weights (before dropout), in the
            order of ``edge_index``.
        edge_weight: optional ``[E]`` differentiable multiplier of each edge's weights after
            dropout (PyG's explainers' edge masks); the returned weights are not multiplied.
        bias: optional ``[H*C]`` (concatenated) or ``[C]`` (averaged) added to every output row.

    Returns:
        ``out`` or ``(out, alpha)``.

    Raises:
        ValueError: a tensor whose shape disagrees with the graph or the score.
    """
    check_backend_name(backend)
    V.check_value(value, score.heads)
    plan = as_plan(edge_index, value.size(0), num_dst, value.device)
    V.check_attention_inputs(score, value, value_edge, plan.num_src, plan.num_dst, plan.num_edges)
    if bias is not None:
        V.check_bias(bias, (score.heads if concat else 1) * value.size(-1), value)
    out, alpha = attend_planned(score, value, plan, value_edge, dropout, training, concat,
                                backend, bool(return_attention), edge_weight, bias)
    return (out, alpha) if return_attention else out


def attend_planned(score: EdgeScore, value: Tensor, plan: GraphPlan, value_edge: Optional[Tensor],
                   dropout: float, training: bool, concat: bool, backend: str, need_alpha: bool,
                   edge_weight: Optional[Tensor] = None,
                   bias: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`graph_attention` on a plan of ``value``'s ``N_src`` sources that the caller built
    and checked: ``(out, alpha or None)``. What the layers call, having checked their inputs
    once (docs/design.md, "Per-call cost on small graphs"). ``bias`` is added to the combined
    heads."""
    p = float(dropout) if training and dropout > 0 else 0.0
    if edge_weight is not None:
        V.check_edge_weight(edge_weight, plan.num_edges, value)
    sink = plan.sink
    if sink and score.dst is not None:  # the sink row's destination terms: zeros
        dst = score.dst
        score = score.with_tensors(score.src, torch.cat([dst, dst.new_zeros(1, *dst.shape[1:])]),
                                   score.edge, score.att)
    call = AttentionCall(score, value, plan, value_edge, p, need_alpha, edge_weight)
    out, alpha = select_kernel(backend, call).run(call)
    if sink:  # the row that collected the edges attention ignores (GraphPlan.num_rows)
        out = out[:plan.num_dst]
        if alpha is not None:
            alpha = alpha.masked_fill((plan.coo()[1] == plan.num_dst).unsqueeze(1), 0)
    if edge_weight is not None:  # (as PyG's explain_message: the mask's dtype promotes)
        out = out.to(torch.promote_types(out.dtype, edge_weight.dtype))
    out = _core.combine_heads(out, concat)
    if bias is not None:
        out = out + bias
    return out, alpha
