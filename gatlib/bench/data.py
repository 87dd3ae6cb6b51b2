"""Node-classification datasets, loaded through the libraries made for them: Planetoid (Cora,
CiteSeer, PubMed: public split, normalised features, as in the GAT paper) and OGB (ogbn-arxiv,
-products, -proteins: official split and ``Evaluator``). Files live under ``data_dir``, else
``$GATLIB_DATA``, else ``~/.cache/gatlib``; what is missing is downloaded after a short network
probe, or copied from ``$GATLIB_PLANETOID_RAW`` offline, else :class:`DatasetNotFoundError` says
where the files are expected.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

import torch
from torch import Tensor
from torch_geometric.data import Data

PathLike = Union[str, "os.PathLike[str]"]

PLANETOID = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
OGB_NODE = ("ogbn-arxiv", "ogbn-products", "ogbn-proteins")
DATASETS = tuple(PLANETOID) + OGB_NODE

_PLANETOID_FILES = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
_PROBE_TIMEOUT_S = 10.0


class DatasetNotFoundError(FileNotFoundError):
    """A dataset is not on disk and could not be downloaded."""


@dataclass
class NodeDataset:
    """One graph (``x``, ``edge_index``, ``y``: class ids, or ``[N, T]`` 0/1 targets when ``multilabel``),
    its split (``split_idx``), ``num_classes`` and ``metric`` (``"acc"``/``"rocauc"``, OGB's ``evaluator``)."""

    name: str
    data: Data
    split_idx: Dict[str, Tensor]
    num_classes: int
    multilabel: bool = False
    metric: str = "acc"
    evaluator: Optional[Any] = None

    @property
    def num_features(self) -> int:
        return self.data.x.size(1)

    def evaluate(self, out: Tensor, split: str) -> float:
        """The dataset's metric (a fraction in ``[0, 1]``) of the model output
        ``out`` (``[N, num_classes]`` logits) on the nodes of ``split``."""
        idx = self.split_idx[split]
        out, y = out[idx].detach().cpu(), self.data.y[idx].cpu()
        if self.evaluator is None:
            return float((out.argmax(-1) == y).double().mean())
        y_pred = out if self.multilabel else out.argmax(-1, keepdim=True)
        y_true = y if self.multilabel else y.view(-1, 1)
        return float(self.evaluator.eval({"y_true": y_true, "y_pred": y_pred})[self.metric])


def resolve_data_dir(path: Optional[PathLike] = None) -> Path:
    """The data directory: ``path``, else ``$GATLIB_DATA``, else the user's cache."""
    if path is not None:
        return Path(path).expanduser()
    if os.environ.get("GATLIB_DATA"):
        return Path(os.environ["GATLIB_DATA"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "gatlib"


def canonical_name(name: str) -> str:
    """``"Cora"`` -> ``"cora"``, ``"ogbn_arxiv"`` -> ``"ogbn-arxiv"``; unknown names raise ``ValueError``."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")
    return key


def load_dataset(name: str, data_dir: Optional[PathLike] = None, *,
                 seed_from: Optional[PathLike] = None) -> NodeDataset:
    """Load a node-classification dataset by name (one of :data:`DATASETS`, case-insensitive).

    ``seed_from``: raw Planetoid files to copy in where missing (default ``$GATLIB_PLANETOID_RAW``). Raises
    :class:`DatasetNotFoundError` when the files are missing and cannot be downloaded.
    """
    key = canonical_name(name)
    root = resolve_data_dir(data_dir)
    if key in PLANETOID:
        return _load_planetoid(key, root, seed_from)
    return _load_ogb(key, root)


# Planetoid
def seed_planetoid(source: PathLike, data_dir: Optional[PathLike] = None) -> List[str]:
    """Copy the missing raw Planetoid files from ``source`` (laid out as ``<Name>/raw/ind.*`` or
    ``Planetoid/<Name>/raw``) into the data directory; returns the names whose complete file set was found."""
    source, found = Path(source), []
    for pretty in PLANETOID.values():
        src = _planetoid_raw_in(source, pretty)
        if src is None:
            continue
        dst = resolve_data_dir(data_dir) / "Planetoid" / pretty / "raw"
        dst.mkdir(parents=True, exist_ok=True)
        for f in _planetoid_raw_files(pretty):
            if not (dst / f).exists():
                # copyfile, not copy2: the source may be read-only, the cache must not be.
                shutil.copyfile(src / f, dst / f)
        found.append(pretty)
    return found


def _planetoid_raw_files(pretty: str) -> List[str]:
    return [f"ind.{pretty.lower()}.{f}" for f in _PLANETOID_FILES]


def _planetoid_raw_in(source: Path, pretty: str) -> Optional[Path]:
    for raw in (source / pretty / "raw", source / "Planetoid" / pretty / "raw"):
        if all((raw / f).is_file() for f in _planetoid_raw_files(pretty)):
            return raw
    return None


def _load_planetoid(key: str, root: Path, seed_from: Optional[PathLike]) -> NodeDataset:
    from torch_geometric.datasets import Planetoid
    from torch_geometric.transforms import NormalizeFeatures

    pretty = PLANETOID[key]
    raw = root / "Planetoid" / pretty / "raw"
    missing = [f for f in _planetoid_raw_files(pretty) if not (raw / f).is_file()]
    seed_from = seed_from if seed_from is not None else os.environ.get("GATLIB_PLANETOID_RAW")
    if missing and seed_from:
        seed_planetoid(seed_from, root)
        missing = [f for f in missing if not (raw / f).is_file()]
    if missing:
        url = f"{Planetoid.url}/{missing[0]}"
        _ensure_downloadable(url, f"{pretty}: the raw Planetoid files ind.{pretty.lower()}."
                             f"{{{','.join(_PLANETOID_FILES)}}}", raw,
                             "Copy them there, or pass seed_from= / set GATLIB_PLANETOID_RAW to a "
                             "directory holding <Name>/raw/ind.*")
    with _download_errors(bool(missing), pretty, raw, Planetoid.url):
        ds = Planetoid(str(root / "Planetoid"), pretty, split="public",
                       transform=NormalizeFeatures())
    data = ds[0]
    split = {s: m.nonzero().view(-1) for s, m in
             (("train", data.train_mask), ("valid", data.val_mask), ("test", data.test_mask))}
    return NodeDataset(key, data, split, ds.num_classes)


# OGB
def _allow_pyg_pickles() -> None:
    """ogb ``torch.load``s its processed PyG file with torch's default
    ``weights_only=True`` (torch >= 2.6): allow-list the PyG classes inside."""
    from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
    from torch_geometric.data.storage import GlobalStorage

    torch.serialization.add_safe_globals([DataEdgeAttr, DataTensorAttr, GlobalStorage])


def _ogb_meta(name: str) -> Dict[str, str]:
    import pandas as pd
    import ogb.nodeproppred

    master = pd.read_csv(Path(ogb.nodeproppred.__file__).parent / "master.csv",
                         index_col=0, keep_default_na=False)
    return {k: str(v) for k, v in master[name].items()}


def ogb_required_files(meta: Dict[str, str]) -> List[str]:
    """Files (relative to the dataset folder) of a prepared homogeneous OGB
    node dataset in the CSV layout, as ``PygNodePropPredDataset`` reads them."""
    raw = ["edge", "num-node-list", "num-edge-list", "node-label"]
    if meta["has_node_attr"] == "True":
        raw.append("node-feat")
    if meta["has_edge_attr"] == "True":
        raw.append("edge-feat")
    for key in ("additional node files", "additional edge files"):
        if meta[key] != "None":
            raw += meta[key].split(",")
    split = [f"split/{meta['split']}/{s}.csv.gz" for s in ("train", "valid", "test")]
    return [f"raw/{f}.csv.gz" for f in raw] + split


def _load_ogb(name: str, root: Path) -> NodeDataset:
    try:
        from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
    except ImportError as e:
        raise ImportError(f"{name} needs the ogb package: pip install 'gatlib[ogb]'") from e
    _allow_pyg_pickles()
    meta = _ogb_meta(name)
    # OGB's own layout, as PygNodePropPredDataset(root=DIR) writes it, is
    # DIR/ogbn_arxiv/: a user's existing download is used where it is;
    # otherwise gatlib keeps its OGB data in DIR/ogb/.
    ogb_root = root if (root / name.replace("-", "_")).is_dir() else root / "ogb"
    folder = ogb_root / name.replace("-", "_")
    missing = [f for f in ogb_required_files(meta) if not (folder / f).is_file()]
    release = folder / f"RELEASE_v{meta['version']}.txt"
    if folder.is_dir() and not release.exists():
        # ogb asks on stdin whether to delete a folder without its release
        # marker (a hang under CI). A complete folder is a prepared copy of
        # the current version (all ogbn datasets are at v1): mark it; never
        # delete user files.
        if missing:
            raise DatasetNotFoundError(
                f"{name}: {folder} exists but is incomplete (missing {', '.join(missing)}). "
                f"Delete the folder to download {name} again, or put the files there.")
        release.write_text(f"{name} version {meta['version']}, marked by gatlib\n")
    if missing:
        _ensure_downloadable(meta["url"], f"{name}: the OGB files {', '.join(missing)}", folder,
                             f"Unzip {meta['url']} into {ogb_root} and rename the folder "
                             f"{meta['download_name']}/ to {folder.name}/ (an existing OGB "
                             f"download in {root / folder.name}/ is used as it is)")
    with _download_errors(bool(missing), name, folder, meta["url"]):
        ds = PygNodePropPredDataset(name=name, root=str(ogb_root))
    return _from_ogb(ds, name, Evaluator(name))


def _from_ogb(ds, name: str, evaluator) -> NodeDataset:
    """A :class:`NodeDataset` from a loaded ``PygNodePropPredDataset``."""
    data = ds[0]
    multilabel = ds.num_tasks > 1
    if multilabel:
        data.y = data.y.float()
    else:
        data.y = data.y.view(-1)
    if data.x is None and data.edge_attr is not None:
        # ogbn-proteins has edge features only: a node gets the mean of its
        # in-edges' features, as in OGB's reference examples.
        from torch_geometric.utils import scatter

        data.x = scatter(data.edge_attr.float(), data.edge_index[1], 0,
                         dim_size=data.num_nodes, reduce="mean")
    if data.x is not None:
        data.x = data.x.float()
    num_classes = ds.num_tasks if multilabel else int(ds.num_classes)
    return NodeDataset(name, data, ds.get_idx_split(), num_classes, multilabel,
                       ds.eval_metric, evaluator)


# Download guards
def _unreachable(url: str, timeout: float = _PROBE_TIMEOUT_S) -> Optional[str]:
    """``None`` if ``url`` answers within ``timeout`` seconds, else why not."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code} from {url}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{url} is not reachable: {getattr(e, 'reason', e)}"


def _ensure_downloadable(url: str, what: str, where: Path, how: str) -> None:
    reason = _unreachable(url)
    if reason is not None:
        raise DatasetNotFoundError(
            f"{what} are expected in {where}, and downloading failed ({reason}). {how}; "
            f"or run once with internet access (the data directory is chosen by "
            f"--data-dir / data_dir=, else $GATLIB_DATA, else ~/.cache/gatlib).")


@contextlib.contextmanager
def _download_errors(downloading: bool, name: str, where: Path, url: str) -> Iterator[None]:
    """Turn a failed download inside a library into :class:`DatasetNotFoundError`."""
    if not downloading:
        yield
        return
    try:
        yield
    except (OSError, RuntimeError, EOFError) as e:  # EOFError: ogb's size prompt without stdin
        raise DatasetNotFoundError(
            f"{name}: downloading {url} into {where} failed ({type(e).__name__}: {e}). "
            f"Put the files there by hand, or retry with internet access.") from e
