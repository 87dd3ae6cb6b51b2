r"""Launch and compile the Triton kernels for NVIDIA GPUs on a machine without one.

Triton's interpreter (``TRITON_INTERPRET=1``), which runs the kernels' tests on
CPU, never uses Triton's launch path: the generated argument binder, the
specialisation of arguments and the compiler. This module runs that path:

1. **capture** — the real dispatcher (:func:`tools.internals.triton_attention`, forward
   and backward) runs on CPU tensors with a stand-in driver whose current
   target is an NVIDIA GPU. Every ``kernel[grid](...)`` goes through Triton's
   real binder and specialisation; a ``jit_cache_hook`` records what would be
   compiled (kernel, argument types, constexprs, alignment attributes) and
   skips the compile and the launch;
2. **compile** — each distinct specialisation is compiled for sm_80 (A100) and
   sm_90 (H100) by ``triton.compile`` with the bundled ``ptxas``, whose
   resource report gives registers, spills and shared memory.

``python -m tools.triton_compile --json ... --table ...`` writes the table kept in
``benchmarks/results/`` (about half an hour on 2 cores). ``--check`` proves a table is this
checkout's in a minute: the same Triton, the same kernel source, exactly the specialisations
the dispatcher launches now, and a sample of them compiled again to the same resources;
``tests/test_triton_compile.py`` runs it and holds the table's rows to the compile budget.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import io
import itertools
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
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
# "gat_projected": GATConv's score from its projected rows (EdgeScore.gat_projected)
KINDS = ("gat", "gatv2", "dot", "gat_projected")
# GATConv's and TransformerConv's calls in input space: values (and the Transformer's
# key, which is its value) x_j of one head that every head shares, C = F channels
INPUT_KINDS = ("gat_inputs", "dot_inputs")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
# Channel counts per head: one per power-of-two tile width the kernels pad to,
# up to the largest they accept (internals.TRITON_MAX_CHANNELS).
CHANNELS = tuple(2 ** i for i in range(11))
assert CHANNELS[-1] == internals.TRITON_MAX_CHANNELS


@dataclass(frozen=True)
class Case:
    """One call of the dispatcher, as a layer makes it."""

    kind: str
    dtype: str
    channels: int
    edge: bool  # edge features: the score's edge term (+ the Transformer's value term)
    dropout: bool
    alpha: bool  # attention weights returned, and differentiated through
    heads: int = 3
    # the value needs a gradient; not for a first layer's inputs in input space (data)
    value_grad: bool = True

    @property
    def label(self) -> str:
        return (f"{self.kind} {self.dtype} C={self.channels}"
                + " edge" * self.edge + " dropout" * self.dropout + " alpha" * self.alpha
                + " data" * (not self.value_grad))


# Channel counts per head that users run (Cora's 8 heads x 8, OGB's 16-256, 40
# classes in an output layer): the compile budget's shapes (tests/test_triton_compile.py).
USER_CHANNELS = (8, 40, 64, 128, 256)


def default_cases() -> List[Case]:
    """The users' calls (each captured with every config of each row kernel's tuning space):
    every kind plain at each of :data:`USER_CHANNELS` in float32 and bfloat16; every
    combination of edge features and dropout (alpha returned with dropout) at C=64 in
    float32; each kind with everything (edge features, dropout, alpha) at 128 and 256
    channels, and at the other tile widths up to the largest the kernels take (float32); the
    plain call in float16 and float64 at 64; the input-space calls with dropout and alpha at
    128 and 256, and GAT's with inputs that need no gradient (a first layer's)."""
    cases = [Case(k, d, c, False, False, False) for k, d, c in
             itertools.product(KINDS + INPUT_KINDS, ("float32", "bfloat16"), USER_CHANNELS)]
    cases += [Case(k, "float32", 64, e, p, p) for k, e, p in
              itertools.product(KINDS, (False, True), (False, True)) if e or p]
    cases += [Case(k, "float32", c, True, True, True) for k, c in
              itertools.product(KINDS, (c for c in CHANNELS if c not in (8, 64)))]
    cases += [Case(k, d, 64, False, False, False) for k, d in
              itertools.product(KINDS, ("float16", "float64"))]
    cases += [Case(k, "float32", c, k == "gat_inputs", True, True) for k, c in
              itertools.product(INPUT_KINDS, (128, 256))]
    cases += [Case("gat_inputs", "float32", c, False, False, False, value_grad=False)
              for c in (8, 64, 256)]
    return cases


def capture_graph() -> Tuple[torch.Tensor, int]:
    """A graph whose destination and source schedules hold rows of 0..23 edges
    and split a hub (rows longer than ``internals.TRITON_SPLIT`` edges)."""
    g = torch.Generator().manual_seed(0)
    n = 64
    split = internals.TRITON_SPLIT
    hub_in = torch.stack([torch.randint(0, n, (2 * split + 5,), generator=g),
                          torch.zeros(2 * split + 5, dtype=torch.long)])
    hub_out = torch.stack([torch.ones(split + 3, dtype=torch.long),
                           torch.randint(0, n, (split + 3,), generator=g)])
    deg = torch.arange(2, n) % 24  # rows of 0..23 edges
    dst = torch.repeat_interleave(torch.arange(2, n), deg)
    src = torch.randint(0, n, (dst.numel(),), generator=g)
    return torch.cat([hub_in, hub_out, torch.stack([src, dst])], 1), n


def _case_tensors(case: Case, n: int, E: int):
    """``(score, value, value_edge, bias)`` of a case: GAT and GATv2 layers give the
    kernels their output bias (concatenated heads), the Transformer has none."""
    dt = DTYPES[case.dtype]
    H, C = case.heads, case.channels

    def r(*shape):
        return torch.randn(*shape, dtype=dt, requires_grad=True)

    edge = None
    if case.kind == "gat_inputs":
        if case.edge:
            edge = r(E, H)
        x = r(n, 1, C).requires_grad_(case.value_grad)
        return EdgeScore.gat(r(n, H), r(n, H), edge, 0.2), x, None, None
    if case.kind == "dot_inputs":
        x = r(n, 1, C)
        return EdgeScore.dot(r(n, H, C), x, None, C ** -0.5), x, None, None
    if case.kind == "gat":
        if case.edge:
            edge = r(E, H)
        score = EdgeScore.gat(r(n, H), r(n, H), edge, 0.2)
        value, value_edge = r(n, H, C), None
    elif case.kind == "gat_projected":
        if case.edge:
            edge = r(E, H)
        value, value_edge = r(n, H, C), None
        score = EdgeScore.gat_projected(value, r(H, C), r(H, C), edge, 0.2)
    elif case.kind == "gatv2":
        if case.edge:
            edge = r(E, H, C)
        x = r(n, H, C)
        score = EdgeScore.gatv2(x, r(n, H, C), r(H, C), edge, 0.2)
        value, value_edge = x, None  # GATv2Conv's values are its source projection
    else:
        if case.edge:
            edge = r(E, H, C)
        score = EdgeScore.dot(r(n, H, C), r(n, H, C), edge, C ** -0.5)
        value, value_edge = r(n, H, C), edge  # TransformerConv adds the edge term to values
        return score, value, value_edge, None
    return score, value, value_edge, r(H * C)


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
    """Inside: Triton's active driver is a stand-in NVIDIA GPU of compute
    capability ``arch`` (no GPU needed): its launch binder and compiler target
    that GPU; nothing can be launched or timed (its benchmarker runs a call once and
    times every config alike, and the row kernels' tuners keep nothing on disk)."""
    from triton.runtime import driver

    previous = driver._active  # None until first used: without a GPU it cannot be made
    driver.set_active(_Driver(arch))
    # the stand-in's "timings" must not reach Triton's autotune cache on disk, where a
    # real GPU of that capability would read them
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
        return (self.kernel, tuple(self.signature.items()), repr(sorted(self.constexprs.items(), key=str)),
                repr(sorted(self.attrs.items(), key=str)), repr(sorted(self.options.items())))

    def id(self) -> str:
        """What Triton compiles, as a short digest: the check's unit of comparison."""
        return hashlib.sha256(repr(self.key()).encode()).hexdigest()[:16]

    def specialised_ints(self) -> List[str]:
        """Integer arguments Triton specialised on their value (== 1, or divisible
        by 16): each new value of those compiles a new kernel."""
        fn = introspect.triton_kernels()[self.kernel]
        names = []
        for i, name in enumerate(fn.arg_names):
            if self.signature.get(name) in ("i32", "i64", "constexpr") and not name.isupper():
                if (i,) in self.constexprs or self.attrs.get((i,)):
                    names.append(name)
        return names

    def consts_label(self) -> str:
        names = {}
        fn = introspect.triton_kernels()[self.kernel]
        for k, v in self.constexprs.items():
            name = fn.arg_names[k[0]] if isinstance(k, tuple) else k
            if not name.isupper():
                continue  # arguments Triton fixed by value (absent pointers are never fixed)
            names[name] = v.__name__ if hasattr(v, "__name__") else str(v)
        return " ".join(f"{k}={v}" for k, v in names.items())


def capture(cases: Iterable[Case]) -> List[Spec]:
    """Run the dispatcher's forward and backward for each case through Triton's
    real binder; return the distinct specialisations it launches."""
    from triton import knobs

    ei, n = capture_graph()
    plan = GraphPlan(ei, num_nodes=n)
    E = ei.size(1)
    specs: Dict = {}
    current: List[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        c = compile
        options = {"num_warps": c["num_warps"], "num_stages": c["num_stages"],
                   "num_ctas": c["num_ctas"], "enable_fp_fusion": c["enable_fp_fusion"]}
        # a launch's register cap (ptxas .maxnreg) is an option the hook's arguments
        # leave out: read it from the options Triton serialised for the compile
        maxnreg = json.loads(c["specialization_data"])["options"].get("maxnreg")
        if maxnreg is not None:
            options["maxnreg"] = maxnreg
        spec = Spec(fn.name, dict(c["signature"]), dict(c["constants"]), dict(c["configs"][0]),
                    options)
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
                for tuned in internals.triton_tuners().values():  # each case binds its whole space
                    tuned.cache.clear()
                torch.manual_seed(0)
                score, value, value_edge, bias = _case_tensors(case, n, E)
                out, alpha = internals.triton_attention(score, value, plan, value_edge,
                                                          0.1 if case.dropout else 0.0, case.alpha,
                                                          bias)
                loss = out.float().sum() + (alpha.float().sum() if case.alpha else 0)
                loss.backward()
                if case.dropout:  # the mask the double backward regenerates
                    internals.dropout_keep_mask(plan, case.heads, 0.1,
                                                 internals.draw_dropout_seed(torch.device("cpu")))
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(specs.values())


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

    A pointer offset is safe at papers100M scale (E·H, N·H·C up to ~2**38) only
    if every product or sum that feeds it is computed in 64 bits. Flagged: an
    ``addptr`` whose offset is 32-bit and depends on a run-time value (an
    argument, a program id, a loaded index, a loop counter), and a 32-bit
    ``muli``/``addi``/``subi``/``shli`` of run-time values that is widened
    (``extsi``) into a 64-bit offset — it may have wrapped before the widening.
    Offsets made only of constants and ``tl.arange`` (bounded by constexprs)
    are fine in 32 bits. Loaded values are data: their own addresses are
    checked where they are loaded.
    """
    # MLIR numbers values per region: sibling regions (the loops of two inlined
    # calls of one jit function) reuse names. Each name is resolved in the scopes
    # open where it is used, innermost first, to a definition's line number.
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
    """``spec``'s Triton IR (the first stage of a compile; no LLVM or ptxas).
    ``fn`` is the jit function (default: the gatlib kernel named ``spec.kernel``)."""
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


_RESOURCES = re.compile(r"Used (\d+) registers.*")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# a vector load from global memory (64 or 128 bits), e.g. ld.global.v4.b32
_WIDE_LOAD = re.compile(r"ld\.global(?:\.\w+)*\.v[24]\.")
# an asynchronous copy from global to shared memory (a pipelined loop's loads), with
# its size in bytes: cp.async.cg.shared.global [ %r1 + 0 ], [ %rd2 + 0 ], 0x10, %r3
_ASYNC_COPY = re.compile(r"cp\.async\.c[ag]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*"
                         r"(0x[0-9a-fA-F]+|\d+)")


def compile_spec(spec: Spec, target: str) -> Dict:
    """Compile ``spec`` for ``target`` (``"sm_80"`` / ``"sm_90"``) to a cubin; returns
    seconds, registers per thread, spill stores/loads (bytes) and shared memory."""
    from triton import knobs
    from triton.compiler import ASTSource

    fn = introspect.triton_kernels()[spec.kernel]
    src = ASTSource(fn, spec.signature, spec.constexprs, spec.attrs)
    log = io.StringIO()
    start = time.perf_counter()
    with knobs.nvidia.scope(), knobs.compilation.scope():
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v: registers and spills
        knobs.compilation.always_compile = True
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=GPUTarget("cuda", TARGETS[target], 32),
                                    options=spec.options)
    seconds = time.perf_counter() - start
    text = log.getvalue()
    regs = _RESOURCES.search(text)
    spills = _SPILLS.search(text)
    if regs is None or spills is None or "cubin" not in kernel.asm:
        raise RuntimeError(f"{spec.kernel} for {target}: no ptxas report\n{text}")
    return {"target": target, "seconds": round(seconds, 2), "registers": int(regs.group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)),
            "shared_bytes": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
            "narrow_index_math": narrow_index_math(kernel.asm["ttir"]),
            "atomics": len(re.findall(r"tt\.atomic_\w+", kernel.asm["ttir"])),
            **_loads(kernel.asm["ptx"])}


# a 128-bit load from global memory: four 32-bit or two 64-bit words
_LOAD_128 = re.compile(r"ld\.global(?:\.\w+)*\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b")


def _loads(ptx: str) -> Dict[str, int]:
    """``wide_loads``: loads of 64 or 128 bits from global memory, into registers
    (``ld.global.v2/v4``) or into shared memory (``cp.async`` of 8 or 16 bytes);
    ``loads_128``: those of 128 bits; ``async_copies``: every ``cp.async`` (the
    pipelined loops' loads)."""
    copies = [int(n, 0) for n in _ASYNC_COPY.findall(ptx)]
    return {"wide_loads": len(_WIDE_LOAD.findall(ptx)) + sum(n >= 8 for n in copies),
            "loads_128": len(_LOAD_128.findall(ptx)) + sum(n == 16 for n in copies),
            "async_copies": len(copies)}


def _compile_job(args):
    spec, target = args
    try:
        return compile_spec(spec, target)
    except Exception as exc:  # reported, not raised: the table lists every failure
        return {"target": target, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def compile_all(specs: Sequence[Spec], targets: Sequence[str] = tuple(TARGETS),
                jobs: Optional[int] = None, progress=None) -> List[Dict]:
    """Compile every spec for every target in ``jobs`` processes; one row per pair."""
    work = [(s, t) for s in specs for t in targets]
    jobs = jobs or os.cpu_count() or 1
    rows = []
    with ProcessPoolExecutor(jobs) as pool:
        for (spec, _), res in zip(work, pool.map(_compile_job, work), strict=True):
            rows.append({"kernel": spec.kernel, "id": spec.id(), "constexprs": spec.consts_label(),
                         "maxnreg": spec.options.get("maxnreg"),
                         "signature": spec.signature, "specialised_ints": spec.specialised_ints(),
                         "cases": spec.cases, **res})
            if progress is not None:
                progress(rows[-1])
    return rows


# ---------------------------------------------------------------------------
# Is a table this checkout's?
# ---------------------------------------------------------------------------
# What a row holds that a compile of the same specialisation must reproduce.
COMPARED = ("registers", "spill_stores", "spill_loads", "shared_bytes", "num_warps",
            "narrow_index_math", "atomics", "wide_loads", "loads_128", "async_copies")


def kernels_digest() -> str:
    """sha256 of the file that holds the kernels' source (every jit function and helper)."""
    fn = next(iter(introspect.triton_kernels().values()))
    return hashlib.sha256(Path(inspect.getsourcefile(fn.fn)).read_bytes()).hexdigest()


def sample(specs: Sequence[Spec], per_kernel: int) -> List[Spec]:
    """``per_kernel`` specialisations of each kernel, evenly spaced in the order of their ids:
    the same choice on every run, spread over configs and calls."""
    out = []
    for kernel in sorted({s.kernel for s in specs}):
        mine = sorted((s for s in specs if s.kernel == kernel), key=Spec.id)
        step = max(1, len(mine) // per_kernel)
        out += mine[::step][:per_kernel]
    return out


def check(report: Dict, per_kernel: int = 2, jobs: Optional[int] = None) -> List[str]:
    """What makes ``report`` (a table this module wrote) not this checkout's: another Triton,
    another kernel source, other calls, specialisations the dispatcher launches now that it
    lacks (or holds and no longer launches), rows missing, or a sample that compiles now to
    other resources than the table says. Empty when the table stands for this checkout."""
    problems = []
    made = report["environment"]["versions"]["triton"]
    if made != triton.__version__:
        problems.append(f"the table was compiled by Triton {made}; this is {triton.__version__}")
    if report.get("kernels_sha256") != kernels_digest():
        problems.append("the kernels' source is not the one the table was compiled from")
    cases = default_cases()
    if report["cases"] != [c.label for c in cases]:
        problems.append("the table's calls are not default_cases()")
    specs = capture(cases)
    now, table = {s.id() for s in specs}, {s["id"] for s in report["specs"]}
    if now != table:
        problems.append(f"{len(now - table)} specialisations launched now are not in the table; "
                        f"{len(table - now)} of the table's are no longer launched")
    rows = {(r["id"], r["target"]): r for r in report["rows"]}
    missing = [(s, t) for s in report["specs"] for t in report["targets"] if (s["id"], t) not in rows]
    if missing:
        problems.append(f"{len(missing)} specialisations lack a row for a target")
    if problems:
        return problems
    for row in compile_all(sample(specs, per_kernel), report["targets"], jobs):
        old = rows[(row["id"], row["target"])]
        diff = {k: (old.get(k), row.get(k)) for k in COMPARED + ("error",) if old.get(k) != row.get(k)}
        if diff:
            problems.append(f"{row['kernel']} {row['target']} {row['constexprs']}: "
                            f"(table, now) {diff}")
    return problems


# ---------------------------------------------------------------------------
# Report and CLI
# ---------------------------------------------------------------------------
def summary_rows(rows: Sequence[Dict]) -> List[List[str]]:
    """Per kernel and target: specialisations, compiled, registers, spills, shared memory."""
    out = []
    for kernel in sorted({r["kernel"] for r in rows}):
        for target in TARGETS:
            rs = [r for r in rows if r["kernel"] == kernel and r["target"] == target]
            if not rs:
                continue
            ok = [r for r in rs if "error" not in r]
            regs = [r["registers"] for r in ok]
            spills = [r["spill_stores"] + r["spill_loads"] for r in ok]
            out.append([kernel, target, str(len(rs)), str(len(ok)),
                        f"{min(regs)}–{max(regs)}" if regs else "-",
                        f"{sum(s > 0 for s in spills)} (max {max(spills)} B)" if spills else "-",
                        f"{max(r['shared_bytes'] for r in ok)}" if ok else "-",
                        str(sum(bool(r.get("async_copies")) for r in ok)),
                        str(sum(bool(r.get("narrow_index_math")) for r in ok))])
    return out


SUMMARY_HEADERS = ["kernel", "target", "specialisations", "compiled", "registers",
                   "spilling (max bytes)", "max shared B", "pipelined", "32-bit index math"]


def render(report: Dict) -> str:
    from gatlib.bench.report import format_table

    rows = report["rows"]
    lines = [
        "# Triton kernels compiled for NVIDIA GPUs (no GPU needed)",
        "",
        f"Command: `{report['command']}`  ",
        f"Git: `{report['environment'].get('git_sha')}`, triton "
        f"{report['environment']['versions']['triton']}, "
        f"torch {report['environment']['versions']['torch']}; {report['seconds']:.0f} s on "
        f"{report['environment']['cpu_count']} cores of an {report['environment']['cpu_model']}. "
        f"{len(report['cases'])} dispatcher calls (forward and backward) gave "
        f"{len(report['specs'])} distinct specialisations, each bound by "
        "Triton's launch binder and compiled to a cubin by its bundled ptxas for every target.",
        "",
        format_table(SUMMARY_HEADERS, summary_rows(rows), align="<<" + ">" * 7, markdown=True),
        "",
        "## Every specialisation",
        "",
    ]
    detail = []
    for r in rows:
        res = (r["error"].splitlines()[0][:80] if "error" in r else
               f"{r['registers']} / {r['spill_stores']}+{r['spill_loads']} / {r['shared_bytes']}")
        detail.append([r["kernel"], r["target"], r["constexprs"], res, "; ".join(r["cases"][:2])
                       + (f" (+{len(r['cases']) - 2})" if len(r["cases"]) > 2 else "")])
    lines.append(format_table(["kernel", "target", "constexprs", "regs / spill B / shared B",
                               "first cases"], detail, align="<<<><", markdown=True))
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.triton_compile",
        description="Bind every specialisation of gatlib's Triton kernels with Triton's launch "
                    "binder and compile it for NVIDIA GPUs (no GPU needed).")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma-separated, of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPUs)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every result here")
    parser.add_argument("--table", default=None, metavar="PATH", help="write the markdown table here")
    parser.add_argument("--check", default=None, metavar="JSON",
                        help="exit 1 unless JSON (a table this command wrote) is this checkout's: "
                             "the same Triton and kernel source, the specialisations launched now, "
                             "and a sample that compiles again to the table's resources")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="only rewrite --table from a JSON this command wrote (no compiling)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from gatlib.bench.report import command_line, environment, write_json

    parser = _parser()
    args = parser.parse_args(argv)
    if args.check:
        with open(args.check) as f:
            problems = check(json.load(f), jobs=args.jobs)
        for line in problems:
            print(f"[triton_compile] {line}", file=sys.stderr)
        print(f"[triton_compile] {args.check}: " + ("stale: rebuild it with "
              "python -m tools.triton_compile --json JSON --table MD" if problems else
              "this checkout's (Triton, kernel source, specialisations, sampled compiles)"))
        return 1 if problems else 0
    if args.render:
        with open(args.render) as f:
            report = json.load(f)
        table = render(report)
        if args.table:
            with open(args.table, "w") as f:
                f.write(table)
        print(format_summary(report))
        return 0
    targets = [t for t in args.targets.split(",") if t]
    if not targets or any(t not in TARGETS for t in targets):
        parser.error(f"--targets: choose from {', '.join(TARGETS)}; got {args.targets!r}")
    cases = default_cases()
    start = time.perf_counter()
    specs = capture(cases)
    print(f"[triton_compile] {len(cases)} calls -> {len(specs)} specialisations "
          f"({time.perf_counter() - start:.1f} s); compiling for {', '.join(targets)}",
          file=sys.stderr, flush=True)
    done = [0]

    def progress(row):
        done[0] += 1
        if "error" in row or done[0] % 100 == 0:
            print(f"[triton_compile] {done[0]}/{len(specs) * len(targets)} "
                  + (f"FAILED {row['kernel']} {row['constexprs']}: {row['error'][:300]}"
                     if "error" in row else "compiled"), file=sys.stderr, flush=True)

    rows = compile_all(specs, targets, args.jobs, progress)
    report = {"schema": "gatlib.triton_compile/1", "command": command_line(),
              "environment": environment("cpu"), "targets": targets,
              "seconds": round(time.perf_counter() - start, 1),
              "kernels_sha256": kernels_digest(),
              "cases": [c.label for c in cases], "user_channels": list(USER_CHANNELS),
              "specs": [{"kernel": s.kernel, "id": s.id(), "constexprs": s.consts_label(),
                         "cases": s.cases}
                        for s in specs],
              "rows": rows}
    table = render(report)
    print(format_summary(report))
    if args.json:
        write_json(args.json, report)
    if args.table:
        with open(args.table, "w") as f:
            f.write(table)
    failed = sum("error" in r or bool(r.get("narrow_index_math")) for r in rows)
    return 1 if failed else 0


def format_summary(report: Dict) -> str:
    from gatlib.bench.report import format_table

    return format_table(SUMMARY_HEADERS, summary_rows(report["rows"]), align="<<" + ">" * 7)


if __name__ == "__main__":
    sys.exit(main())
