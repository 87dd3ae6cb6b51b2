"""The GPU run: one command of at most 7 minutes on a lent GPU (a rerun fits a 15-minute lease),
every step under its own limit and the run's deadline, its results in at most 8 files whose
names come back (docs/gpu.md, "The GPU run"). ``scripts/gpu_run.sh`` runs it on the GPU machine::

    python -m tools.gpu_run --out DIR            # CUDA
    python -m tools.gpu_run --out DIR --dry-run  # CPU: the same steps and files, tiny, the
                                                 # kernels in Triton's interpreter

The steps, in the order of what decides most (a step that does not fit the deadline is skipped,
and says so):

1. ``compute-sanitizer`` memcheck, then racecheck, over every kernel kind (forward and backward,
   eager and compiled) on a small graph, untuned; where the sanitizer refuses the device, one
   line says so and the run goes on. Beside it, in parallel:
2. the self-test of every kind at the configs the tuner chose (a process per kind: compiling
   dominates), float32 and bfloat16, with its GPU checks: no host sync, no recompile, dropout
   under CUDA graphs, an output layer's call, each layer's compiled step against float64, every
   config's bits those of the tuner's choice;
3. the arxiv-like 2-layer training step of each layer against PyG eager and compiled (what each
   key's tuning cost: the autotune file);
4. the 40-class output layer's call: the row kernels, the two-pass form, ``torch.sparse.mm``;
5. Cora's step with both compiled sides replayed as CUDA graphs.

Files: ``run.json`` (each step's command, exit status and seconds; the device, versions, commit),
``log.txt``, ``selftest.json``, ``compare_arxiv.json``, ``classes.json``, ``compare_cora.json``,
``autotune.json`` (every key's timings, Triton's autotune cache in one file).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 420  # 7 minutes
FILES = ("run.json", "log.txt", "selftest.json", "compare_arxiv.json", "classes.json",
         "compare_cora.json", "autotune.json")
KINDS = ("gat", "gatv2", "dot", "gat_inputs", "dot_inputs")


class Run:
    """The steps' log, their records and the deadline."""

    def __init__(self, out: Path, deadline_s: float, env: Dict[str, str]):
        self.out, self.env = out, env
        self.start = time.monotonic()
        self.deadline = self.start + deadline_s
        self.steps: List[Dict] = []
        self.log = open(out / "log.txt", "a")
        self.lock = threading.Lock()  # (the sanitizer's steps run beside the self-test's)

    def say(self, line: str, text: str = "") -> None:
        with self.lock:
            print(line, flush=True)
            self.log.write(text + line + "\n")
            self.log.flush()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start_step(self, name: str, cmd: List[str], limit: float, env=None) -> Optional[Dict]:
        """Start ``cmd`` for at most ``limit`` seconds (or what the deadline leaves); ``None``
        (and a record that says so) where less than 10 seconds are left."""
        limit = min(limit, self.left())
        rec = {"step": name, "command": " ".join(cmd), "limit_s": round(limit)}
        with self.lock:
            self.steps.append(rec)
        if limit < 10:
            rec.update(status="skipped", detail="the run's deadline leaves no time for it")
            self.say(f"== {name}: skipped (the deadline)")
            return None
        self.say(f"== {name}: {rec['command']} (at most {limit:.0f} s)")
        out = tempfile.TemporaryFile("w+")
        rec["_proc"] = subprocess.Popen(cmd, cwd=ROOT, env={**self.env, **(env or {})}, stdout=out,
                                        stderr=subprocess.STDOUT, text=True)
        rec["_out"], rec["_t0"] = out, time.monotonic()
        return rec

    def finish(self, rec: Optional[Dict]) -> Optional[Dict]:
        """Wait for a started step (killed at its limit); log its output and exit status."""
        if rec is None:
            return None
        proc, out = rec.pop("_proc"), rec.pop("_out")
        try:
            proc.wait(timeout=max(1.0, rec["limit_s"] - (time.monotonic() - rec["_t0"])))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rec["timed_out"] = True
        rec["seconds"] = round(time.monotonic() - rec.pop("_t0"), 1)
        rec["returncode"] = proc.returncode
        rec.setdefault("status", "ok" if proc.returncode == 0 else "FAIL")
        out.seek(0)
        text = out.read()
        rec["output_tail"] = text[-2000:]
        self.say(f"== {rec['step']}: exit {proc.returncode} after {rec['seconds']} s", text)
        return rec

    def step(self, name: str, cmd: List[str], limit: float, env=None) -> Optional[Dict]:
        return self.finish(self.start_step(name, cmd, limit, env))


def _python(*args: str) -> List[str]:
    return [sys.executable, *args]


def commands(dry: bool, out: Path, tmp: Path) -> Dict[str, List]:
    """The run's steps as ``{group: [(name, argv, limit_s, extra env), ...]}``: "sanitizer" and
    "selftest" run side by side (each group in order; the self-test's kinds at once), then
    "timed", one after another."""
    py = sys.executable
    interp = {"TRITON_INTERPRET": "1"} if dry else {}
    if dry:  # (tiny: the interpreter, a synthetic graph, no compiled sides)
        kinds, dtypes, device = ("gat",), "float32", "cpu"
        model = ["--scope", "model", "--device", "cpu", "--backend", "triton", "--graph",
                 "synthetic:40:150:8", "--heads", "1", "--channels", "4", "--classes", "3",
                 "--repeats", "1", "--block-seconds", "0", "--no-memory", "--no-compile"]
        arxiv = cora = model + ["--layer", "gat"]
        classes = ["--device", "cpu", "--graph", "synthetic:40:150:8", "--kinds", "gat",
                   "--dtypes", "float32", "--warmup", "1", "--rep", "1"]
    else:
        kinds, dtypes, device = KINDS, "float32,bfloat16", "cuda"
        arxiv = ["--scope", "model", "--layer", "all", "--graph", "arxiv-like", "--device", "cuda",
                 "--backend", "triton", "--no-memory", "--repeats", "2"]
        cora = ["--scope", "model", "--layer", "all", "--graph", "cora", "--device", "cuda",
                "--backend", "triton", "--no-memory", "--repeats", "3", "--compile-mode",
                "reduce-overhead"]
        classes = ["--kinds", "gat", "gatv2", "dot", "--dtypes", "float32", "--rep", "100"]
    sanitizer = [] if dry else [
        (f"sanitizer {check}", ["compute-sanitizer", "--tool", check, "--error-exitcode", "3", py,
                                "-m", "tools.gpu_run", "--calls"], 65, {"GATLIB_TRITON_AUTOTUNE": "0"})
        for check in ("memcheck", "racecheck")]
    selftest = [(f"selftest {kind}", [py, "-m", "gatlib.bench.selftest", "--device", device, "--graphs",
                                      "", "--quick", "--kinds", kind, "--dtypes", dtypes, "--json",
                                      str(tmp / f"selftest_{kind}.json")], 130, interp) for kind in kinds]
    timed = [
        ("arxiv-like step", [py, "-m", "gatlib.bench.compare", *arxiv, "--json",
                             str(out / "compare_arxiv.json")], 150, interp),
        ("40-class call", [py, "-m", "tools.triton_bench", "--heads", "1", "--channels", "40",
                           *classes, "--out", str(out / "classes.json")], 60, interp),
        ("Cora under CUDA graphs", [py, "-m", "gatlib.bench.compare", *cora, "--json",
                                    str(out / "compare_cora.json")], 80, interp)]
    return {"sanitizer": sanitizer, "selftest": selftest, "timed": timed}


def sanitizer_steps(run: Run, steps: List, dry: bool) -> None:
    """compute-sanitizer's memcheck and racecheck over :func:`calls` (untuned, a small graph);
    skipped in a dry run or without the tool, said so where it refuses the device."""
    if dry or shutil.which("compute-sanitizer") is None:
        why = "a dry run: no GPU" if dry else "compute-sanitizer is not on the PATH"
        with run.lock:
            run.steps.append({"step": "sanitizer", "status": "skipped", "detail": why})
        run.say(f"== sanitizer: skipped ({why})")
        return
    for name, argv, limit, env in steps:
        rec = run.step(name, argv, limit, env)
        if rec is not None and rec["returncode"] not in (0, 3) and "Traceback" not in rec["output_tail"]:
            # (it refuses the device on one of the machine's runtimes: not the kernels' failure;
            # a Python traceback is the calls' own failure and stays a FAIL)
            rec.update(status="refused", detail=(rec["output_tail"].strip().splitlines() or ["?"])[-1])
            run.say(f"== {name}: did not run ({rec['detail'][:200]}); the run goes on")


def calls(device: str = "cuda") -> None:
    """What the sanitizer watches: every kernel kind on a small graph with a split hub, forward
    and backward (dropout, edge features, weights with a gradient), eager and compiled."""
    import torch

    import gatlib
    from gatlib.bench import selftest

    plan = gatlib.GraphPlan(selftest.kernel_graph().to(device), num_nodes=selftest.NUM_NODES)
    for kind in KINDS:
        inputs, weights = selftest.case_inputs(kind, torch.float32, kind != "dot_inputs", plan,
                                                device, 0)

        def call(t, kind=kind):
            return gatlib.graph_attention(selftest.edge_score(kind, t), t["value"], plan,
                                          selftest.NUM_NODES, value_edge=t.get("value_edge"),
                                          dropout=0.3, training=True, backend="triton",
                                          return_attention=True, bias=t.get("bias"))
        for fn in (call, torch.compile(call, backend="aot_eager", fullgraph=True)):
            t = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
            out, alpha = fn(t)
            ((out * weights["out"]).sum() + (alpha * weights["alpha"]).sum()).backward()
        torch.cuda.synchronize()
        print(f"{kind}: ok", flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the run's commands with the real parsers)."""
    p = argparse.ArgumentParser(prog="python -m tools.gpu_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_run"))
    p.add_argument("--dry-run", action="store_true",
                   help="on CPU: the same steps and files, tiny (Triton's interpreter, stand-ins)")
    p.add_argument("--print", action="store_true", help="print the steps' commands, run nothing")
    p.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole run")
    p.add_argument("--calls", action="store_true", help=argparse.SUPPRESS)  # (the sanitizer's)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.calls:
        calls()
        return 0
    dry = args.dry_run
    if args.print:
        for group in commands(dry, args.out, Path("TMP")).values():
            for name, argv_, limit, env in group:
                print(f"{name}\t{limit}\t{' '.join(f'{k}={v}' for k, v in env.items())}\t"
                      + shlex.join(argv_))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="gatlib-triton-cache-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": str(cache), "TRITON_PRINT_AUTOTUNING": "1",
           "GATLIB_PLANETOID_RAW": os.environ.get("GATLIB_PLANETOID_RAW", str(ROOT / ".planetoid"))}
    env.pop("TRITON_INTERPRET", None)
    run = Run(args.out, args.deadline, env)
    record = {"schema": "gatlib.gpu_run/1", "dry_run": dry, "environment": _environment(dry)}
    run.say(f"gatlib GPU run{' (dry)' if dry else ''}: {json.dumps(record['environment'], default=str)}")
    with tempfile.TemporaryDirectory() as tmp:
        steps = commands(dry, args.out, Path(tmp))
        # the sanitizer's slow launches beside the self-test's compiles
        side = threading.Thread(target=sanitizer_steps, args=(run, steps["sanitizer"], dry))
        side.start()
        for rec in [run.start_step(*step) for step in steps["selftest"]]:
            run.finish(rec)
        kinds = [name.split()[-1] for name, *_ in steps["selftest"]]
        merged = {k: json.loads((Path(tmp) / f"selftest_{k}.json").read_text())
                  for k in kinds if (Path(tmp) / f"selftest_{k}.json").exists()}
        (args.out / "selftest.json").write_text(json.dumps(merged, indent=1))
        side.join()
        for step in steps["timed"]:
            run.step(*step)
    (args.out / "autotune.json").write_text(json.dumps(_autotune_files(cache), indent=1))
    shutil.rmtree(cache, ignore_errors=True)
    record.update(seconds=round(time.monotonic() - run.start, 1), deadline_s=args.deadline,
                  steps=run.steps)
    (args.out / "run.json").write_text(json.dumps(record, indent=1))
    run.say(f"== the run: {record['seconds']} s; "
            + ", ".join(f"{s['step']} {s['status']}" for s in run.steps))
    run.log.close()
    return 0 if all(s["status"] in ("ok", "skipped", "refused") for s in run.steps) else 1


def _autotune_files(cache: Path) -> List[Dict]:
    """Every key's timings from Triton's autotune cache (``*.autotune.json``), with its kernel."""
    out = []
    for path in sorted(cache.rglob("*.autotune.json")):
        data = json.loads(path.read_text())
        out.append({"kernel": path.name.removesuffix(".autotune.json"), **data})
    return out


def _environment(dry: bool) -> Dict:
    from gatlib.bench.report import environment

    return environment("cpu" if dry else "cuda")


if __name__ == "__main__":
    sys.exit(main())
