"""The ``gatlib`` command.

``gatlib bench`` trains a model over several seeds and reports test accuracy
(mean ± std), validation accuracy, epochs, time per epoch and peak memory::

    gatlib bench --dataset cora --model gat --runs 100 --device cpu --json results.json

``gatlib compare`` compares gatlib's layers with PyTorch Geometric's (time,
peak memory, agreement); it is :mod:`gatlib.bench.compare`.

``gatlib selftest`` checks the Triton kernels against the reference on a
device and runs that comparison with them; it is :mod:`gatlib.bench.selftest`::

    gatlib selftest --device cuda --json selftest.json
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from gatlib import BACKENDS

from .data import DATASETS, DatasetNotFoundError
from .report import format_table, write_json
from .train import MODELS


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(argv).parse_args(argv)
    return args.func(args)


def _parser(argv: List[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gatlib", description="Sparse graph attention: benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench,compare,selftest}")

    bench = sub.add_parser("bench", help="train and evaluate a model over several seeds",
                           description="Train and evaluate a model over several seeds; print a "
                                       "table and optionally write every run to JSON.")
    bench.add_argument("--dataset", required=True, type=str.lower, choices=DATASETS)
    bench.add_argument("--model", required=True, type=str.lower, choices=MODELS,
                       help="on OGB datasets gat/gatv2 use the deep residual GAT and "
                            "transformer uses UniMP")
    bench.add_argument("--runs", type=int, default=10, help="number of seeds (default: 10)")
    bench.add_argument("--seed", type=int, default=0, help="first seed; run i uses seed+i (default: 0)")
    bench.add_argument("--device", default=None,
                       help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    bench.add_argument("--backend", default="auto", choices=BACKENDS,
                       help="attention backend of every layer (default: auto)")
    bench.add_argument("--data-dir", type=Path, default=None,
                       help="data directory (default: $GATLIB_DATA, else ~/.cache/gatlib)")
    bench.add_argument("--epochs", type=int, default=None, help="maximum epochs (default: the recipe's)")
    bench.add_argument("--patience", type=int, default=None,
                       help="early-stopping patience (default: the recipe's)")
    bench.add_argument("--pe", choices=("none", "laplacian", "random_walk"), default=None,
                       help="positional encoding of the Planetoid transformer (default: the recipe's)")
    bench.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    bench.add_argument("--json", type=Path, default=None, dest="json_path",
                       help="write the results here (rewritten after every run)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(func=_bench)

    compare = sub.add_parser("compare", help="compare gatlib's layers with PyG's (gatlib.bench.compare)",
                             description="Compare gatlib's layers with PyG's: agreement, time and "
                                         "peak memory; see gatlib.bench.compare.")
    selftest = sub.add_parser("selftest", help="check the Triton kernels on a device and compare "
                                               "them with PyG (gatlib.bench.selftest)",
                              description="Check the Triton kernels against the reference on a "
                                          "device, compare gatlib's layers on them with PyG's; "
                                          "see gatlib.bench.selftest.")
    # Imported only when asked for: `gatlib bench` need not load the comparison's imports.
    for name, sub_parser in (("compare", compare), ("selftest", selftest)):
        if argv[:1] == [name]:
            module = importlib.import_module(f"gatlib.bench.{name}")
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(func=module.run)
    return parser


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .data import load_dataset
    from .train import benchmark

    if args.runs < 1:
        print("gatlib bench: --runs must be at least 1", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dataset = load_dataset(args.dataset, args.data_dir)
    except (DatasetNotFoundError, ImportError) as e:
        print(f"gatlib bench: {e}", file=sys.stderr)
        return 1

    def save(report: Dict[str, Any]) -> None:
        if args.json_path is not None:
            write_json(args.json_path, report)

    try:
        report = benchmark(dataset, args.model, runs=args.runs, device=device, backend=args.backend,
                           seed=args.seed, epochs=args.epochs, patience=args.patience, pe=args.pe,
                           progress=not args.no_progress, on_update=save)
    except ValueError as e:  # a backend or option that cannot run here
        print(f"gatlib bench: {e}", file=sys.stderr)
        return 2
    save(report)
    print(bench_table(report))
    if args.json_path is not None:
        print(f"results: {args.json_path}")
    if report["interrupted"]:
        print(f"interrupted: kept the {report['runs_completed']} finished run(s)", file=sys.stderr)
        return 130
    return 0


def bench_table(report: Dict[str, Any]) -> str:
    """A one-row summary table of a :func:`gatlib.bench.train.benchmark` report."""
    def pm(mean, std):
        return "-" if mean is None else f"{mean:.2f} ± {std:.2f}"

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    metric = "ROC-AUC" if report["metric"] == "rocauc" else "acc"
    headers = ["dataset", "model", "device", "runs", f"test {metric} (%)", f"val {metric} (%)",
               "epochs", "s/epoch", "peak mem (MiB)"]
    row = [report["dataset"], report["model"], report["device"],
           f"{report['runs_completed']}/{report['runs_requested']}",
           pm(report["test_acc_mean"], report["test_acc_std"]),
           pm(report["val_acc_mean"], report["val_acc_std"]),
           num(report["epochs_mean"], ".0f"), num(report["seconds_per_epoch_mean"], ".4f"),
           num(report["peak_memory_mib"], ".0f")]
    return format_table(headers, [row], align="<<<" + ">" * 6)


if __name__ == "__main__":
    sys.exit(main())
