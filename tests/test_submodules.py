"""A layer's linear submodules are modules: whatever PyTorch lets a user do to a ``Linear`` -
a forward hook, an instance's own ``forward``, a LoRA-style wrapper in its place, ``torch.nn.utils.prune``,
``torch.nn.utils.parametrize`` - gives PyG's outputs and gradients, and trains as PyG's layer
does, for inputs narrower than a head (where gatlib aggregates inputs and projects after) and
wider (where GAT folds its attention vectors into the weight). The fast paths that read
``lin.weight`` directly run only for a plain ``Linear`` (``gatlib._conv``'s ``_plain`` rule)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.utils.parametrize
import torch.nn.utils.prune
import torch_geometric.nn as pyg_nn
from torch_geometric.nn.dense.linear import Linear

import gatlib
import gatlib._scores

pytestmark = pytest.mark.usefixtures("one_thread")

N, E, N_DST, H, C, D = 12, 40, 7, 2, 8, 3


class LoRA(torch.nn.Module):
    """``base(x) + x A B``, a low-rank update beside a frozen-or-not base layer; like most
    such wrappers it has no ``weight`` of its own."""

    def __init__(self, base: torch.nn.Module, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(base.in_channels, 2, generator=g, dtype=torch.float64) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(2, base.out_channels, generator=g, dtype=torch.float64) * 0.3)

    def forward(self, x):
        return self.base(x) + (x @ self.a) @ self.b


class Halved(torch.nn.Module):
    def forward(self, w):
        return 0.5 * w


def _modify(layer: torch.nn.Module, how: str) -> None:
    """Apply ``how`` to every linear submodule of ``layer`` (the same on both sides)."""
    names = [n for n, m in layer.named_children() if isinstance(m, Linear)]
    assert names, "the layer has linear submodules"
    for k, name in enumerate(sorted(names)):
        lin = getattr(layer, name)
        if how == "hook":
            lin.register_forward_hook(lambda m, inp, out: out * 1.5 - 0.1)
        elif how == "own-forward":  # an instance's forward in place of its class's
            lin.forward = lambda x, forward=lin.forward: forward(x) * 0.8 + 0.05
        elif how == "lora":
            setattr(layer, name, LoRA(lin, seed=k))
        elif how == "prune":
            torch.nn.utils.prune.l1_unstructured(lin, "weight", amount=0.4)
        elif how == "parametrize":
            torch.nn.utils.parametrize.register_parametrization(lin, "weight", Halved())
        else:
            raise AssertionError(how)


def _pair(layer_name: str, width: int, edge_dim, pair: bool):
    in_channels = (width, width) if pair else width
    kwargs = dict(heads=H, edge_dim=edge_dim)
    if layer_name == "TransformerConv":
        kwargs["beta"] = True
    else:
        kwargs["residual"] = True
    torch.manual_seed(0)
    ours = getattr(gatlib, layer_name)(in_channels, C, **kwargs)
    theirs = getattr(pyg_nn, layer_name)(in_channels, C, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    # float64: a gradient that is zero by the softmax's invariance (a key's bias) is
    # rounding noise in either library, and must not decide the comparison
    return ours.double(), theirs.double()


def _inputs(width: int, edge_dim, pair: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, width, generator=g, dtype=torch.float64)
    num_dst = N_DST if pair else N
    ei = torch.stack([torch.randint(0, N, (E,), generator=g),
                      torch.randint(0, num_dst, (E,), generator=g)])
    edge_attr = None if edge_dim is None else torch.randn(E, edge_dim, generator=g, dtype=torch.float64)
    xs = (x, x[:N_DST] * 0.7) if pair else x
    return xs, ei, edge_attr


@pytest.fixture
def fold_always(monkeypatch):
    """GAT's attention vectors folded into the weight at any size (the fold's rule would
    keep it for large inputs only)."""
    monkeypatch.setattr(gatlib._scores, "FOLD_MIN_ENTRIES", 0)


@pytest.mark.parametrize("pair", [False, True], ids=["one-x", "pair"])
@pytest.mark.parametrize("edge_dim", [None, D], ids=["no-edge", "edge"])
@pytest.mark.parametrize("width", [4, 16], ids=["F<C", "F>=C"])
@pytest.mark.parametrize("how", ["hook", "own-forward", "lora", "prune", "parametrize"])
@pytest.mark.parametrize("layer_name", ["GATConv", "GATv2Conv", "TransformerConv"])
def test_modified_linears_train_as_in_pyg(layer_name, how, width, edge_dim, pair, fold_always):
    ours, theirs = _pair(layer_name, width, edge_dim, pair)
    _modify(ours, how)
    _modify(theirs, how)
    x, ei, edge_attr = _inputs(width, edge_dim, pair)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs)]
    for step in range(3):
        outs = []
        for model, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad()
            out = model(x, ei, edge_attr)
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(step),
                            dtype=out.dtype)
            (out * w).sum().backward()
            outs.append(out)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-9, rtol=1e-7,
                                   msg=lambda m, step=step: f"step {step}, output: {m}")
        grads = [{n: p.grad for n, p in model.named_parameters()} for model in (ours, theirs)]
        assert grads[0].keys() == grads[1].keys()
        for name, g in grads[1].items():
            if g is None:
                assert grads[0][name] is None or not grads[0][name].any(), name
                continue
            scale = max(1.0, float(g.abs().max()))  # (entries that cancel to ~0 in a large sum)
            torch.testing.assert_close(grads[0][name], g, atol=1e-9 * scale, rtol=1e-7,
                                       msg=lambda m, step=step, name=name: f"step {step}, grad of {name}: {m}")
        for opt in opts:
            opt.step()
