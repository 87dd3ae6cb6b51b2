"""Node-classification models built from gatlib's attention layers: :class:`GAT` /
:class:`GATv2` (the GAT paper's), :class:`GraphTransformer` (Dwivedi & Bresson), :class:`DeepGAT`
(DGL's ogbn-arxiv example), :class:`UniMP` (without the label embedding) and :class:`SampledGAT`
(PyG's ogbn-products example, on sampled mini-batches). Every model takes ``backend=`` for all of
its attention layers; input features may be a sparse CSR tensor (:func:`input_dropout`).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import BatchNorm1d, LayerNorm, Linear, ModuleList

from .layers import GATConv, GATv2Conv, TransformerConv

POSITIONAL_ENCODINGS = ("laplacian", "random_walk")


def input_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``F.dropout(x, p, training)`` that also takes sparse CSR features.

    A zero stays zero under dropout, so for sparse ``x`` only the stored
    values are dropped: the same distribution, at O(nnz) cost.
    """
    if x.layout == torch.sparse_csr and training and p > 0.0:
        return torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(),
                                       F.dropout(x.values(), p, True), x.shape,
                                       check_invariants=False)
    return F.dropout(x, p, training)


class GAT(torch.nn.Module):
    r"""The transductive GAT of `Veličković et al. (2018)
    <https://arxiv.org/abs/1710.10903>`_.

    .. math::
        \mathbf{h} = \mathrm{ELU}\big(\mathrm{GAT}_{8 \times 8}(\mathrm{drop}(\mathbf{x}))\big),
        \qquad \mathbf{y} = \mathrm{mean\ of\ heads}\;\mathrm{GAT}_{K \times C}(\mathrm{drop}(\mathbf{h}))

    Dropout acts on each layer's input, on the attention weights and — as in
    the paper's reference code (``utils/layers.py`` of PetarV-/GAT) — on the
    projected features before they are aggregated (``value_dropout``). The
    paper uses one output head (``out_heads=1``), eight on PubMed.

    Args:
        in_channels (int): input features ``F``.
        out_channels (int): classes ``C``.
        hidden_channels (int): channels per hidden head. (default: ``8``)
        heads (int): hidden heads. (default: ``8``)
        out_heads (int): output heads, averaged. (default: ``1``)
        dropout (float): input and attention dropout. (default: ``0.6``)
        value_dropout (float): dropout on the projected features that are
            aggregated. (default: ``0.6``)
        backend (str): attention backend of both layers. (default: ``"auto"``)

    Shapes:
        - **input:** ``x`` ``[N, F]``, ``edge_index`` ``[2, E]``
        - **output:** logits ``[N, C]``
    """

    conv = GATConv

    def __init__(self, in_channels: int, out_channels: int, hidden_channels: int = 8,
                 heads: int = 8, out_heads: int = 1, dropout: float = 0.6, value_dropout: float = 0.6,
                 backend: str = "auto"):
        super().__init__()
        self.dropout = dropout
        self.conv1 = self.conv(in_channels, hidden_channels, heads=heads, dropout=dropout,
                               value_dropout=value_dropout, backend=backend)
        self.conv2 = self.conv(hidden_channels * heads, out_channels, heads=out_heads, concat=False,
                               dropout=dropout, value_dropout=value_dropout, backend=backend)

    def reset_parameters(self):
        self.conv1.reset_parameters()
        self.conv2.reset_parameters()

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = input_dropout(x, self.dropout, self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


class GATv2(GAT):
    r""":class:`GAT` with the dynamic attention of `Brody et al. (2022)
    <https://arxiv.org/abs/2105.14491>`_ (:class:`~gatlib.GATv2Conv`); same
    arguments and shapes."""

    conv = GATv2Conv


class GraphTransformer(torch.nn.Module):
    r"""The graph Transformer of `Dwivedi & Bresson (2021)
    <https://arxiv.org/abs/2012.09699>`_: each layer is

    .. math::
        \hat{\mathbf{h}} = \mathrm{Norm}\big(\mathbf{h} + \mathbf{O}\,
        \Vert_{k=1}^{H} \textstyle\sum_{j \in \mathcal{N}(i)} \alpha^k_{ij} \mathbf{V}^k \mathbf{h}_j\big),
        \qquad \mathbf{h}' = \mathrm{Norm}\big(\hat{\mathbf{h}} + \mathbf{W}_2\,
        \mathrm{ReLU}(\mathbf{W}_1 \hat{\mathbf{h}})\big)

    with :math:`\alpha` the scaled dot-product attention over the graph's edges
    (:class:`~gatlib.TransformerConv` without its root term) and a feed-forward network
    ``ffn_ratio`` times as wide. The input embedding :math:`\mathbf{h}^0 = \mathbf{A}\mathbf{x}`
    adds a linear map of the positional encoding when one is given (:func:`positional_encoding`;
    a Laplacian eigenvector's sign is flipped at random in training, as in the paper).

    For small, sparse-feature graphs such as Planetoid's (``benchmarks/transformer_cora_ablation.md``):
    ``input_attention=True`` lets the first layer attend over the raw features :math:`\mathbf{x}`
    while the residual stream starts from :math:`\mathbf{h}^0`; ``readout="attention"`` replaces
    the linear classifier with a one-head attention layer over the classes. No self-loops are
    added: put them in ``edge_index`` for a node to attend to itself.

    Args:
        in_channels (int): input features ``F``.
        out_channels (int): classes ``C``.
        hidden_channels (int): model width ``D`` (divisible by ``heads``). (default: ``64``)
        num_layers (int): Transformer layers. (default: ``2``)
        heads (int): attention heads. (default: ``8``)
        dropout (float): dropout after attention and feed-forward blocks and
            before the classifier. (default: ``0.5``)
        input_dropout (float): dropout on the input features. (default: ``0.6``)
        attn_dropout (float): attention-weight dropout. (default: ``0.5``)
        value_dropout (float): dropout on the attended values, not the keys
            (:class:`~gatlib.TransformerConv`'s ``value_dropout``). (default: ``0.0``)
        norm (str): ``"batch"`` or ``"layer"``. (default: ``"batch"``)
        ffn_ratio (int): feed-forward width over ``D``. (default: ``2``)
        pe (str, optional): ``"laplacian"``, ``"random_walk"`` or ``None``. (default: ``None``)
        pe_dim (int): positional-encoding width. (default: ``0``)
        input_attention (bool): first layer attends over the raw features.
            (default: ``False``)
        readout (str): ``"linear"`` or ``"attention"``. (default: ``"linear"``)
        backend (str): attention backend. (default: ``"auto"``)

    Shapes:
        - **input:** ``x`` ``[N, F]``, ``edge_index`` ``[2, E]``, ``pe`` ``[N, pe_dim]``
        - **output:** logits ``[N, C]``
    """

    def __init__(self, in_channels: int, out_channels: int, hidden_channels: int = 64,
                 num_layers: int = 2, heads: int = 8, dropout: float = 0.5,
                 input_dropout: float = 0.6, attn_dropout: float = 0.5, value_dropout: float = 0.0,
                 norm: str = "batch", ffn_ratio: int = 2, pe: Optional[str] = None,
                 pe_dim: int = 0, input_attention: bool = False, readout: str = "linear",
                 backend: str = "auto"):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1; got {num_layers}")
        if readout not in ("linear", "attention"):
            raise ValueError(f"readout must be 'linear' or 'attention'; got {readout!r}")
        if hidden_channels % heads:
            raise ValueError(f"hidden_channels={hidden_channels} must be divisible by heads={heads}")
        if norm not in ("batch", "layer"):
            raise ValueError(f"norm must be 'batch' or 'layer'; got {norm!r}")
        if pe is not None and (pe not in POSITIONAL_ENCODINGS or pe_dim < 1):
            raise ValueError(f"pe must be one of {POSITIONAL_ENCODINGS} with pe_dim >= 1, or None; "
                             f"got pe={pe!r}, pe_dim={pe_dim}")
        self.dropout, self.input_dropout, self.pe = dropout, input_dropout, pe
        self.input_attention = input_attention
        self.input = Linear(in_channels, hidden_channels)
        self.pe_lin = Linear(pe_dim, hidden_channels) if pe is not None else None
        Norm = BatchNorm1d if norm == "batch" else LayerNorm
        D = hidden_channels
        self.attns = ModuleList(
            TransformerConv(in_channels if i == 0 and input_attention else D, D // heads,
                            heads=heads, dropout=attn_dropout, value_dropout=value_dropout,
                            root_weight=False, backend=backend)
            for i in range(num_layers))
        self.outs = ModuleList(Linear(D, D) for _ in range(num_layers))
        self.ffns = ModuleList(torch.nn.Sequential(Linear(D, ffn_ratio * D), torch.nn.ReLU(),
                                                   torch.nn.Dropout(dropout), Linear(ffn_ratio * D, D))
                               for _ in range(num_layers))
        self.norms1 = ModuleList(Norm(D) for _ in range(num_layers))
        self.norms2 = ModuleList(Norm(D) for _ in range(num_layers))
        self.classifier = (Linear(D, out_channels) if readout == "linear" else
                           TransformerConv(D, out_channels, heads=1, dropout=attn_dropout,
                                           value_dropout=value_dropout, root_weight=False,
                                           backend=backend))

    def forward(self, x: Tensor, edge_index: Tensor, pe: Optional[Tensor] = None) -> Tensor:
        x = input_dropout(x, self.input_dropout, self.training)
        h = self.input(x)  # [N, D]
        if self.pe_lin is not None:
            if pe is None:
                raise ValueError(f"this model was built with pe={self.pe!r}: pass pe=[N, pe_dim]")
            if self.pe == "laplacian" and self.training:
                pe = pe * (torch.randint(0, 2, (1, pe.size(1)), device=pe.device) * 2 - 1)
            h = h + self.pe_lin(pe)
        h = F.dropout(h, self.dropout, self.training)
        for i, (attn, out, ffn, norm1, norm2) in enumerate(
                zip(self.attns, self.outs, self.ffns, self.norms1, self.norms2, strict=True)):
            a = attn(x if i == 0 and self.input_attention else h, edge_index)
            h = norm1(h + F.dropout(out(a), self.dropout, self.training))
            h = norm2(h + F.dropout(ffn(h), self.dropout, self.training))
        h = F.dropout(h, self.dropout, self.training)
        if isinstance(self.classifier, TransformerConv):
            return self.classifier(h, edge_index)
        return self.classifier(h)


class DeepGAT(torch.nn.Module):
    r"""A deep GAT with residual connections and batch normalisation, after
    DGL's ogbn-arxiv example (3 layers of 3 heads x 250 channels).

    Each hidden layer is
    :math:`\mathbf{h}' = \mathrm{drop}(\mathrm{ReLU}(\mathrm{BN}(\mathrm{GAT}(\mathbf{h})
    + \mathbf{W}_{res}\mathbf{h})))`; the last layer has one head. Unlike
    DGL's example the attention keeps its destination term, and there is no
    symmetric degree normalisation or edge dropout.

    Args:
        in_channels (int): input features ``F``.
        out_channels (int): classes ``C``.
        hidden_channels (int): channels per head. (default: ``250``)
        num_layers (int): layers. (default: ``3``)
        heads (int): heads per hidden layer. (default: ``3``)
        dropout (float): dropout after each hidden layer. (default: ``0.75``)
        input_dropout (float): dropout on the input features. (default: ``0.1``)
        attn_dropout (float): attention-weight dropout. (default: ``0.0``)
        conv (str): ``"gat"`` or ``"gatv2"``. (default: ``"gat"``)
        backend (str): attention backend. (default: ``"auto"``)

    Shapes:
        - **input:** ``x`` ``[N, F]``, ``edge_index`` ``[2, E]``
        - **output:** logits ``[N, C]``
    """

    def __init__(self, in_channels: int, out_channels: int, hidden_channels: int = 250,
                 num_layers: int = 3, heads: int = 3, dropout: float = 0.75,
                 input_dropout: float = 0.1, attn_dropout: float = 0.0, conv: str = "gat",
                 backend: str = "auto"):
        super().__init__()
        Conv = {"gat": GATConv, "gatv2": GATv2Conv}[conv]
        self.dropout, self.input_dropout = dropout, input_dropout
        self.convs, self.norms = ModuleList(), ModuleList()
        for i in range(num_layers):
            last = i == num_layers - 1
            self.convs.append(Conv(in_channels if i == 0 else heads * hidden_channels,
                                   out_channels if last else hidden_channels,
                                   heads=1 if last else heads, concat=not last,
                                   dropout=attn_dropout, residual=True, backend=backend))
            if not last:
                self.norms.append(BatchNorm1d(heads * hidden_channels))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        h = input_dropout(x, self.input_dropout, self.training)
        for conv, norm in zip(self.convs[:-1], self.norms, strict=True):
            h = F.dropout(F.relu(norm(conv(h, edge_index))), self.dropout, self.training)
        return self.convs[-1](h, edge_index)


class UniMP(torch.nn.Module):
    r"""The graph Transformer of UniMP (`Shi et al. 2021
    <https://arxiv.org/abs/2009.03509>`_) without label propagation: gated
    (``beta=True``) :class:`~gatlib.TransformerConv` layers with LayerNorm
    and ReLU in between, the last one averaging its heads.

    Args:
        in_channels (int): input features ``F``.
        out_channels (int): classes ``C``.
        hidden_channels (int): width of the hidden layers (divisible by ``heads``).
            (default: ``128``)
        num_layers (int): layers. (default: ``3``)
        heads (int): heads. (default: ``2``)
        dropout (float): attention dropout and dropout between layers. (default: ``0.3``)
        backend (str): attention backend. (default: ``"auto"``)

    Shapes:
        - **input:** ``x`` ``[N, F]``, ``edge_index`` ``[2, E]``
        - **output:** logits ``[N, C]``
    """

    def __init__(self, in_channels: int, out_channels: int, hidden_channels: int = 128,
                 num_layers: int = 3, heads: int = 2, dropout: float = 0.3, backend: str = "auto"):
        super().__init__()
        if hidden_channels % heads:
            raise ValueError(f"hidden_channels={hidden_channels} must be divisible by heads={heads}")
        self.dropout = dropout
        self.convs, self.norms = ModuleList(), ModuleList()
        for i in range(num_layers):
            last = i == num_layers - 1
            self.convs.append(TransformerConv(
                in_channels if i == 0 else hidden_channels,
                out_channels if last else hidden_channels // heads, heads=heads,
                concat=not last, beta=True, dropout=dropout, backend=backend))
            if not last:
                self.norms.append(LayerNorm(hidden_channels))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        for conv, norm in zip(self.convs[:-1], self.norms, strict=True):
            x = F.dropout(F.relu(norm(conv(x, edge_index))), self.dropout, self.training)
        return self.convs[-1](x, edge_index)


class SampledGAT(torch.nn.Module):
    r"""The GAT of PyG's ogbn-products example (``examples/ogbn_products_gat.py``:
    3 layers, 4 heads x 128 channels, a linear skip around every layer, ELU and
    dropout 0.5 between layers), built to train on sampled mini-batches.

    .. math::
        \mathbf{h}^{l+1}_i = \mathrm{drop}\big(\mathrm{ELU}\big(
        \mathrm{GAT}^l(\mathbf{h}^l)_i + \mathbf{W}^l_{skip}\mathbf{h}^l_i\big)\big)

    (the last layer averages its heads and has neither ELU nor dropout). Given
    ``num_sampled_nodes`` (the seed count, then the nodes each hop added, as ``NeighborLoader``
    lays them out), layer ``l`` of ``L`` runs on the bipartite block from the nodes within
    ``L - l`` hops to those within ``L - l - 1``, so the last computes the seeds only: PyG's
    ``trim_to_layer``, one step further. Without it every layer runs on the whole graph.

    Args:
        in_channels (int): input features ``F``.
        out_channels (int): classes ``C``.
        hidden_channels (int): channels per head. (default: ``128``)
        num_layers (int): layers, i.e. sampled hops. (default: ``3``)
        heads (int): heads of every layer. (default: ``4``)
        dropout (float): dropout after each hidden layer. (default: ``0.5``)
        conv (str): ``"gat"`` or ``"gatv2"``. (default: ``"gat"``)
        backend (str): attention backend. (default: ``"auto"``)

    Shapes:
        - **input:** ``x`` ``[N, F]``, ``edge_index`` ``[2, E]``,
          ``num_sampled_nodes`` ``num_layers + 1`` ints summing to ``N``
        - **output:** logits ``[N, C]``, or ``[num_sampled_nodes[0], C]``
          (the seeds) when ``num_sampled_nodes`` is given
    """

    def __init__(self, in_channels: int, out_channels: int, hidden_channels: int = 128,
                 num_layers: int = 3, heads: int = 4, dropout: float = 0.5, conv: str = "gat",
                 backend: str = "auto"):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1; got {num_layers}")
        if conv not in ("gat", "gatv2"):
            raise ValueError(f"conv must be 'gat' or 'gatv2'; got {conv!r}")
        Conv = {"gat": GATConv, "gatv2": GATv2Conv}[conv]
        self.num_layers, self.dropout = num_layers, dropout
        self.convs, self.skips = ModuleList(), ModuleList()
        for i in range(num_layers):
            last = i == num_layers - 1
            width_in = in_channels if i == 0 else heads * hidden_channels
            width_out = out_channels if last else heads * hidden_channels
            self.convs.append(Conv(width_in, out_channels if last else hidden_channels,
                                   heads=heads, concat=not last, backend=backend))
            self.skips.append(Linear(width_in, width_out))

    def reset_parameters(self):
        for conv, skip in zip(self.convs, self.skips, strict=True):
            conv.reset_parameters()
            skip.reset_parameters()

    def layer(self, i: int, x: Tensor, edge_index: Tensor, num_dst: Optional[int] = None) -> Tensor:
        """Layer ``i`` alone, from the sources ``x`` ``[N_s, F_i]`` to the destinations
        ``x[:num_dst]`` (all of ``x`` when ``None``), ``edge_index`` holding every in-edge of
        the destinations: the step of layer-wise inference. Returns ``[num_dst, F_{i+1}]``."""
        x_dst = x if num_dst is None else x[:num_dst]
        h = self.convs[i]((x, x_dst), edge_index) + self.skips[i](x_dst)  # [N_t, F_{i+1}]
        if i < self.num_layers - 1:
            h = F.dropout(F.elu(h), self.dropout, self.training)
        return h

    def forward(self, x: Tensor, edge_index: Tensor,
                num_sampled_nodes: Optional[Sequence[int]] = None) -> Tensor:
        if num_sampled_nodes is None:
            for i in range(self.num_layers):
                x = self.layer(i, x, edge_index)
            return x
        counts = hop_offsets(num_sampled_nodes, self.num_layers, x.size(0))
        dst = edge_index[1]
        for i in range(self.num_layers):
            # Destinations within L-1-i hops are a prefix of the nodes; their
            # in-edges come from at most one hop further out, i.e. from x.
            num_dst = counts[self.num_layers - 1 - i]
            x = self.layer(i, x, edge_index[:, dst < num_dst], num_dst)
        return x


def hop_offsets(num_sampled_nodes: Sequence[int], num_layers: int, num_nodes: int) -> List[int]:
    """Cumulative node counts ``[n_0, n_0 + n_1, ...]`` of per-hop counts
    ``n_0`` (seeds), ``n_1``, ... (``num_layers + 1`` of them, summing to
    ``num_nodes``); raises ``ValueError`` otherwise."""
    counts = [int(n) for n in num_sampled_nodes]
    if len(counts) != num_layers + 1 or any(n < 0 for n in counts) or sum(counts) != num_nodes:
        raise ValueError(f"num_sampled_nodes must be {num_layers + 1} non-negative counts (seeds, "
                         f"then one per hop) summing to the {num_nodes} nodes; got {counts}")
    offsets, total = [], 0
    for n in counts:
        total += n
        offsets.append(total)
    return offsets


def positional_encoding(kind: str, dim: int):
    """The PyG transform that stores a ``[N, dim]`` positional encoding as ``data.pe``:
    ``kind`` ``"laplacian"`` (``AddLaplacianEigenvectorPE``, the ``dim`` eigenvectors after the
    trivial one) or ``"random_walk"`` (``AddRandomWalkPE``, return probabilities of walks of
    length 1..``dim``)."""
    from torch_geometric.transforms import AddLaplacianEigenvectorPE, AddRandomWalkPE

    if kind == "laplacian":
        return AddLaplacianEigenvectorPE(dim, attr_name="pe", is_undirected=True)
    if kind == "random_walk":
        return AddRandomWalkPE(dim, attr_name="pe")
    raise ValueError(f"positional encoding must be one of {POSITIONAL_ENCODINGS}; got {kind!r}")
