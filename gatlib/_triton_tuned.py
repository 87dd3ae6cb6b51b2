"""Tuned configs shipped per GPU: the autotuner's choices of a GPU run, one file per GPU model in
``gatlib/tuned/`` (written by ``python -m tools.autotune_report DIR --ship``), put into the row
kernels' tuners on a device's first launch, so that users of that GPU skip the tuning. A file
tuned for other kernels than these (their source's digest) is not used, and says so once."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch
import triton

from . import _triton_kernels

SCHEMA = "gatlib.tuned/1"
DIR = Path(__file__).with_name("tuned")


@functools.lru_cache(maxsize=None)
def kernels_digest() -> str:
    """The kernels' source digest: a file's configs were timed on kernels of this source."""
    return hashlib.sha256(Path(_triton_kernels.__file__).read_bytes()).hexdigest()


def file_name(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3.json"``."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json"


def device_name(device: torch.device) -> Optional[str]:
    """The GPU model whose file applies to ``device`` (none off CUDA)."""
    if device.type != "cuda":
        return None
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def identity(cfg: Dict) -> tuple:
    """What tells a config from the others of a space: its constexprs, warps and register cap."""
    return tuple(sorted(cfg["kwargs"].items())), cfg["num_warps"], cfg["maxnreg"]


def _identity(cfg: triton.Config) -> tuple:
    return identity({"kwargs": cfg.kwargs, "num_warps": cfg.num_warps, "maxnreg": cfg.maxnreg})


_LOADED: Dict[str, int] = {}  # device name -> keys put into the tuners


def preload(name: Optional[str], tuners: Dict, configs: Dict[str, List[triton.Config]],
            env: str) -> int:
    """Put the configs shipped for GPU ``name`` into ``tuners``' caches (``{kernel: tuner}``),
    once per GPU model and process, unless the variable ``env`` is ``"0"`` (the defaults, untuned);
    ``configs``: each kernel's full list, which a shipped config must be one of. Returns the
    number of keys put in."""
    if name is None or name in _LOADED:
        return _LOADED.get(name, 0)
    if os.environ.get(env, "1") == "0":
        return 0
    _LOADED[name] = 0
    path = DIR / file_name(name)
    if not path.exists():
        return 0
    data = json.loads(path.read_text())
    by_id = {k: {_identity(c): c for c in cs} for k, cs in configs.items()}
    chosen = [(tuners[k], tuple(key), by_id[k].get(identity(cfg)))
              for k, entries in data.get("configs", {}).items() if k in tuners for key, cfg in entries]
    stale = (data.get("schema") != SCHEMA or data.get("device") != name
             or data.get("kernels_sha256") != kernels_digest() or any(c is None for *_, c in chosen)
             or set(data.get("configs", {})) - set(tuners))
    if stale:
        warnings.warn(f"gatlib: {path.name} holds configs tuned for other kernels than these (or "
                      f"another GPU than {name}): the row kernels are tuned on first use instead",
                      stacklevel=3)
        return 0
    for tuner, key, cfg in chosen:
        tuner.cache.setdefault(key, cfg)  # (a key tuned in this process keeps its own choice)
    _LOADED[name] = len(chosen)
    return len(chosen)
