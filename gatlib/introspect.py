"""What ``gatlib selftest`` and the tests read of gatlib's kernels: not a user API.

The kernels' Triton jit functions, their per-graph schedule and the dispatcher's kernel objects,
under public names, so that the harness never reaches into the private modules
(``tests/test_structure.py``); what only tools and tests read is ``tools/internals.py``. Each
name is looked up when called, so a test that patches a kernel module sees its patch here. Not
re-exported from :mod:`gatlib` and covered by no compatibility promise. Importing this module
needs no Triton; the ``triton_*`` functions do.
"""
from __future__ import annotations

import importlib
import contextlib
from typing import TYPE_CHECKING, Dict, Iterator

from . import _dispatch

if TYPE_CHECKING:  # (annotations only: importing this module must not import triton)
    from ._plan import GraphPlan

__all__ = ["check_triton_interpreter", "kernel", "triton_config", "triton_kernels", "triton_schedule"]


def _triton_module(name: str):
    """One of the Triton kernels' modules (imports triton)."""
    return importlib.import_module(f"gatlib.{name}")


def kernel(name: str) -> "_dispatch.Kernel":
    """The dispatcher's kernel object for the ``backend=`` name ``name``: its
    ``available(device)`` and ``supports(call)`` give the reason it cannot run."""
    return _dispatch.KERNELS[name]


def triton_kernels() -> Dict[str, object]:
    """Every launched Triton kernel (``@triton.jit`` function named ``*_kernel``) by the name
    Triton reports for it: the jit functions themselves, or the interpreter's under
    ``TRITON_INTERPRET=1``."""
    from triton.runtime import JITFunction
    from triton.runtime.interpreter import InterpretedFunction

    return {name: fn for name, fn in vars(_triton_module("_triton_kernels")).items()
            if name.endswith("_kernel") and isinstance(fn, (JITFunction, InterpretedFunction))}


def triton_schedule(plan: "GraphPlan") -> object:
    """The Triton kernels' view of ``plan`` (layout, edge permutations, work schedules),
    built on first use and kept on the plan: call it to build it before counting or timing."""
    return _triton_module("_triton_schedule")._plan(plan)


def check_triton_interpreter() -> None:
    """Raise ``RuntimeError`` (with what to do) unless the Triton kernels can take CPU
    tensors in this process: ``TRITON_INTERPRET=1`` set before triton was first imported."""
    _triton_module("_triton")._check_interpreter()


@contextlib.contextmanager
def triton_config(index: int) -> Iterator[None]:
    """Inside: every row kernel launches config ``index`` of its space (modulo the space's size)
    instead of the tuner's choice (the self-test's check that no config changes a result)."""
    schedule = _triton_module("_triton_schedule")
    previous = schedule._PINNED
    schedule._PINNED = index
    try:
        yield
    finally:
        schedule._PINNED = previous
