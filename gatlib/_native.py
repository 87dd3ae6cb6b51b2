"""The fused CPU kernel's compiled passes (``gatlib/csrc/fused_cpu.cpp``), built on first use.

Each pass walks the rows of the graph's CSR (or CSC) once and reads a source
row of ``H*C`` values per edge for all heads, with the row's result kept by the
thread that owns the row: the weighted sum with its softmax, the sampled dot
products, both products of the aggregation's backward in one walk, and GATv2's
score and gradient. Written with torch ops instead, each was several passes
over ``[E, H]`` or ``[E, H, C]`` blocks, or an MKL product over a per-head copy
of the graph (benchmarks/NOTES.md, "Compiled row passes").

The source is compiled with ``torch.utils.cpp_extension`` the first time a
fused CPU call asks for it (seconds; later processes load the cached build) with
``-march=native``: the build directory is keyed by the CPU's instruction-set
flags, so a cache shared between machines never runs code built for another.
Where it cannot be built (no C++ compiler or ninja), :func:`unavailable` says
why and the fused CPU kernel reports itself unsupported with that reason.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("csrc") / "fused_cpu.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp")


def _cpu_key() -> str:
    """A short hash of what the compiled code depends on besides its source:
    the CPU's instruction sets, torch's and Python's versions."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags += platform.processor()
    text = f"{flags}|{torch.__version__}|{sys.version_info[:2]}|{' '.join(FLAGS)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_directory() -> Path:
    """Where the extension is built and cached (``$GATLIB_CACHE`` or
    ``~/.cache/gatlib``, then ``native/<key>``)."""
    root = os.environ.get("GATLIB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gatlib")
    return Path(root) / "native" / _cpu_key()


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
    """Build (or load the cached build of) the extension once per process;
    ``None`` on success, else why it failed."""
    from torch.utils import cpp_extension

    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:  # the `ninja` wheel's binary, where ninja is not on PATH (a venv not activated)
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:
            return "building it needs ninja (pip install ninja)"
    try:
        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name="gatlib_cpu", sources=[str(SOURCE)], extra_cflags=list(FLAGS),
                           extra_ldflags=["-fopenmp"], build_directory=str(directory),
                           is_python_module=False, verbose=False)
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
