"""Multi-process data-parallel training: the process group torchrun sets up
(``torchrun --nproc-per-node K --no-python gatlib bench ...``; docs/distributed.md). gloo on
CPU, NCCL on CUDA with each process on ``cuda:LOCAL_RANK``; nothing assumes one node. What each
rank does with it is in :mod:`gatlib.bench.sampled`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass
class Distributed:
    """This process's place in a torch.distributed job (``local_rank`` picks the GPU)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints, shows progress and writes the JSON."""
        return self.rank == 0

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(device_ids=[self.local_rank] if self.backend == "nccl" else None)

    def all_reduce(self, values: Tensor, op: str = "sum") -> Tensor:
        """``values`` reduced over all ranks (``"sum"`` or ``"max"``), as a new tensor
        on the caller's device."""
        import torch.distributed as dist

        out = values.detach().to(self.device, copy=True)
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return out.to(values.device)

    def all_gather_rows(self, rows: Tensor, total: int) -> Tensor:
        """Concatenate every rank's ``rows`` in rank order; rank ``r`` holds rows
        ``[r * chunk, (r + 1) * chunk)`` of ``total`` with ``chunk = ceil(total /
        world_size)`` (see :func:`chunk_range`). Returns ``[total, ...]`` on the
        caller's device."""
        import torch.distributed as dist

        chunk = -(-total // self.world_size)
        padded = rows.new_zeros((chunk, *rows.shape[1:]), device=self.device)
        padded[: rows.size(0)] = rows.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat(parts)[:total].to(rows.device)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def chunk_range(total: int, rank: int, world_size: int) -> range:
    """The contiguous share ``[rank * chunk, min(total, (rank + 1) * chunk))`` of
    ``total`` items, ``chunk = ceil(total / world_size)``."""
    chunk = -(-total // world_size)
    return range(min(total, rank * chunk), min(total, (rank + 1) * chunk))


def launched_by_torchrun() -> bool:
    """Whether torchrun (or another launcher setting its variables) started us
    as one of several processes."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def from_env(device: Optional[str] = None) -> Optional[Distributed]:
    """Join the process group of torchrun's environment; ``None`` for a single process.

    ``device``: ``"cpu"``, ``"cuda"`` (this process's ``cuda:LOCAL_RANK``; an explicit index is refused) or
    ``None`` (CUDA if available). Raises ``ValueError`` for a missing or malformed variable.
    """
    if not launched_by_torchrun():
        return None
    import torch.distributed as dist

    missing = [v for v in _VARS if v not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} "
                         f"unset: launch with torchrun, which sets {', '.join(_VARS)}")
    try:
        rank, world, local = (int(os.environ[v]) for v in _VARS)
    except ValueError as e:
        raise ValueError(f"torchrun's variables must be integers: {e}") from e
    kind = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if kind.type == "cuda":
        if kind.index is not None:
            raise ValueError(f"--device {device}: under torchrun each process uses "
                             f"cuda:LOCAL_RANK; pass --device cuda")
        dev, backend = torch.device("cuda", local), "nccl"
        torch.cuda.set_device(dev)
    elif kind.type == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"--device {device}: multi-process training runs on cpu (gloo) or "
                         f"cuda (NCCL)")
    if not dist.is_initialized():
        # env:// reads MASTER_ADDR/MASTER_PORT (or torchrun's rendezvous store).
        dist.init_process_group(backend, rank=rank, world_size=world,
                                **({"device_id": dev} if backend == "nccl" else {}))
    return Distributed(rank, world, local, dev, backend)
