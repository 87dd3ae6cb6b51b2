"""What a lost gradient term does to the GAT step's checked gradient: a yardstick for a disagreement.

    python -m tools.cut_terms --json benchmarks/results/cut_terms_arxiv-like_cpu.json

``gatlib compare --scope model --layer gat`` checks one number per side: the norm-wise
relative error of conv1's weight gradient against eager PyG's. Compiled GATConv on an
H100 gave 2.32e-4 there in four runs (tolerance 1e-4; eager gatlib 2.2e-5), and its loss
agreed. This builds the same model (the same weights, graph and labels as that
comparison: ``gatlib.bench.compare``'s ``build_pair``, ``load_graph`` and
``random_labels``), runs conv1 with gatlib's eager kernels on CPU and conv2 (one head,
40 classes: small enough for plain PyTorch over the edges) written out, and reports
that relative error when conv2's gradient through one term — the destination term
``a_dst . h_i``, the source term ``a_src . h_j`` or the value ``h_j`` — is cut
(``detach``) on one class of edges: by the in-degree of their destination (rows of
more than 256 edges are the ones the GPU kernels split into pieces and merge), by
the piece of the row they fall in, or by the out-degree of their source. Each
figure is against the uncut gradient; the forward, and so the loss, is unchanged.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch_geometric.utils import add_self_loops, degree, remove_self_loops, softmax

import gatlib
from gatlib.bench import compare, report
from gatlib.bench.data import resolve_data_dir

# rows of more than this many edges are split into pieces of this many by the GPU kernels
# (the schedule's item length: gatlib.introspect.triton_schedule's work items)
PIECE = 256


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.cut_terms",
                                description=__doc__.splitlines()[0])
    p.add_argument("--graph", default="arxiv-like")
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--classes", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--json", default=None)
    return p


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    g = compare.load_graph(args.graph, resolve_data_dir(args.data_dir), seed=args.seed)
    x, ei = g.x, g.edge_index
    N = x.size(0)
    model = compare.build_pair("gat", x.size(1), args.heads, args.channels, "auto",
                               torch.device("cpu"), torch.float32, args.seed, "model",
                               args.classes)["gatlib"]
    labels = compare.random_labels(N, args.classes, "cpu", args.seed)
    plan = gatlib.GraphPlan(ei, num_nodes=N)
    conv1, conv2 = model.conv1, model.conv2
    weight = conv1.get_parameter(compare.first_weight(model).removeprefix("conv1."))
    loss_ref, grad_ref = compare.model_outputs(model, x, plan, labels)

    # conv2 over the edges GATConv attends (self-loops replaced by one per node)
    src, dst = add_self_loops(remove_self_loops(ei)[0], num_nodes=N)[0]
    E = src.numel()
    deg_in, deg_out = degree(dst, N).long(), degree(src, N).long()
    order = torch.sort(dst, stable=True)[1]  # CSR order: by destination, stable
    start = torch.cumsum(deg_in, 0) - deg_in
    position = torch.empty(E, dtype=torch.long)
    position[order] = torch.arange(E) - start[dst[order]]
    piece, pieces = position // PIECE, (deg_in[dst] + PIECE - 1) // PIECE
    split_dst = deg_in[dst] > PIECE

    with torch.no_grad():
        h1 = F.elu(conv1(x, plan))
    h1.requires_grad_()

    def grad_h1(term=None, cut=None):
        h = conv2.lin(h1).view(N, 1, -1)
        terms = {"dst": (h * conv2.att_dst).sum(-1)[dst], "src": (h * conv2.att_src).sum(-1)[src]}
        value = h[src]
        if term == "value":
            value = torch.where(cut[:, None, None], value.detach(), value)
        elif term is not None:
            terms[term] = torch.where(cut[:, None], terms[term].detach(), terms[term])
        alpha = softmax(F.leaky_relu(terms["src"] + terms["dst"], conv2.negative_slope), dst,
                        num_nodes=N)
        out = torch.zeros_like(h).index_add_(0, dst, alpha.unsqueeze(-1) * value).mean(1)
        loss = F.cross_entropy(out + conv2.bias, labels)
        return torch.autograd.grad(loss, h1)[0]

    def weight_grad(gh):
        return torch.autograd.grad(F.elu(conv1(x, plan)), weight, gh)[0]

    uncut = weight_grad(grad_h1())
    classes = {
        f"destination in-degree > {PIECE} (split rows)": split_dst,
        "split rows, first piece": split_dst & (piece == 0),
        "split rows, all but the first piece": split_dst & (piece > 0),
        "split rows, last piece": split_dst & (piece == pieces - 1),
        "split rows, all but the last piece": split_dst & (piece < pieces - 1),
        f"source out-degree > {PIECE}": deg_out[src] > PIECE,
        "self-loops": src == dst,
        "destination in-degree <= 4": deg_in[dst] <= 4,
        "every edge": torch.ones(E, dtype=torch.bool),
    }
    rows = [{"term": None, "edges": "none", "count": 0, "rel_err": rel_err(uncut, grad_ref)}]
    print(f"conv2 written out against gatlib's conv2: {rows[0]['rel_err']:.2e}")
    print(f"{'term':6s} {'edges':42s} {'count':>9s}  rel. error")
    for term in ("dst", "src", "value"):
        for name, cut in classes.items():
            err = rel_err(weight_grad(grad_h1(term, cut)), uncut)
            rows.append({"term": term, "edges": name, "count": int(cut.sum()), "rel_err": err})
            print(f"{term:6s} {name:42s} {rows[-1]['count']:9d}  {err:.3e}", flush=True)
    result = {"schema": "gatlib.cut_terms/1", "command": report.command_line(),
              "environment": report.environment("cpu"),
              "config": {**vars(args), "piece": PIECE},
              "graph": {"num_nodes": N, "num_edges_attended": E,
                        "split_rows": int((deg_in > PIECE).sum())},
              "loss": float(loss_ref), "rows": rows, "seconds": time.perf_counter() - t0}
    if args.json:
        report.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
