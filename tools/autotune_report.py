"""What the Triton row kernels' autotuner measured on a GPU: every config's time per tuning key,
the choice, the default's time beside it, and per knob (``BLOCK_R``, ``STAGES``) how often each
value won or came within 5% of the best: the measurement that decides what a space keeps and
which config is the default.

Reads the GPU run's ``autotune.json`` (``tools.gpu_run``: the ``*.autotune.json`` files of
Triton's autotune cache, one per kernel and key, in one list)::

    python -m tools.autotune_report benchmarks/results/<gpu>_<date>/autotune.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

from gatlib.bench.report import format_table
from tools import internals

KNOBS = ("BLOCK_R", "STAGES")
NEAR = 1.05  # a config "near the best": within 5% of the key's fastest


def _consts(name: str, key: List) -> Dict:
    """A launch's constexprs as far as its tuning key holds them (then Triton's dtypes)."""
    keys = internals.triton_tuners()[name].keys
    return dict(zip(keys, key[:len(keys)], strict=True))


def _label(cfg: Dict) -> str:
    return f"R{cfg['kwargs']['BLOCK_R']} S{cfg['kwargs']['STAGES']} w{cfg['num_warps']}"


def read(entries: List[Dict]) -> List[Dict]:
    """One record per (kernel, key) of ``entries`` (``autotune.json``'s): its configs with their
    median times over the fastest's, and which is the default."""
    records = []
    for entry in entries:
        name, key = entry["kernel"], entry["key"]
        default = internals.triton_default_config(name, _consts(name, key))
        configs = []
        for cfg, times in entry["configs_timings"]:
            configs.append({"label": _label(cfg), "kwargs": cfg["kwargs"], "num_warps": cfg["num_warps"],
                            "ms": times[0], "default": cfg["kwargs"] == default.kwargs
                            and cfg["num_warps"] == default.num_warps})
        best = min(c["ms"] for c in configs)
        for c in configs:
            c["over_best"] = c["ms"] / best if best > 0 else math.inf
        configs.sort(key=lambda c: c["ms"])
        records.append({"kernel": name, "key": _consts(name, key),
                        "key_values": key, "configs": configs,
                        "default_over_best": next((c["over_best"] for c in configs if c["default"]), None)})
    return records


def knob_wins(records: List[Dict]) -> Dict[str, Dict[str, List[int]]]:
    """Per kernel and knob value: ``[keys where it won, keys where it came within 5%]``."""
    out: Dict[str, Dict[str, List[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in records:
        for knob in KNOBS:
            won, near = set(), set()
            for c in r["configs"]:
                v = f"{knob}={c['kwargs'][knob]}"
                if c is r["configs"][0]:
                    won.add(v)
                if c["over_best"] <= NEAR:
                    near.add(v)
            for v in won:
                out[r["kernel"]][v][0] += 1
            for v in near:
                out[r["kernel"]][v][1] += 1
    return {k: dict(v) for k, v in out.items()}


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(prog="python -m tools.autotune_report", description=__doc__.split("\n\n")[0])
    p.add_argument("autotune", type=Path, help="the GPU run's autotune.json")
    p.add_argument("--json", type=Path, default=None, help="write the records here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    records = read(json.loads(args.autotune.read_text()))
    rows = [[r["kernel"], " ".join(f"{k}={v}" for k, v in r["key"].items()), c["label"],
             f"{c['ms']:.3f}", f"{c['over_best']:.2f}", "default" if c["default"] else ""]
            for r in records for c in r["configs"]]
    print(format_table(["kernel", "key", "config", "ms", "x best", ""], rows, align="<<<>><"))
    defaults = [r["default_over_best"] for r in records if r["default_over_best"] is not None]
    if defaults:
        print(f"\nthe default: {statistics.median(defaults):.2f}x the best (median over "
              f"{len(defaults)} keys), at worst {max(defaults):.2f}x")
    for kernel, wins in knob_wins(records).items():
        print(f"{kernel}: " + ", ".join(f"{v} won {w}, within 5% {n}" for v, (w, n) in sorted(wins.items())))
    if args.json:
        args.json.write_text(json.dumps({"records": records, "knob_wins": knob_wins(records)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
