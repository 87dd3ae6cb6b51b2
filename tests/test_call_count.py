"""benchmarks/call_count.py counts what it says: the functions of one package that a call runs,
each call of them (a function called twice counts once among the functions, twice among the
calls), and nothing of other packages."""
import importlib.util
from pathlib import Path

import pytest
import torch

import gatlib

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("call_count", ROOT / "benchmarks" / "call_count.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_counts_the_package_functions_a_call_runs():
    script = _script()
    x = torch.randn(6, 4)
    ei = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    conv = gatlib.GATConv(4, 2, heads=2)
    calls = script.count(lambda: (conv(x, ei), conv(x, ei)), script.ROOTS["gatlib"])
    names = {q: c for (_, _, q), c in calls.items()}
    assert names["GATConv.forward"] == 2  # the layer's forward, once per call
    assert "segment_softmax" in names  # the reference's stages, below the layer
    assert all(f.startswith(("_", "layers", "models")) for f, _, _ in calls)  # gatlib's files only
    assert not script.count(lambda: torch.ones(3).sum(), script.ROOTS["gatlib"])


@pytest.mark.slow
def test_prints_and_saves_every_layer_of_both_libraries(tmp_path, capsys):
    script = _script()
    out = tmp_path / "counts.json"
    assert script.main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    for layer in ("GATConv", "GATv2Conv", "TransformerConv"):
        assert f"small  {layer}" in text and f"large  {layer}" in text
    import json

    results = json.loads(out.read_text())["results"]
    assert len(results) == 12
    assert results["large GATConv gatlib"]["kernels"] == ["fused"]
    assert results["small GATConv gatlib"]["kernels"] == ["torch"]
    assert all(r["functions"] <= r["calls"] for r in results.values())
