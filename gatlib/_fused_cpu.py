r"""Fused sparse attention for CPU tensors: nothing ``[E, H, C]`` is kept for backward.

PyG's attention layers gather source features into ``[E, H, C]`` messages and
autograd keeps them (and their products) until backward: gigabytes on a graph
with millions of edges. This backend keeps only node tensors ``[N, H, C]`` and
per-edge statistics ``[E, H]``:

* the weighted sum ``out_i = sum_j alpha_ij v_j`` and its transpose in
  backward are sparse-dense products (SpMM) with the graph as a CSR matrix;
* per-edge dot products (``q_i·k_j`` of the Transformer, ``<g_i, v_j>`` of
  every backward) are sampled dense-dense products (SDDMM) on the same CSR;
* what does not factor into node terms (the GATv2 score, ``[E, H, C]`` edge
  features) runs over blocks of edges of :data:`_CHUNK_BYTES` and is recomputed
  in backward instead of being saved.

All ``H`` heads share one sparse matrix of shape ``[N_dst*H, N_src*H]``
(:class:`_HeadLayout`), whose dense operands are ``[N, H, C]`` tensors viewed
as ``[N*H, C]`` without a copy. Per-edge tensors are kept ``[E, H]`` in the
destination-sorted (CSR) edge order of :class:`gatlib._graph.Layout` and are
permuted to the block order only around the sparse kernels.

float16/bfloat16 inputs are computed in float32 (torch's CPU sparse kernels
have no half-precision path, and sums over hubs need the digits anyway), as the
reference does. Other dtypes are declined (the reference runs).
"""
from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._core import DotProductScore, GATScore, GATv2Score, _acc_dtype
from ._graph import Layout, layout, memo

# Transient per-edge blocks ([chunk, H, C] in the compute dtype) stay this small:
# large enough that Python overhead per block is noise, small enough to stay in
# cache and under glibc's mmap threshold (see benchmarks/NOTES.md).
_CHUNK_BYTES = 1 << 20
# Below this many edges per thread, a second thread is not worth starting.
_MIN_PART_EDGES = 4096
# Sparse kernels with fewer multiply-adds (E*H*C) run on one thread: waking
# OpenMP's second thread costs 20-30 ms on an oversubscribed CPU, against
# 0.02 ms for a small product (benchmarks/NOTES.md).
_PARALLEL_WORK = 1 << 22

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------
# Graph layout over heads, and the sparse kernels.
# ---------------------------------------------------------------------------
@dataclass
class _HeadLayout:
    """The graph as one block-diagonal CSR over all heads, plus its transpose.

    Row ``i*H + h`` of the ``[N_dst*H, N_src*H]`` matrix holds head ``h`` of
    destination ``i``'s in-edges at columns ``j*H + h``; its entries sit at
    ``H*ptr[i] + h*deg(i) + k`` for the ``k``-th in-edge. An ``[N, H, C]``
    tensor is then the ``[N*H, C]`` dense operand as it is, and one MKL call
    covers all heads. ``t_*`` is the same for the transpose (rows ``j*H + h``,
    out-edges of ``j`` in the CSC order of the :class:`Layout`).
    """

    lay: Layout
    heads: int
    ptr: Tensor  # [N_dst*H + 1]
    col: Tensor  # [E*H]  j*H + h of each block entry
    bh2eh: Tensor  # [E*H]  block entry -> e*H + h, e the edge's CSR position
    eh2bh: Tensor  # [E*H]  e*H + h -> block entry (inverse of bh2eh)
    t_ptr: Tensor  # [N_src*H + 1]
    t_col: Tensor  # [E*H]  i*H + h of each transposed entry
    t2eh: Tensor  # [E*H]  transposed entry -> e*H + h


def _block_positions(ptr: Tensor, row: Tensor, heads: int) -> Tensor:
    """Block position ``H*ptr[r] + h*deg(r) + k`` of the ``k``-th entry of row ``r``, head ``h``.

    ``ptr`` int64 ``[R + 1]`` offsets, ``row`` int64 ``[E]`` sorted row of each entry.
    Returns int64 ``[E, H]``.
    """
    E = row.numel()
    start = ptr.index_select(0, row)  # [E]
    deg = ptr.diff().index_select(0, row)  # [E]
    base = (heads - 1) * start + torch.arange(E)  # H*ptr[r] + k
    return base[:, None] + torch.arange(heads) * deg[:, None]


def _block_ptr(ptr: Tensor, heads: int) -> Tensor:
    """``[R*H + 1]`` offsets of the block rows ``r*H + h`` (int64)."""
    deg = ptr.diff()
    starts = (heads * ptr[:-1])[:, None] + torch.arange(heads) * deg[:, None]  # [R, H]
    return torch.cat([starts.reshape(-1), ptr[-1:] * heads])


def _build_head_layout(lay: Layout, heads: int) -> _HeadLayout:
    H, E = heads, lay.num_edges
    bound = max(E * H, (lay.num_src + 1) * H, (lay.num_dst + 1) * H)
    idt = torch.int32 if bound < 2**31 - 1 else torch.int64
    hs = torch.arange(H)
    ptr, src, dst = lay.ptr.long(), lay.src.long(), lay.dst.long()
    eh2bh = _block_positions(ptr, dst, H).view(-1)  # [E*H]
    bh2eh = torch.empty_like(eh2bh)
    bh2eh[eh2bh] = torch.arange(E * H)
    col = (src[:, None] * H + hs).view(-1).index_select(0, bh2eh)  # [E*H]
    # Transpose: rows are sources, entries their out-edges in CSC order.
    cptr, cedge = lay.csc_ptr.long(), lay.csc_edge.long()
    tpos = _block_positions(cptr, src.index_select(0, cedge), H).view(-1)  # [E*H]
    t_col = torch.empty(E * H, dtype=torch.int64)
    t_col[tpos] = (lay.csc_dst.long()[:, None] * H + hs).view(-1)
    t2eh = torch.empty(E * H, dtype=torch.int64)
    t2eh[tpos] = (cedge[:, None] * H + hs).view(-1)
    return _HeadLayout(
        lay=lay, heads=H, ptr=_block_ptr(ptr, H).to(idt), col=col.to(idt),
        bh2eh=bh2eh.to(idt), eh2bh=eh2bh.to(idt), t_ptr=_block_ptr(cptr, H).to(idt),
        t_col=t_col.to(idt), t2eh=t2eh.to(idt),
    )


def _head_layout(edge_index: Tensor, num_src: int, num_dst: int, heads: int) -> _HeadLayout:
    """The cached :class:`_HeadLayout` of ``edge_index`` for ``heads`` heads."""
    lay = layout(edge_index, num_src, num_dst)
    return memo(edge_index, ("fused_cpu_heads", num_src, num_dst, heads),
                lambda: _build_head_layout(lay, heads))


@contextmanager
def _serial_if(small: bool) -> Iterator[None]:
    """One intra-op thread inside the block when ``small``."""
    if not small:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _csr(ptr: Tensor, col: Tensor, values: Tensor, shape: Tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta state"
        return torch.sparse_csr_tensor(ptr, col, values, shape, check_invariants=False)


def _spmm(hl: _HeadLayout, weight: Tensor, dense: Tensor, transpose: bool = False) -> Tensor:
    """``out_i = sum_j weight_ij dense_j`` per head (``transpose``: ``out_j = sum_i ...``).

    Args:
        weight: ``[E, H]`` per-edge weights in CSR edge order.
        dense: ``[N_src, H, C]`` (``[N_dst, H, C]`` when ``transpose``).

    Returns:
        ``[N_dst, H, C]`` (``[N_src, H, C]`` when ``transpose``).
    """
    lay, H = hl.lay, hl.heads
    C = dense.size(-1)
    rows, cols = (lay.num_src, lay.num_dst) if transpose else (lay.num_dst, lay.num_src)
    if transpose:
        a = _csr(hl.t_ptr, hl.t_col, weight.view(-1).index_select(0, hl.t2eh), (rows * H, cols * H))
    else:
        a = _csr(hl.ptr, hl.col, weight.view(-1).index_select(0, hl.bh2eh), (rows * H, cols * H))
    with _serial_if(lay.num_edges * H * C < _PARALLEL_WORK):
        return (a @ dense.reshape(cols * H, C)).view(rows, H, C)


def _sddmm(hl: _HeadLayout, a: Tensor, b: Tensor, scale: float = 1.0) -> Tensor:
    """``scale * <a_i, b_j>`` for every edge ``j -> i`` and head.

    Args:
        a: ``[N_dst, H, C]``; b: ``[N_src, H, C]``.

    Returns:
        ``[E, H]`` in CSR edge order.
    """
    lay, H = hl.lay, hl.heads
    C, E = a.size(-1), lay.num_edges
    if E * H > lay.num_dst * lay.num_src * H * H:
        # More entries than the matrix has cells (duplicate edges on a tiny graph):
        # sampled_addmm rejects that pattern, so take the edge blocks.
        out = a.new_empty(E, H)

        def block(e0, e1, part):
            torch.linalg.vecdot(a.index_select(0, lay.dst[e0:e1]),
                                b.index_select(0, lay.src[e0:e1]), out=out[e0:e1])

        _for_blocks(lay, H * C * a.element_size(), block)
        return out.mul_(scale)
    # sampled_addmm reads the pattern's values even with beta=0 (NaN * 0 = NaN): zeros.
    pattern = _csr(hl.ptr, hl.col, a.new_zeros(E * H), (lay.num_dst * H, lay.num_src * H))
    # b.t() is a view: the kernel wants rows of b contiguous, which they are.
    with _serial_if(E * H * C < _PARALLEL_WORK):
        vals = torch.sparse.sampled_addmm(pattern, a.reshape(-1, C), b.reshape(-1, C).t(),
                                          beta=0.0, alpha=scale).values()  # [E*H] block order
    return vals.index_select(0, hl.eh2bh).view(E, H)


# ---------------------------------------------------------------------------
# Edge blocks for what does not factor into node terms.
# ---------------------------------------------------------------------------
def _num_parts(lay: Layout) -> int:
    """How many threads :func:`_for_blocks` splits the edges of ``lay`` over."""
    return max(1, min(torch.get_num_threads(), lay.num_edges // _MIN_PART_EDGES))


def _for_blocks(lay: Layout, row_bytes: int, fn: Callable[[int, int, int], None]) -> None:
    """Call ``fn(e0, e1, part)`` on consecutive blocks ``[e0, e1)`` of CSR edges.

    The edges are split at destination-row boundaries into ``parts =
    torch.get_num_threads()`` ranges of about equal size; each range runs on its
    own Python thread (torch releases the GIL in its ops), block after block of
    about :data:`_CHUNK_BYTES` of ``row_bytes``-sized rows, with single-threaded
    torch ops. One OpenMP region per block op would be ~1000s of regions a pass,
    and on a shared, oversubscribed CPU each region waits for a descheduled
    thread (measured 16 ms per 2 MB op with 2 threads vs 0.1 ms with 1,
    benchmarks/NOTES.md). Parts never share a destination row, so ``fn`` may
    update rows of ``[N_dst, ...]`` outputs in place; anything indexed by source
    needs one accumulator per ``part``.

    """
    E = lay.num_edges
    parts = _num_parts(lay)
    step = max(1, _CHUNK_BYTES // max(1, row_bytes))
    if E == 0:
        return
    # part k starts at the first row boundary at or after k*E/parts
    targets = torch.arange(parts + 1, dtype=torch.float64) * (E / parts)
    rows = torch.searchsorted(lay.ptr.double(), targets)
    bounds = lay.ptr.long()[rows.clamp_(max=lay.ptr.numel() - 1)].tolist()
    bounds[0], bounds[-1] = 0, E
    errors = []

    def run(part: int) -> None:
        try:
            torch.set_num_threads(1)  # this OS thread only (OpenMP and MKL settings are per thread)
            with torch.no_grad():  # grad mode is per thread too: no graph from the workers
                for e0 in range(bounds[part], bounds[part + 1], step):
                    fn(e0, min(bounds[part + 1], e0 + step), part)
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(1, parts)]
    n_threads = torch.get_num_threads()
    for t in threads:
        t.start()
    try:
        run(0)
    finally:
        for t in threads:
            t.join()
        torch.set_num_threads(n_threads)  # restore the calling thread's (and the default) setting
    if errors:
        raise errors[0]


def _sum_(parts: list) -> Tensor:
    """Sum of per-thread accumulators, in place into the first."""
    for t in parts[1:]:
        parts[0] += t
    return parts[0]


def _add_row_sums(out: Tensor, x: Tensor, lay: Layout, e0: int, e1: int) -> None:
    """``out[i] += sum of x over the edges of block [e0, e1) into i`` (rows may be partial)."""
    i0 = int(lay.dst[e0])
    # the block's rows are few and adjacent: index_add_ into them stays in cache
    # (measured 2-4x faster than segment_reduce on [1024, 4, 64] blocks)
    out[i0:int(lay.dst[e1 - 1]) + 1].index_add_(0, lay.dst[e0:e1] - i0, x)


def _scatter_rows(out: Tensor, x: Tensor, lay: Layout, e0: int, e1: int) -> None:
    """``out[perm[e]] = x[e - e0]``: a block in CSR order back to the original edge order."""
    out.index_copy_(0, lay.perm[e0:e1], x.to(out.dtype))


# ---------------------------------------------------------------------------
# Stages 2 and 3: softmax and aggregation (shared by every scorer).
# ---------------------------------------------------------------------------
def _row_softmax(e: Tensor, lay: Layout) -> Tensor:
    """Softmax of ``e`` ``[E, H]`` (CSR order) over each destination's in-edges."""
    dst = lay.dst
    m = torch.segment_reduce(e, "max", offsets=lay.ptr, axis=0)  # [N_dst, H]
    ex = (e - m.index_select(0, dst)).exp_()  # [E, H], every entry <= 1
    den = torch.segment_reduce(ex, "sum", offsets=lay.ptr, axis=0)  # [N_dst, H], >= 1 where used
    return ex.div_(den.index_select(0, dst))


class _SoftmaxAggregate(torch.autograd.Function):
    r"""Stages 2 and 3: softmax over each destination's in-edges and the weighted sum.

    Inputs ``e`` ``[E, H]`` (CSR edge order), ``v`` ``[N_src, H, C]``, ``u``
    ``[E, H, C]`` (original edge order) or ``None``; ``p`` the dropout rate.
    Forward, all heads at once::

        m_i      = max_j e_ij                                     # segment max  [N_dst, H]
        alpha_ij = exp(e_ij - m_i) / sum_k exp(e_ik - m_i)        # [E, H]
        a_ij     = alpha_ij * mask_ij / (1 - p)                   # dropout, mask [E, H] bool
        out_i    = sum_j a_ij v_j                                 # SpMM, block CSR
                 + sum_j a_ij u_ij                                # edge blocks of _CHUNK_BYTES

    Backward, with ``g_i = dL/dout_i`` and ``ga_ij = dL/dalpha_ij`` (alpha is
    an output too)::

        dalpha_ij = mask_ij / (1 - p) * <g_i, v_j + u_ij> + ga_ij # SDDMM (+ edge blocks)
        delta_i   = sum_j alpha_ij dalpha_ij                      # = <g_i, out_i> without ga
        de_ij     = alpha_ij * (dalpha_ij - delta_i)              # softmax gradient
        dv_j      = sum_i a_ij g_i                                # SpMM, transposed block CSR
        du_ij     = a_ij g_i                                      # [E, H, C] because u is

    Saved: ``alpha`` and ``mask`` ``[E, H]``, ``v``, and ``u`` (an input, not a copy).
    """

    @staticmethod
    def forward(ctx, e: Tensor, value: Tensor, value_edge: Optional[Tensor], hl: _HeadLayout,
                p: float):
        lay = hl.lay
        alpha = _row_softmax(e, lay)  # [E, H]
        mask = None
        a = alpha
        if p > 0:
            mask = torch.rand_like(alpha) >= p  # [E, H] bool
            a = alpha * mask * (1.0 / (1.0 - p) if p < 1 else 0.0)
        out = _spmm(hl, a, value)  # [N_dst, H, C]
        if value_edge is not None:
            H, C = value.shape[1:]

            def block(e0, e1, part):
                u = value_edge.index_select(0, lay.perm[e0:e1]).to(out.dtype)  # [n, H, C]
                _add_row_sums(out, u.mul_(a[e0:e1, :, None]), lay, e0, e1)

            _for_blocks(lay, H * C * out.element_size(), block)
        ctx.hl, ctx.p = hl, p
        ctx.set_materialize_grads(False)  # an unused output gets None, not an [E, H] of zeros
        ctx.save_for_backward(alpha, mask, value, value_edge)
        return out, alpha

    @staticmethod
    def backward(ctx, g_out: Optional[Tensor], g_alpha: Optional[Tensor]):
        alpha, mask, value, value_edge = ctx.saved_tensors
        hl, p = ctx.hl, ctx.p
        lay = hl.lay
        keep = 1.0 / (1.0 - p) if 0 < p < 1 else 0.0
        a = alpha if mask is None else alpha * mask * keep  # [E, H]
        d_alpha = torch.zeros_like(alpha) if g_alpha is None else g_alpha.clone()  # [E, H]
        dv = du = None
        if g_out is not None:
            g = g_out.contiguous()  # [N_dst, H, C]
            dot = _sddmm(hl, g, value)  # [E, H]  <g_i, v_j>
            if value_edge is not None:
                H, C = g.shape[1:]
                if ctx.needs_input_grad[2]:
                    du = torch.empty_like(value_edge)

                def block(e0, e1, part):
                    g_e = g.index_select(0, lay.dst[e0:e1])  # [n, H, C]
                    u = value_edge.index_select(0, lay.perm[e0:e1]).to(g.dtype)
                    dot[e0:e1] += torch.linalg.vecdot(g_e, u)
                    if du is not None:
                        _scatter_rows(du, g_e.mul_(a[e0:e1, :, None]), lay, e0, e1)

                _for_blocks(lay, H * C * g.element_size(), block)
            d_alpha += dot if mask is None else dot * mask * keep
            if ctx.needs_input_grad[1]:
                dv = _spmm(hl, a, g, transpose=True)  # [N_src, H, C]
        de = None
        if ctx.needs_input_grad[0]:
            ad = alpha * d_alpha  # [E, H]
            delta = torch.segment_reduce(ad, "sum", offsets=lay.ptr, axis=0)  # [N_dst, H]
            de = ad.sub_(alpha * delta.index_select(0, lay.dst))
        return de, dv, du, None, None


# ---------------------------------------------------------------------------
# Stage 1: one autograd function per scorer.
# ---------------------------------------------------------------------------
class _GATEdgeScore(torch.autograd.Function):
    r"""GAT scores ``e_ij = leaky_relu(s_j + t_i + w_ij)`` from per-node terms.

    ``s`` ``[N_src, H]``, ``t`` ``[N_dst, H]`` or ``None``, ``w`` ``[E, H]``
    (original edge order) or ``None``. Forward::

        z_ij = s_j + t_i + w_ij                 # gathers of [*, H] rows, CSR order
        e_ij = leaky_relu(z_ij)                 # [E, H]

    Backward, with ``de_ij = dL/de_ij``::

        dz_ij = de_ij * (1 if z_ij > 0 else slope)
        ds_j  = sum_i dz_ij                     # segment sum in CSC order
        dt_i  = sum_j dz_ij                     # segment sum in CSR order
        dw_ij = dz_ij                           # back to the original edge order

    Saved: the sign of ``z`` as ``[E, H]`` bool.
    """

    @staticmethod
    def forward(ctx, s: Tensor, t: Optional[Tensor], w: Optional[Tensor], lay: Layout,
                slope: float):
        z = s.index_select(0, lay.src)  # [E, H]
        if t is not None:
            z += t.index_select(0, lay.dst)
        if w is not None:
            z += w.index_select(0, lay.perm)
        pos = z > 0  # [E, H]
        ctx.lay, ctx.slope = lay, slope
        ctx.save_for_backward(pos)
        return torch.where(pos, z, z * slope)

    @staticmethod
    def backward(ctx, de: Tensor):
        (pos,) = ctx.saved_tensors
        lay = ctx.lay
        dz = torch.where(pos, de, de * ctx.slope)  # [E, H]
        ds = dt = dw = None
        if ctx.needs_input_grad[0]:
            ds = torch.segment_reduce(dz.index_select(0, lay.csc_edge), "sum",
                                      offsets=lay.csc_ptr, axis=0)  # [N_src, H]
        if ctx.needs_input_grad[1]:
            dt = torch.segment_reduce(dz, "sum", offsets=lay.ptr, axis=0)  # [N_dst, H]
        if ctx.needs_input_grad[2]:
            dw = torch.empty_like(dz).index_copy_(0, lay.perm, dz)
        return ds, dt, dw, None, None


class _GATv2EdgeScore(torch.autograd.Function):
    r"""GATv2 scores ``e_ij = att · leaky_relu(x_j + y_i + w_ij)``, in edge blocks.

    ``x`` ``[N_src, H, C]``, ``y`` ``[N_dst, H, C]``, ``w`` ``[E, H, C]``
    (original edge order) or ``None``, ``att`` ``[H, C]``. The score does not
    factor into node terms, so ``z`` exists only one block of
    :data:`_CHUNK_BYTES` at a time and is recomputed in backward. Forward::

        for each block B of CSR edges:
            z_ij = x_j + y_i + w_ij             # [|B|, H, C] transient
            e_ij = sum_c att_c leaky_relu(z_ij)_c

    Backward, per block again::

        z_ij    = x_j + y_i + w_ij              # recomputed
        dz_ij   = de_ij * att * (1 if z_ij > 0 else slope)   # [|B|, H, C]
        dy_i   += sum_j dz_ij                   # index_add_ into the block's rows
        dx_j   += dz_ij                         # index_add_ over sources, one buffer per thread
        dw_ij   = dz_ij
        datt   += sum_ij de_ij leaky_relu(z_ij)

    Saved: the inputs only.
    """

    @staticmethod
    def _z(x, y, w, lay, e0, e1):
        z = x.index_select(0, lay.src[e0:e1])  # [n, H, C]
        z += y.index_select(0, lay.dst[e0:e1])
        if w is not None:
            z += w.index_select(0, lay.perm[e0:e1])
        return z

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, w: Optional[Tensor], att: Tensor, lay: Layout,
                slope: float):
        H, C = att.shape
        e = x.new_empty(lay.num_edges, H)  # [E, H]

        def block(e0, e1, part):
            z = _GATv2EdgeScore._z(x, y, w, lay, e0, e1)  # [n, H, C]
            torch.linalg.vecdot(F.leaky_relu_(z, slope), att, out=e[e0:e1])

        _for_blocks(lay, H * C * x.element_size(), block)
        ctx.lay, ctx.slope = lay, slope
        ctx.save_for_backward(x, y, w, att)
        return e

    @staticmethod
    def backward(ctx, de: Tensor):
        x, y, w, att = ctx.saved_tensors
        lay, slope = ctx.lay, ctx.slope
        H, C = att.shape
        need_x, need_y, need_w, need_att = ctx.needs_input_grad[:4]
        parts = _num_parts(lay)
        # sources are shared between parts: one accumulator each
        dx = [torch.zeros_like(x) for _ in range(parts)] if need_x else None
        dy = torch.zeros_like(y) if need_y else None
        dw = torch.empty_like(w) if need_w else None
        datt = [torch.zeros_like(att) for _ in range(parts)] if need_att else None

        def block(e0, e1, part):
            z = _GATv2EdgeScore._z(x, y, w, lay, e0, e1)  # [n, H, C]
            g = de[e0:e1, :, None] * att  # [n, H, C]  dL/d leaky_relu(z)
            if need_att:
                datt[part] += torch.einsum("nh,nhc->hc", de[e0:e1], F.leaky_relu(z, slope))
            # g * (1 if z > 0 else slope) in one pass (where() with broadcasting is 10x slower)
            dz = torch.ops.aten.leaky_relu_backward(g, z, slope, False)  # [n, H, C]
            if need_y:
                _add_row_sums(dy, dz, lay, e0, e1)
            if need_x:
                dx[part].index_add_(0, lay.src[e0:e1], dz)
            if need_w:
                _scatter_rows(dw, dz, lay, e0, e1)

        _for_blocks(lay, H * C * x.element_size(), block)
        if need_x:
            dx = _sum_(dx)
        if need_att:
            datt = _sum_(datt)
        return dx, dy, dw, datt, None, None


class _DotEdgeScore(torch.autograd.Function):
    r"""Scaled dot-product scores ``e_ij = scale * <q_i, k_j + w_ij>``.

    ``q`` ``[N_dst, H, C]``, ``k`` ``[N_src, H, C]``, ``w`` ``[E, H, C]``
    (original edge order) or ``None``. Forward::

        e_ij  = scale * <q_i, k_j>              # SDDMM, block CSR
              + scale * <q_i, w_ij>             # edge blocks of _CHUNK_BYTES

    Backward, with ``de_ij = dL/de_ij``::

        dq_i  = scale * sum_j de_ij (k_j + w_ij)  # SpMM (+ edge blocks, segment sums)
        dk_j  = scale * sum_i de_ij q_i           # SpMM, transposed block CSR
        dw_ij = scale * de_ij q_i                 # [E, H, C] because w is

    Saved: the inputs only.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, w: Optional[Tensor], hl: _HeadLayout, scale: float):
        lay = hl.lay
        e = _sddmm(hl, q, k, scale)  # [E, H]
        if w is not None:
            H, C = q.shape[1:]

            def block(e0, e1, part):
                q_e = q.index_select(0, lay.dst[e0:e1])  # [n, H, C]
                u = w.index_select(0, lay.perm[e0:e1]).to(q.dtype)
                e[e0:e1] += torch.linalg.vecdot(q_e, u).mul_(scale)

            _for_blocks(lay, H * C * q.element_size(), block)
        ctx.hl, ctx.scale = hl, scale
        ctx.save_for_backward(q, k, w)
        return e

    @staticmethod
    def backward(ctx, de: Tensor):
        q, k, w = ctx.saved_tensors
        hl, scale = ctx.hl, ctx.scale
        lay = hl.lay
        ds = de * scale  # [E, H]
        dq = dk = dw = None
        if ctx.needs_input_grad[0]:
            dq = _spmm(hl, ds, k)  # [N_dst, H, C]
        if ctx.needs_input_grad[1]:
            dk = _spmm(hl, ds, q, transpose=True)  # [N_src, H, C]
        if w is not None and (dq is not None or ctx.needs_input_grad[2]):
            H, C = q.shape[1:]
            dw = torch.empty_like(w) if ctx.needs_input_grad[2] else None

            def block(e0, e1, part):
                d = ds[e0:e1, :, None]  # [n, H, 1]
                if dq is not None:
                    u = w.index_select(0, lay.perm[e0:e1]).to(q.dtype)
                    _add_row_sums(dq, u.mul_(d), lay, e0, e1)
                if dw is not None:
                    _scatter_rows(dw, q.index_select(0, lay.dst[e0:e1]).mul_(d), lay, e0, e1)

            _for_blocks(lay, H * C * q.element_size(), block)
        return dq, dk, dw, None, None


# ---------------------------------------------------------------------------
# Entry point (called by gatlib._backend._FusedCPUBackend).
# ---------------------------------------------------------------------------
def attention(
    score,
    value: Tensor,
    edge_index: Tensor,
    num_dst: int,
    *,
    value_edge: Optional[Tensor],
    dropout: float,
    training: bool,
    need_alpha: bool,
) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """The three stages of :mod:`gatlib._core` without ``[E, H, C]`` saved tensors.

    Args:
        score: a :class:`GATScore`, :class:`GATv2Score` or :class:`DotProductScore`.
        value: ``[N_src, H, C]`` source values.
        edge_index: validated int64 ``[2, E]`` (the same object across calls, so
            its layouts are cached).
        num_dst: ``N_dst``.
        value_edge: optional ``[E, H, C]`` per-edge value term.
        dropout, training: attention dropout (active when ``training``).
        need_alpha: also return the attention weights.

    Returns:
        ``(out [N_dst, H, C] in value.dtype, alpha [E, H] in the original edge
        order or None)``, or ``None`` for inputs this backend does not handle
        (non-CPU, non-float, unknown scorer) so that the reference runs.
    """
    fields = [t for t in vars(score).values() if isinstance(t, Tensor)]
    tensors = [value, *fields] + ([value_edge] if value_edge is not None else [])
    if not isinstance(score, (GATScore, GATv2Score, DotProductScore)):
        return None
    if any(t.device.type != "cpu" or t.dtype not in _FLOATS for t in tensors):
        return None
    if value.dim() != 3:
        return None
    score_dtype = fields[0].dtype
    for t in fields[1:]:
        score_dtype = torch.promote_types(score_dtype, t.dtype)
    acc = _acc_dtype(torch.promote_types(score_dtype, value.dtype))
    num_src, H, _ = value.shape
    hl = _head_layout(edge_index, num_src, num_dst, H)
    lay = hl.lay

    def node(t: Optional[Tensor]) -> Optional[Tensor]:  # node-sized: upcast is cheap
        return None if t is None else t.to(acc).contiguous()

    if isinstance(score, GATScore):
        e = _GATEdgeScore.apply(node(score.src), node(score.dst), node(score.edge), lay,
                                float(score.negative_slope))
    elif isinstance(score, GATv2Score):
        e = _GATv2EdgeScore.apply(node(score.x_src), node(score.x_dst), score.edge,
                                  node(score.att), lay, float(score.negative_slope))
    else:
        e = _DotEdgeScore.apply(node(score.query), node(score.key), score.edge, hl,
                                float(score.scale))
    p = float(dropout) if training else 0.0
    out, alpha = _SoftmaxAggregate.apply(e, node(value), value_edge, hl, p)
    out = out.to(value.dtype)
    if not need_alpha:
        return out, None
    alpha = torch.index_copy(torch.empty_like(alpha), 0, lay.perm, alpha)  # original order
    return out, alpha.to(score_dtype)
