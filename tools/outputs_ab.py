"""Every layer's outputs and gradients, saved, and two saves compared bit for bit:
the check that a refactoring changed no result.

Run it once per checkout (``--root`` the checkout whose ``gatlib`` is imported),
then compare the two files::

    python -m tools.outputs_ab save --root /path/to/old --out old.pt
    python -m tools.outputs_ab save --root . --out new.pt
    python -m tools.outputs_ab compare old.pt new.pt

The grid: GATConv, GATv2Conv and TransformerConv x every CPU backend (and the
Triton kernels under ``TRITON_INTERPRET=1``, which this script sets) x edge
features or not x concatenated or averaged heads x C = 4 (the projected path) or
8 (input space, F = 6 < C), and the ``propagate`` path (a registered message
hook); float64, fixed seeds; the output, the input's gradient and every
parameter's gradient of ``sum(out ** 2)``.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys

LAYERS = ("GATConv", "GATv2Conv", "TransformerConv")
BACKENDS = ("torch", "scatter", "fused", "triton")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.outputs_ab",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="compute the grid with the gatlib of --root and save it")
    s.add_argument("--root", required=True, help="the checkout whose gatlib is imported")
    s.add_argument("--out", required=True, help="where to save the results (torch.save)")
    c = sub.add_parser("compare", help="compare two saves bit for bit")
    c.add_argument("a")
    c.add_argument("b")
    return p


def save(root: str, out: str) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is first imported)
    sys.path.insert(0, os.path.abspath(root))
    import torch

    gatlib = importlib.import_module("gatlib")
    if not os.path.abspath(gatlib.__file__).startswith(os.path.abspath(root)):
        raise SystemExit(f"gatlib was imported from {gatlib.__file__}, not from {root}")
    n, f_in = 40, 6
    g = torch.Generator().manual_seed(0)
    ei = torch.randint(0, n, (2, 160), generator=g)
    ea = torch.randn(160, 3, generator=g, dtype=torch.float64)
    results = {}
    for layer, backend, edge, concat, C, propagate in itertools.product(
            LAYERS, BACKENDS, (False, True), (True, False), (4, 8), (False, True)):
        if propagate and backend != "torch":  # (the propagate path runs on "auto"/"torch" only)
            continue
        torch.manual_seed(1)
        m = getattr(gatlib, layer)(f_in, C, heads=2, concat=concat, edge_dim=3 if edge else None,
                                   backend=backend).double()
        if propagate:
            m.register_message_forward_hook(lambda *a: None)
        x = torch.randn(n, f_in, generator=torch.Generator().manual_seed(2), dtype=torch.float64,
                        requires_grad=True)
        y = m(x, ei, ea if edge else None)
        y.pow(2).sum().backward()
        key = f"{layer}/{backend}/edge={edge}/concat={concat}/C={C}/propagate={propagate}"
        results[key] = [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()
                                                 if p.grad is not None]
    torch.save(results, out)
    print(f"{len(results)} configurations saved to {out}")
    return 0


def compare(a_path: str, b_path: str) -> int:
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    if a.keys() != b.keys():
        print("the two files hold different grids")
        return 1
    equal = 0
    for key in a:
        if len(a[key]) != len(b[key]):
            print(f"differs: {key} (another number of gradients)")
            continue
        pairs = list(zip(a[key], b[key], strict=True))
        if all(torch.equal(x, y) for x, y in pairs):
            equal += 1
            continue
        worst = max((x - y).abs().max().item() for x, y in pairs)
        print(f"differs: {key} (largest difference {worst:.2e})")
    print(f"bit for bit equal: {equal} of {len(a)}")
    return 0 if equal == len(a) else 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return save(args.root, args.out) if args.cmd == "save" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
