"""The kernels' internals that tools and tests read and that no user command needs (so they
are not in the wheel's :mod:`gatlib.introspect`): tools/ is developer-only, and this module
is the one place in it that imports gatlib's private modules (``tests/test_structure.py``).
Each name is looked up when used, so a test that patches a kernel module sees its patch here;
the Triton names import triton on first use.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

from gatlib import _dispatch

__all__ = ["TRITON_MAX_TILE", "TRITON_SPLIT",  # noqa: F822
           "draw_dropout_seed", "dropout_keep_mask", "triton_admits_cpu_tensors",
           "triton_attention", "triton_default_config", "triton_space", "triton_tuners"]

_TRITON_CONSTANTS = {
    "TRITON_SPLIT": ("_triton_schedule", "_SPLIT"),  # the longest run of edges of one work item
    "TRITON_MAX_TILE": ("_triton", "_MAX_TILE"),  # the most (padded) heads x channels per row
}


def __getattr__(name: str):
    if name in _TRITON_CONSTANTS:
        module, attr = _TRITON_CONSTANTS[name]
        return getattr(_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _module(name: str):
    return importlib.import_module(f"gatlib.{name}")


def triton_tuners() -> Dict[str, object]:
    """The row kernels' ``triton.autotune`` tuners by kernel name: their ``configs``, and
    their ``cache`` of the config chosen per key in this process."""
    return dict(_module("_triton_schedule")._TUNED)


def triton_default_config(name: str, consts: Dict):
    """The config row kernel ``name`` runs untuned at a call with constexprs ``consts``."""
    return _module("_triton_schedule")._default(name, consts)


def triton_space(name: str, consts: Dict):
    """Row kernel ``name``'s configs (its tuning space) at a call with constexprs ``consts``."""
    return _module("_triton_schedule")._space(name, consts)


def triton_attention(score, value: Tensor, plan, value_edge: Optional[Tensor], p: float,
                     need_alpha: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """The Triton kernels' fused attention called as the dispatcher calls it for
    ``backend="triton"`` (no ``supports`` check, no kernel log)."""
    return _module("_triton").attention(score, value, plan, value_edge, p, need_alpha)


def draw_dropout_seed(device: torch.device) -> Tensor:
    """A dropout seed as the Triton kernels draw one per call: ``[1]`` int64 on ``device``."""
    return _module("_triton")._draw_seed(device)


def dropout_keep_mask(plan, heads: int, p: float, seed: Tensor) -> Tensor:
    """The ``[E, H]`` bool mask the Triton kernels keep for ``seed`` (``[1]`` int64 on the
    graph's device), in edge-list order."""
    csr_eid = _module("_triton_schedule")._plan(plan).csr_eid
    return _module("_triton")._keep_mask(csr_eid, heads, p, seed)


@contextlib.contextmanager
def triton_admits_cpu_tensors() -> Iterator[None]:
    """Inside: the Triton backend takes CPU tensors without Triton's interpreter (the
    dispatcher's and the kernels' interpreter checks lifted). The kernels then take Triton's
    compiled launch path, which needs a stand-in GPU target and a ``jit_cache_hook`` that
    skips every compile and launch (``tools.launches.triton_on_cpu`` sets up both)."""
    from unittest import mock

    with mock.patch.object(_dispatch, "_interpreting", lambda: True), \
            mock.patch.object(_module("_triton"), "_check_interpreter", lambda: None):
        yield
