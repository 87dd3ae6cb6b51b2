"""Which kernel ran: the log behind :func:`gatlib.record_kernels`. Kernels log from inside
their own code (the fused ones from their operators), so an entry means that code ran.

A block's log is the opening thread's (a context variable), and also that of threads that
opened none: on CUDA, autograd runs backward passes on a thread of its own, where the
caller's context variable is not set; those threads log into the most recently opened block.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Iterator, List, Optional

import torch

_LOG: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("gatlib_kernel_log",
                                                                      default=None)
# every open block's log, innermost last: for threads that opened none (see above)
_OPEN: List[list] = []
_OPEN_LOCK = threading.Lock()


@contextlib.contextmanager
def record_kernels() -> Iterator[List[str]]:
    """Record which kernel ran each attention call in this block: yields a list of the
    kernels' names in order (``"torch"``, ``"scatter"``, ``"fused"``, ``"triton"``), the fused
    backward passes' (``"fused.backward"``, ``"fused.backward:reference"``) and ``"propagate"``
    where a layer hands a call to PyG. Under ``torch.compile`` it lists the fused operators'
    calls, and nothing for the reference, which is compiled into the graph.
    """
    log: List[str] = []
    token = _LOG.set(log)
    with _OPEN_LOCK:
        _OPEN.append(log)
    try:
        yield log
    finally:
        _LOG.reset(token)
        with _OPEN_LOCK:
            # (by identity: two blocks' logs can be equal lists)
            del _OPEN[next(i for i in reversed(range(len(_OPEN))) if _OPEN[i] is log)]


def log(entry: str) -> None:
    """Append ``entry`` to the active :func:`record_kernels` list, if any (not
    while ``torch.compile`` traces: nothing runs then)."""
    if torch.compiler.is_compiling():
        return
    active = _LOG.get()
    if active is None:
        with _OPEN_LOCK:
            active = _OPEN[-1] if _OPEN else None
    if active is not None:
        active.append(entry)
