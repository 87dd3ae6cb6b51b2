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
from typing import TYPE_CHECKING, Dict, Iterator, Optional, Tuple

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
    "triton_kernels",
    "triton_schedule",
    "triton_tuners",
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


def triton_tuners() -> Dict[str, object]:
    """The row kernels' ``triton.autotune`` tuners by kernel name (``"_fwd_kernel"``, ...):
    their ``configs``, and their ``cache`` of the config chosen per key in this process."""
    return dict(_triton_module("_triton_schedule")._TUNED)


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
