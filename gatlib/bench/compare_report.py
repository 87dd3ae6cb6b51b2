"""What a ``gatlib compare`` report holds and how it prints: the implementations
and layers it compares, the summary of its measurements (ratios of median
times and peak memories) and its tables — also what ``benchmarks/compare_table.py``
and ``benchmarks/floor_table.py`` render from a saved report."""
from __future__ import annotations

import statistics
from typing import Dict, Iterator, List, Optional, Tuple

from . import floor
from .report import format_table

LAYERS = {"gat": "GATConv", "gatv2": "GATv2Conv", "transformer": "TransformerConv"}
IMPLS = ("pyg", "gatlib")  # eager; --no-compile runs these
COMPILED_IMPLS = ("pyg_compiled", "gatlib_compiled")  # torch.compile of the same modules
ALL_IMPLS = ("pyg", "pyg_compiled", "gatlib", "gatlib_compiled")  # --compile; table order
IMPL_LABELS = {"pyg": "PyG", "pyg_compiled": "compiled PyG", "gatlib": "gatlib",
               "gatlib_compiled": "compiled gatlib"}


def is_compiled(impl: str) -> bool:
    return impl.endswith("_compiled")


def precision(config: Dict) -> str:
    """A report's dtype, with the autocast dtype and determinism where its run set them."""
    return (config["dtype"] + (f" (autocast {config['autocast']})" if config.get("autocast") else "")
            + (", deterministic" if config.get("deterministic") else ""))


# Summary and table
# summary key -> (numerator, denominator): ratios of median times, "<key>_rounds" per round.
TIME_RATIOS = {
    "speedup": ("pyg", "gatlib"),  # > 1: eager gatlib faster than eager PyG
    "speedup_compiled": ("pyg_compiled", "gatlib_compiled"),
    "speedup_vs_pyg_compiled": ("pyg_compiled", "gatlib"),  # eager gatlib vs compiled PyG
    "gatlib_compiled_over_eager": ("gatlib_compiled", "gatlib"),  # < 1: compiling helps
    "pyg_compiled_over_eager": ("pyg_compiled", "pyg"),
}
# ... and of peak extra memory
MEMORY_RATIOS = {
    "mem_ratio": ("gatlib", "pyg"),  # < 1: gatlib needs less
    "mem_ratio_compiled": ("gatlib_compiled", "pyg_compiled"),
    "gatlib_compiled_over_eager_mem": ("gatlib_compiled", "gatlib"),
}


def _median(m: Optional[Dict]) -> Optional[float]:
    return (m or {}).get("time", {}).get("median_s") or None


def _peak(m: Optional[Dict]) -> Optional[int]:
    mem = (m or {}).get("memory")
    return mem["peak_extra_bytes"] if mem and mem.get("status") == "ok" else None


def summarize(measurements: List[Dict]) -> List[Dict]:
    """Per (layer, pass) with both eager sides: medians, peak extra memory, the ratios of
    :data:`TIME_RATIOS` and :data:`MEMORY_RATIOS` (``None`` where a side is missing) and per-round time ratios."""
    by = {(m["layer"], m["impl"], m["pass"]): m for m in measurements}
    rows = []
    for layer, p in dict.fromkeys((m["layer"], m["pass"]) for m in measurements):
        if (layer, "pyg", p) not in by or (layer, "gatlib", p) not in by:
            continue
        sides = {impl: by[layer, impl, p] for impl in ALL_IMPLS if (layer, impl, p) in by}
        row: Dict = {"layer": layer, "pass": p,
                     "median_s": {impl: _median(m) for impl, m in sides.items()},
                     "peak_extra_bytes": {impl: _peak(m) for impl, m in sides.items()}}
        for key, (num, den) in TIME_RATIOS.items():
            a, b = sides.get(num), sides.get(den)
            ta, tb = _median(a), _median(b)
            row[key] = ta / tb if ta and tb else None
            # Per-round ratios pair measurements taken seconds apart, under the same
            # load; their spread shows how far to trust the ratio on a shared machine.
            paired = row[key] is not None and len(a["time"]["times_s"]) == len(b["time"]["times_s"])
            row[f"{key}_rounds"] = ([x / y for x, y in zip(a["time"]["times_s"], b["time"]["times_s"],
                                                          strict=True)] if paired else [])
        row["speedup_paired_median"] = (statistics.median(row["speedup_rounds"])
                                        if row["speedup_rounds"] else None)
        for key, (num, den) in MEMORY_RATIOS.items():
            ma, mb = _peak(sides.get(num)), _peak(sides.get(den))
            row[key] = ma / mb if ma is not None and mb is not None and mb > 0 else None
        rows.append(row)
    return rows


def _fmt_ms(r: Optional[Dict]) -> str:
    return _measured(r, "median_s", 1e3)


def _fmt_mib(r: Optional[Dict]) -> str:
    return _measured(r, "peak_extra_bytes", 2**-20)


def _measured(r: Optional[Dict], key: str, scale: float) -> str:
    """``r[key] * scale`` of a time or memory measurement ``r``; its status where it failed."""
    if r and r.get("status") != "ok":
        return r.get("status", "-")
    return _seconds((r or {}).get(key), scale)


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _spread(row: Dict, key: str = "speedup") -> str:
    r = row.get(f"{key}_rounds") or []
    return f"{min(r):.2f}-{max(r):.2f}" if r else "-"


def _seconds(s: Optional[float], scale: float = 1.0, fmt: str = ",.1f") -> str:
    return "-" if s is None else f"{s * scale:{fmt}}"


def has_compiled(report: Dict) -> bool:
    """Whether a report holds compiled sides (``--compile``, schema gatlib.compare/3)."""
    return any(is_compiled(m["impl"]) for m in report["measurements"])


# The eager table: reports without compiled sides (--no-compile, schema 2 and older).
TABLE_HEADERS = ["layer", "pass", "PyG ms", "gatlib ms", "gatlib 1st ms", "speedup", "rounds",
                 "PyG MiB", "gatlib MiB", "mem"]
# With compiled sides, time and memory get a table each ("comp." = torch.compile'd).
TIME_HEADERS = ["layer", "pass", "PyG ms", "PyG comp. ms", "gatlib ms", "gatlib comp. ms",
                "speedup", "rounds", "speedup comp.", "rounds comp.", "vs PyG comp.",
                "gatlib comp./eager"]
MEMORY_HEADERS = ["layer", "pass", "PyG MiB", "PyG comp. MiB", "gatlib MiB", "gatlib comp. MiB",
                  "mem", "mem comp.", "gatlib comp./eager"]
FIRST_CALL_HEADERS = ["layer", "pass", "gatlib 1st ms", "PyG comp. 1st s", "gatlib comp. 1st s",
                      "graphs PyG/gatlib", "graph breaks PyG/gatlib"]


def _summary(report: Dict) -> Iterator[Tuple[Dict, Dict[str, Dict]]]:
    """``(summary row, {implementation: its measurement or {}})`` per (layer, pass)."""
    by = {(m["layer"], m["impl"], m["pass"]): m for m in report["measurements"]}
    for row in report["summary"]:
        yield row, {impl: by.get((row["layer"], impl, row["pass"])) or {} for impl in ALL_IMPLS}


def table_rows(report: Dict) -> List[List[str]]:
    """One row per (layer, pass) of a report, in the columns of :data:`TABLE_HEADERS`
    (eager PyG and gatlib; also what ``benchmarks/compare_table.py`` renders)."""
    return [[LAYERS[row["layer"]], row["pass"], _fmt_ms(s["pyg"].get("time")),
             _fmt_ms(s["gatlib"].get("time")), _seconds(s["gatlib"].get("first_call_s"), 1e3),
             _ratio(row["speedup"]), _spread(row), _fmt_mib(s["pyg"].get("memory")),
             _fmt_mib(s["gatlib"].get("memory")), _ratio(row["mem_ratio"])]
            for row, s in _summary(report)]


def time_rows(report: Dict) -> List[List[str]]:
    """Rows of :data:`TIME_HEADERS`: the four median times and their ratios."""
    return [[LAYERS[row["layer"]], row["pass"],
             *(_fmt_ms(s[impl].get("time")) for impl in ALL_IMPLS),
             _ratio(row["speedup"]), _spread(row),
             _ratio(row.get("speedup_compiled")), _spread(row, "speedup_compiled"),
             _ratio(row.get("speedup_vs_pyg_compiled")),
             _ratio(row.get("gatlib_compiled_over_eager"))]
            for row, s in _summary(report)]


def memory_rows(report: Dict) -> List[List[str]]:
    """Rows of :data:`MEMORY_HEADERS`: the four peaks and their ratios."""
    return [[LAYERS[row["layer"]], row["pass"],
             *(_fmt_mib(s[impl].get("memory")) for impl in ALL_IMPLS),
             _ratio(row["mem_ratio"]), _ratio(row.get("mem_ratio_compiled")),
             _ratio(row.get("gatlib_compiled_over_eager_mem"))]
            for row, s in _summary(report)]


def first_call_rows(report: Dict) -> List[List[str]]:
    """Rows of :data:`FIRST_CALL_HEADERS`, for the passes with a first call recorded:
    eager gatlib's on a fresh graph input, and each compiled side's (compiling)."""
    rows = []
    for row, s in _summary(report):
        if not any("first_call_s" in s[impl] for impl in ("gatlib", *COMPILED_IMPLS)):
            continue
        comp = report.get("compile", {}).get(row["layer"], {})
        count = {key: "/".join(str(comp.get(impl, {}).get(key, "-")) for impl in COMPILED_IMPLS)
                 for key in ("graphs", "graph_breaks")}
        rows.append([LAYERS[row["layer"]], row["pass"],
                     _seconds(s["gatlib"].get("first_call_s"), 1e3),
                     _seconds(s["pyg_compiled"].get("first_call_s"), fmt=",.2f"),
                     _seconds(s["gatlib_compiled"].get("first_call_s"), fmt=",.2f"),
                     count["graphs"], count["graph_breaks"]])
    return rows


def report_tables(report: Dict) -> List[Tuple[str, List[str], List[List[str]], str]]:
    """``(title, headers, rows, align)`` of each table of a report: with compiled
    sides, time, memory and first calls; else the eager table."""
    if not has_compiled(report):
        return [("", TABLE_HEADERS, table_rows(report), "<<" + ">" * 8)]
    return [
        ("time (medians)", TIME_HEADERS, time_rows(report), "<<" + ">" * 10),
        ("peak extra memory", MEMORY_HEADERS, memory_rows(report), "<<" + ">" * 7),
        ("first call (a compiled side's compiles)", FIRST_CALL_HEADERS, first_call_rows(report),
         "<<" + ">" * 5),
    ]


def render_table(report: Dict) -> str:
    """The plain-text report printed at the end of a run."""
    g, c, env = report["graph"], report["config"], report["environment"]

    def kernels(key):
        return "; ".join(f"{LAYERS[k]} {', '.join(v) or '-'}"
                         for k, v in report.get(key, {}).items())

    what = ("one layer" if c["scope"] == "layer" else
            f"training step of a 2-layer model ({c['classes']} classes, Adam)")
    compiled = has_compiled(report)
    lines = [
        f"graph {g['name']}: N={g['num_nodes']:,}, E={g['num_edges']:,} "
        f"(undirected, no self-loops), E+N={g['num_edges_with_self_loops']:,} attended, "
        f"F={g['num_features']}",
        f"{what}, H={c['heads']} C={c['channels']} {precision(c)} on {env['device_name']} "
        f"(threads={env['num_threads']}); gatlib backend={c['backend']}, "
        f"graph input {c['graph_input']}",
        f"gatlib kernels: {kernels('kernels') or '-'}",
        *([f"gatlib compiled kernels: {kernels('kernels_compiled') or '-'}; torch.compile("
           + ", ".join(f"{k}={v!r}" for k, v in c.get("compile_options", {}).items()) + ")"]
          if compiled else []),
        *([("gatlib plan (built once, an input like PyG's edge_index; not in 'gatlib MiB'): "
            + "; ".join(f"{LAYERS[k]} {v / 2**20:,.1f} MiB"
                        for k, v in report.get("plan_bytes", {}).items()))]
          if report.get("plan_bytes") else []),
        ("speedup = PyG time / gatlib time, eager (medians; rounds: range of the per-round "
         "ratios); speedup comp. = the same, both compiled; vs PyG comp. = compiled PyG / "
         "eager gatlib; gatlib comp./eager = compiled / eager gatlib; mem = gatlib peak extra "
         "/ PyG's; 1st = the first call: eager gatlib's on a freshly built graph input, a "
         "compiled side's its first in this process (compiling)" if compiled else
         "speedup = PyG time / gatlib time (medians; rounds: range of the per-round ratios); "
         "gatlib 1st = its first call on a freshly built graph input; "
         "mem = gatlib peak extra / PyG peak extra"),
    ]
    for title, headers, rows, align in report_tables(report):
        lines += ["", *([title] if title else []), format_table(headers, rows, align=align)]
    floor_rows = floor.report_rows(report, LAYERS)  # CUDA, one layer: none on CPU
    if floor_rows:
        lines += ["", floor.report_note(report),
                  format_table(floor.HEADERS, floor_rows, align="<<<" + ">" * 9)]
    return "\n".join(lines)
