r"""Graph plans: a graph's edges, checked once and held in the orders kernels read.

A :class:`GraphPlan` owns everything derived from a graph's edges (the checked edge list, the
CSR/CSC layout, its self-loop'ed twin, kernels' private layouts); nothing else in gatlib holds
such state. It copies its input, hands out copies, frees what it derived with itself, works
under ``no_grad``/``inference_mode`` and in DataLoader workers, and keeps nothing that a
compiled call derives (docs/compile.md). What plans take and cost: docs/pyg_compatibility.md.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import torch
from torch import Tensor

from torch_geometric import EdgeIndex
from torch_geometric.index import ptr2index
from torch_geometric.typing import SparseTensor

from . import _validate as V
from ._layout import (Layout, _csc_layout_fn, _csr_layout_fn, _edge_index_layout_fn,
                      _layout_with_loops, _normal, _sorted_looped_layout, build_layout)


class GraphPlan:
    r"""A graph's edges, checked once, with the CSR/CSC layouts kernels read.

    Args:
        edge_index (Tensor, EdgeIndex or sparse adjacency): ``[2, E]`` integer ``(source,
            destination)`` pairs (int64 or int32), a PyG ``EdgeIndex``, or a sparse adjacency
            ``adj_t`` ``[N_dst, N_src]`` (``torch.sparse`` COO/CSR/CSC or a
            ``torch_sparse.SparseTensor``; entry ``[i, j]`` an edge ``j -> i``, values ignored).
            The plan copies it; input already in order is not sorted again.
        num_nodes (int, optional): nodes of a graph whose sources and destinations are the
            same. (default: the largest index plus one; an adjacency's shape)
        size ((int, int), optional): ``(N_src, N_dst)`` of a bipartite graph, instead of
            ``num_nodes``.

    A layer called with a plan raises ``ValueError`` unless the plan's sizes match its inputs.
    """

    def __init__(self, edge_index: Tensor, num_nodes: Optional[int] = None, *,
                 size: Optional[Tuple[int, int]] = None):
        if isinstance(edge_index, GraphPlan):
            raise TypeError("edge_index is already a GraphPlan")
        num_src, num_dst = _sizes(num_nodes, size)
        ei, layout_fn = checked_edge_list(edge_index, num_src, num_dst)
        if num_src is None and V.is_adjacency(edge_index):  # its shape
            num_src, num_dst = V.check_adjacency(edge_index, None, None)
        elif num_src is None:  # infer from the indices, as PyG's maybe_num_nodes does
            n = int(ei.max()) + 1 if ei.numel() else 0
            num_src = num_dst = n
        self._init(ei, num_src, num_dst, layout_fn, kept=True)

    # -- construction ---------------------------------------------------------
    def _init(self, ei: Tensor, num_src: int, num_dst: int,
              layout_fn: Optional[Callable[[], Layout]], sink: bool = False,
              kept: bool = False) -> None:
        self._ei = ei  # [2, E] int64, contiguous, owned by this plan
        # kept: the caller holds this plan across calls (a layer's throw-away plan is not)
        self._kept = kept
        self._num_src = num_src
        self._num_dst = num_dst
        self._sink = sink  # destination num_dst collects the edges attention ignores
        self._layout: Optional[Layout] = None
        self._layout_fn_sorted = layout_fn is not None  # from a sorted EdgeIndex
        rows = num_dst + 1 if sink else num_dst
        self._layout_fn = layout_fn if layout_fn is not None else (
            lambda: build_layout(ei[0], ei[1], num_src, rows))
        self._loops: Dict[Tuple[Optional[int], bool], GraphPlan] = {}
        self._base_ei: Optional[Tensor] = None  # the edges before with_self_loops added loops
        self._derived: Dict[Hashable, Any] = {}

    @classmethod
    def _owned(cls, ei: Tensor, num_src: int, num_dst: int,
               layout_fn: Optional[Callable[[], Layout]] = None, sink: bool = False,
               kept: bool = False) -> "GraphPlan":
        """A plan around an already checked int64 ``[2, E]`` that nobody else holds
        (``sink``: see :attr:`num_rows`; ``kept``: held across calls)."""
        plan = cls.__new__(cls)
        plan._init(ei, num_src, num_dst, layout_fn, sink, kept)
        return plan

    def _keeps(self) -> bool:
        """Whether what is derived now may be kept: not inside a compiled graph when the plan
        outlives the call (the graph's outputs are its memory to reuse: docs/compile.md)."""
        return not (self._kept and torch.compiler.is_compiling())

    # -- what users read ------------------------------------------------------
    @property
    def num_src(self) -> int:
        return self._num_src

    @property
    def num_dst(self) -> int:
        return self._num_dst

    @property
    def num_edges(self) -> int:
        return self._ei.size(1)

    @property
    def num_rows(self) -> int:
        """Destination rows the kernels compute: ``num_dst``, plus a sink row where a plan built
        under ``torch.compile`` keeps the graph's own self-loops pointed at it
        (:func:`_drop_and_add_loops`); :func:`gatlib._dispatch.attend_planned` drops it."""
        return self._num_dst + 1 if self._sink else self._num_dst

    @property
    def sink(self) -> bool:
        """Whether destination row ``num_dst`` is a sink (see :attr:`num_rows`)."""
        return self._sink

    @property
    def device(self) -> torch.device:
        return self._ei.device

    @property
    def edge_index(self) -> Tensor:
        """A copy of the ``[2, E]`` int64 edge list (editing it changes nothing here).
        In a plan with a sink the edges pointed at it are the graph's own self-loops
        again (their attention weight is zero)."""
        if self._sink:
            src, dst = self._ei
            return torch.stack([src, torch.where(dst == self._num_dst, src, dst)])
        return self._ei.clone()

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this plan holds: its edge list and everything it has
        derived so far (layouts, kernel layouts, self-loop'ed twins)."""
        seen = set()

        def size(obj) -> int:
            if isinstance(obj, Tensor):
                if obj.data_ptr() in seen:
                    return 0
                seen.add(obj.data_ptr())
                return obj.numel() * obj.element_size()
            if isinstance(obj, GraphPlan):
                return sum(map(size, (obj._ei, obj._layout, *obj._derived.values(),
                                      *obj._loops.values())))
            if dataclasses.is_dataclass(obj):
                return sum(size(getattr(obj, f.name)) for f in dataclasses.fields(obj))
            if isinstance(obj, (tuple, list)):
                return sum(map(size, obj))
            return 0

        return size(self)

    def with_self_loops(self, num_nodes: Optional[int] = None) -> "GraphPlan":
        """This graph without its self-loops plus one on each of the first ``num_nodes`` nodes
        (default ``min(N_src, N_dst)``), appended in PyG's order; built once per plan and ``num_nodes``."""
        n = min(self.num_src, self.num_dst) if num_nodes is None else num_nodes
        if not 0 <= n <= min(self.num_src, self.num_dst):
            raise ValueError(f"num_nodes must be in [0, {min(self.num_src, self.num_dst)}] "
                             f"(self-loops need both a source and a destination); got {n}")
        # (one twin per form, the compiled one with a sink; the default count keyed as None: a
        # size as a dict key would recompile a compiled graph for every new plan's size)
        key = None if num_nodes is None else n
        looped = self._loops.get((key, False))
        if looped is None and torch.compiler.is_compiling():
            looped = self._loops.get((key, True))
        if looped is None:
            looped = self._looped(n, *_normal(_drop_and_add_loops, self._ei, n, self.num_dst), key=key)
        return looped

    def _looped(self, n: int, keep: Tensor, looped_ei: Tensor, sink: bool,
                key: Optional[int]) -> "GraphPlan":
        """The plan of ``looped_ei`` (:func:`_drop_and_add_loops` of this plan's edges),
        kept on this plan under ``(key, sink)``. It holds this plan's edge list and layout
        builder, not this plan: no reference cycle, so both are freed as soon as they are dropped."""
        num_src, num_dst = self.num_src, self.num_dst
        base_ei, base_layout, base_fn = self._ei, self._layout, self._layout_fn
        compressed = self._layout_fn_sorted  # a sorted EdgeIndex's or an adjacency's own CSR/CSC

        def layout() -> Layout:
            # merged in O(E) where the base layout exists or comes from the input's compressed
            # structure; a plain edge list is sorted with its loops (docs/design.md, "Self-loops
            # sorted with the edges")
            if sink or (base_layout is None and not compressed):
                return _sorted_looped_layout(looped_ei, num_src, num_dst + 1 if sink else num_dst, n)
            return _layout_with_loops(base_layout or base_fn(), keep, looped_ei.size(1), n)

        looped = GraphPlan._owned(looped_ei, num_src, num_dst, layout, sink, self._kept)
        looped._base_ei = base_ei
        # atomic: concurrent callers get one plan
        return self._loops.setdefault((key, sink), looped) if self._keeps() else looped

    def to(self, device: torch.device | str) -> "GraphPlan":
        """This plan's graph on ``device`` (layouts are rebuilt there when used)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return GraphPlan._owned(self._ei.to(device), self.num_src, self.num_dst, sink=self._sink,
                                kept=True)

    def __repr__(self) -> str:
        return (f"GraphPlan(num_src={self.num_src}, num_dst={self.num_dst}, "
                f"num_edges={self.num_edges}, device={self.device})")

    def __getstate__(self):  # picklable (DataLoader workers): derived state is rebuilt there
        return {"ei": self._ei, "num_src": self.num_src, "num_dst": self.num_dst, "sink": self._sink}

    def __setstate__(self, state):
        self._init(state["ei"], state["num_src"], state["num_dst"], None, state.get("sink", False),
                   kept=True)

    # -- what kernels read (read-only: kernels never write to these) ----------
    def coo(self) -> Tuple[Tensor, Tensor]:
        """``(src, dst)``, each ``[E]`` int64, in edge-list order (``dst`` in
        ``[0, num_rows)``)."""
        return self._ei[0], self._ei[1]

    def layout(self) -> Layout:
        """The CSR/CSC :class:`Layout`, built on first use."""
        if self._layout is None:
            layout = self.derived("layout", self._layout_fn)
            if not self._keeps():
                return layout
            self._layout = layout
        return self._layout

    def derived(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` once per plan and ``key``: where kernels keep what they derive from the
        graph, so that it lives and dies with the plan; ``build`` must only read the plan."""
        value = self._derived.get(key)
        if value is None:
            value = _normal(build)
            if self._keeps():  # atomic: concurrent callers get one value
                value = self._derived.setdefault(key, value)
        return value


def _drop_and_add_loops(ei: Tensor, n: int, num_dst: int) -> Tuple[Tensor, Tensor, bool]:
    """``(keep [E] bool, looped [2, E'], sink)``: the edges that are not self-loops, then
    loops ``i -> i`` for ``i < n``. Under ``torch.compile`` the self-loops keep their place,
    pointed at a sink destination ``num_dst`` (``E' = E + n``): a compiled graph's sizes must
    follow from its inputs' sizes alone.
    """
    keep = ei[0] != ei[1]  # [E]
    loops = torch.arange(n, device=ei.device)
    if torch.compiler.is_compiling():
        ei = torch.stack([ei[0], torch.where(keep, ei[1], num_dst)])
        return keep, torch.cat([ei, loops.expand(2, n)], dim=1), True
    # a sampled subgraph rarely has loops: the masked copy only where some must go
    if not bool(keep.all()):
        ei = ei[:, keep]
    return keep, torch.cat([ei, loops.expand(2, n)], dim=1), False


def _sizes(num_nodes, size) -> Tuple[Optional[int], Optional[int]]:
    if num_nodes is not None and size is not None:
        raise ValueError("pass either num_nodes or size=(N_src, N_dst), not both")
    if size is not None:
        if not isinstance(size, (tuple, list)) or len(size) != 2:
            raise ValueError(f"size must be a pair (N_src, N_dst); got {size!r}")
        return (V.check_positive_int("size[0]", size[0], minimum=0),
                V.check_positive_int("size[1]", size[1], minimum=0))
    if num_nodes is not None:
        n = V.check_positive_int("num_nodes", num_nodes, minimum=0)
        return n, n
    return None, None


def checked_edge_list(edge_index, num_src: Optional[int], num_dst: Optional[int],
                      device: Optional[torch.device] = None,
                      ) -> Tuple[Tensor, Optional[Callable[[], Layout]]]:
    """A checked int64 ``[2, E]`` copy of ``edge_index`` and, for a sorted
    ``EdgeIndex`` or a compressed sparse adjacency, a builder of its layout from
    the input's own CSR/CSC."""
    if V.is_adjacency(edge_index):
        return _normal(_adjacency_edge_list, edge_index, num_src, num_dst, device)
    ei = _normal(V.check_edge_index, edge_index, num_src, num_dst, device)  # an owned int64 copy
    layout_fn = None
    if isinstance(edge_index, EdgeIndex):
        V.check_edge_index_sizes(edge_index, num_src, num_dst)
        if edge_index.is_sorted and ei.numel():
            n_src = num_src if num_src is not None else edge_index.get_num_rows()
            n_dst = num_dst if num_dst is not None else edge_index.get_num_cols()
            layout_fn = _edge_index_layout_fn(edge_index, n_src, n_dst)
    return ei, layout_fn


def owned_plan(ei: Tensor, num_src: int, num_dst: int,
               layout_fn: Optional[Callable[[], Layout]] = None) -> GraphPlan:
    """A plan around a checked int64 ``[2, E]`` (:func:`checked_edge_list`'s) that
    nobody else holds: no copy."""
    return GraphPlan._owned(ei, num_src, num_dst, layout_fn)


def base_edge_index(plan: GraphPlan) -> Optional[Tensor]:
    """The ``[2, E]`` edges of a :meth:`~GraphPlan.with_self_loops` plan (or of
    :func:`as_plan`'s with ``self_loops``) before the loops were added (read-only);
    ``None`` for a plan made otherwise."""
    return plan._base_ei


def as_plan(edge_index, num_src: int, num_dst: Optional[int], device: torch.device,
            self_loops: bool = False, loop_nodes: Optional[int] = None) -> GraphPlan:
    """The plan a layer runs on: ``edge_index`` itself if it is a :class:`GraphPlan` of the
    right sizes, else a throw-away plan of the checked tensor; with ``self_loops``, that
    plan's :meth:`~GraphPlan.with_self_loops` ``(loop_nodes)``."""
    if not isinstance(edge_index, GraphPlan):
        if num_dst is None and V.is_adjacency(edge_index):  # destinations: the adjacency's rows
            num_dst = V.check_adjacency(edge_index, num_src, None, device)[1]
        ei, layout_fn = checked_edge_list(edge_index, num_src, num_dst, device)
        if not self_loops:
            return GraphPlan._owned(ei, num_src, num_dst, layout_fn)
        # loops computed before any plan exists: torch.compile splits the graph at their
        # data-dependent size and resumes only with tensors in flight
        n = min(num_src, num_dst) if loop_nodes is None else loop_nodes
        keep, looped_ei, sink = _drop_and_add_loops(ei, n, num_dst)
        if layout_fn is not None:  # the input's own CSR/CSC: loops merge into its layout
            return GraphPlan._owned(ei, num_src, num_dst, layout_fn)._looped(
                n, keep, looped_ei, sink, key=None if loop_nodes is None else n)
        # a plain edge list: its looped twin is sorted directly (see GraphPlan._looped),
        # and nothing else reads the plan without loops: it is not made
        rows = num_dst + 1 if sink else num_dst
        looped = GraphPlan._owned(looped_ei, num_src, num_dst,
                                  lambda: _sorted_looped_layout(looped_ei, num_src, rows, n), sink)
        looped._base_ei = ei
        return looped
    plan = _check_plan(edge_index, num_src, num_dst, device)
    return plan.with_self_loops(loop_nodes) if self_loops else plan


def _check_plan(plan: GraphPlan, num_src: int, num_dst: Optional[int],
                device: torch.device) -> GraphPlan:
    """``plan``, if its sizes match the inputs' (``num_dst=None``: any) and its device."""
    num_dst = plan.num_dst if num_dst is None else num_dst
    if (plan.num_src, plan.num_dst) != (num_src, num_dst):
        raise ValueError(
            f"edge_index is a GraphPlan of a graph with {plan.num_src} source and "
            f"{plan.num_dst} destination nodes, but the inputs have {num_src} and "
            f"{num_dst}: build the plan with num_nodes= (or size=) matching x")
    if plan.device != device:
        raise ValueError(f"edge_index is a GraphPlan on {plan.device} but x is on {device}")
    return plan


_ADJ_NAMES = ("edge_index's column (source) indices", "edge_index's row (destination) indices")


def _adjacency_edge_list(adj, num_src: Optional[int], num_dst: Optional[int],
                         device: Optional[torch.device]
                         ) -> Tuple[Tensor, Optional[Callable[[], Layout]]]:
    """:func:`checked_edge_list` of a sparse adjacency ``adj_t`` ``[N_dst, N_src]``:
    its entries as ``(source, destination)`` pairs in the order it stores them, and
    for a CSR/CSC (or ``SparseTensor``) a layout builder that takes the compressed
    side as it is."""
    n_src, n_dst = V.check_adjacency(adj, num_src, num_dst, device)
    if isinstance(adj, SparseTensor):  # always row-sorted: a CSR
        rowptr, col = adj.storage.rowptr(), adj.storage.col()
        return _compressed_edge_list(rowptr, col, n_src, n_dst, "rowptr/col", rows_are_dst=True)
    if adj.layout == torch.sparse_csr:
        return _compressed_edge_list(adj.crow_indices(), adj.col_indices(), n_src, n_dst,
                                     "crow_indices/col_indices", rows_are_dst=True)
    if adj.layout == torch.sparse_csc:
        return _compressed_edge_list(adj.ccol_indices(), adj.row_indices(), n_src, n_dst,
                                     "ccol_indices/row_indices", rows_are_dst=False)
    # COO, in stored order (PyG's to_edge_index would also mark the caller's tensor
    # coalesced); a coalesced one is destination-sorted, which build_layout sees.
    idx = adj._indices()
    ei = torch.stack([idx[1], idx[0]]).to(torch.int64)  # an owned copy
    V._check_range(ei, n_src, n_dst, _ADJ_NAMES)
    return ei, None


def _compressed_edge_list(ptr: Tensor, index: Tensor, num_src: int, num_dst: int, what: str,
                          rows_are_dst: bool) -> Tuple[Tensor, Callable[[], Layout]]:
    """The ``[2, E]`` edge list of a CSR (``rows_are_dst``: offsets over destinations,
    source indices) or CSC (offsets over sources, destination indices) adjacency, in
    its stored order, and the builder of its layout from ``ptr`` — copied here,
    so that the plan holds nothing of the caller's."""
    V.check_compressed(ptr, index, num_dst if rows_are_dst else num_src, what)
    ptr = ptr.to(torch.int64, copy=True)
    compressed = ptr2index(ptr, output_size=index.numel())
    pair = (index.to(torch.int64), compressed) if rows_are_dst else (compressed, index.to(torch.int64))
    ei = torch.stack(pair)  # an owned copy
    V._check_range(ei, num_src, num_dst, _ADJ_NAMES)
    if rows_are_dst:
        return ei, _csr_layout_fn(ptr, ei, num_src, num_dst)
    return ei, _csc_layout_fn(ptr, ei, num_src, num_dst)
