"""The launch budget (issue 29, item 4): kernel launches of a layer call and of a
Cora-sized training step, counted without a GPU by :mod:`tools.launches`.

On a small graph a GPU step is launch-bound: each launch costs host time
(~85 µs per gatlib launch on an H100 when the issue was written), so the count
is the cost. The counter runs in a subprocess: this process has
``TRITON_INTERPRET=1`` (conftest), under which Triton launches nothing to count.
The counts are exact (which ops run does not depend on timing, threads or the
graph's values), so the budgets are today's counts: any new launch fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import launches

pytestmark = pytest.mark.slow  # the launch counter runs in a subprocess: not in the fast lane

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("triton")

# Kernel launches (Triton + ATen) of one forward+backward layer call on the
# Cora-sized graph, (layer, heads, channels) -> budget, given a GraphPlan
# ("gatlib") or the [2, E] tensor ("gatlib_tensor": a new plan in every call).
# Today's counts (docs/design.md, "Fewer launches per step", says what took them
# down).
LAYER_BUDGET = {
    "gatlib": {("gat", 3, 256): 17, ("gat", 8, 8): 17, ("gatv2", 3, 256): 13,
               ("gatv2", 8, 8): 13, ("transformer", 3, 256): 11, ("transformer", 8, 8): 11},
    "gatlib_tensor": {("gat", 3, 256): 76, ("gat", 8, 8): 76, ("gatv2", 3, 256): 72,
                      ("gatv2", 8, 8): 72, ("transformer", 3, 256): 68,
                      ("transformer", 8, 8): 68},
}
# ... of a warmed 2-layer training step (H=3, C=256, Adam): layer -> budget. GAT's per-node
# terms and the GAT layers' output bias are torch ops (docs/design.md, "Fewer launches per step").
STEP_BUDGET = {"gatlib": {"gat": 47, "gatv2": 38, "transformer": 34},
               "gatlib_tensor": {"gat": 165, "gatv2": 156, "transformer": 148}}
# Value reads (syncs) per layer call on a new plan: the index check's two (one on
# CUDA, see tools.launches), the self-loops' (GAT layers) or whether the
# edges are sorted already (TransformerConv), whether any row is split.
NEW_PLAN_SYNCS = 4


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("launches") / "launches.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    proc = subprocess.run([sys.executable, "-m", "tools.launches", "--json", str(path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0 and path.exists(), proc.stderr[-4000:]
    return json.loads(path.read_text())


def _rows(report, scope, library="gatlib"):
    return {(r["layer"], r["heads"], r["channels"]) if scope == "layer" else r["layer"]: r
            for r in report[scope] if r["library"] == library}


def _over(rows, budget) -> str:
    """One line per row over its budget, with what it launched; empty if none."""
    return "\n".join(f"{k}: {rows[k]['launches']} launches > budget {b} ("
                     f"{rows[k]['triton_launches']} Triton {rows[k]['triton']}, "
                     f"{rows[k]['aten_launches']} ATen {rows[k]['launch_ops']})"
                     for k, b in budget.items() if rows[k]["launches"] > b)


@pytest.mark.parametrize("library", ["gatlib", "gatlib_tensor"])
def test_layer_call_within_budget(report, library):
    rows = _rows(report, "layer", library)
    assert set(rows) == set(LAYER_BUDGET[library])
    over = _over(rows, LAYER_BUDGET[library])
    assert not over, over


@pytest.mark.parametrize("library", ["gatlib", "gatlib_tensor"])
def test_training_step_within_budget(report, library):
    rows = _rows(report, "step", library)
    assert set(rows) == set(STEP_BUDGET[library])
    over = _over(rows, STEP_BUDGET[library])
    assert not over, over


def test_no_value_is_read_back_on_a_plan(report):
    """gatlib's warmed calls on a plan read no device value back to the host (a
    CUDA stream sync); Adam's step counts are host tensors, their reads are host
    ops. A call on a new plan reads a few, each once."""
    for scope in ("layer", "step"):
        synced = {k: r["sync_ops"] for k, r in _rows(report, scope).items() if r["syncs"]}
        assert not synced, (scope, synced)
        per_call = 1 if scope == "layer" else 2
        for k, r in _rows(report, scope, "gatlib_tensor").items():
            assert r["syncs"] <= NEW_PLAN_SYNCS * per_call, (k, r["sync_ops"])
    for r in _rows(report, "step").values():
        assert r["host"]  # the optimizer's step counts were seen, as host ops


def test_the_counts_are_not_vacuous(report):
    """Every gatlib call ran its Triton kernels (forward, both backward
    directions) inside the count, and PyG's layers, counted the same way, launch
    ATen kernels only."""
    for scope in ("layer", "step"):
        for r in _rows(report, scope).values():
            assert {"_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel"} <= set(r["triton"]), r
            assert r["operators"] == {"gatlib::triton_attention": 1 if scope == "layer" else 2,
                                      "gatlib::triton_attention_backward":
                                          1 if scope == "layer" else 2}
        for r in _rows(report, scope, "pyg").values():
            assert r["triton_launches"] == 0 and r["aten_launches"] > 0


# ---------------------------------------------------------------------------
# The counter's rule, on plain ATen ops (in this process: no Triton needed)
# ---------------------------------------------------------------------------
def _classes(fn, host=()):
    tally = launches.Tally()
    recorder = launches._Recorder(tally, host)
    with launches._reads_counted(recorder), recorder:
        fn()
    return tally


def test_views_allocations_and_no_op_conversions_launch_nothing():
    x = torch.randn(4, 6)

    def free():
        x.view(6, 4).t().unsqueeze(0).expand(2, 4, 6)
        x.detach()
        x.to(torch.float32)
        x.contiguous()
        torch.empty(3, 3)
        x.new_empty(5)
        torch.empty_like(x)
        x[:, 1:3]
        x.new_zeros(0)  # no elements: a CUDA kernel over none is not launched
        torch.promote_types(x.dtype, torch.float64)

    tally = _classes(free)
    assert not tally.launch and not tally.syncs, tally.launch
    assert sum(tally.free.values()) >= 10


def test_writes_launch():
    x = torch.randn(4, 6)
    tally = _classes(lambda: (torch.zeros(3), x + 1, x.add_(1), x.t().contiguous(), x.double(),
                              torch.mm(x, x.t()), torch.sum(x, 0, out=torch.empty(6))))
    assert sum(tally.launch.values()) == 7, tally.launch
    assert tally.launch["aten.zeros.default"] == 1  # zeros fills; empty does not


def test_value_reads_are_syncs_unless_on_host_tensors():
    x = torch.randn(5)
    step = torch.tensor(3.0)
    tally = _classes(lambda: (x.sum().item(), x[x > 0], x.nonzero(), step.item(),
                              torch._foreach_add_([step], torch.tensor(1.0), alpha=1.0)),
                     host=[step])
    assert tally.syncs == {"aten._local_scalar_dense.default": 1, "aten.index.Tensor": 1,
                           "aten.nonzero.default": 1}, tally.syncs
    assert tally.host == {"aten._local_scalar_dense.default": 1, "aten._foreach_add_.Tensor": 1}


def test_reads_without_an_aten_op_are_syncs():
    """A CPU tensor's tolist() and numpy() dispatch no op; on CUDA they copy to the host."""
    x, step = torch.arange(3), torch.tensor(2.0)
    tally = _classes(lambda: (x.tolist(), x.numpy(), step.tolist()), host=[step])
    assert tally.syncs == {"Tensor.tolist": 1, "Tensor.numpy": 1}
    assert "tolist" not in torch.Tensor.__dict__  # torch's own methods are back


def test_host_time_launches_through_tritons_cached_path(report):
    """``--host-time`` (tools.launches.host_time) times a warmed step whose Triton
    launches take Triton's cached path to stand-in binaries: every launch a step makes
    (the counted step's) reaches one, PyG's step makes none, and the stand-ins leave
    Triton's caches afterwards. No time is asserted (it is the machine's)."""
    code = (
        "import json\n"
        "from gatlib import introspect\n"
        "from tools import launches as L\n"
        "g = L.cora_like()\n"
        "rows = [L.host_time(lib, 'gat', g, calls=2, repeats=1) for lib in ('gatlib', 'pyg')]\n"
        "left = sum(isinstance(v, L._StandInBinary) for fn in introspect.triton_kernels().values()\n"
        "           for caches in fn.device_caches.values() for v in caches[0].values())\n"
        "print(json.dumps({'rows': rows, 'left': left}))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    gatlib_row, pyg_row = out["rows"]
    counted = next(r for r in report["step"] if (r["library"], r["layer"]) == ("gatlib", "gat"))
    assert counted["triton_launches"] > 0
    assert gatlib_row["triton_launches"] == counted["triton_launches"]
    assert pyg_row["triton_launches"] == 0
    assert gatlib_row["median_ms"] > 0 and pyg_row["median_ms"] > 0
    assert out["left"] == 0
