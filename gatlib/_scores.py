r"""Stage 1 of the attention core, the score ``e_ij`` of an edge ``j -> i``: per kind (GAT,
GATv2, the Transformer's scaled dot product) the reference formula (:func:`gat_edge`,
:func:`gatv2_edge`, :func:`dot_edge`: the specification, gradient by autograd), GAT's
LeakyReLU gradient and its per-node terms. Part of the reference: imports no kernel code. The
fused CPU kernel's passes per kind (:mod:`gatlib._cpu_passes`), the Triton kernels' ``_score``
and ``gatlib/csrc/fused_cpu.cpp`` compute the same and point here; tests hold every backend to
these formulas. Names: ``s``/``x``/``k`` the per-source term, ``t``/``y``/``q`` the
per-destination term, ``w`` the per-edge term, ``att`` GATv2's vector.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._layout import at_least


# GAT (Veličković et al. 2018): e_ij = LeakyReLU(s_j + t_i + w_ij), with
# s_j = a_src·Wh_j, t_i = a_dst·Wh_i, w_ij = a_edge·W_e e_ij.
def gat_edge(s_j: Tensor, t_i: Optional[Tensor], w: Optional[Tensor], negative_slope: float,
             inplace: bool = False) -> Tensor:
    """GAT's score of a batch of edges from their ``[n, H]`` terms (``t_i``, ``w``
    optional). ``inplace``: ``s_j`` is the caller's to overwrite (a fresh gather)."""
    z = s_j
    for term in (t_i, w):
        if term is not None:
            z = z.add_(term) if inplace else z + term
    return F.leaky_relu(z, negative_slope, inplace)


def gat_edge_backward(de: Tensor, z: Tensor, negative_slope: float) -> Tensor:
    """``dL/dz`` of :func:`gat_edge` from ``de = dL/de`` and the pre-activation
    ``z = s_j + t_i + w_ij``: ``de`` where ``z > 0``, else ``negative_slope * de``."""
    return torch.ops.aten.leaky_relu_backward(de, z, negative_slope, False)


def gat_node_terms(x: Tensor, weight: Optional[Tensor], att: Tensor,
                   h: Optional[Tensor] = None) -> Tensor:
    """``a_h · (W x)_h`` for every row of ``x`` and head ``h``, shape ``[N, H]``: as ``x @ (W_h^T
    a_h)``, the attention vector folded into the weights (one thin product, no ``[N, H, C]``
    pass; docs/design.md, "GAT's attention folded into the weights"), or by reducing the
    projection ``h`` where it exists and the fold does not pay (:func:`folds`) or there is no
    ``weight`` to fold into (a projection that is not a plain ``Linear``: its ``h`` is given)."""
    H, C = att.shape[1:]
    if h is not None and (weight is None or not folds(x, H, C)):
        return (h * att).sum(-1)
    w = (weight.view(H, C, -1) * att.view(H, C, 1)).sum(1)  # [H, F]
    return x @ w.t()


def gat_node_term_pair(x: Tensor, weight: Optional[Tensor], att_a: Tensor, att_b: Tensor,
                       h: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """:func:`gat_node_terms` of one ``x`` for two attention vectors: with the
    fold, one ``[N, F] @ [F, 2H]`` product (and one input gradient in backward)
    instead of two. Returns two ``[N, H]``."""
    H, C = att_a.shape[1:]
    if h is not None and (weight is None or not folds(x, H, C)):
        # both as one [2, N, H] (each half contiguous, as the kernels take them): one
        # product and one reduction, forward and per input in backward, not two
        # (docs/design.md, "Fewer launches per step")
        return gat_projected_terms(h, h, torch.cat([att_a, att_b]))  # att [2, H, C]
    att = torch.stack([att_a, att_b]).view(2, H, C, 1)
    w = (weight.view(1, H, C, -1) * att).sum(2)  # [2, H, F]
    return (x @ w.view(2 * H, -1).t()).split(H, dim=1)


def folds(x: Tensor, heads: int, channels: int) -> bool:
    """Whether the attention vectors are folded into the weights for input ``x``
    (see :func:`gat_node_terms`): where the projection is no narrower than ``x``
    and has at least :data:`FOLD_MIN_ENTRIES` entries."""
    return heads * channels >= x.size(-1) and at_least(x.size(0) * heads * channels, FOLD_MIN_ENTRIES)


def gat_projected_terms(h_src: Tensor, h_dst: Tensor, att: Tensor) -> Tuple[Tensor, Tensor]:
    """``(a_src·h_j, a_dst·h_i)``, two ``[N, H]``, from projected rows ``[N, H, C]``
    and ``att = [a_src; a_dst]`` ``[2, H, C]``: one ``[2, N, H]`` product where
    ``h_src`` is ``h_dst`` (:meth:`gatlib.EdgeScore.node_terms`; the Triton kernels
    form the same in-kernel, KIND 3)."""
    if h_src is h_dst:
        return (h_src.unsqueeze(0) * att.unsqueeze(1)).sum(-1).unbind(0)
    return (h_src * att[0]).sum(-1), (h_dst * att[1]).sum(-1)


# Below this many projected entries (N*H*C) GATConv reduces the projection
# instead of folding: the fold's few extra ops cost more than they save on small
# inputs (docs/design.md, "GAT's attention folded into the weights").
FOLD_MIN_ENTRIES = 1 << 18


# GATv2 (Brody et al. 2022): e_ij = att · LeakyReLU(x_j + y_i + w_ij), [*, H, C] terms that do
# not split per node (fused_cpu.cpp's gatv2_edge, gatv2_grad compute it per edge).
def gatv2_edge(x_j: Tensor, y_i: Tensor, w: Optional[Tensor], att: Tensor,
               negative_slope: float) -> Tensor:
    """GATv2's score of a batch of edges from their ``[n, H, C]`` terms (``w``
    optional) and ``att`` ``[H, C]``: ``[n, H]``."""
    z = x_j + y_i
    if w is not None:
        z = z + w
    return (F.leaky_relu(z, negative_slope) * att).sum(dim=-1)


# Scaled dot product (Vaswani et al. 2017; Shi et al. 2021 on graphs):
# e_ij = scale * <q_i, k_j + w_ij>. The compiled sddmm pass computes the
# <q_i, k_j> part per CSR row.
def dot_edge(k_j: Tensor, q_i: Tensor, w: Optional[Tensor], scale: float) -> Tensor:
    """The dot-product score of a batch of edges from their ``[n, H, C]`` key and
    query terms (``w`` optional; a key may have one head ``[n, 1, C]`` that every
    query head shares): ``[n, H]``."""
    if w is not None:
        k_j = k_j + w
    return (q_i * k_j).sum(dim=-1) * scale


# The kinds, as EdgeScore.kind names them.
KINDS = ("gat", "gatv2", "dot")
