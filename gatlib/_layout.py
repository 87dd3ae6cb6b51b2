r"""A graph's layouts: the destination-sorted CSR and source-sorted CSC that the
kernels read, built from a checked edge list (or from what a PyG ``EdgeIndex``
or a sparse adjacency already holds), and a layout's self-loop'ed twin merged in
O(E). A :class:`~gatlib.GraphPlan` (:mod:`gatlib._plan`) owns the layouts it
builds; nothing here keeps state.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor
from torch_geometric.index import index2ptr


@dataclass(frozen=True)
class Layout:
    """Destination-sorted CSR of a graph plus the source-sorted (CSC) view.

    CSR position ``k`` is edge ``perm[k]`` of the plan's edge list; row ``i`` holds
    ``ptr[i]:ptr[i+1]`` in edge-list order. The CSC lists each source's out-edges as
    increasing CSR positions (``csc_edge``), so a backward gathers CSR-ordered quantities
    without atomics. Indices are int64 on small graphs (:data:`SMALL_EDGES`, whose CSC is
    derived on first read: docs/design.md, "Small graphs: int64 layouts and a lazy CSC"),
    else int32 where every value fits; ``perm`` is int64.
    """

    ptr: Tensor  # [N_dst + 1]
    src: Tensor  # [E]  source of each edge, CSR order
    dst: Tensor  # [E]  destination of each edge, CSR order (sorted)
    perm: Tensor  # [E]  edge-list position of each CSR edge (int64)
    num_src: int
    num_dst: int
    # (csc_ptr [N_src + 1], csc_edge [E], csc_dst [E]), or None until first read
    csc: Optional[Tuple[Tensor, Tensor, Tensor]] = dataclasses.field(default=None, repr=False)

    @property
    def num_edges(self) -> int:
        return self.src.numel()

    def _csc(self) -> Tuple[Tensor, Tensor, Tensor]:
        csc = self.csc
        if csc is None:  # derived from tensors that never change: a racing thread gets the same
            csc = _normal(_csc_of, self.src, self.dst, self.num_src)
            # Not kept from inside a compiled graph: its outputs are its memory to reuse
            # (see GraphPlan); the graph's common-subexpression pass merges the repeats.
            if not torch.compiler.is_compiling():
                object.__setattr__(self, "csc", csc)
        return csc

    @property
    def csc_ptr(self) -> Tensor:
        """``[N_src + 1]`` offsets of each source's out-edges in CSC order."""
        return self._csc()[0]

    @property
    def csc_edge(self) -> Tensor:
        """``[E]`` CSR position of each edge, source-sorted."""
        return self._csc()[1]

    @property
    def csc_dst(self) -> Tensor:
        """``[E]`` destination of each edge, source-sorted."""
        return self._csc()[2]


def at_least(size, threshold: int) -> bool:
    """``size >= threshold``, for a choice made by a graph's size alone (index dtype, fold,
    fused kernel or reference), in code that ``torch.compile`` and ``torch.export`` trace.
    Under ``torch.export`` a size the program leaves free takes the large side without a
    guard (a guard would narrow its range: "Constraints violated"), unless its whole range
    lies below ``threshold``. Eager and compiled calls decide on the size.
    """
    if torch.compiler.is_exporting():  # (a free size reads as an int under strict export)
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return not statically_known_true(size < threshold)
    return size >= threshold


def index_dtype(*bounds: int) -> torch.dtype:
    """int32 when every index and count below ``max(bounds)`` fits, else int64."""
    for b in bounds:  # (a loop: torch.compile traces no max(..., default=))
        if at_least(b, 2**31 - 1):
            return torch.int64
    return torch.int32


def layout_dtype(num_edges: int, num_src: int, num_dst: int) -> torch.dtype:
    """The index dtype of a :class:`Layout`: int64 for a small graph (fewer than
    :data:`SMALL_EDGES` edges), else :func:`index_dtype` (int32 where it fits)."""
    if not at_least(num_edges, SMALL_EDGES):
        return torch.int64
    return index_dtype(num_edges, num_src, num_dst)


# Below this many edges a graph is small: int64 indices and a CSC derived when first read
# (docs/design.md, "Small graphs: int64 layouts and a lazy CSC"); a large graph's CSC is built
# with its CSR, while little else is in memory.
SMALL_EDGES = 1 << 16


def _normal(fn: Callable, *args):
    """``fn(*args)``, building normal tensors even inside ``inference_mode``
    (an inference tensor kept on a plan could not be saved for backward by a
    later training call)."""
    # (dynamo traces neither the inference-mode query nor graph breaks inside a
    # with block it cannot resume; under torch.compile inference mode is off)
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return fn(*args)
    with torch.inference_mode(False):
        return fn(*args)


# Layout construction.
def _nondecreasing(x: Tensor) -> bool:
    return x.numel() == 0 or bool((x[1:] >= x[:-1]).all())


def _ptr(sorted_index: Tensor, n: int) -> Tensor:
    """``[n + 1]`` offsets of the runs of each value ``0..n-1`` in ``sorted_index``
    (PyG's ``index2ptr``, in ``sorted_index``'s dtype)."""
    return index2ptr(sorted_index, n)


def build_layout(src: Tensor, dst: Tensor, num_src: int, num_dst: int,
                 check_sorted: bool = True) -> Layout:
    """CSR + CSC of a checked edge list (stable sorts; no sort where ``dst`` is
    already non-decreasing, which ``check_sorted=False`` does not look for)."""
    ptr, src_csr, dst_csr, perm = torch.ops.gatlib.csr_layout.default(src, dst, num_src, num_dst,
                                                                      check_sorted)
    return _with_csc(ptr, src_csr, dst_csr, perm, num_src, num_dst)


@torch.library.custom_op("gatlib::csr_layout", mutates_args=())
def _csr_layout(src: Tensor, dst: Tensor, num_src: int, num_dst: int, check_sorted: bool
                ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(ptr [N_dst + 1], src [E], dst [E], perm [E])``: the destination-sorted CSR
    of a checked edge list, in :func:`layout_dtype` (``perm`` int64).

    An operator because whether ``dst`` is sorted already is a question about its
    values, which ``torch.compile`` cannot branch on: compiled code calls this
    operator as it is.
    """
    E = src.numel()
    idt = layout_dtype(E, num_src, num_dst)
    dst_i = dst if dst.dtype == idt else dst.to(idt)
    if check_sorted and _nondecreasing(dst_i):  # already destination-sorted
        perm = torch.arange(E, device=src.device)
        dst_csr, src_csr = dst_i.clone(), src.to(idt, copy=True)
    else:
        dst_csr, perm = torch.sort(dst_i, stable=True)
        src_csr = src.index_select(0, perm)
        src_csr = src_csr if src_csr.dtype == idt else src_csr.to(idt)
    return _ptr(dst_csr, num_dst), src_csr, dst_csr, perm


@_csr_layout.register_fake
def _(src, dst, num_src, num_dst, check_sorted):
    E = src.numel()
    idt = layout_dtype(E, num_src, num_dst)
    return (src.new_empty(num_dst + 1, dtype=idt), src.new_empty(E, dtype=idt),
            src.new_empty(E, dtype=idt), src.new_empty(E, dtype=torch.int64))


def _sorted_looped_layout(looped_ei: Tensor, num_src: int, num_dst: int, n: int) -> Layout:
    """The layout of a plain edge list with ``n`` loops appended (by
    :func:`_drop_and_add_loops`), sorted directly: with its loops last it is unsorted."""
    return build_layout(looped_ei[0], looped_ei[1], num_src, num_dst, check_sorted=n == 0)


def _with_csc(ptr, src_csr, dst_csr, perm, num_src, num_dst) -> Layout:
    """The layout of a CSR with its CSC view (:func:`_csc_of`), which on a small
    graph (:data:`SMALL_EDGES`) is derived only when first read."""
    csc = _csc_of(src_csr, dst_csr, num_src) if at_least(src_csr.numel(), SMALL_EDGES) else None
    return Layout(ptr=ptr, src=src_csr, dst=dst_csr, perm=perm, num_src=num_src, num_dst=num_dst,
                  csc=csc)


def _csc_of(src_csr: Tensor, dst_csr: Tensor, num_src: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(csc_ptr, csc_edge, csc_dst)`` of a CSR: each source's out-edges in CSR order."""
    return torch.ops.gatlib.csc_layout.default(src_csr, dst_csr, num_src)


@torch.library.custom_op("gatlib::csc_layout", mutates_args=())
def _csc_layout(src_csr: Tensor, dst_csr: Tensor, num_src: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(csc_ptr [N_src + 1], csc_edge [E], csc_dst [E])`` of a CSR, in its index
    dtype. An operator, as :func:`_csr_layout`: traced, the offsets' op would fix
    a compiled graph to one node count."""
    src_sorted, csc_edge = torch.sort(src_csr, stable=True)
    return (_ptr(src_sorted, num_src), csc_edge.to(src_csr.dtype),
            dst_csr.index_select(0, csc_edge))


@_csc_layout.register_fake
def _(src_csr, dst_csr, num_src):
    E = src_csr.numel()
    return (src_csr.new_empty(num_src + 1), src_csr.new_empty(E), src_csr.new_empty(E))


def _edge_index_layout_fn(ei, num_src: int, num_dst: int) -> Callable[[], Layout]:
    """Layout from a sorted EdgeIndex's CSC ``(colptr, row), perm`` (cached on the
    EdgeIndex by PyG); copied, so the plan does not alias the user's object."""
    def build() -> Layout:
        (colptr, row), perm = ei.get_csc()
        E = row.numel()
        idt = layout_dtype(E, num_src, num_dst)
        perm = (torch.arange(E, device=row.device) if perm is None else perm.to(torch.int64, copy=True))
        ptr = colptr.to(idt, copy=True)
        dst_csr = torch.repeat_interleave(torch.arange(num_dst, dtype=idt, device=row.device),
                                          ptr.diff(), output_size=E)
        return _with_csc(ptr, row.to(idt, copy=True), dst_csr, perm, num_src, num_dst)

    return build


def _csr_layout_fn(ptr: Tensor, ei: Tensor, num_src: int, num_dst: int) -> Callable[[], Layout]:
    """Layout of a destination-sorted edge list ``ei`` (a CSR adjacency's) whose row
    offsets ``ptr`` are known: its CSR is the edge list itself, nothing is sorted
    by destination; ``ptr`` and ``ei`` belong to the plan."""
    def build() -> Layout:
        E = ei.size(1)
        idt = layout_dtype(E, num_src, num_dst)
        return _with_csc(ptr.to(idt, copy=True), ei[0].to(idt, copy=True), ei[1].to(idt, copy=True),
                         torch.arange(E, device=ei.device), num_src, num_dst)

    return build


def _csc_layout_fn(ptr: Tensor, ei: Tensor, num_src: int, num_dst: int) -> Callable[[], Layout]:
    """Layout of a source-sorted edge list ``ei`` (a CSC adjacency's) whose column
    offsets ``ptr`` are known: the CSR side is one stable sort by destination, and
    the CSC side is the edge list itself — each source's edges are in increasing
    CSR position as long as its destinations ascend, as in every CSC that torch or
    PyG builds (otherwise the CSC side is sorted, as for any edge list)."""
    def build() -> Layout:
        E = ei.size(1)
        idt = layout_dtype(E, num_src, num_dst)
        src, dst = ei[0], ei[1]
        dst_csr, perm = torch.sort(dst.to(idt), stable=True)
        src_csr = src.index_select(0, perm).to(idt)
        csr_ptr = _ptr(dst_csr, num_dst)
        if not _nondecreasing(src * num_dst + dst):
            return _with_csc(csr_ptr, src_csr, dst_csr, perm, num_src, num_dst)
        csc_edge = torch.empty_like(perm).index_copy_(0, perm, torch.arange(E, device=ei.device))
        return Layout(ptr=csr_ptr, src=src_csr, dst=dst_csr, perm=perm, num_src=num_src,
                      num_dst=num_dst,
                      csc=(ptr.to(idt, copy=True), csc_edge.to(idt), dst.to(idt, copy=True)))

    return build


def _layout_with_loops(base: Layout, keep_list: Tensor, num_edges: int, n: int) -> Layout:
    """The layout of ``base``'s graph without self-loops plus loops ``i -> i``
    for ``i < n``, appended to the edge list (see :meth:`GraphPlan.with_self_loops`),
    merged into ``base``'s CSR/CSC in O(E) without sorting.

    In CSR order the loop of row ``i`` is its last entry (it comes last in the
    edge list); in CSC order the loop of source ``j`` follows ``j``'s out-edges
    into rows below ``j`` and precedes those into rows above it (CSC rows are
    ordered by CSR position, i.e. by destination).
    """
    dev = base.src.device
    idt = layout_dtype(num_edges, base.num_src, base.num_dst)
    ptr, src, dst, perm = base.ptr.long(), base.src.long(), base.dst.long(), base.perm
    loops = torch.arange(n, device=dev)
    zero = torch.zeros(1, dtype=torch.long, device=dev)

    def excl(mask: Tensor) -> Tensor:  # [len + 1] exclusive prefix counts
        return torch.cat([zero, mask.long().cumsum(0)])

    def kept(mask: Tensor) -> Optional[Tensor]:  # positions where mask holds; None: all of them
        return None if bool(mask.all()) else mask.nonzero().squeeze(1)

    def sel(x: Tensor, idx: Optional[Tensor]) -> Tensor:
        return x if idx is None else x.index_select(0, idx)

    def place(kept_pos: Tensor, kept_vals: Tensor, loop_pos: Tensor, loop_vals: Tensor, dtype) -> Tensor:
        out = torch.empty(num_edges, dtype=dtype, device=dev)
        out.index_copy_(0, kept_pos, kept_vals.to(dtype))
        return out.index_copy_(0, loop_pos, loop_vals.to(dtype))

    # CSR: a kept edge moves down by the loops of the rows above it.
    keep = src != dst  # [E] CSR order
    ke = kept(keep)
    ck = excl(keep)
    kept_rows = ck.index_select(0, ptr[1:]) - ck.index_select(0, ptr[:-1])  # [N_dst]
    has_loop = torch.arange(base.num_dst, device=dev) < n
    new_ptr = torch.cat([zero, (kept_rows + has_loop).cumsum(0)])
    pos = sel(ck[:-1] + torch.clamp(dst, max=n), ke)  # new CSR position of each kept edge
    loop_pos = new_ptr[1:n + 1] - 1  # the last entry of rows 0..n-1
    rank = keep_list.long().cumsum(0) - 1  # edge-list position among the kept edges
    new_src = place(pos, sel(src, ke), loop_pos, loops, idt)
    new_dst = place(pos, sel(dst, ke), loop_pos, loops, idt)
    new_perm = place(pos, rank.index_select(0, sel(perm, ke)), loop_pos, (num_edges - n) + loops,
                     torch.int64)

    # CSC: the same kept entries, now pointing at new CSR positions; the loop of
    # source j goes after j's kept out-edges into rows below j.
    cptr, cedge, cdst = base.csc_ptr.long(), base.csc_edge.long(), base.csc_dst.long()
    csrc = src.index_select(0, cedge)  # source of each CSC entry
    ckeep = cdst != csrc
    kt = kept(ckeep)
    cck = excl(ckeep)
    kept_out = cck.index_select(0, cptr[1:]) - cck.index_select(0, cptr[:-1])  # [N_src]
    src_loop = torch.arange(base.num_src, device=dev) < n
    new_cptr = torch.cat([zero, (kept_out + src_loop).cumsum(0)])
    below = excl(ckeep & (cdst < csrc))
    n_below = (below.index_select(0, cptr[1:]) - below.index_select(0, cptr[:-1]))[:n]  # [n]
    rank_in_row = cck[:-1] - cck.index_select(0, cptr[:-1]).index_select(0, csrc)
    after_loop = src_loop.index_select(0, csrc) & (cdst > csrc)
    cpos = sel(new_cptr.index_select(0, csrc) + rank_in_row + after_loop, kt)
    loop_cpos = new_cptr[:n] + n_below
    new_pos = pos if ke is None else torch.empty(base.num_edges, dtype=torch.long,
                                                 device=dev).index_copy_(0, ke, pos)
    return Layout(ptr=new_ptr.to(idt), src=new_src, dst=new_dst, perm=new_perm,
                  num_src=base.num_src, num_dst=base.num_dst,
                  csc=(new_cptr.to(idt),
                       place(cpos, new_pos.index_select(0, sel(cedge, kt)), loop_cpos, loop_pos, idt),
                       place(cpos, sel(cdst, kt), loop_cpos, loops, idt)))
