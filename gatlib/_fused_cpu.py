r"""Fused sparse attention for CPU tensors: nothing ``[E, H, C]`` is kept for backward.

PyG's attention layers gather source features into ``[E, H, C]`` messages and
autograd keeps them (and their products) until backward: gigabytes on a graph
with millions of edges. This kernel keeps only node tensors ``[N, H, C]`` and
per-edge statistics ``[E, H]``, and runs its sparse work as compiled row
passes (:mod:`gatlib._native`) over the plan's CSR and CSC, each reading one
``H*C`` source row per edge for all heads:

* the softmax and the weighted sum ``out_i = sum_j alpha_ij v_j`` in one walk
  of the CSR, and in backward ``<g_i, v_j>`` and ``sum_i a_ij g_i`` together in
  one walk of the CSC, which reads each ``g_i`` once per edge;
* the Transformer's ``q_i·k_j`` and its gradients as sampled dot products and
  weighted sums over the same CSR/CSC;
* GATv2's score ``att · leaky_relu(x_j + y_i)``, which does not factor into node
  terms, computed per edge inside its walk and again in backward;
* what reads ``[E, H, C]`` edge features into the values or the dot score runs
  over blocks of edges of :data:`_CHUNK_BYTES` with torch ops.

Per-edge tensors are ``[E, H]`` in the destination-sorted (CSR) edge order of
the plan's :class:`~gatlib._plan.Layout`.

A call is two ``torch.library`` operators, ``gatlib::fused_cpu_attention`` and
its backward ``gatlib::fused_cpu_attention_backward``, whose inputs are tensors
(the plan's layout among them) and plain numbers, with fake implementations
(shapes only) and the backward registered as the forward's autograd: so
``torch.compile`` keeps them as two calls in its graph, and a compiled graph
replays them on a new graph. An ordinary backward is the fused one; when a
differentiable backward is asked for (``create_graph=True``: gradient
penalties, ``torch.func.grad``), it differentiates the reference
implementation of the same call instead, so second-order gradients are exact.
Autocast is switched off inside: the kernel picks its own precision (float32
accumulation for float16/bfloat16, as the reference does).

The row passes run on ATen's intra-op threads; edge blocks run on one Python
thread per intra-op thread with single-threaded ops (:func:`_for_blocks`); the
kernel never changes a process-wide setting.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _native, _record
from ._core import EdgeScore, _acc_dtype, distinct_inputs, reference_grads, score_heads
from ._plan import GraphPlan, Layout

# Transient per-edge blocks ([chunk, H, C] in the compute dtype) stay this small:
# large enough that Python overhead per block is noise, small enough to stay in
# cache and under glibc's mmap threshold (see benchmarks/NOTES.md).
_CHUNK_BYTES = 1 << 20
# Below this many edges per thread, a second thread is not worth starting.
_MIN_PART_EDGES = 4096

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------
# Edge blocks: GAT's [E, H] score terms and [E, H, C] edge features, in torch ops.
# ---------------------------------------------------------------------------
def _openmp_set_num_threads() -> Optional[Callable[[int], None]]:
    """``omp_set_num_threads`` of the OpenMP runtime torch runs on, or ``None``.

    It sets the *calling* thread's OpenMP thread count only (OpenMP's per-thread
    ``nthreads-var``), unlike ``torch.set_num_threads``, which also changes a
    process-wide default that every thread started later inherits.
    """
    import ctypes
    import glob
    import os

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for pattern in ("libgomp*.so*", "libiomp5*", "libomp*"):
        for path in sorted(glob.glob(os.path.join(lib, pattern))):
            try:
                return ctypes.CDLL(path).omp_set_num_threads
            except (OSError, AttributeError):
                continue
    return None


_OMP_SET_NUM_THREADS = _openmp_set_num_threads() if torch.backends.openmp.is_available() else None


def _num_parts(lay: Layout) -> int:
    """How many threads :func:`_for_blocks` splits the edges of ``lay`` over."""
    if _OMP_SET_NUM_THREADS is None:
        return 1
    return max(1, min(torch.get_num_threads(), lay.num_edges // _MIN_PART_EDGES))


def _block_edges(row_bytes: int) -> int:
    """Edges per block of :func:`_for_blocks` for rows of ``row_bytes``."""
    return max(1, _CHUNK_BYTES // max(1, row_bytes))


def _one_block(lay: Layout, row_bytes: int) -> bool:
    """Whether :func:`_for_blocks` runs ``lay``'s edges as one block on the calling
    thread: ``E <= _block_edges(row_bytes)``, without its calls (asked ~5 times a call)."""
    E = lay.src.numel()
    return E <= 1 or E * row_bytes <= _CHUNK_BYTES


def _for_blocks(lay: Layout, row_bytes: int, fn: Callable[[int, int, int], None],
                ptr: Optional[Tensor] = None) -> None:
    """Call ``fn(e0, e1, part)`` on consecutive blocks ``[e0, e1)`` of CSR edges,
    of about :data:`_CHUNK_BYTES` of ``row_bytes``-sized rows, without autograd.
    With ``ptr=lay.csc_ptr`` the blocks are of CSC positions instead, and the
    parts are split at source-row boundaries.

    The edges are split at destination-row boundaries into one range per intra-op
    thread (``torch.get_num_threads()``); each range runs on its own Python thread
    (torch releases the GIL in its ops), block after block, with single-threaded
    torch ops: that thread's OpenMP thread count is set to 1 through the OpenMP
    runtime, which touches no other thread and no process-wide setting. One
    OpenMP region per op and block instead would be thousands of regions a pass,
    each waiting for every thread: GATv2 forward+backward on the arxiv-like graph
    measured faster this way than with multi-threaded ops (benchmarks/NOTES.md,
    v3). Parts never share a destination row, so ``fn`` may update rows of
    ``[N_dst, ...]`` outputs in place; anything indexed by source needs one
    accumulator per ``part``. Without a known OpenMP runtime, one part
    runs on the calling thread.
    """
    E = lay.num_edges
    if E == 0:
        return
    step = _block_edges(row_bytes)
    if E <= step and not torch.is_grad_enabled():  # one block (every small graph)
        fn(0, E, 0)
        return
    parts = 1 if E <= step else _num_parts(lay)
    if parts == 1:
        with torch.no_grad():
            for e0 in range(0, E, step):
                fn(e0, min(E, e0 + step), 0)
        return
    # part k starts at the first row boundary at or after k*E/parts
    targets = torch.arange(parts + 1, dtype=torch.float64) * (E / parts)
    ptr = lay.ptr if ptr is None else ptr
    rows = torch.searchsorted(ptr.double(), targets)
    bounds = ptr.long()[rows.clamp_(max=ptr.numel() - 1)].tolist()
    bounds[0], bounds[-1] = 0, E
    errors: List[BaseException] = []

    def run(part: int) -> None:
        try:
            torch.get_num_threads()  # torch's own per-thread set-up first, then ours
            _OMP_SET_NUM_THREADS(1)
            with torch.no_grad():  # grad mode is per thread too: no graph from the workers
                for e0 in range(bounds[part], bounds[part + 1], step):
                    fn(e0, min(bounds[part + 1], e0 + step), part)
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _sum_(parts: List[Tensor]) -> Tensor:
    """Sum of per-part accumulators, in place into the first."""
    for t in parts[1:]:
        parts[0] += t
    return parts[0]


def _add_row_sums(out: Tensor, x: Tensor, lay: Layout, e0: int, e1: int) -> None:
    """``out[i] += sum of x over the edges of block [e0, e1) into i`` (rows may be partial)."""
    if e0 == 0 and e1 == lay.num_edges:  # all of them: no row range to find
        out.index_add_(0, lay.dst, x)
        return
    i0 = int(lay.dst[e0])
    # the block's rows are few and adjacent: index_add_ into them stays in cache
    # (measured faster than segment_reduce on edge blocks); with int64 indices:
    # with int32 ones (a large layout's) index_add_ ran several times slower,
    # conversion included (benchmarks/NOTES.md, "int32 indices in the edge blocks")
    out[i0:int(lay.dst[e1 - 1]) + 1].index_add_(0, (lay.dst[e0:e1] - i0).long(), x)


def _scatter_rows(out: Tensor, x: Tensor, lay: Layout, e0: int, e1: int) -> None:
    """``out[perm[e]] = x[e - e0]``: a block in CSR order back to the edge-list order."""
    out.index_copy_(0, lay.perm[e0:e1], x.to(out.dtype))


# ---------------------------------------------------------------------------
# Stages 2 and 3: softmax and aggregation (shared by every score kind).
# ---------------------------------------------------------------------------
def _recomputed_alpha(e: Tensor, lse: Tensor, lay: Layout) -> Tensor:
    """The softmax weights again from the scores ``e`` (consumed) and ``lse``."""
    return _per_edge_(e, lse, lay, lambda eb, lb: eb.sub_(lb).exp_())


def _per_edge_(x: Tensor, node: Tensor, lay: Layout, fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``x[e] = fn(x[e], node[dst[e]])`` in place for ``[E, H]`` ``x`` and ``[N_dst, H]``
    ``node``, in edge blocks: the gathered ``node`` rows never exist whole."""
    row_bytes = x.size(1) * x.element_size()
    if _one_block(lay, row_bytes) and not torch.is_grad_enabled():  # all edges at once
        fn(x, node.index_select(0, lay.dst))
        return x

    def block(e0, e1, part):
        fn(x[e0:e1], node.index_select(0, lay.dst[e0:e1]))

    _for_blocks(lay, row_bytes, block)
    return x


def _edge_weights(drop: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """The ``[E, H]`` multipliers as the row passes read them: contiguous, in the
    compute dtype (a dropout mask built as ``bool * float`` is float32)."""
    return None if drop is None else drop.to(dtype).contiguous()


def _softmax_aggregate(e: Tensor, v: Tensor, u: Optional[Tensor], lay: Layout,
                       drop: Optional[Tensor], need_lse: bool = True
                       ) -> Tuple[Tensor, Tensor, Tensor]:
    r"""Forward of stages 2 and 3, all heads at once (``e`` is consumed)::

        for each destination i (one walk of the CSR):
            m_i      = max_j e_ij                                 # [H]
            alpha_ij = exp(e_ij - m_i) / sum_k exp(e_ik - m_i)    # in place of e
            out_i    = sum_j alpha_ij drop_ij v_j                 # one v row per edge
        out_i += sum_j a_ij u_ij                                  # edge blocks of _CHUNK_BYTES

    ``e``, ``drop`` (``keep / (1 - p)``, times edge weights) ``[E, H]`` in CSR
    order; ``u`` ``[E, H, C]`` in edge-list order.
    Returns ``(out [N_dst, H, C], alpha [E, H], lse [N_dst, H])`` with
    ``lse_i = m_i + log sum_k exp(e_ik - m_i)`` (empty unless ``need_lse``).
    """
    drop = _edge_weights(drop, v.dtype)
    out, lse = _native.ops().softmax_aggregate(lay.ptr, lay.src, e, drop, v, need_lse)
    alpha = e
    if u is not None:
        H, C = out.shape[1:]
        a = alpha if drop is None else alpha * drop  # [E, H]

        def block(e0, e1, part):
            ub = u.index_select(0, lay.perm[e0:e1]).to(out.dtype)  # [n, H, C]
            _add_row_sums(out, ub.mul_(a[e0:e1, :, None]), lay, e0, e1)

        _for_blocks(lay, H * C * out.element_size(), block)
    return out, alpha, lse


def _softmax_aggregate_backward(g_out, g_alpha, alpha, v, u, lay, drop, need_v, need_u,
                                need_drop=False):
    r"""Backward of :func:`_softmax_aggregate`, with ``g_i = dL/dout_i`` and
    ``ga_ij = dL/dalpha_ij`` (alpha is an output too)::

        for each source j (one walk of the CSC), each out-edge j -> i:
            dot_ij = <g_i, v_j>                                   # one g row per edge
            dv_j  += a_ij g_i                                     # the same row
        dot_ij   += <g_i, u_ij>;  du_ij = a_ij g_i                # edge blocks, where u is
        dalpha_ij = drop_ij * dot_ij + ga_ij
        de_ij     = alpha_ij * (dalpha_ij - sum_k alpha_ik dalpha_ik)   # one walk of the CSR
        ddrop_ij  = alpha_ij * dot_ij                             # when drop carries edge weights

    with ``a = alpha * drop``. Returns ``(de [E, H] CSR order, dv or None, du or
    None, ddrop or None)``.
    """
    drop = _edge_weights(drop, alpha.dtype)
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
                    _scatter_rows(du, g_e.mul_(a[e0:e1, :, None]), lay, e0, e1)

            _for_blocks(lay, H * C * g.element_size(), block)
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


# ---------------------------------------------------------------------------
# Stage 1: the score of each kind, forward and backward. Inputs are the
# score's (src, dst, edge, att); per-edge inputs are in edge-list order.
# ---------------------------------------------------------------------------
def _gat_forward(s, t, w, att, lay, scale, slope) -> Tensor:
    r"""GAT: ``e_ij = leaky_relu(z_ij)``, ``z_ij = s_j + t_i + w_ij`` from ``[*, H]``
    node terms (gathers of ``[*, H]`` rows, CSR order), in edge blocks: the only
    ``[E, H]`` tensor is the result."""
    row_bytes = s.size(1) * s.element_size()
    if _one_block(lay, row_bytes):
        return F.leaky_relu_(_gat_z(s, t, w, lay, 0, lay.num_edges), slope)
    e = s.new_empty(lay.num_edges, s.size(1))  # [E, H]

    def block(e0, e1, part):
        e[e0:e1] = F.leaky_relu_(_gat_z(s, t, w, lay, e0, e1), slope)

    _for_blocks(lay, row_bytes, block)
    return e


def _gat_z(s, t, w, lay, e0, e1) -> Tensor:
    """GAT's scores before the LeakyReLU, ``z_ij = s_j + t_i + w_ij`` ``[n, H]``, of
    the CSR edges ``[e0, e1)`` of ``lay`` (``t``, ``w`` optional; ``w`` in
    edge-list order)."""
    src, dst, perm = lay.src, lay.dst, lay.perm
    if e0 != 0 or e1 != src.numel():  # a block of the edges
        src, dst, perm = src[e0:e1], dst[e0:e1], perm[e0:e1]
    z = s.index_select(0, src)  # [n, H]
    if t is not None:
        z += t.index_select(0, dst)
    if w is not None:
        z += w.index_select(0, perm)
    return z


def _gat_backward(de, s, t, w, att, lay, scale, slope, need):
    r"""With ``de_ij = dL/de_ij`` and ``z`` recomputed (cheap, ``[E, H]``)::

        dz_ij = de_ij * (1 if z_ij > 0 else slope)
        ds_j  = sum_i dz_ij                     # segment sum in CSC order
        dt_i  = sum_j dz_ij                     # segment sum in CSR order
        dw_ij = dz_ij                           # back to the edge-list order
    """
    row_bytes = de.size(1) * de.element_size()
    if _one_block(lay, row_bytes):
        dz = torch.ops.aten.leaky_relu_backward(de, _gat_z(s, t, w, lay, 0, lay.num_edges), slope,
                                                False)
    else:
        dz = de  # [E, H], ours: overwritten block by block

        def block(e0, e1, part):
            dz[e0:e1] = torch.ops.aten.leaky_relu_backward(de[e0:e1], _gat_z(s, t, w, lay, e0, e1),
                                                           slope, False)

        _for_blocks(lay, row_bytes, block)
    ds = dt = dw = None
    if need[0]:  # each source's out-edges, walked in CSC order
        ds = _native.ops().segment_sum(lay.csc_ptr, lay.csc_edge, dz)  # [N_src, H]
    if need[1]:
        dt = _native.ops().segment_sum(lay.ptr, lay.ptr.new_empty(0), dz)  # [N_dst, H]
    if need[2]:
        dw = torch.empty_like(dz).index_copy_(0, lay.perm, dz)
    return ds, dt, dw, None


def _edge_rows(w: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """``[E, H, C]`` edge features as the row passes read them: contiguous, in the
    compute dtype (a copy only for half-precision or strided inputs)."""
    return None if w is None else w.to(dtype).contiguous()


def _gatv2_forward(x, y, w, att, lay, scale, slope) -> Tensor:
    r"""GATv2: ``e_ij = att · leaky_relu(x_j + y_i + w_ij)``, per edge in one walk
    of the CSR: the score does not factor into node terms, so ``z`` never exists
    beyond one edge and is recomputed in backward."""
    return _native.ops().gatv2_score(lay.ptr, lay.src, lay.perm, x, y, _edge_rows(w, x.dtype),
                                     att.contiguous(), slope)  # [E, H]


def _gatv2_backward(de, x, y, w, att, lay, scale, slope, need):
    r"""Two walks, each recomputing ``z_ij = x_j + y_i + w_ij``::

        dz_ij  = de_ij * att * (1 if z_ij > 0 else slope)      # [H, C] per edge
        CSR walk (destinations i): dy_i = sum_j dz_ij,  dw_ij = dz_ij,
                                   datt = sum_ij de_ij leaky_relu(z_ij)
        CSC walk (sources j):      dx_j = sum_i dz_ij
    """
    ops, empty = _native.ops(), lay.ptr.new_empty(0)
    w = _edge_rows(w, x.dtype)
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


def _dot_forward(k, q, w, att, lay, scale, slope) -> Tensor:
    r"""Scaled dot product ``e_ij = scale * <q_i, k_j + w_ij>``::

        e_ij  = scale * <q_i, k_j>              # one walk of the CSR, a k row per edge
              + scale * <q_i, w_ij>             # edge blocks of _CHUNK_BYTES
    """
    e = _native.ops().sddmm(lay.ptr, lay.src, lay.ptr.new_empty(0), q, k, scale)  # [E, H]
    if w is not None:
        H, C = q.shape[1:]

        def block(e0, e1, part):
            q_e = q.index_select(0, lay.dst[e0:e1])  # [n, H, C]
            u = w.index_select(0, lay.perm[e0:e1]).to(q.dtype)
            e[e0:e1] += torch.linalg.vecdot(q_e, u).mul_(scale)

        _for_blocks(lay, H * C * q.element_size(), block)
    return e


def _dot_backward(de, k, q, w, att, lay, scale, slope, need):
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
                _add_row_sums(dq, u.mul_(d), lay, e0, e1)
            if dw is not None:
                _scatter_rows(dw, q.index_select(0, lay.dst[e0:e1]).mul_(d), lay, e0, e1)

        _for_blocks(lay, H * C * q.element_size(), block)
    return dk, dq, dw, None


# score kind -> (forward, backward): read from the score, no isinstance chain
_SCORES = {
    "gat": (_gat_forward, _gat_backward),
    "gatv2": (_gatv2_forward, _gatv2_backward),
    "dot": (_dot_forward, _dot_backward),
}


# ---------------------------------------------------------------------------
# The operators: forward and backward of one call, and their autograd.
# ---------------------------------------------------------------------------
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

    (the stages: ``_gat_forward``, ``_gatv2_forward``, ``_dot_forward``, then
    :func:`_softmax_aggregate`). Inputs in the compute dtype: the score's
    tensors (``s_edge`` in edge-list order), ``value [N_src, H, C]`` (or
    ``[N_src, 1, C]``, shared by the heads), ``value_edge [E, H, C]`` (edge-list order) and ``drop [E, H]`` (CSR order:
    the dropout mask scaled by ``1 / (1 - p)``, times the edge weights if any),
    the graph as :func:`layout_tensors`. Returns ``out [N_dst, H, C]``, ``alpha
    [E, H]`` in CSR order and ``lse [N_dst, H]`` (``[0]`` unless ``keep_lse``).
    """
    _record.log("fused")
    lay = _layout_of(layout, num_src)
    with _no_autocast():
        e = _SCORES[kind][0](s_src, s_dst, s_edge, s_att, lay, scale, slope)  # [E, H]
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
    r"""Gradients of :func:`_attention_op`'s seven tensor inputs (``s_src``, ...,
    ``drop``) from those of ``out`` and ``alpha`` (either may be ``None``)::

        alpha_ij  = exp(e_ij - lse_i)   # recomputed where saved is lse (recompute)
        dalpha_ij = drop_ij <g_i, v_j + u_ij> + ga_ij
        de_ij     = alpha_ij (dalpha_ij - sum_k alpha_ik dalpha_ik)   # softmax gradient
        dv_j = sum_i alpha_ij drop_ij g_i;  du_ij = alpha_ij drop_ij g_i
        then de through the score's backward (``_gat_backward``, ...)

    (:func:`_softmax_aggregate_backward` has each step). ``saved`` is ``alpha``,
    or ``lse`` where ``recompute``; ``kept_layout`` what :func:`_kept_layout` kept
    of the forward's layout. An empty tensor stands for each gradient ``need``
    does not ask for (and for an absent input).
    """
    _record.log("fused.backward")
    lay = _layout_of(_full_layout(kept_layout), num_src)
    with _no_autocast():
        alpha = saved
        if recompute:
            e = _gat_forward(s_src, s_dst, s_edge, s_att, lay, scale, slope)
            alpha = _recomputed_alpha(e, saved, lay)
        de, dv, du, d_drop = _softmax_aggregate_backward(g_out, g_alpha, alpha, value, value_edge,
                                                         lay, drop, need[4], need[5], need[6])
        score_grads = (None,) * 4
        if any(need[:4]):
            score_grads = _SCORES[kind][1](de, s_src, s_dst, s_edge, s_att, lay, scale, slope,
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
    """What backward keeps of a forward's :func:`layout_tensors`: the CSR's ``ptr``
    and ``src``, the CSC's ``csc_ptr`` and ``csc_edge``, ``perm`` where per-edge
    inputs are read in edge-list order (``edge_order``; else an empty tensor).
    The destinations in either order are derived again
    (:func:`_full_layout`): kept, they would be a second copy of the edges per
    layer from forward to backward (at ogbn-products' scale 1 GB each, int32)."""
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
    """:func:`_attention_op` with its registered backward, the layout tensors last
    and one by one (``torch.jit.trace`` records an autograd function's tensor
    arguments, not tensors in a list). In torch 2.13 the autograd function that
    ``register_autograd`` generates has no ``setup_context``, so ``torch.func.grad``
    cannot differentiate the bare operator; this function can, and
    ``torch.compile`` traces it into the same two operators."""

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
    return kind == "gat" and num_edges * heads >= RECOMPUTE_MIN_ENTRIES


# On small graphs the recomputation's few extra ops cost more than the memory saves
# (measured on GATConv forward+backward: benchmarks/NOTES.md, "Second round");
# below 2^16 entries the weights are at most 256 KiB.
RECOMPUTE_MIN_ENTRIES = 1 << 16


# ---------------------------------------------------------------------------
# Entry point (gatlib._dispatch's "fused" kernel).
# ---------------------------------------------------------------------------
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
    """The three stages of :mod:`gatlib._core` without ``[E, H, C]`` saved tensors.

    Args:
        score: the edge score.
        value: ``[N_src, H, C]`` source values (or ``[N_src, 1, C]`` shared by every head).
        plan: the graph.
        value_edge: optional ``[E, H, C]`` per-edge value term.
        p: attention dropout probability in effect (0 outside training).
        need_alpha: also return the attention weights.
        edge_weight: optional ``[E]`` (edge-list order) multiplier of each edge's
            attention weights after dropout, differentiable.

    Returns:
        ``(out [N_dst, H, C] in value.dtype, alpha [E, H] in edge-list order
        and the score's dtype, or None)``.
    """
    s_src, s_dst, s_edge, s_att = score_tensors = score.tensors()
    score_dtype = s_src.dtype
    for t in score_tensors[1:]:
        if t is not None and t.dtype != score_dtype:
            score_dtype = torch.promote_types(score_dtype, t.dtype)
    acc = _acc_dtype(score_dtype if value.dtype == score_dtype
                     else torch.promote_types(score_dtype, value.dtype))
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
