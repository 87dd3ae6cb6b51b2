"""What the Triton row kernels' autotuner measured on a GPU: every config's time per tuning key,
the choice, the default's time beside it, and per tuning knob how often its values won — the
measurement that decides which configs a space keeps (issue 56: the compile table's size).

Reads the ``*.autotune.json`` files of Triton's autotune cache (``cache_results=True``; one per
kernel and key, as ``scripts/gpu_run.sh`` copies them to ``$OUT/autotune/``, numbered backups
``.~N~`` included, beside its ``device.json``: the GPU, and the digest of the kernels that ran).
``--ship`` writes each key's choice into ``gatlib/tuned/`` as that GPU's shipped configs
(``gatlib/_triton_tuned.py``), so that its users skip the tuning::

    python -m tools.autotune_report gpu_run/autotune --json autotune_report.json
    python -m tools.autotune_report gpu_run/autotune --ship gatlib/tuned
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import triton
import triton.language as tl

from gatlib.bench.report import format_table
from tools import internals

KNOBS = ("BLOCK_E", "PER_SM", "AHEAD", "LANE_HEADS")
NEAR = 1.05  # a config "near the best": within 5% of the key's fastest


def _kernel_name(path: Path) -> str:
    return re.sub(r"\.autotune\.json(\.~\d+~)?$", "", path.name)


def _consts(name: str, key: List) -> Dict:
    """A launch's constexprs as far as the key holds them, plus what the dispatcher derives
    from them (tile widths, the accumulator), so that the call's default config is found."""
    keys = internals.triton_tuners()[name].keys
    consts = dict(zip(keys, key[:len(keys)], strict=True))  # (then the dtypes)
    dtypes = [k for k in key[len(keys):] if isinstance(k, str)]
    consts.update(BLOCK_CK=triton.next_power_of_2(consts["CK"]),
                  BLOCK_CV=triton.next_power_of_2(consts["CV"]),
                  ACC=tl.float64 if "torch.float64" in dtypes else tl.float32)
    return consts


def _label(cfg: Dict) -> str:
    kw = cfg["kwargs"]
    return (f"R{kw['BLOCK_R']} E{kw['BLOCK_E']} w{cfg['num_warps']} cap{cfg['maxnreg']} "
            f"sm{kw['PER_SM']}" + (" ahead" if kw.get("AHEAD") else "")
            + (" heads" if kw.get("LANE_HEADS") else ""))


def read(folder: Path) -> List[Dict]:
    """One record per (kernel, key): its configs with their median times, the fastest and
    the default."""
    records = []
    for path in sorted(folder.rglob("*.autotune.json*")):
        name = _kernel_name(path)
        data = json.loads(path.read_text())
        consts = _consts(name, data["key"])
        default = internals.triton_default_config(name, consts)
        configs = [{"label": _label(cfg), "kwargs": cfg["kwargs"], "num_warps": cfg["num_warps"],
                    "maxnreg": cfg["maxnreg"], "ms": times[0],
                    "default": cfg["kwargs"] == default.kwargs and cfg["num_warps"] == default.num_warps
                    and cfg["maxnreg"] == default.maxnreg}
                   for cfg, times in data["configs_timings"]]
        finite = [c["ms"] for c in configs if math.isfinite(c["ms"])]
        best = min(finite) if finite else math.inf
        for c in configs:
            c["over_best"] = c["ms"] / best if finite else None
        key = {k: v for k, v in consts.items() if k in internals.triton_tuners()[name].keys}
        records.append({"kernel": name, "file": str(path.relative_to(folder)), "key": key,
                        "key_values": data["key"],
                        "dtypes": sorted({k for k in data["key"] if isinstance(k, str)}),
                        "configs": configs, "best_ms": best,
                        "default_over_best": next((c["over_best"] for c in configs if c["default"]), None)})
    return records


def knob_summary(records: List[Dict]) -> List[Dict]:
    """Per kernel, knob and value: in how many keys a config with that value was the fastest,
    was near it (within :data:`NEAR`), or only ran, and its median time over the key's best."""
    seen = defaultdict(lambda: {"keys": 0, "best": 0, "near": 0, "over_best": []})
    for r in records:
        for knob in KNOBS:
            by_value = defaultdict(list)
            for c in r["configs"]:
                if knob in c["kwargs"] and c["over_best"] is not None:
                    by_value[c["kwargs"][knob]].append(c["over_best"])
            if len(by_value) < 2:  # a knob the key's space does not vary tells nothing
                continue
            for value, ratios in by_value.items():
                s = seen[r["kernel"], knob, value]
                s["keys"] += 1
                s["best"] += min(ratios) == 1.0
                s["near"] += min(ratios) <= NEAR
                s["over_best"].append(min(ratios))
    return [{"kernel": k, "knob": knob, "value": value, "keys": s["keys"], "fastest": s["best"],
             "near_best": s["near"], "median_over_best": statistics.median(s["over_best"])}
            for (k, knob, value), s in sorted(seen.items(), key=lambda kv: str(kv[0]))]


def ship(records: List[Dict], run: Dict, folder: Path) -> Path:
    """Write each key's fastest config into ``folder`` as the shipped configs of the GPU of
    ``run`` (the GPU run's ``device.json``); returns the file written."""
    tuned = internals.triton_tuned()
    configs: Dict[str, List] = defaultdict(list)
    for r in records:
        best = min(r["configs"], key=lambda c: c["ms"])
        if not math.isfinite(best["ms"]):
            continue
        configs[r["kernel"]].append([r["key_values"], {k: best[k] for k in ("kwargs", "num_warps", "maxnreg")}])
    path = folder / tuned.file_name(run["device"])
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": tuned.SCHEMA, "device": run["device"],
                                "kernels_sha256": run["kernels_sha256"],
                                "tuned_with": {k: run.get(k) for k in ("torch", "triton", "git_sha")},
                                "configs": dict(sorted(configs.items()))}, indent=1) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(prog="python -m tools.autotune_report",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a folder of Triton autotune cache files")
    p.add_argument("--json", type=Path, default=None, help="write the records and summary here")
    p.add_argument("--ship", type=Path, default=None, metavar="DIR",
                   help="write each key's choice into DIR (gatlib/tuned) as the GPU's shipped configs")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    records = read(args.folder)
    if not records:
        raise SystemExit(f"no *.autotune.json files under {args.folder}")
    for r in records:
        flags = " ".join(f"{k}={v}" for k, v in r["key"].items())
        print(f"\n{r['kernel']} {flags} {'/'.join(d.replace('torch.', '') for d in r['dtypes'])}")
        print(format_table(["config", "ms", "x best", ""],
                           [[c["label"], f"{c['ms']:.4f}", f"{c['over_best']:.2f}" if c["over_best"] else "-",
                             " ".join(m for m, on in (("fastest", c["over_best"] == 1.0),
                                                      ("default", c["default"])) if on)]
                            for c in r["configs"]], align="<>><"))
    summary = knob_summary(records)
    print(f"\n{len(records)} keys, {sum(len(r['configs']) for r in records)} configs timed; "
          f"the default was the fastest in {sum(r['default_over_best'] == 1.0 for r in records)}")
    print(format_table(["kernel", "knob", "value", "keys", "fastest", f"within {NEAR:.2f}x",
                        "median x best"],
                       [[s["kernel"], s["knob"], str(s["value"]), s["keys"], s["fastest"], s["near_best"],
                         f"{s['median_over_best']:.2f}"] for s in summary], align="<<<>>>>"))
    if args.json:
        args.json.write_text(json.dumps({"records": records, "knobs": summary}, indent=1,
                                        default=str))
        print(f"wrote {args.json}")
    if args.ship:
        run = json.loads((args.folder / "device.json").read_text())
        print(f"wrote {ship(records, run, args.ship)} ({len(records)} keys of {run['device']})")


if __name__ == "__main__":
    main()
