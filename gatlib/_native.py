"""The fused CPU kernel's compiled passes (``gatlib/csrc/fused_cpu.cpp``), built on first use.

Each pass walks the CSR (or CSC) rows once, reading one ``H*C`` source row per edge for all
heads, each row's result kept by the thread that owns it (docs/design.md, "Compiled CPU row
passes"). Built with ``torch.utils.cpp_extension`` and ``-march=native`` into a cache keyed by
the source, the CPU's flags and torch's version, published by an atomic rename (docs/design.md,
"The CPU passes' build cache"); where it cannot be built, :func:`unavailable` says why.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("csrc") / "fused_cpu.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp")


# A private build folder older than this is a killed process's leftover.
STALE_BUILD_SECONDS = 3600


def _cpu_key() -> str:
    """A short hash of what the compiled code depends on: its source, the CPU's
    instruction sets, torch's and Python's versions and the flags. A published
    build is never rebuilt, so a changed source must change the folder."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags += platform.processor()
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest() if SOURCE.is_file() else ""
    # (DIGEST_FILE in the text: builds from before the digest was kept live in other folders)
    text = f"{source}|{flags}|{torch.__version__}|{sys.version_info[:2]}|{' '.join(FLAGS)}|{DIGEST_FILE}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_directory() -> Path:
    """Where the built extension is cached (``$GATLIB_CACHE`` or
    ``~/.cache/gatlib``, then ``native/<key>``); it exists only once complete."""
    root = os.environ.get("GATLIB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gatlib")
    return Path(root) / "native" / _cpu_key()


def _library(directory: Path) -> Optional[Path]:
    found = sorted(directory.glob("*.so"))
    return found[0] if found else None


# Beside a published library: the SHA-256 of its bytes, written by the build before publishing.
# A library cut short (a full disk, a copy interrupted) crashes the process that maps it (SIGBUS);
# checked against this first, it is rebuilt instead.
DIGEST_FILE = "library.sha256"


def _digest(library: Path) -> str:
    return hashlib.sha256(library.read_bytes()).hexdigest()


def _intact(library: Path) -> bool:
    """Whether ``library``'s bytes are the ones its build recorded."""
    try:
        return (library.parent / DIGEST_FILE).read_text().split() == [_digest(library), library.name]
    except OSError:
        return False


def _discard(final: Path) -> None:
    """Move a damaged published build out of the way (atomically, so no process loads it from
    there again), then delete it."""
    aside = final.parent / f".{final.name}.damaged-{os.getpid()}"
    try:
        os.rename(final, aside)
    except OSError:  # another process moved it first
        return
    shutil.rmtree(aside, ignore_errors=True)


def _remove_stale_builds(final: Path) -> None:
    """Remove the private build folders of ``final`` left by processes that died
    mid-build (older than :data:`STALE_BUILD_SECONDS`; a live build takes seconds)."""
    for old in final.parent.glob(f".{final.name}.build-*"):
        try:
            if time.time() - old.stat().st_mtime > STALE_BUILD_SECONDS:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:  # removed by another process meanwhile
            pass


def _build(final: Path) -> None:
    """Compile and load the extension in a private folder, then publish it as ``final``."""
    from torch.utils import cpp_extension

    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(final)
    private = Path(tempfile.mkdtemp(prefix=f".{final.name}.build-", dir=final.parent))
    try:
        cpp_extension.load(name="gatlib_cpu", sources=[str(SOURCE)], extra_cflags=list(FLAGS),
                           extra_ldflags=["-fopenmp"], build_directory=str(private),
                           is_python_module=False, verbose=False)
        library = _library(private)
        if library is not None:
            (private / DIGEST_FILE).write_text(f"{_digest(library)} {library.name}\n")
        try:
            os.rename(private, final)  # atomic; fails if another process published first
        except OSError:
            if _library(final) is None:
                warnings.warn(f"gatlib: {final} is in the way of the fused CPU kernel's build "
                              "cache (it holds no built library); remove it, or every process "
                              "builds the kernel anew", RuntimeWarning, stacklevel=3)
    finally:
        shutil.rmtree(private, ignore_errors=True)  # (gone if published)


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
    """Build (or load the cached build of) the extension once per process;
    ``None`` on success, else why it failed, said once in a warning: ``backend="auto"``
    then runs the reference on CPU, which must not happen unseen."""
    reason = _build_or_load()
    if reason is not None:
        warnings.warn(f"gatlib: the fused CPU kernel cannot run here: {reason}. "
                      "backend='auto' runs the reference kernel on CPU instead (it builds "
                      "[E, H, C] tensors: more memory and time on large graphs); "
                      "backend='fused' raises", RuntimeWarning, stacklevel=2)
    return reason


def _build_or_load() -> Optional[str]:
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:  # the `ninja` wheel's binary, where ninja is not on PATH (a venv not activated)
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:
            return "building it needs ninja (pip install ninja)"
    try:
        final = build_directory()
        built = _library(final)
        if built is not None and not _intact(built):
            warnings.warn(f"gatlib: the fused CPU kernel's cached build {built} is not the library "
                          "its build wrote (cut short or changed since); building it again",
                          RuntimeWarning, stacklevel=4)
            _discard(final)
            built = None
        if built is not None:
            torch.ops.load_library(str(built))
        else:
            _build(final)
    except Exception as exc:  # a compiler error, a missing compiler: reported, not raised here
        return f"its compiled passes ({SOURCE.name}) failed to build: {str(exc).strip()[:2000]}"
    finally:
        os.environ["PATH"] = path
    return None


@torch.compiler.assume_constant_result
def unavailable() -> Optional[str]:
    """Why the compiled passes cannot run here, or ``None`` once they are loaded.
    The first call builds them. A constant to ``torch.compile``, which would
    otherwise trace the build."""
    return _load()


def ops():
    """The compiled passes, ``torch.ops.gatlib_cpu``; a ``RuntimeError`` with the
    reason where they cannot be built (the dispatcher asks :func:`unavailable`
    first, so this only fails for a caller that did not)."""
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"gatlib's compiled CPU passes cannot run here: {reason}")
    return torch.ops.gatlib_cpu
