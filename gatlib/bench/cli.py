"""The ``gatlib`` command: ``gatlib bench`` (accuracy over seeds, :mod:`gatlib.bench.train`),
``gatlib compare`` (:mod:`gatlib.bench.compare`) and ``gatlib selftest`` (:mod:`gatlib.bench.selftest`).
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
from .recipes import LOADERS, MODELS


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    import torch

    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(argv).parse_args(argv)
    threads = torch.get_num_threads()
    try:
        return args.func(args)
    finally:  # --threads is this command's: a caller in the same process keeps its own
        torch.set_num_threads(threads)


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
    bench.add_argument("--loader", choices=LOADERS, default="full",
                       help="full: full-batch training (one process); neighbor: mini-batches of "
                            "sampled neighbourhoods (NeighborLoader), the recipe of PyG's "
                            "ogbn-products GAT example; runs data-parallel under torchrun "
                            "(default: full)")
    bench.add_argument("--fanouts", type=_fanouts, default=None,
                       help="with --loader neighbor: neighbours sampled per hop, one per layer, "
                            "-1 for all; write --fanouts=-1,-1,-1 when the list starts with -1 "
                            "(default: 10,10,5)")
    bench.add_argument("--batch-size", type=int, default=None,
                       help="with --loader neighbor: training nodes per batch and process "
                            "(default: 512)")
    bench.add_argument("--num-workers", type=int, default=0,
                       help="with --loader neighbor: sampling worker processes (default: 0, "
                            "sample in the training process)")
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


def _fanouts(text: str) -> List[int]:
    """``"10,10,5"`` -> ``[10, 10, 5]`` (argparse names the option on error)."""
    try:
        return [int(f) for f in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 10,10,5; got {text!r}") from None


def _bench_options(args: argparse.Namespace) -> Optional[str]:
    """Why the options cannot run together (checked before any data is loaded), or ``None``."""
    from .distributed import launched_by_torchrun
    from .recipes import recipe, with_sampling

    if args.runs < 1:
        return "--runs must be at least 1"
    if args.epochs is not None and args.epochs < 1:
        return f"--epochs must be at least 1; got {args.epochs}"
    if args.num_workers < 0:
        return f"--num-workers must be >= 0; got {args.num_workers}"
    if args.loader == "full":
        sampling = [o for o, v in (("--fanouts", args.fanouts), ("--batch-size", args.batch_size))
                    if v is not None]
        if sampling:
            return f"{' and '.join(sampling)} apply to --loader neighbor"
        if launched_by_torchrun():
            return ("--loader full trains on the whole graph in one process; for several "
                    "processes (torchrun) use --loader neighbor")
        return None
    try:
        with_sampling(recipe(args.model, args.dataset, args.loader), fanouts=args.fanouts,
                      batch_size=args.batch_size)
    except ValueError as e:
        return str(e)
    return None


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .data import load_dataset
    from .distributed import from_env
    from .train import benchmark

    problem = _bench_options(args)
    if problem is not None:
        print(f"gatlib bench: {problem}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        dist = from_env(args.device)
    except ValueError as e:
        print(f"gatlib bench: {e}", file=sys.stderr)
        return 2
    try:
        return _bench_in(args, dist, load_dataset, benchmark)
    finally:
        if dist is not None:
            dist.close()


def _bench_in(args, dist, load_dataset, benchmark) -> int:
    """``gatlib bench`` in one process, or as one rank of a torchrun job: only
    rank 0 shows progress, prints and writes the JSON."""
    import torch

    main = dist is None or dist.is_main
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # A dataset's first load writes its processed files. Under torchrun rank 0
    # loads first, then the first process of every other node (which finds
    # them on a shared file system, or writes its node's own), then the rest:
    # no two processes write the same file.
    stage = 0 if main else 1 if dist.local_rank == 0 else 2
    dataset, error = None, None
    for turn in range(3 if dist is not None else 1):
        if turn == stage:
            try:
                dataset = load_dataset(args.dataset, args.data_dir)
            except (DatasetNotFoundError, ImportError) as e:
                error = e  # after the barriers: the other ranks must not wait for us
        if dist is not None:
            dist.barrier()
    if error is not None:
        print(f"gatlib bench: {error}", file=sys.stderr)
        return 1

    def save(report: Dict[str, Any]) -> None:
        if args.json_path is not None and main:
            write_json(args.json_path, report)

    try:
        report = benchmark(dataset, args.model, runs=args.runs, device=device, backend=args.backend,
                           seed=args.seed, epochs=args.epochs, patience=args.patience, pe=args.pe,
                           progress=main and not args.no_progress, on_update=save,
                           loader=args.loader, fanouts=args.fanouts, batch_size=args.batch_size,
                           num_workers=args.num_workers, dist=dist)
    except ValueError as e:  # a backend or option that cannot run here
        print(f"gatlib bench: {e}", file=sys.stderr)
        return 2
    if not main:
        return 130 if report["interrupted"] else 0
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
    world = report.get("distributed", {}).get("world_size", 1)
    device = report["device"] if world == 1 else f"{report['device']} x {world} processes"
    row = [report["dataset"], report["model"], device,
           f"{report['runs_completed']}/{report['runs_requested']}",
           pm(report["test_acc_mean"], report["test_acc_std"]),
           pm(report["val_acc_mean"], report["val_acc_std"]),
           num(report["epochs_mean"], ".0f"), num(report["seconds_per_epoch_mean"], ".4f"),
           num(report["peak_memory_mib"], ".0f")]
    return format_table(headers, [row], align="<<<" + ">" * 6)


if __name__ == "__main__":
    sys.exit(main())
