"""Sampled mini-batches (PyG's ``NeighborLoader``) for training in one process or data-parallel over
several (torchrun, :mod:`gatlib.bench.distributed`), after PyG's ogbn-products example; docs/distributed.md
says what each process does.
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import Data

from .distributed import Distributed


def hop_counts(edge_index: Tensor, num_seeds: int, num_nodes: int, num_hops: int) -> List[int]:
    """Nodes per hop of a sampled subgraph, ``[seeds, hop 1, ..., hop num_hops]`` (PyG reports them
    only with pyg-lib). Checks, and raises ``RuntimeError`` otherwise, that the nodes are numbered hop by hop,
    which :class:`~gatlib.models.SampledGAT` relies on."""
    src, dst = edge_index
    far = num_hops + 1
    hop = torch.full((num_nodes,), far, dtype=torch.long, device=edge_index.device)
    hop[:num_seeds] = 0
    for k in range(1, num_hops + 1):
        found = src[hop[dst] == k - 1]
        hop[found] = torch.clamp(hop[found], max=k)
    if num_nodes and (bool((hop[1:] < hop[:-1]).any()) or int(hop.max()) > num_hops):
        raise RuntimeError("the sampled subgraph's nodes are not numbered hop by hop (seeds, "
                           "hop 1, hop 2, ...): SampledGAT cannot take its layers' destinations "
                           "as prefixes")
    return torch.bincount(hop, minlength=num_hops + 1).tolist()


def batch_hop_counts(batch: Data, num_hops: int) -> List[int]:
    """:func:`hop_counts` of a ``NeighborLoader`` batch, or the counts the
    loader attached (pyg-lib's sampler)."""
    counts = getattr(batch, "num_sampled_nodes", None)
    if counts is not None:
        return [int(c) for c in counts]
    return hop_counts(batch.edge_index, batch.batch_size, batch.num_nodes, num_hops)


def derived_seed(*keys: int) -> int:
    """A seed below 2**62 for a random stream of its own, derived from ``keys``
    (``seed + rank`` would be the next run's seed)."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, np.uint64)[0]) >> 2


def neighbor_loader(data: Data, **kwargs):
    from torch_geometric.loader import NeighborLoader

    with warnings.catch_warnings():
        # PyG deprecates the torch_sparse sampler in favour of pyg-lib, which
        # gatlib's environment does not build; both sample the same way.
        warnings.filterwarnings("ignore", "Using 'NeighborSampler' without a 'pyg-lib'")
        return NeighborLoader(data, **kwargs)


@torch.no_grad()
def layerwise_inference(model: torch.nn.Module, x: Tensor, loader, num_nodes: int,
                        device: torch.device, dist: Optional[Distributed] = None) -> Tensor:
    """Every node's ``[N, C]`` logits (on the CPU) of ``model`` in eval mode, layer by
    layer over full neighbourhoods; with ``dist`` each layer's outputs are all-gathered."""
    for i in range(model.num_layers):
        parts = []
        for batch in loader:
            h = x[batch.n_id].to(device)  # [N_batch, F_i]
            parts.append(model.layer(i, h, batch.edge_index.to(device), batch.batch_size).cpu())
        mine = torch.cat(parts) if parts else x.new_zeros((0, model.skips[i].out_features))
        x = mine if dist is None else dist.all_gather_rows(mine, num_nodes)
    return x
