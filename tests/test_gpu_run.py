"""The GPU run (tools/gpu_run.py, scripts/gpu_run.sh) on CPU: its dry run takes the same steps
and writes the same files, tiny (the kernels in Triton's interpreter), which the device tool would
bring back: at most 8, named in letters, digits, ``.``, ``_`` and ``-``, each at most 16 MiB."""
from __future__ import annotations

import json
import re

import pytest

from testing import run_without_interpreter

pytestmark = pytest.mark.slow  # the run's steps, each in a process of its own

pytest.importorskip("triton")


def test_the_dry_run_writes_what_a_gpu_run_brings_back(tmp_path):
    from tools import gpu_run

    out = tmp_path / "out"
    proc = run_without_interpreter(["-m", "tools.gpu_run", "--out", str(out), "--dry-run"],
                                   timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p for p in out.rglob("*"))
    assert all(p.is_file() and p.parent == out for p in files), files  # no folder
    names = [p.name for p in files]
    assert sorted(names) == sorted(gpu_run.FILES) and len(names) <= 8
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    sizes = [p.stat().st_size for p in files]
    assert all(0 < s <= 16 << 20 for s in sizes) and sum(sizes) <= 64 << 20
    run = json.loads((out / "run.json").read_text())
    assert run["dry_run"] and run["seconds"] < run["deadline_s"]
    steps = {s["step"]: s for s in run["steps"]}
    assert set(steps) == {"sanitizer", "selftest gat", "arxiv-like step", "40-class call",
                          "Cora under CUDA graphs"}
    assert steps["sanitizer"]["status"] == "skipped"
    assert all(s["status"] == "ok" and s["returncode"] == 0 for k, s in steps.items() if k != "sanitizer")
    selftest = json.loads((out / "selftest.json").read_text())
    assert selftest["gat"]["status"] == "ok" and selftest["gat"]["kernel_checks"]["failed"] == 0
    for name in ("compare_arxiv.json", "compare_cora.json"):
        assert json.loads((out / name).read_text())["complete"]
    classes = json.loads((out / "classes.json").read_text())
    assert [r["kind"] for r in classes["results"]] == ["gat"] and "two_pass_fwd_ms" in classes["results"][0]
    assert isinstance(json.loads((out / "autotune.json").read_text()), list)
    log = (out / "log.txt").read_text()
    assert "== the run:" in log and "sanitizer: skipped" in log


@pytest.mark.parametrize("output, code, status", [
    ("========= Error: Device not supported", 1, "refused"),  # (the tool, not the kernels)
    ("Traceback (most recent call last):\nRuntimeError: boom", 1, "FAIL"),  # (the calls failed)
    ("========= ERROR SUMMARY: 2 errors", 3, "FAIL"),  # (what it found)
    ("gat: ok", 0, "ok")])
def test_a_sanitizer_refusal_is_told_from_a_failure(tmp_path, monkeypatch, output, code, status):
    import sys

    from tools import gpu_run

    monkeypatch.setattr(gpu_run.shutil, "which", lambda name: "/bin/" + name)
    run = gpu_run.Run(tmp_path, 60, {})
    script = f"import sys; print({output!r}); sys.exit({code})"
    gpu_run.sanitizer_steps(run, [("sanitizer memcheck", [sys.executable, "-c", script], 30, {})], False)
    (rec,) = run.steps
    assert rec["status"] == status and rec["returncode"] == code
