"""``gatlib compare``: gatlib's layers against their PyTorch Geometric twins.

For each layer (GATConv, GATv2Conv, TransformerConv) the PyG layer and the
gatlib layer are built with the *same weights* (``gatlib.load_state_dict(
pyg.state_dict())``) and run on the same graph and features:

1. **peak extra memory** of one forward (inference, ``torch.no_grad``) and one
   forward+backward (training) call, after a warm-up call. CUDA:
   ``max_memory_allocated`` minus what was allocated before the call. CPU: each
   (implementation, layer, pass) runs in a *fresh* child process, which
   reports ``VmHWM`` after the call minus ``VmRSS`` before it (with the inputs
   loaded and the high-water mark reset) — a process's peak RSS never goes
   down, and ``ru_maxrss`` is inherited across ``exec``, so in-process or
   forked numbers would be those of whatever ran before;
2. **agreement**: output and input gradient must match PyG's (norm-wise
   relative error, tolerance by dtype), else the run aborts — timing a layer
   that computes something else is meaningless;
3. **time** of both passes: warm-up, then ``--repeats`` rounds in A B B A
   order (so drift on a shared machine hits both sides alike), each a
   ``torch.utils.benchmark.Timer`` block of at least ``--block-seconds``
   (CUDA-synchronised). Reported: medians, speedup = PyG / gatlib median, and
   the per-round ratios, whose spread says how much the machine's load moved
   the numbers.

Out-of-memory is a result ("OOM"), not a crash: a CUDA ``OutOfMemoryError``, a
CPU allocation failure, or a CPU child killed by the OOM killer. On CPU, every
process runs under :func:`memory_budget` (the free memory, or
``--mem-budget-gb``), so an allocation beyond it fails where it can be
reported instead of summoning the OOM killer; the memory children run first,
and an implementation that ran out of memory there is not run again in the
parent. Results are written to ``--json`` after every layer, so a long run
that dies keeps what it measured (``"complete": false``).

The gatlib layer keeps what it derives from an ``edge_index`` (self-loops,
CSR layout) cached on that tensor, as in training where every epoch reuses
one ``edge_index``; PyG recomputes its self-loops on every call. Memory is
measured after a warm-up call, so that cache counts as part of the input for
gatlib (it is reported: ``rss_before - rss_inputs``).

Usage::

    gatlib compare --layer all --graph arxiv-like --device cpu --json out.json
    python -m gatlib.compare --layer gat --graph synthetic:2000:10000:32
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

LAYERS = {"gat": "GATConv", "gatv2": "GATv2Conv", "transformer": "TransformerConv"}
IMPLS = ("pyg", "gatlib")
PASSES = ("forward", "forward+backward")
GRAPHS = ("cora", "arxiv-like", "products-like")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Per-device defaults for heads/channels: the project's CPU and GPU target configurations.
DEFAULT_HC = {"cpu": (4, 64), "cuda": (3, 256)}

# Full precision: both sides sum the same terms in a different order, which
# costs ~1e-6 (norm-wise, float32) even on hubs with 1e4 in-edges.
_FP32_TOL = 1e-4
# Half precision: gatlib's error against a float32 PyG reference may be at most
# twice PyG's own error in that dtype (flash-attention's test rule) plus this floor.
_LOWP_FLOOR = 1e-4
_OOM_PATTERNS = ("out of memory", "not enough memory", "can't allocate memory",
                 "cannot allocate memory", "bad_alloc")

SCHEMA = "gatlib.compare/1"


# ---------------------------------------------------------------------------
# Graphs
# ---------------------------------------------------------------------------
@dataclass
class Graph:
    """Features and an undirected, loop-free ``edge_index`` plus where they came from."""

    name: str
    x: Tensor  # [N, F]
    edge_index: Tensor  # [2, E]
    source: str
    params: Dict = field(default_factory=dict)


def _load_cora(data_dir: Path) -> Graph:
    from .data import load_dataset

    # Offline, point $GATLIB_PLANETOID_RAW at a folder with Planetoid/Cora/raw:
    # gatlib.data copies the raw files into data_dir (else PyG downloads them).
    data = load_dataset("cora", data_dir).data
    return Graph("cora", data.x, data.edge_index,
                 "gatlib.data.load_dataset('cora'): torch_geometric.datasets.Planetoid, "
                 "public split, NormalizeFeatures", {"data_dir": str(data_dir)})


def load_graph(name: str, data_dir: Path, seed: int = 0) -> Graph:
    """``cora``, ``arxiv-like``, ``products-like`` or ``synthetic:N:E:F``."""
    if name == "cora":
        return _load_cora(data_dir)
    from . import synthetic

    spec = synthetic.parse_spec(name)
    data = synthetic.synthetic_graph(spec, seed=seed, cache_dir=data_dir)
    params = {"num_nodes": spec.num_nodes, "directed_edges_drawn": spec.num_edges,
              "num_features": spec.num_features, "degree_exponent": spec.exponent,
              "max_expected_degree": spec.max_degree, "seed": seed, "undirected": True}
    return Graph(spec.name, data.x, data.edge_index,
                 "gatlib.synthetic (Chung-Lu power-law degrees, made undirected)", params)


def _with_self_loops(edge_index: Tensor, num_nodes: int) -> Tensor:
    from torch_geometric.utils import add_self_loops, remove_self_loops

    return add_self_loops(remove_self_loops(edge_index)[0], num_nodes=num_nodes)[0]


# ---------------------------------------------------------------------------
# Layers and the measured calls
# ---------------------------------------------------------------------------
def build_pair(layer: str, in_channels: int, heads: int, channels: int, backend: str,
               device: torch.device, dtype: torch.dtype, seed: int) -> Dict[str, torch.nn.Module]:
    """PyG's layer and gatlib's, with PyG's freshly initialised weights loaded into gatlib's."""
    import torch_geometric.nn as pyg_nn

    import gatlib

    cls = LAYERS[layer]
    torch.manual_seed(seed)
    theirs = getattr(pyg_nn, cls)(in_channels, channels, heads=heads)
    ours = getattr(gatlib, cls)(in_channels, channels, heads=heads, backend=backend)
    ours.load_state_dict(theirs.state_dict())
    return {"pyg": theirs.to(device, dtype), "gatlib": ours.to(device, dtype)}


def layer_edge_index(layer: str, edge_index: Tensor, edge_index_loops: Tensor) -> Tensor:
    """GAT/GATv2 add self-loops themselves; TransformerConv gets them in its input,
    so all three layers attend over the same ``E + N`` edges."""
    return edge_index_loops if layer == "transformer" else edge_index


def _grad_out(num_nodes: int, width: int, dtype, device, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randn(num_nodes, width, generator=g).to(device, dtype)


class _Pass:
    """One measured call: ``"forward"`` (inference, no autograd graph) or
    ``"forward+backward"`` (a training step's forward and backward, gradients
    reset to ``None`` first as ``zero_grad`` does)."""

    def __init__(self, layer, x: Tensor, edge_index: Tensor, grad_out: Tensor, name: str):
        if name not in PASSES:
            raise ValueError(f"pass must be one of {PASSES}; got {name!r}")
        self.layer, self.x, self.edge_index, self.grad_out, self.name = (
            layer, x, edge_index, grad_out, name)

    def clear(self) -> None:
        self.layer.zero_grad(set_to_none=True)
        self.x.grad = None

    def __call__(self):
        if self.name == "forward":
            with torch.no_grad():
                return self.layer(self.x, self.edge_index)
        self.clear()
        out = self.layer(self.x, self.edge_index)
        out.backward(self.grad_out)
        return out


def _make_pass(layer, x: Tensor, edge_index: Tensor, grad_out: Tensor, name: str) -> _Pass:
    """The callable that is timed and whose memory is measured (tests wrap it)."""
    return _Pass(layer, x, edge_index, grad_out, name)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(p in str(exc).lower() for p in _OOM_PATTERNS)


def _failure(exc: BaseException) -> Dict:
    msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return {"status": "OOM" if _is_oom(exc) else "error", "error": msg[:500]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# Agreement
# ---------------------------------------------------------------------------
def _rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _run_once(layer, x: Tensor, edge_index: Tensor, grad_out: Tensor):
    xx = x.detach().clone().requires_grad_()
    out = layer(xx, edge_index)
    out.backward(grad_out)
    layer.zero_grad(set_to_none=True)
    return out.detach(), xx.grad


def check_agreement(layers: Dict[str, torch.nn.Module], x: Tensor, edge_index: Tensor,
                    grad_out: Tensor) -> Dict:
    """Norm-wise relative error of gatlib vs PyG in output and input gradient.

    float32: each error at most ``1e-4``. bfloat16/float16: both are compared
    with PyG in float32; gatlib's error may be at most twice PyG's plus ``1e-4``.
    """
    dtype = x.dtype
    out = {impl: _run_once(layers[impl], x, edge_index, grad_out) for impl in IMPLS}
    res: Dict = {"dtype": str(dtype).replace("torch.", "")}
    if dtype not in (torch.float16, torch.bfloat16):
        res["forward_rel_err"] = _rel_err(out["gatlib"][0], out["pyg"][0])
        res["input_grad_rel_err"] = _rel_err(out["gatlib"][1], out["pyg"][1])
        res["tol_forward"] = res["tol_input_grad"] = _FP32_TOL
    else:
        ref_layer = copy.deepcopy(layers["pyg"]).float()
        ref = _run_once(ref_layer, x.float(), edge_index, grad_out.float())
        del ref_layer
        for key, i in (("forward", 0), ("input_grad", 1)):
            err_pyg = _rel_err(out["pyg"][i], ref[i])
            res[f"{key}_rel_err"] = _rel_err(out["gatlib"][i], ref[i])
            res[f"{key}_rel_err_pyg_vs_fp32"] = err_pyg
            res[f"tol_{key}"] = 2 * err_pyg + _LOWP_FLOOR
    ok = (res["forward_rel_err"] <= res["tol_forward"]
          and res["input_grad_rel_err"] <= res["tol_input_grad"])
    res["status"] = "ok" if ok else "mismatch"
    return res


# ---------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------
def time_interleaved(fns: Dict[str, Callable], device: torch.device, repeats: int,
                     warmup: int = 1, min_block_s: float = 0.5) -> Dict[str, Dict]:
    """Median seconds per call of each function, measured in A B B A rounds.

    Each function is warmed up ``warmup`` times; the last warm-up call sizes its
    timing block (enough calls to last ``min_block_s``, so that one block
    averages over short bursts of load on a shared machine and small graphs are not
    all launch overhead). A function that raises is recorded as ``"OOM"`` or
    ``"error"`` and left out of later rounds; the others carry on.
    """
    res = {k: {"status": "ok", "times_s": []} for k in fns}
    number = {}
    for k, fn in fns.items():
        try:
            for _ in range(max(1, warmup)):
                t0 = time.perf_counter()
                fn()
                _sync(device)
                dt = time.perf_counter() - t0
            number[k] = max(1, min(1000, math.ceil(min_block_s / max(dt, 1e-9))))
        except Exception as exc:  # noqa: BLE001 — recorded, reported, not fatal
            res[k] = _failure(exc)
            _release(device)
    from torch.utils.benchmark import Timer

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
                res[k] = _failure(exc)
                _release(device)
    for k, v in res.items():
        if v["status"] == "ok":
            v["calls_per_block"] = number[k]
            v["median_s"] = statistics.median(v["times_s"]) if v["times_s"] else None
    return res


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------
def peak_cuda(p: _Pass, device: torch.device) -> Dict:
    """Peak extra CUDA memory of one call of ``p`` after a warm-up call."""
    try:
        out = p()  # warm-up: lazy initialisation, cuBLAS workspace, gatlib's graph cache
        del out
        p.clear()
        _release(device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = p()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del out
        p.clear()
        return {"status": "ok", "peak_extra_bytes": int(peak),
                "allocated_before_bytes": int(before)}
    except Exception as exc:  # noqa: BLE001
        p.clear()
        _release(device)
        return _failure(exc)


def _proc_status() -> Dict[str, int]:
    """VmRSS / VmHWM / VmSize of this process in bytes (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            text = f.read()
    except OSError:
        return {}
    return {k: int(v) * 1024 for k, v in re.findall(r"^(Vm\w+):\s+(\d+) kB", text, re.M)}


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (``/proc/self/clear_refs``, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            m = re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


@contextlib.contextmanager
def memory_budget(budget: Optional[int] = None):
    """Cap this process's address space at its current size plus ``budget`` bytes.

    Default budget: the free memory (``MemAvailable``) less 1 GiB. Going over
    then fails an allocation here — reported as OOM — instead of waking the
    kernel's OOM killer, which on a shared machine may pick someone else's
    process. Restores the previous limit on exit; a no-op off Linux. Yields the
    budget in bytes (``None`` when no limit was set).
    """
    if budget is None:
        avail = _mem_available()
        budget = None if avail is None else max(avail - 2**30, 2**30)
    size = _proc_status().get("VmSize")
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


def measure_peak_rss(spec: Dict) -> Dict:
    """Peak extra RSS of one (implementation, layer, pass), in *this* process.

    Meant to run in a fresh process (:func:`peak_rss_child`): loads the inputs
    written by the parent, builds the layer, runs one warm-up call, resets the
    high-water mark, and reports ``VmHWM`` after the measured call minus
    ``VmRSS`` before it. With ``spec["limit_memory"]``, the call runs under
    :func:`memory_budget` (``spec["mem_budget_bytes"]``), so that running out
    is reported instead of waking the OOM killer.
    """
    torch.set_num_threads(spec["threads"])
    dtype = DTYPES[spec["dtype"]]
    blob = torch.load(spec["inputs"], weights_only=True)
    x = blob["x"].requires_grad_()
    edge_index = layer_edge_index(spec["layer"], blob["edge_index"], blob["edge_index_loops"])
    del blob
    layer = build_pair(spec["layer"], x.size(1), spec["heads"], spec["channels"], spec["backend"],
                       torch.device("cpu"), dtype, spec["seed"])[spec["impl"]]
    grad_out = _grad_out(x.size(0), spec["heads"] * spec["channels"], dtype, "cpu", spec["seed"])
    p = _make_pass(layer, x, edge_index, grad_out, spec["pass"])
    gc.collect()
    rss_inputs = _proc_status()["VmRSS"]
    res = {"rss_inputs_bytes": rss_inputs}
    limit = (memory_budget(spec.get("mem_budget_bytes")) if spec.get("limit_memory")
             else contextlib.nullcontext())
    try:
        with limit as budget:
            res["mem_budget_bytes"] = budget
            hwm_reset = _reset_hwm()
            if hwm_reset:  # without a reset, a warm-up call would set the high-water mark
                out = p()
                del out
            p.clear()
            gc.collect()
            _reset_hwm()
            before = _proc_status()["VmRSS"]
            out = p()
            hwm = _proc_status()["VmHWM"]
            del out
    except Exception as exc:  # noqa: BLE001
        if not _is_oom(exc):
            raise
        return {**res, **_failure(exc)}
    return {**res, "status": "ok", "peak_extra_bytes": hwm - before, "rss_before_bytes": before,
            "hwm_bytes": hwm, "hwm_reset": hwm_reset}


def _child_env() -> Dict[str, str]:
    env = dict(os.environ)
    # Import the same gatlib as the parent, installed or not.
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # A fixed mmap threshold: glibc's adaptive one would keep freed blocks of up
    # to 32 MB on the heap, and a later call would reuse them without raising RSS.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    return env


def peak_rss_child(spec: Dict, workdir: Path, timeout: Optional[float] = None) -> Dict:
    """Run :func:`measure_peak_rss` in a fresh ``python -m gatlib.compare --_child`` process."""
    tag = f"{spec['impl']}-{spec['layer']}-{spec['pass'].replace('+', '_')}"
    spec_path, result_path = workdir / f"{tag}.spec.json", workdir / f"{tag}.result.json"
    result_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**spec, "result": str(result_path)}))
    proc = subprocess.run([sys.executable, "-m", "gatlib.compare", "--_child", str(spec_path)],
                          env=_child_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 0 and result_path.exists():
        return json.loads(result_path.read_text())
    tail = (proc.stderr or "").strip()[-800:]
    if proc.returncode == -signal.SIGKILL:
        return {"status": "OOM", "error": "child process killed (SIGKILL, most likely the OOM "
                                          "killer)"}
    if any(p in tail.lower() for p in _OOM_PATTERNS):
        return {"status": "OOM", "error": tail.splitlines()[-1] if tail else ""}
    return {"status": "error", "error": f"child exited with {proc.returncode}: {tail}"}


def _child_main(spec_path: str) -> int:
    spec = {**json.loads(Path(spec_path).read_text()), "limit_memory": True}
    try:
        res = measure_peak_rss(spec)
    except Exception:  # noqa: BLE001
        res = {"status": "error", "error": traceback.format_exc()[-1500:]}
    Path(spec["result"]).write_text(json.dumps(res))
    return 0


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------
def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), *args],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device) -> Dict:
    """Device name, library versions, git SHA: what a reader needs to trust a number."""
    import gatlib

    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else _cpu_model()),
        "cpu_model": _cpu_model(),
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_geometric": _version("torch_geometric"),
            "gatlib": gatlib.__version__,
            "triton": _version("triton"),
            "torch_scatter": _version("torch_scatter") or _version("torch-scatter"),
            "torch_sparse": _version("torch_sparse") or _version("torch-sparse"),
            "pyg_lib": _version("pyg_lib") or _version("pyg-lib"),
            "cuda": torch.version.cuda,
        },
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "platform": platform.platform(),
    }


def _fmt_ms(r: Dict) -> str:
    if r.get("status") != "ok":
        return r.get("status", "-")
    return f"{r['median_s'] * 1e3:.2f}" if r.get("median_s") is not None else "-"


def _fmt_mib(r: Optional[Dict]) -> str:
    if not r:
        return "-"
    if r.get("status") != "ok":
        return r["status"]
    return f"{r['peak_extra_bytes'] / 2**20:.1f}"


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _spread(row: Dict) -> str:
    r = row.get("speedup_rounds") or []
    return f"{min(r):.2f}-{max(r):.2f}" if r else "-"


def summarize(measurements: List[Dict]) -> List[Dict]:
    """Per (layer, pass): speedup = PyG time / gatlib time, mem_ratio = gatlib / PyG memory."""
    by = {(m["layer"], m["impl"], m["pass"]): m for m in measurements}
    rows = []
    for layer in dict.fromkeys(m["layer"] for m in measurements):
        for p in PASSES:
            a, b = by.get((layer, "pyg", p)), by.get((layer, "gatlib", p))
            if a is None or b is None:
                continue
            ta, tb = a["time"], b["time"]
            ma, mb = a.get("memory"), b.get("memory")
            speed = (ta["median_s"] / tb["median_s"]
                     if ta.get("median_s") and tb.get("median_s") else None)
            # Per-round ratios pair measurements taken seconds apart, under the same
            # load; their spread shows how far to trust the speedup on a shared machine.
            paired = speed is not None and len(ta["times_s"]) == len(tb["times_s"])
            rounds = ([x / y for x, y in zip(ta["times_s"], tb["times_s"], strict=True)]
                      if paired else [])
            mem = (mb["peak_extra_bytes"] / ma["peak_extra_bytes"]
                   if ma and mb and ma.get("status") == mb.get("status") == "ok"
                   and ma["peak_extra_bytes"] > 0 else None)
            rows.append({"layer": layer, "pass": p, "speedup": speed,
                         "speedup_rounds": rounds,
                         "speedup_paired_median": statistics.median(rounds) if rounds else None,
                         "mem_ratio": mem})
    return rows


def format_table(report: Dict) -> str:
    """The plain-text table printed at the end of a run."""
    g, c, env = report["graph"], report["config"], report["environment"]
    lines = [
        f"graph {g['name']}: N={g['num_nodes']:,}, E={g['num_edges']:,} "
        f"(undirected, no self-loops), E+N={g['num_edges_with_self_loops']:,} attended, "
        f"F={g['num_features']}",
        f"H={c['heads']} C={c['channels']} {c['dtype']} on {env['device_name']} "
        f"(threads={env['num_threads']}); gatlib backend={c['backend']} "
        f"(resolves to {c['backend_resolved']})",
        "speedup = PyG time / gatlib time (medians; rounds: range of the per-round ratios); "
        "mem = gatlib peak extra / PyG peak extra",
        "",
    ]
    head = (f"{'layer':<16}{'pass':<18}{'PyG ms':>11}{'gatlib ms':>11}{'speedup':>9}"
            f"{'rounds':>12}{'PyG MiB':>10}{'gatlib MiB':>12}{'mem':>8}")
    lines += [head, "-" * len(head)]
    by = {(m["layer"], m["impl"], m["pass"]): m for m in report["measurements"]}
    for row in report["summary"]:
        a, b = by[(row["layer"], "pyg", row["pass"])], by[(row["layer"], "gatlib", row["pass"])]
        lines.append(
            f"{LAYERS[row['layer']]:<16}{row['pass']:<18}{_fmt_ms(a['time']):>11}"
            f"{_fmt_ms(b['time']):>11}{_ratio(row['speedup']):>9}{_spread(row):>12}"
            f"{_fmt_mib(a.get('memory')):>10}"
            f"{_fmt_mib(b.get('memory')):>12}{_ratio(row['mem_ratio']):>8}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``gatlib compare``'s options to ``parser``."""
    from ._backend import BACKENDS

    parser.add_argument("--layer", default="all", choices=[*LAYERS, "all"],
                        help="layer to compare (default: all)")
    parser.add_argument("--graph", default="cora",
                        help=f"one of {', '.join(GRAPHS)}, or synthetic:N:E:F for a power-law "
                             "graph with N nodes, E directed edges (made undirected) and F "
                             "features (default: cora)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="(default: cpu)")
    parser.add_argument("--heads", type=int, default=None,
                        help="heads H (default: 4 on CPU, 3 on CUDA)")
    parser.add_argument("--channels", type=int, default=None,
                        help="channels per head C (default: 64 on CPU, 256 on CUDA)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="(default: float32)")
    parser.add_argument("--backend", default="auto", choices=list(BACKENDS),
                        help="gatlib attention backend (default: auto)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds per implementation and pass (default: 5)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls before timing, at least 1 (default: 1)")
    parser.add_argument("--block-seconds", type=float, default=0.5, metavar="S",
                        help="each timed block repeats the call until it lasts S seconds "
                             "(default: 0.5)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="measure peak extra memory (default: on)")
    parser.add_argument("--pass", dest="passes", default="both",
                        choices=["forward", "forward+backward", "both"],
                        help="which passes to measure (default: both)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results here")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="dataset cache (default: $GATLIB_DATA or ~/.cache/gatlib); offline, "
                             "set $GATLIB_PLANETOID_RAW to a folder with Planetoid/Cora/raw")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's default, "
                             f"{torch.get_num_threads()} here)")
    parser.add_argument("--seed", type=int, default=0, help="weights, features, graph (default: 0)")
    parser.add_argument("--mem-budget-gb", type=float, default=None,
                        help="CPU: let each process grow by at most this many GB; more "
                             "counts as OOM (default: the free memory less 1 GB)")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)


def _log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def _config(args: argparse.Namespace) -> Dict:
    from ._backend import resolve_backend
    from .data import resolve_data_dir

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1; got {args.repeats}")
    if args.block_seconds < 0:
        raise ValueError(f"--block-seconds must be >= 0; got {args.block_seconds}")
    device = torch.device(args.device)
    heads, channels = DEFAULT_HC[device.type]
    heads = args.heads if args.heads is not None else heads
    channels = args.channels if args.channels is not None else channels
    if heads < 1 or channels < 1:
        raise ValueError(f"--heads and --channels must be >= 1; got {heads}, {channels}")
    resolved = resolve_backend(args.backend, device).name
    return {
        "layers": list(LAYERS) if args.layer == "all" else [args.layer],
        "graph": args.graph, "device": args.device, "heads": heads, "channels": channels,
        "dtype": args.dtype, "backend": args.backend, "backend_resolved": resolved,
        "repeats": args.repeats, "block_s": args.block_seconds, "warmup": max(1, args.warmup),
        "memory": args.memory,
        "passes": list(PASSES) if args.passes == "both" else [args.passes],
        "seed": args.seed, "threads": torch.get_num_threads(),
        "data_dir": str(resolve_data_dir(args.data_dir)),
        "mem_budget_bytes": (int(args.mem_budget_gb * 2**30) if args.mem_budget_gb else None),
    }


def run(args: argparse.Namespace) -> int:
    """Run a comparison (see the module docstring). Returns the exit status:
    0 done, 1 an implementation disagreed with PyG or failed with an error
    other than OOM, 2 bad arguments."""
    if getattr(args, "_child", None):
        return _child_main(args._child)
    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"gatlib compare: error: {exc}", file=sys.stderr)
        return 2
    device, dtype = torch.device(cfg["device"]), DTYPES[cfg["dtype"]]
    try:
        graph = load_graph(cfg["graph"], Path(cfg["data_dir"]), cfg["seed"])
    except (ValueError, FileNotFoundError) as exc:  # incl. gatlib.data.DatasetNotFoundError
        print(f"gatlib compare: error: {exc}", file=sys.stderr)
        return 2
    N, F = graph.x.shape
    x = graph.x.to(device, dtype).requires_grad_()
    ei = graph.edge_index.to(device)
    ei_loops = _with_self_loops(ei, N)
    report = {
        "schema": SCHEMA,
        "command": _command_line(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": cfg,
        "environment": environment(device),
        "graph": {
            "name": graph.name, "source": graph.source, "params": graph.params,
            "num_nodes": N, "num_features": F, "num_edges": ei.size(1),
            "num_edges_with_self_loops": ei_loops.size(1),
            "self_loops": "GATConv/GATv2Conv add one self-loop per node themselves "
                          "(add_self_loops=True); TransformerConv is given edge_index with "
                          "the same self-loops added, so every layer attends over "
                          "num_edges_with_self_loops edges",
        },
        "checks": {}, "measurements": [], "parent_mem_budget_bytes": {},
    }
    _log(f"graph {graph.name}: N={N:,} E={ei.size(1):,} (+{N:,} self-loops) F={F}; "
         f"H={cfg['heads']} C={cfg['channels']} {cfg['dtype']} {device}, "
         f"gatlib backend {cfg['backend']} -> {cfg['backend_resolved']}")
    status = 0
    report["summary"] = []
    with tempfile.TemporaryDirectory(prefix="gatlib-compare-") as tmp:
        workdir = Path(tmp)
        if cfg["memory"] and device.type == "cpu":
            torch.save({"x": graph.x.to(dtype), "edge_index": graph.edge_index,
                        "edge_index_loops": ei_loops.cpu()}, workdir / "inputs.pt")
        for layer in cfg["layers"]:
            # On CPU this process, too, stays within the free memory: a PyG layer that
            # does not fit is then an OOM result instead of a SIGKILL for the whole run.
            with (memory_budget(cfg["mem_budget_bytes"]) if device.type == "cpu"
                  else contextlib.nullcontext()) as budget:
                report["parent_mem_budget_bytes"][layer] = budget
                rc = _compare_layer(layer, cfg, report, x, ei, ei_loops, device, dtype, workdir)
            status = max(status, rc)
            if args.json:  # after every layer: a long run that dies keeps what it measured
                _write_json(report, args.json, complete=False)
            if rc == 1 and report["checks"].get(layer, {}).get("status") != "ok":
                break  # a disagreement aborts the run
    report["summary"] = summarize(report["measurements"])
    print(format_table(report))
    if args.json:
        _write_json(report, args.json, complete=True)
        _log(f"wrote {args.json}")
    return status


def _command_line() -> str:
    prog = Path(sys.argv[0]).name
    if prog == "compare.py":  # python -m gatlib.compare
        prog = "python -m gatlib.compare"
    elif prog in ("cli.py", "__main__.py"):
        prog = "python -m gatlib.cli"
    return " ".join([prog, shlex.join(sys.argv[1:])])


def _write_json(report: Dict, path: str, complete: bool) -> None:
    report["summary"] = summarize(report["measurements"])
    report["complete"] = complete
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)


def _compare_layer(layer: str, cfg: Dict, report: Dict, x: Tensor, ei: Tensor,
                   ei_loops: Tensor, device: torch.device, dtype: torch.dtype,
                   workdir: Path) -> int:
    N, F = x.shape
    H, C = cfg["heads"], cfg["channels"]
    name = LAYERS[layer]
    layers = build_pair(layer, F, H, C, cfg["backend"], device, dtype, cfg["seed"])
    edge_index = layer_edge_index(layer, ei, ei_loops)
    grad_out = _grad_out(N, H * C, dtype, device, cfg["seed"])
    passes = {(impl, p): _make_pass(layers[impl], x, edge_index, grad_out, p)
              for impl in IMPLS for p in cfg["passes"]}
    rc = 0

    # 1. Memory first: on CPU it tells which implementation fits before this process tries.
    memory: Dict = {}
    if cfg["memory"]:
        for (impl, p), fn in passes.items():
            _log(f"{name}: peak memory, {impl}, {p}")
            if device.type == "cuda":
                memory[impl, p] = peak_cuda(fn, device)
            else:
                spec = {"inputs": str(workdir / "inputs.pt"), "layer": layer, "impl": impl,
                        "pass": p, "heads": H, "channels": C, "dtype": cfg["dtype"],
                        "backend": cfg["backend"], "seed": cfg["seed"],
                        "threads": cfg["threads"], "mem_budget_bytes": cfg["mem_budget_bytes"]}
                memory[impl, p] = peak_rss_child(spec, workdir)
            if memory[impl, p]["status"] == "error":
                rc = 1
                _log(f"  error: {memory[impl, p]['error']}")
    # On CPU, running what did not fit in a child would take this process down.
    too_big = ({k for k, m in memory.items() if m["status"] == "OOM"}
               if device.type == "cpu" else set())

    # 2. Agreement, unless one side does not fit.
    if any(m["status"] == "OOM" for m in memory.values()):
        check = {"status": "skipped", "reason": "an implementation ran out of memory"}
    else:
        _log(f"{name}: checking agreement with torch_geometric.nn.{name}")
        try:
            check = check_agreement(layers, x, edge_index, grad_out)
        except Exception as exc:  # noqa: BLE001
            check = {**_failure(exc), "status": "skipped" if _is_oom(exc) else "error"}
            _release(device)
    report["checks"][layer] = check
    if check["status"] in ("mismatch", "error"):
        if check["status"] == "mismatch":
            detail = (f"output rel. error {check['forward_rel_err']:.2e} "
                      f"(tol {check['tol_forward']:.1e}), input-gradient rel. error "
                      f"{check['input_grad_rel_err']:.2e} (tol {check['tol_input_grad']:.1e})")
        else:
            detail = check["error"]
        print(f"gatlib compare: gatlib.{name}(backend={cfg['backend']!r}) does not agree with "
              f"torch_geometric.nn.{name} on {report['graph']['name']} "
              f"({cfg['dtype']}, {device}): {detail}. Not timing it.", file=sys.stderr)
        return 1

    # 3. Time.
    for p in cfg["passes"]:
        fns = {impl: passes[impl, p] for impl in IMPLS if (impl, p) not in too_big}
        _log(f"{name}: timing {p} ({', '.join(fns) or 'nothing fits'}), {cfg['repeats']} rounds")
        times = (time_interleaved(fns, device, cfg["repeats"], cfg["warmup"], cfg["block_s"])
                 if fns else {})
        for impl in IMPLS:
            t = times.get(impl) or {"status": "OOM", "error": "not run in this process: out of "
                                    "memory in its fresh-process memory measurement"}
            if t["status"] == "error":
                rc = 1
                _log(f"  {impl} error: {t['error']}")
            entry = {"layer": layer, "impl": impl, "pass": p, "time": t}
            if (impl, p) in memory:
                entry["memory"] = memory[impl, p]
            report["measurements"].append(entry)
    del layers, passes
    _release(device)
    return rc


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m gatlib.compare``: same options as ``gatlib compare``."""
    parser = argparse.ArgumentParser(
        prog="python -m gatlib.compare",
        description="Compare gatlib's GATConv/GATv2Conv/TransformerConv with PyG's: "
                    "agreement, time and peak memory.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
