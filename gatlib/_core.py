r"""The attention core: every layer of gatlib is these three stages.

1. **score** each edge ``j -> i`` (``e_ij``, shape ``[E, H]``) — the only stage
   in which GAT, GATv2 and the graph Transformer differ (see the scorers below);
2. **softmax** over each destination's in-edges:
   ``alpha_ij = exp(e_ij - m_i) / sum_k exp(e_ik - m_i)`` with ``m_i`` the
   segment max (numerically stable for any logits);
3. **aggregate** the source values: ``out_i = sum_j alpha_ij (v_j + u_ij)``
   (``u_ij`` an optional per-edge value term), shape ``[N, H, C]``, then
   concatenate or average the heads.

The pure-PyTorch functions in this module (:func:`segment_softmax`,
:func:`segment_aggregate` and the scorers' :meth:`edge_scores`) are the
*specification*: they need nothing beyond torch, and every other backend is
tested against them. Backends live in :mod:`gatlib._backend`; a backend either
swaps stages 2 and 3 for its own primitives or, when fused, takes the scorer
object whole and never materialises per-edge ``[E, H, C]`` tensors.

Names: ``N`` nodes, ``E`` edges, ``H`` heads, ``C`` channels per head,
``src``/``index`` the source/destination node of each edge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

# Low-precision inputs are scored, normalised and accumulated in float32 and
# cast back at the end: a bf16 sum over a hub's thousands of in-edges would
# otherwise lose most of its digits. Fused kernels accumulate in fp32 too.
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


# ---------------------------------------------------------------------------
# Stage 1: scorers. Each holds per-node (and optional per-edge) tensors and
# knows how to score edges in plain PyTorch; fused backends read the same
# fields and score inside their kernels.
# ---------------------------------------------------------------------------
@dataclass
class GATScore:
    r"""GAT (Veličković et al. 2018): :math:`e_{ij} = \mathrm{LeakyReLU}(
    \mathbf{a}^\top[\mathbf{W}h_i \,\|\, \mathbf{W}h_j \,\|\, \mathbf{W}_e e_{ij}])`.

    The concatenation splits into per-node dot products (as DGL's ``GATConv``
    notes): ``a^T[Wh_i || Wh_j] = a_dst·Wh_i + a_src·Wh_j``, so the layer
    computes ``[N, H]`` terms once per node instead of ``[E, H, C]`` per edge.
    """

    src: Tensor  # [N_src, H]   a_src · W h_j
    dst: Optional[Tensor]  # [N_dst, H]   a_dst · W h_i
    edge: Optional[Tensor]  # [E, H]       a_edge · W_e e_ij
    negative_slope: float = 0.2

    def edge_scores(self, src: Tensor, index: Tensor) -> Tensor:
        e = self.src.index_select(0, src)  # [E, H]
        if self.dst is not None:
            e = e + self.dst.index_select(0, index)
        if self.edge is not None:
            e = e + self.edge
        return F.leaky_relu(e, self.negative_slope)


@dataclass
class GATv2Score:
    r"""GATv2 (Brody et al. 2022): :math:`e_{ij} = \mathbf{a}^\top
    \mathrm{LeakyReLU}(\mathbf{W}_s h_j + \mathbf{W}_t h_i + \mathbf{W}_e e_{ij})`.

    The non-linearity sits between ``W`` and ``a``, so the score does not
    split into per-node terms: the reference builds ``[E, H, C]``.
    """

    x_src: Tensor  # [N_src, H, C]
    x_dst: Tensor  # [N_dst, H, C]
    edge: Optional[Tensor]  # [E, H, C]
    att: Tensor  # [H, C]
    negative_slope: float = 0.2

    def edge_scores(self, src: Tensor, index: Tensor) -> Tensor:
        z = self.x_src.index_select(0, src) + self.x_dst.index_select(0, index)  # [E, H, C]
        if self.edge is not None:
            z = z + self.edge
        z = F.leaky_relu(z, self.negative_slope)
        return (z * self.att).sum(dim=-1)  # [E, H]


@dataclass
class DotProductScore:
    r"""Scaled dot product (Vaswani et al. 2017; Shi et al. 2021 on graphs):
    :math:`e_{ij} = q_i^\top (k_j + \mathbf{W}_e e_{ij}) \cdot \mathrm{scale}`,
    usually ``scale = 1/sqrt(C)``.
    """

    query: Tensor  # [N_dst, H, C]
    key: Tensor  # [N_src, H, C]
    edge: Optional[Tensor]  # [E, H, C]
    scale: float

    def edge_scores(self, src: Tensor, index: Tensor) -> Tensor:
        k = self.key.index_select(0, src)  # [E, H, C]
        if self.edge is not None:
            k = k + self.edge
        return (self.query.index_select(0, index) * k).sum(dim=-1) * self.scale  # [E, H]


Scorer = Union[GATScore, GATv2Score, DotProductScore]


# ---------------------------------------------------------------------------
# Stages 2 and 3, reference implementation (pure PyTorch).
# ---------------------------------------------------------------------------
def segment_softmax(score: Tensor, index: Tensor, num_segments: int) -> Tensor:
    r"""Softmax of ``score`` over the groups given by ``index``.

    :math:`\alpha_{ij} = \exp(e_{ij} - m_i) / \sum_{k:\,\mathrm{index}_k = i}
    \exp(e_{ik} - m_i)` with :math:`m_i = \max_k e_{ik}`. Subtracting the
    segment max keeps every exponent ≤ 0, so logits of any size are safe; the
    max is detached because the softmax does not depend on it. Every group that
    appears in ``index`` contains its max, so each denominator is ≥ 1.

    Args:
        score: ``[E, *]`` scores (any trailing shape, e.g. ``[E, H]``).
        index: ``[E]`` int64 group (destination node) of each score.
        num_segments: number of groups ``N``; groups with no entry are fine.

    Returns:
        ``[E, *]`` attention weights in ``score``'s dtype, summing to one per group.
    """
    dtype = score.dtype
    s = score.to(_acc_dtype(dtype))
    idx = index.view(-1, *([1] * (s.dim() - 1))).expand_as(s)
    seg_max = s.new_full((num_segments,) + s.shape[1:], float("-inf"))
    seg_max = seg_max.scatter_reduce(0, idx, s.detach(), reduce="amax", include_self=True)
    ex = (s - seg_max.index_select(0, index)).exp()  # [E, *], every entry <= 1
    denom = s.new_zeros((num_segments,) + s.shape[1:]).index_add_(0, index, ex)
    return (ex / denom.index_select(0, index)).to(dtype)


def segment_aggregate(
    alpha: Tensor,
    value: Tensor,
    src: Tensor,
    index: Tensor,
    num_segments: int,
    value_edge: Optional[Tensor] = None,
) -> Tensor:
    r"""``out_i = sum_{j -> i} alpha_ij * (value_j + value_edge_ij)``.

    Args:
        alpha: ``[E, H]`` weights.
        value: ``[N_src, H, C]`` source values.
        src, index: ``[E]`` source / destination of each edge.
        num_segments: number of destinations ``N_dst``.
        value_edge: optional ``[E, H, C]`` per-edge value term.

    Returns:
        ``[N_dst, H, C]`` in ``value``'s dtype (accumulated in float32 for
        float16/bfloat16). Destinations without in-edges get zeros.
    """
    acc = _acc_dtype(value.dtype)
    msg = value.index_select(0, src).to(acc)  # [E, H, C]
    if value_edge is not None:
        msg = msg + value_edge.to(acc)
    msg = msg * alpha.to(acc).unsqueeze(-1)
    out = msg.new_zeros((num_segments,) + value.shape[1:])
    return out.index_add_(0, index, msg).to(value.dtype)


def combine_heads(out: Tensor, concat: bool) -> Tensor:
    """``[N, H, C]`` -> ``[N, H * C]`` (concatenate) or ``[N, C]`` (average)."""
    return out.reshape(out.size(0), -1) if concat else out.mean(dim=1)


def graph_attention(
    score: Scorer,
    value: Tensor,
    edge_index: Tensor,
    num_dst: int,
    *,
    value_edge: Optional[Tensor] = None,
    dropout: float = 0.0,
    training: bool = False,
    concat: bool = True,
    backend: str = "auto",
    return_attention: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Sparse multi-head attention over the edges of a graph.

    .. math::
        \alpha_{ij} = \operatorname{softmax}_{j \in \mathcal{N}(i)}(e_{ij}),
        \qquad
        h_i' = \big\Vert_{h=1}^{H} \text{ or } \tfrac{1}{H}\sum_{h=1}^{H}
        \; \sum_{j \in \mathcal{N}(i)} \alpha^{h}_{ij}\,(v^{h}_j + u^{h}_{ij})

    Args:
        score: a scorer (:class:`GATScore`, :class:`GATv2Score`,
            :class:`DotProductScore`) holding the per-node terms of ``e_ij``.
        value: ``[N_src, H, C]`` values of the source nodes.
        edge_index: ``[2, E]`` int64 ``(src, dst)`` pairs, already validated.
        num_dst: number of destination nodes ``N_dst``.
        value_edge: optional ``[E, H, C]`` term added to each edge's value.
        dropout: probability of dropping an attention weight (training only).
        training: whether dropout is active.
        concat: concatenate heads (``[N, H*C]``) or average them (``[N, C]``).
        backend: ``"auto"``, ``"torch"`` or ``"scatter"`` (see
            :func:`gatlib.available_backends`).
        return_attention: also return the ``[E, H]`` weights (before dropout).

    Returns:
        ``out`` or ``(out, alpha)``.
    """
    from ._backend import resolve_backend  # the one switch

    impl = resolve_backend(backend, value.device)
    out, alpha = impl.attention(
        score, value, edge_index, num_dst, value_edge=value_edge, dropout=dropout,
        training=training, need_alpha=return_attention,
    )
    out = combine_heads(out, concat)
    return (out, alpha) if return_attention else out


def scaled_dot_product_scale(channels: int) -> float:
    """``1 / sqrt(C)``, the Transformer's score scale."""
    return 1.0 / math.sqrt(channels)
