"""Mini-batch training on sampled neighbourhoods (``gatlib bench --loader
neighbor``) and its data-parallel form under torchrun, on a fake ogbn-products
written in OGB's format (``sampled_setup.py``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch_geometric.data import Data

import gatlib
from gatlib.bench import cli
from gatlib.bench.data import load_dataset
from gatlib.bench.distributed import Distributed, chunk_range
from gatlib.bench.sampled import batch_hop_counts, hop_counts, layerwise_inference, neighbor_loader
from gatlib.bench.recipes import recipe, with_sampling
from gatlib.bench.train import benchmark, train_sampled_run
from gatlib.models import SampledGAT

from sampled_setup import deterministic_recipe, write_fake_products
from testing import random_graph

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def products_dir(tmp_path_factory):
    """A data directory holding the fake ogbn-products, already processed by ogb."""
    path = tmp_path_factory.mktemp("data")
    write_fake_products(path)
    load_dataset("ogbn-products", path)
    return path


@pytest.fixture(scope="module")
def products(products_dir):
    return load_dataset("ogbn-products", products_dir)


def _subprocess_env():
    """This checkout's gatlib (and the tests' helpers) in child processes, one thread each."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    return env


# ---------------------------------------------------------------------------
# Blocks and inference
# ---------------------------------------------------------------------------
def _small_graph(n=300, e=1500, f=12):
    torch.manual_seed(0)
    return Data(x=torch.randn(n, f), edge_index=random_graph(n, e), y=torch.randint(0, 5, (n,)),
                num_nodes=n)


@pytest.mark.usefixtures("auto_fused")
def test_trimmed_bipartite_layers_equal_the_whole_subgraph():
    """On a sampled batch, the hop-trimmed forward gives the seeds the logits a
    forward over the whole subgraph gives them — through the fused kernel on
    bipartite blocks of shrinking size."""
    data = _small_graph()
    model = SampledGAT(12, 5, hidden_channels=8, heads=2, num_layers=3).eval()
    batch = next(iter(neighbor_loader(data, input_nodes=torch.arange(40), num_neighbors=[4, 3, 2],
                                      batch_size=40)))
    counts = batch_hop_counts(batch, 3)
    assert counts[0] == 40 and sum(counts) == batch.num_nodes and min(counts[1:]) > 0
    with gatlib.record_kernels() as log:
        trimmed = model(batch.x, batch.edge_index, counts)
    whole = model(batch.x, batch.edge_index)[:40]
    assert trimmed.shape == (40, 5)
    torch.testing.assert_close(trimmed, whole, rtol=1e-5, atol=1e-6)
    assert log == ["fused"] * 3


def test_hop_counts_are_checked_not_assumed():
    # 0 <- 1 <- 2: one seed, one node per hop
    assert hop_counts(torch.tensor([[1, 2], [0, 1]]), 1, 3, 2) == [1, 1, 1]
    # node 1 two hops out, node 2 one hop: not numbered hop by hop
    with pytest.raises(RuntimeError, match="hop by hop"):
        hop_counts(torch.tensor([[2, 1], [0, 2]]), 1, 3, 2)
    with pytest.raises(RuntimeError, match="hop by hop"):  # a node 3 hops out of 2
        hop_counts(torch.tensor([[1, 2, 3], [0, 1, 2]]), 1, 4, 2)
    model = SampledGAT(4, 2, hidden_channels=4, heads=1, num_layers=2)
    with pytest.raises(ValueError, match="num_sampled_nodes"):
        model(torch.randn(3, 4), torch.tensor([[1, 2], [0, 1]]), [1, 1])


def test_layerwise_inference_is_the_full_graph_forward():
    data = _small_graph()
    model = SampledGAT(12, 5, hidden_channels=8, heads=2, num_layers=2).eval()
    loader = neighbor_loader(Data(edge_index=data.edge_index, num_nodes=300),
                             input_nodes=torch.arange(300), num_neighbors=[-1], batch_size=64)
    out = layerwise_inference(model, data.x, loader, 300, torch.device("cpu"))
    torch.testing.assert_close(out, model(data.x, data.edge_index), rtol=1e-5, atol=1e-6)
    assert [len(chunk_range(10, r, 3)) for r in range(3)] == [4, 4, 2]


# ---------------------------------------------------------------------------
# Training on the fake ogbn-products
# ---------------------------------------------------------------------------
def auto_on_blocks(kernels) -> bool:
    """What auto's size rule runs on the sampled blocks: the fused kernel, forward
    and backward, on the blocks large enough for it; the reference on the rest."""
    return {"fused", "fused.backward"} <= set(kernels) <= {"fused", "fused.backward", "torch"}


def test_fake_products_needs_the_graph(products):
    """The data behind the accuracy threshold below: 47 classes (chance ~2%),
    and a node's own features alone give a linear model well under 80%."""
    assert products.num_classes == 47 and products.num_features == 100
    assert products.evaluator is not None and products.metric == "acc"
    x, y = products.data.x, products.data.y
    train, test = products.split_idx["train"], products.split_idx["test"]
    assert len(train) % 2 == 0  # two ranks' shares hold every training node
    torch.manual_seed(0)
    lin = torch.nn.Linear(100, 47)
    opt = torch.optim.Adam(lin.parameters(), lr=0.01, weight_decay=1e-3)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(lin(x[train]), y[train]).backward()
        opt.step()
    assert float((lin(x[test]).argmax(-1) == y[test]).float().mean()) < 0.5


@pytest.mark.slow
def test_bench_neighbor_loader_learns_fake_products(products_dir, tmp_path):
    """`gatlib bench --loader neighbor`: PyG's products recipe, 10 epochs, above
    80% test accuracy (chance ~2%; features alone < 50%), the fused kernel on the
    sampled blocks, evaluated with OGB's Evaluator after the last epoch."""
    out = tmp_path / "products.json"
    code = cli.main(["bench", "--dataset", "ogbn-products", "--model", "gat", "--loader", "neighbor",
                     "--epochs", "10", "--runs", "1", "--device", "cpu", "--no-progress",
                     "--data-dir", str(products_dir), "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["loader"] == "neighbor" and auto_on_blocks(report["kernels"])
    cfg = report["config"]
    assert (cfg["model"], cfg["fanouts"], cfg["batch_size"], cfg["eval_batch_size"], cfg["lr"]) == (
        "SampledGAT", [10, 10, 5], 512, 2048, 0.001)
    assert cfg["model_kwargs"] == {"conv": "gat", "hidden_channels": 128, "heads": 4,
                                   "num_layers": 3, "dropout": 0.5}
    assert report["distributed"] == {"world_size": 1, "backend": None,
                                     "batch_size_per_process": 512, "global_batch_size": 512}
    run = report["runs"][0]
    assert run["epochs"] == 10 and run["best_epoch"] == 10 and run["world_size"] == 1
    assert [h["epoch"] for h in run["history"]] == list(range(1, 11))
    # PyG's schedule evaluates after epochs 60, 70, ...; a shorter run after its last
    assert [h["val_acc"] is None for h in run["history"]] == [True] * 9 + [False]
    assert run["history"][-1]["val_acc"] == run["val_acc"]
    assert run["history"][-1]["loss"] < run["history"][0]["loss"]
    assert report["test_acc"][0] > 80


@pytest.mark.slow
def test_shuffled_training_labels_stay_below_the_threshold(products):
    """The same run learning nothing real (training labels permuted) stays far
    below the 80% the test above asks for."""
    y = products.data.y.clone()
    train = products.split_idx["train"]
    y[train] = y[train][torch.randperm(len(train), generator=torch.Generator().manual_seed(0))]
    data = products.data.clone()
    data.y = y
    report = benchmark(replace(products, data=data), "gat", runs=1, loader="neighbor", epochs=10,
                       progress=False)
    assert report["test_acc"][0] < 20


def test_sampled_run_follows_the_recipes_schedule(products):
    """Evaluated after epochs eval_after+eval_every, ... and the last; the
    selected epoch is the best evaluated one."""
    rcp = replace(deterministic_recipe(300, 6), eval_every=2, eval_after=1)
    res = train_sampled_run(products, rcp, seed=0)
    evaluated = [h["epoch"] for h in res.history if h["val_acc"] is not None]
    assert evaluated == [2, 4, 6]
    best = max(evaluated, key=lambda e: res.history[e - 1]["val_acc"])
    assert res.best_epoch == best and res.val_acc == res.history[best - 1]["val_acc"]


# ---------------------------------------------------------------------------
# Two processes (torchrun)
# ---------------------------------------------------------------------------
def _torchrun(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *args], capture_output=True, text=True,
                          timeout=timeout, env=_subprocess_env(), cwd=TESTS)


@pytest.mark.slow
def test_two_processes_match_one(products_dir, products, tmp_path):
    """2 processes with batches of 100 against 1 process with batches of 200,
    same seed, full neighbourhoods and no dropout (nothing random after
    initialisation): each step's two batches are the single run's batch split
    in two, so DDP's averaged gradient is the single run's. First-step
    gradients agree to float32 summation order (rtol 1e-4); the 5-epoch learning
    curves too: losses to rtol 1e-4, validation accuracy to one of its 400
    nodes (a near-tie may flip). Without DDP's all-reduce each rank's
    gradient is that of half the batch, off by O(1) relative."""
    res = _torchrun(str(TESTS / "ddp_worker.py"), str(products_dir), str(tmp_path), "100", "5")
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(r["world_size"] == 2 for r in ranks)

    grads = {}
    one = train_sampled_run(products, deterministic_recipe(200, 5), seed=0,
                            on_step=lambda step, model: step == 1 and grads.update(
                                {k: p.grad.clone() for k, p in model.named_parameters()}))
    for rank in ranks:
        assert rank["grads"].keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(rank["grads"][name], g, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
        assert [h["epoch"] for h in rank["history"]] == [h["epoch"] for h in one.history]
        for mine, ref in zip(rank["history"], one.history, strict=True):
            assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4)
            assert mine["train_acc"] == pytest.approx(ref["train_acc"], abs=100 / 1200 + 1e-9)
            assert mine["val_acc"] == pytest.approx(ref["val_acc"], abs=100 / 400 + 1e-9)
    assert ranks[0]["history"] == ranks[1]["history"]  # reduced: every rank reports the same
    assert one.history[-1]["loss"] < 0.8 * one.history[0]["loss"]  # it trained


@pytest.mark.slow
def test_torchrun_gatlib_bench(products_dir, tmp_path):
    """The documented command: `torchrun --nproc-per-node 2 --no-python gatlib
    bench ... --loader neighbor` trains, rank 0 alone prints the table and writes
    the JSON, which says two processes trained."""
    gatlib_script = Path(sys.executable).parent / "gatlib"
    out = tmp_path / "ddp.json"
    res = _torchrun("--no-python", str(gatlib_script), "bench", "--dataset", "ogbn-products",
                    "--model", "gat", "--loader", "neighbor", "--epochs", "8", "--runs", "1",
                    "--device", "cpu", "--data-dir", str(products_dir), "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("test acc (%)") == 1 and res.stdout.count("results:") == 1
    assert "cpu x 2 processes" in res.stdout
    report = json.loads(out.read_text())
    assert report["distributed"] == {"world_size": 2, "backend": "gloo",
                                     "batch_size_per_process": 512, "global_batch_size": 1024}
    assert report["runs"][0]["world_size"] == 2 and auto_on_blocks(report["kernels"])
    assert report["test_acc"][0] > 80
    assert list(tmp_path.iterdir()) == [out]


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--loader", "neighbor", "--fanouts", "10,10"], "--fanouts.*3 integers.*got \\[10, 10\\]"),
    (["--loader", "neighbor", "--fanouts", "10,0,5"], "--fanouts.*>= 1 or -1"),
    (["--loader", "neighbor", "--batch-size", "0"], "--batch-size.*>= 1; got 0"),
    (["--fanouts", "10,10,5"], "--fanouts apply to --loader neighbor"),
    (["--batch-size", "64"], "--batch-size apply to --loader neighbor"),
    (["--loader", "neighbor", "--num-workers", "-1"], "--num-workers must be >= 0"),
])
def test_bad_sampling_options_name_the_option(tmp_path, capsys, args, message):
    """Checked before any data is loaded (the data directory here is empty)."""
    import re

    code = cli.main(["bench", "--dataset", "ogbn-products", "--model", "gat",
                     "--data-dir", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err), err
    assert not any(tmp_path.iterdir())


def test_unparsable_options_are_usage_errors(capsys):
    for args, message in ((["--fanouts", "10,x,5"], "argument --fanouts: expected comma-separated"),
                          (["--loader", "cluster"], "argument --loader: invalid choice")):
        with pytest.raises(SystemExit) as info:
            cli.main(["bench", "--dataset", "ogbn-products", "--model", "gat", *args])
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_full_batch_refuses_several_processes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["bench", "--dataset", "cora", "--model", "gat",
                     "--data-dir", str(tmp_path)]) == 2
    assert "--loader full trains on the whole graph in one process" in capsys.readouterr().err
    fake = Distributed(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ValueError, match="loader='neighbor'"):
        benchmark(SimpleNamespace(name="cora"), "gat", runs=1, dist=fake)


def test_sampling_arguments_in_python(tmp_path):
    rcp = recipe("gatv2", "ogbn-products", "neighbor")
    assert rcp.model_kwargs["conv"] == "gatv2" and not rcp.undirected
    assert recipe("gat", "ogbn-arxiv", "neighbor").undirected
    assert with_sampling(rcp, fanouts=[-1, 5, 5], batch_size=8).fanouts == [-1, 5, 5]
    with pytest.raises(ValueError, match="fanouts"):
        with_sampling(rcp, fanouts=[5, 5, -2])
    with pytest.raises(ValueError, match="batch_size"):
        with_sampling(rcp, batch_size=True)
    with pytest.raises(ValueError, match="apply to loader='neighbor'"):
        with_sampling(recipe("gat", "cora"), fanouts=[5, 5])
    with pytest.raises(ValueError, match="loader='neighbor' trains gat or gatv2"):
        recipe("transformer", "ogbn-products", "neighbor")
    with pytest.raises(ValueError, match="loader must be one of full, neighbor"):
        recipe("gat", "cora", "cluster")
