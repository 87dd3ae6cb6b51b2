"""The ``gatlib`` command: bench's table and JSON, Ctrl-C, errors, compare."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gatlib.bench.train
from gatlib.bench import cli

from ogb_fake import planetoid_raw_dir


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from gatlib.bench.data import seed_planetoid

    path = tmp_path_factory.mktemp("data")
    seed_planetoid(planetoid_raw_dir(), path)
    return path


def _bench(data_dir, out, *extra):
    return cli.main(["bench", "--dataset", "cora", "--model", "gat", "--runs", "2", "--epochs", "5",
                     "--device", "cpu", "--data-dir", str(data_dir), "--json", str(out),
                     "--no-progress", *extra])


def test_bench_writes_json_and_prints_table(data_dir, tmp_path, capsys):
    out = tmp_path / "res" / "cora.json"
    assert _bench(data_dir, out, "--seed", "7", "--backend", "torch") == 0
    report = json.loads(out.read_text())
    assert report["dataset"] == "cora" and report["model"] == "gat" and report["device"] == "cpu"
    assert report["backend"] == "torch" and report["metric"] == "acc"
    assert report["kernels"] == ["torch"]  # recorded while the first run trained
    assert report["runs_requested"] == report["runs_completed"] == 2 and not report["interrupted"]
    assert [r["seed"] for r in report["runs"]] == [7, 8]
    assert report["test_acc"] == [r["test_acc"] for r in report["runs"]]
    assert all(0 <= a <= 100 for a in report["test_acc"])
    mean = sum(report["test_acc"]) / 2
    assert report["test_acc_mean"] == pytest.approx(mean)
    assert report["test_acc_std"] >= 0 and report["val_acc_mean"] is not None
    assert all(r["epochs"] == 5 for r in report["runs"])
    assert report["config"]["model"] == "GAT" and report["config"]["epochs"] == 5
    assert report["config"]["lr"] == 0.005 and report["config"]["seed"] == 7
    assert set(report["versions"]) >= {"python", "torch", "torch_geometric", "gatlib"}
    assert report["num_threads"] == 1 and report["cpu_model"]
    assert "git_sha" in report and report["peak_memory_mib"] > 0
    assert report["seconds_per_epoch_mean"] > 0
    table = capsys.readouterr().out
    assert "test acc (%)" in table and f"{mean:.2f} ±" in table and "2/2" in table


def test_ctrl_c_keeps_finished_runs(data_dir, tmp_path, monkeypatch):
    real = gatlib.bench.train.train_run
    calls = []

    def interrupted_on_second_run(*args, **kwargs):
        calls.append(kwargs["seed"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(gatlib.bench.train, "train_run", interrupted_on_second_run)
    out = tmp_path / "partial.json"
    assert _bench(data_dir, out) == 130
    report = json.loads(out.read_text())
    assert report["interrupted"] and report["runs_completed"] == 1 and report["runs_requested"] == 2
    assert len(report["test_acc"]) == 1 and report["test_acc_mean"] == report["test_acc"][0]
    assert report["test_acc_std"] == 0.0


def test_missing_dataset_is_one_line_error(tmp_path, monkeypatch, capsys):
    import urllib.error
    import urllib.request

    def no_network(*args, **kwargs):
        raise urllib.error.URLError("offline")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.delenv("GATLIB_PLANETOID_RAW", raising=False)
    code = cli.main(["bench", "--dataset", "pubmed", "--model", "gat", "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.startswith("gatlib bench: PubMed") and str(tmp_path / "Planetoid" / "PubMed" / "raw") in err


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--dataset", "karate", "--model", "gat"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([])


def test_compare_is_registered_and_delegates(monkeypatch, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["compare", "--help"])
    assert info.value.code == 0
    assert "usage: gatlib compare" in capsys.readouterr().out


@pytest.mark.slow
def test_console_script_entry_point():
    res = subprocess.run([sys.executable, "-m", "gatlib.bench.cli", "bench", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--dataset" in res.stdout and "--json" in res.stdout


def test_pyproject_script_is_the_harness_cli():
    """The installed ``gatlib`` command runs gatlib.bench.cli:main."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["gatlib"] == "gatlib.bench.cli:main"
