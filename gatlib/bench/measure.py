"""Measuring calls: time, peak memory, and out-of-memory as a result (``{"status": "OOM"}``).

A *measured call* is a callable without arguments with a ``clear()`` method that drops what a call leaves
behind (gradients). On CPU peak memory is measured in a fresh child process, because a process's peak RSS
never goes down and ``ru_maxrss`` is inherited across ``exec``: :func:`peak_rss_child` writes a JSON spec
naming a builder (``"package.module:function"``) and runs ``python -m package.module --_child SPEC``, whose
command line hands ``SPEC`` to :func:`child_main`.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import json
import math
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

OOM_PATTERNS = ("out of memory", "not enough memory", "can't allocate memory",
                "cannot allocate memory", "bad_alloc")


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says that memory ran out (CUDA, CPU allocator, ``MemoryError``)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(p in str(exc).lower() for p in OOM_PATTERNS)


def failure(exc: BaseException) -> Dict:
    """``{"status": "OOM" | "error", "error": first line of the message}``."""
    text = str(exc).strip()
    msg = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return {"status": "OOM" if is_oom(exc) else "error", "error": msg[:500]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Free what a failed or finished call left: garbage, CUDA's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# Time
def time_once(fn: Callable, device: torch.device) -> Dict:
    """Seconds of one call of ``fn`` (CUDA-synchronised): ``{"status": "ok",
    "seconds": ...}``, or the :func:`failure`."""
    try:
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        seconds = time.perf_counter() - t0
        del out
        return {"status": "ok", "seconds": seconds}
    except Exception as exc:  # noqa: BLE001 — recorded, reported, not fatal
        release(device)
        return failure(exc)


def time_interleaved(fns: Dict[str, Callable], device: torch.device, repeats: int,
                     warmup: int = 1, min_block_s: float = 0.5) -> Dict[str, Dict]:
    """Median seconds per call of each function, in A B B A rounds after ``warmup`` calls.

    Each block lasts at least ``min_block_s``, so it averages over bursts of load and a small graph is not all
    launch overhead. A function that raises is recorded as ``"OOM"`` or ``"error"`` and left out of later rounds.
    """
    from torch.utils.benchmark import Timer

    res = {k: {"status": "ok", "times_s": []} for k in fns}
    number = {}
    for k, fn in fns.items():
        try:
            for _ in range(max(1, warmup)):
                t0 = time.perf_counter()
                fn()
                sync(device)
                dt = time.perf_counter() - t0
            number[k] = max(1, min(1000, math.ceil(min_block_s / max(dt, 1e-9))))
        except Exception as exc:  # noqa: BLE001
            res[k] = failure(exc)
            release(device)
    names = list(fns)
    for r in range(repeats):
        for k in (names if r % 2 == 0 else names[::-1]):
            if res[k]["status"] != "ok":
                continue
            try:
                # Timer synchronises CUDA; it defaults to 1 thread, so pass ours.
                m = Timer(stmt="fn()", globals={"fn": fns[k]},
                          num_threads=torch.get_num_threads()).timeit(number[k])
                res[k]["times_s"].append(m.mean)
            except Exception as exc:  # noqa: BLE001
                res[k] = failure(exc)
                release(device)
    for k, v in res.items():
        if v["status"] == "ok":
            v["calls_per_block"] = number[k]
            v["median_s"] = statistics.median(v["times_s"]) if v["times_s"] else None
    return res


# Memory: CUDA
def peak_cuda(fn: Callable, device: torch.device) -> Dict:
    """Peak extra CUDA memory of one call of the measured call ``fn`` after a warm-up call."""
    try:
        out = fn()  # warm-up: lazy initialisation, cuBLAS workspace, what a plan derives
        del out
        fn.clear()
        release(device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del out
        fn.clear()
        return {"status": "ok", "peak_extra_bytes": int(peak),
                "allocated_before_bytes": int(before)}
    except Exception as exc:  # noqa: BLE001
        fn.clear()
        release(device)
        return failure(exc)


# Memory: CPU (Linux /proc)
def proc_status() -> Dict[str, int]:
    """VmRSS / VmHWM / VmSize / ... of this process in bytes (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            text = f.read()
    except OSError:
        return {}
    return {k: int(v) * 1024 for k, v in re.findall(r"^(Vm\w+):\s+(\d+) kB", text, re.M)}


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (``/proc/self/clear_refs``, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_available() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (``None`` where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            m = re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


@contextlib.contextmanager
def memory_budget(budget: Optional[int] = None):
    """Cap this process's address space at its size plus ``budget`` bytes (default: free memory less
    1 GiB), so going over fails an allocation here instead of waking the OOM killer, which may pick another
    process. A no-op off Linux; yields the budget (``None`` when no limit was set)."""
    if budget is None:
        avail = mem_available()
        budget = None if avail is None else max(avail - 2**30, 2**30)
    size = proc_status().get("VmSize")
    if budget is None or size is None:
        yield None
        return
    old = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + int(budget)
    if old[1] != resource.RLIM_INFINITY:
        limit = min(limit, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, old[1]))
    try:
        yield int(budget)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def measure_peak_rss(build: Callable[[], Callable], limit_memory: bool = False,
                     mem_budget_bytes: Optional[int] = None) -> Dict:
    """Peak extra RSS of ``build()``'s call in this process (meant for a fresh one): ``VmHWM``
    after the call minus ``VmRSS`` before it, after a warm-up call and a reset of the high-water mark."""
    fn = build()
    gc.collect()
    res = {"rss_inputs_bytes": proc_status()["VmRSS"]}
    limit = memory_budget(mem_budget_bytes) if limit_memory else contextlib.nullcontext()
    try:
        with limit as budget:
            res["mem_budget_bytes"] = budget
            hwm_reset = reset_hwm()
            if hwm_reset:  # without a reset, a warm-up call would set the high-water mark
                out = fn()
                del out
            fn.clear()
            gc.collect()
            reset_hwm()
            before = proc_status()["VmRSS"]
            out = fn()
            hwm = proc_status()["VmHWM"]
            del out
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        return {**res, **failure(exc)}
    return {**res, "status": "ok", "peak_extra_bytes": hwm - before, "rss_before_bytes": before,
            "hwm_bytes": hwm, "hwm_reset": hwm_reset}


def child_env() -> Dict[str, str]:
    """The environment for a measuring child process: this process's, with this
    gatlib first on ``PYTHONPATH`` and glibc's mmap threshold fixed."""
    env = dict(os.environ)
    # Import the same gatlib as the parent, installed or not.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # A fixed mmap threshold: glibc's adaptive one would keep freed blocks of up
    # to 32 MB on the heap, and a later call would reuse them without raising RSS.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    return env


def peak_rss_child(spec: Dict, workdir: Path, timeout: Optional[float] = None) -> Dict:
    """:func:`measure_peak_rss` of ``spec["builder"]``'s call in a fresh process (spec and result
    in ``workdir``); ``{"status": "OOM"}`` when the child was killed by SIGKILL or ran out of memory."""
    module = spec["builder"].split(":")[0]
    fd, name = tempfile.mkstemp(prefix="child-", suffix=".spec.json", dir=workdir)
    spec_path = Path(name)
    result_path = spec_path.with_name(spec_path.name.replace(".spec.json", ".result.json"))
    with os.fdopen(fd, "w") as f:
        json.dump({**spec, "result": str(result_path)}, f)
    proc = subprocess.run([sys.executable, "-m", module, "--_child", str(spec_path)],
                          env=child_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 0 and result_path.exists():
        return json.loads(result_path.read_text())
    tail = (proc.stderr or "").strip()[-800:]
    if proc.returncode == -signal.SIGKILL:
        return {"status": "OOM", "error": "child process killed (SIGKILL, most likely the OOM "
                                          "killer)"}
    if any(p in tail.lower() for p in OOM_PATTERNS):
        return {"status": "OOM", "error": tail.splitlines()[-1] if tail else ""}
    return {"status": "error", "error": f"child exited with {proc.returncode}: {tail}"}


def child_main(spec_path: str) -> int:
    """The child's side of :func:`peak_rss_child` (call it from the builder
    module's ``--_child SPEC`` option): measure, write the result, exit 0."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        module, function = spec["builder"].split(":")
        build = getattr(importlib.import_module(module), function)
        res = measure_peak_rss(lambda: build(spec), limit_memory=True,
                               mem_budget_bytes=spec.get("mem_budget_bytes"))
    except Exception:  # noqa: BLE001
        res = {"status": "error", "error": traceback.format_exc()[-1500:]}
    Path(spec["result"]).write_text(json.dumps(res))
    return 0
