"""The PyG comparison tool (gatlib.compare) and its synthetic graphs (gatlib.synthetic).

End-to-end runs use a tiny power-law graph, one thread and one timing round: they
check the plumbing and the JSON, never the speed.
"""
import json
import subprocess

import pytest
import torch

from gatlib import compare, synthetic

TINY = ["--graph", "synthetic:2000:10000:32", "--heads", "2", "--channels", "8",
        "--repeats", "1", "--threads", "1", "--block-seconds", "0.01"]
TOP_KEYS = {"schema", "command", "timestamp", "config", "environment", "graph", "checks",
            "measurements", "summary", "complete"}


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


# --- compare ----------------------------------------------------------------------------------
def test_compare_end_to_end_json(tmp_path, capsys):
    rc, rep = run_compare(tmp_path, "--layer", "all", "--no-memory")
    assert rc == 0
    assert TOP_KEYS <= set(rep) and rep["complete"] is True
    env = rep["environment"]
    assert {"device_name", "git_sha", "versions"} <= set(env)
    assert {"torch", "torch_geometric", "gatlib", "triton"} <= set(env["versions"])
    g = rep["graph"]
    assert g["num_nodes"] == 2000 and g["num_edges_with_self_loops"] == g["num_edges"] + 2000
    assert rep["config"]["heads"] == 2 and rep["config"]["channels"] == 8
    assert set(rep["checks"]) == {"gat", "gatv2", "transformer"}
    assert all(c["status"] == "ok" for c in rep["checks"].values())
    assert len(rep["measurements"]) == 3 * 2 * 2
    for m in rep["measurements"]:
        assert m["time"]["status"] == "ok" and m["time"]["median_s"] > 0
    assert len(rep["summary"]) == 6 and all(r["speedup"] > 0 for r in rep["summary"])
    assert "TransformerConv" in capsys.readouterr().out


def _tiny_inputs(tmp_path, n=300, e=1000, f=8):
    data = synthetic.synthetic_graph(f"synthetic:{n}:{e}:{f}")
    inputs = tmp_path / "inputs.pt"
    torch.save({"x": data.x, "edge_index": data.edge_index,
                "edge_index_loops": compare._with_self_loops(data.edge_index, n)}, inputs)
    return {"inputs": str(inputs), "layer": "gatv2", "pass": "forward+backward", "heads": 2,
            "channels": 8, "dtype": "float32", "backend": "auto", "seed": 0,
            "threads": torch.get_num_threads()}


def test_cpu_memory_is_measured_in_a_fresh_process(tmp_path):
    spec = {**_tiny_inputs(tmp_path, 3000, 30_000, 32), "impl": "pyg"}
    res = compare.peak_rss_child(spec, tmp_path)
    assert res["status"] == "ok", res
    assert res["hwm_reset"] and res["rss_before_bytes"] > 0
    # GATv2's [E, H, C] messages alone are 0.7 MB per copy here.
    assert res["peak_extra_bytes"] > 2**20


def test_compare_reports_memory_and_ratios(tmp_path, monkeypatch):
    # The children are tested above; here a stand-in keeps this run fast.
    fake = {"pyg": 400 * 2**20, "gatlib": 100 * 2**20}
    monkeypatch.setattr(compare, "peak_rss_child", lambda spec, workdir: {
        "status": "ok", "peak_extra_bytes": fake[spec["impl"]], "hwm_reset": True})
    rc, rep = run_compare(tmp_path, "--layer", "gat")
    assert rc == 0
    assert all(m["memory"]["status"] == "ok" for m in rep["measurements"])
    assert [r["mem_ratio"] for r in rep["summary"]] == [0.25, 0.25]


def _pyg_runs_out_of_memory(monkeypatch, exc):
    real = compare._make_pass

    def make_pass(layer, *args):
        p = real(layer, *args)
        if type(layer).__module__.startswith("torch_geometric"):
            def boom():
                raise exc
            boom.clear = p.clear
            return boom
        return p

    monkeypatch.setattr(compare, "_make_pass", make_pass)


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


def test_peak_rss_reports_oom(tmp_path, monkeypatch):
    _pyg_runs_out_of_memory(monkeypatch, MemoryError())
    spec = _tiny_inputs(tmp_path)
    assert compare.measure_peak_rss({**spec, "impl": "pyg"})["status"] == "OOM"
    assert compare.measure_peak_rss({**spec, "impl": "gatlib"})["status"] == "ok"


@pytest.mark.skipif(not compare._proc_status(), reason="needs Linux /proc")
def test_memory_budget_turns_an_allocation_into_oom():
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(RuntimeError) as info:
        with compare.memory_budget(256 * 2**20):
            torch.empty(2**31, dtype=torch.uint8).fill_(1)
    assert compare._is_oom(info.value)
    assert resource.getrlimit(resource.RLIMIT_AS) == before  # restored


def test_child_killed_by_oom_killer_is_oom(tmp_path, monkeypatch):
    monkeypatch.setattr(compare.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, -9, "", ""))
    spec = {"impl": "pyg", "layer": "gat", "pass": "forward"}
    assert compare.peak_rss_child(spec, tmp_path)["status"] == "OOM"


def test_disagreement_aborts(tmp_path, monkeypatch, capsys):
    real = compare.build_pair

    def broken(*args, **kw):
        layers = real(*args, **kw)
        with torch.no_grad():
            layers["gatlib"].bias.add_(1.0)
        return layers

    monkeypatch.setattr(compare, "build_pair", broken)
    rc, rep = run_compare(tmp_path, "--layer", "all", "--no-memory")
    assert rc == 1
    assert "does not agree with torch_geometric.nn.GATConv" in capsys.readouterr().err
    assert rep["checks"]["gat"]["status"] == "mismatch" and rep["measurements"] == []
    assert "gatv2" not in rep["checks"]  # aborted after the first layer


@pytest.mark.parametrize("args", [["--graph", "nope"], ["--repeats", "0"], ["--heads", "0"]])
def test_bad_arguments_exit_2(tmp_path, args, capsys):
    assert compare.main([*TINY, "--data-dir", str(tmp_path), *args]) == 2
    assert "gatlib compare: error" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_a_gpu_exit_2(tmp_path):
    assert compare.main([*TINY, "--device", "cuda", "--data-dir", str(tmp_path)]) == 2
