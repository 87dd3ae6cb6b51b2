r"""Fused sparse attention in Triton: score, softmax and aggregate in one pass per direction.

Three modules: the ``triton.jit`` kernels (:mod:`gatlib._triton_kernels`), the work items, tuning
and launches (:mod:`gatlib._triton_schedule`), and this one: the two operators, their autograd and
the entry point :func:`attention`. docs/gpu.md has the design.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from . import _record
from . import _triton_schedule as TS
from ._core import EdgeScore, acc_dtype, distinct_inputs, promoted_dtype, reference_grads, score_heads
from ._plan import GraphPlan
from ._triton_kernels import _ATT_ROWS, _alpha_kernel, _fwd_kernel, _keep_kernel
from ._triton_schedule import _launch, _merge, _Plan, _plan, _schedule_sizes, _tile, _tl_acc, _warps

# A work item's padded [heads, channels] tile holds at most this many elements; wider rows run
# on the reference.
_MAX_TILE = 4096
_KINDS = {"gat": 0, "gatv2": 1, "dot": 2}  # EdgeScore.kind -> the kernels' KIND
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class _Meta:
    """The non-tensor arguments of one fused call."""

    kind: int
    H: int
    CK: int  # channels of the score's terms (1 for GAT's per-node scalars)
    CV: int  # channels of the values
    scale: float
    slope: float
    p: float  # dropout probability, 0 when inactive
    acc: torch.dtype  # float32, or float64 for float64 inputs
    share_v: bool  # the value is the score's src (GATv2's x_src; the dot kind's key)
    share_ve: bool  # value_edge is the score's edge term (the Transformer's)
    one_k: bool  # the dot kind's key has one head, which every head reads ([N, 1, CK])
    one_v: bool  # the value has one head, which every head reads ([N, 1, CV])

    def consts(self) -> dict:
        """The row kernels' constexprs."""
        return dict(H=self.H, CK=self.CK, CV=self.CV, KIND=self.kind, SHARE_V=self.share_v,
                    SHARE_VE=self.share_ve, ONE_K=self.one_k, ONE_V=self.one_v,
                    ACC=_tl_acc(self.acc))


def _meta(kind: int, scale: float, slope: float, p: float, share_v: bool, share_ve: bool,
          ins) -> _Meta:
    s_src, s_dst, value = ins[0], ins[1], ins[4]
    H = score_heads(_KIND_NAMES[kind], s_src, s_dst)
    return _Meta(kind, H, 1 if kind == 0 else s_src.size(-1), value.size(-1), scale, slope, p,
                 acc_dtype(*ins), share_v, share_ve, kind == 2 and s_src.size(1) != H,
                 value.size(1) != H)


class _Graph(NamedTuple):
    """What the kernels read of a graph, as the operators take it (:func:`_graph_tensors`)."""

    ptr: Tensor
    src: Tensor  # [E] CSR order
    dst: Tensor  # [E] CSR order
    perm: Tensor  # [E] edge-list position of each CSR position
    csc_edge: Tensor  # [E] CSR position of each CSC position
    csc_dst: Tensor
    csr_eid: Tensor  # perm in the kernels' index dtype
    csc_eid: Tensor  # edge-list position of each CSC position
    dst_items: Tensor  # the schedules' work items and split rows (_Schedule)
    dst_splits: Tensor
    src_items: Tensor
    src_splits: Tensor

    @property
    def num_dst(self) -> int:
        return self.ptr.numel() - 1

    @property
    def num_edges(self) -> int:
        return self.src.numel()

    @property
    def pieces(self) -> int:  # partial rows a call allocates, either direction
        return max(1, _schedule_sizes(0, self.num_edges, TS._split())[2])


def _graph_tensors(tp: _Plan, splits: Tuple[bool, bool] = (True, True)) -> List[Tensor]:
    """The operators' ``graph`` argument; ``splits`` (:func:`_split_rows`): whether each
    schedule's split rows are passed (if not, its merges do not launch)."""
    lay = tp.layout
    # where csr_eid is perm itself, a view (torch.compile traces no autograd function given one
    # tensor twice)
    csr_eid = tp.csr_eid if tp.csr_eid is not lay.perm else lay.perm.view(-1)
    d, s = tp.dst_items, tp.src_items
    return [lay.ptr, lay.src, lay.dst, lay.perm, lay.csc_edge, lay.csc_dst, csr_eid, tp.csc_eid,
            d.items, d.splits if splits[0] else d.splits[:0], s.items,
            s.splits if splits[1] else s.splits[:0]]


def _split_rows(tp: _Plan, like: Tensor) -> Tuple[bool, bool]:
    """Whether the destination and the source schedule of ``tp`` have split rows (whose
    merges must launch). Traced calls and CUDA graph capture assume both; an eager call reads
    it back once per plan, so that graphs without hubs skip the merge launches."""
    if torch.compiler.is_compiling() or type(like) is not torch.Tensor:
        return True, True
    if tp.splits is None:
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            return True, True
        dst, src = torch.stack([tp.dst_items.bounds[-1], tp.src_items.bounds[-1]]).tolist()
        tp.splits = (dst > 0, src > 0)
    return tp.splits


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _coef(meta: _Meta, like: Tensor) -> Tensor:
    """``[scale, negative_slope, 1 / (1 - p), p]`` in the accumulation dtype on ``like``'s device
    (a fresh constant while an operator is traced: a cached fake tensor must not outlive it)."""
    keep = 1.0 / (1.0 - meta.p) if meta.p > 0 else 1.0
    if type(like) is not torch.Tensor:
        return torch.tensor([meta.scale, meta.slope, keep, meta.p], dtype=meta.acc, device=like.device)
    return _coef_tensor(meta.scale, meta.slope, keep, meta.p, meta.acc, like.device)


@functools.lru_cache(maxsize=64)
def _coef_tensor(scale: float, slope: float, keep: float, p: float, dtype: torch.dtype,
                 device: torch.device) -> Tensor:
    # Loaded in-kernel so that float64 runs use exact constants (scalar kernel arguments are
    # float32); cached to skip a host-to-device copy per call.
    return torch.tensor([scale, slope, keep, p], dtype=dtype, device=device)


def _operator(name: str, fake):
    """Define ``gatlib::<name>``: a ``custom_op`` with the shapes-only ``fake``, so that a
    compiled call launches the kernels an eager call launches (docs/design.md, "Compiled
    calls launch the eager kernels")."""
    def define(fn):
        op = torch.library.custom_op(f"gatlib::{name}", fn, mutates_args=())
        op.register_fake(fake)
        return op
    return define


def _fake_forward(s_src, s_dst, s_edge, s_att, value, value_edge, seed, graph, kind, scale, slope,
                  p, need_alpha, alpha_dtype, share_v, share_ve):  # (shapes only)
    num_dst, E = graph[0].numel() - 1, graph[1].numel()
    H = score_heads(_KIND_NAMES[kind], s_src, s_dst)
    acc = acc_dtype(s_src, s_dst, s_edge, s_att, value, value_edge)
    alpha = value.new_empty(E, H, dtype=alpha_dtype) if need_alpha else value.new_empty(0)
    return value.new_empty(num_dst, H, value.size(2)), alpha, value.new_empty(num_dst, H, dtype=acc)


@_operator("triton_attention", _fake_forward)
def _attention_op(s_src: Tensor, s_dst: Optional[Tensor], s_edge: Optional[Tensor],
                  s_att: Optional[Tensor], value: Tensor, value_edge: Optional[Tensor],
                  seed: Optional[Tensor], graph: List[Tensor], kind: int, scale: float, slope: float,
                  p: float, need_alpha: bool, alpha_dtype: torch.dtype, share_v: bool,
                  share_ve: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(out [N_dst, H, CV], alpha [E, H] in edge-list order or [0], lse [N_dst, H])``
    (:class:`_FusedAttention` has the maths and the inputs' order)."""
    ins = _aligned(s_src, s_dst, s_edge, s_att, value, value_edge)
    return _forward(_meta(kind, scale, slope, p, share_v, share_ve, ins), _Graph(*graph), *ins,
                    seed, need_alpha, alpha_dtype)


def _aligned(*tensors: Optional[Tensor]) -> List[Optional[Tensor]]:
    """``tensors``, each one whose data does not start on 16 bytes copied to one that does: Triton
    specialises on a pointer's alignment (docs/design.md, "Inputs aligned to 16 bytes")."""
    return [t.clone() if t is not None and t.data_ptr() % 16 else t for t in tensors]


def _returned(share_v: bool, share_ve: bool, need) -> List[bool]:
    """Which of the six gradients the backward operator returns (``need``), but for one of two
    inputs that are one tensor: the kernels sum both parts into ``value``'s (GATv2's ``x_src``,
    the dot kind's key that is the value) or ``s_edge``'s (the Transformer's edge term)."""
    need = list(need)
    if share_v and need[0] and need[4]:
        need[0] = False
    if share_ve and need[2] and need[5]:
        need[5] = False
    return need


def _fake_backward(grad_out, grad_alpha, s_src, s_dst, s_edge, s_att, value, value_edge, seed, out,
                   lse, alpha, graph, kind, scale, slope, p, share_v, share_ve, need):
    ins = (s_src, s_dst, s_edge, s_att, value, value_edge)
    return [torch.empty_like(t) if n and t is not None else value.new_empty(0)
            for t, n in zip(ins, _returned(share_v, share_ve, need), strict=True)]


@_operator("triton_attention_backward", _fake_backward)
def _attention_backward_op(grad_out: Optional[Tensor], grad_alpha: Optional[Tensor], s_src: Tensor,
                           s_dst: Optional[Tensor], s_edge: Optional[Tensor], s_att: Optional[Tensor],
                           value: Tensor, value_edge: Optional[Tensor], seed: Optional[Tensor],
                           out: Tensor, lse: Tensor, alpha: Tensor, graph: List[Tensor], kind: int,
                           scale: float, slope: float, p: float, share_v: bool, share_ve: bool,
                           need: List[bool]) -> List[Tensor]:
    """The gradients of the forward operator's six float inputs (``s_src``, ..., ``value_edge``)
    from those of ``out`` and ``alpha``: an empty tensor for each one :func:`_returned` leaves out."""
    grad_out, grad_alpha, *ins = _aligned(grad_out, grad_alpha, s_src, s_dst, s_edge, s_att, value,
                                          value_edge)
    meta = _meta(kind, scale, slope, p, share_v, share_ve, ins)
    grads = _backward(meta, _Graph(*graph), _returned(share_v, share_ve, need), grad_out,
                      grad_alpha, *ins, seed, out, lse, alpha)
    return [g if g is not None else value.new_empty(0) for g in grads]


def _setup_context(ctx, inputs, output):
    *ins, seed, graph, kind, scale, slope, p, need_alpha, alpha_dtype, share_v, share_ve = inputs
    out, alpha, lse = output
    ctx.args = (kind, scale, slope, p, share_v, share_ve)
    ctx.num_graph = len(graph)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*ins, seed, out, lse, alpha, *graph)


def _grads(ctx, grad_out: Optional[Tensor], grad_alpha: Optional[Tensor]) -> List[Optional[Tensor]]:
    """The gradients of the six float inputs (``None`` where not needed): the backward
    operator's, or the reference's where they must be differentiable."""
    saved = ctx.saved_tensors
    ins, seed, out, lse, alpha, graph = saved[:6], saved[6], saved[7], saved[8], saved[9], saved[10:]
    need = ctx.needs_input_grad[:6]
    kind, scale, slope, p, share_v, share_ve = ctx.args
    if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
        _record.log("triton.backward:reference")
        return _reference_backward(kind, scale, slope, p, seed, _Graph(*graph), ins, need,
                                   grad_out, grad_alpha)
    grads = torch.ops.gatlib.triton_attention_backward.default(
        grad_out, grad_alpha, *ins, seed, out, lse, alpha, list(graph), kind, scale, slope, p,
        share_v, share_ve, list(need))
    return [g if n else None for g, n in zip(grads, _returned(share_v, share_ve, need), strict=True)]


def _op_backward(ctx, grad_out, grad_alpha, _grad_lse):
    return (*_grads(ctx, grad_out, grad_alpha), None, [None] * ctx.num_graph, *([None] * 8))


_attention_op.register_autograd(_op_backward, setup_context=_setup_context)


class _FusedAttention(torch.autograd.Function):
    r""":func:`_attention_op` with its backward, the graph's tensors last (``torch.func.grad``
    cannot differentiate the bare operator in torch 2.13). One head shown; ``D`` the dropout mask.

    Forward, per destination ``i`` (online softmax, one edge at a time in CSR order)::

        m, l, acc = -inf, 0, 0
        for each edge j -> i:
            s_j   = score(i, j)                       # GAT / GATv2 / dot, in-kernel
            m'    = max(m, s_j)
            l     = l * exp(m - m') + exp(s_j - m')
            acc   = acc * exp(m - m') + exp(s_j - m') * D_ij / (1 - p) * (v_j + u_ij)
            m     = m'
        out_i = acc / l;  lse_i = m + log(l)          # saved: out [N, H, C], lse [N, H]
        alpha_ij = exp(s_ij - lse_i)                  # only when asked for

    A hub's row is cut into pieces, each with its own ``(out, lse)``, merged by log-sum-exp.

    Backward, with ``g_i = dL/dout_i`` and ``A_ij = alpha_ij D_ij / (1 - p)``::

        Delta_i = <g_i, out_i> + sum_j alpha_ij * dL/dalpha_ij     # [N, H]
        # destination-major (CSR) kernel, recomputing s_ij and alpha_ij from lse_i:
        dP_ij  = D_ij / (1 - p) * <g_i, v_j + u_ij> + dL/dalpha_ij
        dS_ij  = alpha_ij * (dP_ij - Delta_i)                      # softmax gradient
        du_ij  = A_ij g_i                                          # value_edge
        GAT:   dz_ij = dS_ij * leaky'(z_ij);  da_dst_i = sum_j dz_ij;  da_edge_ij = dz_ij
        GATv2: dz_ij = dS_ij * att ⊙ leaky'(z_ij);  dx_dst_i = sum_j dz_ij;  de_ij = dz_ij
               datt  = sum_ij dS_ij * leaky(z_ij)          (per program of _ATT_ROWS items, then summed)
        dot:   dq_i  = scale * sum_j dS_ij (k_j + e_ij);  de_ij = scale * dS_ij q_i
        # source-major (CSC) kernel, gathering A and dS (GAT: dz) saved as [E, 2, H]:
        dv_j = sum_i A_ij g_i
        GAT: da_src_j = sum_i dz_ij;  GATv2: dx_src_j = sum_i dS_ij att ⊙ leaky'(z_ij);
        dot: dk_j = scale * sum_i dS_ij q_i

    Inputs, in the fused CPU operator's order: the score's ``s_src`` (a_src / x_src / key),
    ``s_dst`` (a_dst / x_dst / query), ``s_edge``, ``s_att`` (GATv2's ``att [H, CK]``), then
    ``value [N_src, H, CV]`` and ``value_edge [E, H, CV]`` or None.
    """

    @staticmethod
    def forward(s_src, s_dst, s_edge, s_att, value, value_edge, seed, kind, scale, slope, p,
                need_alpha, alpha_dtype, share_v, share_ve, *graph):
        return torch.ops.gatlib.triton_attention.default(
            s_src, s_dst, s_edge, s_att, value, value_edge, seed, list(graph), kind, scale, slope,
            p, need_alpha, alpha_dtype, share_v, share_ve)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, (*inputs[:7], inputs[15:], *inputs[7:15]), output)

    @staticmethod
    def backward(ctx, grad_out, grad_alpha, _grad_lse):
        return (*_grads(ctx, grad_out, grad_alpha), *([None] * (9 + ctx.num_graph)))


def _forward(meta: _Meta, g: _Graph, s_src, s_dst, s_edge, s_att, value, value_edge, seed,
             need_alpha: bool, alpha_dtype: torch.dtype):
    _record.log("triton")
    H, CV, acc = meta.H, meta.CV, meta.acc
    out = value.new_empty(g.num_dst, H, CV)
    lse = value.new_empty(g.num_dst, H, dtype=acc)
    part_out = value.new_empty(g.pieces, H, CV, dtype=acc)
    part_lse = value.new_empty(g.pieces, H, dtype=acc)
    score = (s_src, s_dst, s_edge, s_att)
    coef = _coef(meta, value)
    with _device(value):
        _launch("_fwd_kernel", g.dst_items, (g.src, g.csr_eid), score, value, value_edge, coef,
                seed, (out, lse, part_out, part_lse), **meta.consts())
        _merge(g.dst_splits, part_out, out, part_lse, lse)
        alpha = value.new_empty(0)  # (an operator returns tensors only)
        if need_alpha:
            alpha = value.new_empty(g.num_edges, H, dtype=alpha_dtype)
            if g.num_edges:
                tile = _tile(meta.consts())
                block = max(1, 2048 // tile)
                _alpha_kernel[(triton.cdiv(g.num_edges, block),)](
                    (g.src, g.dst, g.csr_eid), score, coef, lse, alpha, g.num_edges, H=H,
                    CK=meta.CK, KIND=meta.kind, ONE_K=meta.one_k, ACC=_tl_acc(acc), BLOCK_K=block,
                    num_warps=_warps(block * tile))
    return out, alpha, lse


def _backward(meta: _Meta, g: _Graph, need, grad_out, grad_alpha, s_src, s_dst, s_edge, s_att,
              value, value_edge, seed, out, lse, alpha) -> List[Optional[Tensor]]:
    """The six gradients :func:`_returned` says (``need``), ``None`` for the others."""
    _record.log("triton.backward")
    H, CK, acc = meta.H, meta.CK, meta.acc
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
    delta_alpha = None
    if grad_alpha is not None and alpha.numel():  # sum_j alpha_ij dL/dalpha_ij, in CSR order
        grad_alpha = grad_alpha.contiguous()
        ga = grad_alpha.to(acc)  # (grad_alpha is the caller's: a copy is multiplied in place)
        ga = ga * alpha if ga is grad_alpha else ga.mul_(alpha)
        delta_alpha = torch.segment_reduce(ga.index_select(0, g.perm), "sum", offsets=g.ptr,
                                           unsafe=True)  # [N_dst, H]
    else:  # (no weights were returned: their [0] placeholder may get a [0] gradient)
        grad_alpha = None

    def new(t, n, *shape):  # an output where needed; partial rows of split rows in acc
        return t.new_empty(*shape, dtype=acc) if shape else (torch.empty_like(t) if n else None)

    d_src, d_dst, d_edge = (new(t, n) for t, n in zip((s_src, s_dst, s_edge), need[:3], strict=True))
    d_vedge = new(value_edge, need[5])
    need_src_side = need[0] or need[4]
    dst_shape = d_dst.shape[1:] if d_dst is not None else ()
    part_dst = new(value, True, g.pieces, *dst_shape) if d_dst is not None else None
    items = g.dst_items.size(0)
    part_att = value.new_empty(items // _ATT_ROWS.value, H, CK, dtype=acc) if need[3] else None
    buf = value.new_empty(g.num_edges, 2, H, dtype=acc) if need_src_side else None
    score = (s_src, s_dst, s_edge, s_att)
    coef = _coef(meta, value)
    with _device(value):
        _launch("_bwd_dst_kernel", g.dst_items, (g.src, g.csr_eid),
                score, value, value_edge, coef, seed, (grad_out, out, lse, grad_alpha, delta_alpha),
                (buf, d_edge, d_vedge, d_dst, part_dst, part_att),
                group=_ATT_ROWS.value if part_att is not None else None, **meta.consts())
        if d_dst is not None:
            _merge(g.dst_splits, part_dst, d_dst)
        d_value = None
        if need_src_side:
            sum_src = meta.share_v and need[4]  # (then need[0] is off: _returned)
            d_value = new(value, need[4])
            part_value = new(value, True, g.pieces, *value.shape[1:]) if d_value is not None else None
            part_src = new(s_src, True, g.pieces, *s_src.shape[1:]) if d_src is not None else None
            consts = meta.consts()
            del consts["SHARE_V"], consts["SHARE_VE"]
            _launch("_bwd_src_kernel", g.src_items, (g.csc_edge, g.csc_dst, g.csc_eid), score,
                    grad_out, buf, coef, (d_value, part_value, d_src, part_src), SUM_SRC=sum_src,
                    **consts)
            if d_value is not None:
                _merge(g.src_splits, part_value, d_value)
            if d_src is not None:
                _merge(g.src_splits, part_src, d_src)
    d_att = part_att.sum(0).to(s_att.dtype) if part_att is not None else None
    return [d_src, d_dst, d_edge, d_att, d_value, d_vedge]


def _reference_backward(kind: int, scale: float, slope: float, p: float, seed: Optional[Tensor],
                        graph: _Graph, ins, need, g_out, g_alpha) -> List[Optional[Tensor]]:
    """Differentiable gradients of the same call: the reference's, on the edge list
    with the kernels' dropout mask. Builds ``[E, H, C]`` tensors, as the reference does."""
    drop = None
    if p > 0:
        keep = _keep_mask(graph.csr_eid, score_heads(_KIND_NAMES[kind], ins[0], ins[1]), p, seed)
        drop = keep.to(acc_dtype(*ins)) * (1.0 / (1.0 - p))
    perm = graph.perm.long()
    src = torch.empty_like(perm).index_copy_(0, perm, graph.src.long())  # edge-list order
    dst = torch.empty_like(perm).index_copy_(0, perm, graph.dst.long())
    return reference_grads(_KIND_NAMES[kind], scale, slope, ins, src, dst, graph.num_dst, drop,
                           (g_out, g_alpha), need)


def _draw_seed(device: torch.device) -> Tensor:
    """A dropout seed drawn on ``device`` by its default generator, read by the kernels from device
    memory: no host sync, a new seed per CUDA graph replay (docs/design.md, "Dropout and determinism")."""
    return torch.randint(0, 2**31 - 1, (1,), device=device)


def _check_interpreter() -> None:
    """CPU tensors need every jit function (ours and triton.language's) built for the interpreter:
    only if ``TRITON_INTERPRET=1`` was set before triton was first imported."""
    from triton.runtime.interpreter import InterpretedFunction

    if not (isinstance(_fwd_kernel, InterpretedFunction) and isinstance(tl.sum, InterpretedFunction)):
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first "
            "imported (note that torch_geometric imports triton); set it at the very start of "
            "the process")


def unsupported(score: EdgeScore, value: Tensor, value_edge: Optional[Tensor]) -> Optional[str]:
    """Why the kernels cannot run on these tensors, or ``None`` if they can."""
    dev = value.device
    for t in (value, value_edge, *score.tensors()):
        if t is None:
            continue
        if t.device != dev:
            return f"all tensors must be on one device; got {t.device} and {dev}"
        if t.dtype not in _FLOATS:
            return f"the Triton kernels compute in {', '.join(map(str, _FLOATS))}; got {t.dtype}"
    CK = 1 if score.kind == "gat" else score.src.size(-1)
    tile = _tile(dict(H=score.heads, CK=CK, CV=value.size(-1), KIND=_KINDS[score.kind]))
    if tile > _MAX_TILE:
        return (f"the Triton kernels take at most {_MAX_TILE} (padded) heads x channels per row; "
                f"got {score.heads} heads of {max(CK, value.size(-1))} channels ({tile} padded)")
    if dev.type == "cpu":
        _check_interpreter()
    return None


def attention(score: EdgeScore, value: Tensor, plan: GraphPlan, value_edge: Optional[Tensor],
              p: float, need_alpha: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """Fused attention (:class:`_FusedAttention`) of a call :func:`unsupported` accepts:
    ``(out [N_dst, H, C] in value's dtype, alpha [E, H] in edge-list order or None)``.
    ``value`` is ``[N_src, H, C]`` (or ``[N_src, 1, C]`` shared by every head), ``p`` the
    dropout in effect."""
    kind = _KINDS[score.kind]
    s_src, s_dst, s_edge, s_att = score.tensors()
    tensors = (s_src, s_dst, s_edge, s_att, value, value_edge)
    share_v = kind in (1, 2) and s_src is value
    share_ve = value_edge is not None and value_edge is s_edge and kind != 0
    seed = _draw_seed(value.device) if p > 0 else None
    alpha_dtype = promoted_dtype(s_src, s_dst, s_edge, s_att)
    # one tensor passed twice (GATv2's x_src is its value): a view for each repeat (distinct_inputs)
    ins = [t.contiguous() if t is not None else None for t in distinct_inputs(list(tensors))]
    tp = _plan(plan)
    graph = _graph_tensors(tp, _split_rows(tp, value))
    args = (*ins, seed, kind, float(score.scale), float(score.negative_slope), float(p), need_alpha,
            alpha_dtype, share_v, share_ve)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ins):
        out, alpha, _ = _FusedAttention.apply(*args, *graph)
    else:  # nothing to differentiate: the operator alone (as the fused CPU kernel)
        out, alpha, _ = torch.ops.gatlib.triton_attention.default(*ins, seed, graph, *args[7:])
    return out, (alpha if need_alpha else None)


def _wrap_triton(kernel):
    """``torch.library.wrap_triton(kernel)`` for a launch outside the operators; the kernel
    itself under Triton's interpreter (torch before 2.13 refuses to wrap it)."""
    if not isinstance(kernel, JITFunction):
        return kernel
    return torch.library.wrap_triton(kernel)


def _keep_mask(csr_eid: Tensor, heads: int, p: float, seed: Tensor) -> Tensor:
    E = csr_eid.numel()
    # empty, not zeros: the kernel writes every (edge, head) (csr_eid is a permutation),
    # and its 0/1 bytes are read as bools in place: one launch, not three
    keep = torch.empty(E, heads, dtype=torch.int8, device=csr_eid.device)
    if E:
        with _device(keep):
            _wrap_triton(_keep_kernel)[(triton.cdiv(E * heads, 1024),)](
                csr_eid, E, keep, seed, float(p), heads, BLOCK_K=1024)
    return keep.view(torch.bool)
