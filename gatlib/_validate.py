"""Argument checks shared by the layers: fail early, name the argument, before anything is
computed. One host sync per graph (the index range check) is the price of never crashing inside
an indexing kernel; a :class:`gatlib.GraphPlan` pays it once for many calls.
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch_geometric.typing import SparseTensor  # PyG's stand-in class when torch_sparse is absent


_INDEX_DTYPES = (torch.int64, torch.int32)


class UnsupportedInputError(ValueError, NotImplementedError):
    """An input gatlib's layer refuses where PyG's layer raises
    ``NotImplementedError`` for the same input (a ``torch_sparse.SparseTensor``
    adjacency with edge features and ``add_self_loops=True``).

    Like gatlib's other refusals of bad input it is a ``ValueError``; it is also a
    ``NotImplementedError``, so code written for PyG's layer catches it too.
    """


def autocast_enabled(device: str) -> bool:
    """Whether autocast is on for ``device`` (a device type)."""
    # (dynamo before torch 2.13 cannot trace torch.amp.is_autocast_available: asked
    # only for devices other than CPU and CUDA, where is_autocast_enabled could raise)
    if device not in ("cpu", "cuda") and not torch.amp.is_autocast_available(device):
        return False
    return torch.is_autocast_enabled(device)


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}; got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)


def check_in_channels(name: str, value) -> None:
    """An int (``-1`` for lazy initialisation) or a pair of them."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    if isinstance(value, (tuple, list)) and len(value) != 2:
        raise ValueError(f"{name} must be an int or a (source, destination) pair; got {value!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must be an int or a pair of ints; got {value!r}")
        if v < 1 and v != -1:
            raise ValueError(f"{name} must be >= 1 (or -1 for lazy initialisation); got {value!r}")


def check_probability(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1); got {type(value).__name__}")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be in [0, 1); got {value}")
    return float(value)


def check_real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
    return float(value)


_FILL_REDUCTIONS = ("add", "sum", "mean", "min", "max", "mul")


def check_fill_value(value, edge_dim: Optional[int]) -> None:
    if isinstance(value, str):
        if value not in _FILL_REDUCTIONS:
            raise ValueError(f"fill_value must be a number, a tensor or one of {_FILL_REDUCTIONS}; "
                             f"got {value!r}")
    elif isinstance(value, Tensor):
        if edge_dim is not None and value.numel() not in (1, edge_dim):
            raise ValueError(f"fill_value tensor must have 1 or edge_dim={edge_dim} elements; "
                             f"got shape {tuple(value.shape)}")
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"fill_value must be a float, a tensor or a reduction name; "
                        f"got {type(value).__name__}")


def check_features(name: str, x, expected: int, weight: Optional[Tensor]) -> Tensor:
    """A ``[N, F]`` floating tensor whose width and dtype match the layer."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor; got dtype {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape [num_nodes, num_features] (2-D); "
                         f"got {x.dim()}-D shape {tuple(x.shape)}")
    if expected != -1 and x.size(1) != expected:
        raise ValueError(f"{name} must have {expected} features (the layer's in_channels); "
                         f"got shape {tuple(x.shape)}")
    # (the mixin, not UninitializedParameter: Parameter's metaclass makes isinstance
    # a Python call)
    if weight is not None and not isinstance(weight, torch.nn.parameter.UninitializedTensorMixin):
        # (under autocast a layer takes another dtype's features, as F.linear does: a
        # previous layer's output in the autocast dtype)
        if x.dtype != weight.dtype and not autocast_enabled(x.device.type):
            raise TypeError(f"{name} has dtype {x.dtype} but the layer's parameters are "
                            f"{weight.dtype}: cast one to the other (e.g. layer.to({x.dtype}))")
        if x.device != weight.device:
            raise ValueError(f"{name} is on {x.device} but the layer's parameters are on "
                             f"{weight.device}")
    return x


def check_edge_index(edge_index, num_src: Optional[int], num_dst: Optional[int],
                     device: Optional[torch.device] = None) -> Tensor:
    """A ``[2, E]`` integer tensor with ``0 <= src < num_src``, ``0 <= dst < num_dst``.

    ``None`` leaves a bound unchecked. Returns an int64 *copy* (int32 input is
    accepted and widened; a PyG ``EdgeIndex`` becomes a plain tensor), so the
    caller owns what it holds and later writes to ``edge_index`` cannot reach it.
    """
    if not isinstance(edge_index, Tensor):
        raise TypeError(f"edge_index must be a torch.Tensor of shape [2, num_edges], a sparse "
                        f"adjacency or a gatlib.GraphPlan; got {type(edge_index).__name__}")
    if edge_index.layout != torch.strided:
        raise TypeError("edge_index must be a dense [2, num_edges] index tensor or a sparse "
                        "adjacency in COO, CSR or CSC layout (or a torch_sparse.SparseTensor); "
                        f"got layout {edge_index.layout}")
    if edge_index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"edge_index must have dtype torch.int64 (or int32); got {edge_index.dtype}")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, num_edges]; got {tuple(edge_index.shape)}")
    if device is not None and edge_index.device != device:
        raise ValueError(f"edge_index is on {edge_index.device} but x is on {device}")
    if hasattr(edge_index, "as_tensor"):  # torch_geometric.EdgeIndex
        edge_index = edge_index.as_tensor()
    ei = edge_index.to(torch.int64, memory_format=torch.contiguous_format, copy=True)
    _check_range(ei, num_src, num_dst)  # on the copy: what is checked is what is used
    return ei


def check_edge_index_sizes(edge_index, num_src: Optional[int], num_dst: Optional[int]) -> None:
    """A PyG ``EdgeIndex``'s declared ``sparse_size`` must match the inputs."""
    rows, cols = edge_index.sparse_size()
    for name, declared, actual in (("source", rows, num_src), ("destination", cols, num_dst)):
        if declared is not None and actual is not None and declared != actual:
            raise ValueError(f"edge_index is an EdgeIndex of sparse_size {edge_index.sparse_size()} "
                             f"but the inputs have {actual} {name} nodes")


_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc)


def is_adjacency(edge_index) -> bool:
    """Whether ``edge_index`` is a sparse adjacency: a ``torch.sparse`` tensor in COO, CSR
    or CSC layout (PyG's ``is_torch_sparse_tensor``, asked twice per layer call and
    here without its Python call), or a ``torch_sparse.SparseTensor``."""
    if isinstance(edge_index, Tensor):
        return edge_index.layout in _SPARSE_LAYOUTS
    return isinstance(edge_index, SparseTensor)


def check_adjacency(adj, num_src: Optional[int], num_dst: Optional[int],
                    device: Optional[torch.device] = None) -> Tuple[int, int]:
    """``(N_src, N_dst)`` of a sparse adjacency given as PyG's ``adj_t``: shape
    ``[N_dst, N_src]``, entry ``[i, j]`` an edge ``j -> i``. Checks that it is 2-D
    (dense dimensions of its values aside), on ``device`` and as large as the
    inputs (``None`` leaves a size unchecked)."""
    if isinstance(adj, SparseTensor):
        (n_dst, n_src), adj_device = adj.sparse_sizes(), adj.device()
    else:
        sparse_dims = adj.dim() - adj.dense_dim()
        if sparse_dims != 2:
            raise ValueError("edge_index must be a 2-D sparse adjacency [num_dst, num_src]; got a "
                             f"sparse tensor of shape {tuple(adj.shape)} with {sparse_dims} "
                             "sparse (and batch) dimensions")
        (n_dst, n_src), adj_device = adj.shape[:2], adj.device
    if device is not None and adj_device != device:
        raise ValueError(f"edge_index is on {adj_device} but x is on {device}")
    for name, declared, actual in (("source", n_src, num_src), ("destination", n_dst, num_dst)):
        if actual is not None and declared != actual:
            raise ValueError(
                f"edge_index is a sparse adjacency of shape [{n_dst}, {n_src}] (destinations x "
                f"sources: PyG's adj_t, entry [i, j] an edge j -> i) but the inputs have {actual} "
                f"{name} nodes")
    return n_src, n_dst


def check_compressed(ptr: Tensor, index: Tensor, num_rows: int, what: str) -> None:
    """The offsets ``ptr`` of a compressed (CSR or CSC) adjacency: ``num_rows + 1`` of
    them, from 0 to ``index.numel()``, non-decreasing (torch does not check these
    when it builds such a tensor). One host sync."""
    ptr_name, index_name = what.split("/")
    if ptr.dim() != 1 or ptr.numel() != num_rows + 1:
        raise ValueError(f"edge_index's {ptr_name} must have shape [{num_rows + 1}]; "
                         f"got {tuple(ptr.shape)}")
    if index.dim() != 1:
        raise ValueError(f"edge_index's {index_name} must be 1-D; got shape {tuple(index.shape)}")
    first, last, ordered = torch.stack([ptr[0], ptr[-1], (ptr.diff() >= 0).all().to(ptr.dtype)]).tolist()
    if first != 0 or last != index.numel() or not ordered:
        raise ValueError(f"edge_index's {ptr_name} must run from 0 to the number of entries "
                         f"({index.numel()}) without decreasing; got first {first}, last {last}"
                         f"{'' if ordered else ', decreasing'}")


def _check_range(edge_index: Tensor, num_src: Optional[int], num_dst: Optional[int],
                 names=("edge_index[0] (source)", "edge_index[1] (destination)")) -> None:
    """``0 <= edge_index[0] < num_src`` and ``0 <= edge_index[1] < num_dst``; ``names``
    say what the two rows are called in the errors."""
    if edge_index.numel() == 0:
        return
    if torch.compiler.is_compiling():
        # Inside a compiled graph a host sync would split the graph: the same
        # checks run on the device and fail the call with a RuntimeError. (The
        # messages leave the node counts out: a count written into a string would
        # fix the compiled graph to that count.)
        torch._assert_async(edge_index.min() >= 0, "edge_index contains a negative index")
        if num_src is not None:
            torch._assert_async(edge_index[0].max() < num_src,
                                f"{names[0]} out of range for the source nodes")
        if num_dst is not None:
            torch._assert_async(edge_index[1].max() < num_dst,
                                f"{names[1]} out of range for the destination nodes")
        return
    # First over all indices (one reduction: cheaper than one per row on a small
    # subgraph, docs/design.md, "Per-call cost on small graphs"); per row only where
    # the whole range exceeds the smaller bound.
    lo, hi = torch.aminmax(edge_index)
    lo, hi = (lo.item(), hi.item()) if edge_index.device.type == "cpu" else \
        torch.stack([lo, hi]).tolist()  # one host sync for both
    if lo >= 0 and (num_src is None or hi < num_src) and (num_dst is None or hi < num_dst):
        return
    lo, hi = torch.aminmax(edge_index, dim=1)  # [2] each
    lo_src, lo_dst, hi_src, hi_dst = torch.cat([lo, hi]).tolist()  # one host sync for all four
    lo = min(lo_src, lo_dst)
    if lo < 0:
        raise IndexError(f"edge_index contains a negative index ({lo}); indices must be >= 0")
    if num_src is not None and hi_src >= num_src:
        raise IndexError(f"{names[0]} contains index {hi_src}, out of range "
                         f"for {num_src} source nodes")
    if num_dst is not None and hi_dst >= num_dst:
        raise IndexError(f"{names[1]} contains index {hi_dst}, out of range "
                         f"for {num_dst} destination nodes")


def _check_floating(name: str, t, x: Tensor, x_name: str = "x") -> None:
    """``t`` is a floating-point tensor on the device of ``x`` (called ``x_name``)."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor; got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")


def check_edge_weight(edge_weight, num_edges: int, value: Tensor) -> None:
    """``[E]`` floating multipliers of the attention weights (explainer edge masks)."""
    _check_floating("edge_weight", edge_weight, value, "value")
    if edge_weight.shape != (num_edges,):
        raise ValueError(f"edge_weight must have shape [num_edges={num_edges}]; "
                         f"got {tuple(edge_weight.shape)}")


def check_value(value, heads: int) -> None:
    """The values of a :func:`gatlib.graph_attention` call: ``[N_src, H, C]``, or
    ``[N_src, 1, C]`` (one head that every head shares)."""
    if not isinstance(value, Tensor) or value.dim() != 3:
        raise ValueError(f"value must be a [N_src, H, C] tensor (or [N_src, 1, C], one head for "
                         f"all); got {getattr(value, 'shape', type(value).__name__)}")
    if value.size(1) not in (1, heads):
        raise ValueError(f"value has {value.size(1)} heads; the score has {heads} (or 1, shared)")


def check_attention_inputs(score, value, value_edge, num_src: int, num_dst: int,
                           num_edges: int) -> None:
    """The tensors of a :func:`gatlib.graph_attention` call agree with the graph and one
    another (rows per node and edge, ``H`` heads, the kind's channels): the kernels index them
    by node and edge, so a row too few would be read past its end. (``value``: :func:`check_value`.)"""
    H = score.heads
    terms = [("src", score.src, num_src, "N_src", (H, 1) if score.kind == "dot" else (H,)),
             ("dst", score.dst, num_dst, "num_dst", (H,)),
             ("edge", score.edge, num_edges, "E", (H,))]
    wide = score.kind != "gat"  # terms of CK channels, else scalars
    CK = score.dst.size(-1) if wide else None
    for name, t, rows, what, heads in terms:
        if t is None:
            continue
        if not (t.dim() == 2 + wide and t.size(0) == rows and t.size(1) in heads
                and (not wide or t.size(2) == CK)):
            dims = [f"{what}={rows}", f"H={H}" + (" or 1" if len(heads) > 1 else "")]
            raise ValueError(f"score's {name} must have shape [{', '.join(dims + [f'C={CK}'] * wide)}]; "
                             f"got {tuple(t.shape)}")
    if score.kind == "gatv2" and tuple(score.att.shape) != (H, CK):
        raise ValueError(f"score's att must have shape [H={H}, C={CK}]; got {tuple(score.att.shape)}")
    if value_edge is not None and tuple(value_edge.shape) != (num_edges, H, value.size(-1)):
        raise ValueError(f"value_edge must have shape [E={num_edges}, H={H}, C={value.size(-1)}]; "
                         f"got {tuple(value_edge.shape)}")


def check_bias(bias, width: int, value: Tensor) -> None:
    """An output bias: ``[width]`` floating values, one per output channel."""
    _check_floating("bias", bias, value, "value")
    if bias.shape != (width,):
        raise ValueError(f"bias must have shape [{width}] (one value per output channel: heads * "
                         f"channels concatenated, channels averaged); got {tuple(bias.shape)}")


def check_edge_attr(edge_attr, num_edges: int, edge_dim: Optional[int], x: Tensor,
                    user_defined: bool = False) -> Optional[Tensor]:
    """``[E, edge_dim]`` (or ``[E]`` when ``edge_dim == 1``) floating features.

    ``user_defined``: a subclass's own ``edge_update``/``message`` reads
    ``edge_attr`` (as PyG passes it on whatever ``edge_dim`` is), so with
    ``edge_dim=None`` any ``[E, ...]`` floating tensor is accepted as it is."""
    if edge_dim is None and user_defined and edge_attr is not None:
        _check_floating("edge_attr", edge_attr, x)
        if edge_attr.dim() == 0 or edge_attr.size(0) != num_edges:
            raise ValueError(f"edge_attr must have one row per edge ({num_edges} edges in "
                             f"edge_index); got shape {tuple(edge_attr.shape)}")
        return edge_attr
    if edge_dim is None:
        if edge_attr is not None:
            raise ValueError("edge_attr was given but the layer was built with edge_dim=None; "
                             "pass edge_dim=<number of edge features> to use edge features")
        return None
    if edge_attr is None:
        raise ValueError(f"edge_attr is required: the layer was built with edge_dim={edge_dim}")
    if not isinstance(edge_attr, Tensor):
        raise TypeError(f"edge_attr must be a torch.Tensor; got {type(edge_attr).__name__}")
    if not edge_attr.is_floating_point():
        raise TypeError(f"edge_attr must be a floating-point tensor; got dtype {edge_attr.dtype}")
    if edge_attr.dim() == 1 and edge_dim == 1:
        edge_attr = edge_attr.view(-1, 1)
    if edge_attr.dim() != 2:
        raise ValueError(f"edge_attr must have shape [num_edges, edge_dim={edge_dim}]; "
                         f"got {tuple(edge_attr.shape)}")
    if edge_attr.size(0) != num_edges:
        raise ValueError(f"edge_attr must have one row per edge ({num_edges} edges in edge_index); "
                         f"got {edge_attr.size(0)} rows")
    if edge_attr.size(1) != edge_dim:
        raise ValueError(f"edge_attr must have edge_dim={edge_dim} columns; "
                         f"got shape {tuple(edge_attr.shape)}")
    # (under autocast the edge features keep their dtype beside features in the autocast
    # dtype, as F.linear takes them: lin_edge computes in the autocast dtype)
    if edge_attr.dtype != x.dtype and not autocast_enabled(x.device.type):
        raise TypeError(f"edge_attr has dtype {edge_attr.dtype} but x has {x.dtype}")
    if edge_attr.device != x.device:
        raise ValueError(f"edge_attr is on {edge_attr.device} but x is on {x.device}")
    return edge_attr
