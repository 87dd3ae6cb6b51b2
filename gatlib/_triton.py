r"""Fused sparse attention in Triton: score, softmax and aggregate in one pass.

The three stages of :mod:`gatlib._core` run inside one kernel per direction,
so no ``[E, H, C]`` tensor is ever built or saved (the reference gathers
``value[src]`` into one):

* **forward** (destination-major, CSR): a program owns ``BLOCK_R`` lanes, each
  a (work item, head) pair — a work item is a destination row or a piece of a
  hub's row — walks their in-edges ``BLOCK_E`` at a time, scores each edge
  inside the kernel and keeps FlashAttention's online softmax: running max
  ``m``, running sum ``l`` and an accumulator rescaled by ``exp(m_old - m_new)``
  whenever the max grows. It saves ``out`` and a ``[N, H]`` log-sum-exp,
  nothing per edge.
* **backward**: a destination-major kernel recomputes the scores from the
  log-sum-exp and produces the score gradients (``[E, H]``, CSR order), the
  destination-side gradients (query / ``x_dst`` / ``a_dst``) and the per-edge
  gradients of per-edge *inputs*; a source-major kernel walks the CSC view
  and sums, per source node, the value and key/source-term gradients by
  gathering those ``[E, H]`` buffers — every output row is written by exactly
  one program, so there are no atomics.

**Degree-aware scheduling.** Rows of real graphs range from degree 0 to tens
of thousands. Work items are rows cut into pieces of at most ``_SPLIT`` edges
(a hub becomes several items whose partial results — ``(out, lse)`` in the
forward, plain sums in the backward — are merged afterwards by
``_merge_kernel``, as in flash-decoding's split-K), sorted longest first (so
the longest items start first and no hub is left running alone at the end),
and bucketed by length: each bucket runs with its own edge-tile width (4, 16
or 64, narrower for wide channels; buckets whose widths coincide run as one
launch) and packs as many lanes per program as fit the register budget, so a
block of similar-degree rows wastes few lanes and a program's loop runs as
long as its longest item. The schedule is device tensors sized by the graph's
node and edge counts alone, computed once per graph and kept on its
:class:`~gatlib.GraphPlan` (:meth:`~gatlib.GraphPlan.derived`); each launch
has a fixed number of programs (:func:`_programs`) that loop over their
blocks of lanes and read their bucket's bounds on the device, so no launch
depends on a value read back to the host.

Accumulation is fp32 for fp16/bf16/fp32 inputs and fp64 for fp64 inputs;
channels are padded to a power of two and masked. Attention dropout draws
Philox numbers keyed by ``(seed, CSR edge position * H + head)``, so the
backward regenerates the forward's mask from the saved seed.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from . import _record
from ._core import EdgeScore, acc_dtype, distinct_inputs, promoted_dtype, reference_grads
from ._plan import GraphPlan, Layout, index_dtype

# Longest run of edges one work item handles; longer rows are split.
_SPLIT = 256
# Elements of the [BLOCK_R, BLOCK_E, BLOCK_C] tile a program holds per step and
# the most lanes per program. 1024 (8 per thread at 4 warps) keeps the kernels
# at ~70-150 registers on sm_90 without spills — several [R, E, C] temporaries
# and 64-bit pointer tiles are live at once; 4096 spilled (ptxas, C=8). The
# CPU interpreter pays per program and per op, not per element: it gets few
# wide programs instead.
_TILE, _MAX_ROWS = 1024, 16
_TILE_INTERPRETER, _MAX_ROWS_INTERPRETER = 1 << 16, 1024
# Wider channel dimensions fall back to the reference.
_MAX_C = 1024
# Programs per launch (the kernels loop over their blocks of lanes, _programs):
# enough per SM to hide the gathers' latency at the kernels' 4-8 warps; the CPU
# interpreter runs programs one after another, so a few wide ones.
_PROGRAMS_PER_SM, _PROGRAMS_INTERPRETER = 4, 2
# (item length above which, edge-tile width) — longest bucket first.
_BUCKETS = ((16, 64), (4, 16), (-1, 4))
_KINDS = {"gat": 0, "gatv2": 1, "dot": 2}  # EdgeScore.kind -> the kernels' KIND
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Integer kernel arguments that change from graph to graph (item ranges, sizes).
# Triton specialises integer arguments on their value (== 1, divisible by 16)
# by default, which would compile a new kernel for many a new mini-batch.
_PER_CALL = ("E", "H", "CK", "CV")


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


def _build_schedule(ptr: Tensor, num_edges: int, split: int) -> _Schedule:
    p = ptr.long()
    n = p.numel() - 1
    dev = p.device
    max_items, max_split, max_pieces = _schedule_sizes(n, num_edges, split)
    deg = p[1:] - p[:-1]  # [n]
    pieces = ((deg + split - 1) // split).clamp_(min=1)  # a row without edges is one empty item
    ends = torch.cumsum(pieces, 0)
    w = torch.arange(max_items, device=dev)
    row = torch.searchsorted(ends, w, right=True)  # n past the last real item
    real = row < n
    r = row.clamp(max=max(n - 1, 0))
    j = w - (ends - pieces)[r]  # the item's piece of its row
    start = p[r] + j * split
    length = torch.where(real, torch.clamp(deg[r] - j * split, max=split), -1)
    is_split = real & (pieces[r] > 1)
    # slots are numbered in row order, so a split row's pieces are consecutive slots
    slot = torch.where(is_split, torch.cumsum(is_split, 0) - 1, -1)
    # Longest first: hub pieces start before the short rows fill the gaps.
    order = torch.argsort(length, descending=True, stable=True)
    row, start, length, slot = row[order], start[order], length[order], slot[order]
    ends = torch.stack([(length > lo).sum() for lo, _ in _BUCKETS])
    # the split rows first, in row order (a stable sort: no value-sized output)
    splits = pieces > 1
    split_row = torch.argsort((~splits).to(torch.int8), stable=True)[:max_split]
    spieces = torch.where(splits, pieces, 0)
    idt = index_dtype(num_edges, n + 1, max_items, max_pieces)
    bounds = torch.cat([ends.new_zeros(1), ends, splits.sum().reshape(1)])
    return _Schedule(row.to(idt), start.to(idt), length.to(idt), slot.to(idt), bounds,
                     split_row.to(idt), (torch.cumsum(spieces, 0) - spieces)[split_row].to(idt),
                     pieces[split_row].to(idt), max_pieces)


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
                     _build_schedule(lay.ptr, E, _SPLIT), _build_schedule(lay.csc_ptr, E, _SPLIT))

    return plan.derived(("triton.plan", _SPLIT), build)


def _interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_fwd_kernel, InterpretedFunction)


def _tile() -> Tuple[int, int]:
    """(tile elements, max rows per program): the compiled kernels' register
    budget, or the interpreter's few wide programs."""
    return (_TILE_INTERPRETER, _MAX_ROWS_INTERPRETER) if _interpreted() else (_TILE, _MAX_ROWS)


def _rows_per_program(block_e: int, width: int) -> int:
    tile, max_rows = _tile()
    r = max(1, min(max_rows, tile // (block_e * width)))
    return 1 << (r.bit_length() - 1)  # a power of two, as tl.arange needs


def _max_registers(warps: int, heavy: bool = False) -> int:
    """Registers per thread the row kernels may use (ptxas ``.maxnreg``): as many as
    let two programs of ``warps`` warps share an SM's 64K-register file (sm_80 and
    sm_90), half the :data:`_PROGRAMS_PER_SM` a launch runs; at most 255. ``heavy``
    (the dst backward, which holds the scorer's tiles and the gradients' at once):
    255 whatever the warps, as at 8 warps (C >= 128) with edge features, dropout and
    returned weights it spilled 16-32 bytes on sm_80 under 128.

    Without an explicit cap ptxas picks a register count itself and at some shapes
    spills 8-60 bytes per thread to stay at a count it prefers (e.g. 56 or 168, with
    255 allowed); with one it takes what the kernel needs up to the cap and none of
    the shapes users run spills (ptxas, sm_80 and sm_90; benchmarks/NOTES.md, "No
    spills at the shapes users run"). tests/test_triton_compile.py holds both."""
    return 255 if heavy else min(255, (1 << 16) // (2 * 32 * warps))


def _warps(width: int, acc) -> int:
    """Warps per program: 8 for tiles of wide rows (>= 128 channels) or float64,
    whose temporaries spill at 4 warps (ptxas, sm_90: GATv2's forward with edge
    features spilled 2 KB per thread at C = 128 and 3.8 KB in float64 at C = 64;
    none at 8 warps); else 4. See benchmarks/results/triton_compile.md."""
    return 8 if width >= 128 or acc == tl.float64 else 4


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, H: int) -> int:
    """Programs per launch: the kernels loop over their blocks of lanes (a block
    ``b`` is run by program ``b mod programs``), so the grid is a constant of the
    device and no launch depends on the graph's degrees. A multiple of ``H``, so
    that each lane of a program keeps one head (GATv2's ``att`` partials)."""
    if device.type == "cuda":
        n = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        n *= _PROGRAMS_PER_SM
    else:  # the interpreter runs programs one after another
        n = _PROGRAMS_INTERPRETER
    return H * -(-n // H)


def _bucket_launches(width: int) -> List[Tuple[int, int, int]]:
    """``(first bucket, end bucket, BLOCK_E)`` of each launch: consecutive buckets
    whose edge tiles are clamped to one width at wide channels compile to one
    kernel, and run as one launch."""
    tile = _tile()[0]
    cap = 1 << (max(1, tile // width).bit_length() - 1)
    out: List[Tuple[int, int, int]] = []
    for b, (_, block_e) in enumerate(_BUCKETS):
        block_e = min(block_e, cap)
        if out and out[-1][2] == block_e:
            out[-1] = (out[-1][0], b + 1, block_e)
        else:
            out.append((b, b + 1, block_e))
    return out


def _launch(kernel, items: _Schedule, H: int, width: int, *args, part_att: Optional[Tensor] = None,
            **consts) -> None:
    """Launch ``kernel`` over the length buckets of ``items`` (longest first), one
    launch per distinct edge tile, each of :func:`_programs` programs.

    The kernel's leading arguments are the item arrays, ``bounds`` and the range
    of buckets it covers; it reads where its items start and end from ``bounds``
    on the device. ``part_att`` (GATv2's ``att`` gradient) takes one ``[CK]``
    partial per lane of each program, the launches' one after another.
    """
    programs = _programs(items.bounds.device, H)
    offset = 0
    for lo, hi, block_e in _bucket_launches(width):
        lanes = _rows_per_program(block_e, width)
        extra = {} if part_att is None else {"part_att": part_att[offset:]}
        offset += programs * lanes
        warps = _warps(width, consts["ACC"])
        wrap_triton(kernel)[(programs,)](items.row, items.start, items.length, items.slot, items.bounds,
                            *args, B_LO=lo, B_HI=hi, BLOCK_R=lanes, BLOCK_E=block_e,
                            num_warps=warps, maxnreg=_max_registers(warps, kernel is _bwd_dst_kernel),
                            **extra, **consts)


def _att_partials(width: int, H: int, device: torch.device) -> int:
    """Rows of the ``part_att`` buffer :func:`_launch` fills."""
    return sum(_programs(device, H) * _rows_per_program(block_e, width)
               for _, _, block_e in _bucket_launches(width))


def _merge(out: Tensor, part: Tensor, items: _Schedule, H: int, lse: Optional[Tensor] = None,
           part_lse: Optional[Tensor] = None) -> None:
    """Combine the pieces of split rows into their rows, one launch: plain sums
    (``out[row] = sum_p part_p``), or with ``lse`` the pieces' softmax results
    (``lse = log sum_p exp(lse_p)``, ``out = sum_p exp(lse_p - lse) out_p``)."""
    if not items.max_split:  # no row can be split on a graph this small
        return
    C = out.size(2) if out.dim() == 3 else 1
    block_c = triton.next_power_of_2(C)
    lanes = max(1, min(_tile()[1], _tile()[0] // block_c))
    lanes = 1 << (lanes.bit_length() - 1)
    softmax = lse is not None
    wrap_triton(_merge_kernel)[(_programs(out.device, H),)](
        items.bounds, items.split_row, items.split_first, items.split_count, part,
        part_lse if softmax else part, out, lse if softmax else out, H, C,
        SOFTMAX=softmax, ACC=_tl_acc(part.dtype), BLOCK_R=lanes, BLOCK_C=block_c)


# ---------------------------------------------------------------------------
# Kernels. A program owns BLOCK_R *lanes*, each one (work item, head) pair —
# lane l is item l // H, head l % H — so the heads of a row sit side by side
# and their loads of a source's [H, C] row are contiguous.
# ---------------------------------------------------------------------------
@triton.jit
def _blocks(bounds, B_LO: tl.constexpr, B_HI: tl.constexpr, H, BLOCK_R: tl.constexpr):
    """``(first item, item count, blocks of BLOCK_R lanes)`` of the buckets
    ``B_LO : B_HI``, read from the schedule's ``bounds`` on the device."""
    first = tl.load(bounds + B_LO)
    n_items = tl.load(bounds + B_HI) - first
    return first, n_items, tl.cdiv(n_items * H, BLOCK_R).to(tl.int32)


@triton.jit
def _lanes(item_row, item_start, item_len, item_slot, blk, first, n_items, H, BLOCK_R: tl.constexpr):
    """The lanes of block ``blk`` (lanes past the last item are empty). Index
    arithmetic is int64 from the block on: lane counts reach E·H > 2**31."""
    lane = (tl.zeros([BLOCK_R], tl.int64) + blk) * BLOCK_R + tl.arange(0, BLOCK_R)
    local = lane // H
    valid = local < n_items
    it = first + local
    h = lane % H
    row = tl.load(item_row + it, mask=valid, other=0).to(tl.int64)
    start = tl.load(item_start + it, mask=valid, other=0).to(tl.int64)
    length = tl.load(item_len + it, mask=valid, other=0)
    slot = tl.load(item_slot + it, mask=valid, other=-1).to(tl.int64)
    final = valid & (slot < 0)
    piece = valid & (slot >= 0)
    slot = tl.where(piece, slot, 0)
    return lane, valid, row, h, start, length, final, piece, slot, tl.max(length, 0)


@triton.jit
def _score(s_src, s_dst, s_edge, s_att, h, H, CK, src, dst, eid, m_src, m_dst, m_edge,
           scale, slope, KIND: tl.constexpr, HAS_DST: tl.constexpr, HAS_EDGE: tl.constexpr,
           ACC: tl.constexpr, BLOCK_CK: tl.constexpr, FULL_CK: tl.constexpr):
    """Scores of a 2-D tile of edges ``src -> dst`` (original ids ``eid``), head ``h``.

    ``h``, ``src``, ``dst`` and ``eid`` are int64 tiles that broadcast to the
    edge tile (e.g. ``[R, E]`` and ``[R, 1]``), each with a mask of its shape;
    per-node terms are loaded at their own shape, so a row's query is read
    once per tile, not once per edge.

    Returns ``(score, z, xs, xd, xe)``: the ``[R, E]`` scores; ``z`` the
    pre-activation (GAT ``[R, E]``, GATv2 ``[R, E, CK]``) or ``k_j + e_ij``
    (dot product ``[R, E, CK]``); and the loaded channel tiles of the source,
    destination and edge terms (placeholders where a kind has none), which
    callers reuse instead of loading them again.
    """
    if KIND == 0:  # GAT: z = a_src[j] + a_dst[i] + a_edge[ij], per-node scalars
        z = tl.load(s_src + src * H + h, mask=m_src, other=0).to(ACC)
        if HAS_DST:
            z = z + tl.load(s_dst + dst * H + h, mask=m_dst, other=0).to(ACC)
        if HAS_EDGE:
            z = z + tl.load(s_edge + eid * H + h, mask=m_edge, other=0).to(ACC)
        score = tl.where(z > 0, z, z * slope)  # LeakyReLU
        xs = z
        xd = z
        xe = z
    else:
        ck = tl.arange(0, BLOCK_CK)[None, None, :]
        if FULL_CK:
            # CK is the tile's width: rows start at multiples of the constexpr BLOCK_CK
            # and no channel is masked, so the compiler can prove a row's lanes aligned
            # and contiguous and load them 64/128 bits at a time (CK itself stays an
            # unspecialised integer: a new graph compiles nothing new)
            xs = tl.load(s_src + (src * H + h)[:, :, None] * BLOCK_CK + ck, mask=m_src[:, :, None],
                         other=0).to(ACC)
            xd = tl.load(s_dst + (dst * H + h)[:, :, None] * BLOCK_CK + ck, mask=m_dst[:, :, None],
                         other=0).to(ACC)
            if HAS_EDGE:
                xe = tl.load(s_edge + (eid * H + h)[:, :, None] * BLOCK_CK + ck,
                             mask=m_edge[:, :, None], other=0).to(ACC)
            else:
                xe = xs
        else:
            cm = ck < CK
            xs = tl.load(s_src + (src * H + h)[:, :, None] * CK + ck, mask=m_src[:, :, None] & cm,
                         other=0).to(ACC)
            xd = tl.load(s_dst + (dst * H + h)[:, :, None] * CK + ck, mask=m_dst[:, :, None] & cm,
                         other=0).to(ACC)
            if HAS_EDGE:
                xe = tl.load(s_edge + (eid * H + h)[:, :, None] * CK + ck,
                             mask=m_edge[:, :, None] & cm, other=0).to(ACC)
            else:
                xe = xs
        if KIND == 1:  # GATv2: att . leaky(x_src[j] + x_dst[i] + e_ij)
            z = xs + xd
            if HAS_EDGE:
                z = z + xe
            if FULL_CK:
                att = tl.load(s_att + h[:, :, None] * BLOCK_CK + ck).to(ACC)
            else:
                att = tl.load(s_att + h[:, :, None] * CK + ck, mask=ck < CK, other=0).to(ACC)
            score = tl.sum(tl.where(z > 0, z, z * slope) * att, 2)
        else:  # dot product: q_i . (k_j + e_ij) * scale
            z = xs
            if HAS_EDGE:
                z = z + xe
            score = tl.sum(xd * z, 2) * scale
    return score, z, xs, xd, xe


@triton.jit(do_not_specialize=_PER_CALL)
def _fwd_kernel(
    item_row, item_start, item_len, item_slot, bounds,
    csr_src, csr_eid, s_src, s_dst, s_edge, s_att, value, value_edge, coef,
    out, lse, part_out, part_lse, seed, p_drop, H, CK, CV,
    KIND: tl.constexpr, HAS_DST: tl.constexpr, HAS_EDGE: tl.constexpr, HAS_VEDGE: tl.constexpr,
    SHARE_V: tl.constexpr, SHARE_VE: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr,
    B_LO: tl.constexpr, B_HI: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_CK: tl.constexpr, BLOCK_CV: tl.constexpr,
    FULL_CK: tl.constexpr, FULL_CV: tl.constexpr,
):
    first, n_items, n_blocks = _blocks(bounds, B_LO, B_HI, H, BLOCK_R)
    for blk in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        lane, valid, row, h, start, length, final, piece, slot, max_len = _lanes(
            item_row, item_start, item_len, item_slot, blk, first, n_items, H, BLOCK_R)
        scale = tl.load(coef).to(ACC)
        slope = tl.load(coef + 1).to(ACC)
        keep_scale = tl.load(coef + 2).to(ACC)
        if DROPOUT:
            rng_seed = tl.load(seed)
        h2 = h[:, None]  # [R, 1]
        dst = row[:, None]
        m_dst = valid[:, None]
        cv3 = tl.arange(0, BLOCK_CV)[None, None, :]
        m_i = tl.full([BLOCK_R], float("-inf"), ACC)
        l_i = tl.zeros([BLOCK_R], ACC)
        # The accumulator keeps the layout of the [R, E, CV] tile it sums (the edge axis
        # kept, of size 1): as a 2-D slice of it each thread would hold every channel,
        # which spilled at wide C (ptxas, sm_90; benchmarks/NOTES.md, "GATv2's forward
        # accumulator"). tests/test_triton_compile.py holds the kernels to no spills.
        acc = tl.zeros([BLOCK_R, 1, BLOCK_CV], ACC)
        for off in range(0, max_len, BLOCK_E):
            pos = off + tl.arange(0, BLOCK_E)[None, :]
            emask = pos < length[:, None]  # [R, E]
            k = start[:, None] + off + tl.arange(0, BLOCK_E)[None, :]  # CSR positions, int64
            src = tl.load(csr_src + k, mask=emask, other=0).to(tl.int64)
            if HAS_EDGE or HAS_VEDGE:  # per-edge inputs are in original edge order
                eid = tl.load(csr_eid + k, mask=emask, other=0).to(tl.int64)
            else:
                eid = k
            score, z, xs, xd, xe = _score(s_src, s_dst, s_edge, s_att, h2, H, CK, src, dst, eid,
                                          emask, m_dst, emask, scale, slope, KIND, HAS_DST,
                                          HAS_EDGE, ACC, BLOCK_CK, FULL_CK)
            score = tl.where(emask, score, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(score, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no edge seen yet
            p = tl.exp(score - m_safe[:, None])  # [R, E], 0 off the edges
            corr = tl.exp(m_i - m_safe)
            l_i = l_i * corr + tl.sum(p, 1)
            if DROPOUT:
                keep = tl.rand(rng_seed, k * H + h2) >= p_drop
                p = tl.where(keep, p * keep_scale, 0.0)
            # v_j + u_ij, reusing the scorer's tiles when value (GATv2 layers) or
            # value_edge (Transformer layers) is the same tensor
            if FULL_CV:
                # CV is the tile's width: rows start at multiples of it and no channel
                # is masked, which lets the compiler prove rows aligned for wide loads
                vmask = emask[:, :, None]
                row_v = (src * H + h2)[:, :, None] * BLOCK_CV
            else:
                vmask = emask[:, :, None] & (cv3 < CV)
                row_v = (src * H + h2)[:, :, None] * CV
            if SHARE_V:
                v = xs
            else:
                v = tl.load(value + row_v + cv3, mask=vmask, other=0).to(ACC)
            if HAS_VEDGE:
                if SHARE_VE:
                    v = v + xe
                else:
                    v = v + tl.load(value_edge + (eid * H + h2)[:, :, None] * CV + cv3, mask=vmask,
                                    other=0).to(ACC)
            acc = acc * corr[:, None, None] + tl.sum(p[:, :, None] * v, 1, keep_dims=True)
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = tl.sum(acc, 1) / l_safe[:, None]  # [R, CV]; rows without in-edges stay 0
        row_lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
        cv = tl.arange(0, BLOCK_CV)[None, :]
        cm = cv < CV
        orow = row * H + h
        prow = slot * H + h
        tl.store(out + orow[:, None] * CV + cv, o, mask=final[:, None] & cm)
        tl.store(lse + orow, row_lse, mask=final)
        tl.store(part_out + prow[:, None] * CV + cv, o, mask=piece[:, None] & cm)
        tl.store(part_lse + prow, row_lse, mask=piece)


@triton.jit(do_not_specialize=_PER_CALL)
def _alpha_kernel(
    csr_src, csr_dst, csr_eid, E, s_src, s_dst, s_edge, s_att, coef, lse, alpha, H, CK,
    KIND: tl.constexpr, HAS_DST: tl.constexpr, HAS_EDGE: tl.constexpr, ACC: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_CK: tl.constexpr, FULL_CK: tl.constexpr,
):
    """``alpha[eid, h] = exp(e_ij - lse_i)``, one lane per (CSR position, head)."""
    lane = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)[:, None]  # [K, 1]
    k = lane // H
    h = lane % H
    m = k < E
    src = tl.load(csr_src + k, mask=m, other=0).to(tl.int64)
    dst = tl.load(csr_dst + k, mask=m, other=0).to(tl.int64)
    eid = tl.load(csr_eid + k, mask=m, other=0).to(tl.int64)
    scale = tl.load(coef).to(ACC)
    slope = tl.load(coef + 1).to(ACC)
    score, z, xs, xd, xe = _score(s_src, s_dst, s_edge, s_att, h, H, CK, src, dst, eid, m, m, m,
                                  scale, slope, KIND, HAS_DST, HAS_EDGE, ACC, BLOCK_CK, FULL_CK)
    row_lse = tl.load(lse + dst * H + h, mask=m, other=0)
    tl.store(alpha + eid * H + h, tl.exp(score - row_lse), mask=m)


@triton.jit(do_not_specialize=_PER_CALL)
def _keep_kernel(csr_eid, E, keep, seed, p_drop, H, BLOCK_K: tl.constexpr):
    """The dropout mask the fused kernels apply, as ``[E, H]`` in original order
    (the random stream is indexed by ``CSR position * H + head``)."""
    lane = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    k = lane // H
    m = k < E
    eid = tl.load(csr_eid + k, mask=m, other=0).to(tl.int64)
    kept = tl.rand(tl.load(seed), lane) >= p_drop
    tl.store(keep + eid * H + lane % H, kept.to(tl.int8), mask=m)


@triton.jit(do_not_specialize=("H", "C"))
def _merge_kernel(bounds, split_row, split_first, split_count, part, part_lse, out, lse, H, C,
                  SOFTMAX: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    """One lane per (split row, head): combines the row's partial results, in
    slot order (deterministic, no atomics). ``SOFTMAX``: the forward's
    ``(out_p, lse_p)`` pieces by their weights ``exp(lse_p - lse)``; else sums."""
    n = tl.load(bounds + 4)  # split rows (_Schedule.bounds: 0, the 3 bucket ends, splits)
    c = tl.arange(0, BLOCK_C)[None, :]
    cm = c < C
    for blk in range(tl.program_id(0), tl.cdiv(n * H, BLOCK_R).to(tl.int32), tl.num_programs(0)):
        lane = (tl.zeros([BLOCK_R], tl.int64) + blk) * BLOCK_R + tl.arange(0, BLOCK_R)
        s = lane // H
        h = lane % H
        valid = s < n
        row = tl.load(split_row + s, mask=valid, other=0).to(tl.int64)
        first = tl.load(split_first + s, mask=valid, other=0).to(tl.int64)
        count = tl.load(split_count + s, mask=valid, other=0)
        m = tl.full([BLOCK_R], float("-inf"), ACC)
        l_sum = tl.zeros([BLOCK_R], ACC)
        acc = tl.zeros([BLOCK_R, BLOCK_C], ACC)
        for j in range(0, tl.max(count, 0)):
            pm = valid & (j < count)
            prow = (first + j) * H + h
            po = tl.load(part + prow[:, None] * C + c, mask=pm[:, None] & cm, other=0).to(ACC)
            if SOFTMAX:
                pl = tl.load(part_lse + prow, mask=pm, other=float("-inf")).to(ACC)
                m_new = tl.maximum(m, pl)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                corr = tl.exp(m - m_safe)
                w = tl.exp(pl - m_safe)
                l_sum = l_sum * corr + w
                acc = acc * corr[:, None] + w[:, None] * po
                m = m_new
            else:
                acc += po
        orow = row * H + h
        if SOFTMAX:
            l_safe = tl.where(l_sum > 0, l_sum, 1.0)
            acc = acc / l_safe[:, None]
            tl.store(lse + orow, tl.where(l_sum > 0, m + tl.log(l_safe), float("-inf")), mask=valid)
        tl.store(out + orow[:, None] * C + c, acc, mask=valid[:, None] & cm)


@triton.jit(do_not_specialize=_PER_CALL)
def _bwd_dst_kernel(
    item_row, item_start, item_len, item_slot, bounds,
    csr_src, csr_eid, s_src, s_dst, s_edge, s_att, value, value_edge, coef,
    grad_out, out, lse, delta_alpha, grad_alpha, a_buf, ds_buf, d_vedge, d_edge, d_dst, part_dst,
    seed, p_drop, H, CK, CV, part_att,
    KIND: tl.constexpr, HAS_DST: tl.constexpr, HAS_EDGE: tl.constexpr, HAS_VEDGE: tl.constexpr,
    SHARE_V: tl.constexpr, SHARE_VE: tl.constexpr, DROPOUT: tl.constexpr, GALPHA: tl.constexpr,
    NEED_VEDGE: tl.constexpr, NEED_EDGE: tl.constexpr, NEED_DST: tl.constexpr,
    NEED_ATT: tl.constexpr, ACC: tl.constexpr,
    B_LO: tl.constexpr, B_HI: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_CK: tl.constexpr, BLOCK_CV: tl.constexpr,
    FULL_CK: tl.constexpr, FULL_CV: tl.constexpr,
):
    first, n_items, n_blocks = _blocks(bounds, B_LO, B_HI, H, BLOCK_R)
    # GATv2's att gradient, summed over the blocks this program runs: each lane
    # keeps one head, as the grid is a multiple of H (_programs)
    att_acc = tl.zeros([BLOCK_R, BLOCK_CK], ACC)
    for blk in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        lane, valid, row, h, start, length, final, piece, slot, max_len = _lanes(
            item_row, item_start, item_len, item_slot, blk, first, n_items, H, BLOCK_R)
        scale = tl.load(coef).to(ACC)
        slope = tl.load(coef + 1).to(ACC)
        keep_scale = tl.load(coef + 2).to(ACC)
        h2 = h[:, None]
        dst = row[:, None]
        m_dst = valid[:, None]
        orow = row * H + h  # [R]
        cv = tl.arange(0, BLOCK_CV)
        cvm = cv < CV
        cv3 = cv[None, None, :]
        ck = tl.arange(0, BLOCK_CK)
        ckm = ck < CK
        ck3 = ck[None, None, :]
        # rows of CV channels: with FULL_CV (CV is the tile's width) at the constexpr
        # stride BLOCK_CV and masked by lane/edge only, so they load 64/128 bits wide
        if FULL_CV:
            ooff = orow[:, None] * BLOCK_CV + cv[None, :]
            omask = valid[:, None]
        else:
            ooff = orow[:, None] * CV + cv[None, :]
            omask = valid[:, None] & cvm[None, :]
        g2 = tl.load(grad_out + ooff, mask=omask, other=0).to(ACC)  # [R, CV]
        g = g2[:, None, :]  # [R, 1, CV]
        row_lse = tl.load(lse + orow, mask=valid, other=0).to(ACC)
        row_lse = tl.where(row_lse == float("-inf"), 0.0, row_lse)  # rows without in-edges
        if DROPOUT:
            rng_seed = tl.load(seed)
        # Delta_i = <g_i, out_i> (+ sum_j alpha_ij dL/dalpha_ij): computed here, so the
        # backward builds no [N, H, C] temporary for it
        row_delta = tl.sum(g2 * tl.load(out + ooff, mask=omask, other=0).to(ACC), 1)
        if GALPHA:
            row_delta += tl.load(delta_alpha + orow, mask=valid, other=0).to(ACC)
        if KIND == 0:
            d_acc = tl.zeros([BLOCK_R], ACC)
        else:
            d_acc = tl.zeros([BLOCK_R, BLOCK_CK], ACC)
        if KIND == 1:  # only GATv2 has att (other kinds pass a placeholder pointer, maybe empty)
            att = tl.load(s_att + h[:, None, None] * CK + ck3, mask=valid[:, None, None] & (ck3 < CK),
                          other=0).to(ACC)  # [R, 1, CK]
        for off in range(0, max_len, BLOCK_E):
            pos = off + tl.arange(0, BLOCK_E)[None, :]
            emask = pos < length[:, None]
            k = start[:, None] + off + tl.arange(0, BLOCK_E)[None, :]  # int64, as every offset
            src = tl.load(csr_src + k, mask=emask, other=0).to(tl.int64)
            if HAS_EDGE or HAS_VEDGE or GALPHA:
                eid = tl.load(csr_eid + k, mask=emask, other=0).to(tl.int64)
            else:
                eid = k
            score, z, xs, xd, xe = _score(s_src, s_dst, s_edge, s_att, h2, H, CK, src, dst, eid,
                                          emask, m_dst, emask, scale, slope, KIND, HAS_DST,
                                          HAS_EDGE, ACC, BLOCK_CK, FULL_CK)
            p = tl.where(emask, tl.exp(score - row_lse[:, None]), 0.0)  # softmax, [R, E]
            vmask = emask[:, :, None] & (cv3 < CV)
            if FULL_CV:  # (as the destination rows above)
                lmask = emask[:, :, None]
                stride = BLOCK_CV
            else:
                lmask = vmask
                stride = CV
            if SHARE_V:
                v = xs
            else:
                v = tl.load(value + (src * H + h2)[:, :, None] * stride + cv3, mask=lmask,
                            other=0).to(ACC)
            if HAS_VEDGE:
                if SHARE_VE:
                    v = v + xe
                else:
                    v = v + tl.load(value_edge + (eid * H + h2)[:, :, None] * stride + cv3, mask=lmask,
                                    other=0).to(ACC)
            dp = tl.sum(g * v, 2)  # <g_i, v_j + u_ij>
            if DROPOUT:
                keep = tl.rand(rng_seed, k * H + h2) >= p_drop
                drop = tl.where(keep, keep_scale, 0.0)
                a = p * drop
                dp = dp * drop
            else:
                a = p
            if GALPHA:
                dp = dp + tl.load(grad_alpha + eid * H + h2, mask=emask, other=0).to(ACC)
            ds = p * (dp - row_delta[:, None])  # softmax backward, [R, E]
            eoff = k * H + h2
            tl.store(a_buf + eoff, a, mask=emask)
            if NEED_VEDGE:
                tl.store(d_vedge + (eid * H + h2)[:, :, None] * CV + cv3, a[:, :, None] * g, mask=vmask)
            if KIND == 0:
                dz = ds * tl.where(z > 0, 1.0, slope)
                tl.store(ds_buf + eoff, dz, mask=emask)
                d_acc += tl.sum(dz, 1)
                if NEED_EDGE:
                    tl.store(d_edge + eid * H + h2, dz, mask=emask)
            elif KIND == 1:
                tl.store(ds_buf + eoff, ds, mask=emask)
                dz = ds[:, :, None] * att * tl.where(z > 0, 1.0, slope)  # [R, E, CK]
                d_acc += tl.sum(dz, 1)
                if NEED_ATT:
                    att_acc += tl.sum(ds[:, :, None] * tl.where(z > 0, z, z * slope), 1)
                if NEED_EDGE:
                    tl.store(d_edge + (eid * H + h2)[:, :, None] * CK + ck3, dz,
                             mask=emask[:, :, None] & (ck3 < CK))
            else:
                tl.store(ds_buf + eoff, ds, mask=emask)
                d_acc += tl.sum(ds[:, :, None] * z, 1)  # dq_i, scaled below
                if NEED_EDGE:
                    tl.store(d_edge + (eid * H + h2)[:, :, None] * CK + ck3, ds[:, :, None] * xd * scale,
                             mask=emask[:, :, None] & (ck3 < CK))
        prow = slot * H + h
        if NEED_DST:
            if KIND == 0:
                tl.store(d_dst + orow, d_acc, mask=final)
                tl.store(part_dst + prow, d_acc, mask=piece)
            else:
                if KIND == 2:
                    d_acc = d_acc * scale
                km = ckm[None, :]
                tl.store(d_dst + orow[:, None] * CK + ck[None, :], d_acc, mask=final[:, None] & km)
                tl.store(part_dst + prow[:, None] * CK + ck[None, :], d_acc, mask=piece[:, None] & km)
    if NEED_ATT:  # one partial per lane of each program, summed by the caller
        ck = tl.arange(0, BLOCK_CK)
        slot = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        tl.store(part_att + slot[:, None] * CK + ck[None, :], att_acc, mask=(ck < CK)[None, :])


@triton.jit(do_not_specialize=_PER_CALL)
def _bwd_src_kernel(
    item_row, item_start, item_len, item_slot, bounds,
    csc_edge, csc_dst, csc_eid, s_src, s_dst, s_edge, s_att, coef,
    grad_out, a_buf, ds_buf, d_value, part_value, d_src, part_src, H, CK, CV,
    KIND: tl.constexpr, HAS_EDGE: tl.constexpr, NEED_VALUE: tl.constexpr, NEED_SRC: tl.constexpr,
    ACC: tl.constexpr,
    B_LO: tl.constexpr, B_HI: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_CK: tl.constexpr, BLOCK_CV: tl.constexpr,
    FULL_CK: tl.constexpr, FULL_CV: tl.constexpr,
):
    first, n_items, n_blocks = _blocks(bounds, B_LO, B_HI, H, BLOCK_R)
    for blk in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        lane, valid, row, h, start, length, final, piece, slot, max_len = _lanes(
            item_row, item_start, item_len, item_slot, blk, first, n_items, H, BLOCK_R)
        slope = tl.load(coef + 1).to(ACC)
        h2 = h[:, None]
        orow = row * H + h  # this lane's source node and head
        cv = tl.arange(0, BLOCK_CV)
        cvm = cv < CV
        cv3 = cv[None, None, :]
        ck = tl.arange(0, BLOCK_CK)
        ckm = ck < CK
        ck3 = ck[None, None, :]
        dv_acc = tl.zeros([BLOCK_R, BLOCK_CV], ACC)
        if KIND == 0:
            ds_acc = tl.zeros([BLOCK_R], ACC)
        else:
            ds_acc = tl.zeros([BLOCK_R, BLOCK_CK], ACC)
        if KIND == 1:
            rmask = valid[:, None, None] & (ck3 < CK)
            att = tl.load(s_att + h[:, None, None] * CK + ck3, mask=rmask, other=0).to(ACC)  # [R, 1, CK]
            xs = tl.load(s_src + orow[:, None, None] * CK + ck3, mask=rmask, other=0).to(ACC)
        for off in range(0, max_len, BLOCK_E):
            pos = off + tl.arange(0, BLOCK_E)[None, :]
            emask = pos < length[:, None]
            t = start[:, None] + off + tl.arange(0, BLOCK_E)[None, :]  # CSC positions, int64
            k = tl.load(csc_edge + t, mask=emask, other=0).to(tl.int64)  # CSR positions
            i = tl.load(csc_dst + t, mask=emask, other=0).to(tl.int64)  # destinations
            if NEED_VALUE:
                a = tl.load(a_buf + k * H + h2, mask=emask, other=0)
                if FULL_CV:
                    # CV is the tile's width: rows at the constexpr stride BLOCK_CV, masked
                    # by edge only, so the compiler can prove them aligned and contiguous
                    # and gather them 64/128 bits at a time
                    gi = tl.load(grad_out + (i * H + h2)[:, :, None] * BLOCK_CV + cv3,
                                 mask=emask[:, :, None], other=0).to(ACC)
                else:
                    gi = tl.load(grad_out + (i * H + h2)[:, :, None] * CV + cv3,
                                 mask=emask[:, :, None] & (cv3 < CV), other=0).to(ACC)
                dv_acc += tl.sum(a[:, :, None] * gi, 1)
            if NEED_SRC:
                ds = tl.load(ds_buf + k * H + h2, mask=emask, other=0)
                if KIND == 0:
                    ds_acc += tl.sum(ds, 1)
                else:
                    if FULL_CK:  # (as the value rows above)
                        cmask = emask[:, :, None]
                        sk = BLOCK_CK
                    else:
                        cmask = emask[:, :, None] & (ck3 < CK)
                        sk = CK
                    xd = tl.load(s_dst + (i * H + h2)[:, :, None] * sk + ck3, mask=cmask,
                                 other=0).to(ACC)
                    if KIND == 1:
                        z = xs + xd
                        if HAS_EDGE:
                            eid = tl.load(csc_eid + t, mask=emask, other=0).to(tl.int64)
                            z = z + tl.load(s_edge + (eid * H + h2)[:, :, None] * sk + ck3, mask=cmask,
                                            other=0).to(ACC)
                        ds_acc += tl.sum(ds[:, :, None] * att * tl.where(z > 0, 1.0, slope), 1)
                    else:
                        ds_acc += tl.sum(ds[:, :, None] * xd, 1)  # dk_j, scaled below
        prow = slot * H + h
        if NEED_VALUE:
            vm = cvm[None, :]
            tl.store(d_value + orow[:, None] * CV + cv[None, :], dv_acc, mask=final[:, None] & vm)
            tl.store(part_value + prow[:, None] * CV + cv[None, :], dv_acc, mask=piece[:, None] & vm)
        if NEED_SRC:
            if KIND == 0:
                tl.store(d_src + orow, ds_acc, mask=final)
                tl.store(part_src + prow, ds_acc, mask=piece)
            else:
                if KIND == 2:
                    ds_acc = ds_acc * tl.load(coef).to(ACC)
                km = ckm[None, :]
                tl.store(d_src + orow[:, None] * CK + ck[None, :], ds_acc, mask=final[:, None] & km)
                tl.store(part_src + prow[:, None] * CK + ck[None, :], ds_acc, mask=piece[:, None] & km)


# ---------------------------------------------------------------------------
# Operators, autograd and entry point.
# ---------------------------------------------------------------------------
@dataclass
class _Meta:
    """The non-tensor arguments of one fused call."""

    kind: int
    H: int
    CK: int  # channels of the scorer's per-node terms (1 for GAT)
    CV: int  # channels of the values
    scale: float
    slope: float
    p: float  # dropout probability, 0 when inactive
    need_alpha: bool
    alpha_dtype: torch.dtype
    acc: torch.dtype  # accumulation dtype: float32, or float64 for float64 inputs
    share_v: bool  # value is the scorer's x_src (GATv2 layers)
    share_ve: bool  # value_edge is the scorer's edge term (Transformer layers)


def _meta(kind: int, scale: float, slope: float, p: float, need_alpha: bool,
          alpha_dtype: torch.dtype, share_v: bool, share_ve: bool, ins) -> _Meta:
    s_src, value = ins[0], ins[4]
    return _Meta(kind, value.size(1), 1 if kind == 0 else s_src.size(-1), value.size(-1), scale, slope,
                 p, need_alpha, alpha_dtype, acc_dtype(*ins), share_v, share_ve)


class _Graph(NamedTuple):
    """What the kernels read of a graph, as the operators take it: the CSR and
    CSC layouts and the two schedules (:func:`_graph_tensors` flattens it)."""

    ptr: Tensor
    src: Tensor  # [E] CSR order
    dst: Tensor  # [E] CSR order
    perm: Tensor  # [E] edge-list position of each CSR position
    csc_edge: Tensor  # [E] CSR position of each CSC position
    csc_dst: Tensor
    csr_eid: Tensor  # perm in the kernels' index dtype
    csc_eid: Tensor  # edge-list position of each CSC position
    dst_items: _Schedule
    src_items: _Schedule

    @property
    def num_dst(self) -> int:
        return self.ptr.numel() - 1

    @property
    def num_edges(self) -> int:
        return self.src.numel()


def _graph_tensors(tp: _Plan, splits: Tuple[bool, bool] = (True, True)) -> List[Tensor]:
    """The operators' ``graph`` argument; ``splits`` (:func:`_split_rows`): whether
    each schedule's split rows are passed (if not, its merges do not launch)."""
    lay = tp.layout
    # csr_eid is perm in the kernels' index dtype: the plan's, not converted per call
    # (an int32 layout's copy was an ATen launch in each forward and backward); where
    # it is perm itself, a view of it (torch.compile traces no autograd function
    # given one tensor twice)
    csr_eid = tp.csr_eid if tp.csr_eid is not lay.perm else lay.perm.view(-1)
    return [lay.ptr, lay.src, lay.dst, lay.perm, lay.csc_edge, lay.csc_dst, csr_eid, tp.csc_eid,
            *_schedule_tensors(tp.dst_items, splits[0]), *_schedule_tensors(tp.src_items, splits[1])]


def _schedule_tensors(s: _Schedule, split: bool = True) -> List[Tensor]:
    parts = (s.split_row, s.split_first, s.split_count)
    if not split:  # none of its rows is split: empty arrays, whose merge never launches
        parts = tuple(t[:0] for t in parts)
    return [s.row, s.start, s.length, s.slot, s.bounds, *parts]


def _graph_of(ts: List[Tensor]) -> _Graph:
    ptr, src, dst, perm, csc_edge, csc_dst, csr_eid, csc_eid = ts[:8]
    max_pieces = _schedule_sizes(0, src.numel(), _SPLIT)[2]

    def schedule(t: List[Tensor]) -> _Schedule:  # (no split rows: no partial results either)
        return _Schedule(*t, max_pieces if t[5].numel() else 0)

    return _Graph(ptr, src, dst, perm, csc_edge, csc_dst, csr_eid, csc_eid,
                  schedule(ts[8:16]), schedule(ts[16:24]))


def _split_rows(tp: _Plan, like: Tensor) -> Tuple[bool, bool]:
    """Whether the destination and the source schedule of ``tp`` have split rows,
    so that their merges must launch.

    A call that must hold for any graph of these sizes — traced by
    ``torch.compile``, on fake tensors — assumes both may (the merge kernel then
    finds none on the device). An eager call reads it back once per plan, in its
    first call (as building the plan's layout reads values back): graphs without
    hubs (no row longer than ``_SPLIT`` edges, as Cora's) then skip four merge
    launches per forward and backward. Under CUDA graph capture nothing is read;
    a value read before the capture holds, the plan's tensors never change.
    """
    if torch.compiler.is_compiling() or type(like) is not torch.Tensor:
        return True, True
    if tp.splits is None:
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            return True, True
        counts = torch.stack([tp.dst_items.bounds[-1], tp.src_items.bounds[-1]])
        dst, src = counts.tolist()  # the number of split rows of each schedule
        tp.splits = (dst > 0, src > 0)
    return tp.splits


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _params(meta: _Meta, like: Tensor) -> Tensor:
    """``[scale, negative_slope, 1 / (1 - p)]`` in the accumulation dtype, on
    ``like``'s device (a fresh constant while an operator is traced: a cached
    fake or functional tensor must not outlive the trace)."""
    keep = 1.0 / (1.0 - meta.p) if meta.p > 0 else 1.0
    if type(like) is not torch.Tensor:
        return torch.tensor([meta.scale, meta.slope, keep], dtype=meta.acc, device=like.device)
    return _params_tensor(meta.scale, meta.slope, keep, meta.acc, like.device)


@functools.lru_cache(maxsize=64)
def _params_tensor(scale: float, slope: float, keep: float, dtype: torch.dtype,
                   device: torch.device) -> Tensor:
    # Loaded in-kernel so that float64 runs use exact constants (scalar kernel
    # arguments are float32); cached to skip a host-to-device copy per call.
    return torch.tensor([scale, slope, keep], dtype=dtype, device=device)


def _operator(name: str, fake):
    """Define ``gatlib::<name>``: a ``triton_op`` (its launches go through
    ``wrap_triton``, so ``torch.compile`` sees the kernels and its fake
    implementation is the function itself), or, under Triton's interpreter, whose
    kernels read data and which ``wrap_triton`` leaves unwrapped, a ``custom_op``
    with the shapes-only ``fake``."""
    def define(fn):
        if _interpreted():
            op = torch.library.custom_op(f"gatlib::{name}", fn, mutates_args=())
            op.register_fake(fake)
            return op
        return torch.library.triton_op(f"gatlib::{name}", fn, mutates_args=())
    return define


def _fake_forward(s_src, s_dst, s_edge, s_att, value, value_edge, seed, graph, kind, scale, slope,
                  p, need_alpha, alpha_dtype, share_v, share_ve):
    num_dst, E = graph[0].numel() - 1, graph[1].numel()
    H = value.size(1)
    acc = acc_dtype(s_src, s_dst, s_edge, s_att, value, value_edge)
    alpha = value.new_empty(E, H, dtype=alpha_dtype) if need_alpha else value.new_empty(0)
    return (value.new_empty(num_dst, H, value.size(2)), alpha, value.new_empty(num_dst, H, dtype=acc))


@_operator("triton_attention", _fake_forward)
def _attention_op(s_src: Tensor, s_dst: Optional[Tensor], s_edge: Optional[Tensor],
                  s_att: Optional[Tensor], value: Tensor, value_edge: Optional[Tensor],
                  seed: Optional[Tensor], graph: List[Tensor], kind: int, scale: float, slope: float,
                  p: float, need_alpha: bool, alpha_dtype: torch.dtype, share_v: bool,
                  share_ve: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(out [N_dst, H, CV], alpha [E, H] in edge-list order or [0], lse [N_dst, H])``
    of one call (:class:`_FusedAttention` has the maths); ``graph`` as
    :func:`_graph_tensors` flattens it. The tensors in the fused CPU operator's
    order: the score's ``(src, dst, edge, att)``, then ``(value, value_edge)``."""
    ins = (s_src, s_dst, s_edge, s_att, value, value_edge)
    meta = _meta(kind, scale, slope, p, need_alpha, alpha_dtype, share_v, share_ve, ins)
    return _forward(meta, _graph_of(graph), *ins, seed)


def _fake_backward(grad_out, grad_alpha, s_src, s_dst, s_edge, s_att, value, value_edge, seed, out,
                   lse, alpha, graph, kind, scale, slope, p, share_v, share_ve, need):
    ins = (s_src, s_dst, s_edge, s_att, value, value_edge)
    return [torch.empty_like(t) if n and t is not None else value.new_empty(0)
            for t, n in zip(ins, need, strict=True)]


@_operator("triton_attention_backward", _fake_backward)
def _attention_backward_op(grad_out: Optional[Tensor], grad_alpha: Optional[Tensor], s_src: Tensor,
                           s_dst: Optional[Tensor], s_edge: Optional[Tensor], s_att: Optional[Tensor],
                           value: Tensor, value_edge: Optional[Tensor], seed: Optional[Tensor],
                           out: Tensor, lse: Tensor, alpha: Tensor, graph: List[Tensor], kind: int,
                           scale: float, slope: float, p: float, share_v: bool, share_ve: bool,
                           need: List[bool]) -> List[Tensor]:
    """The gradients of the forward operator's six float inputs (``s_src``, ...,
    ``value_edge``) from those of ``out`` and ``alpha``; an empty tensor for each
    one ``need`` does not ask for."""
    ins = (s_src, s_dst, s_edge, s_att, value, value_edge)
    meta = _meta(kind, scale, slope, p, alpha.numel() > 0, alpha.dtype, share_v, share_ve, ins)
    grads = _backward(meta, _graph_of(graph), need, grad_out, grad_alpha, *ins, seed, out, lse, alpha)
    return [g if g is not None else value.new_empty(0) for g in grads]


def _setup_context(ctx, inputs, output):
    *ins, seed, graph, kind, scale, slope, p, need_alpha, alpha_dtype, share_v, share_ve = inputs
    out, alpha, lse = output
    ctx.args = (kind, scale, slope, p, share_v, share_ve)
    ctx.num_graph = len(graph)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*ins, seed, out, lse, alpha, *graph)


def _grads(ctx, grad_out: Optional[Tensor], grad_alpha: Optional[Tensor]) -> List[Optional[Tensor]]:
    """The gradients of the six float inputs (``None`` where not needed): the
    backward operator's, or the reference's where they must be differentiable."""
    saved = ctx.saved_tensors
    ins, seed, out, lse, alpha, graph = saved[:6], saved[6], saved[7], saved[8], saved[9], saved[10:]
    need = ctx.needs_input_grad[:6]
    kind, scale, slope, p, share_v, share_ve = ctx.args
    if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
        _record.log("triton.backward:reference")
        return _reference_backward(kind, scale, slope, p, seed, _graph_of(list(graph)), ins, need,
                                   grad_out, grad_alpha)
    grads = torch.ops.gatlib.triton_attention_backward.default(
        grad_out, grad_alpha, *ins, seed, out, lse, alpha, list(graph), kind, scale, slope, p,
        share_v, share_ve, list(need))
    return [g if n else None for g, n in zip(grads, need, strict=True)]


def _op_backward(ctx, grad_out, grad_alpha, _grad_lse):
    return (*_grads(ctx, grad_out, grad_alpha), None, [None] * ctx.num_graph, *([None] * 8))


_attention_op.register_autograd(_op_backward, setup_context=_setup_context)


class _FusedAttention(torch.autograd.Function):
    r""":func:`_attention_op` with its backward, the graph's tensors last and one
    by one (as the fused CPU kernel's: ``torch.func.grad`` cannot differentiate the
    bare operator in torch 2.13; ``torch.compile`` traces this function into the
    same two operators). Fused attention over CSR segments (one head shown; ``D`` the dropout mask).

    Forward, per destination ``i`` (online softmax over tiles of in-edges)::

        m, l, acc = -inf, 0, 0
        for each tile of edges j -> i:
            s_j   = score(i, j)                       # GAT / GATv2 / dot, in-kernel
            m'    = max(m, max_j s_j)
            p_j   = exp(s_j - m')
            l     = l * exp(m - m') + sum_j p_j
            acc   = acc * exp(m - m') + sum_j p_j * D_ij / (1 - p) * (v_j + u_ij)
            m     = m'
        out_i = acc / l;  lse_i = m + log(l)          # saved: out [N, H, C], lse [N, H]
        alpha_ij = exp(s_ij - lse_i)                  # only when asked for

    Backward, with ``g_i = dL/dout_i`` and ``A_ij = alpha_ij D_ij / (1 - p)``::

        Delta_i = <g_i, out_i> + sum_j alpha_ij * dL/dalpha_ij     # [N, H]
        # destination-major (CSR) kernel, recomputing s_ij and alpha_ij from lse_i:
        dP_ij  = D_ij / (1 - p) * <g_i, v_j + u_ij> + dL/dalpha_ij
        dS_ij  = alpha_ij * (dP_ij - Delta_i)                      # softmax gradient
        du_ij  = A_ij g_i                                          # value_edge
        GAT:   dz_ij = dS_ij * leaky'(z_ij);  da_dst_i = sum_j dz_ij;  da_edge_ij = dz_ij
        GATv2: dz_ij = dS_ij * att ⊙ leaky'(z_ij);  dx_dst_i = sum_j dz_ij;  de_ij = dz_ij
               datt  = sum_ij dS_ij * leaky(z_ij)                   (per-lane partials)
        dot:   dq_i  = scale * sum_j dS_ij (k_j + e_ij);  de_ij = scale * dS_ij q_i
        # source-major (CSC) kernel, gathering A and dS (GAT: dz) saved as [E, H]:
        dv_j = sum_i A_ij g_i
        GAT: da_src_j = sum_i dz_ij;  GATv2: dx_src_j = sum_i dS_ij att ⊙ leaky'(z_ij);
        dot: dk_j = scale * sum_i dS_ij q_i

    Inputs, in the fused CPU operator's order: the scorer's tensors ``s_src``
    (a_src / x_src / key), ``s_dst`` (a_dst / x_dst / query), ``s_edge`` and
    ``s_att`` (GATv2's ``att [H, CK]``), then ``value [N_src, H, CV]`` and
    ``value_edge [E, H, CV]`` or None. The score formulas are
    :mod:`gatlib._scores`' (``gat_edge``, ``gatv2_edge``, ``dot_edge``).
    """

    @staticmethod
    def forward(s_src, s_dst, s_edge, s_att, value, value_edge, seed, kind, scale, slope, p,
                need_alpha, alpha_dtype, share_v, share_ve, *graph):
        return torch.ops.gatlib.triton_attention.default(
            s_src, s_dst, s_edge, s_att, value, value_edge, seed, list(graph), kind, scale, slope,
            p, need_alpha, alpha_dtype, share_v, share_ve)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, (*inputs[:7], inputs[15:], *inputs[7:15]), output)

    @staticmethod
    def backward(ctx, grad_out, grad_alpha, _grad_lse):
        return (*_grads(ctx, grad_out, grad_alpha), *([None] * (9 + ctx.num_graph)))


def _forward(meta: _Meta, graph: _Graph, s_src, s_dst, s_edge, s_att, value, value_edge, seed):
    _record.log("triton")
    plan = lay = graph
    H, CK, CV, dev = meta.H, meta.CK, meta.CV, value.device
    acc = meta.acc
    N_dst, E = lay.num_dst, lay.num_edges
    items = plan.dst_items
    out = torch.empty(N_dst, H, CV, dtype=value.dtype, device=dev)
    lse = torch.empty(N_dst, H, dtype=acc, device=dev)
    part_out = torch.empty(items.max_pieces, H, CV, dtype=acc, device=dev)
    part_lse = torch.empty(items.max_pieces, H, dtype=acc, device=dev)
    coef = _params(meta, value)
    dummy = value
    consts = _consts(meta, s_dst, s_edge, value_edge)
    with _device(value):
        _launch(_fwd_kernel, items, H, max(consts["BLOCK_CK"], consts["BLOCK_CV"]),
                lay.src, plan.csr_eid, s_src, _or(s_dst, dummy), _or(s_edge, dummy),
                _or(s_att, dummy), value, _or(value_edge, dummy), coef,
                out, lse, part_out, part_lse, _or(seed, dummy), meta.p, H, CK, CV,
                DROPOUT=meta.p > 0, **consts)
        _merge(out, part_out, items, H, lse, part_lse)
        alpha = value.new_empty(0)  # (an operator returns tensors only)
        if meta.need_alpha:
            alpha = torch.empty(E, H, dtype=meta.alpha_dtype, device=dev)
            if E:
                # independent (edge, head) lanes: as many as fill the tile
                block_k = min(1024, max(1, _tile()[0] // consts["BLOCK_CK"]))
                wrap_triton(_alpha_kernel)[(triton.cdiv(E * H, block_k),)](
                    lay.src, lay.dst, plan.csr_eid, E, s_src, _or(s_dst, dummy),
                    _or(s_edge, dummy), _or(s_att, dummy), coef, lse, alpha, H, CK,
                    KIND=meta.kind, HAS_DST=consts["HAS_DST"], HAS_EDGE=consts["HAS_EDGE"],
                    ACC=consts["ACC"], BLOCK_K=block_k, BLOCK_CK=consts["BLOCK_CK"],
                    FULL_CK=consts["FULL_CK"],
                    num_warps=_warps(consts["BLOCK_CK"], consts["ACC"]))
    return out, alpha, lse


def _backward(meta: _Meta, graph: _Graph, need, grad_out, grad_alpha, s_src, s_dst, s_edge, s_att,
              value, value_edge, seed, out, lse, alpha):
    _record.log("triton.backward")
    plan = lay = graph
    H, CK, CV, dev, acc = meta.H, meta.CK, meta.CV, value.device, meta.acc
    E = lay.num_edges
    # need: (s_src, s_dst, s_edge, s_att, value, value_edge)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    g = grad_out.contiguous()
    # (no weights were returned: their [0] placeholder may get a [0] gradient)
    galpha = grad_alpha is not None and alpha.numel() > 0
    grad_alpha = grad_alpha if galpha else None
    delta_alpha = None
    if galpha:  # sum_j alpha_ij dL/dalpha_ij; the kernel adds <g_i, out_i>
        grad_alpha = grad_alpha.contiguous()
        # one [E, H] temporary and the product in acc either way: a copy multiplied in
        # place where grad_alpha is in a lower precision, else one product (it is the
        # caller's tensor: no copy just to write into)
        ag = grad_alpha.to(acc)
        ag = ag * alpha if ag is grad_alpha else ag.mul_(alpha)
        ag = ag.index_select(0, lay.perm)  # [E, H], CSR
        delta_alpha = torch.segment_reduce(ag, "sum", offsets=lay.ptr, unsafe=True)  # [N_dst, H]
    consts = _consts(meta, s_dst, s_edge, value_edge)
    dummy = value
    coef = _params(meta, value)
    a_buf = torch.empty(E, H, dtype=acc, device=dev)
    ds_buf = torch.empty(E, H, dtype=acc, device=dev)
    need_vedge = value_edge is not None and need[5]
    need_edge = s_edge is not None and need[2]
    need_dst = s_dst is not None and need[1]
    need_att = s_att is not None and need[3]
    d_vedge = torch.empty_like(value_edge) if need_vedge else None
    d_edge = torch.empty_like(s_edge) if need_edge else None
    d_dst = torch.empty_like(s_dst) if need_dst else None
    items = plan.dst_items
    part_dst = torch.empty(items.max_pieces, H, *([CK] if meta.kind else []), dtype=acc,
                           device=dev) if need_dst else None
    width = max(consts["BLOCK_CK"], consts["BLOCK_CV"])
    # GATv2's att gradient: one [CK] partial per lane of each program (a fixed
    # number, whatever the graph), summed once after the launches
    part_att = torch.empty(_att_partials(width, H, dev), CK, dtype=acc, device=dev) \
        if need_att else None
    with _device(value):
        _launch(_bwd_dst_kernel, items, H, width,
                lay.src, plan.csr_eid, s_src, _or(s_dst, dummy), _or(s_edge, dummy),
                _or(s_att, dummy), value, _or(value_edge, dummy), coef,
                g, out, lse, _or(delta_alpha, dummy), _or(grad_alpha, dummy), a_buf, ds_buf,
                _or(d_vedge, dummy), _or(d_edge, dummy), _or(d_dst, dummy),
                _or(part_dst, dummy), _or(seed, dummy), meta.p, H, CK, CV,
                part_att=_or(part_att, dummy), DROPOUT=meta.p > 0, GALPHA=galpha, NEED_VEDGE=need_vedge,
                NEED_EDGE=need_edge, NEED_DST=need_dst, NEED_ATT=need_att, **consts)
        if need_dst:
            _merge(d_dst, part_dst, items, H)
        need_value, need_src = need[4], need[0]
        d_value = d_src = None
        if need_value or need_src:
            sitems = plan.src_items
            d_value = torch.empty_like(value) if need_value else None
            d_src = torch.empty_like(s_src) if need_src else None
            part_value = torch.empty(sitems.max_pieces, H, CV, dtype=acc, device=dev) \
                if need_value else None
            part_src = torch.empty(sitems.max_pieces, H, *([CK] if meta.kind else []),
                                   dtype=acc, device=dev) if need_src else None
            _launch(_bwd_src_kernel, sitems, H, width,
                    lay.csc_edge, lay.csc_dst, plan.csc_eid, s_src, _or(s_dst, dummy),
                    _or(s_edge, dummy), _or(s_att, dummy), coef, g, a_buf, ds_buf,
                    _or(d_value, dummy), _or(part_value, dummy), _or(d_src, dummy),
                    _or(part_src, dummy), H, CK, CV,
                    KIND=meta.kind, HAS_EDGE=consts["HAS_EDGE"], NEED_VALUE=need_value,
                    NEED_SRC=need_src, ACC=consts["ACC"], BLOCK_CK=consts["BLOCK_CK"],
                    BLOCK_CV=consts["BLOCK_CV"], FULL_CK=consts["FULL_CK"], FULL_CV=consts["FULL_CV"])
            if need_value:
                _merge(d_value, part_value, sitems, H)
            if need_src:
                _merge(d_src, part_src, sitems, H)
    d_att = part_att.view(-1, H, CK).sum(0).to(s_att.dtype) if need_att else None
    return [d_src, d_dst, d_edge, d_att, d_value, d_vedge]


def _reference_backward(kind: int, scale: float, slope: float, p: float, seed: Optional[Tensor],
                        graph: _Graph, ins, need, g_out, g_alpha) -> List[Optional[Tensor]]:
    """Differentiable gradients of the same call: the reference's, on the edge list
    with the kernels' dropout mask. Builds ``[E, H, C]`` tensors, as the reference does."""
    value = ins[4]
    drop = None
    if p > 0:
        acc = acc_dtype(*ins)
        keep = _keep_mask(graph.csr_eid, value.size(1), p, seed)
        drop = keep.to(acc) * (1.0 / (1.0 - p))
    perm = graph.perm.long()
    src = torch.empty_like(perm).index_copy_(0, perm, graph.src.long())  # edge-list order
    dst = torch.empty_like(perm).index_copy_(0, perm, graph.dst.long())
    return reference_grads(_KIND_NAMES[kind], scale, slope, ins, src, dst, graph.num_dst, drop,
                           (g_out, g_alpha), need)


def _or(t: Optional[Tensor], default: Tensor) -> Tensor:
    # Kernels take a pointer for every optional tensor; an absent one is never read.
    return default if t is None else t


def _consts(meta: _Meta, s_dst, s_edge, value_edge) -> dict:
    return dict(
        KIND=meta.kind, HAS_DST=s_dst is not None, HAS_EDGE=s_edge is not None,
        HAS_VEDGE=value_edge is not None, SHARE_V=meta.share_v, SHARE_VE=meta.share_ve,
        ACC=_tl_acc(meta.acc), BLOCK_CK=triton.next_power_of_2(meta.CK),
        BLOCK_CV=triton.next_power_of_2(meta.CV), FULL_CV=meta.CV == triton.next_power_of_2(meta.CV),
        FULL_CK=meta.CK == triton.next_power_of_2(meta.CK),
    )


def _draw_seed(device: torch.device) -> Tensor:
    """A dropout seed drawn on ``device`` by its default generator and read by the
    kernels from device memory: no host sync, ``torch.manual_seed`` makes fused
    dropout reproducible, and a captured CUDA graph should draw a new seed per
    replay (PyTorch's generator advances its Philox offset on the device under
    capture; ``gatlib selftest --device cuda`` checks it; it did on an H100)."""
    return torch.randint(0, 2**31 - 1, (1,), device=device)


def _check_interpreter() -> None:
    """CPU tensors need every jit function — ours and triton.language's own
    (``tl.sum``, ``tl.rand``) — built for the interpreter, which happens only
    if ``TRITON_INTERPRET=1`` was set before triton was first imported."""
    from triton.runtime.interpreter import InterpretedFunction

    if not (isinstance(_fwd_kernel, InterpretedFunction) and isinstance(tl.sum, InterpretedFunction)):
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first "
            "imported (note that torch_geometric imports triton); set it at the very start of "
            "the process")


def unsupported(score: EdgeScore, value: Tensor, value_edge: Optional[Tensor]) -> Optional[str]:
    """Why the kernels cannot run on these tensors, or ``None`` if they can."""
    dev = value.device
    for t in (value, value_edge, *score.tensors()):
        if t is None:
            continue
        if t.device != dev:
            return f"all tensors must be on one device; got {t.device} and {dev}"
        if t.dtype not in _FLOATS:
            return f"the Triton kernels compute in {', '.join(map(str, _FLOATS))}; got {t.dtype}"
    CK = 1 if score.kind == "gat" else score.src.size(-1)
    if max(CK, value.size(-1)) > _MAX_C:
        return f"the Triton kernels take at most {_MAX_C} channels per head; got {max(CK, value.size(-1))}"
    if dev.type == "cpu":
        _check_interpreter()
    return None


def attention(score: EdgeScore, value: Tensor, plan: GraphPlan, value_edge: Optional[Tensor],
              p: float, need_alpha: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """Fused attention (see :class:`_FusedAttention`) of a call :func:`unsupported` accepts.

    Args:
        score: the edge score.
        value: ``[N_src, H, C]`` source values (or ``[N_src, 1, C]`` shared by every head).
        plan: the graph; the kernels' schedule is kept on it.
        value_edge: optional ``[E, H, C]`` per-edge value term.
        p: attention dropout probability in effect (0 outside training).
        need_alpha: also return the ``[E, H]`` weights (before dropout).

    Returns:
        ``(out [N_dst, H, C], alpha [E, H] or None)`` with ``out`` in
        ``value``'s dtype and ``alpha`` in edge-list order.
    """
    kind = _KINDS[score.kind]
    s_src, s_dst, s_edge, s_att = score.tensors()
    # A value (or a dot key) of one head that all heads share: each lane of these
    # kernels reads one (row, head), so the shared rows are copied per head; the
    # per-edge reads are C wide per head either way (the rule in gatlib.layers).
    H = score.heads
    if value.size(1) != H:
        value = value.expand(-1, H, -1)
    if kind == 2 and s_src.size(1) != H:
        s_src = s_src.expand(-1, H, -1)
    tensors = (s_src, s_dst, s_edge, s_att, value, value_edge)
    share_v = kind == 1 and s_src is value
    share_ve = value_edge is not None and value_edge is s_edge and kind != 0
    seed = _draw_seed(value.device) if p > 0 else None
    alpha_dtype = promoted_dtype(s_src, s_dst, s_edge, s_att)
    # One tensor passed twice (GATv2's x_src is its value, the Transformer's edge
    # term its value's edge term): a view for each repeat, which torch.compile can trace as an autograd function's
    # input and whose gradient reaches the tensor.
    ins = [t.contiguous() if t is not None else None for t in distinct_inputs(list(tensors))]
    tp = _plan(plan)
    graph = _graph_tensors(tp, _split_rows(tp, value))
    args = (*ins, seed, kind, float(score.scale), float(score.negative_slope), float(p), need_alpha,
            alpha_dtype, share_v, share_ve)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ins):
        out, alpha, _ = _FusedAttention.apply(*args, *graph)
    else:  # nothing to differentiate: the operator alone (as the fused CPU kernel)
        out, alpha, _ = torch.ops.gatlib.triton_attention.default(*ins, seed, graph, *args[7:])
    return out, (alpha if need_alpha else None)


def _keep_mask(csr_eid: Tensor, heads: int, p: float, seed: Tensor) -> Tensor:
    E = csr_eid.numel()
    # empty, not zeros: the kernel writes every (edge, head) (csr_eid is a permutation),
    # and its 0/1 bytes are read as bools in place: one launch, not three
    keep = torch.empty(E, heads, dtype=torch.int8, device=csr_eid.device)
    if E:
        with _device(keep):
            wrap_triton(_keep_kernel)[(triton.cdiv(E * heads, 1024),)](csr_eid, E, keep, seed, float(p),
                                                                       heads, BLOCK_K=1024)
    return keep.view(torch.bool)


def dropout_keep_mask(plan: GraphPlan, heads: int, p: float, seed: Tensor) -> Tensor:
    """The ``[E, H]`` bool mask of kept attention weights that the fused kernels
    apply for ``seed`` (a ``[1]`` int64 tensor on the graph's device, as drawn
    for each call), in edge-list order — for tests and debugging."""
    return _keep_mask(_plan(plan).csr_eid, heads, p, seed)
