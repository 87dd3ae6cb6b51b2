r"""The attention core, the specification every kernel is tested against: score each edge
``j -> i`` (``[E, H]``, :class:`EdgeScore`: the only stage where GAT, GATv2 and the graph
Transformer differ), softmax over each destination's in-edges (stable for any logits), and
aggregate ``out_i = sum_j alpha_ij (v_j + u_ij)`` (``[N, H, C]``). Pure PyTorch; the kernels and
the switch between them live in :mod:`gatlib._dispatch`. Names: ``N`` nodes, ``E`` edges, ``H``
heads, ``C`` channels per head, ``src``/``index`` each edge's source/destination.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _scores as S

# Low-precision inputs are scored, normalised and accumulated in float32 and
# cast back at the end: a bf16 sum over a hub's thousands of in-edges would
# otherwise lose most of its digits. Fused kernels accumulate in fp32 too.
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def promoted_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """The dtype the given tensors (``None`` skipped) promote to: a score's is the
    dtype of its attention weights."""
    out = None
    for t in tensors:
        if t is not None:
            out = t.dtype if out is None else torch.promote_types(out, t.dtype)
    return out


def acc_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """What every backend scores, normalises and accumulates the tensors of one
    call in: their promoted dtype, float32 for float16/bfloat16."""
    return _acc_dtype(promoted_dtype(*tensors))


# Stage 1: the score of an edge. One type for the three layers: which formula
# applies is ``kind``; every backend reads the same fields.
SCORE_KINDS = S.KINDS  # ("gat", "gatv2", "dot")


@dataclass(frozen=True, eq=False)
class EdgeScore:
    r"""How each edge ``j -> i`` is scored: the only stage in which GAT, GATv2 and
    the graph Transformer differ. Build one with :meth:`gat`, :meth:`gatv2` or
    :meth:`dot`; backends read ``kind`` and the tensors, never the class.

    ================  =======================  =======================  ================
    ``kind``          ``src`` (per source)     ``dst`` (per destination) ``edge`` (per edge)
    ================  =======================  =======================  ================
    ``"gat"``         ``a_src·Wh_j`` [N_s, H]  ``a_dst·Wh_i`` [N_t, H]   ``[E, H]``
    ``"gatv2"``       ``x_j`` [N_s, H, C]      ``x_i`` [N_t, H, C]       ``[E, H, C]``
    ``"dot"``         key ``k_j`` [N_s, H, C]  query ``q_i`` [N_t, H, C] ``[E, H, C]``
    ================  =======================  =======================  ================

    ``att`` ``[H, C]`` is GATv2's attention vector; ``scale`` multiplies dot
    products; ``negative_slope`` is the LeakyReLU slope of GAT and GATv2.
    ``dst`` may be ``None`` for GAT only; ``edge`` is always optional. A
    ``"dot"`` key may have one head ``[N_s, 1, C]`` that every query head
    shares (input-space keys, :mod:`gatlib.layers`).
    """

    kind: str
    src: Tensor
    dst: Optional[Tensor]
    edge: Optional[Tensor] = None
    att: Optional[Tensor] = None
    scale: float = 1.0
    negative_slope: float = 0.2

    def __post_init__(self):
        if self.kind not in SCORE_KINDS:
            raise ValueError(f"kind must be one of {SCORE_KINDS}; got {self.kind!r}")
        if self.kind != "gat" and self.dst is None:
            raise ValueError(f"a {self.kind!r} score needs per-destination terms (dst)")
        if (self.kind == "gatv2") != (self.att is not None):
            raise ValueError("att is GATv2's attention vector: required for 'gatv2', unused otherwise")

    @classmethod
    def gat(cls, src: Tensor, dst: Optional[Tensor], edge: Optional[Tensor] = None,
            negative_slope: float = 0.2) -> "EdgeScore":
        r"""GAT (Veličković et al. 2018): :math:`e_{ij} = \mathrm{LeakyReLU}(
        \mathbf{a}^\top[\mathbf{W}h_i \,\|\, \mathbf{W}h_j \,\|\, \mathbf{W}_e e_{ij}])`.

        The concatenation splits into per-node dot products (as DGL's ``GATConv``
        notes): ``a^T[Wh_i || Wh_j] = a_dst·Wh_i + a_src·Wh_j``, so the layer
        computes ``[N, H]`` terms once per node instead of ``[E, H, C]`` per edge.
        """
        return cls("gat", src, dst, edge, None, 1.0, negative_slope)

    @classmethod
    def gatv2(cls, x_src: Tensor, x_dst: Tensor, att: Tensor, edge: Optional[Tensor] = None,
              negative_slope: float = 0.2) -> "EdgeScore":
        r"""GATv2 (Brody et al. 2022): :math:`e_{ij} = \mathbf{a}^\top
        \mathrm{LeakyReLU}(\mathbf{W}_s h_j + \mathbf{W}_t h_i + \mathbf{W}_e e_{ij})`.

        The non-linearity sits between ``W`` and ``a``, so the score does not
        split into per-node terms: the reference builds ``[E, H, C]``.
        """
        return cls("gatv2", x_src, x_dst, edge, att, 1.0, negative_slope)

    @classmethod
    def dot(cls, query: Tensor, key: Tensor, edge: Optional[Tensor] = None,
            scale: Optional[float] = None) -> "EdgeScore":
        r"""Scaled dot product (Vaswani et al. 2017; Shi et al. 2021 on graphs):
        :math:`e_{ij} = q_i^\top (k_j + \mathbf{W}_e e_{ij}) \cdot \mathrm{scale}`,
        ``scale = 1/sqrt(C)`` by default."""
        scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else float(scale)
        return cls("dot", key, query, edge, None, scale, 0.0)

    @property
    def heads(self) -> int:
        """``H``: the heads of the per-destination terms (of the query for
        ``"dot"``, whose key may have one shared head), else of ``src``."""
        return self.dst.size(1) if self.kind == "dot" else self.src.size(1)  # (score_heads)

    def tensors(self) -> Tuple[Optional[Tensor], ...]:
        """``(src, dst, edge, att)``, the order backends pass them in."""
        return (self.src, self.dst, self.edge, self.att)

    def with_tensors(self, src, dst, edge, att) -> "EdgeScore":
        """The same score over other tensors (e.g. upcast or detached ones)."""
        return replace(self, src=src, dst=dst, edge=edge, att=att)

    def edge_scores(self, src: Tensor, index: Tensor) -> Tensor:
        """Stage 1, reference: ``e_ij`` for every edge, ``[E, H]``: the kind's formula
        (:mod:`gatlib._scores`) over the gathered terms of each edge."""
        s_j = self.src.index_select(0, src)
        t_i = None if self.dst is None else self.dst.index_select(0, index)
        if self.kind == "gat":
            return S.gat_edge(s_j, t_i, self.edge, self.negative_slope)
        if self.kind == "gatv2":
            return S.gatv2_edge(s_j, t_i, self.edge, self.att, self.negative_slope)
        return S.dot_edge(s_j, t_i, self.edge, self.scale)


def score_heads(kind: str, src: Tensor, dst: Optional[Tensor]) -> int:
    """``H`` of a score of ``kind`` over these terms (:attr:`EdgeScore.heads`):
    what the kernels' operators read it from."""
    return dst.size(1) if kind == "dot" else src.size(1)


# Stages 2 and 3, reference implementation (pure PyTorch).
def segment_reduce(x: Tensor, index: Tensor, num_segments: int, reduce: str) -> Tensor:
    """The reference's segment reduction ``out[i] = reduce_{k: index_k = i} x[k]`` for
    ``reduce`` ``"amax"`` (``-inf`` where a segment is empty) or ``"sum"`` (zero there)."""
    shape = (num_segments,) + x.shape[1:]
    if reduce == "amax":
        idx = index.view(-1, *([1] * (x.dim() - 1))).expand_as(x)
        return x.new_full(shape, float("-inf")).scatter_reduce(0, idx, x, reduce="amax",
                                                               include_self=True)
    return x.new_zeros(shape).index_add_(0, index, x)


def segment_softmax(score: Tensor, index: Tensor, num_segments: int, *,
                    segment_reduce: Callable = segment_reduce) -> Tensor:
    r"""Softmax of ``score`` ``[E, *]`` over the groups ``index`` ``[E]`` (of ``num_segments``):
    :math:`\alpha_{ij} = \exp(e_{ij} - m_i) / \sum_{k:\,\mathrm{index}_k = i} \exp(e_{ik} - m_i)`
    with :math:`m_i = \max_k e_{ik}`, in ``score``'s dtype. Subtracting the (detached) segment
    max keeps every exponent ≤ 0 and every denominator ≥ 1, for logits of any size.
    """
    dtype = score.dtype
    s = score.to(_acc_dtype(dtype))
    seg_max = segment_reduce(s.detach(), index, num_segments, "amax")
    ex = (s - seg_max.index_select(0, index)).exp()  # [E, *], every entry <= 1
    denom = segment_reduce(ex, index, num_segments, "sum")
    return (ex / denom.index_select(0, index)).to(dtype)


def segment_aggregate(
    alpha: Tensor,
    value: Tensor,
    src: Tensor,
    index: Tensor,
    num_segments: int,
    value_edge: Optional[Tensor] = None,
    *,
    segment_reduce: Callable = segment_reduce,
) -> Tensor:
    r"""``out_i = sum_{j -> i} alpha_ij * (value_j + value_edge_ij)``: ``[N_dst, H, C]`` in
    ``value``'s dtype, zeros where a destination has no in-edges. ``alpha`` ``[E, H]``,
    ``value`` ``[N_src, H, C]`` or ``[N_src, 1, C]`` shared by every head, ``value_edge``
    ``[E, H, C]``; ``segment_reduce`` the segment sum (:func:`segment_reduce`'s signature).
    """
    acc = _acc_dtype(value.dtype)
    msg = value.to(acc).index_select(0, src)  # [E, H, C]; upcast first: backward sums in acc too
    if value_edge is not None:
        msg = msg + value_edge.to(acc)
    msg = msg * alpha.to(acc).unsqueeze(-1)
    return segment_reduce(msg, index, num_segments, "sum").to(value.dtype)


def combine_heads(out: Tensor, concat: bool) -> Tensor:
    """``[N, H, C]`` -> ``[N, H * C]`` (concatenate) or ``[N, C]`` (average). The
    average of one head is that head, exactly: a view, not a kernel launch each
    way (an output layer's single head)."""
    N, H, C = out.shape  # explicit sizes: a graph with no nodes has no -1 to infer
    return out.reshape(N, H * C) if concat or H == 1 else out.mean(dim=1)


def reference_attention(
    score: EdgeScore,
    value: Tensor,
    src: Tensor,
    index: Tensor,
    num_dst: int,
    value_edge: Optional[Tensor] = None,
    *,
    p: float = 0.0,
    drop: Optional[Tensor] = None,
    edge_weight: Optional[Tensor] = None,
    softmax=segment_softmax,
    aggregate=segment_aggregate,
) -> Tuple[Tensor, Tensor]:
    """The three stages in plain PyTorch: ``(out [N_dst, H, C], alpha [E, H])``.

    Dropout: ``p`` (``F.dropout``) or a given mask ``drop`` ``[E, H]`` already scaled by
    ``1 / (1 - p)``; ``edge_weight`` ``[E]`` or ``[E, H]`` then multiplies the weights,
    differentiably (PyG's explainers' edge masks). ``alpha`` is returned undropped and
    unweighted. ``softmax``/``aggregate`` swap in another implementation of stages 2 and 3.
    float16/bfloat16 inputs are upcast to float32 before anything is gathered, so every sum,
    forward and backward, runs in float32.
    """
    terms = score.tensors()
    score_dtype = promoted_dtype(*terms)
    acc = _acc_dtype(torch.promote_types(score_dtype, value.dtype))
    upcast = score_dtype != acc
    for t in terms:  # (a loop: no generator frames on every call)
        upcast = upcast or (t is not None and t.dtype != acc)
    if upcast:
        score = score.with_tensors(*[None if t is None else t.to(acc) for t in terms])
    v = value.to(acc)
    ve = None if value_edge is None else value_edge.to(acc)
    e = score.edge_scores(src, index)  # [E, H]                    stage 1
    alpha = softmax(e, index, num_dst)  # [E, H]                   stage 2
    if drop is not None:
        a = alpha * drop
    else:
        a = F.dropout(alpha, p=p, training=True) if p > 0 else alpha
    if edge_weight is not None:
        w = edge_weight.to(acc)
        a = a * (w.unsqueeze(-1) if w.dim() == 1 else w)
    out = aggregate(a, v, src, index, num_dst, ve)  # [N_dst, H, C]  stage 3
    return out.to(value.dtype), alpha.to(score_dtype)


def reference_grads(
    kind: str,
    scale: float,
    negative_slope: float,
    inputs: Sequence[Optional[Tensor]],
    src: Tensor,
    index: Tensor,
    num_dst: int,
    drop: Optional[Tensor],
    grads: Tuple[Optional[Tensor], Optional[Tensor]],
    need: Sequence[bool],
    edge_order: Optional[Tensor] = None,
) -> List[Optional[Tensor]]:
    """Gradients of :func:`reference_attention` with respect to ``inputs`` as differentiable
    tensors (a fused kernel's backward under ``create_graph=True``): one per input, ``None``
    where ``need`` is false. ``inputs``: the score's ``(src, dst, edge, att)``, ``(value,
    value_edge)`` and optionally the ``[E, H]`` multiplier of the weights (``drop`` then
    ``None``); ``grads``: of ``(out, alpha)``; per-edge inputs are read at ``edge_order`` when
    given. Each input is used through a fresh alias, so a gradient is the partial derivative
    with respect to that input alone (a GAT layer's ``a_src`` is computed from its values).
    """
    with torch.enable_grad():
        alias = [None if t is None else t.view_as(t) for t in inputs]
        s_src, s_dst, s_edge, s_att, value, value_edge = alias[:6]
        if len(alias) > 6:
            drop = alias[6]
        if edge_order is not None:
            s_edge = None if s_edge is None else s_edge.index_select(0, edge_order)
            value_edge = None if value_edge is None else value_edge.index_select(0, edge_order)
        score = EdgeScore(kind, s_src, s_dst, s_edge, s_att, scale, negative_slope)
        if value_edge is not None:
            value_edge = value_edge.to(value.dtype)
        out, alpha = reference_attention(score, value, src, index, num_dst, value_edge, drop=drop)
    wanted = [i for i, t in enumerate(alias) if need[i] and t is not None and t.requires_grad]
    pairs = [(o, g) for o, g in zip((out, alpha), grads, strict=True) if g is not None]
    res: List[Optional[Tensor]] = [None] * len(inputs)
    if wanted and pairs:
        got = torch.autograd.grad([o for o, _ in pairs], [alias[i] for i in wanted],
                                  [g for _, g in pairs], create_graph=True, allow_unused=True)
        for i, g in zip(wanted, got, strict=True):
            res[i] = g
    return res


def distinct_inputs(tensors: Sequence[Optional[Tensor]]) -> List[Optional[Tensor]]:
    """``tensors`` with each repeat of one tensor (GATv2's source features are its
    values too) replaced by a view of it, for the fused kernels' operators:
    ``torch.compile`` cannot trace an autograd function given one tensor twice,
    and a view's gradient reaches the tensor all the same."""
    seen: List[Tensor] = []
    out = []
    for t in tensors:  # (by identity, not id(): dynamo before torch 2.13 cannot trace id())
        if t is not None:
            repeat = False
            for s in seen:  # (a loop: no generator frame per tensor)
                repeat = repeat or t is s
            if repeat:
                t = t.view_as(t)
            else:
                seen.append(t)
        out.append(t)
    return out
