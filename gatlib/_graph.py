"""Graph structure derived from an ``edge_index``, computed once and cached.

Training calls every layer with the same ``edge_index`` tensor epoch after
epoch; everything derived from it (the range check, the self-loop'ed index,
the CSR/CSC layout of fused backends) is memoised on that tensor object. An
entry is dropped when the tensor is garbage-collected and ignored when the
tensor was modified in place (``Tensor._version`` changed).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Tuple

import torch
from torch import Tensor

# id(tensor) -> (weakref to the tensor, its _version when cached, {key: value})
_MEMO: Dict[int, Tuple[weakref.ref, int, Dict[Hashable, Any]]] = {}


def memo(tensor: Tensor, key: Hashable, fn: Callable[[], Any]) -> Any:
    """``fn()`` cached on ``tensor`` under ``key`` (recomputed after in-place edits)."""
    if torch.jit.is_tracing() or torch.compiler.is_compiling():
        return fn()
    tid = id(tensor)
    entry = _MEMO.get(tid)
    if entry is None or entry[0]() is not tensor or entry[1] != tensor._version:
        ref = weakref.ref(tensor, lambda _, tid=tid, m=_MEMO: m.pop(tid, None))
        entry = (ref, tensor._version, {})
        _MEMO[tid] = entry
    values = entry[2]
    if key not in values:
        values[key] = fn()
    return values[key]


@dataclass
class Layout:
    """Destination-sorted CSR of a graph plus the source-sorted (CSC) view.

    Edge ``k`` in CSR order is edge ``perm[k]`` of the original ``edge_index``;
    row ``i`` holds ``ptr[i]:ptr[i+1]``. The CSC view lists, for each source
    node, its out-edges as positions in CSR order (``csc_edge``) so a backward
    pass can gather per-edge quantities saved in CSR order without atomics.
    Index tensors are int32 when every value fits, else int64.
    """

    ptr: Tensor  # [N_dst + 1]
    src: Tensor  # [E]  source of each edge, CSR order
    dst: Tensor  # [E]  destination of each edge, CSR order (sorted)
    perm: Tensor  # [E]  original edge id of each CSR edge (int64)
    csc_ptr: Tensor  # [N_src + 1]
    csc_edge: Tensor  # [E]  CSR position of each edge, source-sorted
    csc_dst: Tensor  # [E]  destination of each edge, source-sorted
    num_src: int
    num_dst: int
    max_in_degree: int
    max_out_degree: int

    @property
    def num_edges(self) -> int:
        return self.src.numel()


def _index_dtype(*bounds: int) -> torch.dtype:
    return torch.int32 if max(bounds, default=0) < 2**31 - 1 else torch.int64


def build_layout(edge_index: Tensor, num_src: int, num_dst: int) -> Layout:
    """CSR + CSC of a validated int64 ``[2, E]`` ``edge_index`` (stable sorts)."""
    src, dst = edge_index[0], edge_index[1]
    E = src.numel()
    idt = _index_dtype(E, num_src, num_dst)
    perm = torch.argsort(dst, stable=True)  # [E]
    src_csr, dst_csr = src[perm], dst[perm]
    in_deg = torch.bincount(dst, minlength=num_dst)
    ptr = torch.zeros(num_dst + 1, dtype=torch.int64, device=src.device)
    ptr[1:] = torch.cumsum(in_deg, 0)
    cperm = torch.argsort(src_csr, stable=True)  # CSR positions, source-sorted
    out_deg = torch.bincount(src, minlength=num_src)
    csc_ptr = torch.zeros(num_src + 1, dtype=torch.int64, device=src.device)
    csc_ptr[1:] = torch.cumsum(out_deg, 0)
    max_in = int(in_deg.max()) if num_dst > 0 and E > 0 else 0
    max_out = int(out_deg.max()) if num_src > 0 and E > 0 else 0
    return Layout(
        ptr=ptr.to(idt), src=src_csr.to(idt), dst=dst_csr.to(idt), perm=perm,
        csc_ptr=csc_ptr.to(idt), csc_edge=cperm.to(idt), csc_dst=dst_csr[cperm].to(idt),
        num_src=num_src, num_dst=num_dst, max_in_degree=max_in, max_out_degree=max_out,
    )


def layout(edge_index: Tensor, num_src: int, num_dst: int) -> Layout:
    """The cached :class:`Layout` of ``edge_index``."""
    return memo(edge_index, ("layout", num_src, num_dst),
                lambda: build_layout(edge_index, num_src, num_dst))
