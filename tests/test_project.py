"""gatlib._conv.project: several Linear layers of one input as one batched product,
exact against calling each layer, and each layer called as itself wherever a
call is more than ``F.linear`` (hooks, lazy weights, another module)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch_geometric.nn.dense.linear import Linear

from gatlib import TransformerConv
from gatlib._conv import project


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _lins(n, bias=True, out=6, inp=5):
    torch.manual_seed(0)
    return [Linear(inp, out, bias=bias).double() for _ in range(n)]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (2, 3, 5), (0, 5)])
def test_one_product_equals_each_layer(bias, shape):
    lins = _lins(3, bias)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    with _Ops() as rec:
        ys = project(x, *lins)
    assert sum(op in ("aten.bmm", "aten.baddbmm") for op in rec.ops) == 1, rec.ops
    assert not any(op in ("aten.addmm", "aten.mm", "aten.linear") for op in rec.ops), rec.ops
    refs = [lin(x) for lin in lins]
    gs = [torch.randn_like(r) for r in refs]
    params = [p for lin in lins for p in lin.parameters()]
    got = torch.autograd.grad(ys, [x, *params], gs)
    want = torch.autograd.grad(refs, [x, *params], gs)
    for y, r in zip(ys, refs, strict=True):
        assert y.shape == r.shape and y.is_contiguous()
        torch.testing.assert_close(y, r, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _separate(x, lins):
    with _Ops() as rec:
        ys = project(x, *lins)
    return ys, sum(op in ("aten.bmm", "aten.baddbmm") for op in rec.ops)


def test_a_hooked_layer_is_called_as_itself():
    lins = _lins(3)
    seen = []
    lins[1].register_forward_hook(lambda m, i, o: seen.append(o) or o * 2)
    x = torch.randn(4, 5, dtype=torch.float64)
    ys, batched = _separate(x, lins)
    assert batched == 0 and len(seen) == 1
    torch.testing.assert_close(ys[1], 2 * seen[0])


def test_global_hooks_lazy_and_other_modules_are_called_as_themselves():
    x = torch.randn(4, 5, dtype=torch.float64)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        assert _separate(x, _lins(2))[1] == 0
    finally:
        handle.remove()
    lazy = [Linear(-1, 6).double(), Linear(-1, 6).double()]
    ys, batched = _separate(x, lazy)  # the first call initialises them
    assert batched == 0 and ys[0].shape == (4, 6)
    assert _separate(x, lazy)[1] == 1  # initialised now
    other = torch.nn.Linear(5, 6).double()
    assert _separate(x, [_lins(1)[0], other])[1] == 0
    # shapes or biases that differ
    assert _separate(x, [_lins(1)[0], _lins(1, out=7)[0]])[1] == 0
    assert _separate(x, [_lins(1)[0], _lins(1, bias=False)[0]])[1] == 0


@pytest.mark.parametrize("concat,heads", [(True, 2), (False, 2), (False, 1)])
def test_transformer_projects_once_per_input(concat, heads):
    """Query, key, value (and the skip where as wide) of one input: one product;
    of an (x_src, x_dst) pair: one per side. The output is PyG's layer's
    (tests/test_pyg_parity.py has the full grid)."""
    torch.manual_seed(0)
    conv = TransformerConv(5, 4, heads=heads, concat=concat).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    ei = torch.tensor([[0, 1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 0, 3]])
    with _Ops() as rec:
        conv(x, ei)
    skip_joins = concat or heads == 1
    assert rec.ops.count("aten.baddbmm") == 1
    assert rec.ops.count("aten.addmm") == (0 if skip_joins else 1), rec.ops
    with _Ops() as rec:
        conv((x, x.clone()), ei)
    assert rec.ops.count("aten.baddbmm") == (2 if skip_joins else 1), rec.ops


@pytest.mark.parametrize("bias", [True, False])
def test_stacked_product_gradcheck(bias):
    from gatlib._conv import _StackedLinear
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    flat = torch.randn(3 * 4 * 3 + (3 * 4 if bias else 0), dtype=torch.float64, requires_grad=True)

    def fn(x, flat):
        return _StackedLinear.apply(x, flat, 3, 4, bias)
    assert torch.autograd.gradcheck(fn, (x, flat))
    assert torch.autograd.gradgradcheck(fn, (x, flat))


def test_weight_gradients_in_the_weights_layout():
    """The parameters' gradients are contiguous, as the parameters: accumulating
    them copies nothing (one copy per weight otherwise)."""
    lins = _lins(3)
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    with _Ops() as rec:
        torch.autograd.backward(project(x, *lins), [torch.ones(7, 6, dtype=torch.float64)] * 3)
    assert "aten.copy_" not in rec.ops, rec.ops
    assert all(p.grad.is_contiguous() for lin in lins for p in lin.parameters())


def test_under_autocast_as_linear():
    """Under CPU autocast the product runs in the autocast dtype, as F.linear
    would, and its gradients reach the float32 parameters."""
    lins = [Linear(5, 6).float() for _ in range(3)]
    x = torch.randn(7, 5, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = project(x, *lins)
        refs = [lin(x) for lin in lins]
    for y, r in zip(ys, refs, strict=True):
        assert y.dtype == r.dtype == torch.bfloat16
        torch.testing.assert_close(y, r)
    sum(y.float().sum() for y in ys).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for lin in lins for p in lin.parameters())
    assert x.grad.dtype == torch.float32


def test_sparse_input_is_given_to_each_layer():
    """A sparse x (Cora's features as CSR) goes to each Linear, which handles it."""
    lins = _lins(3)
    dense = torch.randn(7, 5, dtype=torch.float64).relu()
    for x in (dense.to_sparse_csr(), dense.to_sparse()):
        ys, batched = _separate(x, lins)
        assert batched == 0
        for y, lin in zip(ys, lins, strict=True):
            torch.testing.assert_close(y, lin(dense))


def test_meta_tensors_give_shapes():
    """On the meta device (shape inference), where autocast does not exist."""
    lins = [Linear(5, 6).to("meta") for _ in range(3)]
    ys = project(torch.randn(4, 5, device="meta"), *lins)
    assert [tuple(y.shape) for y in ys] == [(4, 6)] * 3 and ys[0].device.type == "meta"
