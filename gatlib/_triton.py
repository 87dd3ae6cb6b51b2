r"""Fused sparse attention in Triton: score, softmax and aggregate in one pass per direction.

Three modules: the ``triton.jit`` kernels (:mod:`gatlib._triton_kernels`), the schedules and
launches (:mod:`gatlib._triton_schedule`), and this one: the two operators, their autograd and
the entry point :func:`attention`. How the kernels work, are scheduled and tuned: docs/gpu.md.
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
from ._core import (EdgeScore, acc_dtype, distinct_inputs, promoted_dtype, reference_grads,
                    score_heads)
from ._layout import _Schedule, _schedule_sizes
from ._plan import GraphPlan
from ._triton_kernels import _alpha_kernel, _fwd_kernel, _keep_kernel
from ._triton_schedule import _launch, _merge, _partial_rows, _Plan, _plan, _slot_sums, _tl_acc, _warps

# Wider channel dimensions fall back to the reference.
_MAX_C = 1024
_KINDS = {"gat": 0, "gatv2": 1, "dot": 2}  # EdgeScore.kind -> the kernels' KIND
# KIND 3: GAT over the projected rows (EdgeScore.gat_projected), its terms in-kernel
_KIND_NAMES = {**{v: k for k, v in _KINDS.items()}, 3: "gat"}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# Operators, autograd and entry point.
@dataclass
class _Meta:
    """The non-tensor arguments of one fused call."""

    kind: int
    H: int
    CK: int  # channels of the scorer's per-node terms (1 for GAT)
    CV: int  # channels of the values
    scale: float
    slope: float
    p: float  # dropout probability, 0 when inactive
    need_alpha: bool
    alpha_dtype: torch.dtype
    acc: torch.dtype  # accumulation dtype: float32, or float64 for float64 inputs
    share_v: bool  # value is the scorer's x_src (GATv2 layers; KIND 3: h; dot: the key)
    share_ve: bool  # value_edge is the scorer's edge term (Transformer layers)
    one_k: bool  # the dot kind's key has one head, shared by every head ([N, 1, CK])
    one_v: bool  # the value has one head, shared by every head ([N, 1, CV])


def _meta(kind: int, scale: float, slope: float, p: float, need_alpha: bool,
          alpha_dtype: torch.dtype, share_v: bool, share_ve: bool, ins) -> _Meta:
    s_src, value = ins[0], ins[4]
    H = _heads(kind, ins)
    return _Meta(kind, H, 1 if kind == 0 else s_src.size(-1), value.size(-1), scale, slope,
                 p, need_alpha, alpha_dtype, acc_dtype(*ins), share_v, share_ve,
                 kind == 2 and s_src.size(1) != H, value.size(1) != H)


def _heads(kind: int, ins) -> int:
    """``H`` of a call (:func:`gatlib._core.score_heads`): the query's for the dot
    kind, whose key may have one head; the value may have one too."""
    return score_heads(_KIND_NAMES[kind], ins[0], ins[1])


class _Graph(NamedTuple):
    """What the kernels read of a graph, as the operators take it: the CSR and
    CSC layouts and the two schedules (:func:`_graph_tensors` flattens it)."""

    ptr: Tensor
    src: Tensor  # [E] CSR order
    dst: Tensor  # [E] CSR order
    perm: Tensor  # [E] edge-list position of each CSR position
    csc_edge: Tensor  # [E] CSR position of each CSC position
    csc_dst: Tensor
    csr_eid: Tensor  # perm in the kernels' index dtype
    csc_eid: Tensor  # edge-list position of each CSC position
    dst_items: _Schedule
    src_items: _Schedule

    @property
    def num_dst(self) -> int:
        return self.ptr.numel() - 1

    @property
    def num_edges(self) -> int:
        return self.src.numel()


def _graph_tensors(tp: _Plan, splits: Tuple[bool, bool] = (True, True)) -> List[Tensor]:
    """The operators' ``graph`` argument; ``splits`` (:func:`_split_rows`): whether
    each schedule's split rows are passed (if not, its merges do not launch)."""
    lay = tp.layout
    # csr_eid: perm in the kernels' index dtype, kept on the plan (no copy per call); where it
    # is perm itself, a view (torch.compile traces no autograd function given one tensor twice)
    csr_eid = tp.csr_eid if tp.csr_eid is not lay.perm else lay.perm.view(-1)
    return [lay.ptr, lay.src, lay.dst, lay.perm, lay.csc_edge, lay.csc_dst, csr_eid, tp.csc_eid,
            *_schedule_tensors(tp.dst_items, splits[0]), *_schedule_tensors(tp.src_items, splits[1])]


def _schedule_tensors(s: _Schedule, split: bool = True) -> List[Tensor]:
    parts = (s.split_row, s.split_first, s.split_count)
    if not split:  # none of its rows is split: empty arrays, whose merge never launches
        parts = tuple(t[:0] for t in parts)
    return [s.items, s.bounds, *parts]


def _graph_of(ts: List[Tensor]) -> _Graph:
    ptr, src, dst, perm, csc_edge, csc_dst, csr_eid, csc_eid = ts[:8]
    max_pieces = _schedule_sizes(0, src.numel(), TS._SPLIT)[2]

    def schedule(t: List[Tensor]) -> _Schedule:  # (no split rows: no partial results either)
        return _Schedule(*t, max_pieces if t[2].numel() else 0)

    return _Graph(ptr, src, dst, perm, csc_edge, csc_dst, csr_eid, csc_eid,
                  schedule(ts[8:13]), schedule(ts[13:18]))


def _split_rows(tp: _Plan, like: Tensor) -> Tuple[bool, bool]:
    """Whether the destination and the source schedule of ``tp`` have split rows (whose
    merges must launch). Traced calls and CUDA graph capture assume both; an eager call reads
    it back once per plan, so that graphs without hubs skip the merge launches."""
    if torch.compiler.is_compiling() or type(like) is not torch.Tensor:
        return True, True
    if tp.splits is None:
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            return True, True
        counts = torch.stack([tp.dst_items.bounds[-1], tp.src_items.bounds[-1]])
        dst, src = counts.tolist()  # the number of split rows of each schedule
        tp.splits = (dst > 0, src > 0)
    return tp.splits


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _params(meta: _Meta, like: Tensor) -> Tensor:
    """``[scale, negative_slope, 1 / (1 - p)]`` in the accumulation dtype, on
    ``like``'s device (a fresh constant while an operator is traced: a cached
    fake or functional tensor must not outlive the trace)."""
    keep = 1.0 / (1.0 - meta.p) if meta.p > 0 else 1.0
    if type(like) is not torch.Tensor:
        return torch.tensor([meta.scale, meta.slope, keep], dtype=meta.acc, device=like.device)
    return _params_tensor(meta.scale, meta.slope, keep, meta.acc, like.device)


@functools.lru_cache(maxsize=64)
def _params_tensor(scale: float, slope: float, keep: float, dtype: torch.dtype,
                   device: torch.device) -> Tensor:
    # Loaded in-kernel so that float64 runs use exact constants (scalar kernel
    # arguments are float32); cached to skip a host-to-device copy per call.
    return torch.tensor([scale, slope, keep], dtype=dtype, device=device)


def _operator(name: str, fake):
    """Define ``gatlib::<name>``: a ``custom_op`` with the shapes-only ``fake``, so that a
    compiled call launches the kernels an eager call launches (docs/design.md, "Compiled
    calls launch the eager kernels")."""
    def define(fn):
        op = torch.library.custom_op(f"gatlib::{name}", fn, mutates_args=())
        op.register_fake(fake)
        return op
    return define


def _fake_forward(s_src, s_dst, s_edge, s_att, value, value_edge, bias, seed, graph, kind, scale,
                  slope, p, need_alpha, alpha_dtype, share_v, share_ve):
    num_dst, E = graph[0].numel() - 1, graph[1].numel()
    H = _heads(kind, (s_src, s_dst))
    acc = acc_dtype(s_src, s_dst, s_edge, s_att, value, value_edge, bias)
    alpha = value.new_empty(E, H, dtype=alpha_dtype) if need_alpha else value.new_empty(0)
    out = value.new_empty(num_dst, H, value.size(2))
    return (out, alpha, value.new_empty(num_dst, H, dtype=acc),
            torch.empty_like(out) if bias is not None else value.new_empty(0))


@_operator("triton_attention", _fake_forward)
def _attention_op(s_src: Tensor, s_dst: Optional[Tensor], s_edge: Optional[Tensor],
                  s_att: Optional[Tensor], value: Tensor, value_edge: Optional[Tensor],
                  bias: Optional[Tensor], seed: Optional[Tensor], graph: List[Tensor], kind: int,
                  scale: float, slope: float, p: float, need_alpha: bool, alpha_dtype: torch.dtype,
                  share_v: bool, share_ve: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out [N_dst, H, CV], alpha [E, H] in edge-list order or [0], lse [N_dst, H], attn)``
    (:class:`_FusedAttention` has the maths and the inputs' order); with a ``bias``, ``attn``
    is ``out`` before it (what the backward reads), else ``[0]``."""
    ins = _aligned(s_src, s_dst, s_edge, s_att, value, value_edge, bias)
    meta = _meta(kind, scale, slope, p, need_alpha, alpha_dtype, share_v, share_ve, ins)
    return _forward(meta, _graph_of(graph), *ins, seed)


def _aligned(*tensors: Optional[Tensor]) -> List[Optional[Tensor]]:
    """``tensors``, each one whose data does not start on 16 bytes copied to one that does.
    Triton specialises a kernel on whether each pointer is 16-byte aligned, and a layer's
    projections are views into one product ([G, N, C] cut by group: the second starts N·C
    elements in), so rows whose width is not a multiple of 16 bytes (7 classes) would start
    aligned for some graph sizes and not for others: a new mini-batch would compile the kernels
    again. Such rows load no wider than an element anyway; the copy is of narrow rows."""
    return [t.clone() if t is not None and t.data_ptr() % 16 else t for t in tensors]


def _fake_backward(grad_out, grad_alpha, s_src, s_dst, s_edge, s_att, value, value_edge, bias, seed,
                   out, lse, alpha, graph, kind, scale, slope, p, share_v, share_ve, need):
    ins = (s_src, s_dst, s_edge, s_att, value, value_edge, bias)
    ret = _returned(kind, share_v, need, ins)
    grads = [torch.empty_like(t) if n and t is not None else value.new_empty(0)
             for t, n in zip(ins, ret, strict=True)]
    names, width = _partial_sums(kind, need, ins)
    summed = value.new_empty(len(names), _heads(kind, ins), width, dtype=acc_dtype(*ins)) if width \
        else value.new_empty(0)
    return grads + [summed]


def _returned(kind: int, share_v: bool, need, ins) -> List[bool]:
    """Which of the seven gradients the backward operator returns on their own
    (``need``, but for ``s_src``'s where the two are one tensor, GATv2's ``x_src``,
    and both are needed: the kernel sums it into ``value``'s; and for the
    parameters' that :func:`_partial_sums` returns as one tensor)."""
    need = list(need)
    if share_v and need[0] and need[4]:
        need[0] = False
    if kind == 3 and need[4]:  # h is also the destinations' terms: s_dst's in value's too
        need[1] = False
    if _partial_sums(kind, need, ins)[1]:
        need[3] = need[6] = False
    return need


def _partial_sums(kind: int, need, ins) -> Tuple[Tuple[str, ...], int]:
    """The parameter gradients the kernels leave as per-lane partials (``att``'s, the output
    ``bias``'s) and, where all are one width, that width: they then share one buffer, summed
    into the backward operator's last output ``[k, H, width]`` (cut by :func:`_grads`)."""
    s_src, s_att, value, bias = ins[0], ins[3], ins[4], ins[6]
    names: List[str] = []
    if s_att is not None and need[3]:
        names += ["att_src", "att_dst"] if kind == 3 else ["att"]
    if bias is not None and need[6]:
        names.append("bias")
    # (compared, not put in a set: under torch.compile with dynamic shapes a size
    # can be a SymInt, which does not hash)
    widths = [value.size(-1) if n == "bias" else s_src.size(-1) for n in names]
    one = bool(widths) and all(w == widths[0] for w in widths[1:])
    return tuple(names), (widths[0] if one else 0)


@_operator("triton_attention_backward", _fake_backward)
def _attention_backward_op(grad_out: Optional[Tensor], grad_alpha: Optional[Tensor], s_src: Tensor,
                           s_dst: Optional[Tensor], s_edge: Optional[Tensor], s_att: Optional[Tensor],
                           value: Tensor, value_edge: Optional[Tensor], bias: Optional[Tensor],
                           seed: Optional[Tensor], out: Tensor, lse: Tensor, alpha: Tensor,
                           graph: List[Tensor], kind: int, scale: float, slope: float, p: float,
                           share_v: bool, share_ve: bool, need: List[bool]) -> List[Tensor]:
    """The gradients of the forward operator's seven float inputs (``s_src``, ...,
    ``bias``) from those of ``out`` and ``alpha`` (an empty tensor for each one
    :func:`_returned` leaves out), then :func:`_partial_sums`' summed parameter
    gradients (or an empty tensor)."""
    grad_out, grad_alpha, *ins = _aligned(grad_out, grad_alpha, s_src, s_dst, s_edge, s_att, value,
                                          value_edge, bias)
    meta = _meta(kind, scale, slope, p, alpha.numel() > 0, alpha.dtype, share_v, share_ve, ins)
    grads = _backward(meta, _graph_of(graph), need, grad_out, grad_alpha, *ins, seed, out, lse, alpha)
    return [g if g is not None else value.new_empty(0) for g in grads]


def _setup_context(ctx, inputs, output):
    *ins, seed, graph, kind, scale, slope, p, need_alpha, alpha_dtype, share_v, share_ve = inputs
    out, alpha, lse, attn = output
    ctx.args = (kind, scale, slope, p, share_v, share_ve)
    ctx.num_graph = len(graph)
    ctx.mark_non_differentiable(lse, attn)
    if ins[6] is not None:  # a bias: the backward reads the output without it
        out = attn
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*ins, seed, out, lse, alpha, *graph)


def _grads(ctx, grad_out: Optional[Tensor], grad_alpha: Optional[Tensor]) -> List[Optional[Tensor]]:
    """The gradients of the seven float inputs (``None`` where not needed): the
    backward operator's, or the reference's where they must be differentiable."""
    saved = ctx.saved_tensors
    ins, seed, out, lse, alpha, graph = saved[:7], saved[7], saved[8], saved[9], saved[10], saved[11:]
    need = ctx.needs_input_grad[:7]
    kind, scale, slope, p, share_v, share_ve = ctx.args
    if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
        _record.log("triton.backward:reference")
        return _reference_backward(kind, scale, slope, p, seed, _graph_of(list(graph)), ins, need,
                                   grad_out, grad_alpha)
    *grads, summed = torch.ops.gatlib.triton_attention_backward.default(
        grad_out, grad_alpha, *ins, seed, out, lse, alpha, list(graph), kind, scale, slope, p,
        share_v, share_ve, list(need))
    grads = [g if n else None for g, n in zip(grads, _returned(kind, share_v, need, ins), strict=True)]
    names, width = _partial_sums(kind, need, ins)
    if width:  # the parameters' gradients, summed as one: each its piece
        if "att" in names or "att_src" in names:
            att = summed[:2] if kind == 3 else summed[0]
            grads[3] = att.to(ins[3].dtype)
        if "bias" in names:
            grads[6] = summed[-1].reshape(ins[6].shape).to(ins[6].dtype)
    return grads


def _op_backward(ctx, grad_out, grad_alpha, _grad_lse, _grad_attn):
    return (*_grads(ctx, grad_out, grad_alpha), None, [None] * ctx.num_graph, *([None] * 8))


_attention_op.register_autograd(_op_backward, setup_context=_setup_context)


class _FusedAttention(torch.autograd.Function):
    r""":func:`_attention_op` with its backward, the graph's tensors last (``torch.func.grad``
    cannot differentiate the bare operator in torch 2.13). One head shown; ``D`` the dropout mask.

    Forward, per destination ``i`` (online softmax over tiles of in-edges)::

        m, l, acc = -inf, 0, 0
        for each tile of edges j -> i:
            s_j   = score(i, j)                       # GAT / GATv2 / dot, in-kernel
            m'    = max(m, max_j s_j)
            p_j   = exp(s_j - m')
            l     = l * exp(m - m') + sum_j p_j
            acc   = acc * exp(m - m') + sum_j p_j * D_ij / (1 - p) * (v_j + u_ij)
            m     = m'
        out_i = acc / l;  lse_i = m + log(l)          # saved: out [N, H, C], lse [N, H]
        returned: out_i + b with a bias b, else out_i
        alpha_ij = exp(s_ij - lse_i)                  # only when asked for

    Backward, with ``g_i = dL/dout_i`` and ``A_ij = alpha_ij D_ij / (1 - p)``::

        Delta_i = <g_i, out_i> + sum_j alpha_ij * dL/dalpha_ij     # [N, H]
        db     = sum_i g_i                                         (per-lane partials)
        # destination-major (CSR) kernel, recomputing s_ij and alpha_ij from lse_i:
        dP_ij  = D_ij / (1 - p) * <g_i, v_j + u_ij> + dL/dalpha_ij
        dS_ij  = alpha_ij * (dP_ij - Delta_i)                      # softmax gradient
        du_ij  = A_ij g_i                                          # value_edge
        GAT:   dz_ij = dS_ij * leaky'(z_ij);  da_dst_i = sum_j dz_ij;  da_edge_ij = dz_ij
        GATv2: dz_ij = dS_ij * att ⊙ leaky'(z_ij);  dx_dst_i = sum_j dz_ij;  de_ij = dz_ij
               datt  = sum_ij dS_ij * leaky(z_ij)                   (per-lane partials)
        dot:   dq_i  = scale * sum_j dS_ij (k_j + e_ij);  de_ij = scale * dS_ij q_i
        # source-major (CSC) kernel, gathering A and dS (GAT: dz) saved as [E, H]:
        dv_j = sum_i A_ij g_i
        GAT: da_src_j = sum_i dz_ij;  GATv2: dx_src_j = sum_i dS_ij att ⊙ leaky'(z_ij);
        dot: dk_j = scale * sum_i dS_ij q_i
        GAT from h (KIND 3; a_src.h_j and a_dst.h_i formed in-kernel, dt_j = da_dst_j
        from the destination-major kernel):
             dh_j = dv_j + (sum_i dz_ij) a_src + dt_j a_dst
             da_src = sum_j (sum_i dz_ij) h_j;  da_dst = sum_j dt_j h_j   (per-lane partials)

    Inputs, in the fused CPU operator's order: the scorer's ``s_src`` (a_src / x_src / key),
    ``s_dst`` (a_dst / x_dst / query), ``s_edge``, ``s_att`` (GATv2's ``att [H, CK]``), then
    ``value [N_src, H, CV]``, ``value_edge [E, H, CV]`` or None and the bias ``b [H * CV]`` or
    None. With a bias the forward also keeps ``out_i`` for ``Delta`` (taking ``b`` off again
    would round ``Delta`` at the scale of ``|out_i + b|``).
    """

    @staticmethod
    def forward(s_src, s_dst, s_edge, s_att, value, value_edge, bias, seed, kind, scale, slope, p,
                need_alpha, alpha_dtype, share_v, share_ve, *graph):
        return torch.ops.gatlib.triton_attention.default(
            s_src, s_dst, s_edge, s_att, value, value_edge, bias, seed, list(graph), kind, scale,
            slope, p, need_alpha, alpha_dtype, share_v, share_ve)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, (*inputs[:8], inputs[16:], *inputs[8:16]), output)

    @staticmethod
    def backward(ctx, grad_out, grad_alpha, _grad_lse, _grad_attn):
        return (*_grads(ctx, grad_out, grad_alpha), *([None] * (9 + ctx.num_graph)))


def _forward(meta: _Meta, graph: _Graph, s_src, s_dst, s_edge, s_att, value, value_edge, bias, seed):
    _record.log("triton")
    plan = lay = graph
    H, CK, CV, dev = meta.H, meta.CK, meta.CV, value.device
    acc = meta.acc
    N_dst, E = lay.num_dst, lay.num_edges
    items = plan.dst_items
    out = torch.empty(N_dst, H, CV, dtype=value.dtype, device=dev)
    lse = torch.empty(N_dst, H, dtype=acc, device=dev)
    part_out = torch.empty(items.max_pieces, H, CV, dtype=acc, device=dev)
    part_lse = torch.empty(items.max_pieces, H, dtype=acc, device=dev)
    # with a bias: out_b = out + bias is returned, out kept for the backward (its Delta
    # then rounds at the attention's scale, not at the biased output's)
    out_b = torch.empty_like(out) if bias is not None else None
    coef = _params(meta, value)
    dummy = value
    consts = _consts(meta, s_dst, s_edge, value_edge)
    with _device(value):
        _launch("_fwd_kernel", items,
                lay.src, plan.csr_eid, s_src, _or(s_dst, dummy), _or(s_edge, dummy),
                _or(s_att, dummy), value, _or(value_edge, dummy), _or(bias, dummy), coef,
                out, _or(out_b, dummy), lse, part_out, part_lse, _or(seed, dummy), meta.p,
                DEG=_degree(E, N_dst), H=H, CK=CK, CV=CV, DROPOUT=meta.p > 0, HAS_BIAS=bias is not None, **consts)
        _merge(out, part_out, items, H, lse, part_lse, bias=bias, out_b=out_b)
        alpha = value.new_empty(0)  # (an operator returns tensors only)
        if meta.need_alpha:
            alpha = torch.empty(E, H, dtype=meta.alpha_dtype, device=dev)
            if E:
                # independent (edge, head) lanes: as many as fill the tile
                block_k = min(1024, max(1, 1024 // consts["BLOCK_CK"]))
                _alpha_kernel[(triton.cdiv(E * H, block_k),)](
                    lay.src, lay.dst, plan.csr_eid, E, s_src, _or(s_dst, dummy),
                    _or(s_edge, dummy), _or(s_att, dummy), coef, lse, alpha, H, CK,
                    KIND=meta.kind, HAS_DST=consts["HAS_DST"], HAS_EDGE=consts["HAS_EDGE"],
                    ONE_K=meta.one_k, ACC=consts["ACC"], BLOCK_K=block_k, BLOCK_CK=consts["BLOCK_CK"],
                    num_warps=_warps(consts["BLOCK_CK"], consts["ACC"]))
    if out_b is None:
        return out, alpha, lse, value.new_empty(0)
    return out_b, alpha, lse, out


def _degree(edges: int, rows: int) -> int:
    """A launch's degree bucket, a tuning key (``DEG``): the mean degree of its ``rows`` (of
    ``edges`` edges in all) below 4, 16, 64 or above, 0 to 3. A graph of other degrees (a
    products-like one beside Cora) is tuned for its own, while a graph's mini-batches share one."""
    mean = edges / max(rows, 1)
    return sum(mean >= t for t in (4, 16, 64))


def _backward(meta: _Meta, graph: _Graph, need, grad_out, grad_alpha, s_src, s_dst, s_edge, s_att,
              value, value_edge, bias, seed, out, lse, alpha):
    _record.log("triton.backward")
    plan = lay = graph
    H, CK, CV, dev, acc = meta.H, meta.CK, meta.CV, value.device, meta.acc
    E = lay.num_edges
    # need: (s_src, s_dst, s_edge, s_att, value, value_edge, bias)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    g = grad_out.contiguous()
    # (no weights were returned: their [0] placeholder may get a [0] gradient)
    galpha = grad_alpha is not None and alpha.numel() > 0
    grad_alpha = grad_alpha if galpha else None
    delta_alpha = None
    if galpha:  # sum_j alpha_ij dL/dalpha_ij; the kernel adds <g_i, out_i>
        grad_alpha = grad_alpha.contiguous()
        # one [E, H] temporary in acc either way (grad_alpha is the caller's: not written into)
        ag = grad_alpha.to(acc)
        ag = ag * alpha if ag is grad_alpha else ag.mul_(alpha)
        ag = ag.index_select(0, lay.perm)  # [E, H], CSR
        delta_alpha = torch.segment_reduce(ag, "sum", offsets=lay.ptr, unsafe=True)  # [N_dst, H]
    consts = _consts(meta, s_dst, s_edge, value_edge)
    dummy = value
    coef = _params(meta, value)
    a_buf = torch.empty(E, H, dtype=acc, device=dev)
    ds_buf = torch.empty(E, H, dtype=acc, device=dev)
    ins = (s_src, s_dst, s_edge, s_att, value, value_edge, bias)
    returned = _returned(meta.kind, meta.share_v, need, ins)
    need_vedge = value_edge is not None and need[5]
    need_edge = s_edge is not None and need[2]
    need_dst = s_dst is not None and returned[1]
    need_att = s_att is not None and need[3]
    projected = meta.kind == 3
    # KIND 3: the destination term's gradient [N, H], for the source kernel
    need_dt = projected and (need[4] or need_att)
    d_vedge = torch.empty_like(value_edge) if need_vedge else None
    d_edge = torch.empty_like(s_edge) if need_edge else None
    d_dst = torch.empty_like(s_dst) if need_dst else None
    if need_dt:
        d_dst = torch.empty(lay.num_dst, H, dtype=acc, device=dev)
    items = plan.dst_items
    part_dst = torch.empty(items.max_pieces, H, *([CK] if meta.kind in (1, 2) else []),
                           dtype=acc, device=dev) if d_dst is not None else None
    width = max(consts["BLOCK_CK"], consts["BLOCK_CV"])
    # the parameters' gradients (_partial_sums): a fixed number of per-lane partial rows (the
    # kernels zero those they leave), summed after the launches, in one buffer where one width
    names, one_width = _partial_sums(meta.kind, need, ins)
    rows = _partial_rows(dev, H)
    if one_width:
        part_buf = torch.empty(len(names), rows, one_width, dtype=acc, device=dev)
        parts = dict(zip(names, part_buf.unbind(0), strict=True))
    else:
        parts = {n: torch.empty(rows, CV if n == "bias" else CK, dtype=acc, device=dev)
                 for n in names}
    part_att, part_bias = parts.get("att"), parts.get("bias")
    with _device(value):
        _launch("_bwd_dst_kernel", items,
                lay.src, plan.csr_eid, lay.ptr, s_src, _or(s_dst, dummy), _or(s_edge, dummy),
                _or(s_att, dummy), value, _or(value_edge, dummy), coef,
                g, out, lse, _or(delta_alpha, dummy), _or(grad_alpha, dummy), a_buf, ds_buf,
                _or(d_vedge, dummy), _or(d_edge, dummy), _or(d_dst, dummy),
                _or(part_dst, dummy), _or(seed, dummy), meta.p, _or(part_att, dummy),
                _or(part_bias, dummy), rows, DEG=_degree(E, lay.num_dst), H=H, CK=CK, CV=CV,
                DROPOUT=meta.p > 0, GALPHA=galpha, NEED_VEDGE=need_vedge,
                NEED_EDGE=need_edge, NEED_DST=d_dst is not None, NEED_ATT=part_att is not None,
                NEED_BIAS=part_bias is not None, SLOTS=_slot_sums(width), **consts)
        if d_dst is not None:
            _merge(d_dst, part_dst, items, H)
        need_value = need[4]
        # the source term's gradient: KIND 3 needs it for h's and the att gradients
        need_src = need[0] or need_dt
        # value is the scorer's x_src (GATv2; KIND 3: h): both gradients summed in the kernel
        sum_src = need[0] and not returned[0]
        d_value = d_src = None
        if need_value or need_src:
            sitems = plan.src_items
            # a lane writes its (source, head)'s gradient: of a value or key of one
            # head, each head's row in the accumulation dtype, summed below
            if need_value:
                d_value = (value.new_empty(value.size(0), H, CV, dtype=acc) if meta.one_v
                           else torch.empty_like(value))
            if need_src and not (sum_src or projected):
                d_src = (s_src.new_empty(s_src.size(0), H, CK, dtype=acc) if meta.one_k
                         else torch.empty_like(s_src))
            part_value = torch.empty(sitems.max_pieces, H, CV, dtype=acc, device=dev) \
                if need_value else None
            part_src = torch.empty(sitems.max_pieces, H, *([CK] if meta.kind else []),
                                   dtype=acc, device=dev) if d_src is not None else None
            src = dict(KIND=meta.kind, HAS_EDGE=consts["HAS_EDGE"], NEED_VALUE=need_value,
                       NEED_SRC=need_src, SUM_SRC=sum_src, NEED_ATT="att_src" in parts,
                       ACC=consts["ACC"], BLOCK_CK=consts["BLOCK_CK"],
                       BLOCK_CV=consts["BLOCK_CV"])
            _launch("_bwd_src_kernel", sitems,
                    lay.csc_edge, lay.csc_dst, plan.csc_eid, lay.src, s_src, _or(s_dst, dummy),
                    _or(s_edge, dummy), _or(s_att, dummy), coef, g, a_buf, ds_buf,
                    _or(d_value, dummy), _or(part_value, dummy), _or(d_src, dummy),
                    _or(part_src, dummy), _or(d_dst, dummy),
                    _or(parts.get("att_src"), dummy), _or(parts.get("att_dst"), dummy),
                    rows, DEG=_degree(E, value.size(0)), H=H, CK=CK, CV=CV,
                    SLOTS=_slot_sums(TS._width("_bwd_src_kernel", src)), **src)
            if need_value:
                _merge(d_value, part_value, sitems, H)
                if meta.one_v:
                    d_value = d_value.sum(1, keepdim=True).to(value.dtype)
            if d_src is not None:
                _merge(d_src, part_src, sitems, H)
                if meta.one_k:
                    d_src = d_src.sum(1, keepdim=True).to(s_src.dtype)
    d_att = d_bias = summed = None
    if one_width:  # [k, H, width], cut by _grads
        summed = part_buf.view(len(names), -1, H, one_width).sum(1)
    else:
        if part_att is not None:
            d_att = part_att.view(-1, H, CK).sum(0).to(s_att.dtype)
        if part_bias is not None:
            d_bias = part_bias.view(-1, H * CV).sum(0).to(bias.dtype)
    return [d_src, d_dst if need_dst else None, d_edge, d_att, d_value, d_vedge, d_bias, summed]


def _reference_backward(kind: int, scale: float, slope: float, p: float, seed: Optional[Tensor],
                        graph: _Graph, ins, need, g_out, g_alpha) -> List[Optional[Tensor]]:
    """Differentiable gradients of the same call: the reference's, on the edge list
    with the kernels' dropout mask. Builds ``[E, H, C]`` tensors, as the reference does."""
    bias = ins[6]
    drop = None
    if p > 0:
        acc = acc_dtype(*ins)
        keep = _keep_mask(graph.csr_eid, _heads(kind, ins), p, seed)
        drop = keep.to(acc) * (1.0 / (1.0 - p))
    perm = graph.perm.long()
    src = torch.empty_like(perm).index_copy_(0, perm, graph.src.long())  # edge-list order
    dst = torch.empty_like(perm).index_copy_(0, perm, graph.dst.long())
    grads = reference_grads(_KIND_NAMES[kind], scale, slope, ins[:6], src, dst, graph.num_dst, drop,
                            (g_out, g_alpha), need[:6])
    d_bias = None
    if bias is not None and need[6]:  # out + bias: the sum of out's gradient over the rows
        d_bias = (g_out.sum(0).reshape(bias.shape).to(bias.dtype) if g_out is not None
                  else torch.zeros_like(bias))
    return grads + [d_bias]


def _or(t: Optional[Tensor], default: Tensor) -> Tensor:
    # Kernels take a pointer for every optional tensor; an absent one is never read.
    return default if t is None else t


def _consts(meta: _Meta, s_dst, s_edge, value_edge) -> dict:
    return dict(
        KIND=meta.kind, HAS_DST=s_dst is not None, HAS_EDGE=s_edge is not None,
        HAS_VEDGE=value_edge is not None, SHARE_V=meta.share_v, SHARE_VE=meta.share_ve,
        ONE_K=meta.one_k, ONE_V=meta.one_v,
        ACC=_tl_acc(meta.acc), BLOCK_CK=triton.next_power_of_2(meta.CK),
        BLOCK_CV=triton.next_power_of_2(meta.CV),
    )


def _draw_seed(device: torch.device) -> Tensor:
    """A dropout seed drawn on ``device`` by its default generator, read by the kernels from
    device memory: no host sync, and a new seed per CUDA graph replay (docs/design.md,
    "Dropout and determinism")."""
    return torch.randint(0, 2**31 - 1, (1,), device=device)


def _check_interpreter() -> None:
    """CPU tensors need every jit function — ours and triton.language's own
    (``tl.sum``, ``tl.rand``) — built for the interpreter, which happens only
    if ``TRITON_INTERPRET=1`` was set before triton was first imported."""
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
    CK = 1 if score.kind == "gat" and not score.projected else score.src.size(-1)
    if max(CK, value.size(-1)) > _MAX_C:
        return f"the Triton kernels take at most {_MAX_C} channels per head; got {max(CK, value.size(-1))}"
    if dev.type == "cpu":
        _check_interpreter()
    return None


def attention(score: EdgeScore, value: Tensor, plan: GraphPlan, value_edge: Optional[Tensor],
              p: float, need_alpha: bool,
              bias: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Fused attention (:class:`_FusedAttention`) of a call :func:`unsupported` accepts:
    ``(out [N_dst, H, C] in value's dtype, alpha [E, H] in edge-list order or None)``.
    ``value`` is ``[N_src, H, C]`` (or ``[N_src, 1, C]`` shared by every head), ``p`` the
    dropout in effect, ``bias`` an optional ``[H * C]`` added to every row of ``out``."""
    kind = 3 if score.projected else _KINDS[score.kind]
    s_src, s_dst, s_edge, s_att = score.tensors()
    if kind == 3 and not (value is s_src and s_dst is s_src):
        raise ValueError("a projected GAT score's h must be the values (gatlib's dispatcher "
                         "gives any other call the per-node terms: EdgeScore.node_terms)")
    # a value (or dot key) of one head [N, 1, C] goes to the kernels as it is (ONE_V, ONE_K)
    H = score.heads
    if bias is not None and (bias.dtype != value.dtype or bias.device != value.device
                             or bias.numel() != H * value.size(-1)):
        raise ValueError(f"bias must be [H * C] = [{H * value.size(-1)}] in the values' dtype "
                         f"({value.dtype}) on their device; got {tuple(bias.shape)} {bias.dtype} "
                         f"on {bias.device}")
    tensors = (s_src, s_dst, s_edge, s_att, value, value_edge, bias)
    share_v = kind in (1, 2, 3) and s_src is value
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
        out, alpha, _, _ = _FusedAttention.apply(*args, *graph)
    else:  # nothing to differentiate: the operator alone (as the fused CPU kernel)
        out, alpha, _, _ = torch.ops.gatlib.triton_attention.default(*ins, seed, graph, *args[8:])
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
