"""Execute the notebooks headless, in fast mode, and check that they show their plots.

``GATLIB_NOTEBOOK_FAST=1`` cuts training to a few epochs. Each notebook runs in
a fresh kernel (``python3``: the ipykernel of the interpreter running pytest)
with ``notebooks/`` as its working directory, as Jupyter would run it. Cora is
processed once into a temporary data cache shared by the notebooks.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the notebooks, end to end: not in the fast lane

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gatlib-data")


def execute(name: str, monkeypatch, **env: str):
    """Run ``notebooks/<name>`` in fast mode with ``env`` added; return the executed notebook.

    A cell that raises fails the test with the cell's traceback (``CellExecutionError``).
    """
    monkeypatch.setenv("GATLIB_NOTEBOOK_FAST", "1")
    # Cora-sized work gains nothing from threads, and on a busy shared runner
    # OpenMP threads that wait for each other make it several times slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # The kernel inherits this environment: without a display, and whatever the
    # caller's MPLBACKEND, the notebooks' `%matplotlib inline` renders PNGs.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    return nb


def outputs(nb, cell_type="code"):
    return [out for cell in nb.cells if cell.cell_type == cell_type for out in cell.get("outputs", [])]


def num_images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for out in outputs(nb))


def stdout(nb) -> str:
    return "".join(out.get("text", "") for out in outputs(nb) if out.get("name") == "stdout")


def test_quickstart(monkeypatch, data_dir):
    nb = execute("01_quickstart.ipynb", monkeypatch, GATLIB_DATA=str(data_dir))
    assert num_images(nb) >= 1  # the learning curves
    text = stdout(nb)
    assert "test accuracy" in text
    assert "same predicted class for all 2708 nodes: True" in text


def test_attention_inspection(monkeypatch, data_dir):
    nb = execute("02_attention_inspection.ipynb", monkeypatch, GATLIB_DATA=str(data_dir))
    assert num_images(nb) >= 3  # per-head bars, ego graph, entropy histograms
    assert "test accuracy" in stdout(nb)


# A `gatlib bench` and a `gatlib compare` report with the keys the notebook reads
# (see gatlib/bench/train.py and gatlib/bench/compare.py), and a file it must skip. The
# committed results in benchmarks/results are older reports (``backend_resolved``, no ``kernels``).
_BENCH = {"dataset": "cora", "model": "gat", "metric": "acc", "device": "cpu", "backend": "auto",
          "config": {"model": "GAT", "seed": 0}, "runs_completed": 3, "test_acc": [82.0, 83.1, 82.6],
          "test_acc_mean": 82.57, "test_acc_std": 0.55, "val_acc_mean": 81.2, "val_acc_std": 0.4,
          "seconds_per_epoch_mean": 0.05, "peak_memory_mib": 900.0}


def _measurement(layer, impl, pass_, ms, mib):
    return {"layer": layer, "impl": impl, "pass": pass_,
            "time": {"status": "ok", "median_s": ms / 1e3},
            "memory": {"status": "ok", "peak_extra_bytes": int(mib * 2**20)}}


_COMPARE = {
    "schema": "gatlib.compare/2",
    "config": {"device": "cpu", "heads": 4, "channels": 64, "dtype": "float32", "backend": "auto",
               "scope": "layer", "graph_input": "plan"},
    "kernels": {layer: ["fused", "fused.backward"] for layer in ("gat", "gatv2", "transformer")},
    "environment": {"device_name": "test CPU"},
    "graph": {"name": "cora", "num_nodes": 2708, "num_edges": 10556},
    "measurements": [_measurement(layer, impl, p, ms, mib)
                     for layer in ("gat", "gatv2", "transformer")
                     for p, scale in (("forward", 1), ("forward+backward", 3))
                     for impl, ms, mib in (("pyg", 10 * scale, 40 * scale), ("gatlib", 6 * scale, 20 * scale))],
}
_COMPARE["measurements"][0]["time"] = {"status": "OOM", "error": "out of memory"}
_COMPARE["measurements"][0]["memory"] = {"status": "OOM", "error": "out of memory"}

# A report with the compiled sides (schema gatlib.compare/3): PyG and gatlib, each eager and
# under torch.compile, a training step of a 2-layer model; one compiled side failed.
_COMPARE_COMPILED = {
    "schema": "gatlib.compare/3",
    "config": {**_COMPARE["config"], "scope": "model", "classes": 40,
               "impls": ["pyg", "pyg_compiled", "gatlib", "gatlib_compiled"]},
    "kernels": {"gat": ["fused", "fused.backward"]},
    "kernels_compiled": {"gat": ["fused", "fused.backward"]},
    "environment": {"device_name": "test CPU"},
    "graph": {"name": "arxiv-like", "num_nodes": 169343, "num_edges": 2325946},
    "measurements": [_measurement(layer, impl, "train_step", ms, mib)
                     for layer, scale in (("gat", 1), ("gatv2", 1.2), ("transformer", 1.1))
                     for impl, ms, mib in (("pyg", 9000 * scale, 6000 * scale),
                                           ("pyg_compiled", 6000 * scale, 4000 * scale),
                                           ("gatlib", 1800 * scale, 500 * scale),
                                           ("gatlib_compiled", 1700 * scale, 520 * scale))],
}
_COMPARE_COMPILED["measurements"][-1]["time"] = {"status": "error", "error": "not timed: ..."}


def test_benchmark_plots_from_reports(monkeypatch, tmp_path):
    """Known reports are plotted, other files skipped with a note; whatever
    ``benchmarks/results`` holds now is read along with them."""
    for path in (NOTEBOOKS.parent / "benchmarks" / "results").glob("*.json"):
        shutil.copyfile(path, tmp_path / path.name)
    (tmp_path / "test_bench_cora_gat.json").write_text(json.dumps(_BENCH))
    (tmp_path / "test_compare_cora_cpu.json").write_text(json.dumps(_COMPARE))
    (tmp_path / "test_compare_compiled_cpu.json").write_text(json.dumps(_COMPARE_COMPILED))
    (tmp_path / "test_notes.json").write_text(json.dumps({"something": "else"}))
    (tmp_path / "test_broken.json").write_text("{not json")
    nb = execute("03_benchmark_plots.ipynb", monkeypatch, GATLIB_RESULTS_DIR=str(tmp_path))
    assert num_images(nb) >= 3  # accuracy; time and memory; ratios
    text = stdout(nb)
    assert "skipping test_notes.json" in text and "skipping test_broken.json" in text
    # A setting is labelled with what gatlib ran: the kernels a report recorded.
    tables = "".join(out.get("data", {}).get("text/plain", "") for out in outputs(nb))
    assert "backend auto→fused" in tables
    # The compiled sides get columns of their own (older reports leave them empty).
    assert "gatlib compiled ms" in tables and "speed-up compiled" in tables
    assert "vs PyG compiled" in tables and "PyG compiled MiB" in tables


def test_benchmark_plots_without_results(monkeypatch, tmp_path):
    nb = execute("03_benchmark_plots.ipynb", monkeypatch, GATLIB_RESULTS_DIR=str(tmp_path))
    assert num_images(nb) == 0
    assert "No accuracy results" in stdout(nb) and "No comparison results" in stdout(nb)


def test_committed_notebooks_show_their_plots():
    """The committed notebooks were executed and saved with their figures."""
    for name, expected in (("01_quickstart.ipynb", 1), ("02_attention_inspection.ipynb", 3)):
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        assert num_images(nb) >= expected, f"{name}: run it and save it with its outputs"
        assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code"), name
