"""Each pass of a recorded GPU run against its bandwidth floor, as one Markdown table.

Usage::

    python benchmarks/floor_table.py benchmarks/results/selftest_h100.json --graph arxiv-like

Reads ``gatlib selftest`` JSONs (their comparisons) and ``gatlib compare`` JSONs
(CUDA: one layer, or the 2-layer model's training step) and prints, per (graph,
layer, pass), the floor that :mod:`gatlib.bench.floor` computes from the graph and configuration the JSON
records, at the device's published peak bandwidth (``--bandwidth published``)
or at the copy bandwidth the run measured (``--bandwidth copy``, only in runs
made since the floor was added), beside gatlib's and PyG's median times
divided by it. Where the run recorded no float32 matmul precision, torch's
default (FP32 GEMMs) is assumed: the harness never changes it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Optional

from gatlib.bench import floor
from gatlib.bench.compare_report import IMPL_LABELS, LAYERS
from gatlib.bench.report import format_table


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", type=Path, help="selftest or compare JSON files")
    p.add_argument("--graph", action="append", default=None,
                   help="only this graph; repeat for several (default: every graph)")
    p.add_argument("--bandwidth", default="published", choices=["published", "copy"],
                   help="which bandwidth the floor is taken at (default: published)")
    return p


def reports(path: Path) -> List[Dict]:
    """The compare reports in a selftest or compare JSON."""
    data = json.loads(path.read_text())
    if "comparisons" in data:
        return [c["report"] for c in data["comparisons"] if c.get("report")]
    return [data]


def _ms(s: Optional[float]) -> str:
    return "-" if not s else f"{s * 1e3:,.1f}"


def _over(s: Optional[float], seconds) -> str:
    return "-" if not s else f"{s / seconds[0]:.1f} / {s / seconds[1]:.1f}"


def render(paths: List[Path], graphs: Optional[List[str]] = None,
           bandwidth: str = "published") -> str:
    headers = ["graph", "layer", "pass", "floor ms lo / hi", *(
        h for impl in floor.IMPLS for h in (f"{IMPL_LABELS[impl]} ms", "÷ floor lo / hi"))]
    rows, notes = [], {}
    for path in paths:
        for rep in reports(path):
            if graphs and rep.get("graph", {}).get("name") not in graphs:
                continue
            for r in floor.report_floors(rep):
                if not r["bandwidth"].endswith(bandwidth):
                    continue
                notes.setdefault(floor.report_note(rep), {})[path.name] = None
                lo, hi = r["seconds"]
                rows.append([rep["graph"]["name"], LAYERS[r["layer"]], r["pass"],
                             f"{lo * 1e3:.2f} / {hi * 1e3:.2f}",
                             *(cell for impl in floor.IMPLS for cell in (
                                 _ms(r["median_s"][impl]), _over(r["median_s"][impl], (lo, hi))))])
    if not rows:
        return f"no CUDA pass in these files has a {bandwidth} bandwidth\n"
    # columns of sides that no file measured say nothing: leave them out
    keep = [i for i, _ in enumerate(headers) if i < 4 or any(row[i] != "-" for row in rows)]
    table = format_table([headers[i] for i in keep], [[row[i] for i in keep] for row in rows],
                         align="<<<" + ">" * (len(keep) - 3), markdown=True)
    return "\n\n".join([*(f"{note} ({', '.join(files)})." for note, files in notes.items()),
                        table]) + "\n"


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    print(render(args.paths, args.graph, args.bandwidth), end="")


if __name__ == "__main__":
    main()
