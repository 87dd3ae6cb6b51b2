"""What ``pip install gatlib`` installs: the library and what users run, not the lab
(STYLE 5b). The wheel is built from a copy of the checkout and listed: no developer
instrument (tools/), tests or benchmark scripts; the fused CPU kernel's C++ source,
which it compiles on first use; and of gatlib/bench only the modules of the user
commands, so that a new developer-only module cannot slip in unnoticed.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# gatlib/bench modules the wheel may hold: the `gatlib` command (bench, compare, selftest)
# and what they run. A developer-only instrument goes to tools/, not here.
USER_BENCH = {"__init__", "cli", "compare", "compare_report", "data", "distributed", "floor",
              "measure", "recipes", "report", "sampled", "selftest", "synthetic", "train"}
# Not copied for the build: git's and tools' state, virtual environments, earlier builds,
# data (the build reads pyproject.toml, README.md and the packages it finds).
SKIP_AT_ROOT = {"build", "dist", "data", "gpu_run"}
SKIP_ANYWHERE = {"__pycache__", ".ipynb_checkpoints"}


def _ignore(folder, names):
    at_root = Path(folder) == ROOT
    return {n for n in names if n in SKIP_ANYWHERE or at_root and (
        n.startswith(".") or n in SKIP_AT_ROOT or n.endswith(".egg-info"))}


def build_wheel(dest: Path) -> Path:
    """The wheel pip builds from a copy of the checkout (setuptools builds in the source
    tree: the copy keeps build/ and egg-info out of the checkout, and apart from another
    run's). With the venv's setuptools no network is needed; without it, pip fetches one."""
    src = dest / "src"
    shutil.copytree(ROOT, src, ignore=_ignore)
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                           "-w", str(dest / "wheel"), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [wheel] = (dest / "wheel").glob("gatlib-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    path = build_wheel(tmp_path_factory.mktemp("wheel"))
    with zipfile.ZipFile(path) as z:
        return {name: z.read(name) for name in z.namelist()}


def line_counts(files) -> dict:
    """Modules and lines of Python in ``files`` (``{name in the wheel: bytes}``): the
    library (gatlib/ outside gatlib/bench), gatlib/bench and the total."""
    counts = {part: [0, 0] for part in ("library", "bench", "total")}
    for name, data in files.items():
        if name.endswith(".py"):
            lines = len(data.decode().splitlines())
            part = "bench" if name.startswith("gatlib/bench/") else "library"
            for key in (part, "total"):
                counts[key][0] += 1
                counts[key][1] += lines
    return counts


def test_the_wheel_holds_the_package_and_nothing_else(wheel):
    names = set(wheel)
    for folder in ("tools/", "tests/", "benchmarks/"):
        assert not any(n.startswith(folder) for n in names), folder
    assert not any(n.split("/")[0] in ("tools", "tools.py") for n in names)
    info = {n.split("/")[0] for n in names if ".dist-info/" in n}
    assert len(info) == 1 and all(n.startswith(("gatlib/", *info)) for n in names), sorted(names)
    assert wheel[f"{info.pop()}/top_level.txt"].decode().split() == ["gatlib"]
    # the fused CPU kernel compiles this on first use
    assert "gatlib/csrc/fused_cpu.cpp" in names
    # every module of the checkout's package is installed (a folder without __init__.py
    # would be left out by packages.find)
    checkout = {p.relative_to(ROOT).as_posix() for p in (ROOT / "gatlib").rglob("*.py")}
    assert checkout <= names, sorted(checkout - names)


def test_the_wheel_ships_only_the_user_commands_of_the_harness(wheel):
    bench = {Path(n).stem for n in wheel if n.startswith("gatlib/bench/") and n.endswith(".py")}
    assert bench, "no gatlib/bench in the wheel"
    assert bench <= USER_BENCH, (
        f"developer-only modules in the wheel: {sorted(bench - USER_BENCH)} (move them to tools/, "
        "or add a module that a user command runs to USER_BENCH)")


def test_the_wheels_line_count_is_reported(wheel):
    """Reported, not budgeted (docs/packaging.md quotes it)."""
    counts = line_counts(wheel)
    print("\nwheel Python:", ", ".join(f"{k} {m} modules {n} lines" for k, (m, n) in counts.items()))
    assert counts["total"][1] == counts["library"][1] + counts["bench"][1] > 0


PLANETOID_RAW = ROOT.parent / "shared" / "data" / "Planetoid"


@pytest.mark.slow  # a fresh venv: torch and PyG installed by pip (a minute with pip's cache)
@pytest.mark.skipif(not (PLANETOID_RAW / "Cora").is_dir(), reason="no ../shared/data/Planetoid")
def test_the_main_jobs_setup_runs_the_main_job(tmp_path):
    """The README's first command on a copy of the checkout: ``setup_env.sh`` with no
    argument installs enough for the Cora job (the full suite's venv has more, so it
    cannot tell), and nothing that compiles. Two epochs of one run stand for the job."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_ignore)
    setup = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=src, capture_output=True,
                           text=True, timeout=900)
    assert setup.returncode == 0, setup.stdout[-2000:] + setup.stderr[-3000:]
    python = src / ".venv" / "bin" / "python"
    compiled = subprocess.run([python, "-c", "import importlib.util as u; print([m for m in "
                               "('torch_scatter', 'torch_sparse', 'pyg_lib') if u.find_spec(m)])"],
                              capture_output=True, text=True)
    assert compiled.stdout.strip() == "[]", compiled.stdout + compiled.stderr
    job = subprocess.run([src / ".venv" / "bin" / "gatlib", "bench", "--dataset", "cora",
                          "--model", "gat", "--runs", "1", "--epochs", "2", "--device", "cpu",
                          "--no-progress", "--data-dir", tmp_path / "data", "--json",
                          tmp_path / "r.json"], cwd=src, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "GATLIB_PLANETOID_RAW": str(PLANETOID_RAW)})
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    assert (tmp_path / "r.json").exists() and "test acc (%)" in job.stdout, job.stdout
