r"""The Triton kernels' work and tiling: a plan's work items (:func:`_plan`), each row kernel's
config space and the launches (docs/gpu.md, "Work items" and "Tuning")."""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from . import _triton_kernels as K
from ._layout import Layout, index_dtype
from ._plan import GraphPlan

# Longest run of edges one work item handles; longer rows are split and merged
# (docs/design.md, "Split rows"). The interpreter steps one edge per loop trip at a cost per
# op, not per element: there, rows are split at 16 (docs/design.md, "The interpreter's tiles").
_SPLIT = 256
_SPLIT_INTERPRETER = 16
# A schedule's rows are padded to a multiple of this: the most items a program can own.
_PAD = 64


@dataclass
class _Schedule:
    """Work items over the segments of a CSR ``ptr``, longest first, as device tensors sized by
    the graph's sizes alone: nothing is read on the host, so a compiled or captured call replays
    on a new graph and compiles nothing new."""

    items: Tensor  # [M, 4]: (row, start, length, slot), length and slot -1 past the real items
    splits: Tensor  # [S, 3]: (row, first partial row, pieces); the split rows first, in row order
    bounds: Tensor  # [2] int64: the real items and the split rows (read once per plan)
    pieces: int  # partial rows a call allocates


def _schedule_sizes(num_segments: int, num_edges: int, split: int) -> Tuple[int, int, int]:
    """At most how many items, split segments and pieces of split segments, from the sizes
    alone: a segment of ``d`` edges is at most ``1 + d // split`` items; a split one has
    ``d > split`` edges and fewer than ``2 d / split`` pieces."""
    return (num_segments + num_edges // split, min(num_segments, num_edges // (split + 1)),
            2 * num_edges // split)


def _build_schedules(ptrs: List[Tensor], num_edges: int, split: int) -> List[_Schedule]:
    """The :class:`_Schedule` of each CSR ``ptr`` of ``ptrs`` (each ending at ``num_edges``),
    its segments cut into pieces of at most ``split``: built side by side, one op for all."""
    K_ = len(ptrs)
    sizes = [q.numel() - 1 for q in ptrs]
    n = max(sizes)
    dev = ptrs[0].device
    M, _, max_pieces = _schedule_sizes(n, num_edges, split)  # room for every schedule's items
    M = _padded(M)
    # Each ptr goes on to n + 1 segments of -1 edges: the room past its real items, whose
    # length and slot then come out -1 with no mask.
    p = torch.empty(K_, n + 2, dtype=torch.long, device=dev)
    p[:, -1] = num_edges - 1  # (not a size: an index that is one would fix it when compiled)
    for k, (q, nk) in enumerate(zip(ptrs, sizes, strict=True)):
        p[k, :nk + 1] = q
        if nk < n:
            p[k, nk + 1:n + 1] = num_edges
    deg = p.diff(dim=1)  # [K, n + 1]
    for k, nk in enumerate(sizes):
        if nk < n:
            deg[k, nk:n] = -1
    pieces = (deg + (split - 1)).div_(split, rounding_mode="floor").clamp_(min=1)  # an empty row: one empty item
    ends = pieces.cumsum(1)
    splits = pieces > 1  # (never the room)
    spieces = pieces * splits
    slot0 = spieces.cumsum(1).sub_(spieces)  # a split row's first slot: slots in row order
    w = torch.arange(M, device=dev).repeat(K_, 1)
    row = torch.searchsorted(ends, w, right=True).clamp_(max=n)  # past the last segment: the room's
    j = w.sub_((ends - pieces).gather(1, row))  # the item's piece of its row
    start = p.gather(1, row).add_(j, alpha=split)  # (in the room: any value will do)
    length = deg.gather(1, row).sub_(j, alpha=split).clamp_(-1, split)
    slot = (slot0.gather(1, row) + j).masked_fill_(spieces.gather(1, row) == 0, -1)
    # Longest first: hub pieces start before the short rows fill the gaps.
    order = torch.argsort(length, dim=1, descending=True, stable=True)
    items = torch.stack([row, start, length, slot], 2).gather(1, order.unsqueeze(2).expand(K_, M, 4))
    bounds = torch.stack([(items[:, :, 2] >= 0).sum(1), splits.sum(1)], 1)
    # the split rows first, in row order (a stable sort: no value-sized output)
    split_row = torch.argsort(pieces[:, :n].clamp(max=2), dim=1, descending=True, stable=True)
    first_count = torch.stack([slot0[:, :n], pieces[:, :n]], 1).gather(2, split_row.unsqueeze(1).expand(K_, 2, n))
    idt = index_dtype(num_edges, n + 1, M, max_pieces)
    items = items.to(idt)
    table = torch.stack([split_row, first_count[:, 0], first_count[:, 1]], 2).to(idt)  # [K, n, 3]
    out = []
    for k, nk in enumerate(sizes):
        m, ms, pieces_k = _schedule_sizes(nk, num_edges, split)
        # (a copy: a schedule's splits start on 16 bytes, as its items do, whatever n; Triton
        # specialises on a pointer's alignment)
        out.append(_Schedule(items[k][:_padded(m)], table[k][:ms].clone(), bounds[k],
                             max(1, pieces_k)))
    return out


def _padded(items: int) -> int:
    """Rows of a schedule of ``items`` items: a multiple of :data:`_PAD`, at least one."""
    return max(1, -(-items // _PAD)) * _PAD


@dataclass
class _Plan:
    """Everything the kernels need about one graph, kept on its plan by :func:`_plan`."""

    layout: Layout
    csr_eid: Tensor  # [E] original edge id of each CSR position
    csc_eid: Tensor  # [E] original edge id of each CSC position
    dst_items: _Schedule  # over destinations (CSR)
    src_items: _Schedule  # over sources (CSC)
    splits: Optional[Tuple[bool, bool]] = None  # each schedule has split rows: set by _split_rows


def _plan(plan: GraphPlan) -> _Plan:
    """The kernels' view of ``plan`` (built once, kept on the plan)."""
    split = _split()

    def build():
        lay = plan.layout()
        idt = lay.src.dtype
        return _Plan(lay, lay.perm.to(idt), lay.perm[lay.csc_edge.long()].to(idt),
                     *_build_schedules([lay.ptr, lay.csc_ptr], lay.num_edges, split))

    return plan.derived(("triton.plan", split), build)


def _interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return isinstance(K._fwd_kernel, InterpretedFunction)


def _split() -> int:
    """The longest work item of a plan's schedules (:data:`_SPLIT`)."""
    return min(_SPLIT, _SPLIT_INTERPRETER) if _interpreted() else _SPLIT


# A config: work items per program (BLOCK_R) and the edge loop's software pipelining (STAGES: 1, or
# 3, which issues the next edges' index loads two steps ahead and their gathers one), neither of
# which changes what a program sums or in what order; the warps are fixed per layer by _warps.
_ROWS = tuple(2 ** i for i in range(7))  # 1 .. _PAD
_STAGES = (1, 3)
_CONFIGS = [triton.Config({"BLOCK_R": r, "STAGES": s}, num_warps=w, num_stages=1, maxnreg=255)
            for r in _ROWS for w in (1, 2, 4, 8) for s in _STAGES]
_BY_TILE = {(c.kwargs["BLOCK_R"], c.num_warps, c.kwargs["STAGES"]): c for c in _CONFIGS}
_ROW_KERNELS = ("_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel")


def _tile(consts: dict) -> int:
    """Elements of one work item's padded ``[HP, C]`` tile (the wider of the score's rows and
    the values')."""
    ck = consts["CK"] if consts["KIND"] else 1
    return triton.next_power_of_2(consts["H"]) * triton.next_power_of_2(max(ck, consts["CV"]))


def _warps(tile: int) -> int:
    """Warps per program: one per 256 elements of an item's tile, 1 to 8. Fixed per layer (a
    tile's layout, and so the order of its channel and head sums, follows the warps)."""
    return min(8, max(1, tile // 256))


def _space(name: str, consts: dict) -> List[triton.Config]:
    """Kernel ``name``'s configs for a call with constexprs ``consts``: the fewest items that
    give each thread 8 elements of their tile (the tile's layout along heads and channels is
    then the same for every item count) and, but in the dst kernel, twice that; each
    unpipelined and pipelined. (The dst kernel holds the most tiles: at 16 elements per thread
    Triton 3.6's GATv2 dst kernel spilled 472 bytes, tools.triton_compile.)"""
    tile = _tile(consts)
    w = _warps(tile)
    r0 = max(1, 256 * w // tile)
    if name == "_bwd_dst_kernel":
        rows = [min(r0, K._ATT_ROWS.value)]
    else:
        rows = [r for r in (r0, 2 * r0) if r <= _PAD] or [_PAD]
    return [_BY_TILE[r, w, s] for r in rows for s in _STAGES]


def _default(name: str, consts: dict) -> triton.Config:
    """The config run untuned: the plainest, the fewest items and no pipelining (not timed on
    a GPU)."""
    return _space(name, consts)[0]


def _interpreter_config(group: Optional[int]) -> triton.Config:
    """The interpreter's one config: few programs, as many items as one can own (it pays per
    program and per op, not per element): a group's (GATv2's att gradient), else the padding's."""
    return _BY_TILE[group or _PAD, 4, 1]


# "0": every row kernel runs its default config, untimed.
_AUTOTUNE_ENV = "GATLIB_TRITON_AUTOTUNE"
# A config index every row kernel runs (modulo its space's size), bypassing the tuner: how the
# tests run every config in the interpreter (tests/test_triton_configs.py).
_PINNED: Optional[int] = None
_WARNED_CAPTURE: List[bool] = []


def _untuned() -> bool:
    """Whether launches take the default config untimed: ``GATLIB_TRITON_AUTOTUNE=0``, or under
    ``torch.use_deterministic_algorithms`` (one config per layer, on every GPU)."""
    return os.environ.get(_AUTOTUNE_ENV, "1") == "0" or torch.are_deterministic_algorithms_enabled()


def _prune(name: str, configs, nargs, **consts) -> List[triton.Config]:
    """triton.autotune's ``early_config_prune`` at a key's first launch: the call's space, or the
    default alone under CUDA graph capture, where nothing can be timed."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        if not _WARNED_CAPTURE:
            _WARNED_CAPTURE.append(True)
            warnings.warn("gatlib: a Triton kernel's first call is under CUDA graph capture, "
                          "where it cannot be timed: it keeps its default config in this "
                          "process (run one call before capturing to tune it)", stacklevel=2)
        return [_default(name, consts)]
    return _space(name, consts)


# The tuning key: what a layer fixes (Triton adds the dtype of each tensor argument that is not in
# a tuple, the values' or their gradient's, which also fixes ACC; the key must be JSON for Triton's
# disk cache), never a graph's size, so new graphs and mini-batches reuse a choice.
_KEYS = {
    "_fwd_kernel": ["H", "CK", "CV", "KIND", "SHARE_V", "SHARE_VE", "ONE_K", "ONE_V"],
    "_bwd_dst_kernel": ["H", "CK", "CV", "KIND", "SHARE_V", "SHARE_VE", "ONE_K", "ONE_V"],
    "_bwd_src_kernel": ["H", "CK", "CV", "KIND", "SUM_SRC", "ONE_K", "ONE_V"],
}
# Every tuned launch goes through these; Triton keeps each key's timings on disk (per GPU
# architecture and Triton version), so later processes time nothing.
_TUNED = {name: triton.autotune(_CONFIGS, key=_KEYS[name], cache_results=True, prune_configs_by=dict(
    early_config_prune=functools.partial(_prune, name)))(getattr(K, name)) for name in _ROW_KERNELS}


def _launch(name: str, items: Tensor, *args, group: Optional[int] = None, **consts) -> None:
    """Launch row kernel ``name`` over the work items ``items``, ``BLOCK_R`` per program (or a
    program per ``group`` items), at the tuner's config for the call's key; untuned (:func:`_untuned`)
    at the default, pinned at :data:`_PINNED`'s, in the interpreter at its own."""
    def grid(meta):
        return (triton.cdiv(items.size(0), group or meta["BLOCK_R"]),)

    cfg = None
    if _PINNED is not None:
        space = _space(name, consts)
        cfg = space[_PINNED % len(space)]
    elif _interpreted():
        cfg = _interpreter_config(group)
    elif _untuned():
        cfg = _default(name, consts)
    if cfg is None:
        _TUNED[name][grid](items, *args, **consts)
    else:
        _TUNED[name].fn[grid](items, *args, **consts, **cfg.all_kwargs())


def _merge(splits: Tensor, part: Tensor, out: Tensor, part_lse: Optional[Tensor] = None,
           lse: Optional[Tensor] = None) -> None:
    """Combine the pieces of split rows into their rows of ``out`` (``[N, HR, C]`` or ``[N, HR]``),
    one program per split row: by log-sum-exp with ``part_lse`` (into ``lse`` too), else sums."""
    if not splits.size(0):
        return
    HR, C = out.size(1), out.size(2) if out.dim() == 3 else 1
    tile = triton.next_power_of_2(HR) * triton.next_power_of_2(C)
    K._merge_kernel[(splits.size(0),)](splits, part, part_lse, out, lse, HR=HR, C=C,
                                       ACC=_tl_acc(part.dtype), num_warps=_warps(tile))


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32
