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


def test_training_step_floor_counted_by_hand():
    """`gatlib compare --scope model`'s step: conv1 without grad x, ELU, conv2 (3 classes, one
    head) with it, the cross-entropy and Adam, in the order they run."""
    import dataclasses

    fl = floor.step_floor("gat", TINY, num_classes=3)
    assert [k.name for k in fl.kernels] == [
        "conv1.project", "conv1.attend", "elu", "conv2.project", "conv2.attend",
        "cross_entropy", "cross_entropy.backward", "conv2.attend.dst", "conv2.attend.src",
        "conv2.project", "elu.backward", "conv1.attend.dst", "conv1.attend.src",
        "conv1.project", "adam"]
    conv1 = floor.layer_floor("gat", "forward+backward", dataclasses.replace(TINY, input_grad=False))
    conv2 = floor.layer_floor("gat", "forward+backward", floor.Shape(2, 2, 3, 2, 1, 3))
    # elu: h and y [2, 2] 16 + 16; elu.backward: grad y, h, grad h 48; cross_entropy: logits
    # [2, 3] 24, labels 16, lse 8; its backward also writes grad logits 24; adam: P = conv1's
    # W [1, 2] + att_src, att_dst, bias 2 each = 8 and conv2's W [2, 3] + 3 * 3 = 15, times
    # 7 tensors of 4 bytes = 644
    assert fl.bytes_lo - conv1.bytes_lo - conv2.bytes_lo == 32 + 48 + 48 + 72 + 644
    assert fl.bytes_hi - conv1.bytes_hi - conv2.bytes_hi == 32 + 48 + 48 + 72 + 644
    # conv1: x W (2 * 2 * 1 * 4 flops) and grad W only; conv2 (K = 3 + 2): also grad x
    assert (conv1.flops, conv2.flops, fl.flops) == (16 + 16, 40 + 80, 32 + 120)


@pytest.mark.parametrize("layer, cls", [("gat", "GATConv"), ("gatv2", "GATv2Conv"),
                                        ("transformer", "TransformerConv")])
def test_adam_moves_the_parameters_pyg_builds(layer, cls):
    """The step floor's parameter count is what PyG's layers hold, for conv1 (three heads
    concatenated) and conv2 (one head, averaged)."""
    import torch_geometric.nn as pyg_nn

    for F, C, H, concat in ((1433, 256, 3, True), (768, 40, 1, False)):
        module = getattr(pyg_nn, cls)(F, C, heads=H, concat=concat)
        assert sum(p.numel() for p in module.parameters()) == floor.num_parameters(layer, F, H, C)


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
def _report(device="cuda", device_name="Some Future GPU", copy_bytes_per_s=1e6, scope="layer"):
    """A `gatlib compare` report of GATConv's forward on the TINY graph, with made-up times
    (seconds): at 1 MB/s and no GEMM peak the floor is 0.136 ms (lo) and 0.148 ms (hi).
    ``scope="model"``: the 2-layer model's training step (3 classes) instead, at the same times."""
    medians = {"pyg": 1.36e-3, "gatlib": 0.272e-3, "gatlib_compiled": 0.136e-3}
    pass_ = "forward" if scope == "layer" else "train_step"
    measurements = [{"layer": "gat", "impl": impl, "pass": pass_,
                     "time": {"status": "ok", "median_s": t, "times_s": [t]}}
                    for impl, t in medians.items()]
    rep = {
        "graph": {"name": "tiny", "num_nodes": 2, "num_edges": 1, "num_edges_with_self_loops": 3,
                  "num_features": 1},
        "config": {"device": device, "scope": scope, "heads": 1, "channels": 2,
                   "dtype": "float32", "backend": "triton", "graph_input": "plan",
                   "compile_options": dict(compare.COMPILE_OPTIONS),
                   "classes": None if scope == "layer" else 3},
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


def test_a_training_step_is_set_against_its_floor():
    """`gatlib compare --scope model` on CUDA prints its step against the step's floor."""
    rep = _report(scope="model")
    fl = floor.step_floor("gat", floor.report_shape(rep), 3)
    lo, hi = fl.bytes_lo / 1e6 * 1e3, fl.bytes_hi / 1e6 * 1e3  # ms at 1 MB/s, bytes only
    line = next(line for line in compare.render_table(rep).splitlines() if "train_step" in line
                and "copy" in line)
    cells = re.split(r"\s{2,}", line.strip())
    assert cells[:3] == ["GATConv", "train_step", "1e-06 TB/s copy"]
    assert cells[-4:] == [f"{1.36 / lo:.1f} / {1.36 / hi:.1f}", "-",
                          f"{0.272 / lo:.1f} / {0.272 / hi:.1f}",
                          f"{0.136 / lo:.1f} / {0.136 / hi:.1f}"]
    # a model report that names no classes has no floor
    rep["config"]["classes"] = None
    assert floor.report_rows(rep) == []


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
    assert script.render([result]).startswith("no CUDA pass")
    md = script.render([result], ["tiny"], "copy")
    row = next(line for line in md.splitlines() if line.startswith("| tiny"))
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "tiny", "GATConv", "forward", "0.14 / 0.15", "1.4", "10.0 / 9.2", "0.3", "2.0 / 1.8",
        "0.1", "1.0 / 0.9"]  # PyG, gatlib, compiled gatlib; compiled PyG was not measured
    assert script.render([result], ["other"], "copy").startswith("no CUDA pass")
