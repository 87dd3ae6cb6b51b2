"""The one backend switch.

A backend implements :meth:`_Backend.attention`: the three stages of
:mod:`gatlib._core` for one layer call. The unfused backends share the
scoring stage (plain PyTorch) and differ in the softmax/aggregation
primitives; a fused backend overrides ``attention`` whole and may decline a
scorer it does not support by returning ``None`` — then the call falls back
to the reference. Layers never see any of this: they pass ``backend=`` names.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _core

BACKENDS = ("auto", "torch", "scatter", "fused", "triton")


class _Backend:
    name = "torch"

    @staticmethod
    def available(device: torch.device) -> Optional[str]:
        """``None`` when usable on ``device``, else the reason it is not."""
        return None

    softmax = staticmethod(_core.segment_softmax)
    aggregate = staticmethod(_core.segment_aggregate)

    def attention(
        self,
        score: _core.Scorer,
        value: Tensor,
        edge_index: Tensor,
        num_dst: int,
        *,
        value_edge: Optional[Tensor],
        dropout: float,
        training: bool,
        need_alpha: bool,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        src, index = edge_index[0], edge_index[1]
        e = score.edge_scores(src, index)  # [E, H]         stage 1
        alpha = self.softmax(e, index, num_dst)  # [E, H]   stage 2
        a = F.dropout(alpha, p=dropout, training=training) if dropout > 0 else alpha
        out = self.aggregate(a, value, src, index, num_dst, value_edge)  # [N, H, C]  stage 3
        return out, (alpha if need_alpha else None)


class _ScatterBackend(_Backend):
    """Stages 2 and 3 with torch_scatter's fused scatter kernels."""

    name = "scatter"

    @staticmethod
    def available(device: torch.device) -> Optional[str]:
        if importlib.util.find_spec("torch_scatter") is None:
            return "torch_scatter is not installed (pip install 'gatlib[scatter]')"
        return None

    @staticmethod
    def softmax(score: Tensor, index: Tensor, num_segments: int) -> Tensor:
        from torch_scatter import scatter

        dtype = score.dtype
        s = score.to(_core._acc_dtype(dtype))
        seg_max = scatter(s.detach(), index, 0, dim_size=num_segments, reduce="max")
        ex = (s - seg_max.index_select(0, index)).exp()
        denom = scatter(ex, index, 0, dim_size=num_segments, reduce="sum")
        return (ex / denom.index_select(0, index)).to(dtype)

    @staticmethod
    def aggregate(alpha, value, src, index, num_segments, value_edge=None):
        from torch_scatter import scatter

        acc = _core._acc_dtype(value.dtype)
        msg = value.index_select(0, src).to(acc)
        if value_edge is not None:
            msg = msg + value_edge.to(acc)
        msg = msg * alpha.to(acc).unsqueeze(-1)
        return scatter(msg, index, 0, dim_size=num_segments, reduce="sum").to(value.dtype)


class _FusedCPUBackend(_Backend):
    """Fused CSR attention in plain PyTorch ops for CPU tensors (gatlib._fused_cpu)."""

    name = "fused"

    @staticmethod
    def available(device: torch.device) -> Optional[str]:
        if device.type != "cpu":
            return "the fused CPU path runs on CPU tensors; on CUDA 'fused' uses Triton"
        return None

    def attention(self, score, value, edge_index, num_dst, **kw):
        from . import _fused_cpu

        res = _fused_cpu.attention(score, value, edge_index, num_dst, **kw)
        return super().attention(score, value, edge_index, num_dst, **kw) if res is None else res


class _TritonBackend(_Backend):
    """Fused Triton kernels (gatlib._triton): CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1`` (how CI tests the kernels)."""

    name = "triton"

    @staticmethod
    def available(device: torch.device) -> Optional[str]:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'gatlib[triton]')"
        if device.type == "cuda" or (device.type == "cpu" and _interpreting()):
            return None
        return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU); got {device}"

    def attention(self, score, value, edge_index, num_dst, **kw):
        from . import _triton

        res = _triton.attention(score, value, edge_index, num_dst, **kw)
        return super().attention(score, value, edge_index, num_dst, **kw) if res is None else res


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_IMPLS: Dict[str, _Backend] = {
    "torch": _Backend(),
    "scatter": _ScatterBackend(),
    "fused": _FusedCPUBackend(),
    "triton": _TritonBackend(),
}


def check_backend_name(backend: str) -> str:
    """Validate a ``backend=`` argument at construction time."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {BACKENDS}; got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend in ("scatter", "triton"):
        name = {"scatter": "torch_scatter", "triton": "triton"}[backend]
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"backend={backend!r} is not available: {name} is not installed "
                             f"(pip install 'gatlib[{backend}]')")
    return backend


def available_backends(device: torch.device | str = "cpu") -> Tuple[str, ...]:
    """Names of the backends that can run on ``device`` (``"torch"`` always can)."""
    device = torch.device(device)
    return tuple(n for n, b in _IMPLS.items() if b.available(device) is None)


def resolve_backend(backend: str, device: torch.device) -> _Backend:
    """Turn a backend name into an implementation, for tensors on ``device``.

    Selection rules for ``"auto"`` (measurements in benchmarks/NOTES.md):
      * CPU: ``"fused"``. On the 2-core CPU it ran GATConv/GATv2Conv/
        TransformerConv forward+backward faster than the reference on Cora and
        on the arxiv-like graph, with a fraction of the memory; dtypes it does
        not handle fall back to the reference inside the backend.
      * CUDA: ``"torch"``, the reference. The Triton kernels have only run under
        ``TRITON_INTERPRET=1``; until they are measured on a GPU, they are
        opt-in (``backend="fused"`` or ``"triton"``).
    An explicitly named backend that cannot run raises ``ValueError``.
    """
    check_backend_name(backend)
    if backend == "auto":
        return _IMPLS["fused" if device.type == "cpu" else "torch"]
    if backend == "fused" and device.type == "cuda":
        backend = "triton"  # one name for "never build [E, H, C]", whatever the device
    impl = _IMPLS[backend]
    reason = impl.available(device)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run on {device}: {reason}")
    return impl
