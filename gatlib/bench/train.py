"""One training run of a recipe (:mod:`gatlib.bench.recipes`), full-batch or on
sampled mini-batches, and the multi-seed benchmark of ``gatlib bench``.
"""
from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch_geometric.data import Data

from .. import GraphPlan, models, record_kernels
from .data import NodeDataset
from .measure import proc_status
from .recipes import Recipe, SampledRecipe, recipe, with_sampling
from .report import environment
from .distributed import Distributed, chunk_range
from .sampled import batch_hop_counts, derived_seed, layerwise_inference, neighbor_loader


_SPARSE_FEATURES = 0.1  # density below which prepare_graph stores features as sparse CSR


@dataclass
class RunResult:
    """One training run; metrics in % of the selected weights (ROC-AUC for ogbn-proteins),
    ``best_epoch`` 1-based, ``peak_memory_mib`` peak RSS (CPU) or peak allocated (CUDA)."""

    seed: int
    test_acc: float
    val_acc: float
    epochs: int
    best_epoch: int
    seconds_per_epoch: float
    peak_memory_mib: Optional[float]


@dataclass
class SampledRunResult(RunResult):
    """A run of a :class:`SampledRecipe`; ``history`` per epoch: ``epoch``, mean ``loss``
    over all processes' batches, approximate ``train_acc`` and ``val_acc`` (``None`` where not evaluated)."""

    train_seconds_per_epoch: float = 0.0
    world_size: int = 1
    history: List[Dict[str, Any]] = field(default_factory=list)


def prepare_graph(dataset: NodeDataset, rcp: Recipe, device: torch.device | str,
                  sparse_features: bool = True) -> Data:
    """The graph a recipe trains on (reverse edges, positional encoding,
    self-loops), on ``device``; with ``sparse_features``, features that are
    mostly zeros become a sparse CSR tensor."""
    from torch_geometric.utils import add_self_loops, remove_self_loops, to_undirected

    data = copy.copy(dataset.data)
    if rcp.undirected:
        data.edge_index = to_undirected(data.edge_index, num_nodes=data.num_nodes)
    if rcp.pe is not None:  # of the graph itself, before any self-loops
        data = models.positional_encoding(rcp.pe, rcp.pe_dim)(data)
    if rcp.self_loops:
        edge_index = remove_self_loops(data.edge_index)[0]
        data.edge_index = add_self_loops(edge_index, num_nodes=data.num_nodes)[0]
    keep = ["x", "edge_index", "y"] + (["pe"] if rcp.pe is not None else [])
    data = Data(**{k: data[k] for k in keep}, num_nodes=data.num_nodes)
    if (sparse_features and data.x.layout == torch.strided
            and data.x.count_nonzero() < _SPARSE_FEATURES * data.x.numel()):
        # Bag-of-words features (Planetoid: ~1% nonzero) as CSR make the first
        # layer's matmul and the input dropout O(nnz) instead of O(nodes x features).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
            data.x = data.x.to_sparse_csr()
    return data.to(device)


def build_model(rcp: Recipe, dataset: NodeDataset, backend: str = "auto") -> torch.nn.Module:
    """A freshly initialised model for ``rcp`` (seed the RNG first)."""
    kwargs = dict(rcp.model_kwargs, backend=backend)
    if rcp.pe is not None:
        kwargs.update(pe=rcp.pe, pe_dim=rcp.pe_dim)
    return getattr(models, rcp.model)(dataset.num_features, dataset.num_classes, **kwargs)


def train_run(dataset: NodeDataset, rcp: Recipe, *, seed: int, device: torch.device | str = "cpu",
              backend: str = "auto", graph: Optional[Data] = None,
              on_epoch: Optional[Callable[[int, float, float], None]] = None) -> RunResult:
    """Train one model from scratch (seeded) and evaluate the selected weights; ``graph``:
    :func:`prepare_graph`'s output to reuse; ``on_epoch(epoch, loss, val)`` for progress displays."""
    from torch_geometric import seed_everything

    device = torch.device(device)
    graph = prepare_graph(dataset, rcp, device) if graph is None else graph
    split = {k: v.to(device) for k, v in dataset.split_idx.items()}
    seed_everything(seed)
    model = build_model(rcp, dataset, backend).to(device)
    Opt = {"adam": torch.optim.Adam, "rmsprop": torch.optim.RMSprop}[rcp.optimizer]
    opt = Opt(model.parameters(), lr=rcp.lr, weight_decay=rcp.weight_decay)
    loss_fn = F.binary_cross_entropy_with_logits if dataset.multilabel else F.cross_entropy
    inputs = {"pe": graph.pe} if rcp.pe is not None else {}
    # The graph is checked and sorted once, not in every layer of every epoch.
    plan = GraphPlan(graph.edge_index, num_nodes=graph.num_nodes)

    def forward():
        return model(graph.x, plan, **inputs)

    stop = _Stopping(rcp)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, epoch = time.perf_counter(), 0
    for epoch in range(1, rcp.epochs + 1):
        if epoch <= rcp.warmup_epochs:
            for group in opt.param_groups:
                group["lr"] = rcp.lr * epoch / rcp.warmup_epochs
        model.train()
        opt.zero_grad()
        out = forward()
        loss = loss_fn(out[split["train"]], graph.y[split["train"]])
        loss.backward()
        opt.step()

        model.eval()
        with torch.no_grad():
            out = forward()
            val_loss = float(loss_fn(out[split["valid"]], graph.y[split["valid"]]))
        val_metric = dataset.evaluate(out, "valid")
        if on_epoch is not None:
            on_epoch(epoch, float(loss.detach()), val_metric)
        if stop.update(epoch, val_loss, val_metric, model):
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start

    model.load_state_dict(stop.state)
    model.eval()
    with torch.no_grad():
        out = forward()
    return RunResult(seed=seed, test_acc=round(100 * dataset.evaluate(out, "test"), 6),
                     val_acc=round(100 * dataset.evaluate(out, "valid"), 6), epochs=epoch,
                     best_epoch=stop.best_epoch, seconds_per_epoch=seconds / max(epoch, 1),
                     peak_memory_mib=peak_memory_mib(device))


def train_sampled_run(dataset: NodeDataset, rcp: SampledRecipe, *, seed: int,
                      device: torch.device | str = "cpu", backend: str = "auto",
                      graph: Optional[Data] = None,
                      on_epoch: Optional[Callable[[int, float, Optional[float]], None]] = None,
                      num_workers: int = 0, dist: Optional[Distributed] = None,
                      on_step: Optional[Callable[[int, torch.nn.Module], None]] = None
                      ) -> SampledRunResult:
    """Train one model on sampled mini-batches and evaluate the selected weights
    (docs/distributed.md says how processes share the work); with ``dist`` every rank returns the same result.
    ``on_step(step, model)`` is called after each backward, before the optimiser step."""
    from torch.utils.data import DistributedSampler
    from torch_geometric import seed_everything

    device = torch.device(device) if dist is None else dist.device
    rank, world = (0, 1) if dist is None else (dist.rank, dist.world_size)
    if graph is None:
        graph = prepare_graph(dataset, rcp, "cpu", sparse_features=False)
    if graph.x.layout != torch.strided:
        raise ValueError("sampled training gathers feature rows: pass a dense graph "
                         "(prepare_graph(..., sparse_features=False))")
    seed_everything(seed)
    model = build_model(rcp, dataset, backend).to(device)
    net = model
    if dist is not None:
        from torch.nn.parallel import DistributedDataParallel

        # DDP broadcasts rank 0's initial weights and averages gradients over ranks.
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                      else None)
        if rank > 0:  # own sampling and dropout streams
            torch.manual_seed(derived_seed(seed, rank))
    opt = {"adam": torch.optim.Adam, "rmsprop": torch.optim.RMSprop}[rcp.optimizer](
        model.parameters(), lr=rcp.lr, weight_decay=rcp.weight_decay)
    loss_fn = F.binary_cross_entropy_with_logits if dataset.multilabel else F.cross_entropy
    hops = model.num_layers

    train_idx = dataset.split_idx["train"]
    share = DistributedSampler(range(train_idx.numel()), num_replicas=world, rank=rank,
                               shuffle=True, seed=derived_seed(seed, 1 << 20), drop_last=True)
    train_loader = neighbor_loader(graph, input_nodes=train_idx, num_neighbors=rcp.fanouts,
                                   batch_size=rcp.batch_size, sampler=share,
                                   num_workers=num_workers)
    eval_nodes = torch.tensor(chunk_range(graph.num_nodes, rank, world))
    eval_loader = neighbor_loader(Data(edge_index=graph.edge_index, num_nodes=graph.num_nodes),
                                  input_nodes=eval_nodes, num_neighbors=[-1],
                                  batch_size=rcp.eval_batch_size, num_workers=num_workers)

    def reduce(*values: float) -> List[float]:
        t = torch.tensor(values, dtype=torch.float64)
        return (t if dist is None else dist.all_reduce(t)).tolist()

    stop, history = _Stopping(rcp), []
    val_at: Dict[int, float] = {}
    test_at: Dict[int, float] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, train_seconds, step, epoch = time.perf_counter(), 0.0, 0, 0
    for epoch in range(1, rcp.epochs + 1):
        if epoch <= rcp.warmup_epochs:
            for group in opt.param_groups:
                group["lr"] = rcp.lr * epoch / rcp.warmup_epochs
        share.set_epoch(epoch)
        tic = time.perf_counter()
        net.train()
        loss_sum = batches = correct = seen = 0.0
        for batch in train_loader:
            batch = batch.to(device)
            counts = batch_hop_counts(batch, hops)
            opt.zero_grad()
            out = net(batch.x, batch.edge_index, counts)  # [B, C]: the seeds
            y = batch.y[:batch.batch_size]
            loss = loss_fn(out, y)
            loss.backward()
            step += 1
            if on_step is not None:
                on_step(step, model)
            opt.step()
            loss_sum, batches = loss_sum + float(loss.detach()), batches + 1
            if not dataset.multilabel:
                correct += int((out.argmax(-1) == y).sum())
            seen += batch.batch_size
        loss_sum, batches, correct, seen = reduce(loss_sum, batches, correct, seen)
        train_seconds += time.perf_counter() - tic
        loss = loss_sum / max(batches, 1)
        entry: Dict[str, Any] = {"epoch": epoch, "loss": loss,
                                 "train_acc": None if dataset.multilabel
                                 else round(100 * correct / max(seen, 1), 6),
                                 "val_acc": None}
        val_metric = None
        if rcp.evaluates(epoch):
            model.eval()
            out = layerwise_inference(model, graph.x, eval_loader, graph.num_nodes, device, dist)
            val_idx = dataset.split_idx["valid"]
            val_loss = float(loss_fn(out[val_idx], graph.y[val_idx]))
            val_metric = dataset.evaluate(out, "valid")
            val_at[epoch], test_at[epoch] = val_metric, dataset.evaluate(out, "test")
            entry["val_acc"] = round(100 * val_metric, 6)
            stopping = stop.update(epoch, val_loss, val_metric, model)
        else:
            stopping = False
        history.append(entry)
        if on_epoch is not None:
            on_epoch(epoch, loss, val_metric)
        if stopping:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = peak_memory_mib(device)
    if dist is not None and peak is not None:
        peak = dist.all_reduce(torch.tensor([peak], dtype=torch.float64), "max").item()
    # The selected epoch's test metric came from the same deterministic
    # inference its validation metric did: no second pass over the graph.
    best = stop.best_epoch
    return SampledRunResult(
        seed=seed, test_acc=round(100 * test_at[best], 6), val_acc=round(100 * val_at[best], 6),
        epochs=epoch,
        best_epoch=stop.best_epoch, seconds_per_epoch=seconds / max(epoch, 1),
        peak_memory_mib=peak, train_seconds_per_epoch=train_seconds / max(epoch, 1),
        world_size=world, history=history)


class _Stopping:
    """Model selection and early stopping on the validation split (see :class:`Recipe`)."""

    def __init__(self, rcp: Recipe):
        if rcp.stopping not in ("gat", "best_val"):
            raise ValueError(f"stopping must be 'gat' or 'best_val'; got {rcp.stopping!r}")
        self.rule, self.patience = rcp.stopping, rcp.patience
        self.min_loss, self.max_acc = math.inf, -math.inf
        self.bad_epochs, self.best_epoch, self.state = 0, 0, None

    def update(self, epoch: int, val_loss: float, val_acc: float, model: torch.nn.Module) -> bool:
        """Record an epoch; ``True`` when training should stop."""
        if self.rule == "gat":
            improved = val_acc >= self.max_acc or val_loss <= self.min_loss
            save = val_acc >= self.max_acc and val_loss <= self.min_loss
        else:
            improved = save = val_acc > self.max_acc
        if save:
            self.best_epoch = epoch
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if improved:
            self.max_acc, self.min_loss = max(self.max_acc, val_acc), min(self.min_loss, val_loss)
            self.bad_epochs = 0
        else:
            self.bad_epochs += 1
        return self.patience is not None and self.bad_epochs >= self.patience


def peak_memory_mib(device: torch.device | str = "cpu") -> Optional[float]:
    """Peak memory in MiB: ``torch.cuda.max_memory_allocated`` on CUDA, the
    process's peak resident set (``VmHWM``) on CPU; ``None`` where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm = proc_status().get("VmHWM")
    return None if hwm is None else hwm / 2**20


def benchmark(dataset: NodeDataset, model: str, *, runs: int, device: torch.device | str = "cpu",
              backend: str = "auto", seed: int = 0, epochs: Optional[int] = None,
              patience: Optional[int] = None, pe: Optional[str] = None, progress: bool = True,
              on_update: Optional[Callable[[Dict[str, Any]], None]] = None,
              loader: str = "full", fanouts: Optional[List[int]] = None,
              batch_size: Optional[int] = None, num_workers: int = 0,
              dist: Optional[Distributed] = None) -> Dict[str, Any]:
    """Train ``runs`` models with seeds ``seed, seed+1, ...`` and return the report (runs, test and
    validation mean/std, config, kernels, environment); the other arguments override the recipe.

    Ctrl-C discards the run in progress and returns the finished ones with ``"interrupted": True``. With ``dist``
    every process calls this and all return the same report, which rank 0 writes; ``on_update`` gets the report
    after every run.
    """
    from tqdm.auto import tqdm

    rcp = recipe(model, dataset.name, loader)
    if dist is not None and dist.world_size > 1 and loader != "neighbor":
        raise ValueError(f"loader={loader!r} trains on the whole graph in one process; "
                         f"{dist.world_size} processes train data-parallel with "
                         f"loader='neighbor' (--loader neighbor)")
    rcp = with_sampling(rcp, fanouts=fanouts, batch_size=batch_size)
    if epochs is not None:
        rcp = replace(rcp, epochs=epochs)
    if patience is not None:
        rcp = replace(rcp, patience=patience)
    if pe is not None:
        if rcp.model != "GraphTransformer":
            raise ValueError(f"--pe applies to the Planetoid transformer, not to {rcp.model}")
        rcp = replace(rcp, pe=None if pe == "none" else pe,
                      pe_dim={"none": 0, "laplacian": 8, "random_walk": 16}[pe])
    device = torch.device(device) if dist is None else dist.device
    sampled = isinstance(rcp, SampledRecipe)
    # Sampled batches gather feature rows: the graph stays dense and on the CPU,
    # where the sampler runs; each batch moves to the device.
    graph = prepare_graph(dataset, rcp, "cpu" if sampled else device, sparse_features=not sampled)
    report: Dict[str, Any] = {
        "dataset": dataset.name, "model": model, "metric": dataset.metric, **environment(device),
        "backend": backend, "kernels": None, "runs_requested": runs,
        "config": {"seed": seed, **asdict(rcp)},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "interrupted": False, "runs": [],
    }
    if sampled:
        world = 1 if dist is None else dist.world_size
        report.update(loader=loader, num_workers=num_workers,
                      distributed={"world_size": world,
                                   "backend": None if dist is None else dist.backend,
                                   "batch_size_per_process": rcp.batch_size,
                                   "global_batch_size": world * rcp.batch_size})
    results: List[RunResult] = []
    # disable=None: tqdm stays quiet when stderr is not a terminal
    quiet = None if progress else True
    bar = tqdm(range(runs), desc=f"{dataset.name} {model}", unit="run", disable=quiet)
    metric = "ROC-AUC" if dataset.metric == "rocauc" else "acc"
    try:
        for i in bar:
            epochs_bar = tqdm(total=rcp.epochs, desc=f"  run {i + 1}/{runs}", unit="epoch",
                              leave=False, disable=quiet)
            # Which kernels ran is recorded in the first run; the others run the same calls.
            try:
                with record_kernels() if i == 0 else contextlib.nullcontext() as log:
                    on_epoch = _epoch_progress(epochs_bar, metric)
                    if sampled:
                        res = train_sampled_run(dataset, rcp, seed=seed + i, device=device,
                                                backend=backend, graph=graph, on_epoch=on_epoch,
                                                num_workers=num_workers, dist=dist)
                    else:
                        res = train_run(dataset, rcp, seed=seed + i, device=device,
                                        backend=backend, graph=graph, on_epoch=on_epoch)
            finally:
                epochs_bar.close()
            if i == 0:
                report["kernels"] = list(dict.fromkeys(log))
            results.append(res)
            _summarise(report, results)
            bar.set_postfix(test=f"{res.test_acc:.1f}", mean=f"{report['test_acc_mean']:.2f}")
            if on_update is not None:
                on_update(report)
    except KeyboardInterrupt:
        report["interrupted"] = True
    finally:
        bar.close()
    _summarise(report, results)
    return report


def _epoch_progress(bar, metric: str) -> Callable[[int, float, Optional[float]], None]:
    """``train_run``'s ``on_epoch`` for a tqdm bar over a run's epochs (its ETA
    is to the recipe's maximum; early stopping ends a run sooner). A sampled
    run reports ``val=None`` for epochs it did not evaluate."""
    def on_epoch(epoch: int, loss: float, val: Optional[float]) -> None:
        post = {"loss": f"{loss:.4f}"}
        if val is not None:
            post[f"val {metric}"] = f"{100 * val:.2f}"
        bar.set_postfix(post, refresh=False)
        bar.update(epoch - bar.n)

    return on_epoch


def _summarise(report: Dict[str, Any], results: List[RunResult]) -> None:
    def mean_std(xs):
        if not xs:
            return None, None
        return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)

    test, val = [r.test_acc for r in results], [r.val_acc for r in results]
    report["runs"] = [asdict(r) for r in results]
    report["runs_completed"] = len(results)
    report["test_acc"] = test
    report["test_acc_mean"], report["test_acc_std"] = mean_std(test)
    report["val_acc_mean"], report["val_acc_std"] = mean_std(val)
    report["epochs_mean"] = mean_std([r.epochs for r in results])[0]
    report["seconds_per_epoch_mean"] = mean_std([r.seconds_per_epoch for r in results])[0]
    peaks = [r.peak_memory_mib for r in results if r.peak_memory_mib is not None]
    report["peak_memory_mib"] = max(peaks) if peaks else None
