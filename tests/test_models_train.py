"""Models and training: shapes, backend plumbing, sparse inputs, the GAT
stopping rule, and short runs on Cora that learn."""
from __future__ import annotations

import copy
import io
import re
import sys
from dataclasses import replace

import pytest
import torch

from gatlib import GATConv, GATv2Conv, TransformerConv
from gatlib.bench.data import load_dataset
from gatlib.models import (GAT, GATv2, DeepGAT, GraphTransformer, SampledGAT, UniMP, input_dropout,
                           positional_encoding)
from gatlib.bench.recipes import Recipe, recipe
from gatlib.bench.train import _Stopping, benchmark, build_model, prepare_graph, train_run

from ogb_fake import planetoid_raw_dir
from testing import random_graph

N, F_IN, C = 40, 12, 3


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def cora(tmp_path_factory):
    return load_dataset("cora", tmp_path_factory.mktemp("data"), seed_from=planetoid_raw_dir())


def _attention_layers(model):
    return [m for m in model.modules() if isinstance(m, (GATConv, GATv2Conv, TransformerConv))]


@pytest.mark.parametrize("make", [
    lambda b: GAT(F_IN, C, backend=b),
    lambda b: GATv2(F_IN, C, out_heads=2, backend=b),
    lambda b: GraphTransformer(F_IN, C, hidden_channels=16, heads=4, num_layers=2, backend=b),
    lambda b: GraphTransformer(F_IN, C, hidden_channels=16, heads=2, norm="layer", pe="random_walk",
                               pe_dim=4, backend=b),
    lambda b: GraphTransformer(F_IN, C, hidden_channels=16, heads=4, num_layers=2,
                               input_attention=True, readout="attention", backend=b),
    lambda b: DeepGAT(F_IN, C, hidden_channels=8, heads=2, backend=b),
    lambda b: DeepGAT(F_IN, C, hidden_channels=8, heads=2, conv="gatv2", backend=b),
    lambda b: UniMP(F_IN, C, hidden_channels=8, heads=2, backend=b),
    lambda b: SampledGAT(F_IN, C, hidden_channels=8, heads=2, backend=b),
    lambda b: SampledGAT(F_IN, C, hidden_channels=8, heads=2, num_layers=2, conv="gatv2", backend=b),
])
def test_models_shapes_backend_and_gradients(make):
    torch.manual_seed(0)
    x, ei = torch.randn(N, F_IN), random_graph(N, 150)
    model = make("torch")
    layers = _attention_layers(model)
    assert layers and all(layer.backend == "torch" for layer in layers)
    kwargs = {"pe": torch.randn(N, 4)} if getattr(model, "pe", None) else {}
    out = model(x, ei, **kwargs)
    assert out.shape == (N, C) and torch.isfinite(out).all()
    out.square().mean().backward()
    # TransformerConv(root_weight=False) keeps an unused lin_skip, as PyG does
    used = [p for name, p in model.named_parameters() if "lin_skip" not in name
            or not isinstance(model, GraphTransformer)]
    assert all(p.grad is not None for p in used)
    model.eval()  # deterministic in eval mode
    assert torch.equal(model(x, ei, **kwargs), model(x, ei, **kwargs))


def test_models_reject_bad_configuration():
    with pytest.raises(ValueError, match="divisible"):
        GraphTransformer(F_IN, C, hidden_channels=10, heads=4)
    with pytest.raises(ValueError, match="norm"):
        GraphTransformer(F_IN, C, norm="group")
    with pytest.raises(ValueError, match="pe must be"):
        GraphTransformer(F_IN, C, pe="laplacian", pe_dim=0)
    with pytest.raises(ValueError, match="readout"):
        GraphTransformer(F_IN, C, readout="mlp")
    with pytest.raises(ValueError, match="num_layers"):
        GraphTransformer(F_IN, C, num_layers=0)
    with pytest.raises(ValueError, match="backend"):
        GAT(F_IN, C, backend="nope")
    with pytest.raises(ValueError, match="pass pe"):
        GraphTransformer(F_IN, C, hidden_channels=16, pe="laplacian", pe_dim=4)(
            torch.randn(N, F_IN), random_graph(N, 50))


def test_sparse_features_give_the_dense_result():
    torch.manual_seed(0)
    x = torch.randn(N, F_IN) * (torch.rand(N, F_IN) < 0.1)
    ei = random_graph(N, 150)
    for model in (GAT(F_IN, C), GraphTransformer(F_IN, C, hidden_channels=16),
                  GraphTransformer(F_IN, C, hidden_channels=16, input_attention=True,
                                   readout="attention"), UniMP(F_IN, C, 8)):
        model.eval()
        torch.testing.assert_close(model(x.to_sparse_csr(), ei), model(x, ei))


def test_input_dropout_on_sparse_values():
    torch.manual_seed(0)
    x = torch.rand(200, 300) * (torch.rand(200, 300) < 0.05)
    y = input_dropout(x.to_sparse_csr(), 0.6, True).to_dense()
    kept = y != 0
    assert not kept[x == 0].any()
    torch.testing.assert_close(y[kept], x[kept] / 0.4)
    assert 0.5 < 1 - kept.sum() / (x != 0).sum() < 0.7
    assert input_dropout(x, 0.6, False) is x


def test_positional_encodings(cora):
    data = cora.data
    for kind, dim in (("laplacian", 4), ("random_walk", 5)):
        pe = positional_encoding(kind, dim)(data.clone()).pe
        assert pe.shape == (data.num_nodes, dim) and torch.isfinite(pe).all()
    with pytest.raises(ValueError):
        positional_encoding("spectral", 3)


class _Constant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))


def test_gat_stopping_rule_follows_the_reference_code():
    """Improvement = loss <= min OR acc >= max; weights saved when both hold."""
    stop, model = _Stopping(Recipe("GAT", patience=2)), _Constant()
    history = [  # (val_loss, val_acc)
        (1.0, 0.5),  # both: save (epoch 1)
        (0.9, 0.4),  # loss only: counter reset, no save
        (1.1, 0.5),  # acc ties the max: counter reset, no save (loss 1.1 > 0.9)
        (0.8, 0.6),  # both: save (epoch 4)
        (0.85, 0.55),  # neither: 1
        (0.9, 0.5),  # neither: 2 -> stop
    ]
    stops = []
    for epoch, (loss, acc) in enumerate(history, 1):
        model.w.data.fill_(epoch)
        stops.append(stop.update(epoch, loss, acc, model))
    assert stops == [False] * 5 + [True]
    assert stop.best_epoch == 4 and stop.state["w"].item() == 4


def test_best_val_rule_keeps_the_best_epoch():
    stop, model = _Stopping(Recipe("UniMP", stopping="best_val", patience=None)), _Constant()
    for epoch, acc in enumerate([0.3, 0.6, 0.5, 0.6, 0.4], 1):
        model.w.data.fill_(epoch)
        assert not stop.update(epoch, 1.0, acc, model)
    assert stop.best_epoch == 2 and stop.state["w"].item() == 2


def test_recipes_follow_the_papers():
    gat = recipe("gat", "cora")
    assert (gat.model, gat.lr, gat.weight_decay, gat.patience, gat.stopping) == ("GAT", 0.005, 5e-4, 100, "gat")
    pubmed = recipe("gatv2", "pubmed")
    assert (pubmed.model, pubmed.model_kwargs, pubmed.lr, pubmed.weight_decay) == (
        "GATv2", {"out_heads": 8}, 0.01, 1e-3)
    arxiv = recipe("gat", "ogbn-arxiv")
    assert arxiv.model == "DeepGAT" and arxiv.undirected and arxiv.stopping == "best_val"
    assert recipe("transformer", "ogbn-products").model == "UniMP"
    with pytest.raises(ValueError, match="unknown model"):
        recipe("gcn", "cora")


def test_prepare_graph_stores_bag_of_words_sparse(cora):
    graph = prepare_graph(cora, recipe("gat", "cora"), "cpu")
    assert graph.x.layout == torch.sparse_csr
    torch.testing.assert_close(graph.x.to_dense(), cora.data.x)
    assert torch.equal(graph.edge_index, cora.data.edge_index)


def test_prepare_graph_adds_exactly_one_self_loop_per_node(cora):
    rcp = recipe("transformer", "cora")
    assert rcp.self_loops
    data = copy.copy(cora.data)
    # one node already has a loop, which must not be doubled
    data.edge_index = torch.cat([cora.data.edge_index, torch.tensor([[5], [5]])], dim=1)
    graph = prepare_graph(replace(cora, data=data), rcp, "cpu")
    src, dst = graph.edge_index
    loops = src == dst
    assert torch.equal(torch.sort(src[loops]).values, torch.arange(cora.data.num_nodes))
    assert torch.equal(graph.edge_index[:, ~loops], cora.data.edge_index)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gat", "gatv2", "transformer"])
def test_short_training_run_learns_cora(cora, model):
    """A few dozen epochs reach far above chance (1/7 = 14%) on the public split
    (the transformer, with value dropout on both attention layers, starts slower)."""
    epochs = 100 if model == "transformer" else 40
    rcp = replace(recipe(model, "cora"), epochs=epochs)
    res = train_run(cora, rcp, seed=0, backend="torch")
    assert res.epochs == epochs and 1 <= res.best_epoch <= epochs
    assert res.test_acc > 65 and res.val_acc > 65
    assert res.seconds_per_epoch > 0 and res.peak_memory_mib > 0


def test_training_is_reproducible_per_seed(cora):
    rcp = replace(recipe("gat", "cora"), epochs=5)
    a, b = (train_run(cora, rcp, seed=3) for _ in range(2))
    assert (a.test_acc, a.val_acc, a.best_epoch) == (b.test_acc, b.val_acc, b.best_epoch)


def test_build_model_passes_backend(cora):
    model = build_model(recipe("transformer", "cora"), cora, backend="torch")
    assert all(layer.backend == "torch" for layer in _attention_layers(model))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("tty, progress", [(True, True), (False, True), (True, False)])
def test_progress_shows_epochs_only_on_a_terminal(cora, monkeypatch, tty, progress):
    """Long runs show the epochs of the current run (training loss, validation
    metric, ETA), not only finished runs — on a terminal, unless turned off."""
    import tqdm.auto

    class EveryUpdate(tqdm.auto.tqdm):
        # tqdm redraws at most every `mininterval` seconds: on a fast machine a
        # 6-epoch run ends before its bar is redrawn with the loss. Drawing every
        # update makes what is shown independent of the machine's speed.
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{"mininterval": 0, **kwargs})

    monkeypatch.setattr(tqdm.auto, "tqdm", EveryUpdate)
    err = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    report = benchmark(cora, "gat", runs=2, epochs=6, patience=100, progress=progress)
    assert report["runs_completed"] == 2
    text = err.getvalue()
    if not (tty and progress):
        assert text == ""
        return
    assert "run 1/2" in text and "run 2/2" in text and "epoch" in text
    assert re.search(r"loss=\d\.\d{4}", text) and re.search(r"val acc=\d+\.\d\d", text)
    assert re.search(r"\| [1-6]/6 \[", text)  # epochs done in the run, of its maximum
    assert "cora gat" in text and "2/2" in text  # the runs bar


def test_train_run_reports_every_epoch(cora):
    seen = []
    rcp = replace(recipe("gat", "cora"), epochs=4, patience=100)
    res = train_run(cora, rcp, seed=0, on_epoch=lambda *a: seen.append(a))
    assert [e for e, _, _ in seen] == [1, 2, 3, 4] and res.epochs == 4
    assert all(loss > 0 and 0 <= val <= 1 for _, loss, val in seen)
