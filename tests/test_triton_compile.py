"""The Triton kernels through Triton's real launch path, without a GPU.

The other Triton tests run the kernels in Triton's CPU interpreter, which skips what a real
launch does first: the generated argument binder, specialisation, and the compiler. The
compile table (``benchmarks/results/triton_compile.json``, :mod:`tools.triton_compile`) holds
every specialisation the dispatcher launches at the users' calls, bound by Triton's binder
and compiled to a cubin for sm_80 and sm_90 with Triton's bundled ptxas. Building it takes
half an hour on 2 cores; here ``--check`` proves the committed table is this checkout's (the
same Triton and kernel source, exactly the specialisations launched now, a sample compiled
again to the same resources) and the tests hold its rows to the compile budget. These run in
subprocesses: this process has ``TRITON_INTERPRET=1`` (conftest), which the compiler must
not see.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a capture and sampled compiles through ptxas: not in the fast lane

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"_fwd_kernel", "_alpha_kernel", "_keep_kernel", "_bwd_dst_kernel", "_bwd_src_kernel",
           "_merge_kernel"}
pytest.importorskip("triton")


def _run(args, **kw):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, **kw)


TABLE = ROOT / "benchmarks" / "results" / "triton_compile.json"
REBUILD = ("python -m tools.triton_compile --json benchmarks/results/triton_compile.json "
           "--table benchmarks/results/triton_compile.md")


@pytest.fixture(scope="module")
def report():
    return json.loads(TABLE.read_text())


def test_the_committed_table_is_this_checkouts():
    """The table the other tests read stands for this checkout: a kernel edit, a Triton
    upgrade or a change of what the dispatcher launches fails here until it is rebuilt."""
    proc = _run(["-m", "tools.triton_compile", "--check", str(TABLE)], timeout=1800)
    assert proc.returncode == 0, f"rebuild it: {REBUILD}\n" + proc.stderr[-3000:]
    assert "this checkout's" in proc.stdout, proc.stdout


def test_the_check_fails_on_a_stale_table(tmp_path, report):
    """The check can fail: a table that lacks a launched specialisation, or from another
    kernel source, is stale before anything compiles; one whose sampled row says other
    registers than a compile gives now is named with the difference."""
    stale = dict(report, specs=report["specs"][1:], kernels_sha256="0" * 64)
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    proc = _run(["-m", "tools.triton_compile", "--check", str(tmp_path / "stale.json")],
                timeout=1800)
    assert proc.returncode == 1 and "stale" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "1 specialisations launched now are not in the table" in proc.stderr, proc.stderr
    assert "kernels' source" in proc.stderr, proc.stderr
    probe = textwrap.dedent(f"""
        import json
        from tools import triton_compile as tc
        report = json.load(open({str(TABLE)!r}))
        first = tc.sample(tc.capture(tc.default_cases()), 1)[0].id()
        row = next(r for r in report["rows"] if r["id"] == first and r["target"] == "sm_90")
        row["registers"] += 1
        print("\\n".join(tc.check(report, per_kernel=1)))  # (the test above compiles 2 per kernel)
    """)
    script = tmp_path / "probe.py"
    script.write_text(probe)
    proc = _run([str(script)], timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "sm_90" in lines[0] and "'registers'" in lines[0], lines


def _consts(row):
    return dict(kv.split("=") for kv in row["constexprs"].split())


def test_every_specialisation_binds_and_compiles_for_sm80_and_sm90(report):
    rep = report
    rows = rep["rows"]
    failed = [f"{r['kernel']} {r['target']} {r['constexprs']}: {r['error'][:500]}"
              for r in rows if "error" in r]
    assert not failed, "\n".join(failed[:5])
    # every captured specialisation, for both targets, each with a ptxas report
    assert len(rows) == 2 * len(rep["specs"]) and len(rep["specs"]) > 300
    per_target = Counter(r["target"] for r in rows)
    assert per_target == {"sm_80": len(rep["specs"]), "sm_90": len(rep["specs"])}
    assert all(0 < r["registers"] <= 255 for r in rows)
    # what the dispatcher's calls covered: all kernels, kinds, input dtypes,
    # edge features, dropout, tuning configs and channel widths
    assert {r["kernel"] for r in rows} == KERNELS
    fwd = [r for r in rows if r["kernel"] == "_fwd_kernel"]
    assert {_consts(r)["KIND"] for r in fwd} == {"0", "1", "2", "3"}
    assert {r["signature"]["value"] for r in fwd} == {"*fp16", "*bf16", "*fp32", "*fp64"}
    for flag in ("HAS_EDGE", "HAS_VEDGE", "HAS_BIAS", "DROPOUT", "SHARE_V", "SHARE_VE", "ONE_K",
                 "ONE_V"):
        assert {_consts(r)[flag] for r in fwd} == {"True", "False"}, flag
    assert {_consts(r)["BLOCK_CV"] for r in fwd} == {str(2 ** i) for i in range(11)}
    # every edge tile and lane count of the tuning spaces, both ways of the heads and of
    # loading ahead, every register cap
    assert {_consts(r)["BLOCK_E"] for r in fwd} >= {"2", "4", "16", "64"}
    assert {_consts(r)["BLOCK_R"] for r in fwd} >= {"1", "2", "4", "8", "16"}
    for flag in ("LANE_HEADS", "AHEAD"):
        assert {_consts(r)[flag] for r in fwd} == {"True", "False"}, flag
    assert {r["maxnreg"] for r in fwd} >= {255, 128, 64}
    bwd = [r for r in rows if r["kernel"] == "_bwd_dst_kernel"]
    for flag in ("GALPHA", "NEED_EDGE", "NEED_VEDGE", "NEED_ATT", "NEED_BIAS"):
        assert {_consts(r)[flag] for r in bwd} == {"True", "False"}, flag
    # integers that change with the graph are not specialised on their value
    # (a new mini-batch must not compile new kernels)
    assert not [(r["kernel"], r["specialised_ints"]) for r in rows if r["specialised_ints"]]


# The compile budget at the shapes users run (the report's user_channels, float32
# and bfloat16, with and without edge features, dropout and returned weights),
# sm_80 and sm_90, every config of each row kernel's tuning space: no specialisation
# spills, and none uses more registers than its config's cap (ptxas .maxnreg: the
# programs per SM it runs; without a cap ptxas spilled 8-60 bytes per thread at some of
# these shapes to stay at a register count it preferred).
#
# GATv2's forward accumulator keeps the layout of the [R, E, CV] tile it sums: as
# a 2-D slice of it (the old accumulator) it spilled 708 bytes per thread at C = 256
# in float32 and 1,172 in bfloat16. With rows of 128 channels or more in the larger
# tile (2048 elements) the old accumulator spills again (ptxas, sm_90,
# C = 256: 152 bytes in bfloat16, 2,516 in float32 with edge features, dropout and
# weights; the kept layout none, 115-124 registers): the spill check fails with it.
SPILL_BYTES = 0
PIPELINED = {"_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel"}
# Shared memory per SM: 164 KB on an A100 (sm_80), 228 KB on an H100 (sm_90); a
# block may take at most 163 KB and 227 KB (CUDA programming guide, compute
# capabilities 8.0 and 9.0). The budget at the users' shapes: half the A100's SM.
SHARED_MAX = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
SHARED_BUDGET = 164 * 1024 // 2


def _register_budget(row):
    return row["maxnreg"] or 255


def _user_shape_cases(row, channels):
    """The cases of ``row`` at the budget's shapes (plain or with extras)."""
    out = []
    for label in row["cases"]:
        kind, dtype, c = label.split()[:3]
        if dtype in ("float32", "bfloat16") and int(c.removeprefix("C=")) in channels:
            out.append(label)
    return out


def test_compile_budget_at_the_shapes_users_run(report):
    rep = report
    channels = rep["user_channels"]  # the module's USER_CHANNELS (not importable here)
    assert channels == [8, 40, 64, 128, 256]
    rows = [r for r in rep["rows"] if "error" not in r and _user_shape_cases(r, channels)]
    fwd = [r for r in rows if r["kernel"] == "_fwd_kernel"]
    # every kind (the input-space calls' two among them) at every width, plain: the
    # budget saw what it is about
    plain = {c for r in fwd for c in _user_shape_cases(r, channels) if len(c.split()) == 3}
    assert len(plain) == 6 * 2 * 5, sorted(plain)
    over = [(r["kernel"], r["target"], r["registers"], r["spill_stores"] + r["spill_loads"],
             r["cases"][0]) for r in rows if r["spill_stores"] + r["spill_loads"] > SPILL_BYTES]
    assert not over, over[:5]
    greedy = [(r["kernel"], r["target"], r["registers"], r["num_warps"], r["cases"][0]) for r in rows
              if r["registers"] > _register_budget(r)]
    assert not greedy, greedy[:5]
    # rows loaded 64 or 128 bits at a time where rows are 16-byte aligned (C x the dtype's
    # bytes a multiple of 16: every user shape, 40 classes among them, since heads and
    # channels are compile-time constants): the value rows of every forward (GATv2's
    # through its x_src tiles), the Transformer's keys and GATv2's x_src/x_dst (the
    # scorer's tiles, in the forward and the dst backward), the value and grad_out rows
    # of the backward kernels. Every such specialisation has wide loads in its PTX, and
    # in float32 128-bit ones (with H, C as runtime integers, none at C = 40 had). In
    # bfloat16 at C = 8 and 256 the tile's layout gives a thread 4 channels: 64 bits.
    def aligned(r):
        return all(int(c.split()[2][2:]) * {"float32": 4, "bfloat16": 2}[c.split()[1]] % 16 == 0
                   for c in _user_shape_cases(r, channels))

    def float32(r):
        return all(c.split()[1] == "float32" for c in _user_shape_cases(r, channels))

    row_kernels = ("_fwd_kernel", "_bwd_dst_kernel")
    full = [r for r in rows if r["kernel"] in row_kernels and aligned(r)]
    full += [r for r in rows if r["kernel"] == "_bwd_src_kernel" and aligned(r)
             and _consts(r)["NEED_VALUE"] == "True"]
    narrow_loads = [(r["kernel"], r["target"], r["cases"][0]) for r in full
                    if not (r["loads_128"] if float32(r) else r["wide_loads"])]
    assert {r["kernel"] for r in full} == {*row_kernels, "_bwd_src_kernel"}
    assert any("C=40" in c for r in full if float32(r) for c in _user_shape_cases(r, channels))
    assert not narrow_loads, narrow_loads[:5]
    # the row kernels' edge loops are software-pipelined (_triton_schedule._stages):
    # every specialisation at these shapes without edge features was launched with
    # more than one stage and its PTX has the pipeliner's asynchronous copies
    # (cp.async) — with one stage, or a loop the pipeliner refused, it has none —
    # within a shared-memory budget that lets two programs share an SM (as the
    # registers' above) on sm_80, the smaller; with edge features, one stage
    def has_edge(r):
        return "True" in (_consts(r)["HAS_EDGE"], _consts(r).get("HAS_VEDGE"))

    row = [r for r in rows if r["kernel"] in PIPELINED]
    pipelined = [r for r in row if not has_edge(r)]
    assert {r["kernel"] for r in pipelined} == PIPELINED
    unpipelined = [(r["kernel"], r["target"], _consts(r)["STAGES"], r["cases"][0])
                   for r in pipelined if int(_consts(r)["STAGES"]) < 2 or not r["async_copies"]]
    assert not unpipelined, unpipelined[:5]
    assert all(_consts(r)["STAGES"] == "1" and not r["async_copies"]
               for r in row if has_edge(r))
    big = [(r["kernel"], r["target"], r["shared_bytes"], r["cases"][0]) for r in pipelined
           if r["shared_bytes"] > SHARED_BUDGET]
    assert not big, big[:5]


def test_shared_memory_fits_every_gpu(report):
    """A launch whose kernel asks for more shared memory than the GPU has fails
    there (Triton's OutOfResources), whatever its shape: every specialisation of
    the table fits the opt-in maximum per block of its target."""
    rep = report
    over = [(r["kernel"], r["target"], r["shared_bytes"], r["cases"][0]) for r in rep["rows"]
            if "error" not in r and r["shared_bytes"] > SHARED_MAX[r["target"]]]
    assert not over, over[:5]


def test_index_arithmetic_is_64_bit(report):
    rep = report
    narrow = [(r["kernel"], r["constexprs"], r["narrow_index_math"][:2])
              for r in rep["rows"] if r.get("narrow_index_math")]
    assert not narrow, narrow[:3]


def test_deterministic_by_construction(report):
    """No atomics in any kernel (every output row is written by one program),
    and no PyTorch op around them that is nondeterministic on CUDA (split rows
    are merged with segment reductions)."""
    rep = report
    assert not [(r["kernel"], r["constexprs"]) for r in rep["rows"] if r["atomics"]]
    source = (ROOT / "gatlib" / "_triton.py").read_text()
    for op in ("index_add", "scatter_add", "scatter_reduce", "index_put_(", "atomic_"):
        assert op not in source, op


def test_the_index_check_flags_32_bit_offsets(tmp_path):
    """The IR check itself can fail: a kernel whose offsets are computed in
    32 bits (and only then widened, or not at all) is flagged; the same kernel
    in 64 bits is not."""
    probe = textwrap.dedent("""
        import triton, triton.language as tl
        from tools.triton_compile import Spec, narrow_index_math, ttir

        @triton.jit
        def widened(x, n, C, BLOCK: tl.constexpr):
            lane = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
            tl.store(x + lane * C, 1.0, mask=lane < n)

        @triton.jit
        def narrow(x, n, C, BLOCK: tl.constexpr):
            lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x + lane * C, 1.0, mask=lane < n)

        @triton.jit
        def wide(x, n, C, BLOCK: tl.constexpr):
            lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x + lane * C + tl.arange(0, BLOCK), 1.0, mask=lane < n)

        sig = {"x": "*fp32", "n": "i32", "C": "i32", "BLOCK": "constexpr"}
        opts = {"num_warps": 4, "num_stages": 3, "num_ctas": 1, "enable_fp_fusion": True}
        for fn in (widened, narrow, wide):
            spec = Spec(fn.__name__, sig, {(3,): 128}, {(0,): [["tt.divisibility", 16]]}, opts)
            print(fn.__name__, len(narrow_index_math(ttir(spec, fn=fn))))
    """)
    script = tmp_path / "probe.py"  # Triton reads a jit function's source from its file
    script.write_text(probe)
    proc = _run([str(script)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = dict(re.findall(r"^(\w+) (\d+)$", proc.stdout, re.M))
    assert int(found["widened"]) >= 1 and int(found["narrow"]) >= 1
    assert found["wide"] == "0"


def test_a_new_graph_needs_no_new_kernel(tmp_path):
    """Two graphs of other sizes, the self-test's GPU checks' own graphs and training
    call, bind through Triton's real binder to the same compiled kernels: the first call
    compiles each config of its tuning spaces (the stand-in times them alike), the second
    binds the chosen ones, every cache key of it one of the first's."""
    probe = textwrap.dedent("""
        import gatlib
        from triton import knobs
        from gatlib.bench import selftest
        from tools import internals, triton_compile

        keys = []

        def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            keys[-1].add(str(key))
            return True

        knobs.runtime.jit_cache_hook = hook
        N = selftest.NUM_NODES
        # the GPU checks' own graphs and training call (selftest.gpu_checks)
        with triton_compile.stand_in_driver(), internals.triton_admits_cpu_tensors():
            for n, e, seed in ((N, 4 * (N - 21), 0), (N - 13, 4 * (N - 34) + 7, 1)):
                keys.append(set())
                plan, inputs = selftest.check_graph(n, e, seed, "cpu")
                with gatlib.record_kernels() as log:
                    selftest.check_call(plan, n, inputs)
                assert log == ["triton", "triton.backward"], log
        print(len(keys[0]), len(keys[1]), len(keys[1] - keys[0]))
    """)
    script = tmp_path / "probe.py"
    script.write_text(probe)
    proc = _run([str(script)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, new = map(int, proc.stdout.split()[-3:])
    # the three row kernels (one launch each, the tuned config's) and the two merges
    # (softmax pieces, sums): the hubs are split
    assert second >= 5 and first > second and new == 0


def test_a_compiled_step_launches_the_eager_kernels(tmp_path):
    """A compiled 2-layer training step on a GraphPlan (each layer; AOT autograd with
    the min-cut partitioner, as inductor calls it), run through Triton's launch path
    (a stand-in sm_90 driver, launches skipped): its graphs call gatlib's two operators
    and hold no Triton kernel of their own, and its launches bind exactly the eager
    step's specialisations (once the eager step has tuned them) — the same constexprs,
    warps and register caps (``maxnreg``: Triton's cache key holds the compile options).

    As ``triton_op``s the kernels were compiled by inductor (torch 2.11-2.13), which
    passes no ``maxnreg`` to the compiler: compiled calls ran uncapped binaries, not
    the ones the compile budget holds (docs/design.md, "Compiled calls launch the
    eager kernels"). GATConv's output layer runs with ``compiled_gat_terms_in_kernel``, so
    that both steps form its terms in the kernels (compiled calls take the node terms
    by default: another kind)."""
    probe = textwrap.dedent("""
        import json
        import torch, torch.nn.functional as F
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from triton import knobs
        import gatlib
        from tools import internals
        from tools.launches import Tally, triton_on_cpu

        keys, calls, wrapped = [], set(), []

        def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            # (the cache key holds the specialisation; warps and the register cap are
            # compile options beside it)
            options = json.loads(compile["specialization_data"])["options"]
            keys[-1].add((fn.name, str(key), compile["num_warps"], options.get("maxnreg")))
            return True  # skip the compile and the launch

        def keep(gm, inputs):
            for n in gm.graph.nodes:
                if "triton_kernel_wrapper" in str(n.target):
                    wrapped.append(str(n.target))
                elif str(n.target).startswith("gatlib."):
                    calls.add(str(n.target).split(".")[1])
            return make_boxed_func(gm.forward)

        def backend(gm, inputs):
            return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep,
                                         partition_fn=min_cut_rematerialization_partition)

        for layer in ("GATConv", "GATv2Conv", "TransformerConv"):
            cls = getattr(gatlib, layer)

            class TwoLayer(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.conv1 = cls(16, 8, heads=3, backend="triton")
                    self.conv2 = cls(24, 5, heads=1, backend="triton")

                def forward(self, x, graph):
                    return self.conv2(F.elu(self.conv1(x, graph)), graph)

            torch.manual_seed(0)
            n = 200
            x = torch.randn(n, 16)
            plan = gatlib.GraphPlan(torch.randint(0, n, (2, 1000)), num_nodes=n)
            model = TwoLayer()
            torch._dynamo.reset()
            knobs.runtime.jit_cache_hook = hook
            with triton_on_cpu(Tally()), internals.compiled_gat_terms_in_kernel():
                knobs.runtime.jit_cache_hook = hook
                # (the first eager step tunes: it binds every config of its spaces; the
                # second, and the compiled one, the chosen configs)
                for compiled in (False, False, True):
                    keys.append(set())
                    m = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
                    m(x, plan).sum().backward()
            eager, comp = keys[-2], keys[-1]
            # the row kernels alike; a compiled call also launches the merges of split
            # rows, which an eager call on a graph without hubs skips (it reads that back)
            rows = [{k for k in ks if k[0] != "_merge_kernel"} for ks in (eager, comp)]
            assert rows[0] == rows[1], (layer, sorted(rows[0] ^ rows[1])[:4])
            assert comp >= eager, (layer, sorted(eager - comp)[:4])
            assert {k[0] for k in rows[0]} == {"_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel"}
            assert all(k[3] for k in rows[0]), sorted(rows[0])[:1]  # each with its cap
        assert not wrapped, wrapped
        assert calls == {"triton_attention", "triton_attention_backward"}, calls
        print("ok")
    """)
    script = tmp_path / "probe.py"
    script.write_text(probe)
    proc = _run([str(script)], timeout=900)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]

