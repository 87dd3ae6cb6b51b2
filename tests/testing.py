"""Shared test helpers: devices, dtypes, random graphs, skips for optional backends."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import gatlib

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FLOAT_DTYPES = [torch.float32, torch.float64]
HAS_SCATTER = importlib.util.find_spec("torch_scatter") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None

requires_scatter = pytest.mark.skipif(not HAS_SCATTER, reason="torch_scatter not installed")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def backends(device="cpu"):
    """Every backend usable on ``device``, the reference ``"torch"`` first."""
    return list(gatlib.available_backends(device))


def random_graph(num_nodes, num_edges, *, num_dst=None, seed=0, device="cpu", self_loops=True):
    """A random ``[2, E]`` edge_index (unsorted, may repeat edges) on ``num_nodes`` sources
    and ``num_dst`` (default ``num_nodes``) destinations."""
    g = torch.Generator().manual_seed(seed)
    num_dst = num_nodes if num_dst is None else num_dst
    src = torch.randint(0, num_nodes, (num_edges,), generator=g)
    dst = torch.randint(0, num_dst, (num_edges,), generator=g)
    ei = torch.stack([src, dst])
    if not self_loops:
        ei = ei[:, ei[0] != ei[1]]
    return ei.to(device)


def hub_graph(num_nodes, hub_degree, *, hub=0, device="cpu"):
    """A star: ``hub_degree`` edges from random sources into node ``hub``, plus a ring."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, num_nodes, (hub_degree,), generator=g)
    ring = torch.arange(num_nodes)
    ei = torch.cat([torch.stack([src, torch.full_like(src, hub)]),
                    torch.stack([ring, (ring + 1) % num_nodes])], dim=1)
    return ei.to(device)
