"""Render every ``gatlib compare`` JSON in a folder as one Markdown report.

Usage::

    python benchmarks/compare_table.py [--results benchmarks/results] [--out .../compare.md]

One section per JSON file (graph, device, configuration, environment, the
agreement check, a table of times and peak extra memory; for reports with the
compiled sides, schema gatlib.compare/3, a table of times, one of memory and one
of first calls), preceded by a summary of the training passes (a layer's
forward+backward, a model's train_step) across all files. Rows of a run in the
project's CPU target setting (arxiv-like, H=4, C=64, float32, CPU, the graph given
as a plan) are marked against its targets (TARGET_BY_PASS): a layer's
forward+backward at least 4.5x faster than PyG's with at most a tenth of its peak
extra memory, a 2-layer model's training step at least 3.5x faster; and, where the
compiled sides were measured (TARGET_COMPILED), a compiled training step at least
3x faster than compiled PyG's, taking at most 1.15x the time and 1.3x the peak
memory of eager gatlib's.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional

from gatlib.bench.compare_report import IMPL_LABELS, LAYERS, has_compiled, precision, report_tables
from gatlib.bench.report import format_table

# The target setting; with a fresh edge_index per call (graph_input "tensor") every call
# also derives its plan, which docs/benchmarks.md reports beside the target, not against it.
TARGET = {"graph": "arxiv-like", "device": "cpu", "heads": 4, "channels": 64, "dtype": "float32", "autocast": None,
          "graph_input": "plan"}
# pass -> (least speedup, largest memory ratio or None)
TARGET_BY_PASS = {"forward+backward": (4.5, 0.1), "train_step": (3.5, None)}
# pass -> least speedup_compiled, largest gatlib_compiled_over_eager (time), and the same
# for peak memory (gatlib_compiled_over_eager_mem)
TARGET_COMPILED = {"train_step": (3.0, 1.15, 1.3)}


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _is_target(rep: Dict) -> bool:
    c = rep["config"]
    return all(c.get(k) == v for k, v in TARGET.items())


def _backend(rep: Dict) -> str:
    """The requested backend and what ran: the kernels the report recorded (schema 2)
    or, in older reports, the backend it resolved to."""
    c = rep["config"]
    kernels = [k for ks in (rep.get("kernels") or {}).values() for k in ks if "." not in k]
    ran = "+".join(dict.fromkeys(kernels)) or c.get("backend_resolved") or "?"
    return f"{c['backend']} ({ran})"


def _errors(ch: Dict) -> str:
    errs = [f"{label} {ch[key]:.1e}" for key, label in (
        ("forward_rel_err", "out"), ("input_grad_rel_err", "grad"),
        ("loss_rel_err", "loss"), ("weight_grad_rel_err", "weight grad")) if key in ch]
    return f"{ch['status']}" + (f" ({', '.join(errs)})" if errs else "")


def _check(layer: str, ch: Dict) -> str:
    compiled = "; ".join(f"{IMPL_LABELS[impl]} {_errors(c)}"
                         for impl, c in (ch.get("compiled") or {}).items())
    return f"{LAYERS[layer]} {_errors(ch)}" + (f"; {compiled}" if compiled else "")


def _verdict(row: Dict) -> str:
    """Against the CPU target for this pass (TARGET_BY_PASS; "" for a pass without one)."""
    if row["pass"] not in TARGET_BY_PASS:
        return ""
    speed, mem = TARGET_BY_PASS[row["pass"]]
    if row["speedup"] is None or (mem is not None and row["mem_ratio"] is None):
        return "n/a"
    ok = row["speedup"] >= speed and (mem is None or row["mem_ratio"] <= mem)
    return "met" if ok else "not met"


def _verdict_compiled(row: Dict) -> str:
    """Against TARGET_COMPILED for this pass ("" for a pass without one or a report
    without compiled sides)."""
    if row["pass"] not in TARGET_COMPILED or "speedup_compiled" not in row:
        return ""
    speed, time_over, mem_over = TARGET_COMPILED[row["pass"]]
    values = (row["speedup_compiled"], row["gatlib_compiled_over_eager"],
              row["gatlib_compiled_over_eager_mem"])
    if any(v is None for v in values):
        return "n/a"
    ok = values[0] >= speed and values[1] <= time_over and values[2] <= mem_over
    return "met" if ok else "not met"


def _target_text(p: str) -> str:
    speed, mem = TARGET_BY_PASS[p]
    return f"{p}: ≥{speed:g}x" + (f", ≤{mem:g}x memory" if mem is not None else "")


def _section(name: str, rep: Dict) -> List[str]:
    c, g, env = rep["config"], rep["graph"], rep["environment"]
    v = env["versions"]
    lines = [
        f"## {name}",
        "",
        f"- command: `{rep['command']}`",
        f"- graph: **{g['name']}**, N={g['num_nodes']:,}, E={g['num_edges']:,} (undirected, no "
        f"self-loops), {g['num_edges_with_self_loops']:,} edges attended with self-loops, "
        f"F={g['num_features']} — {g['source']}",
        f"- {_scope(c)}, H={c['heads']}, C={c['channels']}, {precision(c)}, backend "
        f"{_backend(rep)}, gatlib's graph input: "
        f"{c.get('graph_input', 'edge_index, derived state cached on it (older report)')}, "
        f"{c['repeats']} interleaved rounds (median)",
        f"- {env['device_name']}, {env['num_threads']} threads; torch {v['torch']}, "
        f"torch_geometric {v['torch_geometric']}, gatlib {v['gatlib']}, "
        f"torch_scatter {v.get('torch_scatter')}, triton {v.get('triton')}; "
        f"git {str(env.get('git_sha'))[:10]}{' (dirty)' if env.get('git_dirty') else ''}; "
        f"{rep['timestamp']}",
        "",
    ]
    checks = ", ".join(_check(k, ch) for k, ch in rep["checks"].items())
    lines += [f"Agreement with PyG (norm-wise relative error): {checks}", ""]
    for i, (title, header, rows, align) in enumerate(report_tables(rep)):
        if i == 0 and _is_target(rep):  # the verdicts beside the times
            header = [*header, "target (" + "; ".join(_target_text(p) for p in TARGET_BY_PASS)
                      + ")"]
            rows = [row + [_verdict(r)] for row, r in zip(rows, rep["summary"], strict=True)]
            align += "<"
        lines += [*([f"**{title}**", ""] if title else []),
                  format_table(header, rows, align=align, markdown=True), ""]
    return lines


def _scope(c: Dict) -> str:
    if c.get("scope", "layer") == "layer":
        return "one layer"
    return f"training step of a 2-layer model ({c['classes']} classes, Adam)"


def render(paths: List[Path]) -> str:
    """The Markdown report for the compare JSON files ``paths``."""
    reps = [(p.stem, json.loads(p.read_text())) for p in paths]
    lines = [
        "# gatlib vs PyTorch Geometric",
        "",
        "Generated by `benchmarks/compare_table.py` from `benchmarks/results/compare_*.json` "
        "(written by `gatlib compare`). speedup = PyG time / gatlib time (>1: gatlib faster); "
        "mem ratio = gatlib peak extra memory / PyG's (<1: gatlib smaller). forward = "
        "inference (`no_grad`); forward+backward = one training step of the layer. Peak extra "
        "memory: CUDA `max_memory_allocated` minus what was allocated before the call; CPU "
        "`VmHWM` − `VmRSS` before the call in a fresh process per measurement. Times on the "
        "shared 2-core CPU machines are noisy; the ratios are measured interleaved "
        "(A B B A) in one process; *per-round* is the range of the PyG/gatlib ratios of the "
        "individual rounds. *gatlib 1st*: gatlib's first forward+backward (or training step) on "
        "a freshly built graph input (reports since schema gatlib.compare/2).",
        "",
    ]
    compiled = any(has_compiled(rep) for _, rep in reps)
    if compiled:
        lines += [
            "Reports since schema gatlib.compare/3 also time both layers under `torch.compile` "
            "(*comp.*: the same modules, torch.compile's defaults): *speedup comp.* = compiled "
            "PyG / compiled gatlib; *vs PyG comp.* = compiled PyG / eager gatlib (what an eager "
            "gatlib user gains over a compiled-PyG user); *gatlib comp./eager* = compiled / "
            "eager gatlib, time and memory. A compiled side's *1st* is its first call, which "
            "compiles (with torch's compile caches as they were: the JSON counts their hits).",
            "",
        ]
    lines += ["## Summary: training passes (forward+backward, train_step)", ""]
    rows = []
    for _, rep in reps:
        c = rep["config"]
        for r in rep["summary"]:
            if r["pass"] not in ("forward+backward", "train_step"):
                continue
            row = [c["graph"], c.get("graph_input", "-"), c["device"], _backend(rep),
                   f"{c['heads']}x{c['channels']}", precision(c), LAYERS[r["layer"]],
                   r["pass"], _x(r["speedup"]), _x(r["mem_ratio"]),
                   _verdict(r) if _is_target(rep) else ""]
            if compiled:
                row += [_x(r.get("speedup_compiled")), _x(r.get("speedup_vs_pyg_compiled")),
                        _x(r.get("gatlib_compiled_over_eager")),
                        _x(r.get("gatlib_compiled_over_eager_mem")),
                        _verdict_compiled(r) if _is_target(rep) else ""]
            rows.append(row)
    header = ["graph", "input", "device", "backend", "HxC", "dtype", "layer", "pass",
              "speedup", "mem ratio", "CPU target"]
    align = "<" * 8 + ">>" + "<"
    if compiled:
        header += ["speedup comp.", "vs PyG comp.", "gatlib comp./eager",
                   "gatlib comp./eager mem", "compiled target"]
        align += ">>>><"
    lines.append(format_table(header, rows, align=align, markdown=True))
    lines.append("")
    for name, rep in reps:
        lines += _section(name, rep)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    here = Path(__file__).resolve().parent / "results"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=here, help="folder of compare_*.json")
    parser.add_argument("--out", type=Path, default=None,
                        help="Markdown file (default: <results>/compare.md)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    paths = sorted(args.results.glob("compare_*.json"))
    if not paths:
        parser.error(f"no compare_*.json in {args.results}")
    out = args.out or args.results / "compare.md"
    out.write_text(render(paths))
    print(f"wrote {out} ({len(paths)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
