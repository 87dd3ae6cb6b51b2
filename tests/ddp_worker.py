"""One rank of the 2-process check in ``tests/test_sampled.py`` (run by
torchrun, not collected by pytest): train a small deterministic SampledGAT on
the given dataset and save the first step's (all-reduced) gradients and the
run's learning curve to ``<out>/rank<RANK>.pt``.

Usage: ``torchrun --standalone --nproc-per-node 2 tests/ddp_worker.py DATA_DIR OUT BATCH EPOCHS``
"""
import sys
from pathlib import Path

import torch

from gatlib.bench import distributed
from gatlib.bench.data import load_dataset
from gatlib.bench.train import train_sampled_run

from sampled_setup import deterministic_recipe


def main(data_dir: str, out: str, batch_size: str, epochs: str) -> None:
    torch.set_num_threads(1)
    dist = distributed.from_env("cpu")
    assert dist is not None and dist.world_size == 2, "run me under torchrun with 2 processes"
    try:
        dataset = load_dataset("ogbn-products", data_dir)
        grads = {}

        def first_step(step, model):
            if step == 1:
                grads.update({k: p.grad.clone() for k, p in model.named_parameters()})

        res = train_sampled_run(dataset, deterministic_recipe(int(batch_size), int(epochs)), seed=0,
                                dist=dist, on_step=first_step)
        torch.save({"grads": grads, "history": res.history, "test_acc": res.test_acc,
                    "world_size": res.world_size}, Path(out) / f"rank{dist.rank}.pt")
    finally:
        dist.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
