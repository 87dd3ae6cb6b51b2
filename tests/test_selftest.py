"""``gatlib selftest``: end to end on this machine's device (the Triton interpreter
without a GPU), and red when the Triton kernels are broken."""
from __future__ import annotations

import argparse
import json
import random
import sys

import pytest
import torch

from gatlib import _dispatch, _triton, _triton_schedule
from gatlib.bench import cli, selftest

from testing import DEVICE


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _selftest(tmp_path, *extra, monkeypatch=None):
    out = tmp_path / "selftest.json"
    argv = ["selftest", "--device", DEVICE, "--quick", "--repeats", "1",
            "--data-dir", str(tmp_path / "data"), "--json", str(out), *extra]
    if monkeypatch is not None:  # as the console script sees it (the JSON records it)
        monkeypatch.setattr(sys, "argv", ["gatlib", *argv])
    rc = cli.main(argv)
    return rc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.slow
def test_selftest_end_to_end(tmp_path, capsys, monkeypatch):
    table = tmp_path / "selftest.md"
    # (float64 left to tests/test_triton.py's gradchecks: the harness again, at one case in four
    # of the suite's costliest test; by default the checks cover all four)
    dtypes = ("float32", "bfloat16", "float16")
    rc, rep = _selftest(tmp_path, "--graphs", "synthetic:100:400:8", "--heads", "1",
                        "--channels", "4", "--dtypes", ",".join(dtypes), "--table", str(table),
                        monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert rep["schema"] == selftest.SCHEMA and rep["status"] == "ok"
    assert rep["environment"]["device"] == DEVICE and "git_sha" in rep["environment"]
    assert rep["interpreter"] == (DEVICE == "cpu") and " selftest --device " in rep["command"]
    kc = rep["kernel_checks"]
    cases = kc["cases"]
    assert kc["failed"] == 0 and kc["passed"] == len(cases)
    assert all(c["status"] == "ok" for c in cases), [c for c in cases if c["status"] != "ok"]
    # every kind x dtype, with and without dropout, the hub split by the kernels
    assert {(c["kind"], c["dtype"], c["dropout"] > 0) for c in cases} == {
        (k, d, p) for k in selftest.KINDS for d in dtypes for p in (False, True)}
    parser = argparse.ArgumentParser()
    selftest.add_arguments(parser)
    assert parser.parse_args([]).dtypes.split(",") == list(selftest.DTYPES) == [
        "float32", "bfloat16", "float16", "float64"]
    assert kc["graph"]["hub_in_degree"] > _triton_schedule._SPLIT
    for c in cases:
        assert c["kernels"][0] == "triton" and "triton.backward" in c["kernels"], c
        assert c["error"] <= c["bound"]
    (comp,) = rep["comparisons"]
    assert comp["graph"] == "synthetic:100:400:8" and comp["status"] == "ok"
    report = comp["report"]
    assert report["config"]["backend"] == "triton" and report["config"]["channels"] == 4
    assert all(names[:2] == ["triton", "triton.backward"] for names in report["kernels"].values())
    assert {m["layer"] for m in report["measurements"]} == {"gat", "gatv2", "transformer"}
    assert f"{len(cases)} passed, 0 failed" in out and "synthetic:100:400:8 ok" in out
    for layer in ("GATConv", "GATv2Conv", "TransformerConv"):
        assert f"| synthetic:100:400:8 | {layer}" in out
    assert table.read_text() == out


# Each mutation breaks one part of the Triton path; the self-test must go red.
def _skip_merge(monkeypatch, softmax: bool):
    merge = _triton._merge

    def skipping(splits, part, out, part_lse=None, lse=None):
        if (lse is not None) != softmax:
            merge(splits, part, out, part_lse, lse)
    monkeypatch.setattr(_triton, "_merge", skipping)


def _skip_split_merge(monkeypatch):  # forward: a hub's pieces are never combined
    _skip_merge(monkeypatch, softmax=True)


def _skip_gradient_merge(monkeypatch):  # backward only: a hub's gradient pieces are dropped
    _skip_merge(monkeypatch, softmax=False)


def _unseeded_dropout(monkeypatch):  # a dropout mask torch.manual_seed does not fix
    monkeypatch.setattr(_triton, "_draw_seed", lambda device: torch.tensor(
        [random.SystemRandom().randrange(2**31 - 1)], device=device))


def _backward_mask_differs(monkeypatch):  # the backward draws another dropout mask
    real = _triton._backward

    def backward(*args):  # (meta, graph, need, grad_out, grad_alpha, the 6 inputs, seed, ...)
        args = list(args)
        args[11] = args[11] + 1
        return real(*args)

    monkeypatch.setattr(_triton, "_backward", backward)


def _reference_instead(monkeypatch):  # right numbers, but not from the Triton kernel
    monkeypatch.setitem(_dispatch.KERNELS, "triton", _dispatch.ReferenceKernel())


# Each break shows on the two float32 cases of one kind (the end-to-end test runs the rest);
# the kinds differ so that each kernel path is broken once.
@pytest.mark.slow
@pytest.mark.parametrize("mutation, expect, kind", [
    (_skip_split_merge, "max abs error", "gat"),
    (_skip_gradient_merge, "grad value: max abs error", "dot"),  # (the source side's pieces)
    (_unseeded_dropout, "same seed, different results", "gatv2"),
    (_backward_mask_differs, "the backward's dropout mask is not the forward's", "gat"),
    (_reference_instead, "the Triton kernel did not run", "gat_inputs"),
])
def test_broken_kernel_fails(tmp_path, capsys, monkeypatch, mutation, expect, kind):
    monkeypatch.setattr(selftest, "DTYPES", {"float32": torch.float32})
    mutation(monkeypatch)
    rc, rep = _selftest(tmp_path, "--graphs", "", "--kinds", kind)
    out = capsys.readouterr().out
    assert rc == 1 and rep["status"] == "FAIL"
    failed = [c for c in rep["kernel_checks"]["cases"] if c["status"] == "FAIL"]
    assert failed and any(expect in c["detail"] for c in failed), failed
    assert f"{len(failed)} failed" in out and "| failed case" in out
    assert all(f"| {c['name']}" in out for c in failed)


@pytest.mark.parametrize("child, status", [
    # a layer disagreed with PyG: compare wrote its report and exited 1
    ("write({'complete': True, 'checks': {'gat': {'status': 'mismatch'}}, 'measurements': [],"
     " 'summary': []}); sys.exit(1)", "mismatch"),
    ("sys.exit('Traceback: boom')", "error"),  # it crashed before writing anything
])
def test_a_comparison_that_fails_fails_the_selftest(tmp_path, monkeypatch, capsys, child, status):
    """The comparison's child is replaced by a script acting out one outcome."""
    real_popen = selftest.subprocess.Popen

    def fake_compare(cmd, **kw):
        if "gatlib.bench.compare" not in cmd:  # git, for the provenance
            return real_popen(cmd, **kw)
        out = cmd[cmd.index("--json") + 1]
        script = (f"import json, sys\ndef write(r): open({out!r}, 'w').write(json.dumps(r))\n"
                  + child)
        return real_popen([sys.executable, "-c", script], **kw)

    monkeypatch.setattr(selftest.subprocess, "Popen", fake_compare)
    monkeypatch.setattr(selftest, "kernel_checks",
                        lambda *a: {"cases": [], "passed": 0, "failed": 0})
    rc, rep = _selftest(tmp_path, "--graphs", "synthetic:100:400:8")
    assert rc == 1 and rep["status"] == "FAIL"
    (comp,) = rep["comparisons"]
    assert comp["status"] == status and comp["returncode"] == 1
    assert ("boom" in comp["stderr_tail"]) == (status == "error")
    out = capsys.readouterr().out
    assert f"synthetic:100:400:8 {status}" in out
    assert ("GATConv mismatch" in out) == (status == "mismatch")


@pytest.mark.parametrize("args, message", [(["--graphs", "cora,arxiv"], "unknown synthetic graph"),
                                           (["--repeats", "0"], "--repeats must be at least 1"),
                                           (["--kinds", "gat,gcn"], "--kinds takes"),
                                           (["--kinds", ","], "--kinds takes")])
def test_bad_arguments_exit_2_before_any_check(args, message, monkeypatch, capsys):
    monkeypatch.setattr(selftest, "kernel_checks", None)  # not reached
    assert cli.main(["selftest", "--device", DEVICE, *args]) == 2
    assert message in capsys.readouterr().err


def test_kinds_limit_the_kernel_checks(tmp_path, monkeypatch):
    seen = []

    def case(kind, dtype, edge, p, alpha, plan, device, seed=0):
        seen.append((kind, dtype))
        return {"name": kind, "status": "ok"}
    monkeypatch.setattr(selftest, "check_case", case)
    monkeypatch.setattr(selftest, "gpu_checks", lambda device, kinds: [])
    rc, rep = _selftest(tmp_path, "--graphs", "", "--kinds", "dot,gatv2")
    assert rc == 0 and rep["config"]["kinds"] == ["dot", "gatv2"]
    # the quick grid's two cases per kind and dtype, for the named kinds alone
    assert sorted(seen, key=str) == sorted(
        [(k, d) for k in ("dot", "gatv2") for d in selftest.DTYPES.values()] * 2, key=str)




def test_cpu_without_the_interpreter_exits_2(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["selftest", "--device", "cpu", "--graphs", ""]) == 2
    err = capsys.readouterr().err
    assert "TRITON_INTERPRET=1 gatlib selftest --device cpu" in err and "Traceback" not in err


def test_interpreter_set_after_triton_was_imported_exits_2(monkeypatch, capsys):
    def late():
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                           "triton is first imported")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_triton, "_check_interpreter", late)
    assert cli.main(["selftest", "--device", "cpu", "--graphs", ""]) == 2
    assert "gatlib selftest: error: Triton kernels on CPU tensors need" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_a_gpu_exits_2(capsys):
    assert cli.main(["selftest", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_selftest_is_registered(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["selftest", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: gatlib selftest" in out and "--graphs" in out and "--quick" in out


@pytest.mark.slow
def test_the_compiled_step_check_passes_and_can_fail(monkeypatch):
    """The GPU checks' training step (run here on the interpreter): eager and compiled
    models agree with the float64 reference; a compiled model whose output is off by
    1e-3 fails the check, and so do eager and compiled steps wrong alike (the split
    rows' gradient pieces dropped), which a check against eager would pass.
    TransformerConv's key bias has a zero gradient in exact arithmetic (rounding noise on
    both sides): the check passes it."""
    pytest.importorskip("triton")
    plan, _ = selftest.check_graph(selftest.NUM_NODES, 4 * (selftest.NUM_NODES - 21), 0, "cpu")
    cpu = torch.device("cpu")
    assert selftest.compiled_step_check("GATConv", cpu, plan) is None
    assert selftest.compiled_step_check("TransformerConv", cpu, plan) is None

    def off(model):
        compiled = torch.compile(model)
        return lambda x, graph: compiled(x, graph) * 1.001

    detail = selftest.compiled_step_check("GATConv", cpu, plan, compile_fn=off)
    assert detail is not None and "against float64" in detail and "eager" not in detail, detail
    where = detail.rsplit("(", 1)[1].rstrip(")")  # the quantity: the loss or a parameter
    assert where == "loss" or where.startswith(("conv1.", "conv2.")), detail
    _skip_gradient_merge(monkeypatch)
    with selftest.unwritten_memory_is_nan():
        detail = selftest.compiled_step_check("GATConv", cpu, plan)
    assert detail is not None and "eager" in detail and "compiled" in detail, detail


@pytest.mark.slow
@pytest.mark.parametrize("kind", selftest.KINDS)
def test_the_output_layer_check_passes_and_can_fail(kind, monkeypatch):
    """The GPU checks' output-layer call (one head of 40 channels, run here on the
    interpreter) computes the reference on the check graph, whose hub rows are split;
    with the gradient pieces of split rows dropped it fails, at the hub (node 0, which
    receives 300 edges and sends 300), whose rows were never written: NaN, not what
    the allocator handed out (the check's right answer, when the buffer of the call
    before was reused: it passed so after other tests)."""
    pytest.importorskip("triton")
    plan, _ = selftest.check_graph(selftest.NUM_NODES, 4 * (selftest.NUM_NODES - 21), 0, "cpu")
    assert selftest.output_layer_check(kind, torch.device("cpu"), plan) is None
    _skip_gradient_merge(monkeypatch)
    detail = selftest.output_layer_check(kind, torch.device("cpu"), plan)
    assert detail is not None and "grad " in detail and "(row 0)" in detail, detail
    assert "max abs error nan" in detail, detail


@pytest.mark.slow
def test_the_configs_check_passes_and_can_fail(monkeypatch):
    """The GPU checks' configs check (every config of the row kernels' spaces pinned in turn,
    against the tuned one: here the interpreter's) passes over the check graph's split rows; a
    "config" that changes what is summed in what order (the hub's pieces cut elsewhere) fails it."""
    import contextlib

    from gatlib import introspect

    pytest.importorskip("triton")
    plan, _ = selftest.check_graph(selftest.NUM_NODES, 4 * (selftest.NUM_NODES - 21), 0, "cpu")
    cpu = torch.device("cpu")
    assert selftest.configs_check("gatv2", cpu, plan) is None
    pinned = introspect.triton_config

    @contextlib.contextmanager
    def reordering(i):
        with pinned(i), monkeypatch.context() as m:
            if i == 1:
                m.setattr(_triton_schedule, "_SPLIT", _triton_schedule._split() // 2)
            yield
    monkeypatch.setattr(introspect, "triton_config", reordering)
    detail = selftest.configs_check("gatv2", cpu, plan)
    assert detail is not None and "config 1: out" in detail and "config 0" not in detail, detail


def test_unwritten_memory_reads_as_nan_inside_the_block_only():
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    with selftest.unwritten_memory_is_nan():
        assert bool(torch.empty(1000).isnan().all())
        assert bool(torch.ones(3).new_empty(5, 7).isnan().all())
    assert (torch.are_deterministic_algorithms_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory) == before
