"""The bandwidth floor (gatlib.bench.floor): its byte counts on a graph small enough to count
by hand, the bandwidth a report is set against (published, or measured where the device is
unknown), and the floor table as `gatlib compare` and `gatlib selftest` print it on CUDA.
No GPU and no timing: the measurements are made up."""
from __future__ import annotations

import re

import pytest

from gatlib.bench import compare, floor, selftest

# Two nodes, three edges (self-loops included), F = 1, one head of two channels, float32:
# every row is a few bytes, so each term below can be counted by hand.
TINY = floor.Shape(num_src=2, num_dst=2, num_edges=3, in_channels=1, heads=1, channels=2)


def test_gat_forward_bytes_counted_by_hand():
    fl = floor.layer_floor("gat", "forward", TINY)
    # project: x [2, 1] 8 + W [1, HC + 2H = 4] 16 + h [2, 2] 16 + a_src, a_dst [2, 1] 8 + 8 = 56
    # attend: CSR ptr 3 * 4 + src 3 * 4 = 24, a_dst 8, bias 8, out 16 = 56, plus the
    #   gathered a_src (2 rows of 4 B lo, 3 hi) and h (2 rows of 8 B lo, 3 hi): 80 lo, 92 hi
    assert [k.name for k in fl.kernels] == ["project", "attend"]
    assert [(k.bytes_lo, k.bytes_hi) for k in fl.kernels] == [(56, 56), (80, 92)]
    assert (fl.bytes_lo, fl.bytes_hi, fl.flops) == (136, 148, 2 * 2 * 1 * 4)
    # each kernel's time is the larger of its bytes and its flops: at 1 B/s and a GEMM
    # peak of 0.1 flop/s the projection takes 160 s, not 56
    assert fl.seconds(1.0) == (136.0, 148.0)
    assert fl.seconds(1.0, 0.1) == pytest.approx((160 + 80, 160 + 92))


def test_gat_forward_backward_bytes_counted_by_hand():
    fl = floor.layer_floor("gat", "forward+backward", TINY)
    # attend also writes lse [2, 1] (8); attend.dst: CSR 24, g 16, out 16, lse 8, a_dst 8,
    # bias 8, gathered a_src 8 / 12 and h 16 / 24, alpha and dscore [3, 1] 12 + 12,
    # grad a_dst 8, grad bias 8; attend.src: CSC ptr, dst, CSR positions 36, alpha and
    # dscore 24, gathered g 16 / 24, grad h 16, grad a_src 8; project backward: grad h 16,
    # grad a_src 8, grad a_dst 8, x 8, grad W 16, W 16, grad x 8
    assert [k.name for k in fl.kernels] == ["project", "attend", "attend.dst", "attend.src",
                                            "project"]
    assert [(k.bytes_lo, k.bytes_hi) for k in fl.kernels] == [
        (56, 56), (88, 100), (144, 156), (100, 108), (80, 80)]
    assert fl.flops == 16 + 2 * (2 * 2 * 1 * 4)  # forward GEMM, then grad x and grad W


@pytest.mark.parametrize("layer, gathered", [
    # (layer, per pass: (source-row bytes gathered per edge, destination-row bytes))
    ("gat", {"forward": (3 * 256 + 3, 0), "forward+backward": (2 * (3 * 256 + 3), 3 * 256)}),
    ("gatv2", {"forward": (3 * 256, 0), "forward+backward": (2 * 3 * 256, 2 * 3 * 256)}),
    ("transformer", {"forward": (2 * 3 * 256, 0),
                     "forward+backward": (2 * 2 * 3 * 256, 2 * 3 * 256)}),
])
def test_hi_reads_each_gathered_row_once_per_edge(layer, gathered):
    """hi − lo is exactly the gathered rows read E times instead of N: source rows in the
    forward and destination-major backward, destination rows in the source-major one."""
    sh = floor.Shape(169_343, 169_343, 2_495_289, 128, 3, 256)
    for pass_, (src_row, dst_row) in gathered.items():
        fl = floor.layer_floor(layer, pass_, sh)
        extra = (sh.num_edges - sh.num_src) * src_row * 4 + (sh.num_edges - sh.num_dst) * dst_row * 4
        assert fl.bytes_hi - fl.bytes_lo == extra, pass_


def test_edge_features_and_bipartite_add_their_tensors():
    edge = floor.Shape(2, 2, 3, 1, 1, 2, edge_dim=5)
    plain, with_edge = (floor.layer_floor("gatv2", "forward", s) for s in (TINY, edge))
    # project.edge: edge_attr [3, 5] 60 + W_e [5, 2] 40 + e [3, 2] 24; attend: e 24, ids 12
    assert with_edge.bytes_lo - plain.bytes_lo == 60 + 40 + 24 + 24 + 12
    assert with_edge.flops - plain.flops == 2 * 3 * 5 * 2
    bipartite = floor.layer_floor("transformer", "forward", floor.Shape(3, 2, 4, 1, 1, 2))
    assert [k.name for k in bipartite.kernels] == ["project.src", "project.dst", "attend"]


# --- bandwidth ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, part", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"), ("NVIDIA L40S", "L40S"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None), ("NVIDIA GeForce GTX 1080", None),
])
def test_published_bandwidth_by_device_name(name, part):
    spec = floor.published(name)
    assert (spec.part if spec else None) == part


def test_an_unknown_device_takes_the_measured_bandwidth():
    record = {"measured_copy": {"bytes_per_s": 1.5e12}}
    assert floor.bandwidths("Some Future GPU", record) == ([("1.5 TB/s copy", 1.5e12)], None)
    assert floor.gemm_peak(None, "float32") is None  # no published GEMM peak either
    bws, spec = floor.bandwidths("NVIDIA H100 80GB HBM3", record)
    assert [bw for _, bw in bws] == [3.35e12, 1.5e12] and spec.part == "H100 SXM"
    assert floor.gemm_peak(spec, "float32") == (67e12, "FP32")
    assert floor.gemm_peak(spec, "float32", "high") == (989 / 2 * 1e12, "TF32")


# --- the floor table in the CUDA reports --------------------------------------------------------
def _report(device="cuda", device_name="Some Future GPU", copy_bytes_per_s=1e6):
    """A `gatlib compare` report of GATConv's forward on the TINY graph, with made-up times
    (seconds): at 1 MB/s and no GEMM peak the floor is 0.136 ms (lo) and 0.148 ms (hi)."""
    medians = {"pyg": 1.36e-3, "gatlib": 0.272e-3, "gatlib_compiled": 0.136e-3}
    measurements = [{"layer": "gat", "impl": impl, "pass": "forward",
                     "time": {"status": "ok", "median_s": t, "times_s": [t]}}
                    for impl, t in medians.items()]
    rep = {
        "graph": {"name": "tiny", "num_nodes": 2, "num_edges": 1, "num_edges_with_self_loops": 3,
                  "num_features": 1},
        "config": {"device": device, "scope": "layer", "heads": 1, "channels": 2,
                   "dtype": "float32", "backend": "triton", "graph_input": "plan",
                   "compile_options": dict(compare.COMPILE_OPTIONS), "classes": None},
        "environment": {"device": device, "device_name": device_name, "num_threads": 1},
        "checks": {}, "kernels": {}, "measurements": measurements,
    }
    if device == "cuda":
        rep["bandwidth"] = {"device_name": device_name, "published": None,
                            "measured_copy": {"bytes_per_s": copy_bytes_per_s},
                            "float32_matmul_precision": "highest"}
    rep["summary"] = compare.summarize(measurements)
    return rep


def _selftest_result(report):
    return {"environment": report["environment"], "interpreter": False, "gpu_checks": [],
            "kernel_checks": {"passed": 0, "failed": 0, "cases": []},
            "comparisons": [{"graph": "tiny", "status": "ok", "report": report}]}


def _floor_cells(text):
    """The cells of the floor table's row (a Markdown row, or columns two spaces apart)."""
    line = next(line for line in text.splitlines() if "forward" in line and "copy" in line)
    if line.startswith("|"):
        return [c.strip() for c in line.strip("|").split("|")]
    return re.split(r"\s{2,}", line.strip())


def test_compare_and_selftest_print_time_over_floor():
    rep = _report()
    # 136 and 148 bytes (MB), 16 flops (GFLOP), the floors in ms; PyG 1.36 ms / 0.136 = 10.0,
    # / 0.148 = 9.2; gatlib 0.272 ms: 2.0 / 1.8; compiled gatlib 0.136 ms: 1.0 / 0.9;
    # compiled PyG not measured
    cells = ["GATConv", "0.000136", "0.000148", "1.6e-08", "0.136", "0.148", "10.0 / 9.2", "-",
             "2.0 / 1.8", "1.0 / 0.9"]
    plain = compare.render_table(rep)
    markdown = selftest.render_markdown(_selftest_result(rep))
    for text, graph in ((plain, []), (markdown, ["tiny"])):
        # unknown device: the measured copy only, and the note says so
        assert _floor_cells(text) == [*graph, cells[0], "forward", "1e-06 TB/s copy", *cells[1:]]
        assert "not in gatlib.bench.floor.DEVICES" in text and "bytes only" in text


def test_a_known_device_gets_both_bandwidths():
    rep = _report(device_name="NVIDIA H100 80GB HBM3")
    rows = floor.report_rows(rep)
    assert [r[2] for r in rows] == ["3.35 TB/s published", "1e-06 TB/s copy"]
    assert "FP32, published" in compare.render_table(rep)


def test_cpu_reports_print_no_floor():
    rep = _report(device="cpu", device_name="Some CPU")
    assert floor.report_rows(rep) == []
    assert "floor" not in compare.render_table(rep).lower()
    assert "floor" not in selftest.render_markdown(_selftest_result(rep)).lower()


def test_floor_table_script_renders_the_recorded_runs(tmp_path):
    """benchmarks/floor_table.py (what the README's table comes from) on a selftest JSON:
    the same floors and ratios as the reports, at the bandwidth asked for."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "floor_table.py"
    spec = importlib.util.spec_from_file_location("floor_table", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = tmp_path / "selftest.json"
    result.write_text(json.dumps(_selftest_result(_report())))
    # the made-up device is unknown: only the copy it measured is a bandwidth
    assert script.render([result]).startswith("no CUDA layer pass")
    md = script.render([result], ["tiny"], "copy")
    row = next(line for line in md.splitlines() if line.startswith("| tiny"))
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "tiny", "GATConv", "forward", "0.14 / 0.15", "1.4", "10.0 / 9.2", "0.3", "2.0 / 1.8",
        "0.1", "1.0 / 0.9"]  # PyG, gatlib, compiled gatlib; compiled PyG was not measured
    assert script.render([result], ["other"], "copy").startswith("no CUDA layer pass")
