"""Synthetic stand-ins for the OGB benchmark graphs: same size, heavy-tailed degrees (Chung–Lu sampling
with power-law weights; docs/benchmarks.md, "Synthetic graphs", has the model). One seeded generator: the
same arguments give the same graph on every machine.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor


@dataclass(frozen=True)
class GraphSpec:
    r"""Size and degree shape of a synthetic graph (``num_edges``: directed edges before
    symmetrising; ``exponent``: the degree tail's; ``max_degree``: cap on the largest expected degree)."""

    name: str
    num_nodes: int
    num_edges: int
    num_features: int
    exponent: float = 2.5
    max_degree: Optional[int] = None


# Node/edge/feature counts are those of ogbn-arxiv and ogbn-products; the hub
# degree is of the order of the real graphs' largest (~1e4).
PRESETS = {
    "arxiv-like": GraphSpec("arxiv-like", 169_343, 1_166_243, 128, 2.5, 13_000),
    "products-like": GraphSpec("products-like", 2_449_029, 61_859_140, 100, 2.5, 17_500),
}

_SPEC_RE = re.compile(r"^synthetic:(\d+):(\d+):(\d+)$")


def parse_spec(text: str) -> GraphSpec:
    """A preset name (``"arxiv-like"``, ``"products-like"``) or
    ``"synthetic:N:E:F"`` (N nodes, E directed edges, F features) as a :class:`GraphSpec`."""
    if text in PRESETS:
        return PRESETS[text]
    m = _SPEC_RE.match(text)
    if m is None:
        raise ValueError(f"unknown synthetic graph {text!r}: use one of {sorted(PRESETS)} "
                         "or 'synthetic:N:E:F' (nodes, directed edges, features)")
    n, e, f = (int(g) for g in m.groups())
    if n < 2 or e < 1 or f < 1:
        raise ValueError(f"synthetic:N:E:F needs N >= 2, E >= 1, F >= 1; got {text!r}")
    if e > n * (n - 1):
        raise ValueError(f"{text!r}: {e} distinct directed edges do not fit on {n} nodes "
                         f"(at most N*(N-1) = {n * (n - 1)})")
    return GraphSpec(text, n, e, f)


def power_law_weights(num_nodes: int, num_edges: int, exponent: float = 2.5,
                      max_degree: Optional[int] = None) -> Tensor:
    r"""Chung–Lu node weights ``(i + i_0)^(-1/(exponent-1))`` summing to 1, largest first,
    with ``i_0`` bisected so the heaviest node's expected degree is ``max_degree``."""
    if exponent <= 1:
        raise ValueError(f"exponent must be > 1; got {exponent}")
    alpha = 1.0 / (exponent - 1.0)
    i = torch.arange(num_nodes, dtype=torch.float64)

    def weights(i0: float) -> Tensor:
        w = (i + 1.0 + i0).pow(-alpha)
        return w / w.sum()

    w = weights(0.0)
    if max_degree is None or 2 * num_edges * float(w[0]) <= max_degree:
        return w
    lo, hi = 0.0, float(num_nodes)  # hub degree falls monotonically as i0 grows
    for _ in range(60):
        mid = math.sqrt(max(lo, 1e-3) * hi)  # bisect in log space: i0 spans decades
        if 2 * num_edges * float(weights(mid)[0]) > max_degree:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-3 * hi:
            break
    return weights(hi)


def power_law_edges(num_nodes: int, num_edges: int, *, exponent: float = 2.5,
                    max_degree: Optional[int] = None, seed: int = 0,
                    undirected: bool = True) -> Tensor:
    """A Chung–Lu power-law graph: a coalesced int64 ``edge_index`` without self-loops or
    duplicates, ``num_edges`` directed edges (with their reverses when ``undirected``)."""
    N = num_nodes
    if num_edges > N * (N - 1):
        raise ValueError(f"{num_edges} distinct directed edges do not fit on {N} nodes")
    g = torch.Generator().manual_seed(seed)
    cdf = power_law_weights(N, num_edges, exponent, max_degree).cumsum(0)
    cdf[-1] = 1.0  # guard the inverse-CDF lookup against rounding in the sum
    # Node i gets the i-th largest weight; a random relabelling spreads hubs over the ids.
    relabel = torch.randperm(N, generator=g)

    def draw(m: int) -> Tensor:
        idx = torch.searchsorted(cdf, torch.rand(m, dtype=torch.float64, generator=g), right=True)
        return relabel[idx.clamp_(max=N - 1)]

    # Memory: ogbn-products' sizes make every [E] int64 tensor ~0.5-1 GB, so
    # temporaries are freed as soon as possible and the output is written in place.
    keys = torch.empty(0, dtype=torch.int64)  # src * N + dst of the distinct edges so far
    while keys.numel() < num_edges:
        need = num_edges - keys.numel()
        m = int(need * 1.15) + 64  # a little extra: loops and repeats get dropped
        src, dst = draw(m), draw(m)
        keep = src != dst
        new = src[keep].mul_(N).add_(dst[keep])
        del src, dst, keep
        keys = _sorted_unique(torch.cat([keys, new]))
        del new
    # The keys are sorted, so keep a *random* subset of the right size, not the smallest keys.
    keys = keys[torch.randperm(keys.numel(), generator=g)[:num_edges]]
    if undirected:
        reverse = (keys % N).mul_(N).add_(keys // N)  # dst * N + src
        keys = torch.cat([keys, reverse])
        del reverse
    keys = _sorted_unique(keys)  # sorted by (src, dst): coalesced, like PyG's datasets
    edge_index = torch.empty(2, keys.numel(), dtype=torch.int64)
    torch.div(keys, N, rounding_mode="floor", out=edge_index[0])
    torch.remainder(keys, N, out=edge_index[1])
    return edge_index


def _sorted_unique(keys: Tensor) -> Tensor:
    """``torch.unique(keys)`` (sorted), consuming ``keys``: sorted in place (no
    index tensor, which ``torch.sort`` would allocate), then one copy of the
    distinct values."""
    keys.numpy().sort()
    if keys.numel() < 2:
        return keys
    first = torch.ones(keys.numel(), dtype=torch.bool)
    torch.ne(keys[1:], keys[:-1], out=first[1:])
    return keys[first]


def synthetic_graph(spec: Union[str, GraphSpec], *, seed: int = 0,
                    cache_dir: Optional[Union[str, os.PathLike]] = None):
    """A synthetic ``Data(x, edge_index)``, undirected and coalesced, from a preset name,
    ``"synthetic:N:E:F"`` or a spec; cached as ``.pt`` in ``cache_dir`` when given."""
    from torch_geometric.data import Data

    if isinstance(spec, str):
        spec = parse_spec(spec)
    path = None
    if cache_dir is not None:
        tag = (f"{spec.name.replace(':', '_')}-n{spec.num_nodes}-e{spec.num_edges}"
               f"-f{spec.num_features}-g{spec.exponent}-d{spec.max_degree}-s{seed}")
        path = Path(cache_dir) / "synthetic" / f"{tag}.pt"
        if path.exists():
            blob = torch.load(path, weights_only=True)
            return Data(x=blob["x"], edge_index=blob["edge_index"])
    edge_index = power_law_edges(spec.num_nodes, spec.num_edges, exponent=spec.exponent,
                                 max_degree=spec.max_degree, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(spec.num_nodes, spec.num_features, generator=g)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"x": x, "edge_index": edge_index, "spec": asdict(spec), "seed": seed}, tmp)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    return Data(x=x, edge_index=edge_index)
