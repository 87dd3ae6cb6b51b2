"""gatlib.introspect, the harness's view of the kernels: each name is the
kernels' own object (or calls it), and importing it needs no Triton."""
import importlib.util
import subprocess
import sys

import pytest
import torch

import gatlib
from gatlib import _dispatch, introspect

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed: the Triton names cannot resolve")


def test_not_a_user_api():
    assert "introspect" not in gatlib.__all__ and "not a user API" in introspect.__doc__
    assert set(introspect.__all__) <= set(dir(introspect))


def test_dispatcher_kernels_are_the_dispatchers(monkeypatch):
    for name in ("torch", "scatter", "fused", "triton"):
        assert introspect.kernel(name) is _dispatch.KERNELS[name]
    stand_in = _dispatch.ReferenceKernel()  # looked up when called: a test's patch shows
    monkeypatch.setitem(_dispatch.KERNELS, "triton", stand_in)
    assert introspect.kernel("triton") is stand_in


@pytest.mark.slow
def test_importing_it_needs_no_triton():
    code = ("import sys; sys.modules['triton'] = None; import torch, gatlib.introspect as i; "
            "print(i.kernel('triton').available(torch.device('cpu')), 'gatlib._triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False" and "not installed" in out.stdout, out.stdout


@needs_triton
def test_triton_names_are_the_kernels_own():
    from gatlib import _triton, _triton_kernels, _triton_schedule

    assert introspect.TRITON_SPLIT == _triton_schedule._SPLIT
    assert introspect.TRITON_MAX_CHANNELS == _triton._MAX_C
    kernels = introspect.triton_kernels()
    assert {"_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel", "_alpha_kernel", "_keep_kernel",
            "_merge_kernel"} == set(kernels)
    for name, fn in kernels.items():
        assert fn is getattr(_triton_kernels, name) and fn.__name__ == name
    assert not hasattr(introspect, "NO_SUCH_NAME")  # (__getattr__ raises AttributeError)


@needs_triton
def test_triton_functions_call_the_kernels_own(monkeypatch):
    from gatlib import _triton, _triton_schedule

    plan = gatlib.GraphPlan(torch.tensor([[0, 1, 2, 2], [1, 2, 0, 1]]), num_nodes=3)
    assert introspect.triton_schedule(plan) is _triton_schedule._plan(plan)  # built once, kept on the plan
    seed = introspect.draw_dropout_seed(torch.device("cpu"))
    assert seed.shape == (1,) and seed.dtype == torch.int64
    calls = []
    for private, public, args in (
            ("_check_interpreter", "check_triton_interpreter", ()),
            ("_draw_seed", "draw_dropout_seed", ("cpu",)),
            ("dropout_keep_mask", "dropout_keep_mask", (plan, 2, 0.5, seed)),
            ("attention", "triton_attention", (None, None, plan, None, 0.0, False, None))):
        monkeypatch.setattr(_triton, private, lambda *a, _n=private: calls.append((_n, a)) or _n)
        result = getattr(introspect, public)(*args)
        assert calls[-1] == (private, args)
        assert result == (None if public == "check_triton_interpreter" else private)


@needs_triton
def test_cpu_tensors_admitted_only_inside(monkeypatch):
    from gatlib import _triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton, cpu = introspect.kernel("triton"), torch.device("cpu")
    assert triton.available(cpu) is not None
    real = _triton._check_interpreter
    with introspect.triton_admits_cpu_tensors():
        assert triton.available(cpu) is None
        introspect.check_triton_interpreter()  # lifted: no error
    assert triton.available(cpu) is not None and _triton._check_interpreter is real


@needs_triton
def test_triton_tiles_set_the_row_kernels_tile_and_restore_it(monkeypatch):
    """Inside the block the compiled row kernels take the given tile at every width (their
    constexprs: edges per step E0, lanes R0) and the given programs per SM; after it, the
    library's own again (the larger tile from 128 channels on)."""
    sched = importlib.import_module("gatlib._triton_schedule")
    monkeypatch.setattr(sched, "_interpreted", lambda: False)  # the compiled path's tile
    kernels = introspect.triton_kernels()
    fwd, dst, src = (kernels[k] for k in ("_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel"))

    def consts():
        return {(w, f): sched._group_consts(w, f) for w in (64, 256) for f in (False, True)}

    def caps():  # (warps, row width) of narrow and wide rows
        return [sched._max_registers(w, k, c) for w, c in ((4, 64), (8, 128), (8, 256))
                for k in (fwd, dst, src)]

    own = consts()
    # 2048 elements per step for the backward at wide rows, 1024 for the forward at
    # rows of 256 channels and at narrow rows
    assert own[256, False]["E0"] == 8 and own[256, True]["E0"] == 4
    # below 256 channels the forward's schedule and the src backward's have 4 lanes of 4
    # edges (1024 elements at 64 channels, 2048 at 128)
    assert [own[64, f][k] for f in (True, False) for k in ("R0", "E0", "B1")] \
        == [4, 4, 3, 4, 4, 3]
    # ... but GAT from given node terms (KIND 0) below 128 channels: the tile's edges
    for f in (True, False):
        assert [sched._group_consts(64, f, 0)[k] for k in ("R0", "E0", "B1")] == [1, 16, 2]
        assert [sched._group_consts(128, f, 0)[k] for k in ("R0", "E0", "B1")] == [4, 4, 3]
    with introspect.triton_tiles(edges_node_terms=4) as values:  # (a GPU diagnosis)
        assert values["edges_node_terms"] == 4
        assert [sched._group_consts(64, True, 0)[k] for k in ("R0", "E0", "B1")] == [4, 4, 3]
    assert sched._EDGES_NODE_TERMS is None
    assert [sched._group_consts(128, f)[k] for f in (True, False) for k in ("R0", "E0", "B1")] \
        == [4, 4, 3, 4, 4, 3]
    # the src backward's tile of scalars (and of rows narrower than 8 channels) keeps the
    # tile's edges: 16 lanes of up to 64 edges; with edges_src=16, one lane of 16 at 64
    assert [sched._group_consts(1, False)[k] for k in ("R0", "E0", "B1")] == [16, 64, 1]
    with introspect.triton_tiles(edges_src=16) as values:
        assert values["edges_src"] == 16
        assert [sched._group_consts(64, False)[k] for k in ("R0", "E0", "B1")] == [1, 16, 2]
    assert sched._EDGES_SRC == 4
    own_caps = caps()
    # two programs per SM, one dst backward; four forward and dst backward programs at
    # 256 channels
    assert own_caps == [255, 255, 255, 128, 255, 128, 64, 64, 128]
    # ... but heavy calls keep their kernel's count: the dst backward's (edge features,
    # GAT's node terms, dropout) one program's registers, the forward's (dropout) two
    assert sched._max_registers(8, dst, 256, heavy=True) == 255
    assert sched._max_registers(8, fwd, 256, heavy=True) == 128
    assert sched._heavy({"KIND": 0}, dst) and sched._heavy({"KIND": 2, "HAS_VEDGE": True}, dst)
    assert not sched._heavy({"KIND": 0}, fwd) and not sched._heavy({"KIND": 2, "HAS_EDGE": True}, fwd)
    assert all(sched._heavy({"KIND": 1, "DROPOUT": True}, k) for k in (fwd, dst))
    assert not sched._heavy({"KIND": 3, "HAS_EDGE": False, "DROPOUT": False}, dst)
    with introspect.triton_tiles(tile=4096, programs_per_sm=8, stages=1, resident=4,
                                 edges_wide=16, edges_narrow=32) as values:
        assert values == {"tile": 4096, "tile_wide": 4096, "tile_wide_fwd": 4096, "wide": 128,
                          "programs_per_sm": 8, "stages": 1, "resident": 4, "resident_heavy": 4,
                          "resident_fwd": 4, "edges_wide": 16, "edges_narrow": 32,
                          "edges_node_terms": None, "edges_src": 4, "lane_heads": 1,
                          "items_ahead": 1}
        assert all(c["E0"] == (16 if w == 256 else 32 if f else 4)
                   for (w, f), c in consts().items())
        assert [sched._group_consts(128, True)[k] for k in ("R0", "E0")] == [2, 16]
        assert sched._PROGRAMS_PER_SM == 8 and sched._STAGES == 1
        # four programs of 8 (4) warps in 64K registers, every row kernel alike
        assert caps() == [128] * 3 + [64] * 6
    assert consts() == own and caps() == own_caps
    with introspect.triton_tiles() as values:
        assert values["tile"] == 1024 and values["tile_wide"] == 2048 and values["stages"] == 2
        assert values["tile_wide_fwd"] == 1024
        assert values["resident"] == 2 and values["resident_heavy"] == 1
        assert values["resident_fwd"] == 4 and values["edges_wide"] == values["edges_narrow"] == 4
    with pytest.raises(ValueError, match="stages must be >= 1"):
        with introspect.triton_tiles(stages=0):
            pass
    with pytest.raises(ValueError, match="resident must be in"):
        with introspect.triton_tiles(resident=0):
            pass
    for name in ("edges_wide", "edges_narrow", "edges_node_terms", "edges_src"):
        with pytest.raises(ValueError, match=f"{name} must be a power of two"):
            with introspect.triton_tiles(**{name: 6}):
                pass
    # the forward's lanes at values of one head: every head of an item (HP), or one
    assert sched._lane_heads(0, 3, False, True, False, False) == 4
    assert sched._lane_heads(2, 5, True, True, True, False) == 8
    # ... but the dot kind's dst backward at rows of 256 channels (GAT's takes them)
    assert sched._lane_heads(2, 3, True, True, True, False, 256, dst_backward=True) == 0
    assert sched._lane_heads(2, 3, True, True, True, False, 128, dst_backward=True) == 4
    assert sched._lane_heads(0, 3, False, True, False, False, 256, dst_backward=True) == 4
    with introspect.triton_tiles(lane_heads=0) as values:
        assert values["lane_heads"] == 0 and sched._lane_heads(0, 3, False, True, False, False) == 0
    assert sched._HEADS_IN_LANE
    # the row kernels' blocks load their successor's edge ranges at rows of 128 channels
    # up, where the register cap is below 255
    assert [sched._items_ahead(w, 128) for w in (64, 128, 256)] == [False, True, True]
    assert not sched._items_ahead(128, 255)
    # ... but GATv2's src backward at 256 channels (it spilled)
    src = sched._bwd_src_kernel
    assert sched._items_ahead(128, 128, src, 1) and not sched._items_ahead(256, 128, src, 1)
    assert sched._items_ahead(256, 128, src, 2)
    with introspect.triton_tiles(items_ahead=0) as values:
        assert values["items_ahead"] == 0 and not sched._items_ahead(256, 64)
    assert sched._ITEMS_AHEAD
    for name in ("lane_heads", "items_ahead"):
        with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
            with introspect.triton_tiles(**{name: 2}):
                pass
    for args in ((0, 1, False, True, False, False),  # one head
                 (0, 3, False, False, False, False),  # values of H heads
                 (0, 3, False, True, False, True),  # edge features
                 (2, 3, True, True, False, False),  # a key that is not the value
                 (1, 3, False, True, False, False)):  # GATv2
        assert sched._lane_heads(*args) == 0, args
    assert sched._heavy({"KIND": 0, "HP": 4}, fwd) and not sched._heavy({"KIND": 2, "HP": 4}, fwd)
    # ... its dst backward registers for two programs per SM (not one), but with dropout
    assert not sched._heavy({"KIND": 0, "HP": 4}, dst) and sched._heavy({"KIND": 0}, dst)
    assert sched._heavy({"KIND": 0, "HP": 4, "DROPOUT": True}, dst)
    assert [sched._max_registers(8, dst, w, False, 0, heads=True) for w in (128, 256)] == [128] * 2
    assert sched._max_registers(8, dst, 128, True, 0, heads=True) == 255
    assert sched._STAGES == 2


@needs_triton
def test_the_sweeps_variants_reach_triton_tiles():
    """tools.triton_sweep's TILE:PROGRAMS[:STAGES[:RESIDENT]] variants set what they
    name, and nothing else."""
    from tools import triton_sweep as sweep

    with sweep._tiles("default") as own:
        pass
    for variant, want in (("2048:8", {"tile": 2048, "programs_per_sm": 8}),
                          ("1024:4:1", {"tile": 1024, "programs_per_sm": 4, "stages": 1}),
                          ("1024:4:2:4", {"tile": 1024, "programs_per_sm": 4, "stages": 2,
                                          "resident": 4, "resident_heavy": 4,
                                          "resident_fwd": 4})):
        with sweep._tiles(variant) as values:
            assert values == {**own, "tile_wide": want["tile"], "tile_wide_fwd": want["tile"],
                              **want}, variant
    with sweep._tiles("edges_wide=16,stages=1") as values:
        assert values == {**own, "edges_wide": 16, "stages": 1}
    assert sweep._tiles("no_such_setting=1") is None  # (an older checkout's: skipped)


@needs_triton
def test_triton_blocks_are_the_launch_blocks_of_lanes(monkeypatch):
    """``triton_blocks``: the blocks of (item, head) lanes a row kernel's launch runs, heads
    side by side, with the edge-loop trips of each block (its longest item over the edge
    tile), at the compiled kernels' tiles: rows of 10, 6 and 2 edges at 128 channels, 3 heads,
    in the forward's 4 lanes of 4 edges and the src backward's, and the src backward's one
    lane of 16 under ``edges_src=16`` (the schedule before)."""
    sched = importlib.import_module("gatlib._triton_schedule")
    monkeypatch.setattr(sched, "_interpreted", lambda: False)
    dst = torch.repeat_interleave(torch.arange(3), torch.tensor([10, 6, 2]))
    plan = gatlib.GraphPlan(torch.stack([torch.zeros_like(dst), dst]), num_nodes=3)
    (fwd,) = introspect.triton_blocks(plan, 3, 128, "_fwd_kernel", kind=1)
    # lanes 10,10,10,6 | 6,6,2,2 | 2 (the items longest first, each 3 heads)
    assert (fwd["lanes"], fwd["edges"]) == (4, 4) and fwd["steps"].tolist() == [3, 2, 1]
    (src,) = introspect.triton_blocks(plan, 3, 128, "_bwd_src_kernel", kind=1)
    # over sources: node 0 sends all 18 edges (one item, 3 lanes); nodes 1, 2 send none:
    # lanes 18,18,18,0 | 0,0,0,0 | 0
    assert (src["lanes"], src["edges"]) == (4, 4) and src["steps"].tolist() == [5, 0, 0]
    with introspect.triton_tiles(edges_src=16):
        src = introspect.triton_blocks(plan, 3, 128, "_bwd_src_kernel", kind=1)
    assert [(g["lanes"], g["edges"]) for g in src] == [(1, 16), (4, 4)]
    assert src[0]["steps"].tolist() == [2, 2, 2] and src[1]["steps"].tolist() == [0, 0]
    assert fwd["resident"] == 2 and src[0]["resident"] == 2
    # the forward's and the src backward's blocks load their successor's edge ranges at
    # 128 channels (registers capped for two programs per SM), not below; GATv2's dst
    # backward keeps one program's registers there
    assert fwd["ahead"] and src[0]["ahead"]
    assert not introspect.triton_blocks(plan, 3, 64, "_fwd_kernel", kind=1)[0]["ahead"]
    assert not introspect.triton_blocks(plan, 3, 128, "_bwd_dst_kernel", kind=1)[0]["ahead"]
    with introspect.triton_tiles(items_ahead=0):
        assert not introspect.triton_blocks(plan, 3, 128, "_fwd_kernel", kind=1)[0]["ahead"]
    # at values of one head the forward and the dst backward give a lane every head of
    # its item: lanes 10,6,2 (one block); the src backward a lane per (item, head)
    for k in ("_fwd_kernel", "_bwd_dst_kernel"):
        (heads,) = introspect.triton_blocks(plan, 3, 128, k, kind=0, one_value=True)
        assert (heads["lanes"], heads["edges"]) == (4, 4) and heads["steps"].tolist() == [3]
        with introspect.triton_tiles(lane_heads=0):
            (per_head,) = introspect.triton_blocks(plan, 3, 128, k, kind=0, one_value=True)
        assert per_head["steps"].tolist() == [3, 2, 1]
    (src,) = introspect.triton_blocks(plan, 3, 128, "_bwd_src_kernel", kind=0, one_value=True)
    assert src["steps"].tolist() == [5, 0, 0]
