r"""Edge blocks and threads of the fused CPU kernel: what it runs with torch ops (GAT's
``[E, H]`` terms, ``[E, H, C]`` edge features, per-edge updates), over blocks of CSR edges of
about :data:`CHUNK_BYTES`, so that no gathered ``[E, H, C]`` tensor exists whole.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, List, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:  # (annotations only: the module needs nothing from the plan)
    from ._layout import Layout

# Transient per-edge blocks ([chunk, H, C] in the compute dtype) stay this small:
# large enough that Python overhead per block is noise, small enough to stay in
# cache and under glibc's mmap threshold (never swept: docs/design.md, "Edge blocks
# and threads on CPU").
CHUNK_BYTES = 1 << 20
# Below this many edges per thread, a second thread is not worth starting.
MIN_PART_EDGES = 4096


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


def num_parts(lay: Layout) -> int:
    """How many threads :func:`for_blocks` splits the edges of ``lay`` over."""
    if _OMP_SET_NUM_THREADS is None:
        return 1
    return max(1, min(torch.get_num_threads(), lay.num_edges // MIN_PART_EDGES))


def block_edges(row_bytes: int) -> int:
    """Edges per block of :func:`for_blocks` for rows of ``row_bytes``."""
    return max(1, CHUNK_BYTES // max(1, row_bytes))


def one_block(lay: Layout, row_bytes: int) -> bool:
    """Whether :func:`for_blocks` runs ``lay``'s edges as one block on the calling
    thread: ``E <= block_edges(row_bytes)``, without its calls (asked ~5 times a call)."""
    E = lay.src.numel()
    return E <= 1 or E * row_bytes <= CHUNK_BYTES


def for_blocks(lay: Layout, row_bytes: int, fn: Callable[[int, int, int], None]) -> None:
    """Call ``fn(e0, e1, part)`` on consecutive blocks ``[e0, e1)`` of CSR edges of about
    :data:`CHUNK_BYTES`, without autograd.

    The edges are split at row boundaries into one part per intra-op thread, each run on its
    own Python thread with single-threaded torch ops (its OpenMP thread count set to 1; no
    process-wide setting: docs/design.md, "Edge blocks and threads on CPU"). Parts never share
    a destination row, so ``fn`` may update ``[N_dst, ...]`` rows in place; what is indexed
    by source needs one accumulator per ``part``. Without a known OpenMP runtime, one part.
    """
    E = lay.num_edges
    if E == 0:
        return
    step = block_edges(row_bytes)
    if E <= step and not torch.is_grad_enabled():  # one block (every small graph)
        fn(0, E, 0)
        return
    parts = 1 if E <= step else num_parts(lay)
    if parts == 1:
        with torch.no_grad():
            for e0 in range(0, E, step):
                fn(e0, min(E, e0 + step), 0)
        return
    # part k starts at the first row boundary at or after k*E/parts
    targets = torch.arange(parts + 1, dtype=torch.float64) * (E / parts)
    ptr = lay.ptr
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


def add_row_sums(out: Tensor, x: Tensor, lay: Layout, e0: int, e1: int) -> None:
    """``out[i] += sum of x over the edges of block [e0, e1) into i`` (rows may be partial)."""
    if e0 == 0 and e1 == lay.num_edges:  # all of them: no row range to find
        out.index_add_(0, lay.dst, x)
        return
    i0 = int(lay.dst[e0])
    # the block's rows are few and adjacent: index_add_ into them stays in cache
    # (faster than segment_reduce), with int64 indices: with a large layout's int32
    # ones index_add_ is several times slower, conversion included (docs/design.md,
    # "Edge blocks and threads on CPU")
    out[i0:int(lay.dst[e1 - 1]) + 1].index_add_(0, (lay.dst[e0:e1] - i0).long(), x)


def scatter_rows(out: Tensor, x: Tensor, lay: Layout, e0: int, e1: int) -> None:
    """``out[perm[e]] = x[e - e0]``: a block in CSR order back to the edge-list order."""
    out.index_copy_(0, lay.perm[e0:e1], x.to(out.dtype))


def per_edge_(x: Tensor, node: Tensor, lay: Layout, fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """``x[e] = fn(x[e], node[dst[e]])`` in place for ``[E, H]`` ``x`` and ``[N_dst, H]``
    ``node``, in edge blocks: the gathered ``node`` rows never exist whole."""
    row_bytes = x.size(1) * x.element_size()
    if one_block(lay, row_bytes) and not torch.is_grad_enabled():  # all edges at once
        fn(x, node.index_select(0, lay.dst))
        return x

    def block(e0, e1, part):
        fn(x[e0:e1], node.index_select(0, lay.dst[e0:e1]))

    for_blocks(lay, row_bytes, block)
    return x


def edge_weights(drop: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """The ``[E, H]`` multipliers as the row passes read them: contiguous, in the
    compute dtype (a dropout mask built as ``bool * float`` is float32)."""
    return None if drop is None else drop.to(dtype).contiguous()


def edge_rows(w: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """``[E, H, C]`` edge features as the row passes read them: contiguous, in the
    compute dtype (a copy only for half-precision or strided inputs)."""
    return None if w is None else w.to(dtype).contiguous()

