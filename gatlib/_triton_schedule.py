r"""The Triton kernels' work and tiling: a plan's schedules of work items (:func:`_plan`), the
row kernels' ``triton.autotune`` config spaces, and the launches (:mod:`gatlib._triton` has the
design; docs/gpu.md the tuning)."""
from __future__ import annotations

import functools
import itertools
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
from . import _triton_tuned as _tuned
from ._layout import Layout, _build_schedules, _Schedule
from ._plan import GraphPlan

# Longest run of edges one work item handles; longer rows are split and merged
# (docs/design.md, "Split rows").
_SPLIT = 256


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
    def build():
        lay = plan.layout()
        idt = lay.src.dtype
        return _Plan(lay, lay.perm.to(idt), lay.perm[lay.csc_edge.long()].to(idt),
                     *_build_schedules([lay.ptr, lay.csc_ptr], lay.num_edges, _SPLIT))

    return plan.derived(("triton.plan", _SPLIT), build)


def _interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return isinstance(K._fwd_kernel, InterpretedFunction)


# A config: lanes per program (BLOCK_R), edges per step (BLOCK_E), warps, programs per SM (PER_SM: one
# wave, under the register cap that lets them share an SM's 64K registers) and, where a call allows them,
# every head of an item in one lane (LANE_HEADS) and each block loading its successor's edge ranges
# (AHEAD). Pruned by _keep (docs/design.md, "Tiling by triton.autotune", "No spills at the users' shapes").
_LANES = (1, 2, 4, 8, 16)
_EDGES = (1, 2, 4, 16, 64)
_R_MAX = _LANES[-1]  # the parameters' partial rows are sized for it, whatever the config
_PER_SM_MAX = 4
_R_MAX_INTERPRETER = 1024
_PROGRAMS_INTERPRETER = 2  # the interpreter runs programs one after another: a few wide ones
_ROW_KERNELS = ("_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel")


def _all_configs(name: str) -> List[triton.Config]:
    """Every config of kernel ``name`` before :func:`_keep` prunes it for a call."""
    heads = ({},) if name == "_bwd_src_kernel" else ({"LANE_HEADS": False}, {"LANE_HEADS": True})
    return [triton.Config(dict(BLOCK_R=r, BLOCK_E=e, PER_SM=s, AHEAD=a, **lh), num_warps=w,
                          maxnreg=min(255, (1 << 16) // (s * 32 * w)))
            for r, e, w, s, lh, a in itertools.product(_LANES, _EDGES, (4, 8), (1, 2, _PER_SM_MAX),
                                                       heads, (False, True))]


def _fit(tile: int, per_lane: int, most: int) -> int:
    """Lanes of ``per_lane`` elements that fit ``tile``: the most, a power of two up to ``most``; 0 if none."""
    r = min(most, tile // per_lane)
    return 1 << (r.bit_length() - 1) if r else 0


def _width(name: str, kw: dict) -> int:
    """Channels a row kernel's tile holds per (lane, edge): the widest row it gathers per edge
    (the src backward's: the value's gradient if needed, the destination terms but GAT's
    scalar ones; all of them from projected rows, KIND 3)."""
    if name == "_bwd_src_kernel" and kw["KIND"] != 3:
        return max(kw["BLOCK_CV"] if kw["NEED_VALUE"] else 1, kw["BLOCK_CK"] if kw["KIND"] else 1)
    return max(kw["BLOCK_CK"], kw["BLOCK_CV"])


def _warps(width: int, acc) -> int:
    """Warps per program: 8 from 128 channels or in float64, which spilled at 4."""
    return 8 if width >= 128 or acc == tl.float64 else 4


def _lanes(name: str, edges: int, width: int, warps: int) -> int:
    """Lanes of a full tile: at most 8 elements of ``[BLOCK_R, BLOCK_E, width]`` per thread, 4
    from 256 channels where the tile holds the scorer's rows and the values' (more spilled)."""
    per_thread = 4 if name != "_bwd_src_kernel" and width >= 256 else 8
    return _fit(32 * warps * per_thread, edges * width, _R_MAX)


def _lane_heads(name: str, kw: dict) -> bool:
    """Whether a call may give a lane every head of an item (``LANE_HEADS``): a value of one head
    (``ONE_V``), no per-edge feature, GAT's node terms or the dot kind keyed by that value; in the
    dst backward no parameters' partials, nor the dot kind from 256 channels (spilled)."""
    if name == "_bwd_src_kernel" or kw["H"] == 1 or not kw["ONE_V"] or kw["HAS_EDGE"] or kw["HAS_VEDGE"]:
        return False
    if name == "_bwd_dst_kernel" and (kw["NEED_ATT"] or kw["NEED_BIAS"]
                                      or (kw["KIND"] == 2 and _width(name, kw) >= 256)):
        return False
    return kw["KIND"] == 0 or (kw["KIND"] == 2 and kw["ONE_K"] and kw["SHARE_V"])


def _heavy(name: str, kw: dict, lane_heads: bool) -> bool:
    """Calls that spilled under 64 registers at 256 channels: with dropout; with every head in
    a lane, GAT's; else the dst backward's with a per-edge feature or GAT's node terms."""
    if kw["DROPOUT"]:
        return True
    if lane_heads:
        return kw["KIND"] == 0
    return name == "_bwd_dst_kernel" and (kw["HAS_EDGE"] or kw["HAS_VEDGE"] or kw["KIND"] == 0)


def _keep(name: str, cfg: triton.Config, kw: dict) -> bool:
    """Whether ``cfg`` is in kernel ``name``'s space for a call with constexprs ``kw``: one full
    tile per edge count, without what ptxas spilled under (tests/test_triton_compile.py)."""
    c = cfg.kwargs
    width = _width(name, kw)
    warps = _warps(width, kw["ACC"])
    r, e, per_sm = c["BLOCK_R"], c["BLOCK_E"], c["PER_SM"]
    if cfg.num_warps != warps or r != _lanes(name, e, width, warps):
        return False
    if e < 4 and _lanes(name, 2 * e, width, warps):  # fewer than 4 only where 4 do not fit
        return False
    lane_heads = c.get("LANE_HEADS", False)
    if lane_heads and (not _lane_heads(name, kw) or e > 4):  # its [R, E, heads] tiles spilled at 16
        return False
    if kw["ACC"] == tl.float64 and cfg.maxnreg < 255:  # (float64 spilled under a cap)
        return False
    # Register caps: 4 warps uncapped, two per SM; 8 warps uncapped, at 128 (two per SM: not the
    # dst backward's, but with every head in a lane) or from 256 channels at 64 (four per SM:
    # the forward and the dst backward, but the heavy calls).
    if warps == 4 and per_sm != 2:
        return False
    dst_spills = name == "_bwd_dst_kernel" and (not lane_heads or _heavy(name, kw, lane_heads))
    if warps == 8 and per_sm == 2 and dst_spills:
        return False
    if per_sm == 4 and (name == "_bwd_src_kernel" or width < 256 or _heavy(name, kw, lane_heads)):
        return False
    # loading ahead: at wide rows under a cap, but not GATv2's src backward from 256 channels
    return not (c["AHEAD"] and (width < 128 or cfg.maxnreg == 255
                                or (name == "_bwd_src_kernel" and kw["KIND"] == 1 and width >= 256)))


def _space(name: str, kw: dict) -> List[triton.Config]:
    """Kernel ``name``'s configs for a call with constexprs ``kw``."""
    return [c for c in _CONFIGS[name] if _keep(name, c, kw)]


def _default(name: str, kw: dict) -> triton.Config:
    """The config run untuned: the most edges a step up to 4, two programs per SM where the
    space has them (else one), every head in one lane where allowed, no block loading ahead."""
    space = [c for c in _space(name, kw) if c.kwargs["BLOCK_E"] <= 4 and not c.kwargs["AHEAD"]
             and c.kwargs.get("LANE_HEADS", False) == _lane_heads(name, kw)]
    edges = max(c.kwargs["BLOCK_E"] for c in space)
    return min((c for c in space if c.kwargs["BLOCK_E"] == edges), key=lambda c: abs(c.kwargs["PER_SM"] - 2))


def _interpreter_config(name: str, kw: dict) -> triton.Config:
    """The interpreter's one config: few wide programs, long edge steps (it pays per program and
    per op, not per element: docs/design.md, "The interpreter's tiles")."""
    kw_cfg = dict(BLOCK_R=max(1, _fit(1 << 16, 64 * _width(name, kw), _R_MAX_INTERPRETER)),
                  BLOCK_E=64, PER_SM=1, AHEAD=False)
    if name != "_bwd_src_kernel":
        kw_cfg["LANE_HEADS"] = _lane_heads(name, kw)
    return triton.Config(kw_cfg, num_warps=4)


# "0": every row kernel runs its default config, untimed (read at each key's first launch).
_AUTOTUNE_ENV = "GATLIB_TRITON_AUTOTUNE"
# A config index every row kernel runs (modulo its space's size), bypassing the tuner: how
# the tests run every config in the interpreter (tests/test_triton_configs.py).
_PINNED: Optional[int] = None
_WARNED_CAPTURE: List[bool] = []


def _prune(name: str, configs, nargs, **kw) -> List[triton.Config]:
    """triton.autotune's ``early_config_prune`` at a key's first launch: the space to time, or
    the default alone where tuning is off or a CUDA graph is captured (timing syncs)."""
    if os.environ.get(_AUTOTUNE_ENV, "1") == "0":
        return [_default(name, kw)]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        if not _WARNED_CAPTURE:
            _WARNED_CAPTURE.append(True)
            warnings.warn("gatlib: a Triton kernel's first call is under CUDA graph capture, "
                          "where it cannot be timed: it keeps its default config in this "
                          "process (run one call before capturing to tune it)", stacklevel=2)
        return [_default(name, kw)]
    return _space(name, kw)


# The tuning key: what a layer fixes (Triton adds the dtypes) and the degree bucket (DEG), never a
# graph's size, so that new graphs and mini-batches reuse a tuned config.
_KEYS = {
    "_fwd_kernel": ["H", "CK", "CV", "KIND", "HAS_DST", "HAS_EDGE", "HAS_VEDGE", "HAS_BIAS", "SHARE_V", "SHARE_VE",
                    "ONE_K", "ONE_V", "DROPOUT", "DEG"],
    "_bwd_dst_kernel": ["H", "CK", "CV", "KIND", "HAS_DST", "HAS_EDGE", "HAS_VEDGE", "SHARE_V", "SHARE_VE", "ONE_K",
                        "ONE_V", "DROPOUT", "GALPHA", "NEED_VEDGE", "NEED_EDGE", "NEED_DST", "NEED_ATT", "NEED_BIAS",
                        "DEG"],
    "_bwd_src_kernel": ["H", "CK", "CV", "KIND", "HAS_EDGE", "NEED_VALUE", "NEED_SRC", "SUM_SRC", "NEED_ATT", "DEG"],
}
_CONFIGS = {name: _all_configs(name) for name in _ROW_KERNELS}
# Every launch goes through these (pinned, interpreted: .fn); Triton caches timings on disk per device.
_TUNED = {name: triton.autotune(_CONFIGS[name], key=_KEYS[name], cache_results=True, prune_configs_by=dict(
    early_config_prune=functools.partial(_prune, name)))(getattr(K, name)) for name in _ROW_KERNELS}


def _stages(consts: dict) -> int:
    """Edge loops' pipelining stages: 2, 1 with a per-edge feature (docs/design.md, "Pipelined edge loops")."""
    return 1 if consts.get("HAS_EDGE") or consts.get("HAS_VEDGE") else 2


def _slot_sums(width: int) -> bool:
    """Whether the backward kernels keep their sums per edge slot of the tile (``SLOTS``): from
    256 channels (docs/design.md, "Per-slot sums in the backward")."""
    return width >= 256


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, H: int, per_sm: int) -> int:
    """Programs per launch, looping over the blocks of lanes: ``per_sm`` per SM, fixed by the
    device and the config, never by the graph; a multiple of ``H`` (at least ``H``), so that
    each lane of a program keeps one head (the parameters' partials)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        n = _sm_count(index) * per_sm
    else:
        n = _PROGRAMS_INTERPRETER
    return H * max(1, n // H)


def _partial_rows(device: torch.device, H: int) -> int:
    """Rows of a backward launch's parameter-partials buffer: one per lane of the most programs
    any config runs (``_store_partials`` zeroes the rows a launch leaves)."""
    return _programs(device, H, _PER_SM_MAX) * (_R_MAX_INTERPRETER if _interpreted() else _R_MAX)


def _launch(name: str, items: _Schedule, *args, **consts) -> None:
    """Launch row kernel ``name`` over the work items of ``items`` in :func:`_programs`
    programs, at the config the tuner chose for the call's key, the :data:`_PINNED` one or, in
    the interpreter, :func:`_interpreter_config`."""
    H = consts["H"]
    consts["STAGES"] = _stages(consts)
    if name != "_bwd_src_kernel":
        consts["HP"] = triton.next_power_of_2(H)
    args = (items.items, items.bounds, *args)

    def grid(meta):
        return (_programs(items.bounds.device, H, meta["PER_SM"]),)

    if _PINNED is not None:
        space = _space(name, consts)
        cfg = space[_PINNED % len(space)]
    elif _interpreted():
        cfg = _interpreter_config(name, consts)
    else:  # (a GPU's shipped configs go into the tuners first: _triton_tuned)
        _tuned.preload(_tuned.device_name(items.bounds.device), _TUNED, _CONFIGS, _AUTOTUNE_ENV)
        _TUNED[name][grid](*args, **consts)
        return
    _TUNED[name].fn[grid](*args, **consts, **cfg.all_kwargs())


def _merge(out: Tensor, part: Tensor, items: _Schedule, H: int, lse: Optional[Tensor] = None,
           part_lse: Optional[Tensor] = None, bias: Optional[Tensor] = None, out_b: Optional[Tensor] = None) -> None:
    """Combine the pieces of split rows into their rows, one launch: plain sums, or with
    ``lse`` the pieces' softmax results by log-sum-exp (and ``out_b = out + bias`` for a
    ``bias`` ``[H * C]``); lanes fill a tile of 1,024 elements (the interpreter's: 64K)."""
    if not items.max_split:  # no row can be split on a graph this small
        return
    C = out.size(2) if out.dim() == 3 else 1
    block_c = triton.next_power_of_2(C)
    tile, most = ((1 << 16), 1024) if _interpreted() else (1024, _R_MAX)
    softmax = lse is not None
    K._merge_kernel[(_programs(out.device, H, _PER_SM_MAX),)](
        items.bounds, items.split_row, items.split_first, items.split_count, part, part_lse if softmax else part,
        out, lse if softmax else out, bias if bias is not None else out, out_b if out_b is not None else out, H, C,
        SOFTMAX=softmax, HAS_BIAS=bias is not None, ACC=_tl_acc(part.dtype),
        BLOCK_R=max(1, _fit(tile, block_c, most)), BLOCK_C=block_c)


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32
