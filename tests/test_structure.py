"""Architecture rules: each piece of attention maths in its one home; no import cycles; the
library imports nothing from the benchmark harness, and the package nothing from the
developer instruments (tools/, not installed); kernels read the score's kind, not its
class; provenance and result files are written in one place; the harness, tools/ and
benchmarks/ use public names only (gatlib.introspect for the kernels; tools/internals.py
alone reads the private modules), and benchmarks/
imports nothing from tools/."""
import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

import gatlib

PKG = Path(gatlib.__file__).parent
ROOT = PKG.parent
# The developer instruments: a package of the checkout beside gatlib, not installed;
# held to the harness's rules.
TOOLS = ROOT / "tools"
KERNELS = {"_fused_cpu.py", "_cpu_passes.py", "_blocks.py", "_native.py", "_triton.py",
           "_triton_kernels.py", "_triton_schedule.py"}

# Where each piece of the attention maths lives: {what: (pattern, {file: functions or
# classes it may sit in})}. Matched on code only (strings and comments blanked out).
# The Triton kernels cannot call Python: their own copies of the formulas sit in
# the jit functions named, which tests hold to the reference.
HOMES = {
    "a score formula": (
        r"leaky_relu|\*\s*slope\b|\bslope\s*\*|\*\s*(self\.)?att\b|"
        r"\(\s*\w*(query|q)\w*\s*\*\s*\w*(key|k)\w*\s*\)\.sum|\(\s*\w*(key|k)\w*\s*\*\s*\w*(query|q)\w*\s*\)\.sum",
        {"_scores.py": None, "_triton_kernels.py": {"_score", "_bwd_dst_kernel", "_bwd_src_kernel"}}),
    "a softmax": (
        r"\bsoftmax\(|\.softmax\(|\.exp_?\(|\bexp\(|logsumexp|def \w*softmax",
        {"_core.py": {"segment_softmax", "reference_attention"},
         "_fused_cpu.py": {"_recomputed_alpha", "_softmax_aggregate", "_softmax_aggregate_backward"},
         "_triton_kernels.py": {"_fwd_kernel", "_alpha_kernel", "_merge_kernel", "_bwd_dst_kernel"}}),
    "a segment reduction": (
        r"scatter_reduce|index_add|segment_reduce|(import|from) torch_scatter|segment_sum",
        {"_core.py": {"segment_reduce", "segment_softmax", "segment_aggregate"},
         "_dispatch.py": {"_torch_scatter_reduce", "_scatter_aggregate", "ScatterKernel"},
         "_blocks.py": {"add_row_sums"}, "_cpu_passes.py": {"gat_cpu_backward"},
         "_triton.py": {"_backward"}}),
}
# The one tool that writes a layer out on purpose: tools/cut_terms.py cuts the gradient
# through one term of GAT's score, or its value, on a class of edges, which no backend
# offers; it reports its written-out output layer against gatlib's before any cut.
WRITTEN_OUT = {"cut_terms.py": {"grad_h1"}}


def code_lines(src):
    """``[(line number, code)]`` of module source ``src`` with its strings and
    comments blanked out."""
    chars = [list(line) for line in src.splitlines()]
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == FSTRING_MIDDLE:
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                row = chars[r - 1]
                a, b = (c0 if r == r0 else 0), (c1 if r == r1 else len(row))
                row[a:b] = " " * (b - a)
    return [(no, "".join(row)) for no, row in enumerate(chars, 1)]


FSTRING_MIDDLE = getattr(tokenize, "FSTRING_MIDDLE", -1)


def enclosing(src):
    """``{line number: name of the innermost function or class around it}``."""
    out = {}

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for no in range(child.lineno, child.end_lineno + 1):
                    out[no] = child.name
            visit(child)

    visit(ast.parse(src))
    return out


def misplaced_maths(modules, folder="gatlib"):
    """Lines of ``modules`` (``{name relative to folder: source}``) that hold
    attention maths outside its home (:data:`HOMES`: all in gatlib/; in tools/ only
    the functions of :data:`WRITTEN_OUT`)."""
    offenders = []
    for name, src in modules.items():
        where = enclosing(src)
        for no, code in code_lines(src):
            for what, (pattern, homes) in HOMES.items():
                if not re.search(pattern, code):
                    continue
                home = homes.get(name, False) if folder == "gatlib" else WRITTEN_OUT.get(name, False)
                if home is None or (home and where.get(no) in home):
                    continue
                offenders.append(f"{what} at {folder}/{name}:{no} (in {where.get(no)}): {code.strip()}")
    return offenders


def package_sources():
    return {str(p.relative_to(PKG)): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def tool_files():
    return sorted(TOOLS.glob("*.py"))


def modules():
    """{dotted module name: path} of every module in the package and in tools/."""
    out = {}
    for path in [*sorted(PKG.rglob("*.py")), *tool_files()]:
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name, path, mods):
    """Package modules imported anywhere in ``path`` (function-level imports too)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in mods else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in mods and m != name}


def test_attention_maths_only_in_its_home():
    """Each score formula, the softmax and its segment reductions are written once,
    in their home (:data:`HOMES`); everything else calls them."""
    offenders = misplaced_maths(package_sources())
    offenders += misplaced_maths({p.name: p.read_text() for p in tool_files()}, "tools")
    assert not offenders, "attention maths outside its home:\n" + "\n".join(offenders)


PASTES = {  # (module, code appended to it, how many of its lines must be flagged)
    "a GAT score in a layer": ("layers.py", "def edge_update(a_j, a_i, slope):\n"
                               "    return F.leaky_relu(a_j + a_i, slope)\n", 1),
    "a dot score in a layer": ("layers.py", "def message(query_i, key_j):\n"
                               "    return (query_i * key_j).sum(-1)\n", 1),
    "a GATv2 score in the CPU kernel": ("_fused_cpu.py", "def _softmax_aggregate(z, att, slope):\n"
                                       "    return (torch.where(z > 0, z, z * slope) * att).sum(-1)\n", 1),
    "a LeakyReLU in the Triton host code": ("_triton_schedule.py", "def _launch(z, slope):\n"
                                            "    return tl.where(z > 0, z, z * slope)\n", 1),
    "a LeakyReLU in a Triton kernel's helper": ("_triton_kernels.py", "def _lanes(z, slope):\n"
                                                "    return tl.where(z > 0, z, z * slope)\n", 1),
    "a softmax in a layer": ("layers.py", "def weights(e):\n    return e.exp_() / e.sum()\n", 1),
    "PyG's softmax in a layer": ("layers.py", "def weights(e, index):\n"
                                 "    return softmax(e, index)\n", 1),
    "a segment sum in the CPU kernel": ("_fused_cpu.py", "def _softmax_aggregate(x, index, out):\n"
                                        "    return out.index_add_(0, index, x)\n", 1),
    "a score formula in its home": ("_scores.py", "def gat_edge_again(z, slope):\n"
                                    "    return F.leaky_relu(z, slope)\n", 0),
}


def test_the_home_check_sees_maths_in_tools():
    """In tools/ too, and outside the one function that writes a layer out on purpose."""
    cut_terms = (TOOLS / "cut_terms.py").read_text()
    paste = "def grad_again(z, slope, index):\n    return softmax(F.leaky_relu(z, slope), index)\n"
    assert not misplaced_maths({"cut_terms.py": cut_terms}, "tools")
    assert len(misplaced_maths({"cut_terms.py": cut_terms + paste}, "tools")) == 2
    assert len(misplaced_maths({"launches.py": paste}, "tools")) == 2


@pytest.mark.parametrize("case", PASTES)
def test_the_home_check_sees_pasted_maths(case):
    """The check above can fail: each paste appended to the real module is flagged
    (and one into the home is not)."""
    name, code, flagged = PASTES[case]
    src = (PKG / name).read_text()
    found = misplaced_maths({name: src + "\n\n" + code})
    assert len(found) == flagged, found


def test_layers_and_reference_score_with_the_home_formulas():
    """The reference (EdgeScore.edge_scores) and the layers' propagate path call
    each kind's formula in gatlib._scores, and no score formula is defined elsewhere."""
    formulas = {"gat_edge", "gatv2_edge", "dot_edge"}
    for name in ("_core.py", "layers.py"):
        called = {n.func.attr for n in ast.walk(ast.parse((PKG / name).read_text()))
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert formulas <= called, (name, formulas - called)
    defined = {(p.name, n.name) for p in PKG.rglob("*.py")
               for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.FunctionDef) and n.name in formulas}
    assert defined == {("_scores.py", f) for f in formulas}, defined


def test_the_reference_imports_no_kernel_code():
    """The specification (the core, the score formulas) and everything it imports, however
    indirectly, hold no kernel module: the reference runs where no kernel can, and a kernel
    is tested against it, never the other way round."""
    mods = modules()
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    kernels = {f"gatlib.{Path(k).stem}" for k in KERNELS} | {"gatlib._dispatch"}
    assert kernels <= set(mods), kernels - set(mods)
    for ref in ("gatlib._core", "gatlib._scores"):
        seen, todo = set(), [ref]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert not seen & kernels, (ref, sorted(seen & kernels))


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    for m in mods:  # a package's __init__ re-exporting its submodules is not a cycle
        if mods[m].name == "__init__.py":
            graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    cycles = []

    def visit(node, stack):
        for nxt in graph[node]:
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack + [nxt])
        done.add(node)

    done = set()
    for m in graph:
        if m not in done:
            visit(m, [m])
    assert not cycles, cycles


def _is_tool(module: str) -> bool:
    return module == "tools" or module.startswith("tools.")


def _is_harness(module: str) -> bool:
    return module.startswith("gatlib.bench") or _is_tool(module)


def forbidden_imports(mods):
    """``{module: [what it must not import]}``: the library (gatlib outside gatlib/bench)
    imports neither the harness nor tools/; the harness does not import tools/ either
    (it is installed, tools/ is not). tools/ may import both."""
    out = {}
    for m, p in mods.items():
        if _is_tool(m):
            out[m] = []
            continue
        bad = _is_tool if m.startswith("gatlib.bench") else _is_harness
        out[m] = sorted(t for t in imports(m, p, mods) if bad(t))
    return out


@pytest.mark.slow
def test_library_does_not_import_the_harness():
    mods = modules()
    library = {m for m in mods if not _is_harness(m)}
    assert library >= {"gatlib", "gatlib.layers", "gatlib.models", "gatlib._core",
                       "gatlib._dispatch", "gatlib._fused_cpu", "gatlib._plan"}
    assert {"gatlib.bench.cli", "tools", "tools.launches", "tools.triton_compile"} <= set(mods)
    offenders = forbidden_imports(mods)
    assert not any(offenders.values()), {m: t for m, t in offenders.items() if t}
    # and at run time: using the library loads no harness or tools module
    code = ("import sys, torch, gatlib, gatlib.models; "
            "x = torch.randn(4, 3); gatlib.GATConv(3, 2)(x, torch.tensor([[0, 1], [1, 2]])); "
            "print(sorted(m for m in sys.modules if m.startswith(('gatlib.bench', 'tools'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env)  # (tools/ importable, so that a stray import would load it)
    assert out.stdout.strip() == "[]", out.stdout


IMPORT_PROBES = {  # (module, source): what forbidden_imports must report
    ("gatlib._probe", "from tools.launches import Tally"): ["tools.launches"],
    ("gatlib._probe", "import tools"): ["tools"],
    ("gatlib._probe", "from .bench import report"): ["gatlib.bench.report"],
    ("gatlib._probe", "from gatlib.bench.compare import build_pair"): ["gatlib.bench.compare"],
    ("gatlib.bench._probe", "from tools import triton_compile"): ["tools.triton_compile"],
    ("gatlib.bench._probe", "from . import report"): [],
    ("tools._probe", "from gatlib.bench import report\nfrom tools import launches"): [],
}


@pytest.mark.parametrize("probe", IMPORT_PROBES, ids=lambda p: f"{p[0]}: {p[1]}")
def test_the_import_rule_sees_the_harness_and_tools(probe, tmp_path):
    """The rule above can fail: a module of each part importing what it must not is flagged,
    relative imports included, and what it may import is not."""
    name, source = probe
    path = tmp_path / "_probe.py"
    path.write_text(source + "\n")
    found = forbidden_imports({**modules(), name: path})[name]
    assert found == IMPORT_PROBES[probe], found


def test_kernels_do_not_import_the_switch():
    mods = modules()
    for name in KERNELS:
        mod = f"gatlib.{name[:-3]}"
        assert "gatlib._dispatch" not in imports(mod, mods[mod], mods), mod


def test_kernels_read_the_score_kind_not_its_class():
    """One score type: no isinstance/type dispatch on score classes anywhere."""
    offenders = []
    for path in [*sorted(PKG.rglob("*.py")), *tool_files()]:
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"(isinstance\(|type\()[^)]*Score", code):
                offenders.append(f"{path.name}:{no}: {line.strip()}")
    assert not offenders, offenders


def test_provenance_and_tables_are_written_once():
    """Git commit, library versions, result JSON and tables come from
    gatlib/bench/report.py: no other module of the package, tool or benchmark
    script computes them again."""
    pattern = re.compile(r"rev-parse|importlib\.metadata|platform\.python_version|"
                         r"def (environment|write_json|format_table)\b")
    files = [*PKG.rglob("*.py"), *tool_files(), *(ROOT / "benchmarks").glob("*.py")]
    assert {"launches.py", "triton_compile.py"} <= {p.name for p in tool_files()}
    offenders = [f"{path.relative_to(ROOT)}:{no}"
                 for path in files if path.name != "report.py"
                 for no, line in enumerate(path.read_text().splitlines(), 1)
                 if pattern.search(line.split("#", 1)[0])]
    assert not offenders, offenders
    assert (PKG / "bench" / "report.py").exists()


# The private torch API the library uses, each for a question torch answers publicly
# nowhere; docs/compile.md lists them with the reasons. Anything else fails.
PRIVATE_TORCH_API = {
    "torch._C._are_functorch_transforms_active": "_dispatch.py",
    "torch._C._functorch.get_interpreter_stack": "_dispatch.py",
    "_current_level": "_dispatch.py",  # torch.autograd.forward_ad's
    "torch._assert_async": "_validate.py",
    "torch.nn.modules.module._global_forward_hooks": "_conv.py",
    "torch.nn.modules.module._global_forward_pre_hooks": "_conv.py",
    "torch.nn.modules.module._global_backward_hooks": "_conv.py",
    "torch.nn.modules.module._global_backward_pre_hooks": "_conv.py",
}


def test_private_torch_api_only_where_listed():
    """In the library; the benchmark harness (gatlib/bench) and the developer
    instruments (tools/, outside the package) may read dynamo's counters and
    Triton's and torch's internals."""
    found = set()
    for path in sorted(p for p in PKG.rglob("*.py") if "bench" not in p.relative_to(PKG).parts):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for name in re.findall(r"torch(?:\.\w+)*\._(?!_)\w+(?:\.\w+)*|\b_current_level\b", code):
                found.add(name)
                assert PRIVATE_TORCH_API.get(name) == path.name, \
                    f"{path.relative_to(ROOT)}:{no}: private torch API {name} is not listed"
    assert found == set(PRIVATE_TORCH_API)  # (and the list holds nothing that is gone)
    doc = (ROOT / "docs" / "compile.md").read_text()
    assert all(name.split(".")[-1] in doc for name in PRIVATE_TORCH_API)


# ---------------------------------------------------------------------------
# Public names only outside the library
# ---------------------------------------------------------------------------
# The one tool that reads gatlib's private modules, for the other tools and the tests: the
# kernels' internals that no user command needs (the wheel's gatlib.introspect stays small).
# tools/ is developer-only and not installed; the package never imports it (above).
INTERNALS = TOOLS / "internals.py"
HARNESS = [*sorted((PKG / "bench").glob("*.py")), *(p for p in tool_files() if p != INTERNALS),
           *sorted((ROOT / "benchmarks").glob("*.py"))]
# The packages whose private names the harness, tools/ and benchmarks/ must not use
# (tools/ is harness too: one tool does not read another's internals).
OURS = ("gatlib", "tools")
# getattr-like calls whose string argument names an attribute
ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr", "object"}  # (mock.patch.object)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def library_private_names():
    """The private names the library defines: functions, classes and methods,
    module-level names, and attributes it assigns (``self._layout = ...``)."""
    names = set()
    for path in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
        names.add(path.stem)
    return {n for n in names if _private(n)}


def _root(node):
    """The name an attribute chain, call or subscript starts from (or None)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(rel: str, source: str, library_private) -> list:
    """Where ``source``, of ``rel`` (a module of gatlib/bench or tools/, or a script of
    benchmarks/), uses a private name of gatlib or tools: imports a private module or name
    (``from gatlib._x import``, ``from gatlib import _x``, ``import gatlib._x``,
    ``from .._x import``, ``from .mod import _name``, ``from tools.mod import _name``),
    reads a private attribute of a gatlib or tools module (``_triton.x``,
    ``measure._child_env``, ``launches._StandInBinary``) or a private name the
    library defines on any object that is not another package's (``plan._layout``,
    ``getattr(m, "_space")``); or, in benchmarks/, imports another script or tools/ (a
    table's reproducer needs the package only)."""
    tree = ast.parse(source)
    package = {"gatlib/bench/": "gatlib.bench", "tools/": "tools"}.get(rel.rpartition("/")[0] + "/")
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} | {"benchmarks"}
    gatlib_names, foreign_names, found = set(), {"self", "cls"}, []

    def flag(node, what):
        found.append(f"{rel}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                bound = a.asname or parts[0]
                if parts[0] in OURS:
                    gatlib_names.add(bound)
                    if any(map(_private, parts)):
                        flag(node, f"import {a.name}")
                else:
                    foreign_names.add(bound)
                if package is None and parts[0] in scripts:
                    flag(node, f"a script imports another script: import {a.name}")
                if package is None and parts[0] == "tools":
                    flag(node, f"a script imports tools/: import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert package, f"{rel}: a relative import outside gatlib/bench and tools/"
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            parts = module.split(".")
            bound = {a.asname or a.name for a in node.names}
            if package is None and parts[0] in scripts:
                flag(node, f"a script imports another script: from {module} import ...")
            if package is None and parts[0] == "tools":
                flag(node, f"a script imports tools/: from {module} import ...")
            if parts[0] not in OURS:
                foreign_names |= bound
                continue
            gatlib_names |= bound
            if any(map(_private, parts)) or any(_private(a.name) for a in node.names):
                flag(node, f"from {module} import {', '.join(a.name for a in node.names)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node.value)
            if root in gatlib_names or (node.attr in library_private and root not in foreign_names):
                flag(node, f"private attribute: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))
              and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) in ATTRIBUTE_CALLS
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in library_private):
            flag(node, f"private attribute by name: {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def test_the_harness_and_benchmarks_use_public_names_only():
    """gatlib/bench, tools/ and benchmarks/ see the library as its users do — gatlib,
    gatlib.layers, gatlib.models — plus the kernels' documented introspection
    surface, gatlib.introspect; no script imports another script's helper or a tool,
    no harness module or tool another's private name. (The library's internals stay free
    to change; tests/ may look inside.)"""
    library_private = library_private_names()
    assert {"tools/launches.py", "tools/triton_compile.py"} <= {p.relative_to(ROOT).as_posix() for p in HARNESS}
    assert {"_layout", "_triton", "_dispatch", "_SPLIT", "_check_interpreter"} <= library_private
    offenders = [f for path in HARNESS
                 for f in private_uses(path.relative_to(ROOT).as_posix(), path.read_text(), library_private)]
    assert not offenders, "private gatlib names outside the library:\n" + "\n".join(offenders)


def test_only_the_internals_tool_reads_the_librarys_internals():
    """tools/internals.py reads gatlib's private modules and imports no other tool; the
    rule above holds every other tool to public names (it flags this one)."""
    source = INTERNALS.read_text()
    assert private_uses("tools/probe.py", source, library_private_names())
    tree = ast.parse(source)
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and _is_tool(m) for m in imported), imported


def test_the_private_name_rule_catches_each_form():
    """The rule above, on one line of each form it must flag (in gatlib/bench, tools/
    and benchmarks/; a benchmarks/ script importing tools/ too), and on what they may
    use: the private names of other packages, a tool's public name from another tool,
    the harness from a script."""
    library_private = library_private_names()
    bench, benchmarks, tool = "gatlib/bench/probe.py", "benchmarks/probe.py", "tools/probe.py"
    flagged = {
        "from gatlib._triton import attention": bench,
        "from gatlib import _triton": bench,
        "import gatlib._plan": bench,
        "from .. import _dispatch": bench,
        "from .._plan import GraphPlan": bench,
        "from .compare import _helper": bench,
        "from . import measure\nmeasure._child_env()": bench,
        "import gatlib\ngatlib._triton.attention": bench,
        "plan = make()\nplan._layout = None": benchmarks,
        "x = getattr(m, '_space')": benchmarks,
        "import plan_cost": benchmarks,
        "from per_batch import main": benchmarks,
        "from gatlib._plan import GraphPlan": tool,
        "from gatlib.bench.compare import _helper": tool,
        "from tools.triton_compile import _case_tensors": tool,
        "from .triton_compile import _case_tensors": tool,
        "from tools import launches\nlaunches._StandInBinary": tool,
        "import tools.launches\ntools.launches._LOOK_INSIDE": tool,
        "from tools import launches\nlaunches.triton_on_cpu": benchmarks,
        "from tools.triton_compile import capture": benchmarks,
        "import tools.launches": benchmarks,
        "from gatlib import introspect\nintrospect._triton": tool,
    }
    allowed = {"import torch\ntorch._dynamo.reset()": bench,
               "from torch._dynamo.utils import counters": bench,
               "from triton.runtime import driver\ndriver._active = None": bench,
               "def f(func):\n    return func._schema.name": bench,
               "from gatlib import introspect\nintrospect.triton_kernels": bench,
               "from tools import internals\ninternals.TRITON_SPLIT": tool,
               "from .compare import with_self_loops": bench,
               "from torch._library.custom_ops import OPDEFS\nOPDEFS[n]._init_fn": tool,
               "from gatlib.bench.compare import with_self_loops": tool,
               "from tools.triton_compile import stand_in_driver": tool,
               "from .triton_compile import stand_in_driver": tool,
               "from tools import launches\nlaunches.triton_on_cpu": tool,
               "from gatlib.bench import synthetic": benchmarks}
    for expected, cases in ((True, flagged), (False, allowed)):
        for code, where in cases.items():
            found = private_uses(where, code, library_private)
            assert bool(found) == expected, (code, where, found)


def test_only_the_plan_module_touches_the_plans_internals():
    """GraphPlan's private attributes and methods are read or written only in
    gatlib/_plan.py (the rest of the library calls its functions); other
    objects' own ``self._x`` of the same names are theirs."""
    tree = ast.parse((PKG / "_plan.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GraphPlan")
    internals = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and _private(n.attr)}
    internals |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and _private(n.name)}
    assert {"_layout", "_base_ei", "_owned", "_derived"} <= internals
    offenders = [f"{path.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}"
                 for path in [*sorted(PKG.rglob("*.py")), *tool_files()] if path.name != "_plan.py"
                 for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Attribute) and n.attr in internals
                 and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]
    assert not offenders, "GraphPlan's internals outside gatlib/_plan.py:\n" + "\n".join(offenders)


# A timing or a run's history in the package's text: "12.6 ms", "3x faster", "measured 4".
_DIARY = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|µs|us|ns)\b|\d+(?:\.\d+)?x faster|NOTES\.md"
                    r"|measured \d")


def diary_lines(src):
    """(line, text) of ``src``'s comments and strings that carry a timing or point into a
    lab notebook."""
    return [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type in (tokenize.COMMENT, tokenize.STRING) and _DIARY.search(t.string)]


def test_package_text_says_why_without_timings():
    """The package's comments and docstrings say why; measurements live in results JSON and
    decisions in docs/design.md (no lab notebook: benchmarks/NOTES.md is gone)."""
    root = Path(gatlib.__file__).parent
    found = [(str(p.relative_to(root)), line) for p in sorted(root.rglob("*.py"))
             for line, _ in diary_lines(p.read_text())]
    assert not found, found
    assert not (root.parent / "benchmarks" / "NOTES.md").exists()
    assert diary_lines("x = 1  # the forward took 12.6 ms\n")
    assert diary_lines('"""see benchmarks/NOTES.md"""\n')
    assert not diary_lines("x = 1  # one program per row\n")
