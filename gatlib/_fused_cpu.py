r"""Fused sparse attention for CPU tensors: nothing ``[E, H, C]`` is kept for backward.

Node tensors ``[N, H, C]`` and per-edge ``[E, H]`` statistics (CSR order) only; the sparse work
runs as compiled row passes (:mod:`gatlib._native`) over the plan's CSR and CSC, edge features
over blocks of edges (:mod:`gatlib._blocks`), each kind's score by its passes
(:mod:`gatlib._cpu_passes`, held to :mod:`gatlib._scores`' formulas). This module: softmax and
aggregation, the two ``torch.library`` operators, their autograd and the entry point
:func:`attention` (docs/design.md, "The fused CPU kernel as operators").
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _blocks as B
from . import _native, _record
from ._core import (EdgeScore, acc_dtype, distinct_inputs, promoted_dtype, reference_grads,
                    score_heads)
from ._layout import Layout, at_least
from ._plan import GraphPlan
from ._cpu_passes import PASSES

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# Stages 2 and 3: softmax and aggregation (shared by every score kind).
def _recomputed_alpha(e: Tensor, lse: Tensor, lay: Layout) -> Tensor:
    """The softmax weights again from the scores ``e`` (consumed) and ``lse``."""
    return B.per_edge_(e, lse, lay, lambda eb, lb: eb.sub_(lb).exp_())


def _softmax_aggregate(e: Tensor, v: Tensor, u: Optional[Tensor], lay: Layout,
                       drop: Optional[Tensor], need_lse: bool = True
                       ) -> Tuple[Tensor, Tensor, Tensor]:
    r"""Forward of stages 2 and 3, all heads at once (``e`` ``[E, H]`` CSR order, consumed)::

        for each destination i (one walk of the CSR):
            m_i      = max_j e_ij                                 # [H]
            alpha_ij = exp(e_ij - m_i) / sum_k exp(e_ik - m_i)    # in place of e
            out_i    = sum_j alpha_ij drop_ij v_j                 # one v row per edge
        out_i += sum_j a_ij u_ij                                  # edge blocks, u in edge-list order

    Returns ``(out [N_dst, H, C], alpha [E, H], lse [N_dst, H])``, ``lse`` empty unless ``need_lse``.
    """
    drop = B.edge_weights(drop, v.dtype)
    out, lse = _native.ops().softmax_aggregate(lay.ptr, lay.src, e, drop, v, need_lse)
    alpha = e
    if u is not None:
        H, C = out.shape[1:]
        a = alpha if drop is None else alpha * drop  # [E, H]

        def block(e0, e1, part):
            ub = u.index_select(0, lay.perm[e0:e1]).to(out.dtype)  # [n, H, C]
            B.add_row_sums(out, ub.mul_(a[e0:e1, :, None]), lay, e0, e1)

        B.for_blocks(lay, H * C * out.element_size(), block)
    return out, alpha, lse


def _softmax_aggregate_backward(g_out, g_alpha, alpha, v, u, lay, drop, need_v, need_u,
                                need_drop=False):
    r"""Backward of :func:`_softmax_aggregate`, with ``g_i = dL/dout_i``, ``ga_ij =
    dL/dalpha_ij`` and ``a = alpha * drop``::

        for each source j (one walk of the CSC), each out-edge j -> i:
            dot_ij = <g_i, v_j>;  dv_j += a_ij g_i                # one g row per edge
        dot_ij   += <g_i, u_ij>;  du_ij = a_ij g_i                # edge blocks, where u is
        dalpha_ij = drop_ij * dot_ij + ga_ij
        de_ij     = alpha_ij * (dalpha_ij - sum_k alpha_ik dalpha_ik)   # one walk of the CSR
        ddrop_ij  = alpha_ij * dot_ij                             # when drop carries edge weights

    Returns ``(de [E, H] CSR order, dv, du, ddrop)``, ``None`` where not computed.
    """
    drop = B.edge_weights(drop, alpha.dtype)
    a = alpha if drop is None else alpha * drop  # [E, H]
    # [E, H] temporaries are few: at ogbn-products' scale each is 2 GB (H=4, float32)
    d_alpha = None if g_alpha is None else g_alpha.clone(memory_format=torch.contiguous_format)
    dv = du = d_drop = None
    if g_out is not None:
        g = g_out.contiguous()  # [N_dst, H, C]
        dot, dv = _native.ops().sddmm_spmm(lay.csc_ptr, lay.csc_dst, lay.csc_edge, a, g, v, need_v)
        dv = dv if need_v else None
        if u is not None:
            H, C = g.shape[1:]
            if need_u:
                du = torch.empty_like(u)

            def block(e0, e1, part):
                g_e = g.index_select(0, lay.dst[e0:e1])  # [n, H, C]
                ub = u.index_select(0, lay.perm[e0:e1]).to(g.dtype)
                dot[e0:e1] += torch.linalg.vecdot(g_e, ub)
                if du is not None:
                    B.scatter_rows(du, g_e.mul_(a[e0:e1, :, None]), lay, e0, e1)

            B.for_blocks(lay, H * C * g.element_size(), block)
        if need_drop:
            d_drop = alpha * dot
        if drop is not None:
            dot.mul_(drop)
        d_alpha = dot if d_alpha is None else d_alpha.add_(dot)
        del dot
    a = None  # an [E, H] less during the softmax gradient (a cell of block(): not del'd)
    if d_alpha is None:
        return torch.zeros_like(alpha), dv, du, d_drop
    return _native.ops().softmax_backward(lay.ptr, alpha, d_alpha), dv, du, d_drop

# The operators: forward and backward of one call, and their autograd.
def layout_tensors(lay: Layout) -> List[Tensor]:
    """The index tensors of ``lay`` as the operators take them, in one list: the
    CSR ``(ptr, src, dst, perm)`` and the CSC ``(csc_ptr, csc_edge, csc_dst)``."""
    return [lay.ptr, lay.src, lay.dst, lay.perm, lay.csc_ptr, lay.csc_edge, lay.csc_dst]


def _layout_of(layout: Sequence[Tensor], num_src: int) -> Layout:
    """The :class:`Layout` that :func:`layout_tensors` flattened."""
    ptr, src, dst, perm, csc_ptr, csc_edge, csc_dst = layout
    return Layout(ptr=ptr, src=src, dst=dst, perm=perm, num_src=num_src, num_dst=ptr.numel() - 1,
                  csc=(csc_ptr, csc_edge, csc_dst))


def _no_autocast():
    """Autocast off for the block (the kernel picks its own precision: float32
    for float16/bfloat16 inputs, which the caller casts); a no-op context where
    it is off already, the usual case."""
    if torch.is_autocast_enabled("cpu"):
        return torch.autocast("cpu", enabled=False)
    return contextlib.nullcontext()


@torch.library.custom_op("gatlib::fused_cpu_attention", mutates_args=(), device_types="cpu")
def _attention_op(kind: str, scale: float, slope: float, s_src: Tensor, s_dst: Optional[Tensor],
                  s_edge: Optional[Tensor], s_att: Optional[Tensor], value: Tensor,
                  value_edge: Optional[Tensor], drop: Optional[Tensor], layout: List[Tensor],
                  num_src: int, keep_lse: bool) -> Tuple[Tensor, Tensor, Tensor]:
    r"""Scores, softmax and aggregation of one call, nothing ``[E, H, C]`` kept::

        e_ij     = score of kind (s_src, s_dst, s_edge, s_att)     # stage 1, [E, H]
        alpha_ij = exp(e_ij - lse_i),  lse_i = log sum_j exp(e_ij) # stage 2
        out_i    = sum_j alpha_ij drop_ij (v_j + u_ij)             # stage 3

    Inputs in the compute dtype; ``s_edge``, ``value_edge`` in edge-list order, ``drop`` [E, H]
    in CSR order (the dropout mask over ``1 - p``, times the edge weights). Returns ``out
    [N_dst, H, C]``, ``alpha [E, H]`` in CSR order, ``lse [N_dst, H]`` (``[0]`` unless ``keep_lse``).
    """
    _record.log("fused")
    lay = _layout_of(layout, num_src)
    with _no_autocast():
        e = PASSES[kind].cpu_forward(s_src, s_dst, s_edge, s_att, lay, scale, slope)  # [E, H]
        return _softmax_aggregate(e, value, value_edge, lay, drop, keep_lse)


@_attention_op.register_fake
def _(kind, scale, slope, s_src, s_dst, s_edge, s_att, value, value_edge, drop, layout, num_src,
      keep_lse):
    num_dst, E = layout[0].size(0) - 1, layout[1].size(0)
    H, C = score_heads(kind, s_src, s_dst), value.size(2)
    lse = value.new_empty(num_dst, H) if keep_lse else value.new_empty(0)
    return value.new_empty(num_dst, H, C), value.new_empty(E, H), lse


@torch.library.custom_op("gatlib::fused_cpu_attention_backward", mutates_args=(), device_types="cpu")
def _attention_backward_op(kind: str, scale: float, slope: float, g_out: Optional[Tensor],
                           g_alpha: Optional[Tensor], s_src: Tensor, s_dst: Optional[Tensor],
                           s_edge: Optional[Tensor], s_att: Optional[Tensor], value: Tensor,
                           value_edge: Optional[Tensor], drop: Optional[Tensor], saved: Tensor,
                           recompute: bool, kept_layout: List[Tensor], num_src: int,
                           need: List[bool]) -> List[Tensor]:
    r"""Gradients of :func:`_attention_op`'s seven tensor inputs from those of ``out`` and
    ``alpha`` (either may be ``None``)::

        alpha_ij  = exp(e_ij - lse_i)   # recomputed where saved is lse (recompute)
        dalpha_ij = drop_ij <g_i, v_j + u_ij> + ga_ij
        de_ij     = alpha_ij (dalpha_ij - sum_k alpha_ik dalpha_ik)   # softmax gradient
        dv_j = sum_i alpha_ij drop_ij g_i;  du_ij = alpha_ij drop_ij g_i
        then de through the kind's ``cpu_backward`` (:mod:`gatlib._cpu_passes`)

    ``kept_layout``: :func:`_kept_layout`'s. An empty tensor stands for each gradient ``need``
    does not ask for (and for an absent input).
    """
    _record.log("fused.backward")
    lay = _layout_of(_full_layout(kept_layout), num_src)
    with _no_autocast():
        alpha = saved
        if recompute:
            e = PASSES["gat"].cpu_forward(s_src, s_dst, s_edge, s_att, lay, scale, slope)
            alpha = _recomputed_alpha(e, saved, lay)
        de, dv, du, d_drop = _softmax_aggregate_backward(g_out, g_alpha, alpha, value, value_edge,
                                                         lay, drop, need[4], need[5], need[6])
        score_grads = (None,) * 4
        if any(need[:4]):
            score_grads = PASSES[kind].cpu_backward(de, s_src, s_dst, s_edge, s_att, lay, scale, slope,
                                           need[:4])
    ins = (s_src, s_dst, s_edge, s_att, value, value_edge, drop)
    # what was asked for and is zero (no gradient flowed to it) as zeros, what was
    # not asked for as an empty tensor: the operator returns tensors only
    return [g if g is not None else torch.zeros_like(t) if n and t is not None else s_src.new_empty(0)
            for g, t, n in zip((*score_grads, dv, du, d_drop), ins, need, strict=True)]


@_attention_backward_op.register_fake
def _(kind, scale, slope, g_out, g_alpha, s_src, s_dst, s_edge, s_att, value, value_edge, drop,
      saved, recompute, kept_layout, num_src, need):
    ins = (s_src, s_dst, s_edge, s_att, value, value_edge, drop)
    return [torch.empty_like(t) if n and t is not None else s_src.new_empty(0)
            for t, n in zip(ins, need, strict=True)]


def _kept_layout(layout: Sequence[Tensor], edge_order: bool) -> List[Tensor]:
    """What backward keeps of :func:`layout_tensors`: ``ptr``, ``src``, ``csc_ptr``,
    ``csc_edge`` and ``perm`` where per-edge inputs are read in edge-list order. The
    destinations are derived again (:func:`_full_layout`), not kept as a second copy of the edges."""
    ptr, src, dst, perm, csc_ptr, csc_edge, csc_dst = layout
    return [ptr, src, csc_ptr, csc_edge, perm if edge_order else perm.new_empty(0)]


def _full_layout(kept: Sequence[Tensor]) -> List[Tensor]:
    """:func:`layout_tensors` again from what :func:`_kept_layout` kept."""
    ptr, src, csc_ptr, csc_edge, perm = kept
    num_dst = ptr.numel() - 1
    dst = torch.repeat_interleave(torch.arange(num_dst, dtype=src.dtype, device=src.device),
                                  ptr.diff(), output_size=src.numel())  # [E] CSR order
    return [ptr, src, dst, perm, csc_ptr, csc_edge, dst.index_select(0, csc_edge)]


def _save(ctx, args, tensors, layout, num_src, keep_lse, output) -> None:
    """What backward needs of a forward call (``args``: kind, scale, slope; the
    seven tensor inputs; the layout tensors, of which :func:`_kept_layout`)."""
    s_edge, value_edge = tensors[2], tensors[5]
    kept = _kept_layout(layout, edge_order=s_edge is not None or value_edge is not None)
    ctx.args, ctx.num_src, ctx.recompute, ctx.num_layout = args, num_src, keep_lse, len(layout)
    ctx.set_materialize_grads(False)  # an unused output gets None, not an [E, H] of zeros
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(*tensors, output[2] if keep_lse else output[1], *kept)


def _grads(ctx, g_out: Optional[Tensor], g_alpha: Optional[Tensor]) -> List[Optional[Tensor]]:
    """The gradients of the seven tensor inputs (``None`` where not needed): the
    backward operator's, or the reference's where they must be differentiable."""
    kind, scale, slope = ctx.args
    saved = ctx.saved_tensors
    ins, kept = saved[:7], list(saved[8:])
    need = ctx.needs_input_grad[3:10]
    if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
        _record.log("fused.backward:reference")
        return _reference_backward(kind, scale, slope, ins, _full_layout(kept), need, g_out,
                                   g_alpha)
    grads = torch.ops.gatlib.fused_cpu_attention_backward.default(
        kind, scale, slope, g_out, g_alpha, *ins, saved[7], ctx.recompute, kept, ctx.num_src,
        list(need))
    return [g if n else None for g, n in zip(grads, need, strict=True)]


def _op_setup_context(ctx, inputs, output):
    kind, scale, slope, *tensors, layout, num_src, keep_lse = inputs
    _save(ctx, (kind, scale, slope), tensors, layout, num_src, keep_lse, output)


def _op_backward(ctx, g_out, g_alpha, g_lse):
    return (None, None, None, *_grads(ctx, g_out, g_alpha), [None] * ctx.num_layout, None, None)


_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)


class _FusedAttention(torch.autograd.Function):
    """:func:`_attention_op` with its registered backward, the layout tensors last and one by
    one (``torch.jit.trace`` records an autograd function's tensor arguments, not a list's;
    ``torch.func.grad`` cannot differentiate the bare operator in torch 2.13)."""

    @staticmethod
    def forward(kind, scale, slope, s_src, s_dst, s_edge, s_att, value, value_edge, drop,
                num_src, keep_lse, *layout):
        return torch.ops.gatlib.fused_cpu_attention.default(
            kind, scale, slope, s_src, s_dst, s_edge, s_att, value, value_edge, drop, list(layout),
            num_src, keep_lse)

    @staticmethod
    def setup_context(ctx, inputs, output):
        kind, scale, slope, *rest = inputs
        _save(ctx, (kind, scale, slope), rest[:7], rest[9:], rest[7], rest[8], output)

    @staticmethod
    def backward(ctx, g_out, g_alpha, g_lse):
        return (None, None, None, *_grads(ctx, g_out, g_alpha), None, None,
                *([None] * ctx.num_layout))


def _reference_backward(kind: str, scale: float, slope: float, ins: Sequence[Optional[Tensor]],
                        layout: Sequence[Tensor], need: Sequence[bool],
                        g_out: Optional[Tensor], g_alpha: Optional[Tensor]) -> List[Optional[Tensor]]:
    """Differentiable gradients of the same call: the reference's, on the edges in
    CSR order (the order of ``alpha`` and ``drop``). Builds ``[E, H, C]`` tensors,
    as the reference does."""
    *tensors, drop = ins
    ptr, src, dst, perm = layout[:4]
    perm = perm if perm.numel() else None  # (kept only where edge inputs are read through it)
    if need[6]:  # edge weights in drop: an input like the others (already in CSR order)
        tensors, drop = [*tensors, drop], None
    with torch.autocast("cpu", enabled=False):
        grads = reference_grads(kind, scale, slope, tensors, src.long(), dst.long(),
                                ptr.numel() - 1, drop, (g_out, g_alpha), need[:7],
                                edge_order=perm)
    return [*grads, None][:7]


def _recomputes_alpha(kind: str, num_edges: int, heads: int) -> bool:
    """Whether backward recomputes ``alpha`` from the saved ``lse`` (GAT, whose
    scores are cheap to recompute, on graphs of :data:`RECOMPUTE_MIN_ENTRIES` or
    more edges times heads) instead of saving it."""
    return kind == "gat" and at_least(num_edges * heads, RECOMPUTE_MIN_ENTRIES)


# On small graphs the recomputation's few extra ops cost more than the memory saves;
# below 2^16 entries the weights are at most 256 KiB (docs/design.md, "GAT recomputes
# its weights in backward").
RECOMPUTE_MIN_ENTRIES = 1 << 16


# Entry point (gatlib._dispatch's "fused" kernel).
def unsupported(score: EdgeScore, value: Tensor, value_edge: Optional[Tensor]) -> Optional[str]:
    """Why this kernel cannot run on these tensors, or ``None`` if it can."""
    for t in (value, value_edge, *score.tensors()):
        if t is None:
            continue
        if t.device.type != "cpu":
            return f"the fused CPU kernel runs on CPU tensors; got a tensor on {t.device}"
        if t.dtype not in FLOATS:
            return f"the fused CPU kernel computes in {', '.join(map(str, FLOATS))}; got {t.dtype}"
    reason = _native.unavailable()  # builds the compiled passes on the first call
    if reason is not None:
        return f"the fused CPU kernel cannot run here: {reason}"
    return None


def attention(score: EdgeScore, value: Tensor, plan: GraphPlan, value_edge: Optional[Tensor],
              p: float, need_alpha: bool, edge_weight: Optional[Tensor] = None
              ) -> Tuple[Tensor, Optional[Tensor]]:
    """The three stages of :mod:`gatlib._core` without ``[E, H, C]`` saved tensors:
    ``(out [N_dst, H, C] in value's dtype, alpha [E, H] in edge-list order and the score's
    dtype, or None)``. ``value`` is ``[N_src, H, C]`` or ``[N_src, 1, C]`` shared by every head;
    ``edge_weight`` an optional ``[E]`` multiplier of the weights after dropout, differentiable.
    """
    s_src, s_dst, s_edge, s_att = score.tensors()
    score_dtype, acc = promoted_dtype(*score.tensors()), acc_dtype(*score.tensors(), value)
    H, E = score.heads, plan.num_edges
    lay = plan.layout()
    drop = None
    if p > 0:  # the mask is an input: backward (and a reference re-run) sees the same one
        drop = ((torch.rand(E, H, dtype=acc) >= p) * (1.0 / (1.0 - p) if p < 1 else 0.0)).to(acc)
    if edge_weight is not None:  # one multiplier per edge and head, in the kernel's edge order
        w = edge_weight.to(acc).index_select(0, lay.perm).unsqueeze(1)  # [E, 1]
        drop = w.expand(E, H).contiguous() if drop is None else drop * w
    # Node-sized inputs in the compute dtype, contiguous (an upcast of them is cheap),
    # and GAT's [E, H] edge term too; [E, H, C] edge tensors are cast per block.
    cast = [t if t is None or (t.dtype == acc and t.is_contiguous()) else t.to(acc).contiguous()
            for t in (s_src, s_dst, s_att, value, s_edge if score.kind == "gat" else None)]
    s_src, s_dst, s_att, v = cast[:4]
    s_edge = cast[4] if score.kind == "gat" else s_edge
    ins = distinct_inputs((s_src, s_dst, s_edge, s_att, v, value_edge, drop))
    args = (score.kind, float(score.scale), float(score.negative_slope), *ins)
    layout, recompute = layout_tensors(lay), _recomputes_alpha(score.kind, E, H)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ins):
        out, alpha, _ = _FusedAttention.apply(*args, plan.num_src, recompute, *layout)
    else:  # nothing to differentiate: the operator alone (and torch.compile traces no
        # autograd function under no_grad, whose forward it would call with a context)
        out, alpha, _ = torch.ops.gatlib.fused_cpu_attention.default(*args, layout, plan.num_src,
                                                                     False)
    out = out if out.dtype == value.dtype else out.to(value.dtype)
    if not need_alpha:
        return out, None
    alpha = torch.empty_like(alpha).index_copy(0, lay.perm, alpha)  # back to the edge-list order
    return out, alpha.to(score_dtype)
