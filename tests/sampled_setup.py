"""Shared by ``tests/test_sampled.py`` and the torchrun worker it starts
(``tests/ddp_worker.py``): the fake ogbn-products and a deterministic recipe."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from gatlib.bench.recipes import SampledRecipe, recipe

from ogb_fake import write_fake_ogbn

# 2,000 nodes (1,200 training nodes: an even count, so two ranks' shares lose
# nothing), 47 classes, 100 features. Noise 4 around the class centroids: a
# linear model of a node's own features reaches ~32% test accuracy, one that
# also sees its neighbours' mean ~94%.
FAKE_PRODUCTS = dict(num_nodes=2000, num_features=100, feature_noise=4.0, seed=0)


def write_fake_products(data_dir: Path) -> Path:
    return write_fake_ogbn(data_dir, "ogbn-products", **FAKE_PRODUCTS)


def deterministic_recipe(batch_size: int, epochs: int) -> SampledRecipe:
    """A small SampledGAT with nothing random after initialisation: full
    neighbourhoods (fan-out -1), no dropout; evaluated after every epoch."""
    rcp = recipe("gat", "ogbn-products", "neighbor")
    return replace(rcp, model_kwargs=dict(rcp.model_kwargs, hidden_channels=16, heads=2,
                                          num_layers=2, dropout=0.0),
                   fanouts=[-1, -1], batch_size=batch_size, epochs=epochs, eval_every=1,
                   eval_after=0, eval_batch_size=4096)
