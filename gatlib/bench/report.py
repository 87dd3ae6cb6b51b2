"""What every result file carries, written once for the whole harness: :func:`environment`
(device, library versions, git commit), :func:`command_line`, :func:`write_json` (atomic: an
interrupted run never leaves half a file) and :func:`format_table` (aligned text or Markdown).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

_PACKAGE = Path(__file__).resolve().parents[1]  # gatlib/
_ROOT = _PACKAGE.parent  # the checkout (or site-packages) holding gatlib/
# Distributions whose versions a result file records, by the name they are installed as.
_DISTRIBUTIONS = ("torch_geometric", "triton", "torch_scatter", "torch_sparse", "pyg_lib", "ogb")


def _version(dist: str) -> Optional[str]:
    for name in (dist, dist.replace("_", "-")):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git(*args: str) -> Optional[str]:
    try:
        res = subprocess.run(["git", "-C", str(_PACKAGE), *args], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device | str) -> Dict[str, Any]:
    """Device, library versions, git commit and platform of a run on ``device``; ``git_dirty``:
    whether the ``gatlib`` package or ``tools/`` differ from that commit (``None`` outside a checkout)."""
    from .. import __version__

    device = torch.device(device)
    sha = _git("rev-parse", "HEAD")
    # the package and, in a checkout, the developer instruments beside it (tools/
    # writes results too; a path that is not there matches nothing)
    status = _git("status", "--porcelain", "--", ".", "../tools") if sha is not None else None
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "gatlib": __version__, "cuda": torch.version.cuda}
    versions.update({dist: _version(dist) for dist in _DISTRIBUTIONS})
    return {
        "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else cpu_model()),
        "cpu_model": cpu_model(),
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
        "git_sha": sha,
        "git_dirty": None if status is None else bool(status),
        "platform": platform.platform(),
    }


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """``argv`` (default ``sys.argv``) as a command to paste into a shell (``python -m`` for a
    module, ``python path`` for a checkout's script, else the console script's name)."""
    argv = list(sys.argv if argv is None else argv)
    prog = Path(argv[0]).resolve() if argv else Path("python")
    try:
        rel = prog.relative_to(_ROOT)
    except ValueError:
        exe = prog.name
    else:
        if len(rel.parts) > 1 and (_ROOT / rel.parts[0] / "__init__.py").is_file():  # a package
            parts = rel.with_suffix("").parts
            exe = "python -m " + ".".join(parts[:-1] if parts[-1] == "__main__" else parts)
        else:
            exe = f"python {rel}"
    return " ".join([exe, shlex.join(argv[1:])]).rstrip()


def write_json(path: os.PathLike | str, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (a temporary file, then ``os.replace``),
    so a failure leaves the previous file and no partial one."""
    text = json.dumps(obj, indent=2) + "\n"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                 align: Optional[str] = None, markdown: bool = False) -> str:
    """An aligned table: header, rule, one line per row; ``align`` one ``"<"``/``">"`` per column
    (default: first left, the rest right); ``markdown`` a GitHub table."""
    cells: List[List[str]] = [[str(h) for h in headers]]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"a row has {len(row)} cells for {len(headers)} columns: {row!r}")
        cells.append([str(c) for c in row])
    align = align or "<" + ">" * (len(headers) - 1)
    if len(align) != len(headers) or set(align) - {"<", ">"}:
        raise ValueError(f"align needs one '<' or '>' per column; got {align!r}")
    widths = [max(3, *(len(line[i]) for line in cells)) if markdown else
              max(len(line[i]) for line in cells) for i in range(len(headers))]
    padded = [[f"{c:{a}{w}}" for c, a, w in zip(line, align, widths, strict=True)]
              for line in cells]
    if markdown:
        rule = ["-" * (w - 1) + ":" if a == ">" else ":" + "-" * (w - 1)
                for a, w in zip(align, widths, strict=True)]
        return "\n".join("| " + " | ".join(line) + " |" for line in [padded[0], rule, *padded[1:]])
    rule = ["-" * w for w in widths]
    return "\n".join("  ".join(line).rstrip() for line in [padded[0], rule, *padded[1:]])
