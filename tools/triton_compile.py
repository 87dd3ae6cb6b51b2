r"""Launch and compile the Triton kernels for NVIDIA GPUs on a machine without one: the compile
budget (tests/test_triton_compile.py).

Triton's interpreter (``TRITON_INTERPRET=1``), which runs the kernels' tests on CPU, never uses
Triton's launch path: the generated argument binder, the specialisation of arguments and the
compiler. This module runs that path:

1. **capture**: the dispatcher's Triton path (:func:`tools.internals.triton_attention`, forward
   and backward) runs on CPU tensors with a stand-in driver whose current target is an NVIDIA
   GPU. Every launch goes through Triton's real binder and specialisation, each row kernel's
   tuner through every config of its space; a ``jit_cache_hook`` records what would be compiled
   and skips the compile and the launch;
2. **compile**: each distinct specialisation is compiled by ``triton.compile`` for sm_90 (H100,
   H200; sm_80 on request) with the bundled ``ptxas``, whose report gives registers and spills;
   the PTX its loads' widths, the Triton IR its index arithmetic and the GPU IR its tiles' layouts.

``python -m tools.triton_compile [--json PATH]`` prints the budget's table at the users' shapes.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

if os.environ.get("TRITON_INTERPRET") == "1":  # must hold before triton is imported
    raise RuntimeError("tools.triton_compile needs Triton's compiler: unset TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from gatlib import EdgeScore, GraphPlan  # noqa: E402
from gatlib import introspect  # noqa: E402
from tools import internals  # noqa: E402

TARGETS = {"sm_80": 80, "sm_90": 90}
# GATConv's, GATv2Conv's and TransformerConv's calls; "*_inputs": GATConv's and TransformerConv's
# in input space, values (and the Transformer's key, its value) of one head that every head reads
KINDS = ("gat", "gatv2", "dot", "gat_inputs", "dot_inputs")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
# Channels per head users run: Cora's 8 x 8, OGB's 16-256, a 40-class output layer (at 3 heads;
# that layer's one head is a case of its own)
USER_CHANNELS = (8, 40, 64, 128, 256)


@dataclass(frozen=True)
class Case:
    """One call of the dispatcher, as a layer makes it."""

    kind: str
    dtype: str
    heads: int
    channels: int
    edge: bool = False  # edge features: the score's edge term (+ the Transformer's value term)
    dropout: bool = False
    alpha: bool = False  # attention weights returned, and differentiated through

    @property
    def label(self) -> str:
        return (f"{self.kind} {self.dtype} H={self.heads} C={self.channels}"
                + " edge" * self.edge + " dropout" * self.dropout + " alpha" * self.alpha)


def user_cases() -> List[Case]:
    """The budget's calls: the three layers' kinds plain at 3 heads of each of
    :data:`USER_CHANNELS` in float32 and bfloat16, at one head of 40 (an output layer), with
    edge features, dropout and weights at 3 x 64; the input-space calls at 3 x 128 (arxiv's
    first layer), GAT's with dropout and weights."""
    layers = KINDS[:3]
    cases = [Case(k, d, 3, c) for k, d, c in
             itertools.product(layers, ("float32", "bfloat16"), USER_CHANNELS)]
    cases += [Case(k, "float32", 1, 40) for k in layers]
    cases += [Case(k, "float32", 3, 64, edge=True, dropout=True, alpha=True) for k in layers]
    cases += [Case(k, "float32", 3, 128) for k in KINDS[3:]]
    cases.append(Case("gat_inputs", "float32", 3, 128, dropout=True, alpha=True))
    return cases


def capture_graph() -> Tuple[torch.Tensor, int]:
    """A graph whose destination and source schedules hold rows of 0..23 edges and split a
    hub (rows longer than ``internals.TRITON_SPLIT`` edges)."""
    g = torch.Generator().manual_seed(0)
    n = 64
    split = internals.TRITON_SPLIT
    hub_in = torch.stack([torch.randint(0, n, (2 * split + 5,), generator=g),
                          torch.zeros(2 * split + 5, dtype=torch.long)])
    hub_out = torch.stack([torch.ones(split + 3, dtype=torch.long),
                           torch.randint(0, n, (split + 3,), generator=g)])
    deg = torch.arange(2, n) % 24
    dst = torch.repeat_interleave(torch.arange(2, n), deg)
    src = torch.randint(0, n, (dst.numel(),), generator=g)
    return torch.cat([hub_in, hub_out, torch.stack([src, dst])], 1), n


def case_tensors(case: Case, n: int, E: int):
    """``(score, value, value_edge)`` of a case, as its layer passes them."""
    dt = DTYPES[case.dtype]
    H, C = case.heads, case.channels

    def r(*shape):
        return torch.randn(*shape, dtype=dt, requires_grad=True)

    if case.kind == "gat_inputs":
        return EdgeScore.gat(r(n, H), r(n, H), r(E, H) if case.edge else None), r(n, 1, C), None
    if case.kind == "dot_inputs":
        x = r(n, 1, C)
        return EdgeScore.dot(r(n, H, C), x), x, None
    if case.kind == "gat":
        return EdgeScore.gat(r(n, H), r(n, H), r(E, H) if case.edge else None), r(n, H, C), None
    edge = r(E, H, C) if case.edge else None
    if case.kind == "gatv2":  # GATv2Conv's values are its source projection
        x = r(n, H, C)
        return EdgeScore.gatv2(x, r(n, H, C), r(H, C), edge), x, None
    return EdgeScore.dot(r(n, H, C), r(n, H, C), edge), r(n, H, C), edge  # the edge term twice


class _Driver:
    """The active driver for capture and compile: an NVIDIA GPU that is not there."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        def bench(kernel_call, quantiles):  # runs the call once (its compile is captured)
            kernel_call()
            return [1.0, 1.0, 1.0]  # nothing is timed: every config alike, the first kept
        return bench


@contextlib.contextmanager
def stand_in_driver(arch: int = 90):
    """Inside: Triton's active driver is a stand-in NVIDIA GPU of compute capability ``arch``:
    its launch binder and compiler target that GPU; nothing can be launched or timed (its
    benchmarker runs a call once and times every config alike), and the row kernels' tuners
    keep nothing on disk (a real GPU of that capability would read the stand-in's timings)."""
    from triton.runtime import driver

    previous = driver._active  # None until first used: without a GPU it cannot be made
    driver.set_active(_Driver(arch))
    tuners = internals.triton_tuners().values()
    cached = [t.cache_results for t in tuners]
    for t in tuners:
        t.cache_results = False
    try:
        yield
    finally:
        driver._active = previous
        for t, c in zip(tuners, cached, strict=True):
            t.cache_results = c


@dataclass
class Spec:
    """One specialisation of one kernel: what Triton compiles for a launch."""

    kernel: str
    signature: Dict[str, str]
    constexprs: Dict
    attrs: Dict
    options: Dict
    cases: List[str] = field(default_factory=list)

    def key(self):
        return (self.kernel, repr(sorted(self.signature.items())),
                repr(sorted(self.constexprs.items(), key=str)),
                repr(sorted(self.attrs.items(), key=str)), repr(sorted(self.options.items())))

    def constant(self, name: str):
        """A constexpr's value by name (``None`` if it is not one)."""
        fn = introspect.triton_kernels()[self.kernel]
        if name not in fn.arg_names:
            return None
        return self.constexprs.get((fn.arg_names.index(name),))

    def layer(self) -> Tuple:
        """What a layer fixes of this launch (every constexpr but the config's, the signature):
        the specialisations of one layer's space differ only in their config."""
        rest = {k: v for k, v in self.constexprs.items() if self._name(k) not in ("BLOCK_R", "STAGES")}
        return (self.kernel, repr(sorted(self.signature.items())), repr(sorted(rest.items(), key=str)),
                repr(sorted(self.attrs.items(), key=str)))

    def _name(self, k) -> str:
        return introspect.triton_kernels()[self.kernel].arg_names[k[0]] if isinstance(k, tuple) else str(k)

    def label(self) -> str:
        names = [f"{self._name(k)}={getattr(v, '__name__', v)}" for k, v in self.constexprs.items()
                 if isinstance(k, tuple) and len(k) == 1 and self._name(k).isupper()]
        return " ".join(names + [f"warps={self.options['num_warps']}",
                                 f"stages={self.options['num_stages']}"])


def capture(cases: Iterable[Case]) -> List[Spec]:
    """Run the dispatcher's forward and backward for each case through Triton's real binder,
    each row kernel's tuner through its whole space; return the distinct specialisations."""
    from triton import knobs

    ei, n = capture_graph()
    plan = GraphPlan(ei, num_nodes=n)
    specs: Dict = {}
    current: List[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        c = compile
        options = {"num_warps": c["num_warps"], "num_stages": c["num_stages"]}
        # (a launch's register cap is an option the hook's arguments leave out)
        maxnreg = json.loads(c["specialization_data"])["options"].get("maxnreg")
        if maxnreg is not None:
            options["maxnreg"] = maxnreg
        spec = Spec(fn.name, dict(c["signature"]), dict(c["constants"]), dict(c["configs"][0]), options)
        spec = specs.setdefault(spec.key(), spec)
        if current[0] not in spec.cases:
            spec.cases.append(current[0])
        return True  # skip the compile (and so the launch)

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        with stand_in_driver():
            for case in cases:
                current[:] = [case.label]
                for tuner in internals.triton_tuners().values():  # each case binds its whole space
                    tuner.cache.clear()
                torch.manual_seed(0)
                score, value, value_edge = case_tensors(case, n, ei.size(1))
                out, alpha = internals.triton_attention(score, value, plan, value_edge,
                                                        0.1 if case.dropout else 0.0, case.alpha)
                (out.float().sum() + (alpha.float().sum() if case.alpha else 0)).backward()
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(specs.values())


# ---------------------------------------------------------------------------
# Compile and read what the compiler made.
# ---------------------------------------------------------------------------
_RESOURCES = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# a 128-bit load from global memory (four 32-bit or two 64-bit words), into registers or
# (cp.async of 16 bytes) into shared memory: a pipelined loop's
_LOAD_128 = re.compile(r"ld\.global(?:\.\w+)*\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b")
_ASYNC_16 = re.compile(r"cp\.async\.c[ag]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(?:0x10|16)\b")
_ASYNC = re.compile(r"cp\.async\.c[ag]\.shared\.global")
# the GPU IR's blocked layouts, and its reductions: the axis, the operand's shape and layout
_BLOCKED = re.compile(r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], "
                      r"threadsPerWarp = \[([\d, ]+)\], warpsPerCTA = \[([\d, ]+)\]", re.M)
_REDUCE = re.compile(r'"tt\.reduce"\((%[\w.]+)\) <\{axis = (\d+) : i32\}>(?:(?!"tt\.reduce").)*?\}\) : '
                     r'\(tensor<([\dx]+)x(\w+), (#blocked\d*)>', re.S)


def sum_layouts(ttgir: str) -> List[List]:
    """How the GPU IR spreads what it sums along a tile's heads or channels: per sum of a float
    tile (but of a masked selection, ``tl.sum(tl.where(i == k, x, 0))``, which picks one element
    exactly in any order), the tile's shape past its first axis, the axis, and that axis's
    elements per thread, threads per warp and warps. The order of the additions follows these."""
    defs = {m[0]: [tuple(int(x) for x in g.split(",")) for g in m[1:]] for m in _BLOCKED.findall(ttgir)}
    selects = set(re.findall(r"^\s*(%[\w.]+) = arith\.select ", ttgir, re.M))
    out = set()
    for operand, axis, shape, dtype, name in _REDUCE.findall(ttgir):
        axis = int(axis)
        if operand not in selects and dtype.startswith("f") and name in defs:
            spt, tpw, wpc = defs[name]
            out.add((shape.split("x", 1)[1], axis, spt[axis], tpw[axis], wpc[axis]))
    return [list(x) for x in sorted(out)]


def compile_spec(spec: Spec, target: str = "sm_90") -> Dict:
    """Compile ``spec`` for ``target`` to a cubin: seconds, registers per thread, spills
    (bytes), shared memory, 128-bit loads, atomics, 32-bit index arithmetic and how its sums
    along heads and channels are laid out (:func:`sum_layouts`)."""
    from triton import knobs
    from triton.compiler import ASTSource

    src = ASTSource(introspect.triton_kernels()[spec.kernel], spec.signature, spec.constexprs,
                    spec.attrs)
    log = io.StringIO()
    start = time.perf_counter()
    with knobs.nvidia.scope(), knobs.compilation.scope():
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v: registers and spills
        knobs.compilation.always_compile = True
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=GPUTarget("cuda", TARGETS[target], 32),
                                    options=spec.options)
    text = log.getvalue()
    regs, spills = _RESOURCES.search(text), _SPILLS.search(text)
    if regs is None or spills is None or "cubin" not in kernel.asm:
        raise RuntimeError(f"{spec.kernel} for {target}: no ptxas report\n{text}")
    ptx = kernel.asm["ptx"]
    return {"seconds": round(time.perf_counter() - start, 2), "registers": int(regs.group(1)),
            "spills": int(spills.group(1)) + int(spills.group(2)),
            "shared_bytes": kernel.metadata.shared,
            "loads_128": len(_LOAD_128.findall(ptx)) + len(_ASYNC_16.findall(ptx)),
            "async_copies": len(_ASYNC.findall(ptx)),
            "atomics": len(re.findall(r"tt\.atomic_\w+", kernel.asm["ttir"])),
            "narrow_index_math": narrow_index_math(kernel.asm["ttir"]),
            "sum_layouts": sum_layouts(kernel.asm["ttgir"])}


def _compile_job(args):
    spec, target = args
    try:
        return compile_spec(spec, target)
    except Exception as exc:  # reported, not raised: the table lists every failure
        return {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def compile_all(specs: Sequence[Spec], target: str = "sm_90", jobs: Optional[int] = None) -> List[Dict]:
    """Compile every spec in ``jobs`` processes; one row per spec."""
    with ProcessPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        results = list(pool.map(_compile_job, [(s, target) for s in specs], chunksize=4))
    return [{"kernel": s.kernel, "label": s.label(), "layer": repr(s.layer()), "cases": s.cases,
             "target": target, "config": _config(s), "space": _space(s), **r}
            for s, r in zip(specs, results, strict=True)]


ROW_KERNELS = ("_fwd_kernel", "_bwd_dst_kernel", "_bwd_src_kernel")


def _config(spec: Spec) -> Optional[List[int]]:
    """A row kernel's config as launched: ``[BLOCK_R, STAGES, num_warps]``."""
    if spec.kernel not in ROW_KERNELS:
        return None
    return [spec.constant("BLOCK_R"), spec.constant("STAGES"), spec.options["num_warps"]]


def _space(spec: Spec) -> Optional[List[List[int]]]:
    """The configs of the row kernel's space at the layer of ``spec`` (as :func:`_config`)."""
    if spec.kernel not in ROW_KERNELS:
        return None
    fn = introspect.triton_kernels()[spec.kernel]
    consts = {name: spec.constant(name) for name in fn.arg_names if name.isupper()}
    return sorted([c.kwargs["BLOCK_R"], c.kwargs["STAGES"], c.num_warps]
                  for c in internals.triton_space(spec.kernel, consts))


# ---------------------------------------------------------------------------
# 64-bit index arithmetic, checked on the kernels' Triton IR.
# ---------------------------------------------------------------------------
_DEF = re.compile(r"^\s*(%[\w.]+)(?::\d+)? = ([\w.]+) (.*)$")
_VALUE = re.compile(r"%[\w.]+")
_ARITH = {"arith.muli", "arith.addi", "arith.subi", "arith.shli"}
_SHAPE = {"tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "tt.trans"}
_BOUNDED = {"arith.constant", "tt.make_range"}  # values set by constexprs
_DATA = {"tt.load", "tt.get_program_id"}  # values known only at run time


def narrow_index_math(ttir: str) -> List[str]:
    """The 32-bit index arithmetic in ``ttir`` that can reach an address.

    A pointer offset is safe at papers100M scale (E·H, N·H·C up to ~2**38) only if every
    product or sum that feeds it is computed in 64 bits. Flagged: an ``addptr`` whose offset is
    32-bit and depends on a run-time value (an argument, a program id, a loaded index, a loop
    counter), and a 32-bit ``muli``/``addi``/``subi``/``shli`` of run-time values that is
    widened (``extsi``) into a 64-bit offset: it may have wrapped before the widening. Offsets
    made only of constants and ``tl.arange`` (bounded by constexprs) are fine in 32 bits.
    """
    # MLIR numbers values per region: sibling regions reuse names. Each name is resolved in
    # the scopes open where it is used, innermost first, to a definition's line number.
    defs = {}
    scopes: List[Dict[str, int]] = [{}]

    def resolve(name: str):
        for scope in reversed(scopes):
            if name in scope:
                return scope[name]
        return name  # a kernel argument or a block argument (loop-carried)

    for lineno, line in enumerate(ttir.splitlines()):
        code = line.split(" loc(")[0]
        stripped = code.strip()
        while stripped.startswith("}"):  # closes a region (also "} else {", "} do {")
            scopes.pop()
            stripped = stripped[1:].lstrip(") ")
        m = _DEF.match(code)
        if m:
            rhs = m.group(3)
            operands = [resolve(v.split("#")[0]) for v in _VALUE.findall(rhs.split(" : ")[0])]
            scopes[-1][m.group(1)] = lineno
            defs[lineno] = (m.group(2), operands, rhs.rsplit(":", 1)[-1].strip(), code.strip())
        if stripped.endswith("{"):
            scopes.append({})

    def runtime(v, seen) -> bool:  # depends on a value known only at run time
        if v in seen:
            return False
        seen.add(v)
        d = defs.get(v)
        if d is None:  # a kernel argument or a loop-carried value
            return True
        op, operands, _, _ = d
        if op in _BOUNDED:
            return False
        if op in _DATA:
            return True
        return any(runtime(o, seen) for o in operands)

    def narrow(v) -> bool:  # a 32-bit product/sum of run-time values (through shape ops)
        d = defs.get(v)
        if d is None:
            return False
        op, operands, ty, _ = d
        if op in _SHAPE:
            return any(narrow(o) for o in operands)
        return op in _ARITH and ty.rstrip(">").endswith("i32") and runtime(v, set())

    problems = []
    for op, operands, ty, code in defs.values():
        if op != "tt.addptr":
            continue
        offset = operands[1]
        if ty.rstrip(">").endswith("i32") and runtime(offset, set()):
            problems.append(f"32-bit offset: {code}")
            continue
        stack, seen = [offset], set()
        while stack:  # the offset's cone, stopping at loads (data)
            v = stack.pop()
            if v in seen or v not in defs:
                continue
            seen.add(v)
            vop, vops, _, vcode = defs[v]
            if vop == "arith.extsi" and narrow(vops[0]):
                problems.append(f"widened after 32-bit arithmetic: {vcode} (in {code})")
            elif vop not in _DATA:
                stack.extend(vops)
    return problems


def ttir(spec: Spec, target: str = "sm_90", fn=None) -> str:
    """``spec``'s Triton IR (the first stage of a compile; no LLVM or ptxas). ``fn`` is the jit
    function (default: the gatlib kernel named ``spec.kernel``)."""
    from triton._C.libtriton import ir
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    gpu = GPUTarget("cuda", TARGETS[target], 32)
    backend = make_backend(gpu)
    options = backend.parse_options(dict(spec.options))
    src = ASTSource(fn or introspect.triton_kernels()[spec.kernel], spec.signature, spec.constexprs,
                    spec.attrs)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(gpu, options, backend.get_codegen_implementation(options),
                         backend.get_module_map(), context)
    stages = {}
    backend.add_stages(stages, options, src.language)
    return str(stages["ttir"](module, {}))


# ---------------------------------------------------------------------------
# The budget and its CLI
# ---------------------------------------------------------------------------
# The most shared memory a program may take: an sm_86/sm_89 SM's 99 KiB (A100: 163, H100: 227).
SHARED_BUDGET = 99 * 1024


def over_budget(row: Dict) -> List[str]:
    """What breaks the compile budget in one compiled row: an error, spilled registers, more
    shared memory than :data:`SHARED_BUDGET`, an atomic, 32-bit index arithmetic."""
    if "error" in row:
        return [row["error"].splitlines()[0]]
    out = []
    if row["spills"]:
        out.append(f"spills {row['spills']} B")
    if row["shared_bytes"] > SHARED_BUDGET:
        out.append(f"{row['shared_bytes']} B of shared memory")
    if row["atomics"]:
        out.append(f"{row['atomics']} atomics")
    out += row["narrow_index_math"][:1]
    return out


def budget_problems(rows: Sequence[Dict]) -> List[str]:
    """Everything in ``rows`` (one per specialisation) that breaks the compile budget: a row
    over budget (:func:`over_budget`); a row kernel without 128-bit loads (the users' rows are
    16-byte aligned), or the weights' kernel of a kind with channel rows; a pipelined config
    (``STAGES`` 3) whose edge loop the pipeliner left alone, an unpipelined one with its copies;
    a layer whose configs do not all compile, or sum along heads or channels laid out unlike
    one another (the order of a sum must not follow the tuned config)."""
    out = [f"{r['kernel']} {r['label']} ({r['cases'][0]}): {'; '.join(over_budget(r))}"
           for r in rows if over_budget(r)]
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        wide = r["kernel"] in ROW_KERNELS or (r["kernel"] == "_alpha_kernel"
                                              and "KIND=0" not in r["label"])
        if wide and not r["loads_128"]:
            out.append(f"{r['kernel']} {r['label']} ({r['cases'][0]}): no 128-bit load")
        if r["config"] and (r["config"][1] > 1) != (r["async_copies"] > 0):
            out.append(f"{r['kernel']} {r['label']} ({r['cases'][0]}): STAGES={r['config'][1]} "
                       f"with {r['async_copies']} asynchronous copies")
    layers: Dict[str, List[Dict]] = {}
    for r in rows:
        if r["config"]:
            layers.setdefault(r["layer"], []).append(r)
    for rs in layers.values():
        if sorted(r["config"] for r in rs) != rs[0]["space"]:
            out.append(f"{rs[0]['kernel']} ({rs[0]['cases'][0]}): configs "
                       f"{sorted(r['config'] for r in rs)} compiled, its space is {rs[0]['space']}")
        sums = {json.dumps(r.get("sum_layouts")) for r in rs if "error" not in r}
        if len(sums) > 1:
            out.append(f"{rs[0]['kernel']} ({rs[0]['cases'][0]}): the configs' sums are laid "
                       f"out differently: {sorted(sums)}")
    return out


def summary(rows: Sequence[Dict]) -> List[List[str]]:
    """Per kernel: specialisations, registers, spilling, shared memory, 128-bit loads, seconds."""
    out = []
    for kernel in sorted({r["kernel"] for r in rows}):
        rs = [r for r in rows if r["kernel"] == kernel]
        ok = [r for r in rs if "error" not in r]
        regs = [r["registers"] for r in ok]
        out.append([kernel, str(len(rs)), str(len(rs) - len(ok)),
                    f"{min(regs)}-{max(regs)}" if regs else "-",
                    str(sum(r["spills"] > 0 for r in ok)),
                    str(max((r["shared_bytes"] for r in ok), default=0)),
                    str(sum(r["loads_128"] > 0 for r in ok)),
                    f"{sum(r.get('seconds', 0) for r in ok):.0f}"])
    return out


HEADERS = ["kernel", "specialisations", "failed", "registers", "spilling", "max shared B",
           "with 128-bit loads", "compile s"]


def _parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.triton_compile",
        description="Bind gatlib's Triton kernels at the users' shapes (every config of each "
                    "space) with Triton's launch binder and compile them (no GPU needed).")
    parser.add_argument("--target", default="sm_90", choices=sorted(TARGETS))
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPUs)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every row here")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from gatlib.bench.report import command_line, environment, format_table, write_json

    args = _parser().parse_args(argv)
    start = time.perf_counter()
    cases = user_cases()
    specs = capture(cases)
    print(f"[triton_compile] {len(cases)} calls -> {len(specs)} specialisations "
          f"({time.perf_counter() - start:.0f} s); compiling for {args.target}", file=sys.stderr)
    rows = compile_all(specs, args.target, args.jobs)
    print(format_table(HEADERS, summary(rows), align="<" + ">" * 7))
    problems = budget_problems(rows)
    for line in problems:
        print(f"over budget: {line}", file=sys.stderr)
    seconds = time.perf_counter() - start
    if args.json:
        write_json(args.json, {"schema": "gatlib.triton_compile/2", "command": command_line(),
                               "environment": environment("cpu"), "target": args.target,
                               "triton": triton.__version__, "seconds": round(seconds, 1),
                               "cases": [c.label for c in cases], "problems": problems,
                               "rows": rows})
    print(f"[triton_compile] triton {triton.__version__}: {len(rows)} specialisations in "
          f"{seconds:.0f} s, {len(problems)} over budget", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
