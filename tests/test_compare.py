"""The PyG comparison tool (gatlib.bench.compare), its measurements
(gatlib.bench.measure) and its synthetic graphs (gatlib.bench.synthetic).

End-to-end runs use a tiny power-law graph, one thread and one timing round: they
check the plumbing and the JSON, never the speed. They run the eager sides
(``--no-compile``) except where the compiled ones are under test: compiling takes
10-40 s per model on two cores, so those tests compile one layer type, with
``dynamic=False``.
"""
import json
import subprocess
import sys

import pytest
import torch

import gatlib
from gatlib.bench import compare, compare_report, measure, synthetic

TINY = ["--graph", "synthetic:2000:10000:32", "--heads", "2", "--channels", "8",
        "--repeats", "1", "--threads", "1", "--block-seconds", "0.01", "--no-compile"]
# The four-implementation runs: the smallest graph, the fused kernel (auto would pick
# the reference on so small a graph), no timing blocks.
TINY_COMPILED = ["--graph", "synthetic:300:1500:16", "--layer", "gat", "--backend", "fused",
                 "--heads", "2", "--channels", "4", "--repeats", "1", "--threads", "1",
                 "--block-seconds", "0", "--compile"]
TOP_KEYS = {"schema", "command", "timestamp", "config", "environment", "graph", "checks",
            "kernels", "measurements", "summary", "complete"}


def run_compare(tmp_path, *extra):
    out = tmp_path / "out.json"
    rc = compare.main([*TINY, "--data-dir", str(tmp_path / "data"), "--json", str(out), *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


# --- synthetic graphs -------------------------------------------------------------------------
def test_synthetic_graph_size_range_and_symmetry():
    N, E = 2000, 10_000
    ei = synthetic.power_law_edges(N, E, seed=3)
    assert ei.dtype == torch.int64 and ei.dim() == 2 and ei.size(0) == 2
    assert E <= ei.size(1) <= 2 * E  # symmetrised: reciprocal draws merge
    assert ei.min() >= 0 and ei.max() < N
    assert not (ei[0] == ei[1]).any()
    keys = ei[0] * N + ei[1]
    assert keys.unique().numel() == keys.numel()  # no duplicates
    assert torch.equal(keys, keys.sort().values)  # coalesced
    assert torch.equal((ei[1] * N + ei[0]).sort().values, keys)  # undirected
    directed = synthetic.power_law_edges(N, E, seed=3, undirected=False)
    assert directed.size(1) == E


def test_sorted_unique_is_torch_unique():
    """The generator's in-place sort-and-dedupe (no index tensor, for products-sized
    key arrays) gives torch.unique's result, edge cases included."""
    from gatlib.bench.synthetic import _sorted_unique

    for n, hi in ((0, 5), (1, 5), (2, 1), (3000, 40), (3000, 2**40)):
        keys = torch.randint(0, hi, (n,), generator=torch.Generator().manual_seed(n))
        assert torch.equal(_sorted_unique(keys.clone()), torch.unique(keys))


def test_synthetic_graph_is_deterministic_by_seed():
    a = synthetic.power_law_edges(1000, 5000, seed=1)
    b = synthetic.power_law_edges(1000, 5000, seed=1)
    c = synthetic.power_law_edges(1000, 5000, seed=2)
    assert torch.equal(a, b)
    assert a.shape != c.shape or not torch.equal(a, c)


def test_synthetic_degrees_are_heavy_tailed():
    N, E = 20_000, 100_000
    deg = torch.bincount(synthetic.power_law_edges(N, E, seed=0)[1], minlength=N).double()
    # An Erdős–Rényi graph of this density has max/mean ~ 3 and its top 1% holds ~2%.
    assert deg.max() > 30 * deg.mean()
    top = deg.sort(descending=True).values
    assert top[: N // 100].sum() > 0.10 * top.sum()
    # Complementary CDF falls like d^-(gamma-1) = d^-1.5 over the tail, not exponentially.
    ccdf = lambda d: float((deg >= d).double().mean())  # noqa: E731
    slope = (torch.tensor(ccdf(100)).log() - torch.tensor(ccdf(20)).log()) / torch.tensor(5.0).log()
    assert -2.5 < float(slope) < -0.8


def test_synthetic_max_degree_caps_the_hub():
    N, E = 5000, 50_000
    free = torch.bincount(synthetic.power_law_edges(N, E)[1], minlength=N).max()
    capped = torch.bincount(synthetic.power_law_edges(N, E, max_degree=200)[1], minlength=N).max()
    assert capped <= 240 < free


def test_presets_and_spec_parsing():
    arxiv = synthetic.parse_spec("arxiv-like")
    assert (arxiv.num_nodes, arxiv.num_edges, arxiv.num_features) == (169_343, 1_166_243, 128)
    products = synthetic.parse_spec("products-like")
    assert (products.num_nodes, products.num_edges, products.num_features) == (
        2_449_029, 61_859_140, 100)
    assert synthetic.parse_spec("synthetic:10:20:3").num_edges == 20
    for bad in ("arxiv", "synthetic:10:20", "synthetic:1:0:3", "synthetic:4:13:2"):
        with pytest.raises(ValueError):
            synthetic.parse_spec(bad)


def test_synthetic_graph_cache_roundtrip(tmp_path):
    a = synthetic.synthetic_graph("synthetic:500:2000:4", cache_dir=tmp_path)
    assert len(list((tmp_path / "synthetic").glob("*.pt"))) == 1
    b = synthetic.synthetic_graph("synthetic:500:2000:4", cache_dir=tmp_path)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.x, b.x)
    assert a.x.shape == (500, 4)


# --- compare ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_compare_end_to_end_json(tmp_path, capsys):
    rc, rep = run_compare(tmp_path, "--layer", "all", "--no-memory")
    assert rc == 0
    assert TOP_KEYS <= set(rep) and rep["complete"] is True
    env = rep["environment"]
    assert {"device_name", "git_sha", "versions"} <= set(env)
    assert {"torch", "torch_geometric", "gatlib", "triton"} <= set(env["versions"])
    g = rep["graph"]
    assert g["num_nodes"] == 2000 and g["num_edges_with_self_loops"] == g["num_edges"] + 2000
    c = rep["config"]
    assert c["heads"] == 2 and c["channels"] == 8
    assert c["scope"] == "layer" and c["graph_input"] == "plan" and "backend_resolved" not in c
    assert set(rep["checks"]) == {"gat", "gatv2", "transformer"}
    assert all(c["status"] == "ok" for c in rep["checks"].values())
    # What ran is recorded (not guessed from the backend), forward and backward.
    assert set(rep["kernels"]) == set(compare.LAYERS)
    for names in rep["kernels"].values():
        assert names and all(n.split(".")[0] in gatlib.BACKENDS[1:] for n in names)
    assert len(rep["measurements"]) == 3 * 2 * 2
    for m in rep["measurements"]:
        assert m["time"]["status"] == "ok" and m["time"]["median_s"] > 0
        # gatlib's first call on a fresh plan is timed once, for the backward pass only.
        first = m["impl"] == "gatlib" and m["pass"] == "forward+backward"
        assert ("first_call_s" in m) == first and (not first or m["first_call_s"] > 0)
    assert len(rep["summary"]) == 6 and all(r["speedup"] > 0 for r in rep["summary"])
    out = capsys.readouterr().out
    assert "TransformerConv" in out and f"gatlib kernels: GATConv {', '.join(rep['kernels']['gat'])};" in out


@pytest.mark.slow
@pytest.mark.parametrize("graph_input", ["plan", "tensor"])
def test_graph_input_plan_or_tensor(tmp_path, monkeypatch, graph_input):
    """gatlib's layer gets a GraphPlan built once, or the tensor; PyG always the tensor."""
    seen = {}
    real = compare.make_pass

    def make_pass(module, x, edge_index, target, name):
        seen[type(module).__module__.split(".")[0], name] = type(edge_index)
        return real(module, x, edge_index, target, name)

    monkeypatch.setattr(compare, "make_pass", make_pass)
    rc, rep = run_compare(tmp_path, "--layer", "gatv2", "--no-memory", "--graph-input", graph_input)
    assert rc == 0 and rep["config"]["graph_input"] == graph_input
    assert rep["checks"]["gatv2"]["status"] == "ok"
    ours = gatlib.GraphPlan if graph_input == "plan" else torch.Tensor
    assert seen[("gatlib", "forward+backward")] is ours and seen[("gatlib", "forward")] is ours
    assert seen[("torch_geometric", "forward+backward")] is torch.Tensor
    (fb,) = [m for m in rep["measurements"] if m["impl"] == "gatlib" and m["pass"] == "forward+backward"]
    assert fb["first_call_s"] > 0


@pytest.fixture
def static_compile(monkeypatch):
    """torch.compile with dynamic=False: no dynamic-shape recompiles in the tests."""
    monkeypatch.setattr(compare, "COMPILE_OPTIONS", {**compare.COMPILE_OPTIONS, "dynamic": False})


def _check_four_sides(rep, passes, backend="inductor"):
    """What every four-implementation report holds: each side timed, each compiled
    side checked against eager PyG, compiled for real, and the new summary keys."""
    assert rep["schema"] == "gatlib.compare/3"
    assert rep["config"]["impls"] == list(compare.ALL_IMPLS)
    assert rep["config"]["compile_options"] == {"backend": backend, "mode": None,
                                                "fullgraph": False, "dynamic": False}
    check = rep["checks"]["gat"]
    assert check["status"] == "ok" and set(check["compiled"]) == set(compare_report.COMPILED_IMPLS)
    for impl, c in check["compiled"].items():
        assert c["status"] == "ok", (impl, c)
        for key in compare._QUANTITIES[rep["config"]["scope"]]:
            assert c[f"{key}_rel_err"] <= c[f"tol_{key}"] == 1e-4
    # Compiled for real: each compiled side's first call compiled graphs (the caches
    # were reset for the layer), the compiled gatlib ran the fused operators, and
    # nothing compiled while timing.
    comp = rep["compile"]["gat"]
    for impl in compare_report.COMPILED_IMPLS:
        assert comp[impl]["graphs"] >= 1 and comp[impl]["first_call_s"] > 0
    assert comp["gatlib_compiled"]["graph_breaks"] == 0  # the fused operators stay in the graph
    assert rep["kernels_compiled"]["gat"] == ["fused", "fused.backward"]
    assert rep["kernels"]["gat"] == ["fused", "fused.backward"]
    assert set(comp["graphs_while_timing"]) == set(passes)
    assert not any(comp["graphs_while_timing"].values())
    by = {(m["impl"], m["pass"]): m for m in rep["measurements"]}
    assert set(by) == {(i, p) for i in compare.ALL_IMPLS for p in passes}
    for (impl, p), m in by.items():
        assert m["time"]["status"] == "ok" and m["time"]["median_s"] > 0, (impl, p, m)
        if compare.is_compiled(impl):  # called until a call compiled nothing
            assert m["settle_calls"][-1]["graphs"] == 0
    first = passes[-1]  # forward+backward or train_step
    for impl in ("gatlib", *compare_report.COMPILED_IMPLS):
        assert by[impl, first]["first_call_s"] > 0
    assert by["pyg_compiled", first]["first_call_s"] == comp["pyg_compiled"]["first_call_s"]
    assert "first_call_s" not in by["pyg", first]
    assert [(r["layer"], r["pass"]) for r in rep["summary"]] == [("gat", p) for p in passes]
    for row in rep["summary"]:
        assert set(row["median_s"]) == set(compare.ALL_IMPLS)
        for key in compare_report.TIME_RATIOS:
            assert row[key] > 0 and len(row[f"{key}_rounds"]) == 1
        assert row["speedup_compiled"] == pytest.approx(
            row["median_s"]["pyg_compiled"] / row["median_s"]["gatlib_compiled"])
        assert row["speedup_vs_pyg_compiled"] == pytest.approx(
            row["median_s"]["pyg_compiled"] / row["median_s"]["gatlib"])
        assert row["gatlib_compiled_over_eager"] == pytest.approx(
            row["median_s"]["gatlib_compiled"] / row["median_s"]["gatlib"])
        assert set(compare_report.MEMORY_RATIOS) <= set(row)


@pytest.mark.slow
def test_model_scope_end_to_end(tmp_path, capsys, monkeypatch):
    """One training step of a 2-layer model, PyG's and gatlib's with the same weights,
    each eager and compiled; memory measured in fresh child processes, where the
    compiled sides compile before their warm-up call. Compiled by ``aot_eager``: dynamo's
    graphs and AOT autograd's backward as with inductor, without inductor's code generation
    (a cold compile of each model, in the parent and again in its child: 40 s on 2 cores),
    which test_layer_scope_four_sides runs in compare and tests/test_compile.py on models."""
    monkeypatch.setattr(compare, "COMPILE_OPTIONS",
                        {**compare.COMPILE_OPTIONS, "backend": "aot_eager", "dynamic": False})
    out = tmp_path / "model.json"
    rc = compare.main([*TINY_COMPILED, "--scope", "model", "--classes", "5",
                       "--data-dir", str(tmp_path / "data"), "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["complete"] and rep["config"]["scope"] == "model" and rep["config"]["classes"] == 5
    check = rep["checks"]["gat"]
    assert check["status"] == "ok" and check["weight"] == "conv1.lin.weight"
    assert check["loss_rel_err"] <= check["tol_loss"] and check["weight_grad_rel_err"] <= 1e-4
    assert all(c["weight"] == "conv1.lin.weight" for c in check["compiled"].values())
    _check_four_sides(rep, ["train_step"], backend="aot_eager")
    for m in rep["measurements"]:
        assert m["memory"]["status"] == "ok" and m["memory"]["hwm_reset"], m
    # PyG's GATConv removes and adds self-loops with data-dependent shapes (nonzero).
    assert rep["compile"]["gat"]["pyg_compiled"]["graph_breaks"] >= 1
    out = capsys.readouterr().out
    assert "training step of a 2-layer model" in out
    assert "time (medians)" in out and "peak extra memory" in out and "gatlib comp. ms" in out
    assert "gatlib compiled kernels: GATConv fused, fused.backward; torch.compile(" in out


@pytest.mark.slow
def test_layer_scope_four_sides(tmp_path, monkeypatch, static_compile):
    """--scope layer, the four sides; the compiled ones are torch.compile's modules (of
    the same objects as the eager sides') and get a graph input of their own. (The
    forward pass is left out: compiled gatlib layers do not yet compile under no_grad.)"""
    seen = []  # (module, graph input) of each measured call, in the order they were made
    real = compare.make_pass

    def make_pass(module, x, edge_index, target, name):
        warmed = isinstance(edge_index, gatlib.GraphPlan) and (edge_index._layout is not None
                                                            or bool(edge_index._loops))
        seen.append((module, edge_index, warmed))
        return real(module, x, edge_index, target, name)

    monkeypatch.setattr(compare, "make_pass", make_pass)
    rc, rep = run_compare(tmp_path, *TINY_COMPILED, "--no-memory", "--pass", "forward+backward")
    assert rc == 0
    _check_four_sides(rep, ["forward+backward"])
    (pyg, _, _), (pyg_c, _, _), (ours, plan, warm), (ours_c, plan_c, warm_c) = seen[:4]
    # a compiled call keeps nothing on a plan: the compiled side's is warmed by one eager
    # call before compiling, as docs/compile.md tells users; the eager side's first call warms its own
    assert warm_c and not warm
    assert isinstance(pyg_c, torch._dynamo.eval_frame.OptimizedModule) and pyg_c._orig_mod is pyg
    assert isinstance(ours_c, torch._dynamo.eval_frame.OptimizedModule) and ours_c._orig_mod is ours
    assert type(pyg).__module__.startswith("torch_geometric") and isinstance(ours, gatlib.GATConv)
    assert isinstance(plan, gatlib.GraphPlan) and isinstance(plan_c, gatlib.GraphPlan)
    assert plan is not plan_c
    table = compare.render_table(rep)
    assert "GATConv  forward+backward" in table and "PyG comp. 1st s" in table


def test_no_compile_gives_the_eager_two(tmp_path):
    rc, rep = run_compare(tmp_path, "--layer", "gat", "--no-memory")
    assert rc == 0 and rep["config"]["impls"] == ["pyg", "gatlib"]
    assert rep["config"]["compile_options"] is None
    assert {m["impl"] for m in rep["measurements"]} == {"pyg", "gatlib"}
    assert "compiled" not in rep["checks"]["gat"] and "kernels_compiled" not in rep
    assert all(r["speedup_compiled"] is None and r["mem_ratio_compiled"] is None
               for r in rep["summary"])
    assert compare_report.report_tables(rep)[0][1] == compare_report.TABLE_HEADERS


def _cheap_backend(monkeypatch, scale):
    """torch.compile with :func:`_bad_backend` (by name, as the options go into the
    JSON; registered for this test only)."""
    from torch._dynamo.backends import registry

    monkeypatch.setitem(registry._BACKENDS, "gatlib_test_backend", None)
    monkeypatch.setitem(registry._COMPILER_FNS, "gatlib_test_backend", _bad_backend(scale))
    monkeypatch.setattr(compare, "COMPILE_OPTIONS", {"backend": "gatlib_test_backend"})


def _bad_backend(scale):
    """A torch.compile backend without inductor (cheap): its graphs' floating outputs
    times ``scale`` (1: right), or raising (``scale=None``): a compile that fails."""
    def backend(gm, example_inputs):
        if scale is None:
            raise RuntimeError("no compiler here")

        def run(*args):
            return [o * scale if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                    for o in gm(*args)]
        return run
    return backend


@pytest.mark.slow
@pytest.mark.parametrize("scale, status", [(1.5, "mismatch"), (None, "error")])
def test_a_compiled_side_that_disagrees_or_fails_is_not_timed(tmp_path, monkeypatch, capsys,
                                                              scale, status):
    """Recorded for that side, the others timed, exit 1; not a crash."""
    _cheap_backend(monkeypatch, scale)
    rc, rep = run_compare(tmp_path, *TINY_COMPILED, "--no-memory", "--scope", "model",
                          "--classes", "3")
    assert rc == 1 and rep["complete"]
    check = rep["checks"]["gat"]
    assert check["status"] == "ok"  # eager gatlib agrees with PyG
    assert {c["status"] for c in check["compiled"].values()} == {status}
    time = {m["impl"]: m["time"] for m in rep["measurements"]}
    assert time["pyg"]["status"] == time["gatlib"]["status"] == "ok"
    assert time["pyg_compiled"]["status"] == time["gatlib_compiled"]["status"] == status
    assert rep["summary"][0]["speedup"] > 0 and rep["summary"][0]["speedup_compiled"] is None
    err = capsys.readouterr().err
    assert "torch.compile(gatlib.GATConv(backend='fused')) " in err and "Not timing it" in err


@pytest.mark.slow
def test_compile_mode_reaches_both_compiled_sides(tmp_path, monkeypatch):
    """--compile-mode goes to torch.compile for PyG's and gatlib's modules alike (each
    graph a backend compiled was given it) and into the report's options."""
    from torch._dynamo.backends import registry

    modes = []

    def backend(gm, example_inputs, mode=None, **kwargs):
        modes.append(mode)
        return gm.forward

    monkeypatch.setitem(registry._BACKENDS, "gatlib_test_backend", None)
    monkeypatch.setitem(registry._COMPILER_FNS, "gatlib_test_backend", backend)
    monkeypatch.setattr(compare, "COMPILE_OPTIONS", {"backend": "gatlib_test_backend"})
    rc, rep = run_compare(tmp_path, *TINY_COMPILED, "--no-memory", "--scope", "model",
                          "--classes", "3", "--compile-mode", "reduce-overhead")
    assert rc == 0, rep["checks"]
    assert rep["config"]["compile_options"] == {"backend": "gatlib_test_backend",
                                                "mode": "reduce-overhead"}
    assert {c["status"] for c in rep["checks"]["gat"]["compiled"].values()} == {"ok"}
    assert modes and set(modes) == {"reduce-overhead"}
    assert all(rep["compile"]["gat"][impl]["graphs"] > 0 for impl in compare_report.COMPILED_IMPLS)


def test_compile_mode_without_compiled_sides_is_refused(tmp_path, capsys):
    rc, rep = run_compare(tmp_path, "--compile-mode", "reduce-overhead")  # (TINY: --no-compile)
    assert rc == 2 and rep is None
    assert "--compile-mode reduce-overhead: there are no compiled sides" in capsys.readouterr().err


def test_a_compiled_side_that_ran_eagerly_is_an_error(tmp_path, monkeypatch):
    """If torch.compile compiled nothing (disabled, or a wrapper that is not it), the
    side's first call compiled no graph: an error, not a column of eager times."""
    monkeypatch.setattr(compare.torch, "compile", lambda module, **kw: module)
    rc, rep = run_compare(tmp_path, *TINY_COMPILED, "--no-memory", "--scope", "model",
                          "--classes", "3")
    assert rc == 1
    for c in rep["checks"]["gat"]["compiled"].values():
        assert c["status"] == "error" and "ran eagerly" in c["error"]


def test_model_pair_shares_weights_and_trains():
    pair = compare.build_pair("transformer", 8, 2, 4, "auto", torch.device("cpu"), torch.float32,
                              seed=0, scope="model", num_classes=3)
    theirs, ours = pair["pyg"].state_dict(), pair["gatlib"].state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert ours["conv2.lin_skip.weight"].shape == (3, 8)  # conv2: H*C -> classes, one head
    data = synthetic.synthetic_graph("synthetic:50:200:8")
    x, y = data.x, compare.random_labels(50, 3, "cpu", 0)
    step = compare.make_pass(pair["gatlib"], x, data.edge_index, y, compare.TRAIN_STEP)
    before = pair["gatlib"].conv1.lin_key.weight.detach().clone()
    loss = step()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert not torch.equal(before, pair["gatlib"].conv1.lin_key.weight)  # Adam stepped


def _tiny_spec(tmp_path, n=300, e=1000, f=8):
    data = synthetic.synthetic_graph(f"synthetic:{n}:{e}:{f}")
    inputs = tmp_path / "inputs.pt"
    torch.save({"x": data.x, "edge_index": data.edge_index,
                "edge_index_loops": compare.with_self_loops(data.edge_index, n)}, inputs)
    return {"builder": "gatlib.bench.compare:measured_call", "inputs": str(inputs),
            "layer": "gatv2", "pass": "forward+backward", "scope": "layer", "heads": 2,
            "channels": 8, "classes": None, "dtype": "float32", "backend": "auto",
            "graph_input": "plan", "seed": 0, "threads": torch.get_num_threads()}


@pytest.mark.slow
def test_cpu_memory_is_measured_in_a_fresh_process(tmp_path):
    spec = {**_tiny_spec(tmp_path, 3000, 30_000, 32), "impl": "pyg"}
    res = measure.peak_rss_child(spec, tmp_path)
    assert res["status"] == "ok", res
    assert res["hwm_reset"] and res["rss_before_bytes"] > 0
    # GATv2's [E, H, C] messages alone are 0.7 MB per copy here.
    assert res["peak_extra_bytes"] > 2**20


def test_compare_reports_memory_and_ratios(tmp_path, monkeypatch):
    # The children are tested above; here a stand-in keeps this run fast.
    fake = {"pyg": 400 * 2**20, "gatlib": 100 * 2**20}
    specs = []

    def fake_child(spec, workdir):
        specs.append(spec)
        return {"status": "ok", "peak_extra_bytes": fake[spec["impl"]], "hwm_reset": True}

    monkeypatch.setattr(measure, "peak_rss_child", fake_child)
    rc, rep = run_compare(tmp_path, "--layer", "gat")
    assert rc == 0
    assert all(m["memory"]["status"] == "ok" for m in rep["measurements"])
    assert [r["mem_ratio"] for r in rep["summary"]] == [0.25, 0.25]
    assert {s["builder"] for s in specs} == {"gatlib.bench.compare:measured_call"}
    assert {(s["impl"], s["pass"]) for s in specs} == {(i, p) for i in compare.IMPLS
                                                      for p in compare.PASSES}


def _pyg_runs_out_of_memory(monkeypatch, exc):
    real = compare.make_pass

    def make_pass(layer, *args):
        p = real(layer, *args)
        if type(layer).__module__.startswith("torch_geometric"):
            def boom():
                raise exc
            boom.clear = p.clear
            return boom
        return p

    monkeypatch.setattr(compare, "make_pass", make_pass)


@pytest.mark.slow
@pytest.mark.parametrize("exc", [torch.OutOfMemoryError("CUDA out of memory."), MemoryError()])
def test_out_of_memory_is_a_result(tmp_path, monkeypatch, capsys, exc):
    _pyg_runs_out_of_memory(monkeypatch, exc)
    rc, rep = run_compare(tmp_path, "--layer", "gat", "--no-memory")
    assert rc == 0
    status = {(m["impl"], m["pass"]): m["time"]["status"] for m in rep["measurements"]}
    assert status[("pyg", "forward")] == status[("pyg", "forward+backward")] == "OOM"
    assert status[("gatlib", "forward")] == "ok"
    assert all(r["speedup"] is None for r in rep["summary"])
    assert "OOM" in capsys.readouterr().out


@pytest.mark.slow
def test_peak_rss_reports_oom(tmp_path, monkeypatch):
    _pyg_runs_out_of_memory(monkeypatch, MemoryError())
    spec = _tiny_spec(tmp_path)
    pyg = measure.measure_peak_rss(lambda: compare.measured_call({**spec, "impl": "pyg"}))
    ours = measure.measure_peak_rss(lambda: compare.measured_call({**spec, "impl": "gatlib"}))
    assert pyg["status"] == "OOM" and ours["status"] == "ok"


@pytest.mark.skipif(not measure.proc_status(), reason="needs Linux /proc")
def test_memory_budget_turns_an_allocation_into_oom():
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(RuntimeError) as info:
        with measure.memory_budget(256 * 2**20):
            torch.empty(2**31, dtype=torch.uint8).fill_(1)
    assert measure.is_oom(info.value)
    assert resource.getrlimit(resource.RLIMIT_AS) == before  # restored


def test_child_killed_by_oom_killer_is_oom(tmp_path, monkeypatch):
    calls = []

    def killed(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, -9, "", "")

    monkeypatch.setattr(measure.subprocess, "run", killed)
    spec = {"builder": "gatlib.bench.compare:measured_call", "impl": "pyg"}
    assert measure.peak_rss_child(spec, tmp_path)["status"] == "OOM"
    # The child is the builder's module, run with --_child and the spec's path.
    assert calls[0][1:4] == ["-m", "gatlib.bench.compare", "--_child"]


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_disagreement_aborts(tmp_path, monkeypatch, capsys, scope):
    real = compare.build_pair

    def broken(*args, **kw):
        modules = real(*args, **kw)
        bias = next(p for n, p in modules["gatlib"].named_parameters() if n.endswith("bias"))
        with torch.no_grad():
            bias.add_(1.0)
        return modules

    monkeypatch.setattr(compare, "build_pair", broken)
    rc, rep = run_compare(tmp_path, "--layer", "all", "--no-memory", "--scope", scope)
    assert rc == 1
    assert "does not agree with torch_geometric.nn.GATConv" in capsys.readouterr().err
    assert rep["checks"]["gat"]["status"] == "mismatch" and rep["measurements"] == []
    assert "gatv2" not in rep["checks"]  # aborted after the first layer


@pytest.mark.parametrize("args", [["--graph", "nope"], ["--repeats", "0"], ["--heads", "0"],
                                  ["--scope", "model", "--pass", "forward"],
                                  ["--scope", "model", "--classes", "0"]])
def test_bad_arguments_exit_2(tmp_path, args, capsys):
    assert compare.main([*TINY, "--data-dir", str(tmp_path), *args]) == 2
    assert "gatlib compare: error" in capsys.readouterr().err




@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_a_gpu_exit_2(tmp_path):
    assert compare.main([*TINY, "--device", "cuda", "--data-dir", str(tmp_path)]) == 2


@pytest.mark.slow
def test_module_entry_point():
    res = subprocess.run([sys.executable, "-m", "gatlib.bench.compare", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--scope" in res.stdout and "--graph-input" in res.stdout


def _compare_table():
    """benchmarks/compare_table.py, imported from its file (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_table.py"
    spec = importlib.util.spec_from_file_location("compare_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_table_renders_a_report_and_judges_the_target(tmp_path):
    """The Markdown report shows every (layer, pass) of a run with the row builder the CLI
    prints with, and marks the target only in the target setting, per pass."""
    table = _compare_table()
    rc, rep = run_compare(tmp_path, "--layer", "gat", "--no-memory")
    assert rc == 0
    path = tmp_path / "compare_tiny.json"
    path.write_text(json.dumps(rep))
    md = table.render([path])
    assert "## compare_tiny" in md and "target (" not in md  # a tiny graph is not the target setting
    rows = compare_report.table_rows(rep)
    assert len(rows) == 2
    lines = md.splitlines()
    for r in rows:  # each row's cells on one line of the section's table
        assert any(all(cell in line for cell in r) for line in lines if line.startswith(f"| {r[0]} ")), r

    row = {"pass": "forward+backward", "speedup": 4.6, "mem_ratio": 0.09}
    assert table._verdict(row) == "met"
    assert table._verdict({**row, "speedup": 4.4}) == "not met"
    assert table._verdict({**row, "mem_ratio": 0.11}) == "not met"
    assert table._verdict({"pass": "train_step", "speedup": 3.6, "mem_ratio": None}) == "met"
    assert table._verdict({"pass": "train_step", "speedup": 3.4, "mem_ratio": 0.05}) == "not met"
    assert table._verdict({"pass": "forward", "speedup": 9.0, "mem_ratio": 0.01}) == ""
    target = {**rep, "config": {**rep["config"], **table.TARGET}}
    path.write_text(json.dumps(target))
    assert "target (forward+backward: ≥4.5x" in table.render([path])


@pytest.mark.slow
def test_compare_table_renders_compiled_sides(tmp_path, monkeypatch):
    """A schema 3 report (here compiled with a backend that runs the traced graphs as
    they are: cheap) gets a table of times, one of memory and one of first calls; the
    summary gains the compiled ratios, judged against the compiled target."""
    table = _compare_table()
    _cheap_backend(monkeypatch, 1.0)
    rc, rep = run_compare(tmp_path, *TINY_COMPILED, "--no-memory", "--scope", "model",
                          "--classes", "3")
    assert rc == 0 and compare_report.has_compiled(rep)
    path = tmp_path / "compare_tiny.json"
    path.write_text(json.dumps(rep))
    md = table.render([path])
    assert "**time (medians)**" in md and "**peak extra memory**" in md
    assert "compiled PyG ok (loss" in md and "compiled gatlib ok (loss" in md
    lines = md.splitlines()
    for rows in (compare_report.time_rows(rep), compare_report.memory_rows(rep), compare_report.first_call_rows(rep)):
        assert len(rows) == 1, rows
        assert any(all(cell in line for cell in rows[0]) for line in lines), rows[0]
    summary = next(line for line in lines if line.startswith("| synthetic:300:1500:16"))
    assert summary.count("|") == 17  # 16 columns: the compiled ratios and their target
    row = {"pass": "train_step", "speedup_compiled": 3.1, "gatlib_compiled_over_eager": 1.1,
           "gatlib_compiled_over_eager_mem": 1.2}
    assert table._verdict_compiled(row) == "met"
    assert table._verdict_compiled({**row, "speedup_compiled": 2.9}) == "not met"
    assert table._verdict_compiled({**row, "gatlib_compiled_over_eager": 1.2}) == "not met"
    assert table._verdict_compiled({**row, "gatlib_compiled_over_eager_mem": None}) == "n/a"
    assert table._verdict_compiled({"pass": "train_step", "speedup": 4.0}) == ""  # schema 2


def test_model_scope_under_autocast(tmp_path, capsys):
    """``--autocast bfloat16``: both models' layers run under CPU autocast (a Transformer's
    second layer then gets bfloat16 features), each checked against PyG in float32 without
    autocast by the low-precision rule, and timed; the table says so."""
    out = tmp_path / "amp.json"
    rc = compare.main([*TINY, "--scope", "model", "--classes", "5", "--autocast", "bfloat16",
                       "--no-memory", "--data-dir", str(tmp_path / "data"), "--json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["autocast"] == "bfloat16" and rep["config"]["dtype"] == "float32"
    for layer in compare_report.LAYERS:
        check = rep["checks"][layer]
        assert check["status"] == "ok", check
        # against float32 PyG: PyG's own autocast error is what the bound is made of
        assert 0 < check["weight_grad_rel_err_pyg_vs_fp32"] < 0.1
        assert check["tol_weight_grad"] == 2 * check["weight_grad_rel_err_pyg_vs_fp32"] + 1e-4
    assert {(m["layer"], m["impl"]) for m in rep["measurements"]} == {
        (layer, impl) for layer in compare_report.LAYERS for impl in ("pyg", "gatlib")}
    assert "float32 (autocast bfloat16) on" in capsys.readouterr().out


def test_autocast_runs_the_models_in_the_autocast_dtype():
    """The model of ``--autocast`` computes its layers in bfloat16 (its loss differs from
    float32's) and hands float32 logits to the loss."""
    data = synthetic.synthetic_graph("synthetic:50:200:8")
    labels = compare.random_labels(50, 3, "cpu", 0)
    for layer in compare_report.LAYERS:
        ei = compare.layer_edge_index(layer, data.edge_index,
                                      compare.with_self_loops(data.edge_index, 50))
        plain = compare.build_pair(layer, 8, 2, 4, "auto", torch.device("cpu"), torch.float32, 0,
                                   "model", 3)
        amp = compare.build_pair(layer, 8, 2, 4, "auto", torch.device("cpu"), torch.float32, 0,
                                 "model", 3, torch.bfloat16)
        for impl in ("pyg", "gatlib"):
            assert amp[impl](data.x, ei).dtype == torch.float32
            loss_amp = compare.model_outputs(amp[impl], data.x, ei, labels)[0]
            loss = compare.model_outputs(plain[impl], data.x, ei, labels)[0]
            assert loss.dtype == loss_amp.dtype == torch.float32 and loss != loss_amp


def test_deterministic_runs_under_deterministic_algorithms(tmp_path, monkeypatch):
    """``--deterministic``: every call of the run (checks and timing) under
    ``torch.use_deterministic_algorithms(True)``, the caller's setting after it."""
    seen = []
    real = compare.make_pass

    def spying(*args, **kwargs):
        fn = real(*args, **kwargs)

        def call():
            seen.append(torch.are_deterministic_algorithms_enabled())
            return fn()
        call.clear = fn.clear
        return call
    monkeypatch.setattr(compare, "make_pass", spying)
    assert not torch.are_deterministic_algorithms_enabled()
    rc, rep = run_compare(tmp_path, "--layer", "gat", "--no-memory", "--deterministic")
    assert rc == 0 and rep["config"]["deterministic"] is True
    assert rep["checks"]["gat"]["status"] == "ok"
    assert seen and all(seen)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("args", [["--autocast", "bfloat16"],  # (scope layer)
                                  ["--scope", "model", "--autocast", "bfloat16", "--dtype", "bfloat16"]])
def test_autocast_outside_a_float32_model_is_refused(tmp_path, args, capsys):
    assert compare.main([*TINY, "--data-dir", str(tmp_path), *args]) == 2
    assert "--autocast applies to --scope model with --dtype float32" in capsys.readouterr().err
