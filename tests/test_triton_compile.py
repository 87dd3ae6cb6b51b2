"""The Triton kernels through Triton's real launch path, without a GPU.

The other Triton tests run the kernels in Triton's CPU interpreter, which skips what a real launch
does first: the generated argument binder, specialisation, and the compiler. Here the dispatcher's
calls at the users' shapes bind through Triton's binder and compile to a cubin for sm_90 with its
bundled ptxas (tools.triton_compile), every config of each row kernel's space, and the compiled
kernels are held to the compile budget. These run in subprocesses: this process has
``TRITON_INTERPRET=1`` (conftest), which the compiler must not see. tests/test_older_torch.py runs
the budget again under the GPU machine's Triton (3.6).
"""
from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from testing import compile_budget, run_without_interpreter

pytestmark = pytest.mark.slow  # captures and compiles through ptxas: not in the fast lane

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("triton")


def _run(args, **kw):
    return run_without_interpreter(args, **kw)


def test_compile_budget_at_the_users_shapes(tmp_path):
    """At the users' calls, every specialisation (every config of each row kernel's space)
    binds and compiles for sm_90 without spilling (a register cap of 255 for every config:
    ptxas otherwise spilled 16 bytes per thread at one GATv2 shape to stay at a count it
    preferred), within 99 KB of shared memory, without atomics or 32-bit index arithmetic; every
    row kernel loads 128 bits at a time (the users' rows are 16-byte aligned, 40 classes among
    them); every pipelined config's edge loop is pipelined (asynchronous copies); and the configs
    of each layer sum along heads and channels laid out alike: the tuner cannot change a sum's
    order."""
    report = compile_budget(tmp_path)
    print(f"triton {report['triton']}: {len(report['rows'])} specialisations in "
          f"{report['seconds']:.0f} s", file=sys.stderr)


def test_the_budget_sees_a_layer_laid_out_twice_and_a_missing_config(tmp_path):
    """The budget's checks can fail: one layer's configs compiled at two warp counts (which lays
    its sums out otherwise) are flagged, and so is a layer of which a config did not compile."""
    probe = textwrap.dedent("""
        from tools import triton_compile as tc
        specs = [s for s in tc.capture([tc.Case("gatv2", "float32", 3, 256)]) if s.kernel == "_fwd_kernel"]
        specs[1].options = {**specs[1].options, "num_warps": 1}  # another layout, one config
        rows = tc.compile_all(specs, jobs=1)
        print("|".join(tc.budget_problems(rows)))
        print("|".join(tc.budget_problems(rows[1:])))
    """)
    script = tmp_path / "probe.py"
    script.write_text(probe)
    proc = _run([str(script)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    twice, missing = proc.stdout.strip().splitlines()[-2:]
    assert "laid out differently" in twice, twice
    assert "compiled, its space is" in missing, missing


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
    eager kernels")."""
    probe = textwrap.dedent("""
        import json
        import torch, torch.nn.functional as F
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from triton import knobs
        import gatlib
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
            with triton_on_cpu(Tally()):
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

