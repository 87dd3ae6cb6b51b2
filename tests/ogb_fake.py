"""Test data: small node datasets in OGB's on-disk format, and where the
shared Planetoid raw files are.

The OGB layout written here is what ``ogb.nodeproppred.PygNodePropPredDataset``
reads (ogb 1.3.6, homogeneous graph, CSV files without headers)::

    <folder>/RELEASE_v<version>.txt
    <folder>/raw/edge.csv.gz               [E, 2] src,dst
    <folder>/raw/num-node-list.csv.gz      [1] N
    <folder>/raw/num-edge-list.csv.gz      [1] E
    <folder>/raw/node-label.csv.gz         [N, tasks]
    <folder>/raw/node-feat.csv.gz          [N, F]     if has_node_attr
    <folder>/raw/edge-feat.csv.gz          [E, D]     if has_edge_attr
    <folder>/raw/<additional file>.csv.gz  [N, 1]     e.g. node_year
    <folder>/split/<scheme>/{train,valid,test}.csv.gz  node ids
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import pandas as pd

REPO_ROOT = Path(__file__).resolve().parents[1]


def planetoid_raw_dir() -> Path:
    """The read-only raw Planetoid files shared with CI: ``$GATLIB_PLANETOID_RAW``,
    else ``<repo>/../shared/data/Planetoid`` (laid out ``<Name>/raw/ind.*``)."""
    env = os.environ.get("GATLIB_PLANETOID_RAW")
    path = Path(env) if env else REPO_ROOT.parent / "shared" / "data" / "Planetoid"
    if not (path / "Cora" / "raw" / "ind.cora.x").is_file():
        raise FileNotFoundError(
            f"the shared Planetoid raw files are missing from {path}: CI checks out ../shared beside "
            f"the repository; elsewhere set GATLIB_PLANETOID_RAW to a directory with Cora/raw/ind.cora.*")
    return path


def ogb_meta_dict(folder: Path, *, num_tasks: int = 1, num_classes: int = 4,
                  has_node_attr: bool = True, has_edge_attr: bool = False, split: str = "time",
                  additional_node_files: Optional[str] = "node_year") -> Dict[str, str]:
    """A ``meta_dict`` for ``PygNodePropPredDataset`` describing a dataset at ``folder``.

    Values are strings, as in ogb's ``master.csv``.
    """
    multilabel = num_tasks > 1
    return {
        "dir_path": str(folder), "version": "1", "download_name": folder.name,
        "url": "http://ogb.invalid/never-downloaded.zip",
        "num tasks": str(num_tasks), "num classes": str(2 if multilabel else num_classes),
        "task type": "binary classification" if multilabel else "multiclass classification",
        "eval metric": "rocauc" if multilabel else "acc", "add_inverse_edge": "False",
        "has_node_attr": str(has_node_attr), "has_edge_attr": str(has_edge_attr), "split": split,
        "additional node files": additional_node_files or "None", "additional edge files": "None",
        "is hetero": "False", "binary": "False",
    }


def write_ogb_node_dataset(folder: Path, meta: Dict[str, str], *, num_nodes: int = 300,
                           num_features: int = 16, edge_dim: int = 8, avg_degree: int = 6,
                           feature_noise: float = 1.0, seed: int = 0, release: bool = True) -> Path:
    """Write a learnable node dataset described by ``meta`` into ``folder``.

    Nodes of one class share a feature centroid and link mostly to each other,
    so a GNN beats chance after a few epochs. Multi-task (``num tasks`` > 1)
    labels are 0/1 and correlate with the node's latent class.

    Args:
        folder: the dataset folder (created).
        meta: ogb meta information (``master.csv`` column or :func:`ogb_meta_dict`).
        num_nodes, num_features, edge_dim, avg_degree: sizes.
        feature_noise: standard deviation of the noise around the class
            centroids (whose entries are standard normal): large values make
            a node's own features ambiguous and its neighbours' decisive.
        seed: RNG seed.
        release: write the ``RELEASE_v<version>.txt`` marker.

    Returns:
        ``folder``.
    """
    rng = np.random.default_rng(seed)
    tasks = int(meta["num tasks"])
    classes = int(meta["num classes"]) if tasks == 1 else 4
    latent = rng.integers(0, classes, num_nodes)
    E = num_nodes * avg_degree
    src = rng.integers(0, num_nodes, E)
    # 80% of edges stay inside the source's class
    same = rng.random(E) < 0.8
    by_class = [np.flatnonzero(latent == c) for c in range(classes)]
    dst = np.array([rng.choice(by_class[latent[s]]) if k else rng.integers(0, num_nodes)
                    for s, k in zip(src, same, strict=True)])
    raw = folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)

    def write(path: Path, array) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(np.asarray(array)).to_csv(path, header=False, index=False, compression="gzip")

    write(raw / "edge.csv.gz", np.stack([src, dst], 1))
    write(raw / "num-node-list.csv.gz", [num_nodes])
    write(raw / "num-edge-list.csv.gz", [E])
    if tasks == 1:
        write(raw / "node-label.csv.gz", latent[:, None])
    else:
        task_class = rng.integers(0, classes, tasks)
        labels = (latent[:, None] == task_class[None, :]) ^ (rng.random((num_nodes, tasks)) < 0.1)
        write(raw / "node-label.csv.gz", labels.astype(np.int64))
    if meta["has_node_attr"] == "True":
        centroids = rng.normal(size=(classes, num_features))
        write(raw / "node-feat.csv.gz",
              (centroids[latent] + feature_noise * rng.normal(size=(num_nodes, num_features)))
              .astype(np.float32))
    if meta["has_edge_attr"] == "True":
        write(raw / "edge-feat.csv.gz", (rng.random((E, edge_dim)) * (1 + latent[dst, None])) / classes)
    if meta["additional node files"] != "None":
        for name in meta["additional node files"].split(","):
            write(raw / f"{name}.csv.gz", rng.integers(2000, 2020, (num_nodes, 1)))
    perm = rng.permutation(num_nodes)
    n_train, n_valid = int(0.6 * num_nodes), int(0.2 * num_nodes)
    parts = {"train": perm[:n_train], "valid": perm[n_train:n_train + n_valid],
             "test": perm[n_train + n_valid:]}
    for part, idx in parts.items():
        write(folder / "split" / meta["split"] / f"{part}.csv.gz", np.sort(idx))
    if release:
        (folder / f"RELEASE_v{meta['version']}.txt").write_text("fake dataset for tests\n")
    return folder


def write_fake_ogbn(data_dir: Path, name: str, *, ogb_layout: bool = False, **kwargs) -> Path:
    """Write a fake ``name`` (``"ogbn-arxiv"``, ...) in that dataset's format
    (ogb's master.csv) where gatlib keeps OGB data under ``data_dir``
    (``data_dir/ogb/ogbn_arxiv``), or with ``ogb_layout`` where
    ``PygNodePropPredDataset(root=data_dir)`` does (``data_dir/ogbn_arxiv``)."""
    from gatlib.bench.data import _ogb_meta

    meta = _ogb_meta(name)
    root = Path(data_dir) if ogb_layout else Path(data_dir) / "ogb"
    return write_ogb_node_dataset(root / name.replace("-", "_"), meta, **kwargs)
