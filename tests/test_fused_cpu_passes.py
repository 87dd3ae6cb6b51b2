"""The fused CPU kernel's compiled row passes (gatlib/csrc/fused_cpu.cpp), each
against the same computation written with torch ops on the edge list: float32
and float64, int32 and int64 indices, destinations without in-edges, a hub, and
on enough rows that they run over several threads (with the same result for
any thread count). How the dispatcher treats a build that fails is at the end."""
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import gatlib
from gatlib import _layout, _native

from testing import hub_graph, random_graph

ops = _native.ops()
DTYPES = [torch.float32, torch.float64]
IDS = ["float32", "float64"]


@pytest.fixture(params=["int64", "int32"])
def graph(request, monkeypatch):
    """``(layout, src, dst)``: 1,500 sources into 1,200 destinations (the last 200
    without in-edges) with a hub of 3,000 in-edges and repeated edges, its
    layout's indices of the parameter's dtype; ``src``/``dst`` int64, CSR order."""
    monkeypatch.setattr(_layout, "SMALL_EDGES", 0 if request.param == "int32" else 1 << 62)
    ei = torch.cat([random_graph(1500, 20000, num_dst=1000, seed=3),
                    hub_graph(1000, 3000, hub=7)[:, :3000], random_graph(1500, 50, num_dst=1000, seed=3)],
                   dim=1)
    lay = gatlib.GraphPlan(ei, size=(1500, 1200)).layout()
    assert str(lay.src.dtype) == f"torch.{request.param}"
    return lay, lay.src.long(), lay.dst.long()


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def close(got, want):
    """``got`` against ``want`` computed in float64 from the same inputs: float32
    sums run over a hub of 3,000 edges, GATv2's att gradient over all 23,000."""
    tol = dict(rtol=1e-4, atol=2e-3) if got.dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.double(), want.double(), **tol)


def f64(*ts):
    return [None if t is None else t.detach().double() for t in ts]


def rows(n, H, C, dtype, seed):
    return torch.randn(n, H, C, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def softmax_ref(e, dst, n):
    """Softmax of ``e [E, H]`` over each destination's in-edges, and its log-normaliser."""
    m = torch.full((n, e.size(1)), -torch.inf, dtype=e.dtype).scatter_reduce(
        0, dst[:, None].expand_as(e), e, "amax")
    x = (e - m[dst]).exp()
    s = torch.zeros(n, e.size(1), dtype=e.dtype).index_add_(0, dst, x)
    return x / s[dst], s.log() + m


def with_threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("with_drop", [False, True], ids=["", "drop"])
def test_softmax_aggregate(graph, dtype, with_drop):
    lay, src, dst = graph
    E, H, C = src.numel(), 3, 8
    e = torch.randn(E, H, dtype=dtype) * 4
    v = rows(1500, H, C, dtype, 1)
    drop = torch.rand(E, H, dtype=dtype) if with_drop else None
    e64, v64, drop64 = f64(e, v, drop)
    alpha_ref, lse_ref = softmax_ref(e64, dst, 1200)
    a = alpha_ref * drop64 if with_drop else alpha_ref
    out_ref = torch.zeros(1200, H, C, dtype=torch.float64).index_add_(0, dst, a[..., None] * v64[src])
    alpha = e.clone()
    out, lse = ops.softmax_aggregate(lay.ptr, lay.src, alpha, drop, v, True)
    close(alpha, alpha_ref)
    close(out, out_ref)
    close(lse[:1000], lse_ref[:1000])
    assert torch.all(out[1000:] == 0) and torch.all(lse[1000:] == -torch.inf)  # no in-edges
    assert ops.softmax_aggregate(lay.ptr, lay.src, e.clone(), drop, v, False)[1].numel() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_spmm_and_sddmm_both_ways(graph, dtype):
    """The CSR walk (rows are destinations) and the CSC walk (rows are sources,
    weights read at the CSR positions ``csc_edge``)."""
    lay, src, dst = graph
    E, H, C = src.numel(), 2, 5
    w = torch.randn(E, H, dtype=dtype)
    xs, xd = rows(1500, H, C, dtype, 1), rows(1200, H, C, dtype, 2)
    empty = lay.ptr.new_empty(0)
    w64, xs64, xd64 = f64(w, xs, xd)
    close(ops.spmm(lay.ptr, lay.src, empty, w, xs),
          torch.zeros(1200, H, C, dtype=torch.float64).index_add_(0, dst, w64[..., None] * xs64[src]))
    close(ops.spmm(lay.csc_ptr, lay.csc_dst, lay.csc_edge, w, xd),
          torch.zeros(1500, H, C, dtype=torch.float64).index_add_(0, src, w64[..., None] * xd64[dst]))
    close(ops.sddmm(lay.ptr, lay.src, empty, xd, xs, 0.5), 0.5 * (xd64[dst] * xs64[src]).sum(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_sddmm_spmm_is_both_products_of_the_backward(graph, dtype):
    lay, src, dst = graph
    E, H, C = src.numel(), 3, 4
    a = torch.rand(E, H, dtype=dtype)
    g, v = rows(1200, H, C, dtype, 1), rows(1500, H, C, dtype, 2)
    dot, dv = ops.sddmm_spmm(lay.csc_ptr, lay.csc_dst, lay.csc_edge, a, g, v, True)
    a64, g64, v64 = f64(a, g, v)
    close(dot, (g64[dst] * v64[src]).sum(-1))
    close(dv, torch.zeros(1500, H, C, dtype=torch.float64).index_add_(0, src, a64[..., None] * g64[dst]))
    dot2, dv2 = ops.sddmm_spmm(lay.csc_ptr, lay.csc_dst, lay.csc_edge, a, g, v, False)
    assert torch.equal(dot2, dot) and dv2.numel() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_source_operand_of_one_head_is_shared_by_every_head(graph, dtype):
    """Input-space aggregation (gatlib.layers._input_space): values and keys
    ``[N, 1, C]`` read by each of the H heads, and their gradients summed over the
    heads into one row."""
    lay, src, dst = graph
    E, H, C = src.numel(), 3, 6
    e, w = torch.randn(E, H, dtype=dtype) * 4, torch.randn(E, H, dtype=dtype)
    x, q, g = rows(1500, 1, C, dtype, 1), rows(1200, H, C, dtype, 2), rows(1200, H, C, dtype, 3)
    empty = lay.ptr.new_empty(0)
    e64, w64, x64, q64, g64 = f64(e, w, x, q, g)
    alpha_ref = softmax_ref(e64, dst, 1200)[0]
    out = ops.softmax_aggregate(lay.ptr, lay.src, e.clone(), None, x, False)[0]
    assert out.shape == (1200, H, C)
    close(out, torch.zeros(1200, H, C, dtype=torch.float64).index_add_(0, dst, alpha_ref[..., None] * x64[src]))
    close(ops.sddmm(lay.ptr, lay.src, empty, q, x, 0.5), 0.5 * (q64[dst] * x64[src]).sum(-1))
    close(ops.spmm(lay.ptr, lay.src, empty, w, x),  # dq = sum_j w_ij k_j
          torch.zeros(1200, H, C, dtype=torch.float64).index_add_(0, dst, w64[..., None] * x64[src]))
    dk = ops.spmm(lay.csc_ptr, lay.csc_dst, lay.csc_edge, w, q, True)  # dk = sum_i sum_h w_ij q_i
    assert dk.shape == (1500, 1, C)
    close(dk, torch.zeros(1500, C, dtype=torch.float64).index_add_(
        0, src, (w64[..., None] * q64[dst]).sum(1)).unsqueeze(1))
    dot, dv = ops.sddmm_spmm(lay.csc_ptr, lay.csc_dst, lay.csc_edge, w, g, x, True)
    assert dv.shape == (1500, 1, C)
    close(dot, (g64[dst] * x64[src]).sum(-1))
    close(dv, torch.zeros(1500, C, dtype=torch.float64).index_add_(
        0, src, (w64[..., None] * g64[dst]).sum(1)).unsqueeze(1))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("edge", [False, True], ids=["", "edge"])
def test_gatv2_score_and_its_gradient(graph, dtype, edge):
    """Score and both walks of the gradient against autograd of the formula
    ``e = att · leaky_relu(x_j + y_i + w_ij)`` (``w`` in edge-list order)."""
    lay, src, dst = graph
    E, H, C, slope = src.numel(), 2, 6, 0.2
    x, y = rows(1500, H, C, dtype, 1), rows(1200, H, C, dtype, 2)
    att = torch.randn(H, C, dtype=dtype)
    w = rows(E, H, C, dtype, 3) if edge else None
    x64, y64, att64, w64 = (t.requires_grad_() if t is not None else None for t in f64(x, y, att, w))
    z = x64[src] + y64[dst] + (w64[lay.perm] if edge else 0)
    e_ref = (F.leaky_relu(z, slope) * att64).sum(-1)
    e = ops.gatv2_score(lay.ptr, lay.src, lay.perm, x.detach(), y.detach(),
                        None if w is None else w.detach(), att.detach(), slope)
    close(e, e_ref.detach())
    de = torch.randn(E, H, dtype=dtype)
    leaves = [x64, y64, att64] + ([w64] if edge else [])
    want = torch.autograd.grad(e_ref, leaves, de.double())
    dw = None if w is None else w.detach()
    dy, dw_got, datt = ops.gatv2_grad(lay.ptr, lay.src, lay.ptr.new_empty(0), lay.perm, y.detach(),
                                      x.detach(), dw, att.detach(), de, slope, edge, True)
    dx = ops.gatv2_grad(lay.csc_ptr, lay.csc_dst, lay.csc_edge, lay.perm, x.detach(), y.detach(), dw,
                        att.detach(), de, slope, False, False)[0]
    for got, ref in zip([dx, dy, datt] + ([dw_got] if edge else []), want, strict=True):
        close(got, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_softmax_backward_and_segment_sum(graph, dtype):
    lay, src, dst = graph
    E, H = src.numel(), 3
    alpha = softmax_ref(torch.randn(E, H, dtype=dtype), dst, 1200)[0]
    d = torch.randn(E, H, dtype=dtype)
    a64, d64 = f64(alpha, d)
    delta = torch.zeros(1200, H, dtype=torch.float64).index_add_(0, dst, a64 * d64)
    close(ops.softmax_backward(lay.ptr, alpha, d.clone()), a64 * (d64 - delta[dst]))
    x = torch.randn(E, H, dtype=dtype)
    x64, = f64(x)
    close(ops.segment_sum(lay.ptr, lay.ptr.new_empty(0), x),
          torch.zeros(1200, H, dtype=torch.float64).index_add_(0, dst, x64))
    close(ops.segment_sum(lay.csc_ptr, lay.csc_edge, x),
          torch.zeros(1500, H, dtype=torch.float64).index_add_(0, src, x64))


def test_results_do_not_depend_on_the_thread_count(graph):
    """Every pass gives bit-identical results on one thread and on two (each row
    is summed by one thread in edge order; GATv2's att gradient is summed over
    chunks set by the edge count, in chunk order)."""
    lay, src, dst = graph
    E, H, C = src.numel(), 2, 8
    e, v, w = torch.randn(E, H), rows(1500, H, C, torch.float32, 1), torch.rand(E, H)
    g, y, att = rows(1200, H, C, torch.float32, 2), rows(1200, H, C, torch.float32, 3), torch.randn(H, C)

    def run():
        empty = lay.ptr.new_empty(0)
        return [*ops.softmax_aggregate(lay.ptr, lay.src, e.clone(), w, v, True),
                *ops.sddmm_spmm(lay.csc_ptr, lay.csc_dst, lay.csc_edge, w, g, v, True),
                ops.gatv2_score(lay.ptr, lay.src, lay.perm, v, y, None, att, 0.2),
                *ops.gatv2_grad(lay.ptr, lay.src, empty, lay.perm, y, v, None, att, w, 0.2, False, True)]

    one, two = with_threads(1, run), with_threads(2, run)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


def test_a_pass_rejects_rows_of_the_wrong_shape(graph):
    lay = graph[0]
    with pytest.raises(RuntimeError, match=r"v must be a contiguous \[\*, 2, 4\]"):
        ops.softmax_aggregate(lay.ptr, lay.src, torch.randn(lay.num_edges, 2), None,
                              torch.randn(1500, 4, 2).transpose(1, 2), False)


# ---------------------------------------------------------------------------
# Where the passes cannot be built
# ---------------------------------------------------------------------------
def test_a_failed_build_says_why(tmp_path, monkeypatch):
    """A source that does not compile: the loader returns the compiler's error
    instead of raising, and builds under $GATLIB_CACHE keyed by the CPU."""
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setattr(_native, "SOURCE", bad)
    monkeypatch.setenv("GATLIB_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="fused CPU kernel cannot run here: its compiled "
                                            "passes .bad.cpp. failed to build") as said:
        reason = _native._load.__wrapped__()
    assert len(said) == 1 and "backend='auto' runs the reference" in str(said[0].message)
    assert reason is not None and "failed to build" in reason and "bad.cpp" in reason
    assert _native.build_directory().parent == tmp_path / "cache" / "native"


def test_without_the_passes_the_fused_kernel_is_unsupported_by_name(monkeypatch):
    """Explicitly asked for, the fused kernel raises with the reason; "auto" takes
    the reference, as it does for any call the fused kernel cannot run, and a warning
    says why, once per process (the loader's result is cached: a fresh cache here)."""
    monkeypatch.setattr(_native, "_build_or_load", lambda: "no compiler here")
    monkeypatch.setattr(_native, "_load", functools.lru_cache(maxsize=None)(_native._load.__wrapped__))
    n = 600
    ei = random_graph(n, 20000, seed=1)  # (E + n) * H * C >= the auto size rule's bound
    x = torch.randn(n, 8)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="fused CPU kernel cannot run here: no compiler here"):
            gatlib.GATConv(8, 16, heads=4, backend="fused")(x, ei)
        assert (ei.size(1) + n) * 4 * 16 >= gatlib._dispatch.FUSED_CPU_MIN_ENTRIES
        with gatlib.record_kernels() as log:
            gatlib.GATConv(8, 16, heads=4)(x, ei)
            gatlib.GATConv(8, 16, heads=4)(x, ei)
    assert log == ["torch", "torch"]
    said = [str(w.message) for w in said if issubclass(w.category, RuntimeWarning)]
    assert said == ["gatlib: the fused CPU kernel cannot run here: no compiler here. "
                    "backend='auto' runs the reference kernel on CPU instead (it builds "
                    "[E, H, C] tensors: more memory and time on large graphs); "
                    "backend='fused' raises"], said
    monkeypatch.undo()
    with gatlib.record_kernels() as log:
        gatlib.GATConv(8, 16, heads=4)(x, ei)
    assert log == ["fused"]



# A user's first fused call, as a script: it builds the passes (in the cache folder
# that GATLIB_CACHE names) and runs a GATConv forward on them.
FIRST_CALL = """
import torch, gatlib
g = torch.Generator().manual_seed(0)
ei = torch.randint(0, 2000, (2, 20000), generator=g)
with gatlib.record_kernels() as log:
    out = gatlib.GATConv(32, 16, heads=3, backend="fused")(torch.randn(2000, 32, generator=g), ei)
assert log == ["fused"] and out.shape == (2000, 48) and bool(out.isfinite().all()), log
print("first call ok")
"""


@pytest.mark.slow
def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next(tmp_path):
    """A process SIGKILLed while it compiles the passes (an out-of-memory kill, a
    notebook restart) must not leave a lock that makes every later process wait
    forever: the next process builds and runs. A leftover private build folder an
    hour old is removed by the next build.

    The next build runs torch's ``cpp_extension.load`` (its lock on the build folder,
    which a dead process's lock there would make wait forever, then loading the library)
    with the compiler's run alone replaced by a copy of the library this process built
    (:data:`ops`): a second compile of the same source would prove nothing more."""
    env = {**os.environ, "GATLIB_CACHE": str(tmp_path)}
    built = _native._library(_native.build_directory())
    assert built is not None
    first = subprocess.Popen([sys.executable, "-c", FIRST_CALL], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 120
    try:  # killed once its build has started (ninja's build file written)
        while not list(tmp_path.rglob("build.ninja")):
            assert first.poll() is None, "the first process ended before its build started"
            assert time.monotonic() < deadline, "the build did not start within 120 s"
            time.sleep(0.05)
    finally:
        first.kill()
        first.wait()
        # then the ninja it ran (in its process group), which stops the compiler it runs: left
        # alone they compile on for a minute after the test, a core the tests after it lack
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGTERM)
    assert first.returncode == -signal.SIGKILL
    assert not list((tmp_path / "native").glob("*/*.so")), "a killed build was published"
    (left,) = [p for p in (tmp_path / "native").iterdir()]  # its private folder
    an_hour_ago = time.time() - 2 * 3600
    os.utime(left, (an_hour_ago, an_hour_ago))

    # a build takes seconds; a process that waits on the dead one never returns
    copy_built = ("import shutil, torch.utils.cpp_extension as c\n"
                  "def build(name, build_directory, **kw):  # (the compiler's run)\n"
                  "    print('built')\n"
                  f"    shutil.copy({str(built)!r}, build_directory + '/' + name + '.so')\n"
                  "c._write_ninja_file_and_build_library = build\n")
    second = subprocess.run([sys.executable, "-c", copy_built + FIRST_CALL], env=env,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "built\nfirst call ok" in second.stdout, second.stderr[-3000:]
    assert not left.exists()
    (published,) = list((tmp_path / "native").iterdir())
    assert not published.name.startswith(".") and list(published.glob("*.so"))

    # a later process loads the published build and compiles nothing
    no_build = ("import torch.utils.cpp_extension as c\n"
                "def load(*a, **k): raise AssertionError('built again')\nc.load = load\n")
    third = subprocess.run([sys.executable, "-c", no_build + FIRST_CALL], env=env,
                           capture_output=True, text=True, timeout=300)
    assert third.returncode == 0 and "first call ok" in third.stdout, third.stderr[-3000:]
    assert list((tmp_path / "native").iterdir()) == [published]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "no digest"])
def test_a_damaged_build_is_rebuilt_not_loaded(tmp_path, damage):
    """A cached library cut short (a full disk, an interrupted copy) crashes the process that maps
    it; one whose build's digest is missing cannot be trusted either. The next process finds it
    does not match its digest, says so, and builds and runs it again. (The build's compiler run is
    a copy of this process's library, as in the test above.)"""
    env = {**os.environ, "GATLIB_CACHE": str(tmp_path)}
    built = _native._library(_native.build_directory())
    assert built is not None
    copy_built = ("import shutil, torch.utils.cpp_extension as c\n"
                  "def build(name, build_directory, **kw):  # (the compiler's run)\n"
                  "    print('built')\n"
                  f"    shutil.copy({str(built)!r}, build_directory + '/' + name + '.so')\n"
                  "c._write_ninja_file_and_build_library = build\n")

    def first_call():
        return subprocess.run([sys.executable, "-c", copy_built + FIRST_CALL], env=env,
                              capture_output=True, text=True, timeout=300)

    first = first_call()
    assert first.returncode == 0 and "built\nfirst call ok" in first.stdout, first.stderr[-3000:]
    (library,) = (tmp_path / "native").glob("*/*.so")
    assert _native._intact(library)
    if damage == "truncated":
        library.write_bytes(library.read_bytes()[: library.stat().st_size // 3])
    else:
        (library.parent / _native.DIGEST_FILE).unlink()
    assert not _native._intact(library)
    second = first_call()
    assert second.returncode == 0 and "built\nfirst call ok" in second.stdout, second.stderr[-3000:]
    assert "is not the library its build wrote" in second.stderr
    (again,) = (tmp_path / "native").glob("*/*.so")
    assert again.read_bytes() == built.read_bytes() and _native._intact(again)
    assert [p.name for p in (tmp_path / "native").iterdir()] == [again.parent.name]  # nothing aside
