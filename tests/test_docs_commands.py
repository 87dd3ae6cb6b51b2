"""The commands the README and the docs show still work as written, at least as far as their
argument parsing: every ``gatlib ...`` (also ``.venv/bin/gatlib``, under ``torchrun
--no-python``), ``python -m gatlib.bench.X ...``, ``python -m tools.X ...`` and
``python benchmarks/X.py ...`` command parses with its program's real argparse parser, without
running the job. Also: the README's test command is the one CI runs, the README stays short and
names no commit hash, and relative links resolve.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
# The docs with results tables, whose reproduce commands name benchmarks/' scripts.
RESULTS = {"README.md", "docs/benchmarks.md", "docs/distributed.md", "docs/gpu.md"}
# Placeholders in commands, as `selftest_<gpu>.json`: a concrete value to parse with.
PLACEHOLDERS = {"gpu": "h100"}
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {"&&", "||", ";", "|", "&"}
PROGRAM_START = re.compile(r"\s*([A-Za-z_]\w*=\S*\s+)*(\S*/)?(gatlib|python3?|torchrun|bash|pip)\s")
# A commit hash: 7 to 40 hex digits, at least one a decimal digit (so plain words such as
# "defaced" do not count), not part of a longer word.
COMMIT_HASH = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")


class Command(NamedTuple):
    doc: str        # the file it is in, relative to the repository
    text: str       # the command as written (continuations joined)
    program: str    # "gatlib", "gatlib.bench.compare", "benchmarks/per_batch.py", ...
    argv: List[str]

    def __str__(self):
        return f"{self.doc}: {self.text}"


def shell_snippets(markdown: str) -> List[Tuple[str, bool]]:
    """(text, fenced) for each line of a shell code block (backslash continuations joined) and
    each inline code span of ``markdown``."""
    out = []
    for lang, body in FENCE.findall(markdown):
        if lang in SHELL_LANGS:
            out += [(line, True) for line in body.replace("\\\n", " ").splitlines() if line.strip()]
    prose = FENCE.sub("", markdown)
    out += [(span.replace("\n", " "), False) for span in re.findall(r"`([^`]+)`", prose)]
    return out


def split_commands(snippet: str) -> List[List[str]]:
    """The simple commands of a shell line (split at ``&&``, ``;``, ``|``, ...), as words, with
    placeholders filled in and comments dropped."""
    snippet = re.sub(r"<(\w+)>", lambda m: PLACEHOLDERS.get(m.group(1), "x"), snippet)
    lexer = shlex.shlex(snippet, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, words = [], []
    for word in lexer:
        if word in OPERATORS:
            commands.append(words)
            words = []
        else:
            words.append(word)
    return [c for c in commands + [words] if c]


def invocation(words: List[str]) -> Optional[Tuple[str, List[str]]]:
    """(program, argv) when ``words`` run gatlib, a gatlib.bench module, a developer instrument
    (``tools.X``) or a benchmark script, a shell script or pytest; else None."""
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if not words or words[0].endswith("/"):  # a folder in a file tree, not a program
        return None
    head, args = Path(words[0]).name, words[1:]
    if head == "compute-sanitizer":  # its options (--name=value), then the program it runs
        while args and args[0].startswith("-"):
            args = args[1:]
        return invocation(args)
    if head == "torchrun":
        return invocation(args[args.index("--no-python") + 1:]) if "--no-python" in args else None
    if head == "gatlib":
        return "gatlib", args
    if head == "bash" and args and args[0].endswith(".sh"):
        return args[0], args[1:]
    if head == "pip" or re.fullmatch(r"python3?", head) and args[:2] == ["-m", "pip"]:
        args = args if head == "pip" else args[2:]
        return ("pip", args[1:]) if args[:1] == ["install"] else None
    if re.fullmatch(r"python3?", head):
        if args[:1] == ["-m"] and len(args) > 1 and (args[1] == "pytest"
                                                     or args[1].startswith(("gatlib.", "tools."))):
            return args[1], args[2:]
        if args and args[0].startswith("benchmarks/") and args[0].endswith(".py"):
            return args[0], args[1:]
    return None


def doc_commands(path: Path) -> List[Command]:
    """Every command of one Markdown file that :func:`invocation` recognises. An inline code
    span without an option that runs ``gatlib`` (``gatlib bench`` in a sentence) names the
    command rather than showing one."""
    doc = str(path.relative_to(ROOT))
    found = []
    for snippet, fenced in shell_snippets(path.read_text()):
        mention = not fenced and not re.search(r"(^|\s)--?\w", snippet)
        try:
            commands = split_commands(snippet)
        except ValueError:  # unbalanced quotes: prose or Python such as `PyG's`, not a command
            assert not PROGRAM_START.match(snippet), f"{doc}: cannot split {snippet!r}"
            continue
        for words in commands:
            inv = invocation(words)
            if inv is not None and not (mention and inv[0].startswith(("gatlib", "tools.", "pytest"))):
                found.append(Command(doc, snippet.strip(), *inv))
    return found


COMMANDS = [c for path in DOCS for c in doc_commands(path)]


def has_parser(program: str) -> bool:
    return (program == "gatlib" or program.startswith(("gatlib.bench.", "tools."))
            or program.startswith("benchmarks/") and program.endswith(".py"))


def _script(path: str):
    """A benchmarks/ script imported from its file (benchmarks/ is not a package; its scripts
    import the package only: tests/test_structure.py)."""
    name = "_docs_" + Path(path).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def parser_for(program: str, argv: List[str]) -> argparse.ArgumentParser:
    """The real parser of ``program``, built without running anything."""
    if program in ("gatlib", "gatlib.bench.cli"):
        from gatlib.bench import cli

        return cli._parser(argv)
    if program in ("gatlib.bench.compare", "gatlib.bench.selftest"):
        parser = argparse.ArgumentParser(prog=f"python -m {program}")
        importlib.import_module(program).add_arguments(parser)
        return parser
    if program.startswith("tools."):  # (the repository root is on sys.path: conftest)
        module = importlib.import_module(program)
        return (module._parser if hasattr(module, "_parser") else module.build_parser)()
    if program.startswith("benchmarks/") and program.endswith(".py"):
        return _script(program).build_parser()
    raise AssertionError(f"no parser known for {program}: add it to parser_for")


@functools.lru_cache(maxsize=None)
def _parse_triton_compile(argv: Tuple[str, ...]) -> Optional[str]:
    """argparse's error for ``python -m tools.triton_compile`` with ``argv``, or None."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = "import sys; from tools.triton_compile import _parser; _parser().parse_args(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return proc.stderr if proc.returncode else None


def parse(command: Command) -> Optional[argparse.Namespace]:
    """``command``'s arguments parsed by its program's parser; a parse error fails with
    argparse's message."""
    if command.program == "tools.triton_compile":
        # It refuses to be imported under TRITON_INTERPRET=1 (conftest sets it): parse in a
        # process of its own.
        error = _parse_triton_compile(tuple(command.argv))
        if error is not None:
            pytest.fail(f"{command}\ndoes not parse:\n{error}")
        return None
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser_for(command.program, command.argv).parse_args(command.argv)
    except SystemExit:
        pytest.fail(f"{command}\ndoes not parse:\n{stderr.getvalue()}")


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in COMMANDS if has_parser(c.program)], ids=str)
def test_command_parses(command):
    args = parse(command)
    if command.program in ("gatlib", "gatlib.bench.cli") and args.command == "bench":
        from gatlib.bench.cli import _bench_options

        # The option checks `gatlib bench` makes before loading any data.
        assert _bench_options(args) is None, f"{command}: {_bench_options(args)}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.program.endswith(".sh")], ids=str)
def test_shell_script_exists(command):
    assert (ROOT / command.program).is_file(), f"{command}: no {command.program}"
    if command.program == "benchmarks/run_accuracy.sh":  # its arguments: dataset:model jobs
        from gatlib.bench.data import DATASETS
        from gatlib.bench.recipes import MODELS

        for job in command.argv:
            dataset, _, model = job.partition(":")
            assert dataset in DATASETS and model in MODELS, f"{command}: no job {job}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.program == "pytest"], ids=str)
def test_pytest_paths_exist(command):
    # (the values of pytest's options that take one, as -m "not slow" or xdist's -n auto, are
    # not paths)
    argv = command.argv
    paths = [a.split("::")[0] for i, a in enumerate(argv)
             if not a.startswith("-") and (i == 0 or argv[i - 1] not in ("-m", "-k", "-p", "-n"))]
    assert all((ROOT / p).exists() for p in paths), f"{command}: a path does not exist"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.program == "pip"], ids=str)
def test_pip_extras_exist(command):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for arg in command.argv:
        match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
        if match and match.group(1):
            assert set(match.group(1).split(",")) <= extras, f"{command}: unknown extra"


def test_commands_are_found():
    """The extraction finds what the docs show, so the tests above cannot pass vacuously."""
    in_readme = [c for c in COMMANDS if c.doc == "README.md"]
    programs = {c.program for c in COMMANDS}
    assert len(in_readme) >= 10 and len(COMMANDS) >= 40, [str(c) for c in COMMANDS]
    assert {"gatlib", "gatlib.bench.compare", "tools.triton_compile", "tools.launches", "pytest", "pip",
            "benchmarks/per_batch.py", "benchmarks/products_step.py",
            "benchmarks/run_accuracy.sh", "scripts/setup_env.sh"} <= programs, programs
    texts = [c.text for c in COMMANDS]
    assert any(t.startswith("torchrun ") for t in texts)
    assert any(t.startswith("TRITON_INTERPRET=1 gatlib selftest") for t in texts)
    # The README's main job: setup, then the installed command behind an environment variable.
    main_job = [c for c in in_readme if c.program == "gatlib" and ".venv/bin/gatlib" in c.text]
    assert main_job and main_job[0].argv[:1] == ["bench"]


def test_benchmarks_holds_the_tables_reproducers_only():
    """benchmarks/ keeps the scripts that reproduce a results table (each run by a command
    shown in RESULTS) and the renderers those scripts call; benchmarks/README.md has a row
    for each. A script only design.md runs is an instrument: tools/. Every developer
    instrument in tools/ has a command in the docs, which test_command_parses parses."""
    shown = {c.program for c in COMMANDS if c.doc in RESULTS}
    run = {p for p in shown if p.startswith("benchmarks/")}
    for script in [p for p in run if p.endswith(".sh")]:
        run |= set(re.findall(r"benchmarks/\w+\.(?:py|sh)", (ROOT / script).read_text()))
    scripts = {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").iterdir()
               if p.suffix in (".py", ".sh")}
    assert {"benchmarks/run_accuracy.sh", "benchmarks/make_tables.py",
            "benchmarks/compare_table.py"} <= scripts & run
    assert not scripts - run, f"in benchmarks/ but reproducing no documented table: {scripts - run}"
    index = (ROOT / "benchmarks" / "README.md").read_text()
    assert all(f"| `{Path(s).name}` |" in index for s in scripts), "a script without its row"
    # (tools/internals.py is what the instruments and tests read of the kernels, not one)
    tools = {f"tools.{p.stem}" for p in (ROOT / "tools").glob("*.py")
             if p.stem not in ("__init__", "internals")}
    assert {"tools.launches", "tools.triton_compile"} <= tools
    assert not tools - {c.program for c in COMMANDS}, tools - {c.program for c in COMMANDS}


def test_a_bad_command_fails():
    """The check rejects what argparse rejects."""
    bad = Command("README.md", "gatlib bench --dataset cora --model gat --runz 10", "gatlib",
                  ["bench", "--dataset", "cora", "--model", "gat", "--runz", "10"])
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --runz"):
        parse(bad)
    [words] = split_commands("GATLIB_X=1 .venv/bin/gatlib selftest --json out_<gpu>.json # note")
    assert invocation(words) == ("gatlib", ["selftest", "--json", "out_h100.json"])


def _fenced_shell_lines(path: Path) -> List[str]:
    return [s for s, fenced in shell_snippets(path.read_text()) if fenced]


def test_readme_test_commands_are_what_ci_runs():
    """.ci/run runs the README's test command, then the older torch's lane as the README
    gives it."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if not line.strip().startswith("#")]
    readme = [line.split("#")[0].strip() for line in _fenced_shell_lines(README)]
    runs = [line for line in readme if "pytest" in line and "setup_env.sh" in line]
    assert len(runs) == 2 and runs == [line for line in ci if "pytest" in line], (runs, ci)
    assert "older_torch" in runs[1] and "export GATLIB_SECOND_TORCH=2.11.0" in readme
    assert ci.index("export GATLIB_SECOND_TORCH=2.11.0") == ci.index(runs[1]) - 1, ci


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 300


def test_decisions_are_short():
    """One short entry per decision that stands: a record, not a lab notebook."""
    assert len((ROOT / "docs" / "design.md").read_text().splitlines()) <= 400


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_commit_hashes(path):
    hits = [(n, m.group()) for n, line in enumerate(path.read_text().splitlines(), 1)
            for m in COMMIT_HASH.finditer(line)]
    assert not hits, f"{path.name}: commit hashes belong in the result JSONs, not in prose: {hits}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@pytest.mark.parametrize("path", [*DOCS, ROOT / "notebooks" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    text = FENCE.sub("", path.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: broken link {target}"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", FENCE.sub("", dest.read_text()), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{path.name}: no heading #{anchor} in {file}"


@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "dry_run"])
def test_the_gpu_run_commands_parse(dry):
    """The GPU run's commands (``tools.gpu_run --print``; it cannot run here: no GPU) parse with
    their programs' real parsers, the sanitizer's program too; its steps' limits fit the run."""
    out = subprocess.run([sys.executable, "-m", "tools.gpu_run", "--print", *(["--dry-run"] * dry)],
                         capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    programs, limits = [], {}
    for line in out.splitlines():
        name, limit, _, command = line.split("\t")
        limits[name] = int(limit)
        words = shlex.split(command)
        if words[0] == "compute-sanitizer":
            words = words[words.index("--error-exitcode") + 2:]
        program, argv = invocation(words)
        programs.append(program)
        parse(Command("tools/gpu_run.py", command, program, argv))
    assert set(programs) == ({"gatlib.bench.selftest", "gatlib.bench.compare", "tools.triton_bench"}
                             | ({"tools.gpu_run"} if not dry else set()))
    if not dry:  # the sanitizer beside the self-test, then the timed steps: within the deadline
        from tools import gpu_run

        side = max(sum(v for k, v in limits.items() if k.startswith("sanitizer")),
                   max(v for k, v in limits.items() if k.startswith("selftest")))
        timed = sum(v for k, v in limits.items() if not k.startswith(("sanitizer", "selftest")))
        assert side + timed <= gpu_run.DEADLINE_S <= 7 * 60
