"""The row kernels' config spaces (gatlib._triton_schedule): every config of every space against
the float64 reference in the interpreter, bit for bit alike; what the tuner keys, times and
caches; nothing timed under deterministic algorithms.

The interpreter runs one config unless a test pins one (``_PINNED``, an index into each kernel's
space). The tuner itself runs in a subprocess without ``TRITON_INTERPRET``, through Triton's real
launch path on a stand-in GPU (tools.triton_compile), with a benchmarker that times nothing but
counts. That a config cannot change a GPU's sums either (their layout) is the compile budget's
to show (tests/test_triton_compile.py).
"""
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

from gatlib import EdgeScore, GraphPlan, _triton_kernels, _triton_schedule, graph_attention  # noqa: E402
from gatlib.bench.selftest import unwritten_memory_is_nan  # noqa: E402

from testing import DEVICE, record_tiles  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
S = _triton_schedule
ROW_KERNELS = ("_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel")
# Pieces of at most 8 edges (_SPLIT) in the config test: rows of 9, 11 and 20 edges split.
_TEST_SPLIT = 8


def _graph():
    """Rows of 0..9, 11 and 20 edges in and out (split both ways at ``_TEST_SPLIT``)."""
    g = torch.Generator().manual_seed(0)
    deg = torch.tensor([0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 20])
    n = deg.numel()
    dst = torch.repeat_interleave(torch.arange(n), deg)
    return torch.stack([dst[torch.randperm(dst.numel(), generator=g)], dst]).to(DEVICE), n


def _call(form, n, E, H, C, dtype):
    """``(score, value, value_edge)`` of one layer-like call."""
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()

    if form == "gat_edge":
        return EdgeScore.gat(r(n, H), r(n, H), r(E, H), 0.2), r(n, H, C), None
    if form == "gatv2_edge":  # GATv2Conv: the value is x_src; att's gradient in groups of items
        score = EdgeScore.gatv2(r(n, H, C), r(n, H, C), r(H, C), r(E, H, C), 0.2)
        return score, score.src, None
    if form == "dot_edge":  # TransformerConv with edge features: the edge term in the value too
        score = EdgeScore.dot(r(n, H, C), r(n, H, C), r(E, H, C), 1 / C ** 0.5)
        return score, r(n, H, C), score.edge
    if form == "gat_inputs":  # GATConv in input space: a value of one head
        return EdgeScore.gat(r(n, H), r(n, H), None, 0.2), r(n, 1, C), None
    if form == "dot_key_only":  # a key of one head, values of H
        return EdgeScore.dot(r(n, H, C), r(n, 1, C), None, 1 / C ** 0.5), r(n, H, C), None
    assert form == "dot_inputs"  # TransformerConv in input space: key = value of one head
    key = r(n, 1, C)
    return EdgeScore.dot(r(n, H, C), key, None, 1 / C ** 0.5), key, None


# (form, heads, channels, dtype, dropout): every kernel flag, tiles from 1 item to many
CALLS = [("gat_edge", 3, 5, torch.float32, 0.3), ("gatv2_edge", 3, 40, torch.float32, 0.0),
         ("dot_edge", 2, 16, torch.float64, 0.3), ("gat_inputs", 3, 16, torch.float64, 0.0),
         ("dot_key_only", 3, 8, torch.float64, 0.0), ("dot_inputs", 1, 64, torch.float32, 0.0)]


def _run(score, value, value_edge, graph, n, backend, p):
    """Output, weights and every input's gradient of one training call (a fixed dropout mask)."""
    torch.manual_seed(3)
    out, alpha = graph_attention(score, value, graph, n, value_edge=value_edge, backend=backend,
                                 dropout=p, training=p > 0, return_attention=True)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ins = list(dict.fromkeys(t for t in (*score.tensors(), value, value_edge)
                             if t is not None and t.requires_grad))
    loss = (out * w.to(out)).sum() + (alpha * alpha.detach().cos()).sum()
    return [out, alpha, *torch.autograd.grad(loss, ins)]


@pytest.mark.slow
@pytest.mark.parametrize("form,H,C,dtype,p", CALLS, ids=[f"{f}-H{h}-C{c}-{str(d)[6:]}{'-dropout' * (q > 0)}"
                                                          for f, h, c, d, q in CALLS])
def test_every_config_of_every_space_is_the_reference(form, H, C, dtype, p, monkeypatch):
    """Each row kernel's space for the call run config by config (config ``i`` of every kernel
    at once, pinned), forward and backward, over rows split both ways: the reference's results
    (against float64), and every config's bit for bit the interpreter's own config's. (The
    interpreter runs a program's items one after another whatever its warps and pipelining, so
    configs differing only in those run once.)"""
    monkeypatch.setattr(S, "_SPLIT", _TEST_SPLIT)
    ei, n = _graph()
    plan = GraphPlan(ei, num_nodes=n)
    tp = S._plan(plan)
    assert int(tp.dst_items.bounds[1]) > 0 and int(tp.src_items.bounds[1]) > 0  # split rows
    score, value, value_edge = _call(form, n, ei.size(1), H, C, dtype)
    if p == 0:  # (with dropout the reference draws another mask: the interpreter's config is it)
        want = _run(score, value, value_edge, plan, n, "torch", 0.0)
        tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
        for a, b in zip(_run(score, value, value_edge, plan, n, "triton", 0.0), want, strict=True):
            torch.testing.assert_close(a, b, **tol)
    with unwritten_memory_is_nan():
        own = _run(score, value, value_edge, plan, n, "triton", p)  # the interpreter's config
    tiles = record_tiles(monkeypatch)
    ran, seen = set(), []
    for i in itertools.count():
        monkeypatch.setattr(S, "_PINNED", i)
        tiles.clear()
        with unwritten_memory_is_nan():
            got = _run(score, value, value_edge, plan, n, "triton", p)
        spaces = {name: S._space(name, kw) for name, kw in tiles.items()}
        assert set(spaces) == set(ROW_KERNELS)
        for name, kw in tiles.items():
            assert S._space(name, kw)[i % len(spaces[name])].kwargs["BLOCK_R"] == kw["BLOCK_R"]
            ran.add((name, kw["BLOCK_R"]))
        seen.append({name: kw["BLOCK_R"] for name, kw in tiles.items()})
        for a, b in zip(got, own, strict=True):
            assert torch.equal(a, b), (i, seen[-1], (a - b).abs().max())
        if i + 1 >= max(map(len, spaces.values())):
            break
    for name, space in spaces.items():  # every item count of every space ran
        assert {(name, c.kwargs["BLOCK_R"]) for c in space} <= ran, (name, space)
    assert len({tuple(s.values()) for s in seen}) > 1  # (the configs are not one tile)


def _calls(name):
    """Constexprs of users' calls and others: every kind, heads 1-8, channels 1-1024."""
    for kind, H, C, acc in itertools.product((0, 1, 2), (1, 2, 3, 4, 8), (1, 5, 8, 40, 64, 128, 256, 1024),
                                             (tl.float32, tl.float64)):
        if triton.next_power_of_2(H) * triton.next_power_of_2(C) <= 4096:
            yield dict(H=H, CK=1 if kind == 0 else C, CV=C, KIND=kind, SHARE_V=kind > 0,
                       SHARE_VE=False, ONE_K=False, ONE_V=False, SUM_SRC=False, ACC=acc)


@pytest.mark.parametrize("name", ROW_KERNELS)
def test_spaces_are_small_and_keep_the_layout(name):
    """Every call's space holds 2 to 6 configs of one warp count (the layer's: a tile's layout
    follows it), each giving every thread at least 8 elements of its tile (then Triton lays
    the heads and channels of every item count out alike), items a power of two within the
    schedule's padding (the dst kernel's dividing its att group), and the default among them."""
    sizes = []
    for kw in _calls(name):
        space = S._space(name, kw)
        sizes.append(len(space))
        assert 2 <= len(space) <= 6, (kw, space)
        assert len({c.num_warps for c in space}) == 1 and space[0].num_warps == S._warps(S._tile(kw))
        for c in space:
            r = c.kwargs["BLOCK_R"]
            assert r in S._ROWS and S._PAD % r == 0 and c.kwargs["STAGES"] in S._STAGES
            assert r * S._tile(kw) >= 256 * c.num_warps or r == S._PAD or (
                name == "_bwd_dst_kernel" and r == _triton_kernels._ATT_ROWS.value), (kw, c)
            if name == "_bwd_dst_kernel":
                assert _triton_kernels._ATT_ROWS.value % r == 0
        assert S._default(name, kw) in space
    assert max(sizes) == (2 if name == "_bwd_dst_kernel" else 4)


def test_untuned_where_deterministic_or_asked(monkeypatch):
    """Under ``torch.use_deterministic_algorithms`` and with ``GATLIB_TRITON_AUTOTUNE=0`` a
    launch bypasses the tuner (nothing is timed, no cached choice is used) and runs the
    default config; otherwise the tuner runs it."""
    launched = []

    class Tuner:
        def __init__(self, name):
            self.name = name
            self.fn = Direct(name)

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(("tuned", self.name, kw))

    class Direct:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(("direct", self.name, kw))

    monkeypatch.setattr(S, "_interpreted", lambda: False)
    monkeypatch.setattr(S, "_TUNED", {name: Tuner(name) for name in ROW_KERNELS})
    monkeypatch.delenv(S._AUTOTUNE_ENV, raising=False)
    consts = next(_calls("_fwd_kernel"))
    items = torch.zeros(64, 4, dtype=torch.int32)
    default = S._default("_fwd_kernel", consts).all_kwargs()

    def launch():
        launched.clear()
        S._launch("_fwd_kernel", items, **consts)
        (how, name, kw), = launched
        return how, {k: kw[k] for k in default if k in kw}

    assert launch() == ("tuned", {})
    torch.use_deterministic_algorithms(True)  # (conftest's fixture restores it)
    try:
        assert launch() == ("direct", default)
    finally:
        torch.use_deterministic_algorithms(False)
    assert launch()[0] == "tuned"
    monkeypatch.setenv(S._AUTOTUNE_ENV, "0")
    assert launch() == ("direct", default)


def test_the_default_under_capture(monkeypatch):
    """A key's first launch under CUDA graph capture (which cannot be timed, said once) gives
    the tuner the default alone; otherwise the space."""
    kw = next(k for k in _calls("_fwd_kernel"))
    configs = S._CONFIGS
    assert S._prune("_fwd_kernel", configs, {}, **kw) == S._space("_fwd_kernel", kw)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(S, "_WARNED_CAPTURE", [])
    with pytest.warns(UserWarning, match="CUDA graph capture"):
        assert S._prune("_fwd_kernel", configs, {}, **kw) == [S._default("_fwd_kernel", kw)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert S._prune("_fwd_kernel", configs, {}, **kw) == [S._default("_fwd_kernel", kw)]


def test_keys_are_what_a_layer_fixes():
    """The tuning keys name constexprs a layer fixes (heads, channels, score kind, sharing;
    Triton adds the values' dtype, which fixes the accumulation's): no size of a graph, no
    pointer, no part of a config."""
    for name, keys in S._KEYS.items():
        fn = getattr(_triton_kernels, name).fn
        constexprs = {n for n, p in inspect.signature(fn).parameters.items()
                      if "constexpr" in str(p.annotation)}
        assert set(keys) <= constexprs, name
        assert not set(keys) & {"BLOCK_R", "STAGES"}
        assert S._TUNED[name].keys == keys
        assert len(inspect.signature(fn).parameters) <= 20, name  # (the launch's arguments)


_TUNER = textwrap.dedent("""
    import json, sys
    import torch
    from triton import knobs
    from tools import triton_compile as tc
    from gatlib import EdgeScore, GraphPlan, _triton_schedule as S
    from tools import internals

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
        # two graphs (mini-batches) of one layer; then a layer of another width, deterministic
        for n, E, C, deterministic in ((60, 400, 16, False), (90, 1000, 16, False), (50, 300, 32, True)):
            g = torch.Generator().manual_seed(n)
            ei = torch.randint(0, n, (2, E), generator=g)
            score = EdgeScore.gatv2(torch.randn(n, 2, C), torch.randn(n, 2, C), torch.randn(2, C), None, 0.2)
            v = torch.randn(n, 2, C)
            before = len(timed)
            torch.use_deterministic_algorithms(deterministic)
            internals.triton_attention(score, v, GraphPlan(ei, num_nodes=n), None, 0.0, False)
            tuner = S._TUNED["_fwd_kernel"]
            out.append({"timed": len(timed) - before, "keys": len(tuner.cache),
                        "best": tuner.best_config.kwargs if tuner.cache else None})
    json.dump(out, sys.stdout)
""")


def _tuner_run(cache_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _TUNER], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # (two processes through Triton's launch path)
def test_tuned_once_per_key_and_cached_across_processes(tmp_path):
    """Through Triton's real launch path (a stand-in GPU): a layer's first call times each
    config of its forward's space once and keeps the fastest; a second graph of other sizes
    times nothing; a layer of another width under deterministic algorithms times nothing and
    keeps no choice; a second process finds the first's choice in Triton's cache and times
    nothing."""
    kw = dict(KIND=1, H=2, CK=16, CV=16, ACC=tl.float32, SHARE_V=False, SHARE_VE=False,
              ONE_K=False, ONE_V=False)
    space = S._space("_fwd_kernel", kw)
    assert len(space) > 1
    first = _tuner_run(tmp_path)
    assert [r["timed"] for r in first] == [len(space), 0, 0], first
    assert [r["keys"] for r in first] == [1, 1, 1], first  # (the deterministic call kept none)
    assert first[0]["best"] == space[0].kwargs
    again = _tuner_run(tmp_path)
    assert [r["timed"] for r in again] == [0, 0, 0] and again[0]["best"] == space[0].kwargs
    # what the GPU run brings back of those files (tools.gpu_run's autotune.json) and its report
    from tools import autotune_report, gpu_run

    records = autotune_report.read(gpu_run._autotune_files(tmp_path))
    record, = records
    assert record["kernel"] == "_fwd_kernel" and record["key"]["KIND"] == 1 and record["key"]["CV"] == 16
    assert [c["kwargs"] for c in record["configs"]] == [c.kwargs for c in space]  # (fastest first)
    assert [c["over_best"] for c in record["configs"]] == [float(i + 1) for i in range(len(space))]
    default = S._default("_fwd_kernel", kw)
    assert [c["default"] for c in record["configs"]] == [c is default for c in space]
    assert record["default_over_best"] == space.index(default) + 1
    wins = autotune_report.knob_wins(records)["_fwd_kernel"]
    assert wins[f"BLOCK_R={space[0].kwargs['BLOCK_R']}"][0] == 1
