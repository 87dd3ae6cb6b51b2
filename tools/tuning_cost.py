"""What a layer's first training step compiles on a GPU, its tuning included, without a GPU.

For each layer and model shape, one training step of the 2-layer model of ``gatlib compare
--scope model`` (forward, cross-entropy, backward) runs through Triton's real launch path
against a stand-in sm_90 GPU (:func:`tools.launches.triton_warm_on_cpu`) from cold tuners:
every row kernel's key is tuned (each config of its space compiled and "timed" once, as
``triton.autotune`` does on its first launch) and every specialisation a GPU would compile is
counted, per kernel. Steps on graphs of other sizes (new mini-batches: node counts whose rows of
7 classes start at every offset modulo 16 bytes, where Triton would specialise a pointer's
alignment; then one of higher degree) follow, which must compile and tune nothing. On the GPU
each compile takes ptxas's time; the run's own seconds there are the lease's measurement
(``scripts/gpu_run.sh``)::

    python -m tools.tuning_cost --json benchmarks/results/tuning_cost_cpu_standin.json
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from typing import Dict, Iterator

import torch
import torch.nn.functional as F

# (input features, heads, channels per head, classes): the arxiv-like model of `gatlib compare
# --device cuda` and the published GAT's on Cora
SHAPES = {"arxiv-like": (128, 3, 256, 40), "cora": (1433, 8, 8, 7)}
LAYERS = ("gat", "gatv2", "transformer")
AUTOTUNE_ENV = "GATLIB_TRITON_AUTOTUNE"  # "0": the defaults, untimed (docs/gpu.md, "Tuning")
# (nodes, directed random edges) of the mini-batches after the first graph's (600, 3000), the
# last of a higher degree
NEW_GRAPHS = ((457, 2100), (458, 1500), (459, 2500), (601, 3100), (320, 9000))


def graph(num_nodes: int, num_edges: int, features: int, seed: int):
    """``(x, edge_index, edge_index with self-loops)``: random edges made undirected, and node 0
    a hub of 300 in-edges, so that its row is split (``tools.internals.TRITON_SPLIT``) and the
    merge kernels launch, as on arxiv-like graphs."""
    from gatlib.bench.compare import with_self_loops
    from torch_geometric.utils import to_undirected

    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(1, num_nodes, (2, num_edges), generator=g)
    hub = torch.stack([torch.arange(1, 301), torch.zeros(300, dtype=torch.long)])
    ei = to_undirected(torch.cat([ei, hub], dim=1), num_nodes=num_nodes)
    ei = ei[:, ei[0] != ei[1]]
    return torch.randn(num_nodes, features, generator=g), ei, with_self_loops(ei, num_nodes)


@contextlib.contextmanager
def cold_tuners(tune: bool = True) -> Iterator[None]:
    """Inside: the row kernels' tuners know no key (as in a fresh process) and, unless ``tune``,
    are bypassed for the defaults (``GATLIB_TRITON_AUTOTUNE=0``); theirs and the variable's value
    after."""
    from tools import internals

    tuners = internals.triton_tuners().values()
    kept = [dict(t.cache) for t in tuners]
    env = os.environ.get(AUTOTUNE_ENV)
    for t in tuners:
        t.cache.clear()
    if not tune:
        os.environ[AUTOTUNE_ENV] = "0"
    try:
        yield
    finally:
        for t, cache in zip(tuners, kept, strict=True):
            t.cache.clear()
            t.cache.update(cache)
        if env is None:
            os.environ.pop(AUTOTUNE_ENV, None)
        else:
            os.environ[AUTOTUNE_ENV] = env


def measure(layer: str, shape: str, tune: bool = True) -> Dict:
    """The specialisations compiled by the first step and by the new graphs' steps, per kernel,
    and the tuning keys; ``tune=False``: with every key at its default config."""
    import gatlib
    from gatlib.bench.compare import build_pair, layer_edge_index
    from tools import internals
    from tools.launches import triton_warm_on_cpu

    features, heads, channels, classes = SHAPES[shape]
    model = build_pair(layer, features, heads, channels, "triton", torch.device("cpu"),
                       torch.float32, 0, "model", classes)["gatlib"]
    res: Dict = {"layer": layer, "shape": shape, "tuned": tune, "features": features,
                 "heads": heads, "channels": channels, "classes": classes}
    compiled: collections.Counter = collections.Counter()
    with cold_tuners(tune), triton_warm_on_cpu(collections.Counter(), compiled):
        for name, sizes in (("first_step", [(600, 3000)]), ("new_graph", NEW_GRAPHS)):
            before = collections.Counter(compiled)
            for n, e in sizes:
                x, ei, ei_loops = graph(n, e, features, seed=n)
                plan = gatlib.GraphPlan(layer_edge_index(layer, ei, ei_loops), num_nodes=n)
                labels = torch.randint(classes, (n,), generator=torch.Generator().manual_seed(1))
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(x, plan), labels).backward()
            res[name] = dict(sorted((compiled - before).items()))
            res[f"{name}_keys"] = {k: len(t.cache) for k, t in internals.triton_tuners().items()}
    res["first_step_total"] = sum(res["first_step"].values())
    return res


def build_parser() -> argparse.ArgumentParser:
    """The options (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(prog="python -m tools.tuning_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=LAYERS)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json", default=None, help="write the counts here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("tools.tuning_cost runs Triton's launch path, which TRITON_INTERPRET=1 replaces: unset it")
    from gatlib.bench.report import command_line, environment, format_table, write_json

    rows = [measure(layer, shape, tune) for shape in args.shapes for layer in args.layers
            for tune in (True, False)]
    kernels = sorted({k for r in rows for k in r["first_step"]})
    print(format_table(
        ["shape", "layer", "tuned", *kernels, "compiles", "keys", "new graphs: compiles", "keys"],
        [[r["shape"], r["layer"], "yes" if r["tuned"] else "no (defaults)",
          *(r["first_step"].get(k, 0) for k in kernels), r["first_step_total"],
          sum(r["first_step_keys"].values()), sum(r["new_graph"].values()),
          sum(r["new_graph_keys"].values())] for r in rows],
        align="<<<" + ">" * (len(kernels) + 4)))
    if args.json:
        write_json(args.json, {"command": command_line(), **environment(torch.device("cpu")),
                               "target": "sm_90 (stand-in)", "rows": rows})
        print(f"wrote {args.json}")
    return 1 if any(r["new_graph"] or r["new_graph_keys"] != r["first_step_keys"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
