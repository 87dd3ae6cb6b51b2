"""The row kernels' tuning spaces (gatlib._triton_schedule): every config of every space
against the reference in the interpreter, and what the tuner keys, times and caches.

The interpreter runs one config unless a test pins one (``_PINNED``, an index into each
kernel's space); the tuner itself runs in a subprocess without ``TRITON_INTERPRET``,
through Triton's real launch path on a stand-in GPU (tools.triton_compile), with a
benchmarker that times nothing but counts.
"""
import ast
import inspect
import itertools
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from gatlib import EdgeScore, GraphPlan, _triton_kernels, _triton_schedule, _triton_tuned, graph_attention  # noqa: E402,E501
from gatlib.bench.selftest import unwritten_memory_is_nan  # noqa: E402

from testing import DEVICE, leaves, make_score, record_launches, record_tiles  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
S = _triton_schedule
ROW_KERNELS = ("_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel")


# Pieces of at most 8 edges (_SPLIT) in the config test: rows of 9, 11 and 20 edges split.
_TEST_SPLIT = 8


def _graph():
    """Rows of 0..9, 11 and 20 edges in and out (one split each way at ``_TEST_SPLIT``),
    17 work items each way: what :func:`_reached` needs of every config, and no more (the
    interpreter pays per block and per edge step)."""
    g = torch.Generator().manual_seed(0)
    deg = torch.tensor([0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 20])
    n = deg.numel()
    dst = torch.repeat_interleave(torch.arange(n), deg)
    return torch.stack([dst[torch.randperm(dst.numel(), generator=g)], dst]).to(DEVICE), n


def _call(form, n, E, H, C, dtype):
    """``(score, value, value_edge, bias)`` of one layer-like call."""
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()

    if form == "gat_edge":
        return EdgeScore.gat(r(n, H), r(n, H), r(E, H), 0.2), r(n, H, C), None, None
    if form == "gatv2_bias":  # GATv2Conv: the value is x_src, att's and bias's partials
        score = EdgeScore.gatv2(r(n, H, C), r(n, H, C), r(H, C), None, 0.2)
        return score, score.src, None, r(H * C)
    if form == "dot_edge":  # TransformerConv with edge features: the edge term in the value
        score = EdgeScore.dot(r(n, H, C), r(n, H, C), r(E, H, C), 1 / C ** 0.5)
        return score, r(n, H, C), score.edge, None
    if form == "gat_projected_bias":
        h = r(n, H, C)
        return EdgeScore.gat_projected(h, r(1, H, C), r(1, H, C), r(E, H)), h, None, r(H * C)
    if form == "gat_inputs":  # GATConv in input space: values of one head (every head in a lane)
        return EdgeScore.gat(r(n, H), r(n, H), None, 0.2), r(n, 1, C), None, None
    assert form == "dot_inputs"  # TransformerConv in input space: key = value of one head
    key = r(n, 1, C)
    return EdgeScore.dot(r(n, H, C), key, None, 1 / C ** 0.5), key, None, None


# (form, channels, dtype): every kernel flag, below and at 128 channels (8 warps, blocks
# loading ahead), at 256 (64-register configs, per-slot sums), float64 (8 warps)
CALLS = [("gat_edge", 5, torch.float32), ("gatv2_bias", 40, torch.float32),
         ("dot_edge", 64, torch.float32), ("gat_projected_bias", 40, torch.float32),
         ("gat_inputs", 128, torch.float64), ("dot_inputs", 256, torch.float32),
         ("gatv2_bias", 256, torch.float32), ("gat_projected_bias", 128, torch.float32)]


def _run(score, value, value_edge, bias, graph, n, backend):
    out = graph_attention(score, value, graph, n, value_edge=value_edge, backend=backend, bias=bias)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ins = list(dict.fromkeys(t for t in (*leaves(score), value, value_edge, bias)
                             if t is not None and t.requires_grad))
    return [out, *torch.autograd.grad((out * w.to(out)).sum(), ins)]


_TILE = ("BLOCK_R", "BLOCK_E", "LANE_HEADS", "AHEAD")


def _cfg_id(kw, keys=(*_TILE, "PER_SM", "num_warps", "maxnreg")):
    return tuple(sorted((k, v) for k, v in kw.items() if k in keys))


def _run_id(kw):
    """What a run of config ``kw`` checks: on a GPU the whole config; in the interpreter its
    tile alone, as its programs run one after another on the CPU: warps and the register cap
    change nothing it computes, nor does ``PER_SM``, which sizes a GPU's grid only (both
    checked in the test)."""
    return _cfg_id(kw, _TILE) if S._interpreted() else _cfg_id(kw)


def _reached(items, kw, H, device):
    """Which of a config's paths the work items ``items`` of its launch take: a program
    running two blocks (``AHEAD``'s next block; in the interpreter, whose grid is a few
    programs, not a GPU's hundreds), a block with lanes past the items, a row of more than one
    edge step where pieces can have one, a masked step, an empty row, split rows."""
    n = int(items.bounds[0])
    length = items.items[:n, 2].long()
    lanes = n * (1 if kw.get("LANE_HEADS") else H)
    blocks = -(-lanes // kw["BLOCK_R"])
    r, e = kw["BLOCK_R"], kw["BLOCK_E"]
    paths = {"lanes past the items": r == 1 or blocks * r > lanes,
             "steps": e >= S._SPLIT or bool((length > e).any()),
             "masked step": bool((length % e != 0).any()),
             "empty row": bool((length == 0).any()),
             "split rows": int(items.bounds[1]) > 0}
    if S._interpreted():
        paths["two blocks"] = blocks > S._programs(device, H, kw["PER_SM"])
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("form,C,dtype", CALLS, ids=[f"{f}-C{c}-{str(d)[6:]}" for f, c, d in CALLS])
def test_every_config_of_every_space_is_the_reference(form, C, dtype, monkeypatch):
    """Each row kernel's space for the call (:func:`_space`) run config by config (config
    ``i`` of every kernel at once, pinned), forward and backward, equals the reference on
    :func:`_graph`, unwritten memory NaN. Each config of each space is seen to run (in the
    interpreter, it or a config of the same tile: :func:`_run_id`) and to take every path of
    :func:`_reached`."""
    monkeypatch.setattr(S, "_SPLIT", _TEST_SPLIT)
    # the parameters' partials sized for the configs' lanes (at most _R_MAX), as on a GPU, not
    # for the interpreter's own config (1,024): a block of lanes zeroes a row block per step
    monkeypatch.setattr(S, "_R_MAX_INTERPRETER", S._R_MAX)
    ei, n = _graph()
    plan = GraphPlan(ei, num_nodes=n)
    tp = S._plan(plan)
    H = 3
    score, value, value_edge, bias = _call(form, n, ei.size(1), H, C, dtype)
    want = _run(score, value, value_edge, bias, plan, n, "torch")
    if S._interpreted():  # PER_SM: not in a kernel's body, nor in the interpreter's grid
        assert len({S._programs(ei.device, H, s) for s in (1, 2, S._PER_SM_MAX)}) == 1
        for name in ROW_KERNELS:
            fn = getattr(_triton_kernels, name).fn
            body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
            assert "PER_SM" not in {x.id for b in body for x in ast.walk(b) if isinstance(x, ast.Name)}
    launched = record_launches(monkeypatch)
    tiles = record_tiles(monkeypatch)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    ran = set()

    def check(i):
        monkeypatch.setattr(S, "_PINNED", i)
        tiles.clear()
        with unwritten_memory_is_nan():
            got = _run(score, value, value_edge, bias, plan, n, "triton")
        for name, kw in tiles.items():
            ran.add((name, _run_id(kw)))
            items = tp.src_items if name == "_bwd_src_kernel" else tp.dst_items
            missed = [path for path, took in _reached(items, kw, H, ei.device).items() if not took]
            assert not missed, (name, kw, missed)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"config {i}: {m}")

    check(0)  # its launches give each kernel's space
    spaces = {name: S._space(name, consts) for name, consts in launched}
    assert set(spaces) == set(ROW_KERNELS)
    for i in range(1, max(map(len, spaces.values()))):
        if any((name, _run_id(space[i % len(space)].all_kwargs())) not in ran
               for name, space in spaces.items()):  # (else each kernel's config i, or its twin, ran)
            check(i)
    for name, space in spaces.items():
        assert {r for k, r in ran if k == name} == {_run_id(c.all_kwargs()) for c in space}, name


# What _space is given at users' calls: every flag a launch passes, at each width.
def _calls(name):
    flags = {"_fwd_kernel": ["HAS_DST", "HAS_EDGE", "HAS_VEDGE", "HAS_BIAS", "SHARE_V", "SHARE_VE",
                             "ONE_K", "ONE_V", "DROPOUT"],
             "_bwd_dst_kernel": ["HAS_DST", "HAS_EDGE", "HAS_VEDGE", "SHARE_V", "SHARE_VE", "ONE_K",
                                 "ONE_V", "DROPOUT", "GALPHA", "NEED_VEDGE", "NEED_EDGE",
                                 "NEED_DST", "NEED_ATT", "NEED_BIAS"],
             "_bwd_src_kernel": ["HAS_EDGE", "NEED_VALUE", "NEED_SRC", "SUM_SRC", "NEED_ATT"]}[name]
    g = torch.Generator().manual_seed(0)
    for kind, c, acc, H in itertools.product((0, 1, 2, 3), (1, 8, 16, 64, 128, 256, 512, 1024),
                                             (tl.float32, tl.float64), (1, 3)):
        for _ in range(8):  # random flag sets
            bits = torch.randint(0, 2, (len(flags),), generator=g).bool().tolist()
            kw = dict(zip(flags, bits, strict=True), KIND=kind, H=H, ACC=acc,
                      BLOCK_CK=1 if kind == 0 else c, BLOCK_CV=c)
            yield kw


@pytest.mark.parametrize("name", ROW_KERNELS)
def test_spaces_are_small_and_hold_their_default(name):
    """Every call's space is non-empty, at most 12 configs (a first call compiles and times
    each once), and holds the default (the config used untuned); the interpreter's own
    config is not in it."""
    sizes = []
    for kw in _calls(name):
        space = S._space(name, kw)
        sizes.append(len(space))
        assert 1 <= len(space) <= 12, (kw, space)
        assert S._default(name, kw) in space
        assert S._interpreter_config(name, kw) not in space
        for c in space:
            r, e = c.kwargs["BLOCK_R"], c.kwargs["BLOCK_E"]
            assert r * e * S._width(name, kw) <= 256 * c.num_warps  # the register budget
    assert max(sizes) > 1


def test_the_default_where_tuning_is_off_or_under_capture(monkeypatch):
    """``GATLIB_TRITON_AUTOTUNE=0`` and a first call under CUDA graph capture (which cannot
    be timed: said once) give the tuner one config, the default; otherwise the space."""
    kw = next(k for k in _calls("_fwd_kernel") if len(S._space("_fwd_kernel", k)) > 1)
    configs = S._CONFIGS["_fwd_kernel"]
    assert S._prune("_fwd_kernel", configs, {}, **kw) == S._space("_fwd_kernel", kw)
    monkeypatch.setenv(S._AUTOTUNE_ENV, "0")
    assert S._prune("_fwd_kernel", configs, {}, **kw) == [S._default("_fwd_kernel", kw)]
    monkeypatch.delenv(S._AUTOTUNE_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(S, "_WARNED_CAPTURE", [])
    with pytest.warns(UserWarning, match="CUDA graph capture"):
        assert S._prune("_fwd_kernel", configs, {}, **kw) == [S._default("_fwd_kernel", kw)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert S._prune("_fwd_kernel", configs, {}, **kw) == [S._default("_fwd_kernel", kw)]


def test_the_interpreter_runs_its_one_config(monkeypatch):
    """Unpinned, the interpreter runs :func:`_interpreter_config` (few wide programs)."""
    ei, n = _graph()
    score = make_score("gatv2", n, n, ei.size(1), 2, 8, device=DEVICE)
    v = torch.randn(n, 2, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    launched = record_launches(monkeypatch)
    tiles = record_tiles(monkeypatch)
    graph_attention(score, v, ei, n, backend="triton").sum().backward()
    for name, consts in launched:
        assert _cfg_id(tiles[name]) == _cfg_id(S._interpreter_config(name, consts).all_kwargs())


def test_keys_are_what_a_layer_fixes():
    """The tuning keys name constexprs a layer fixes (heads, channels, score kind, flags) and
    the graph's degree bucket (``DEG``, a runtime integer Triton does not specialise on, so a
    new bucket retunes without compiling): no size of a graph (``E``, ``P_ROWS``), no pointer,
    no tiling."""
    constexprs = {name: {n for n, p in inspect.signature(getattr(_triton_kernels, name).fn).parameters.items()
                         if "constexpr" in str(p.annotation)} for name in S._KEYS}
    for name, keys in S._KEYS.items():
        fn = getattr(_triton_kernels, name)
        assert set(keys) <= set(fn.arg_names), name
        assert keys[-1] == "DEG" and "DEG" in _triton_kernels._PER_CALL
        assert set(keys[:-1]) <= constexprs[name] and "DEG" not in constexprs[name], name
        assert not set(keys) & {"BLOCK_R", "BLOCK_E", "PER_SM", "AHEAD", "LANE_HEADS", "STAGES"}
        assert S._TUNED[name].keys == keys


_TUNER = textwrap.dedent("""
    import json, sys
    import torch
    from triton import knobs
    from tools import triton_compile as tc
    from gatlib import GraphPlan, _triton_schedule as S
    from tools import internals

    if len(sys.argv) > 1:  # a folder of shipped configs, this stand-in GPU's
        from pathlib import Path
        from gatlib import _triton_tuned
        _triton_tuned.DIR = Path(sys.argv[1])
        _triton_tuned.device_name = lambda device: "Stand-in GPU"
    timed = []
    def bench(fn, quantiles):  # times nothing: the launch is skipped (the hook)
        fn()
        timed.append(1)
        return [float(len(timed))] * 3  # the first config timed is the fastest
    tc._Driver.get_benchmarker = lambda self: bench
    knobs.runtime.jit_cache_hook = lambda **kw: True  # (no compile, no launch)
    out = []
    with tc.stand_in_driver():
        for tuner in internals.triton_tuners().values():  # (the stand-in keeps none on disk)
            tuner.cache_results = True  # here: TRITON_CACHE_DIR is the test's own folder
        # two graphs (mini-batches) of one layer, of mean degree 7 and 11, then one of 25
        for n, E in ((60, 400), (90, 1000), (40, 1000)):
            g = torch.Generator().manual_seed(n)
            ei = torch.randint(0, n, (2, E), generator=g)
            from gatlib import EdgeScore
            score = EdgeScore.gatv2(torch.randn(n, 2, 16), torch.randn(n, 2, 16),
                                    torch.randn(2, 16), None, 0.2)
            v = torch.randn(n, 2, 16, requires_grad=True)
            before = len(timed)
            internals.triton_attention(score, v, GraphPlan(ei, num_nodes=n), None, 0.0, False)
            out.append({"timed": len(timed) - before,
                        "best": S._TUNED["_fwd_kernel"].best_config.kwargs})
    json.dump(out, sys.stdout)
""")


def _tuner_run(cache_dir, shipped=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _TUNER, *([str(shipped)] if shipped else [])], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # (two processes through Triton's launch path)
def test_tuned_once_per_key_and_cached_across_processes(tmp_path):
    """Through Triton's real launch path (a stand-in GPU): a layer's first call times each
    config of its forward's space once and keeps the fastest; a second graph of other sizes
    times nothing, a third of another degree bucket times again; a second process finds the
    choices in Triton's cache and times nothing. The
    autotune report reads those files, and its shipped configs let a process with an empty
    cache on that GPU time nothing either and run the choice."""
    kw = dict(KIND=1, H=2, ACC=tl.float32, BLOCK_CK=16, BLOCK_CV=16, HAS_DST=True,
              HAS_EDGE=False, HAS_VEDGE=False, HAS_BIAS=False, SHARE_V=False, SHARE_VE=False,
              ONE_K=False, ONE_V=False, DROPOUT=False)
    space = S._space("_fwd_kernel", kw)
    assert len(space) > 1
    first = _tuner_run(tmp_path)
    assert [r["timed"] for r in first] == [len(space), 0, len(space)], first
    assert all(r["best"] == space[0].kwargs for r in first)
    again = _tuner_run(tmp_path)
    assert [r["timed"] for r in again] == [0, 0, 0] and again[0]["best"] == space[0].kwargs
    # what the GPU run's report reads from those files: each config's time, the choice, the
    # default (tools.autotune_report)
    from tools import autotune_report
    records = autotune_report.read(tmp_path)
    assert sorted(r["key"]["DEG"] for r in records) == [1, 2]
    record = records[0]
    assert record["kernel"] == "_fwd_kernel" and record["key"]["KIND"] == 1 and record["key"]["CV"] == 16
    assert [c["kwargs"] for c in record["configs"]] == [c.kwargs for c in space]
    assert [c["over_best"] for c in record["configs"]] == [float(i + 1) for i in range(len(space))]
    default = S._default("_fwd_kernel", kw)
    assert [c["default"] for c in record["configs"]] == [c is default for c in space]
    assert record["default_over_best"] == space.index(default) + 1
    # shipped: the report's choices for this GPU, then a process with an empty Triton cache
    (tmp_path / "device.json").write_text(json.dumps(
        {"device": "Stand-in GPU", "kernels_sha256": _triton_tuned.kernels_digest()}))
    autotune_report.main([str(tmp_path), "--ship", str(tmp_path / "tuned")])
    path = tmp_path / "tuned" / "stand-in-gpu.json"
    shipped = json.loads(path.read_text())
    assert shipped["device"] == "Stand-in GPU" and list(shipped["configs"]) == ["_fwd_kernel"]
    entries = shipped["configs"]["_fwd_kernel"]
    assert [choice for _, choice in entries] == [
        {"kwargs": space[0].kwargs, "num_warps": space[0].num_warps, "maxnreg": space[0].maxnreg}] * 2
    # (another choice than the stand-in's timing would make, so that running it proves it was read)
    last = space[-1]
    shipped["configs"]["_fwd_kernel"] = [[key, {"kwargs": last.kwargs, "num_warps": last.num_warps,
                                                "maxnreg": last.maxnreg}] for key, _ in entries]
    path.write_text(json.dumps(shipped))
    fresh = _tuner_run(tmp_path / "empty_cache", shipped=tmp_path / "tuned")
    assert [r["timed"] for r in fresh] == [0, 0, 0] and all(r["best"] == last.kwargs for r in fresh)


def test_shipped_configs_fill_the_tuners_once_and_only_their_own(tmp_path, monkeypatch):
    """A GPU's shipped file puts each key's config into the tuners, once per GPU model; a file
    of other kernels (their digest), of another GPU or with a config outside the spaces is not
    used, and says so; none for the GPU, or GATLIB_TRITON_AUTOTUNE=0: nothing."""
    monkeypatch.setattr(_triton_tuned, "DIR", tmp_path)
    monkeypatch.setattr(_triton_tuned, "_LOADED", {})
    monkeypatch.delenv("GATLIB_TRITON_AUTOTUNE", raising=False)

    class Tuner:
        def __init__(self):
            self.cache = {}
    cfg = S._CONFIGS["_bwd_src_kernel"][3]
    key = [2, 1, 16, 0, False, True, True, False, False, "torch.int32", "torch.float32"]
    entry = {"kwargs": cfg.kwargs, "num_warps": cfg.num_warps, "maxnreg": cfg.maxnreg}

    def load(**change):
        data = {"schema": _triton_tuned.SCHEMA, "device": "Test GPU",
                "kernels_sha256": _triton_tuned.kernels_digest(), "configs": {"_bwd_src_kernel": [[key, entry]]}}
        (tmp_path / "test-gpu.json").write_text(json.dumps({**data, **change}))
        _triton_tuned._LOADED.clear()
        tuners = {name: Tuner() for name in S._ROW_KERNELS}
        return _triton_tuned.preload("Test GPU", tuners, S._CONFIGS, "GATLIB_TRITON_AUTOTUNE"), tuners

    n, tuners = load()
    assert n == 1 and tuners["_bwd_src_kernel"].cache == {tuple(key): cfg}
    assert tuners["_bwd_src_kernel"].cache[tuple(key)] is cfg  # the space's own object
    (tmp_path / "test-gpu.json").unlink()  # once per process: not read again
    assert _triton_tuned.preload("Test GPU", tuners, S._CONFIGS, "GATLIB_TRITON_AUTOTUNE") == 1
    unknown = {**entry, "kwargs": {**entry["kwargs"], "BLOCK_R": 3}}
    for change in ({"kernels_sha256": "0" * 64}, {"device": "Other GPU"},
                   {"configs": {"_bwd_src_kernel": [[key, unknown]]}}, {"configs": {"_nope": []}}):
        with pytest.warns(UserWarning, match="tuned for other kernels than these"):
            n, tuners = load(**change)
        assert n == 0 and not any(t.cache for t in tuners.values()), change
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _triton_tuned.preload("No File GPU", {}, S._CONFIGS, "GATLIB_TRITON_AUTOTUNE") == 0
        assert _triton_tuned.preload(None, {}, S._CONFIGS, "GATLIB_TRITON_AUTOTUNE") == 0
        monkeypatch.setenv("GATLIB_TRITON_AUTOTUNE", "0")
        n, tuners = load()
        assert n == 0 and not any(t.cache for t in tuners.values())
