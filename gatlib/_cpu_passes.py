r"""The fused CPU kernel's score passes, per kind: the forward ``e [E, H]`` of every CSR edge and
its backward, in edge blocks (:mod:`gatlib._blocks`) or the compiled walks of the CSR and CSC
(:mod:`gatlib._native`). They compute the formulas of :mod:`gatlib._scores` (the reference),
which tests hold them to; only :mod:`gatlib._fused_cpu` uses them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
from torch import Tensor

from . import _blocks as B
from . import _native
from ._scores import dot_edge, gat_edge, gat_edge_backward
if TYPE_CHECKING:  # (annotations only: the module needs nothing from the plan)
    from ._layout import Layout


def _gat_terms(s, t, w, lay: Layout, e0: int, e1: int):
    """``(s_j, t_i, w_ij)`` of the CSR edges ``[e0, e1)`` of ``lay`` (fresh
    gathers; ``t``, ``w`` optional, ``w`` in edge-list order)."""
    src, dst, perm = lay.src, lay.dst, lay.perm
    if e0 != 0 or e1 != src.numel():  # a block of the edges
        src, dst, perm = src[e0:e1], dst[e0:e1], perm[e0:e1]
    return (s.index_select(0, src), None if t is None else t.index_select(0, dst),
            None if w is None else w.index_select(0, perm))


def _gat_z(s, t, w, lay: Layout, e0: int, e1: int) -> Tensor:
    """The pre-activation ``z = s_j + t_i + w_ij`` ``[n, H]`` of CSR edges ``[e0, e1)``."""
    z, *terms = _gat_terms(s, t, w, lay, e0, e1)
    for term in terms:
        if term is not None:
            z += term
    return z


def gat_cpu_forward(s, t, w, att, lay: Layout, scale, slope) -> Tensor:
    r""":func:`gat_edge` of every CSR edge, from ``[*, H]`` node terms, in edge
    blocks: the only ``[E, H]`` tensor is the result."""
    row_bytes = s.size(1) * s.element_size()
    if B.one_block(lay, row_bytes):
        return gat_edge(*_gat_terms(s, t, w, lay, 0, lay.num_edges), slope, inplace=True)
    e = s.new_empty(lay.num_edges, s.size(1))  # [E, H]

    def block(e0, e1, part):
        e[e0:e1] = gat_edge(*_gat_terms(s, t, w, lay, e0, e1), slope, inplace=True)

    B.for_blocks(lay, row_bytes, block)
    return e


def gat_cpu_backward(de, s, t, w, att, lay: Layout, scale, slope, need):
    r"""With ``de_ij = dL/de_ij`` and ``z`` recomputed (cheap, ``[E, H]``)::

        dz_ij = de_ij * (1 if z_ij > 0 else slope)   # gat_edge_backward
        ds_j  = sum_i dz_ij                     # segment sum in CSC order
        dt_i  = sum_j dz_ij                     # segment sum in CSR order
        dw_ij = dz_ij                           # back to the edge-list order
    """
    row_bytes = de.size(1) * de.element_size()
    if B.one_block(lay, row_bytes):
        dz = gat_edge_backward(de, _gat_z(s, t, w, lay, 0, lay.num_edges), slope)
    else:
        dz = de  # [E, H], ours: overwritten block by block

        def block(e0, e1, part):
            dz[e0:e1] = gat_edge_backward(de[e0:e1], _gat_z(s, t, w, lay, e0, e1), slope)

        B.for_blocks(lay, row_bytes, block)
    ds = dt = dw = None
    if need[0]:  # each source's out-edges, walked in CSC order
        ds = _native.ops().segment_sum(lay.csc_ptr, lay.csc_edge, dz)  # [N_src, H]
    if need[1]:
        dt = _native.ops().segment_sum(lay.ptr, lay.ptr.new_empty(0), dz)  # [N_dst, H]
    if need[2]:
        dw = torch.empty_like(dz).index_copy_(0, lay.perm, dz)
    return ds, dt, dw, None



def gatv2_cpu_forward(x, y, w, att, lay: Layout, scale, slope) -> Tensor:
    r""":func:`gatv2_edge` of every CSR edge in one walk of the CSR (a compiled
    pass): ``z`` never exists beyond one edge and is recomputed in backward."""
    return _native.ops().gatv2_score(lay.ptr, lay.src, lay.perm, x, y, B.edge_rows(w, x.dtype),
                                     att.contiguous(), slope)  # [E, H]


def gatv2_cpu_backward(de, x, y, w, att, lay: Layout, scale, slope, need):
    r"""Two walks, each recomputing ``z_ij = x_j + y_i + w_ij``::

        dz_ij  = de_ij * att * (1 if z_ij > 0 else slope)      # [H, C] per edge
        CSR walk (destinations i): dy_i = sum_j dz_ij,  dw_ij = dz_ij,
                                   datt = sum_ij de_ij leaky_relu(z_ij)
        CSC walk (sources j):      dx_j = sum_i dz_ij
    """
    ops, empty = _native.ops(), lay.ptr.new_empty(0)
    w = B.edge_rows(w, x.dtype)
    att = att.contiguous()
    de = de.contiguous()
    dx = dy = dw = datt = None
    if need[1] or need[2] or need[3]:
        dy, dw, datt = ops.gatv2_grad(lay.ptr, lay.src, empty, lay.perm, y, x, w, att, de, slope,
                                      need[2] and w is not None, need[3])
    if need[0]:
        dx = ops.gatv2_grad(lay.csc_ptr, lay.csc_dst, lay.csc_edge, lay.perm, x, y, w, att, de,
                            slope, False, False)[0]
    return (dx, dy if need[1] else None, dw if need[2] and w is not None else None,
            datt if need[3] else None)



def dot_cpu_forward(k, q, w, att, lay: Layout, scale, slope) -> Tensor:
    r""":func:`dot_edge` of every CSR edge::

        e_ij  = scale * <q_i, k_j>              # one walk of the CSR, a k row per edge
              + scale * <q_i, w_ij>             # edge blocks of CHUNK_BYTES
    """
    e = _native.ops().sddmm(lay.ptr, lay.src, lay.ptr.new_empty(0), q, k, scale)  # [E, H]
    if w is not None:
        H, C = q.shape[1:]

        def block(e0, e1, part):
            q_e = q.index_select(0, lay.dst[e0:e1])  # [n, H, C]
            u = w.index_select(0, lay.perm[e0:e1]).to(q.dtype)
            e[e0:e1] += dot_edge(u, q_e, None, scale)

        B.for_blocks(lay, H * C * q.element_size(), block)
    return e


def dot_cpu_backward(de, k, q, w, att, lay: Layout, scale, slope, need):
    r"""With ``de_ij = dL/de_ij``::

        dq_i  = scale * sum_j de_ij (k_j + w_ij)  # a walk of the CSR (+ edge blocks)
        dk_j  = scale * sum_i de_ij q_i           # a walk of the CSC
        dw_ij = scale * de_ij q_i                 # [E, H, C] because w is
    """
    ops = _native.ops()
    ds = de * scale  # [E, H]
    # [N_src, H, C], or [N_src, 1, C] summed over heads where the key has one shared head
    dk = (ops.spmm(lay.csc_ptr, lay.csc_dst, lay.csc_edge, ds, q, k.size(1) != q.size(1))
          if need[0] else None)
    dq = ops.spmm(lay.ptr, lay.src, lay.ptr.new_empty(0), ds, k) if need[1] else None  # [N_dst, H, C]
    dw = None
    if w is not None and (dq is not None or need[2]):
        H, C = q.shape[1:]
        dw = torch.empty_like(w) if need[2] else None

        def block(e0, e1, part):
            d = ds[e0:e1, :, None]  # [n, H, 1]
            if dq is not None:
                u = w.index_select(0, lay.perm[e0:e1]).to(q.dtype)
                B.add_row_sums(dq, u.mul_(d), lay, e0, e1)
            if dw is not None:
                B.scatter_rows(dw, q.index_select(0, lay.dst[e0:e1]).mul_(d), lay, e0, e1)

        B.for_blocks(lay, H * C * q.element_size(), block)
    return dk, dq, dw, None



# The passes of each kind, read from EdgeScore.kind (no isinstance chain).
class ScoreKind(NamedTuple):
    """One kind's fused CPU forward ``(src, dst, edge, att, lay, scale, slope) ->
    e [E, H]`` (CSR order) and backward ``(de, src, dst, edge, att, lay, scale,
    slope, need) -> (dsrc, ddst, dedge, datt)``."""

    cpu_forward: Callable
    cpu_backward: Callable


PASSES = {
    "gat": ScoreKind(gat_cpu_forward, gat_cpu_backward),
    "gatv2": ScoreKind(gatv2_cpu_forward, gatv2_cpu_backward),
    "dot": ScoreKind(dot_cpu_forward, dot_cpu_backward),
}
