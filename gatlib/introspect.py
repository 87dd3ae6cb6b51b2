"""What tools and tests that inspect gatlib's kernels may read: not a user API.

The benchmark harness (:mod:`gatlib.bench`: the compile table of
``tools.triton_compile``, the launch counts of ``tools.launches``,
``gatlib selftest``) and the tests look at the kernels themselves — their
Triton jit functions, constants, the per-graph schedule, the dispatcher's
kernel objects. They read them here, under public names, and never through the
private modules (``tests/test_structure.py`` holds the harness, ``tools/`` and
``benchmarks/`` to that). Each name is a thin alias over the kernels' own
object, looked up when called, so a test that patches a kernel module sees its
patch here.

Not re-exported from :mod:`gatlib`, and not covered by any compatibility
promise: the names follow the kernels and change with them. Importing this
module needs no Triton; the ``triton_*`` functions and constants do
(they import the kernels on first use).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Tuple

import torch

from . import _dispatch

if TYPE_CHECKING:  # (annotations only: importing this module must not import triton)
    from torch import Tensor

    from ._core import EdgeScore
    from ._plan import GraphPlan

__all__ = [
    "TRITON_MAX_CHANNELS",  # noqa: F822  (resolved on first read: __getattr__)
    "TRITON_SPLIT",  # noqa: F822
    "check_triton_interpreter",
    "draw_dropout_seed",
    "dropout_keep_mask",
    "kernel",
    "triton_admits_cpu_tensors",
    "triton_attention",
    "triton_blocks",
    "triton_kernels",
    "triton_schedule",
    "triton_tiles",
]

# Public name -> the Triton module's constant (resolved on first read, below).
_TRITON_CONSTANTS = {
    # longest run of edges one work item handles; longer rows are split
    "TRITON_SPLIT": ("_triton_schedule", "_SPLIT"),
    "TRITON_MAX_CHANNELS": ("_triton", "_MAX_C"),  # most channels per head the kernels take
}


def __getattr__(name: str):
    if name in _TRITON_CONSTANTS:
        module, attr = _TRITON_CONSTANTS[name]
        return getattr(_triton_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_TRITON_CONSTANTS))


def _kernels():
    """The Triton kernels' entry module (imports triton)."""
    return _triton_module("_triton")


def _triton_module(name: str):
    """One of the Triton kernels' modules (``_triton``, ``_triton_kernels``,
    ``_triton_schedule``; imports triton)."""
    import importlib

    return importlib.import_module(f"gatlib.{name}")


def kernel(name: str) -> "_dispatch.Kernel":
    """The dispatcher's kernel object for the ``backend=`` name ``name``
    (``"torch"``, ``"scatter"``, ``"fused"``, ``"triton"``): its
    ``available(device)`` and ``supports(call)`` give the reason it cannot run."""
    return _dispatch.KERNELS[name]


def triton_kernels() -> Dict[str, object]:
    """Every launched Triton kernel (``@triton.jit`` function whose name ends in
    ``_kernel``) by the name Triton reports for it (``fn.name``, e.g.
    ``"_fwd_kernel"``): the jit functions themselves (their ``arg_names``, their
    per-device compile caches), or the interpreter's under ``TRITON_INTERPRET=1``."""
    from triton.runtime import JITFunction
    from triton.runtime.interpreter import InterpretedFunction

    return {name: fn for name, fn in vars(_triton_module("_triton_kernels")).items()
            if name.endswith("_kernel") and isinstance(fn, (JITFunction, InterpretedFunction))}


def triton_attention(score: "EdgeScore", value: "Tensor", plan: "GraphPlan",
                     value_edge: Optional["Tensor"], p: float, need_alpha: bool,
                     bias: Optional["Tensor"] = None) -> Tuple["Tensor", Optional["Tensor"]]:
    """The Triton kernels' fused attention called directly, as the dispatcher
    calls it for ``backend="triton"`` (no ``supports`` check, no kernel log):
    ``(out [N_dst, H, C], alpha [E, H] or None)``, ``bias`` ``[H * C]`` added to
    every row of ``out`` if given."""
    return _kernels().attention(score, value, plan, value_edge, p, need_alpha, bias)


def triton_schedule(plan: "GraphPlan") -> object:
    """The Triton kernels' view of ``plan`` (layout, edge permutations, the
    destination and source work schedules), built on first use and kept on the
    plan: call it to build it before something is counted or timed."""
    return _triton_module("_triton_schedule")._plan(plan)


@contextlib.contextmanager
def triton_tiles(tile: Optional[int] = None, programs_per_sm: Optional[int] = None,
                 stages: Optional[int] = None, resident: Optional[int] = None,
                 edges_wide: Optional[int] = None,
                 edges_narrow: Optional[int] = None,
                 edges_node_terms: Optional[int] = None,
                 edges_src: Optional[int] = None,
                 lane_heads: Optional[int] = None,
                 items_ahead: Optional[int] = None) -> Iterator[Dict[str, Optional[int]]]:
    """Inside: the compiled row kernels' edge tile (elements of the ``[R, E, C]``
    tile a program holds per step, at every width; the library's own is larger at
    wide rows), programs per SM (the library's ``None``: as many as a launch's binary
    fits there, at most 4), the software-pipelining stages of their edge
    loops (1: not pipelined) and the programs their register cap lets share an SM
    (``resident``, every row kernel alike) and the most edges per step of the forward's
    and the dst backward's tiles at rows of 128 up to 256 channels (``edges_wide``: the
    rest of the tile is lanes), below 128 (``edges_narrow``), and below 128 for GAT
    from given node terms (``edges_node_terms``; the library's is ``None``, the
    tile's edges), and of the src backward's tile from 8 up to 256 channels
    (``edges_src``), and whether the forward and the dst backward at values of one head
    take every head of an item in one lane (``lane_heads``: 1, the library's, or 0: a
    lane per item and head), and whether the row kernels' blocks load their successor's
    edge ranges at rows of 128 channels or more under a register cap (``items_ahead``: 1,
    the library's, or 0: each block its own) set to these (``None``: as they are), for schedule sweeps
    (``tools.triton_sweep``). Yields the values in force:
    ``tile``, ``tile_wide`` (the src backward's at rows of ``wide`` channels or more,
    and the others' below 256), ``tile_wide_fwd`` (the forward's and the dst
    backward's at rows of 256 channels or more), ``wide``, ``programs_per_sm``,
    ``stages``, ``resident`` (the src backward's), ``resident_heavy`` (the dst
    backward's below 256 channels), ``resident_fwd`` (the forward's and the dst
    backward's at 256 and more), ``edges_wide``, ``edges_narrow``, ``edges_node_terms``,
    ``edges_src``, ``lane_heads``, ``items_ahead``.
    A plan's schedule does not depend on them; the kernels' constexprs and register
    caps do (new values compile new specialisations)."""
    from unittest import mock

    m = _triton_module("_triton_schedule")
    patches = {}
    if tile is not None:
        patches.update(_TILE=tile, _TILE_WIDE=tile, _TILE_WIDE_FWD=tile)
    if programs_per_sm is not None:
        patches["_PROGRAMS_PER_SM"] = programs_per_sm
    if stages is not None:
        if stages < 1:
            raise ValueError(f"triton_tiles: stages must be >= 1, got {stages}")
        patches["_STAGES"] = stages
    if resident is not None:
        if not 1 <= resident <= 8:
            raise ValueError(f"triton_tiles: resident must be in [1, 8], got {resident}")
        patches.update(_RESIDENT=resident, _RESIDENT_HEAVY=resident, _RESIDENT_FWD=resident)
    for name, edges in (("edges_wide", edges_wide), ("edges_narrow", edges_narrow),
                        ("edges_node_terms", edges_node_terms), ("edges_src", edges_src)):
        if edges is not None:
            if edges < 1 or edges & (edges - 1):
                raise ValueError(f"triton_tiles: {name} must be a power of two, got {edges}")
            patches["_" + name.upper()] = edges
    if lane_heads is not None:
        if lane_heads not in (0, 1):
            raise ValueError(f"triton_tiles: lane_heads must be 0 or 1, got {lane_heads}")
        patches["_HEADS_IN_LANE"] = bool(lane_heads)
    if items_ahead is not None:
        if items_ahead not in (0, 1):
            raise ValueError(f"triton_tiles: items_ahead must be 0 or 1, got {items_ahead}")
        patches["_ITEMS_AHEAD"] = bool(items_ahead)
    with mock.patch.multiple(m, **patches) if patches else contextlib.nullcontext():
        yield {"tile": m._TILE, "tile_wide": m._TILE_WIDE, "tile_wide_fwd": m._TILE_WIDE_FWD,
               "wide": m._WIDE, "programs_per_sm": m._PROGRAMS_PER_SM, "stages": m._STAGES,
               "resident": m._RESIDENT, "resident_heavy": m._RESIDENT_HEAVY,
               "resident_fwd": m._RESIDENT_FWD, "edges_wide": m._EDGES_WIDE,
               "edges_narrow": m._EDGES_NARROW, "edges_node_terms": m._EDGES_NODE_TERMS,
               "edges_src": m._EDGES_SRC, "lane_heads": int(m._HEADS_IN_LANE),
               "items_ahead": int(m._ITEMS_AHEAD)}


def check_triton_interpreter() -> None:
    """Raise ``RuntimeError`` (with what to do) unless the Triton kernels can
    take CPU tensors in this process: ``TRITON_INTERPRET=1`` set before triton
    was first imported."""
    _kernels()._check_interpreter()


def draw_dropout_seed(device: torch.device) -> "Tensor":
    """A dropout seed as the Triton kernels draw one for each call: a ``[1]``
    int64 tensor on ``device``, drawn there by its default generator."""
    return _kernels()._draw_seed(device)


def dropout_keep_mask(plan: "GraphPlan", heads: int, p: float, seed: "Tensor") -> "Tensor":
    """The ``[E, H]`` bool mask of the attention weights that the Triton kernels
    keep for ``seed``, in edge-list order."""
    return _kernels().dropout_keep_mask(plan, heads, p, seed)


def triton_blocks(plan: "GraphPlan", heads: int, width: int, kernel: str = "_fwd_kernel",
                  kind: Optional[int] = None,
                  one_value: bool = False) -> List[Dict[str, object]]:
    """The blocks of lanes that one launch of the row ``kernel`` (``"_fwd_kernel"``,
    ``"_bwd_dst_kernel"``, ``"_bwd_src_kernel"``) runs on ``plan`` at ``heads`` and rows
    of ``width`` channels (a power of two), under the tiles in force (the compiled
    kernels' outside Triton's interpreter; :func:`triton_tiles`): per group of buckets,
    in launch order, ``edges`` per step, ``lanes`` per program, ``steps`` (an int64
    tensor: the edge-loop trips of each block, its longest item over ``edges``), and
    ``resident``, the programs of the kernel's register cap (a plain float32 call's)
    that share an SM. Lanes are ``(item, head)`` pairs, heads side by side, as the
    kernels number them; score ``kind`` as the kernels' ``KIND``. With ``one_value`` the
    call's value has one head that every head shares (a layer in input space; the dot
    kind's key is that value): where the library then gives a lane every head of its
    item (the forward and the dst backward, ``triton_tiles(lane_heads=)``), lanes are
    items. ``ahead``: whether each block loads its successor's edge ranges while it runs
    (rows of 128 channels or more under a register cap, ``triton_tiles(items_ahead=)``)."""
    m = _triton_module("_triton_schedule")
    fn = triton_kernels()[kernel]
    items = m._plan(plan).src_items if kernel == "_bwd_src_kernel" else m._plan(plan).dst_items
    forward = m._fwd_schedule(fn, kind)
    length = items.length.long().clamp(min=0).cpu()
    bounds = items.bounds.tolist()
    warps = m._warps(width, m._tl_acc(torch.float32))
    hp = 0
    if one_value and kernel != "_bwd_src_kernel":
        hp = m._lane_heads(kind, heads, kind == 2, True, kind == 2, False, width,
                           dst_backward=kernel == "_bwd_dst_kernel")
    regs = m._max_registers(warps, fn, width, m._heavy({"KIND": kind, "HP": hp}, fn), kind,
                            bool(hp))
    resident = (1 << 16) // (regs * 32 * warps)
    ahead = m._items_ahead(width, regs, fn, kind)
    out = []
    for lo, hi, edges in m._bucket_groups(width, forward, kind):
        lanes = m._rows_per_program(edges, width, forward)
        lane_len = length[bounds[lo]:bounds[hi]].repeat_interleave(1 if hp else heads)
        blocks = -(-lane_len.numel() // lanes)
        padded = torch.zeros(blocks * lanes, dtype=torch.int64)
        padded[:lane_len.numel()] = lane_len
        steps = (padded.view(blocks, lanes).amax(1) + edges - 1) // edges
        out.append({"edges": edges, "lanes": lanes, "steps": steps, "resident": resident,
                    "ahead": ahead})
    return out


@contextlib.contextmanager
def triton_admits_cpu_tensors() -> Iterator[None]:
    """Inside: the Triton backend takes CPU tensors without Triton's interpreter.

    The dispatcher's Triton kernel admits CPU tensors only under
    ``TRITON_INTERPRET=1``, and the kernels' wrapper refuses them unless their
    jit functions were built for the interpreter; both checks are lifted for
    the block. The kernels then go through Triton's compiled launch path: that
    needs a current (stand-in) GPU target and a ``jit_cache_hook`` that skips
    every compile and launch — the caller's to set up
    (``tools.launches.triton_on_cpu`` does both)."""
    from unittest import mock

    with mock.patch.object(_dispatch, "_interpreting", lambda: True), \
            mock.patch.object(_kernels(), "_check_interpreter", lambda: None):
        yield


@contextlib.contextmanager
def compiled_gat_terms_in_kernel() -> Iterator[None]:
    """Inside: compiled GAT calls form their attention terms ``a·Wh`` in the Triton
    kernels where eager calls do (``EdgeScore.gat_projected``), instead of the node
    terms compiled calls take outside it (on an H100 such a compiled step went wrong:
    docs/compile.md). A diagnosis (``tools.profile_step
    --projected-under-compile``); calls compiled inside keep what they traced."""
    from unittest import mock

    with mock.patch.object(_dispatch, "_PROJECTED_UNDER_COMPILE", True):
        yield
