"""The data layer: directory choice, Planetoid from raw files, OGB through the
real ogb code path on small fake datasets, and the errors when data is missing.
Everything runs offline: downloads are made to fail fast by patching urlopen."""
from __future__ import annotations

import builtins
import hashlib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from gatlib.bench.data import (DatasetNotFoundError, load_dataset, ogb_required_files, resolve_data_dir,
                         seed_planetoid)

from ogb_fake import ogb_meta_dict, planetoid_raw_dir, write_fake_ogbn, write_ogb_node_dataset


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture
def offline(monkeypatch):
    """No network, no stdin: a download attempt fails at once, a prompt fails the test."""
    def no_network(*args, **kwargs):
        raise urllib.error.URLError("network disabled in tests")

    def no_prompt(*args, **kwargs):
        raise AssertionError("the loader asked for input(): it would hang under CI")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setattr(builtins, "input", no_prompt)
    monkeypatch.delenv("GATLIB_PLANETOID_RAW", raising=False)
    monkeypatch.delenv("GATLIB_DATA", raising=False)


def test_data_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("GATLIB_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_data_dir() == tmp_path / "xdg" / "gatlib"
    monkeypatch.setenv("GATLIB_DATA", str(tmp_path / "env"))
    assert resolve_data_dir() == tmp_path / "env"
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"


def test_unknown_dataset_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'corra'.*cora, citeseer, pubmed, ogbn-arxiv"):
        load_dataset("corra", tmp_path)


@pytest.mark.parametrize("name, n, f, c, n_train", [("Cora", 2708, 1433, 7, 140),
                                                   ("citeseer", 3327, 3703, 6, 120)])
def test_planetoid_from_shared_raw_files(offline, tmp_path, name, n, f, c, n_train):
    source = planetoid_raw_dir()
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in source.rglob("*") if p.is_file()}
    ds = load_dataset(name, tmp_path, seed_from=source)
    assert ds.data.num_nodes == n and ds.num_features == f and ds.num_classes == c
    assert {k: len(v) for k, v in ds.split_idx.items()} == {"train": n_train, "valid": 500, "test": 1000}
    # NormalizeFeatures: every non-empty row sums to one
    sums = ds.data.x.sum(1)
    assert torch.allclose(sums[sums > 0], torch.ones(1))
    assert ds.metric == "acc" and ds.evaluator is None
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in source.rglob("*") if p.is_file()} == before
    # the copy lives in the data directory: a second load needs no source
    assert load_dataset(name, tmp_path).data.num_nodes == n


def test_planetoid_seed_from_env_and_seed_function(offline, monkeypatch, tmp_path):
    assert seed_planetoid(planetoid_raw_dir(), tmp_path / "a") == ["Cora", "CiteSeer"]
    assert (tmp_path / "a" / "Planetoid" / "Cora" / "raw" / "ind.cora.graph").is_file()
    monkeypatch.setenv("GATLIB_PLANETOID_RAW", str(planetoid_raw_dir()))
    assert load_dataset("cora", tmp_path / "b").data.num_nodes == 2708


def test_missing_planetoid_raises_one_clear_error(offline, tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("pubmed", tmp_path)
    msg = str(info.value)
    assert str(tmp_path / "Planetoid" / "PubMed" / "raw") in msg
    assert "ind.pubmed" in msg and "GATLIB_PLANETOID_RAW" in msg and "network disabled" in msg
    assert isinstance(info.value, FileNotFoundError)


def test_missing_ogb_dataset_raises_without_prompting(offline, tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("ogbn-products", tmp_path)
    msg = str(info.value)
    assert str(tmp_path / "ogb" / "ogbn_products") in msg and "products.zip" in msg


def test_fake_dataset_is_valid_ogb_format(tmp_path):
    """The writer's output loads with ogb's own loader given a meta_dict."""
    from ogb.nodeproppred import PygNodePropPredDataset

    from gatlib.bench.data import _allow_pyg_pickles

    _allow_pyg_pickles()
    folder = tmp_path / "fake_ogbn"
    meta = ogb_meta_dict(folder, num_classes=5)
    write_ogb_node_dataset(folder, meta, num_nodes=120)
    assert all((folder / f).is_file() for f in ogb_required_files(meta))
    ds = PygNodePropPredDataset(name="ogbn-fake", root=str(tmp_path), meta_dict=meta)
    data, split = ds[0], ds.get_idx_split()
    assert data.num_nodes == 120 and data.x.shape == (120, 16) and data.y.shape == (120, 1)
    assert data.node_year.shape == (120, 1) and ds.num_classes == 5
    assert sum(len(v) for v in split.values()) == 120


def test_ogbn_arxiv_layout_end_to_end(offline, tmp_path):
    """load_dataset('ogbn-arxiv') on a fake arxiv → a model → ogb's Evaluator."""
    from dataclasses import replace

    from gatlib.bench.recipes import recipe
    from gatlib.bench.train import train_run

    write_fake_ogbn(tmp_path, "ogbn-arxiv", num_nodes=300, num_features=16)
    ds = load_dataset("ogbn-arxiv", tmp_path)
    assert ds.evaluator is not None and ds.metric == "acc" and not ds.multilabel
    assert ds.data.y.shape == (300,) and ds.num_features == 16
    rcp = replace(recipe("gat", "ogbn-arxiv"), epochs=30, warmup_epochs=5,
                  model_kwargs={"hidden_channels": 16, "num_layers": 2, "heads": 2, "dropout": 0.2})
    res = train_run(ds, rcp, seed=0)
    # 40 classes in the metadata, 4 used by the fake labels: chance is 25%
    assert res.test_acc > 60


def test_ogb_root_layout_is_used_where_it_is(offline, tmp_path):
    """A download made by ogb itself (PygNodePropPredDataset(root=DIR) writes
    DIR/ogbn_arxiv/, processed files included) is found under --data-dir DIR and
    used in place: nothing is copied or downloaded into DIR/ogb/."""
    from ogb.nodeproppred import PygNodePropPredDataset

    from gatlib.bench.data import _allow_pyg_pickles

    write_fake_ogbn(tmp_path, "ogbn-arxiv", ogb_layout=True, num_nodes=150, num_features=8)
    _allow_pyg_pickles()
    ref = PygNodePropPredDataset("ogbn-arxiv", root=str(tmp_path))  # ogb's own processing
    assert (tmp_path / "ogbn_arxiv" / "processed").is_dir()
    ds = load_dataset("ogbn-arxiv", tmp_path)
    assert not (tmp_path / "ogb").exists()
    assert torch.equal(ds.data.x, ref[0].x) and ds.data.num_nodes == 150
    assert torch.equal(ds.split_idx["train"], ref.get_idx_split()["train"])


def test_ogbn_proteins_layout_multilabel(offline, tmp_path):
    """Edge features only: node features are built from them; ROC-AUC metric."""
    write_fake_ogbn(tmp_path, "ogbn-proteins", num_nodes=150, edge_dim=8)
    ds = load_dataset("ogbn-proteins", tmp_path)
    assert ds.multilabel and ds.metric == "rocauc" and ds.num_classes == 112
    assert ds.data.x.shape == (150, 8) and ds.data.y.dtype == torch.float32
    # the Evaluator accepts scores in the model-output format
    score = ds.evaluate(ds.data.y + 0.1 * torch.randn_like(ds.data.y), "test")
    assert 0.9 < score <= 1.0


def test_release_marker_missing_in_complete_folder(offline, tmp_path):
    """ogb would ask on stdin: a complete folder is marked, then loads."""
    folder = write_fake_ogbn(tmp_path, "ogbn-arxiv", num_nodes=100, release=False)
    assert load_dataset("ogbn-arxiv", tmp_path).data.num_nodes == 100
    assert (folder / "RELEASE_v1.txt").is_file()


def test_incomplete_ogb_folder_is_reported_not_downloaded(offline, tmp_path):
    folder = write_fake_ogbn(tmp_path, "ogbn-arxiv", num_nodes=100, release=False)
    (folder / "split" / "time" / "valid.csv.gz").unlink()
    with pytest.raises(DatasetNotFoundError, match="incomplete.*split/time/valid.csv.gz"):
        load_dataset("ogbn-arxiv", tmp_path)
    assert folder.is_dir()  # user files are never deleted


def test_processed_without_raw_fails_offline(offline, tmp_path):
    """ogb re-downloads when a raw file is missing, even if processed data exists."""
    folder = write_fake_ogbn(tmp_path, "ogbn-arxiv", num_nodes=100)
    load_dataset("ogbn-arxiv", tmp_path)
    assert (folder / "processed" / "geometric_data_processed.pt").is_file()
    (folder / "raw" / "node-feat.csv.gz").unlink()
    with pytest.raises(DatasetNotFoundError, match=r"raw/node-feat\.csv\.gz"):
        load_dataset("ogbn-arxiv", tmp_path)


def test_planetoid_raw_dir_helper_points_at_shared_data():
    assert Path(planetoid_raw_dir(), "CiteSeer", "raw", "ind.citeseer.x").is_file()
