r"""The Triton kernels' work: degree-aware schedules of work items over a plan's
CSR/CSC, and the launches over them (:mod:`gatlib._triton` has the design).

Rows are cut into work items of at most :data:`_SPLIT` edges, sorted longest
first and bucketed by length (:data:`_BUCKETS`); a :class:`_Schedule` is device
tensors sized by the graph's node and edge counts alone, built once per graph
and kept on its plan (:func:`_plan`). :func:`_launch` runs a kernel over all the
buckets in one launch of a fixed number of programs; :func:`_merge` combines the
pieces of split rows. The constants here are the kernels' tiling: the compiled
kernels' register budget, or the interpreter's few wide programs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._layout import Layout, index_dtype
from ._plan import GraphPlan
from ._triton_kernels import _bwd_dst_kernel, _bwd_src_kernel, _fwd_kernel, _merge_kernel

# The kernels' tiling. Each constant's measurement (or its absence) is in docs/design.md;
# none came from an autotuner, and those marked there as not timed on a GPU are guesses.

# Longest run of edges one work item handles; longer rows are split and merged
# (docs/design.md, "Degree buckets and split rows").
_SPLIT = 256
# Elements of the [BLOCK_R, BLOCK_E, BLOCK_C] tile a program holds per step, and the most
# lanes per program, below _WIDE channels: it compiles without spills, where 4096 spilled
# (docs/design.md, "Edge tiles and resident programs"). The CPU interpreter
# pays per program and per op, not per element: it gets few wide programs instead.
_TILE, _MAX_ROWS = 1024, 16
# Rows of _WIDE channels or more (8-warp programs, _warps): a larger tile puts more
# gathers in flight; 2048 is the largest that fits the register cap without spilling
# (same entry).
_TILE_WIDE, _WIDE = 2048, 128
# ... but the forward's schedule (the forward and the dst backward, _fwd_schedule) at rows
# of _WIDE_FWD channels or more: 1024 with registers for 4 programs per SM (_RESIDENT_FWD),
# more independent work items in flight per SM (same entry).
_TILE_WIDE_FWD, _WIDE_FWD = 1024, 256
# ... and below _WIDE_FWD channels the tile is lanes before edges: at most _EDGES_WIDE edges
# per step from _WIDE channels, _EDGES_NARROW below, so that a program runs several items'
# chains of dependent loads at once (docs/design.md, "Lanes before edges").
_EDGES_WIDE = _EDGES_NARROW = 4
# ... but GAT from given node terms below _WIDE: None, the tile's edges (_edges_first;
# docs/design.md, "Compiled GAT takes the node terms").
_EDGES_NODE_TERMS: Optional[int] = None
# The src backward's lanes (and the dst backward's of GAT from projected rows, whose
# parameters' partials share its rows) below _WIDE_FWD: at most _EDGES_SRC edges per step
# from _EDGES_SRC_FROM channels; narrower rows already hold many lanes ("Lanes before edges").
_EDGES_SRC, _EDGES_SRC_FROM = 4, 8
_TILE_INTERPRETER, _MAX_ROWS_INTERPRETER = 1 << 16, 1024
# Software-pipelining stages of the row kernels' edge loops (tl.range's num_stages): with
# 2 the next step's indices and gathers are issued as cp.async copies while a step computes;
# calls with edge features keep 1 (_stages) (docs/design.md, "Pipelined edge loops").
_STAGES = 2
# Programs per launch of a row kernel (they loop over their blocks of lanes, _programs): as
# many per SM as its compiled binary fits (_fit), at most _MAX_PROGRAMS_PER_SM, so that the
# grid is one wave; a sweep may fix _PROGRAMS_PER_SM (docs/design.md, "A grid of one wave").
# The merge kernel keeps _PROGRAMS_MERGE per SM; the CPU interpreter runs programs one after
# another, so a few wide ones.
_PROGRAMS_PER_SM: Optional[int] = None
_MAX_PROGRAMS_PER_SM, _PROGRAMS_MERGE, _PROGRAMS_INTERPRETER = 4, 4, 2
# The forward's and the dst backward's lanes at values of one head that every head shares
# (ONE_V: a layer aggregating its inputs): a lane per item with all its heads (_lane_heads),
# so that a source row is gathered once for all heads, not once per head (docs/design.md,
# "Every head of an item in one lane").
_HEADS_IN_LANE = True
# A row kernel's blocks load their successor's edge ranges before their own edge loop
# (the kernels' AHEAD), so that a block's chain of loads starts at its indices; from
# _AHEAD_FROM channels under a register cap below 255 (_items_ahead; docs/design.md,
# "Items a block ahead").
_ITEMS_AHEAD, _AHEAD_FROM = True, 128
# (item length above which, edge-tile width) — longest bucket first
# (docs/design.md, "Degree buckets and split rows").
_BUCKETS = ((16, 64), (4, 16), (-1, 4))

# ---------------------------------------------------------------------------
# Scheduling: work items over the segments of a CSR-like ``ptr``.
# ---------------------------------------------------------------------------
@dataclass
class _Schedule:
    """Work items over the segments of a CSR ``ptr``, in launch order, as device
    tensors whose sizes follow from the graph's sizes alone (no value of the graph
    is read on the host: a captured or compiled call replays on a new graph).

    Item ``w`` covers positions ``start[w] : start[w] + length[w]`` of segment
    ``row[w]``; ``slot[w]`` is ``-1`` when that is the whole segment (the item
    writes the final result) or its partial-result slot when the segment was
    split. Items are sorted longest first; the arrays have room for
    :attr:`max_items`, and the ones past the real items have length ``-1``.
    ``bounds`` holds ``0``, the end of each bucket's items (:data:`_BUCKETS`) and
    the number of split segments; split segment ``s`` is ``split_row[s]``, with
    partial-result slots ``split_first[s] : split_first[s] + split_count[s]``.
    """

    row: Tensor  # [max_items]
    start: Tensor  # [max_items]
    length: Tensor  # [max_items]
    slot: Tensor  # [max_items]
    bounds: Tensor  # [len(_BUCKETS) + 2] int64
    split_row: Tensor  # [max_split]
    split_first: Tensor  # [max_split]
    split_count: Tensor  # [max_split]
    max_pieces: int  # partial-result slots a call allocates

    @property
    def max_split(self) -> int:
        return self.split_row.numel()


def _schedule_sizes(num_segments: int, num_edges: int, split: int) -> Tuple[int, int, int]:
    """``(items, split segments, pieces of split segments)`` at most, from the sizes
    alone: a segment of ``d`` edges is ``max(1, ceil(d / split))`` items, at most
    ``1 + d // split``; a split one has ``d > split`` edges and fewer than
    ``2 d / split`` pieces."""
    return (num_segments + num_edges // split, min(num_segments, num_edges // (split + 1)),
            2 * num_edges // split)


def _build_schedules(ptrs: List[Tensor], num_edges: int, split: int) -> List[_Schedule]:
    """The :class:`_Schedule` of each CSR ``ptr`` of ``ptrs`` over ``num_edges`` edges (a
    graph's CSR and CSC: each ends at ``num_edges``), its segments cut into pieces of at
    most ``split``.

    Each op is a kernel launch on a GPU, and a new graph (a mini-batch, a layer given a
    ``[2, E]`` tensor) builds its schedules in the call; so they are built side by side,
    one op for all, and the per-item fields are formed, sorted and converted together.
    Each ptr goes on with segments of -1 edges to ``n + 1`` segments (``n`` the most of
    any): the room past its real items, whose length and slot come out -1 with no mask."""
    K = len(ptrs)
    sizes = [q.numel() - 1 for q in ptrs]
    n = max(sizes)
    dev = ptrs[0].device
    M = _schedule_sizes(n, num_edges, split)[0]  # room for every schedule's items
    p = torch.empty(K, n + 2, dtype=torch.long, device=dev)  # each ptr, then its room's
    p[:, -1] = num_edges - 1  # (column n + 1: an index that is a size would fix that size when compiled)
    for k, (q, nk) in enumerate(zip(ptrs, sizes, strict=True)):
        p[k, :nk + 1] = q
        if nk < n:
            p[k, nk + 1:n + 1] = num_edges
    deg = p.diff(dim=1)  # [K, n + 1]: the room's segments -1 (the last one always)
    for k, nk in enumerate(sizes):
        if nk < n:
            deg[k, nk:n] = -1
    pieces = (deg + (split - 1)).div_(split, rounding_mode="floor").clamp_(min=1)  # an empty row: one empty item
    ends = pieces.cumsum(1)
    splits = pieces > 1  # (never the room)
    spieces = pieces * splits
    slot0 = spieces.cumsum(1).sub_(spieces)  # a split row's first slot: slots in row order
    w = torch.arange(M, device=dev).repeat(K, 1)
    row = torch.searchsorted(ends, w, right=True).clamp_(max=n)  # past the last segment: the room's
    j = w.sub_((ends - pieces).gather(1, row))  # the item's piece of its row
    start = p.gather(1, row).add_(j, alpha=split)  # (in the room: any value will do)
    length = deg.gather(1, row).sub_(j, alpha=split).clamp_(-1, split)
    slot = (slot0.gather(1, row) + j).masked_fill_(spieces.gather(1, row) == 0, -1)
    # Longest first: hub pieces start before the short rows fill the gaps.
    order = torch.argsort(length, dim=1, descending=True, stable=True)
    items = torch.stack([row, start, length, slot], 1).gather(2, order.unsqueeze(1).expand(K, 4, M))
    # a bucket ends after the items longer than its bound
    length = items[:, 2]
    counts = [(length > lo).sum(1) for lo, _ in _BUCKETS]
    bounds = _rows_aligned(torch.stack([torch.zeros_like(counts[0]), *counts, splits.sum(1)], 1),
                           torch.int64)
    # the split rows first, in row order (a stable sort: no value-sized output)
    split_row = torch.argsort(pieces[:, :n].clamp(max=2), dim=1, descending=True, stable=True)
    first_count = torch.stack([slot0[:, :n], pieces[:, :n]], 1).gather(
        2, split_row.unsqueeze(1).expand(K, 2, n))
    idt = index_dtype(num_edges, n + 1, M, _schedule_sizes(n, num_edges, split)[2])
    items = _rows_aligned(items.reshape(K * 4, M), idt)
    split_row = _rows_aligned(split_row, idt)
    first_count = _rows_aligned(first_count.reshape(K * 2, n), idt)
    out = []
    for k, nk in enumerate(sizes):
        m, ms, pieces_k = _schedule_sizes(nk, num_edges, split)
        out.append(_Schedule(*(t[:m] for t in items[4 * k:4 * k + 4]), bounds[k], split_row[k][:ms],
                             first_count[2 * k][:ms], first_count[2 * k + 1][:ms], pieces_k))
    return out


def _rows_aligned(rows: Tensor, dtype: torch.dtype) -> List[Tensor]:
    """The rows of ``rows`` ``[R, M]`` in ``dtype``, each starting on 16 bytes as a tensor
    of its own would: Triton specialises a kernel on its pointers' 16-byte alignment,
    and rows that started wherever ``M`` put them would compile kernels anew for graphs
    of other sizes. Each row has room past its end, even where ``M`` is a multiple of
    the step: with some rows padded and others not, ``torch.compile`` guards on which
    (a recompile whenever a new graph's ``M`` changes side)."""
    step = 16 // dtype.itemsize
    M = rows.size(1)
    out = rows.new_empty(rows.size(0), (M // step + 1) * step, dtype=dtype)
    out[:, :M] = rows
    return list(out[:, :M])


@dataclass
class _Plan:
    """Everything the kernels need about one graph, cached on its ``edge_index``."""

    layout: Layout
    csr_eid: Tensor  # [E] original edge id of each CSR position
    csc_eid: Tensor  # [E] original edge id of each CSC position
    dst_items: _Schedule  # over destinations (CSR)
    src_items: _Schedule  # over sources (CSC)
    # whether each schedule (destinations, sources) has split rows; None until an
    # eager call reads it (_split_rows)
    splits: Optional[Tuple[bool, bool]] = None


def _plan(plan: GraphPlan) -> _Plan:
    """The kernels' view of ``plan`` (built once, kept on the plan)."""
    def build():
        lay = plan.layout()
        idt = lay.src.dtype
        E = lay.num_edges
        return _Plan(lay, lay.perm.to(idt), lay.perm[lay.csc_edge.long()].to(idt),
                     *_build_schedules([lay.ptr, lay.csc_ptr], E, _SPLIT))

    return plan.derived(("triton.plan", _SPLIT), build)


def _interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_fwd_kernel, InterpretedFunction)


def _fwd_schedule(kernel, kind: Optional[int] = None) -> bool:
    """Whether ``kernel`` takes the forward's schedule at wide rows (:data:`_TILE_WIDE_FWD`,
    :data:`_RESIDENT_FWD`): the forward and the dst backward; the src backward not, nor
    the dst backward of GAT from projected rows (``kind`` 3), whose parameters' per-lane
    partials share one buffer and one sum with the src backward's: with other lanes per
    program its rows would need zeroing, one more launch per call."""
    return kernel is _fwd_kernel or (kernel is _bwd_dst_kernel and kind != 3)


def _tile(width: int = 0, forward: bool = False) -> Tuple[int, int]:
    """(tile elements, max rows per program): the compiled kernels' register
    budget (for the row kernels, whose rows are ``width`` channels wide: see
    :data:`_TILE_WIDE`, :data:`_TILE_WIDE_FWD` for a kernel of the ``forward``'s
    schedule, :func:`_fwd_schedule`), or the interpreter's few wide programs."""
    if _interpreted():
        return _TILE_INTERPRETER, _MAX_ROWS_INTERPRETER
    if width < _WIDE:
        return _TILE, _MAX_ROWS
    return (_TILE_WIDE_FWD if forward and width >= _WIDE_FWD else _TILE_WIDE), _MAX_ROWS


def _rows_per_program(block_e: int, width: int, forward: bool = False) -> int:
    tile, max_rows = _tile(width, forward)
    r = max(1, min(max_rows, tile // (block_e * width)))
    return 1 << (r.bit_length() - 1)  # a power of two, as tl.arange needs


# Programs of a row kernel that its register cap lets share an SM at the least
# (_max_registers; a launch runs as many as its binary fits, _per_sm): two; the dst
# backward, which holds the scorer's tiles and the gradients' at once, one (uncapped: it
# spilled under a cap); the forward's schedule at rows of _WIDE_FWD channels, four
# (docs/design.md, "Edge tiles and resident programs").
_RESIDENT, _RESIDENT_HEAVY, _RESIDENT_FWD = 2, 1, 4


def _max_registers(warps: int, kernel=None, width: int = 0, heavy: bool = False,
                   kind: Optional[int] = None, heads: bool = False) -> int:
    """Registers per thread a row kernel may use (ptxas ``.maxnreg``): as many as let
    :data:`_RESIDENT` programs of ``warps`` warps share an SM's 64K-register file
    (sm_80 and sm_90), :data:`_RESIDENT_HEAVY` for the dst backward,
    :data:`_RESIDENT_FWD` for the forward and the dst backward at rows of
    :data:`_WIDE_FWD` channels or more (:func:`_fwd_schedule`) — but for ``heavy``
    calls (:func:`_heavy`), which spilled under that cap: they keep their kernel's
    count; at most 255. The dst backward with every head of an item in one lane
    (``heads``, ``_bwd_dst_heads_items``), but for heavy calls: :data:`_RESIDENT`
    (uncapped it fits one 8-warp program per SM at 128 channels).

    Without an explicit cap ptxas picks a register count itself and at some shapes
    spills to stay at a count it prefers; with one it takes what the kernel needs up
    to the cap, and none of the shapes users run spills (docs/design.md, "No spills at
    the users' shapes"). tests/test_triton_compile.py holds both."""
    resident = _RESIDENT_HEAVY if kernel is _bwd_dst_kernel else _RESIDENT
    if _fwd_schedule(kernel, kind) and width >= _WIDE_FWD and not heavy:
        resident = _RESIDENT_FWD
    if heads and kernel is _bwd_dst_kernel and not heavy:
        resident = _RESIDENT
    return min(255, (1 << 16) // (resident * 32 * warps))


def _warps(width: int, acc) -> int:
    """Warps per program: 8 for tiles of wide rows (>= 128 channels) or float64,
    whose temporaries spill at 4 warps; else 4 (docs/design.md, "No spills at the
    users' shapes")."""
    return 8 if width >= 128 or acc == tl.float64 else 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _programs(device: torch.device, H: int, per_sm: int) -> int:
    """Programs per launch: the kernels loop over their blocks of lanes (a block
    ``b`` is run by program ``b mod programs``), so the grid is fixed by the device
    and the binary, and no launch depends on the graph's degrees. ``per_sm`` per SM,
    rounded down to a multiple of ``H`` (at least ``H``), so that each lane of a
    program keeps one head (GATv2's ``att`` partials) and no program is left over
    for a second wave."""
    if device.type == "cuda":
        n = _sm_count(_device_index(device)) * per_sm
    else:  # the interpreter runs programs one after another
        n = _PROGRAMS_INTERPRETER
    return H * max(1, n // H)


def _slots(device: torch.device, H: int) -> int:
    """Programs whose per-lane partials a backward launch's buffers hold (the most a
    row kernel's launch runs: :func:`_programs` at :data:`_MAX_PROGRAMS_PER_SM`, or at
    the fixed :data:`_PROGRAMS_PER_SM`); a launch of fewer programs zeroes the rows of
    the others (``_store_partials``), so the buffers' size does not depend on what a
    binary fits."""
    return _programs(device, H, max(_MAX_PROGRAMS_PER_SM, _PROGRAMS_PER_SM or 0))


def _fit(n_regs: int, warps: int, shared: int, max_regs: int, max_shared: int,
         max_threads: int) -> int:
    """Programs of a compiled kernel that an SM holds at once: registers (allocated
    per warp in units of 256 on sm_80 and sm_90), shared memory (1 KB of it reserved
    per program) and threads, at most :data:`_MAX_PROGRAMS_PER_SM`; at least one."""
    per_warp = -(-n_regs * 32 // 256) * 256
    fit = min(max_regs // max(1, per_warp * warps), max_threads // (32 * warps),
              max_shared // (shared + 1024) if shared else _MAX_PROGRAMS_PER_SM)
    return max(1, min(fit, _MAX_PROGRAMS_PER_SM))


# (kernel, device, launch options and constexprs, each argument's dtype and 16-byte
# alignment — what Triton specialises a binary on) -> programs per SM. Compiling the
# binary to read its registers costs a launch's host time: read once per binary.
_FITS: Dict[tuple, int] = {}


def _specialised(arg):
    """What Triton specialises a binary on in a positional ``arg``: a tensor's dtype and
    16-byte alignment; not the kernels' integers and floats (``_PER_CALL``)."""
    if isinstance(arg, Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return type(arg)
    return repr(arg)


def _per_sm(kernel, device: torch.device, args, options: dict) -> int:
    """Programs per SM of a CUDA launch of ``kernel`` with ``args`` and ``options``:
    :data:`_PROGRAMS_PER_SM` where a sweep fixes it, else what its compiled binary
    fits on an SM (:func:`_fit`; compiled here, before the launch, as Triton's
    fused-softmax tutorial does)."""
    if _PROGRAMS_PER_SM is not None:
        return _PROGRAMS_PER_SM
    index = _device_index(device)
    key = (kernel, index,
           tuple(sorted((k, _specialised(v) if isinstance(v, Tensor) else repr(v))
                        for k, v in options.items())),
           tuple(_specialised(a) for a in args))
    fit = _FITS.get(key)
    if fit is None:
        from triton.runtime import driver

        binary = kernel.warmup(*args, grid=(1,), **options)
        if binary is None:  # a jit_cache_hook skipped the compile: nor will it launch
            return _MAX_PROGRAMS_PER_SM
        if hasattr(binary, "result"):  # (compiled under Triton's async compile mode)
            binary = binary.result()
        binary._init_handles()  # (loads it: registers are known from here)
        props = driver.active.utils.get_device_properties(index)
        fit = _fit(binary.n_regs, binary.metadata.num_warps, binary.metadata.shared,
                   props["max_num_regs"], props["max_shared_mem"],
                   torch.cuda.get_device_properties(index).max_threads_per_multi_processor)
        _FITS[key] = fit
    return fit


def _edges_first(width: int, forward: bool, kind: Optional[int]) -> Optional[int]:
    """The most edges per step of a kernel below :data:`_WIDE_FWD` channels (the rest
    of the tile is lanes), or ``None``: as many as the tile holds. Of the ``forward``'s
    schedule :data:`_EDGES_WIDE` from :data:`_WIDE` channels, :data:`_EDGES_NARROW`
    below; of the src backward's :data:`_EDGES_SRC` from :data:`_EDGES_SRC_FROM`.

    GAT from given node terms (``kind`` 0) keeps the tile's edges below :data:`_WIDE`
    in every kernel: with 4 lanes there its compiled training step disagreed with
    eager PyG's, where the other kinds' agreed (docs/design.md, "Compiled GAT takes the
    node terms"). ``introspect.triton_tiles(edges_node_terms=4)`` sets them back, for a
    GPU run to tell whether that schedule is what disagreed. The interpreter: few wide
    programs."""
    if width >= _WIDE_FWD or _interpreted():
        return None
    if kind == 0 and width < _WIDE:
        return _EDGES_NODE_TERMS
    if not forward:
        return _EDGES_SRC if width >= _EDGES_SRC_FROM else None
    return _EDGES_WIDE if width >= _WIDE else _EDGES_NARROW


def _bucket_groups(width: int, forward: bool = False,
                   kind: Optional[int] = None) -> List[Tuple[int, int, int]]:
    """``(first bucket, end bucket, BLOCK_E)`` of each group of buckets: consecutive
    buckets whose edge tiles are clamped to one width at wide channels compile to
    the same code, and are one group (of the ``forward`` kernel's tile, or the
    backward kernels'; of score ``kind``, :func:`_edges_first`)."""
    tile = _tile(width, forward)[0]
    cap = 1 << (max(1, tile // width).bit_length() - 1)
    edges = _edges_first(width, forward, kind)
    if edges is not None:
        cap = min(cap, edges)
    out: List[Tuple[int, int, int]] = []
    for b, (_, block_e) in enumerate(_BUCKETS):
        block_e = min(block_e, cap)
        if out and out[-1][2] == block_e:
            out[-1] = (out[-1][0], b + 1, block_e)
        else:
            out.append((b, b + 1, block_e))
    return out


def _group_consts(width: int, forward: bool = False, kind: Optional[int] = None) -> dict:
    """The row kernels' constexprs for :func:`_bucket_groups`: bounds ``B1, B2, B3``
    (groups ``[0, B1)``, ``[B1, B2)``, ``[B2, B3)`` of buckets, empty where equal)
    and each group's lanes per program ``R*`` and edge tile ``E*`` (1 where empty)."""
    groups = _bucket_groups(width, forward, kind)
    assert 1 <= len(groups) <= 3 == len(_BUCKETS)
    ends = [hi for _, hi, _ in groups] + [len(_BUCKETS)] * (3 - len(groups))
    tiles = [(_rows_per_program(e, width, forward), e) for _, _, e in groups]
    tiles += [(1, 1)] * (3 - len(groups))
    return {"B1": ends[0], "B2": ends[1], "B3": ends[2],
            **{f"R{g}": r for g, (r, _) in enumerate(tiles)},
            **{f"E{g}": e for g, (_, e) in enumerate(tiles)}}


def _lane_heads(kind: int, H: int, one_k: bool, one_v: bool, share_v: bool,
                has_edge: bool, width: int = 0, dst_backward: bool = False) -> int:
    """``HP`` of the forward (``_fwd_heads_items``) or the dst backward
    (``_bwd_dst_heads_items``): the heads padded to a power of two where a lane takes
    every head of its item (:data:`_HEADS_IN_LANE`), else 0 (a lane per item and head).
    Its calls: more than one head; a value of one head that all heads share
    (``one_v``); no per-edge feature (``has_edge``); GAT from node terms (``kind`` 0),
    or the dot product whose key is that value (``one_k``, ``share_v``) — but the dot
    kind's dst backward at rows of :data:`_WIDE_FWD` channels or more (``width``): its
    ``[R, HP, C]`` query gradient spilled under that schedule's 4-program cap, and at
    the one program per SM it fits uncapped the latency count puts it behind 4 programs
    of a lane per head (docs/design.md, "Every head of an item in one lane")."""
    if not _HEADS_IN_LANE or H == 1 or not one_v or has_edge:
        return 0
    if kind == 2 and dst_backward and width >= _WIDE_FWD:
        return 0
    if kind == 0 or (kind == 2 and one_k and share_v):
        return triton.next_power_of_2(H)
    return 0


def _items_ahead(width: int, max_registers: int, kernel=None, kind: Optional[int] = None) -> bool:
    """``AHEAD`` of a row ``kernel`` of score ``kind`` at rows of ``width`` channels under
    a register cap of ``max_registers`` (:data:`_ITEMS_AHEAD`) — but GATv2's src
    backward at :data:`_WIDE_FWD` channels, which spilled so under its cap of 128."""
    if kernel is _bwd_src_kernel and kind == 1 and width >= _WIDE_FWD:
        return False
    return _ITEMS_AHEAD and width >= _AHEAD_FROM and max_registers < 255


def _stages(consts: dict) -> int:
    """Pipelining stages of a row kernel's edge loops: :data:`_STAGES`, but 1 for
    calls with edge features (``HAS_EDGE``, ``HAS_VEDGE``), whose extra per-edge
    stream's copies in flight spilled under the register cap at 2 stages."""
    return 1 if _has_edge(consts) else _STAGES


def _slot_sums(width: int) -> bool:
    """Whether the backward kernels keep their gradients' sums per edge slot of the
    tile (``SLOTS``: the src kernel's, the dst kernel's dot query gradient), summed
    once after the edge loop rather than across the tile's warps at every step: at
    rows of :data:`_WIDE_FWD` channels or more, where they were timed faster; at 128
    GATv2's src backward spilled so (docs/design.md, "Per-slot sums in the backward")."""
    return width >= _WIDE_FWD


def _has_edge(consts: dict) -> bool:
    """Whether a row kernel's call reads a per-edge feature stream."""
    return bool(consts.get("HAS_EDGE") or consts.get("HAS_VEDGE"))


def _heavy(consts: dict, kernel=None) -> bool:
    """The calls of ``kernel`` that spilled under the forward's schedule's 64 registers
    at C = 256 (ptxas): with attention dropout, the forward and the dst backward, whose
    random stream's state and keep masks are live besides the tiles; and the dst
    backward's with a per-edge feature stream and with GAT's given node terms (KIND 0)
    — but where a lane takes every head of its item (``HP``), only GAT's forward is."""
    if consts.get("DROPOUT"):
        return True
    if consts.get("HP"):  # every head of an item in one lane: GAT's forward (its heads'
        # [R, E, HP] terms besides the rows spilled under the forward's 64 at 256)
        return kernel is _fwd_kernel and consts.get("KIND") == 0
    return kernel is _bwd_dst_kernel and (_has_edge(consts) or consts.get("KIND") == 0)


def _launch(kernel, items: _Schedule, H: int, width: int, *args, **consts) -> None:
    """Launch ``kernel`` over the length buckets of ``items`` (longest first): one
    launch of :func:`_programs` programs (as many per SM as its binary fits there,
    :func:`_per_sm`), which run the groups of buckets of :func:`_bucket_groups` one
    after another, each with its own edge tile (the kernel reads where its items
    start and end from ``bounds`` on the device).

    Its register cap (:func:`_max_registers`) also decides ``AHEAD``
    (:func:`_items_ahead`). The kernel's leading arguments are the item arrays and
    ``bounds``. The backward kernels' parameter gradients (``part_att``, ``part_bias``)
    take one partial per lane of each of ``P_SLOTS`` programs, the groups' one after
    another (:func:`_att_partials`, :func:`_slots`).
    """
    warps = _warps(width, consts["ACC"])
    kind = consts.get("KIND")
    maxnreg = _max_registers(warps, kernel, width, _heavy(consts, kernel), kind,
                             bool(consts.get("HP")))
    options = dict(num_warps=warps, maxnreg=maxnreg, STAGES=_stages(consts),
                   AHEAD=_items_ahead(width, maxnreg, kernel, kind),
                   **_group_consts(width, _fwd_schedule(kernel, kind), kind), **consts)
    args = (items.row, items.start, items.length, items.slot, items.bounds, *args)
    device = items.bounds.device
    per_sm = _per_sm(kernel, device, args, options) if device.type == "cuda" else 0
    kernel[(_programs(device, H, per_sm),)](*args, **options)


def _att_partials(width: int, H: int, device: torch.device, kernel,
                  kind: Optional[int] = None) -> int:
    """Rows of the ``part_att`` buffer that :func:`_launch` of the backward ``kernel``
    fills for a call of score ``kind``: one per lane of each of :func:`_slots`
    programs, over its groups of buckets."""
    forward = _fwd_schedule(kernel, kind)
    return sum(_slots(device, H) * _rows_per_program(block_e, width, forward)
               for _, _, block_e in _bucket_groups(width, forward, kind))


def _merge(out: Tensor, part: Tensor, items: _Schedule, H: int, lse: Optional[Tensor] = None,
           part_lse: Optional[Tensor] = None, bias: Optional[Tensor] = None,
           out_b: Optional[Tensor] = None) -> None:
    """Combine the pieces of split rows into their rows, one launch: plain sums
    (``out[row] = sum_p part_p``), or with ``lse`` the pieces' softmax results
    (``lse = log sum_p exp(lse_p)``, ``out = sum_p exp(lse_p - lse) out_p``, and
    ``out_b = out + bias`` where a ``bias`` ``[H * C]`` is given)."""
    if not items.max_split:  # no row can be split on a graph this small
        return
    C = out.size(2) if out.dim() == 3 else 1
    block_c = triton.next_power_of_2(C)
    lanes = max(1, min(_tile()[1], _tile()[0] // block_c))
    lanes = 1 << (lanes.bit_length() - 1)
    softmax = lse is not None
    _merge_kernel[(_programs(out.device, H, _PROGRAMS_MERGE),)](
        items.bounds, items.split_row, items.split_first, items.split_count, part,
        part_lse if softmax else part, out, lse if softmax else out,
        bias if bias is not None else out, out_b if out_b is not None else out, H, C,
        SOFTMAX=softmax, HAS_BIAS=bias is not None,
        ACC=_tl_acc(part.dtype), BLOCK_R=lanes, BLOCK_C=block_c)


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32
