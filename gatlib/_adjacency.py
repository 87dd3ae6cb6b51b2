r"""Sparse adjacencies given to a layer, as PyTorch Geometric 2.8's layers take them: what
their values mean (``[nnz, D]`` ones stand in for a missing ``edge_attr``, 1-D ones are
ignored) and what comes back with the attention weights. Where PyG raises or quietly drops an
edge term, gatlib raises a ``ValueError`` naming ``edge_index`` (docs/pyg_compatibility.md).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch_geometric.typing import SparseTensor
from torch_geometric.utils import to_torch_coo_tensor, to_torch_csc_tensor, to_torch_csr_tensor
from torch_geometric.utils.sparse import set_sparse_value  # what PyG's layers call (not exported)

from . import _validate as V
from ._plan import GraphPlan


def _values(adj) -> Optional[Tensor]:
    """The adjacency's values in stored order (``None``: a ``SparseTensor`` without)."""
    if isinstance(adj, SparseTensor):
        return adj.storage.value()
    if adj.layout == torch.sparse_coo and not adj.is_coalesced():
        return adj._values()  # values() refuses an uncoalesced tensor
    return adj.values()


def edge_features(adj, edge_attr: Optional[Tensor], edge_dim: Optional[int], self_loops: bool,
                  x: Tensor) -> Optional[Tensor]:
    """The edge features a layer built with ``edge_dim`` uses with adjacency ``adj``:
    ``edge_attr`` if given (rows in the adjacency's stored order), else, as in PyG,
    the adjacency's values if they are ``[nnz, D]``. 1-D values are edge weights,
    which attention ignores (PyG too)."""
    values = _values(adj)
    if values is not None and values.dim() == 1:
        values = None  # PyG: 1-D values are not edge_attr
    if edge_dim is None:
        if values is not None:
            raise ValueError(
                f"edge_index's values have shape {tuple(values.shape)}: PyG passes such values "
                "as edge_attr, but the layer was built with edge_dim=None; pass "
                f"edge_dim={values.size(1)} to use them, or an adjacency without them")
        return edge_attr  # None, or an error for the caller's check to raise
    if self_loops:
        if isinstance(adj, SparseTensor):  # PyG: NotImplementedError
            raise V.UnsupportedInputError(
                "edge_index is a SparseTensor, and edge features (edge_dim) with "
                "add_self_loops=True are not supported for it (nor in PyG): pass a "
                "[2, E] edge_index with edge_attr, or add_self_loops=False")
        if edge_attr is not None:
            raise ValueError(
                "edge_attr cannot be combined with a torch.sparse edge_index and "
                "add_self_loops=True (PyG fails on it too): pass the edge features as the "
                "adjacency's [nnz, edge_dim] values, or a [2, E] edge_index with edge_attr")
    if edge_attr is not None:
        return edge_attr  # PyG: an explicit edge_attr wins over the adjacency's values
    if values is None:
        raise ValueError(
            f"edge_attr is required: the layer was built with edge_dim={edge_dim}, and "
            "edge_index (a sparse adjacency) holds no edge features (those are [nnz, "
            "edge_dim] values; 1-D values are edge weights)")
    if (not isinstance(adj, SparseTensor) and torch.is_grad_enabled() and adj.requires_grad
            and not values.requires_grad):  # _values() of an uncoalesced COO
        raise ValueError(
            "edge_index is an uncoalesced COO tensor whose values are the edge features and "
            "require grad: no gradient can reach values read in stored order (PyG's backward "
            "fails on it too); coalesce it first (adj.coalesce()), or pass edge_attr")
    try:
        return V.check_edge_attr(values, values.size(0), edge_dim, x)
    except (TypeError, ValueError) as e:
        raise type(e)(f"edge_index's values are the edge features (edge_attr): {e}") from None


def check_loops(adj, edges: Tensor, num_src: int, num_dst: int) -> None:
    """Self-loops are about to be added to the graph of ``adj`` (``edges``: its
    ``[2, E]`` edge list). PyG then coalesces a ``torch.sparse`` adjacency, which
    merges repeated entries into one edge (and sums their values); gatlib keeps
    an edge per entry, so such an adjacency is refused rather than computed
    differently. (A ``SparseTensor``'s repeated entries stay, in PyG too.)"""
    if isinstance(adj, SparseTensor):
        return
    src, dst = edges[0], edges[1]
    keep = src != dst  # existing self-loops are dropped anyway
    by_source = adj.layout == torch.sparse_csc
    key = (src * num_dst + dst if by_source else dst * num_src + src)[keep]
    if key.numel() < 2 or bool((key[1:] > key[:-1]).all()):  # stored sorted: no repeats
        return
    key = key.sort().values
    if bool((key[1:] == key[:-1]).any()):
        raise ValueError(
            "edge_index (a torch.sparse adjacency) has repeated entries; with "
            "add_self_loops=True PyG merges them into one edge (it coalesces the "
            "adjacency): coalesce it first (adj.coalesce()), or pass a [2, E] "
            "edge_index to keep them as parallel edges")


def _holding(adj: Tensor, alpha: Tensor) -> Tensor:
    """``adj``'s entries holding ``alpha`` ``[nnz, H]``: PyG's ``set_sparse_value(adj,
    alpha)``, which takes the shape ``[N_dst, N_src, H]`` for granted and reads a
    COO's ``indices()``. For what it cannot take — an adjacency with ``[nnz, D]``
    values (it would make the shape ``[N_dst, N_src, D, H]``) and an uncoalesced COO
    (which PyG's layers never hand it) — the same is built here."""
    if adj.dense_dim() == 0 and (adj.layout != torch.sparse_coo or adj.is_coalesced()):
        return set_sparse_value(adj, alpha)
    size = adj.shape[:2] + alpha.shape[1:]
    # (the input's own indices, which the layer has checked: torch's checks off, explicitly)
    if adj.layout == torch.sparse_coo:  # coalesced afterwards, as set_sparse_value does
        return torch.sparse_coo_tensor(adj._indices(), alpha, size, check_invariants=False).coalesce()
    if adj.layout == torch.sparse_csr:
        return torch.sparse_csr_tensor(adj.crow_indices(), adj.col_indices(), alpha, size,
                                       check_invariants=False)
    return torch.sparse_csc_tensor(adj.ccol_indices(), adj.row_indices(), alpha, size,
                                   check_invariants=False)


def attention_weights(adj, plan: GraphPlan, alpha: Tensor, looped: bool, alpha_values: bool = True):
    """What PyG's layer returns beside ``out`` for a sparse adjacency ``adj``: ``(adj holding
    alpha, alpha)`` for a ``torch.sparse`` one (``alpha_values=False``, as PyG's
    ``TransformerConv``: a copy of ``adj``), the ``SparseTensor`` holding ``alpha`` for a
    ``SparseTensor``. ``alpha`` ``[E, H]`` is in the plan's edge order; with ``looped``
    self-loops PyG rebuilds the adjacency coalesced, so its entries (and ``alpha``) are sorted."""
    if not looped:
        if isinstance(adj, SparseTensor):
            return adj.set_value(alpha, layout="coo")
        return (_holding(adj, alpha) if alpha_values else adj.clone()), alpha
    src, dst = plan.coo()
    csc = not isinstance(adj, SparseTensor) and adj.layout == torch.sparse_csc
    key = src * plan.num_dst + dst if csc else dst * plan.num_src + src
    order = torch.sort(key, stable=True).indices
    src, dst, alpha = src[order], dst[order], alpha[order]  # copies: the plan's stay its own
    size = (plan.num_dst, plan.num_src)
    if isinstance(adj, SparseTensor):
        return SparseTensor(row=dst, col=src, value=alpha, sparse_sizes=size, is_sorted=True,
                            trust_data=True)
    build = {torch.sparse_coo: to_torch_coo_tensor, torch.sparse_csr: to_torch_csr_tensor,
             torch.sparse_csc: to_torch_csc_tensor}[adj.layout]
    return build(torch.stack([dst, src]), alpha, size, is_coalesced=True), alpha
