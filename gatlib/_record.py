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
from typing import Callable, Iterator, List, Optional

import torch

_LOG: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("gatlib_kernel_log",
                                                                      default=None)
# every open block's log, innermost last: for threads that opened none (see above)
_OPEN: List[list] = []
_OPEN_LOCK = threading.Lock()


class KernelLog(list):
    """The kernels' names in the order they ran, and in :attr:`decisions` how each call's
    kernel was chosen."""

    def __init__(self):
        super().__init__()
        #: one :class:`gatlib._dispatch.Dispatch` per attention call: ``backend``, ``kernel``,
        #: the ``rule`` ``"auto"`` applied and the reasons of every kernel it ``refused``
        self.decisions: list = []


@contextlib.contextmanager
def record_kernels() -> Iterator[KernelLog]:
    """Record which kernel ran each attention call in this block: yields a list of the
    kernels' names in order (``"torch"``, ``"scatter"``, ``"fused"``, ``"triton"``), the fused
    backward passes' (``"fused.backward"``, ``"fused.backward:reference"``) and ``"propagate"``
    where a layer hands a call to PyG; its ``decisions`` say why each call's kernel was chosen
    (the rule of ``backend="auto"`` and every reason of each kernel it passed over). Under
    ``torch.compile`` it lists the fused operators' calls, and nothing for the reference, which
    is compiled into the graph.
    """
    log = KernelLog()
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


def _active() -> Optional[KernelLog]:
    """The :func:`record_kernels` log this thread records into, if any (none while
    ``torch.compile`` traces: nothing runs then)."""
    if torch.compiler.is_compiling():
        return None
    active = _LOG.get()
    if active is None:
        with _OPEN_LOCK:
            active = _OPEN[-1] if _OPEN else None
    return active


def log(entry: str) -> None:
    """Append ``entry`` to the active :func:`record_kernels` list, if any."""
    if not _OPEN:  # no block open anywhere: the usual call
        return
    active = _active()
    if active is not None:
        active.append(entry)


def decide(make: Callable[[], object]) -> None:
    """Append ``make()`` (a dispatch decision) to the active log's ``decisions``, if any:
    built only where someone records."""
    if not _OPEN:
        return
    active = _active()
    if active is not None:
        active.decisions.append(make())
