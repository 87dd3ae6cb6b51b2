"""What every result file carries (gatlib.bench.report): provenance, atomic JSON, tables."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from gatlib.bench import report

ROOT = Path(__file__).resolve().parents[1]


# --- write_json -------------------------------------------------------------------------------
def test_write_json_creates_parents_and_roundtrips(tmp_path):
    path = tmp_path / "a" / "b" / "out.json"
    report.write_json(path, {"x": [1, 2.5, None], "name": "µ"})
    assert json.loads(path.read_text()) == {"x": [1, 2.5, None], "name": "µ"}
    assert path.read_text().endswith("\n")
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]


def test_write_json_failed_serialisation_leaves_the_old_file(tmp_path):
    path = tmp_path / "out.json"
    report.write_json(path, {"run": 1})
    with pytest.raises(TypeError):
        report.write_json(path, {"run": 2, "bad": object()})
    assert json.loads(path.read_text()) == {"run": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no partial or temporary file
    with pytest.raises(TypeError):
        report.write_json(tmp_path / "new.json", {"bad": object()})
    assert not (tmp_path / "new.json").exists()


def test_write_json_failed_replace_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    report.write_json(path, {"run": 1})

    def disk_full(src, dst):
        raise OSError("No space left on device")

    monkeypatch.setattr(report.os, "replace", disk_full)
    with pytest.raises(OSError):
        report.write_json(path, {"run": 2})
    assert json.loads(path.read_text()) == {"run": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


# --- format_table -----------------------------------------------------------------------------
def test_format_table_aligns_columns():
    text = report.format_table(["layer", "ms", "note"], [["GATConv", 1.5, "a"], ["GAT", 12.25, "bbb"]],
                               align="<><")
    head, rule, *rows = text.splitlines()
    assert head.split() == ["layer", "ms", "note"] and len(rows) == 2
    assert rule.split() == ["-" * 7, "-" * 5, "-" * 4]  # each column as wide as its widest cell
    starts = [m.start() for m in re.finditer(r"-+", rule)]
    ends = [m.end() for m in re.finditer(r"-+", rule)]
    for line in (head, *rows):
        cells = line.split()
        assert line.index(cells[0]) == starts[0]  # left-aligned
        assert line.index(cells[1]) + len(cells[1]) == ends[1]  # right-aligned
        assert line.index(cells[2], ends[1]) == starts[2]
    assert rows[0] == "GATConv    1.5  a"  # trailing spaces dropped


def test_format_table_default_alignment_and_markdown():
    text = report.format_table(["name", "value"], [["a", 10], ["bb", 2]])
    assert text.splitlines()[2:] == ["a        10", "bb        2"]
    md = report.format_table(["name", "value"], [["a", 10]], markdown=True)
    assert md.splitlines() == ["| name | value |", "| :--- | ----: |", "| a    |    10 |"]


@pytest.mark.parametrize("rows, align", [([["a"]], None), ([["a", "b"]], "<"), ([["a", "b"]], "<^")])
def test_format_table_rejects_bad_shapes(rows, align):
    with pytest.raises(ValueError):
        report.format_table(["x", "y"], rows, align=align)


# --- environment and command line -------------------------------------------------------------
def test_environment_has_the_provenance_keys():
    env = report.environment("cpu")
    assert set(env) == {"device", "device_name", "cpu_model", "num_threads", "cpu_count", "versions",
                        "git_sha", "git_dirty", "platform"}
    assert env["device"] == "cpu" and env["device_name"] == env["cpu_model"] != ""
    assert env["num_threads"] == torch.get_num_threads()
    assert set(env["versions"]) == {"python", "torch", "torch_geometric", "gatlib", "triton",
                                    "torch_scatter", "torch_sparse", "pyg_lib", "ogb", "cuda"}
    assert env["versions"]["torch"] == torch.__version__ and env["versions"]["torch_geometric"]
    json.dumps(env)  # goes into result files as is
    if (ROOT / ".git").exists() and shutil.which("git"):
        assert re.fullmatch(r"[0-9a-f]{40}", env["git_sha"]) and isinstance(env["git_dirty"], bool)


def test_command_line_names_modules_and_scripts():
    module = str(ROOT / "gatlib" / "bench" / "compare.py")
    assert (report.command_line([module, "--graph", "cora", "--json", "a b.json"])
            == "python -m gatlib.bench.compare --graph cora --json 'a b.json'")
    tool = str(ROOT / "tools" / "launches.py")  # (run from the checkout, not installed)
    assert report.command_line([tool, "--json", "x.json"]) == "python -m tools.launches --json x.json"
    script = str(ROOT / "benchmarks" / "plan_cost.py")
    assert report.command_line([script]) == "python benchmarks/plan_cost.py"
    assert report.command_line(["/usr/local/bin/gatlib", "bench"]) == "gatlib bench"
