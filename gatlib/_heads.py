r"""Per-head products of the input-space layers (:func:`gatlib._conv._input_space`):
``out_h = a_h @ b_h`` for ``h = 1..H``, one BLAS product per head reading and writing each
head's columns in place (an einsum copies heads-first both ways). Where that cannot run
(tracing, ``torch.func``, autocast, mixed dtypes), :func:`per_head_mm_ops` writes the same in
differentiable ops, one ``mm`` per head (docs/design.md, "Per-head products").
"""
from __future__ import annotations

import torch
from torch import Tensor


def per_head_mm_reference(a: Tensor, b: Tensor) -> Tensor:
    """``a [N, H*K]``, ``b [H, K, M]`` -> ``[N, H*M]`` with ``out_h = a_h @ b_h``."""
    N, (H, K, M) = a.size(0), b.shape
    return torch.einsum("nhk,hkm->nhm", a.reshape(N, H, K), b).reshape(N, H * M)


def _per_head_mm_into(out: Tensor, a: Tensor, b: Tensor, heads: int) -> Tensor:
    """``out_h = a_h @ b[h]`` per head, ``a_h`` and ``out_h`` the ``h``-th column
    blocks of ``a`` and ``out``."""
    ka, mo = a.size(1) // heads, out.size(1) // heads
    for h in range(heads):
        torch.mm(a[:, h * ka:(h + 1) * ka], b[h], out=out[:, h * mo:(h + 1) * mo])
    return out


class _PerHeadMM(torch.autograd.Function):
    """:func:`per_head_mm_reference` by one product per head::

        forward:   out_h = a_h @ b_h
        backward:  da_h = g_h @ b_h^T,   db_h = a_h^T @ g_h

    A differentiable backward (``create_graph=True``) computes the same in einsums."""

    @staticmethod
    def forward(a: Tensor, b: Tensor) -> Tensor:
        H, K, M = b.shape
        return _per_head_mm_into(a.new_empty(a.size(0), H * M), a, b, H)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g: Tensor):
        a, b = ctx.saved_tensors
        H, K, M = b.shape
        need_a, need_b = ctx.needs_input_grad
        if torch.is_grad_enabled():  # the same formulas in differentiable ops
            N = a.size(0)
            da = per_head_mm_reference(g, b.transpose(1, 2)) if need_a else None
            db = (torch.einsum("nhk,nhm->hkm", a.reshape(N, H, K), g.reshape(N, H, M))
                  if need_b else None)
            return da, db
        da = db = None
        if need_a:
            da = _per_head_mm_into(a.new_empty(a.shape), g, b.transpose(1, 2), H)
        if need_b:
            db = b.new_empty(H, K, M)
            for h in range(H):
                torch.mm(a[:, h * K:(h + 1) * K].t(), g[:, h * M:(h + 1) * M], out=db[h])
        return da, db


def per_head_mm_ops(a: Tensor, b: Tensor) -> Tensor:
    """:func:`per_head_mm_reference` as one differentiable ``mm`` per head (its
    backward: one per head and input, as :class:`_PerHeadMM`'s)."""
    N, (H, K, _) = a.size(0), b.shape
    heads = zip(a.view(N, H, K).unbind(1), b.unbind(0), strict=True)
    return torch.cat([a_h @ b_h for a_h, b_h in heads], 1)


def per_head_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a [N, H*K]``, ``b [H, K, M]`` -> ``[N, H*M]``, ``out_h = a_h @ b_h``: one
    product per head in place (:class:`_PerHeadMM`), or in differentiable ops
    (:func:`per_head_mm_ops`) where that cannot run."""
    from ._dispatch import _transforms

    if (torch.compiler.is_compiling() or _transforms() or a.dtype != b.dtype
            or torch.is_autocast_enabled(a.device.type)):
        return per_head_mm_ops(a, b)
    return _PerHeadMM.apply(a, b)
