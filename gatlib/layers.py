r"""GATConv, GATv2Conv and TransformerConv: thin layers over the attention core.

Each owns the parameters of PyG 2.8's layer of the same name (a PyG ``state_dict`` loads as it
is), computes its edge score's per-node terms and calls :func:`gatlib._dispatch.graph_attention`;
a call that uses MessagePassing's extension points runs through ``propagate`` instead
(:class:`gatlib._conv._AttentionConv`). Where they differ from PyG on purpose (errors, attention
weights, graph inputs, sparse adjacencies): docs/pyg_compatibility.md.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.nn.inits import glorot, zeros
from torch_geometric.typing import OptPairTensor, OptTensor, PairTensor

from . import _scores as S
from . import _validate as V
from ._conv import _AttentionConv, _input_space, _plain, _project_heads, _weight, project
from ._core import EdgeScore, combine_heads, segment_softmax
from ._heads import per_head_mm
from ._plan import GraphPlan, checked_edge_list, owned_plan


class GATConv(_AttentionConv):
    r"""The graph attention layer of `Veličković et al. (2018)
    <https://arxiv.org/abs/1710.10903>`_.

    .. math::
        \mathbf{x}'_i = \big\Vert_{h=1}^{H}\ \sum_{j \in \mathcal{N}(i) \cup \{ i \}}
        \alpha^{h}_{ij} \mathbf{\Theta}^{h}_s \mathbf{x}_j, \qquad
        \alpha^{h}_{ij} = \operatorname{softmax}_j\Big(\mathrm{LeakyReLU}\big(
        \mathbf{a}^{h\top}_{s} \mathbf{\Theta}^{h}_s \mathbf{x}_j
        + \mathbf{a}^{h\top}_{t} \mathbf{\Theta}^{h}_t \mathbf{x}_i
        + \mathbf{a}^{h\top}_{e} \mathbf{\Theta}^{h}_e \mathbf{e}_{ij}\big)\Big)

    With ``concat=False`` the heads are averaged instead (the paper's output
    layer). Drop-in for ``torch_geometric.nn.GATConv`` (same arguments, defaults
    and parameter names).

    Args:
        in_channels, out_channels, heads, concat, negative_slope, dropout, add_self_loops,
            edge_dim, fill_value, bias, residual: as ``torch_geometric.nn.GATConv``'s, with
            its defaults (``in_channels=-1`` initialises lazily; a pair, bipartite graphs).
        value_dropout (float): dropout on the projected source features
            :math:`\Theta_s x_j` before they are aggregated (scores see them undropped), as
            the GAT paper's reference code does; a gatlib addition, not in PyG. (default: ``0.0``)
        backend (str): attention backend, see :func:`gatlib.available_backends`.
            (default: ``"auto"``)

    Shapes:
        - **input:** ``x`` ``[N, F_in]`` or ``([N_s, F_s], [N_t, F_t])``, ``edge_index``
          ``[2, E]`` (or a sparse adjacency ``[N_t, N_s]``), ``edge_attr`` ``[E, D]`` *(optional)*
        - **output:** ``[N_t, H * C]`` (``[N_t, C]`` if ``concat=False``); with
          ``return_attention_weights=True`` also ``(edge_index [2, E'], alpha [E', H])``, ``E'``
          counting the added self-loops (for a sparse adjacency, what PyG returns).
    """

    def __init__(
        self,
        in_channels: Union[int, Tuple[int, int]],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        add_self_loops: bool = True,
        edge_dim: Optional[int] = None,
        fill_value: Union[float, Tensor, str] = "mean",
        bias: bool = True,
        residual: bool = False,
        backend: str = "auto",
        value_dropout: float = 0.0,
    ):
        super().__init__()
        self._init_common(in_channels, out_channels, heads, concat, dropout, edge_dim, backend,
                          value_dropout)
        V.check_real("negative_slope", negative_slope)
        V.check_fill_value(fill_value, edge_dim)
        self.negative_slope = negative_slope
        self.add_self_loops = add_self_loops
        self.fill_value = fill_value
        self.residual = residual

        HC = heads * out_channels
        self.lin = self.lin_src = self.lin_dst = None
        if isinstance(in_channels, int):
            self.lin = Linear(in_channels, HC, bias=False, weight_initializer="glorot")
        else:
            self.lin_src = Linear(in_channels[0], HC, False, weight_initializer="glorot")
            self.lin_dst = Linear(in_channels[1], HC, False, weight_initializer="glorot")
        self.att_src = Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = Parameter(torch.empty(1, heads, out_channels))
        if edge_dim is not None:
            self.lin_edge = Linear(edge_dim, HC, bias=False, weight_initializer="glorot")
            self.att_edge = Parameter(torch.empty(1, heads, out_channels))
        else:
            self.lin_edge = None
            self.register_parameter("att_edge", None)
        in_dst = in_channels if isinstance(in_channels, int) else in_channels[1]
        self._residual_and_bias(in_dst, out_channels * (heads if concat else 1), residual, bias)
        self.reset_parameters()

    def reset_parameters(self):
        for lin in (self.lin, self.lin_src, self.lin_dst, self.lin_edge, self.res):
            if lin is not None:
                lin.reset_parameters()
        glorot(self.att_src)
        glorot(self.att_dst)
        glorot(self.att_edge)
        zeros(self.bias)

    def forward(
        self,
        x: Union[Tensor, OptPairTensor],
        edge_index: Tensor,
        edge_attr: OptTensor = None,
        size: Optional[Tuple[int, int]] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        """``x``, ``edge_index``, ``edge_attr`` as in the class docstring; ``size`` ``(N_s,
        N_t)`` overrides the node counts (a plan's or an adjacency's own must agree);
        ``return_attention_weights`` also returns ``(edge_index, alpha)``."""
        H, C = self.heads, self.out_channels
        lin_src = self.lin if self.lin is not None else self.lin_src
        lin_dst = self.lin if self.lin is not None else self.lin_dst
        w_src = _weight(lin_src)  # None: lin_src is called, never read (_plain)
        w_dst = w_src if lin_dst is lin_src else _weight(lin_dst)
        x_src, x_dst = self._split(x, w_src, allow_missing_dst=True)
        num_src = x_src.size(0)
        if size is not None:
            if (not isinstance(size, (tuple, list)) or len(size) != 2
                    or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in size)):
                raise ValueError(f"size must be a pair of non-negative ints (N_src, N_dst); got {size!r}")
            if size[0] != num_src or (x_dst is not None and size[1] != x_dst.size(0)):
                raise ValueError(f"size={tuple(size)} does not match the inputs' node counts")
        graph = edge_index
        if x_dst is not None:
            num_dst = x_dst.size(0)
        elif size is not None:
            num_dst = size[1]
        elif isinstance(edge_index, GraphPlan) or V.is_adjacency(edge_index):
            num_dst = None  # the plan's; the adjacency's rows
        else:  # (x_src, None) without size: destinations are those edge_index names
            ei, layout_fn = checked_edge_list(edge_index, num_src, None, x_src.device)
            num_dst = int(ei[1].max()) + 1 if ei.numel() > 0 else 0
            # PyG adds self-loops for all N_s source nodes in this case.
            num_dst = max(num_dst, num_src) if self.add_self_loops else num_dst
            graph = owned_plan(ei, num_src, num_dst, layout_fn)
        # Self-loops go on the first min(N_s, N_t) nodes, as in PyG.
        loop_nodes = min(size) if size is not None else None
        propagate = self._use_propagate()
        plan, edge_attr = self._graph(graph, edge_attr, num_src, num_dst, x_src,
                                      self.add_self_loops, self.fill_value, loop_nodes, propagate)
        num_dst = plan.num_dst

        res = self.res(x_dst) if self.res is not None and x_dst is not None else None
        one_x = x_dst is x_src and lin_dst is lin_src  # one x under one projection
        # Values are W_h x_j, projected first (h_src), or x_j, projected after the
        # aggregation where that moves fewer bytes (_input_space) and the projection is
        # a plain Linear (_plain); the values' own dropout needs them projected.
        in_space = (propagate is None and w_src is not None and _input_space(x_src, C)
                    and not (self.value_dropout > 0.0 and self.training))
        h_src = None if in_space else lin_src(x_src).view(-1, H, C)  # [N_s, H, C], the values
        h_dst = None  # [N_t, H, C], where the destinations' terms or propagate need it
        if x_dst is not None and not one_x and (propagate or w_dst is None):
            h_dst = lin_dst(x_dst).view(-1, H, C)

        # a^T[Wh_i || Wh_j] = a_dst·Wh_i + a_src·Wh_j: two [N, H] terms per node,
        # and a_edge·W_e e_ij one [E, H] term per edge (see gatlib._scores.gat_node_terms).
        if one_x:  # both terms at once
            a_src, a_dst = S.gat_node_term_pair(x_src, w_src, self.att_src, self.att_dst, h_src)
        else:
            a_src = S.gat_node_terms(x_src, w_src, self.att_src, h_src)  # [N_s, H]
            a_dst = None if x_dst is None else S.gat_node_terms(
                x_dst, w_dst, self.att_dst, h_dst)  # [N_t, H]
        if propagate:  # PyG's flow: edge_update, then message per edge
            if x_dst is not None and one_x:
                h_dst = h_src
            if self.value_dropout > 0.0:
                h_src = F.dropout(h_src, self.value_dropout, self.training)
            ei, size = plan.edge_index.long(), (num_src, num_dst)
            # edge_updater_type: (alpha: OptPairTensor, edge_attr: OptTensor)
            alpha = self.edge_updater(ei, alpha=(a_src, a_dst), edge_attr=edge_attr, size=size)
            # propagate_type: (x: OptPairTensor, alpha: Tensor)
            out = self.propagate(ei, x=(h_src, h_dst), alpha=alpha, size=size)
            out = combine_heads(out, self.concat)
        else:
            a_edge = None if self.lin_edge is None else self._edge_terms(edge_attr)  # [E, H]
            score = EdgeScore.gat(a_src, a_dst, a_edge, self.negative_slope)
            if in_space:  # every head aggregates x_j [N_s, 1, F]; then W_h per head
                agg, alpha = self._attend(score, x_src.unsqueeze(1), plan, return_attention_weights,
                                          concat=True)
                out = _project_heads(agg, lin_src.weight, H, self.concat)
            else:
                out, alpha = self._attend(score, h_src, plan, return_attention_weights)
        if res is not None:
            out = out + res
        if self.bias is not None:
            out = out + self.bias
        return self._output(out, alpha, plan, edge_index, return_attention_weights)

    def _edge_terms(self, edge_attr: Tensor) -> Tensor:
        """``a_edge · W_e e_ij`` ``[E, H]``: folded into the weight for a plain ``lin_edge``."""
        lin = self.lin_edge
        w = _weight(lin)
        h = None if w is not None else lin(edge_attr).view(-1, self.heads, self.out_channels)
        return S.gat_node_terms(edge_attr, w, self.att_edge, h)

    # MessagePassing's extension points, run only by the propagate path (see
    # _AttentionConv): the same computation as the attention core, edge by edge.
    def edge_update(self, alpha_j: Tensor, alpha_i: Optional[Tensor], edge_attr: Optional[Tensor],
                    index: Tensor, ptr: Optional[Tensor], dim_size: Optional[int]) -> Tensor:
        a_edge = None
        if edge_attr is not None and self.lin_edge is not None:
            a_edge = self._edge_terms(edge_attr.view(edge_attr.size(0), -1))
        alpha = S.gat_edge(alpha_j, alpha_i, a_edge, self.negative_slope)
        alpha = segment_softmax(alpha, index, dim_size)
        return F.dropout(alpha, p=self.dropout, training=self.training)

    def message(self, x_j: Tensor, alpha: Tensor) -> Tensor:
        return alpha.unsqueeze(-1) * x_j


class GATv2Conv(_AttentionConv):
    r"""GATv2, the dynamic attention layer of `Brody et al. (2022)
    <https://arxiv.org/abs/2105.14491>`_.

    .. math::
        \mathbf{x}'_i = \big\Vert_{h=1}^{H} \sum_{j \in \mathcal{N}(i) \cup \{ i \}}
        \alpha^{h}_{ij}\mathbf{\Theta}^{h}_{s}\mathbf{x}_{j}, \qquad
        \alpha^{h}_{ij} = \operatorname{softmax}_j\Big(\mathbf{a}^{h\top}
        \mathrm{LeakyReLU}\big(\mathbf{\Theta}^{h}_{s} \mathbf{x}_j
        + \mathbf{\Theta}^{h}_{t} \mathbf{x}_{i} + \mathbf{\Theta}^{h}_{e}
        \mathbf{e}_{ij}\big)\Big)

    Drop-in for ``torch_geometric.nn.GATv2Conv``: ``lin_l`` is
    :math:`\Theta_s` (sources, also the values), ``lin_r`` is
    :math:`\Theta_t` (destinations).

    Args:
        in_channels, out_channels, heads, concat, negative_slope, dropout, add_self_loops,
            edge_dim, fill_value, bias, share_weights, residual: as
            ``torch_geometric.nn.GATv2Conv``'s, with its defaults.
        value_dropout (float): dropout on the projected source features
            :math:`\Theta_s x_j` before they are aggregated (scores see them undropped), as
            :class:`GATConv`'s; a gatlib addition, not in PyG. (default: ``0.0``)
        backend (str): attention backend. (default: ``"auto"``)

    Shapes:
        - **input:** ``x`` ``[N, F_in]`` or ``([N_s, F_s], [N_t, F_t])``, ``edge_index``
          ``[2, E]`` (or a sparse adjacency ``[N_t, N_s]``), ``edge_attr`` ``[E, D]`` *(optional)*
        - **output:** ``[N_t, H * C]`` or ``[N_t, C]``; optionally ``(edge_index [2, E'], alpha
          [E', H])`` (for a sparse adjacency, what PyG returns).
    """

    def __init__(
        self,
        in_channels: Union[int, Tuple[int, int]],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        add_self_loops: bool = True,
        edge_dim: Optional[int] = None,
        fill_value: Union[float, Tensor, str] = "mean",
        bias: bool = True,
        share_weights: bool = False,
        residual: bool = False,
        backend: str = "auto",
        value_dropout: float = 0.0,
    ):
        super().__init__()
        self._init_common(in_channels, out_channels, heads, concat, dropout, edge_dim, backend,
                          value_dropout)
        V.check_real("negative_slope", negative_slope)
        V.check_fill_value(fill_value, edge_dim)
        if share_weights and isinstance(in_channels, (tuple, list)) and in_channels[0] != in_channels[1]:
            raise ValueError(f"share_weights=True needs equal source and destination widths; "
                             f"got in_channels={in_channels!r}")
        self.negative_slope = negative_slope
        self.add_self_loops = add_self_loops
        self.fill_value = fill_value
        self.residual = residual
        self.share_weights = share_weights

        HC = heads * out_channels
        in_src, in_dst = ((in_channels, in_channels) if isinstance(in_channels, int)
                          else in_channels)
        self.lin_l = Linear(in_src, HC, bias=bias, weight_initializer="glorot")
        self.lin_r = self.lin_l if share_weights else Linear(in_dst, HC, bias=bias,
                                                             weight_initializer="glorot")
        self.att = Parameter(torch.empty(1, heads, out_channels))
        self.lin_edge = (Linear(edge_dim, HC, bias=False, weight_initializer="glorot")
                         if edge_dim is not None else None)
        self._residual_and_bias(in_dst, out_channels * (heads if concat else 1), residual, bias)
        self.reset_parameters()

    def reset_parameters(self):
        for lin in (self.lin_l, self.lin_r, self.lin_edge, self.res):
            if lin is not None:
                lin.reset_parameters()
        glorot(self.att)
        zeros(self.bias)

    def forward(
        self,
        x: Union[Tensor, PairTensor],
        edge_index: Tensor,
        edge_attr: OptTensor = None,
        return_attention_weights: Optional[bool] = None,
    ):
        H, C = self.heads, self.out_channels
        x_src, x_dst = self._split(x, _weight(self.lin_l))
        num_src, num_dst = x_src.size(0), x_dst.size(0)
        propagate = self._use_propagate()
        plan, edge_attr = self._graph(edge_index, edge_attr, num_src, num_dst, x_src,
                                      self.add_self_loops, self.fill_value, propagate=propagate)
        res = self.res(x_dst) if self.res is not None else None
        if self.share_weights and x_dst is x_src:
            h_src = h_dst = self.lin_l(x_src).view(-1, H, C)  # [N_s, H, C]
        elif x_dst is x_src:  # both projections of one x as one product
            h_src, h_dst = project(x_src, self.lin_l, self.lin_r)
            h_src, h_dst = h_src.view(-1, H, C), h_dst.view(-1, H, C)
        else:
            h_src = self.lin_l(x_src).view(-1, H, C)  # [N_s, H, C]
            h_dst = self.lin_r(x_dst).view(-1, H, C)  # [N_t, H, C]
        if propagate:  # PyG's flow: edge_update, then message per edge
            ei = plan.edge_index.long()
            # edge_updater_type: (x: PairTensor, edge_attr: OptTensor)
            alpha = self.edge_updater(ei, x=(h_src, h_dst), edge_attr=edge_attr,
                                      size=(num_src, num_dst))
            if self.value_dropout > 0.0:  # the scores above saw the undropped features
                h_src = F.dropout(h_src, self.value_dropout, self.training)
            # propagate_type: (x: PairTensor, alpha: Tensor)
            out = self.propagate(ei, x=(h_src, h_dst), alpha=alpha, size=(num_src, num_dst))
            out = combine_heads(out, self.concat)
        else:
            h_edge = None
            if self.lin_edge is not None:
                h_edge = self.lin_edge(edge_attr).view(-1, H, C)  # [E, H, C]
            out, alpha = self._attend(
                EdgeScore.gatv2(h_src, h_dst, self.att.view(H, C), h_edge, self.negative_slope),
                h_src, plan, return_attention_weights)
        if res is not None:
            out = out + res
        if self.bias is not None:
            out = out + self.bias
        return self._output(out, alpha, plan, edge_index, return_attention_weights)

    # MessagePassing's extension points, run only by the propagate path (see
    # _AttentionConv): the same computation as the attention core, edge by edge.
    def edge_update(self, x_j: Tensor, x_i: Tensor, edge_attr: Optional[Tensor], index: Tensor,
                    ptr: Optional[Tensor], dim_size: Optional[int]) -> Tensor:
        h_edge = None
        if edge_attr is not None and self.lin_edge is not None:
            h_edge = self.lin_edge(edge_attr.view(edge_attr.size(0), -1)).view(-1, self.heads,
                                                                                self.out_channels)
        alpha = S.gatv2_edge(x_j, x_i, h_edge, self.att.view(self.heads, self.out_channels),
                             self.negative_slope)
        alpha = segment_softmax(alpha, index, dim_size)
        return F.dropout(alpha, p=self.dropout, training=self.training)

    def message(self, x_j: Tensor, alpha: Tensor) -> Tensor:
        return x_j * alpha.unsqueeze(-1)


class TransformerConv(_AttentionConv):
    r"""The graph Transformer attention layer of `Shi et al. (2021)
    <https://arxiv.org/abs/2009.03509>`_ (UniMP): scaled dot-product attention
    restricted to the graph's edges.

    .. math::
        \mathbf{x}'_i = \mathbf{W}_1 \mathbf{x}_i + \big\Vert_{h=1}^{H}
        \sum_{j \in \mathcal{N}(i)} \alpha^{h}_{ij} \left(\mathbf{W}^{h}_2 \mathbf{x}_{j}
        + \mathbf{W}^{h}_6 \mathbf{e}_{ij}\right), \qquad
        \alpha^{h}_{ij} = \operatorname{softmax}_j\left(
        \frac{(\mathbf{W}^{h}_3\mathbf{x}_i)^{\top} (\mathbf{W}^{h}_4\mathbf{x}_j
        + \mathbf{W}^{h}_6 \mathbf{e}_{ij})}{\sqrt{C}} \right)

    With ``beta=True`` the root term is gated:
    :math:`\mathbf{x}'_i = \beta_i \mathbf{W}_1 \mathbf{x}_i + (1 - \beta_i)\,\mathbf{m}_i`,
    :math:`\beta_i = \sigma(\mathbf{w}_5^{\top}[\mathbf{W}_1 \mathbf{x}_i,\ \mathbf{m}_i,\
    \mathbf{W}_1 \mathbf{x}_i - \mathbf{m}_i])` with :math:`\mathbf{m}_i` the
    attention output. Drop-in for ``torch_geometric.nn.TransformerConv``
    (``lin_query``, ``lin_key``, ``lin_value``, ``lin_edge``, ``lin_skip``,
    ``lin_beta``). No self-loops are added.

    Args:
        in_channels, out_channels, heads, concat, beta, dropout, edge_dim, bias, root_weight:
            as ``torch_geometric.nn.TransformerConv``'s, with its defaults.
        backend (str): attention backend. (default: ``"auto"``)
        value_dropout (float): dropout on the projected source values
            :math:`\mathbf{W}_2 \mathbf{x}_j` before they are aggregated (the keys are not
            dropped); a gatlib addition, not in PyG. (default: ``0.0``)

    Shapes:
        - **input:** ``x`` ``[N, F_in]`` or ``([N_s, F_s], [N_t, F_t])``, ``edge_index``
          ``[2, E]`` (or a sparse adjacency ``[N_t, N_s]``), ``edge_attr`` ``[E, D]`` *(optional)*
        - **output:** ``[N_t, H * C]`` or ``[N_t, C]``; optionally ``(edge_index [2, E], alpha
          [E, H])`` (for a sparse adjacency, what PyG returns).
    """

    _adjacency_holds_alpha = False  # PyG returns (adj_t, alpha) for a torch.sparse adj_t

    def __init__(
        self,
        in_channels: Union[int, Tuple[int, int]],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        beta: bool = False,
        dropout: float = 0.0,
        edge_dim: Optional[int] = None,
        bias: bool = True,
        root_weight: bool = True,
        backend: str = "auto",
        value_dropout: float = 0.0,
    ):
        super().__init__()
        self._init_common(in_channels, out_channels, heads, concat, dropout, edge_dim, backend,
                          value_dropout)
        self.beta = beta and root_weight
        self.root_weight = root_weight

        HC = heads * out_channels
        in_src, in_dst = ((in_channels, in_channels) if isinstance(in_channels, int)
                          else in_channels)
        self.lin_key = Linear(in_src, HC, bias=bias)
        self.lin_query = Linear(in_dst, HC, bias=bias)
        self.lin_value = Linear(in_src, HC, bias=bias)
        self.lin_edge = Linear(edge_dim, HC, bias=False) if edge_dim is not None else None
        width = HC if concat else out_channels
        # PyG builds lin_skip even with root_weight=False; keep it for state_dict parity.
        self.lin_skip = Linear(in_dst, width, bias=bias)
        self.lin_beta = Linear(3 * width, 1, bias=False) if self.beta else None
        self._alpha: Optional[Tensor] = None  # PyG's attribute; set only inside a propagate call
        self.reset_parameters()

    def reset_parameters(self):
        for lin in (self.lin_key, self.lin_query, self.lin_value, self.lin_edge,
                    self.lin_skip, self.lin_beta):
            if lin is not None:
                lin.reset_parameters()

    def forward(
        self,
        x: Union[Tensor, PairTensor],
        edge_index: Tensor,
        edge_attr: OptTensor = None,
        return_attention_weights: Optional[bool] = None,
    ):
        H, C = self.heads, self.out_channels
        x_src, x_dst = self._split(x, _weight(self.lin_key))
        propagate = self._use_propagate()
        plan, edge_attr = self._graph(edge_index, edge_attr, x_src.size(0), x_dst.size(0),
                                      x_src, self_loops=False, propagate=propagate)
        x_r = None
        if propagate is None and self._input_space(x_src):
            query = self.lin_query(x_dst).view(-1, H, C)  # [N_t, H, C]
            out, alpha = self._attend_inputs(x_src, query, plan, return_attention_weights)
        elif propagate:  # PyG's flow: score, softmax and weigh in message
            query = self.lin_query(x_dst).view(-1, H, C)  # [N_t, H, C]
            key = self.lin_key(x_src).view(-1, H, C)  # [N_s, H, C]
            value = self.lin_value(x_src).view(-1, H, C)  # [N_s, H, C]
            if self.value_dropout > 0.0:
                value = F.dropout(value, self.value_dropout, self.training)
            # propagate_type: (query: Tensor, key: Tensor, value: Tensor, edge_attr: OptTensor)
            out = self.propagate(plan.edge_index.long(), query=query, key=key, value=value,
                                 edge_attr=edge_attr, size=(x_src.size(0), x_dst.size(0)))
            out = combine_heads(out, self.concat)
            alpha, self._alpha = self._alpha, None  # message() left it there, as in PyG
        else:
            query, key, value, x_r = self._projections(x_src, x_dst)
            h_edge = None
            if self.lin_edge is not None:
                h_edge = self.lin_edge(edge_attr).view(-1, H, C)  # [E, H, C]
            out, alpha = self._attend(EdgeScore.dot(query, key, h_edge, 1.0 / math.sqrt(C)),
                                      value, plan, return_attention_weights, value_edge=h_edge)
        if self.root_weight:
            if x_r is None:
                x_r = self.lin_skip(x_dst)
            if self.lin_beta is not None:
                beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1)).sigmoid()
                out = beta * x_r + (1 - beta) * out
            else:
                out = out + x_r
        return self._output(out, alpha, plan, edge_index, return_attention_weights)

    def _projections(self, x_src: Tensor, x_dst: Tensor):
        """``(query [N_t, H, C], key, value [N_s, H, C], skip [N_t, ·] or None)``: one
        product per distinct input (:func:`gatlib._conv.project`)."""
        H, C = self.heads, self.out_channels
        skip = self.lin_skip
        with_skip = self.root_weight and _plain(skip) and skip.out_channels == H * C
        dst_lins = (self.lin_query, skip) if with_skip else (self.lin_query,)
        if x_dst is x_src:  # (by identity, not id(): see _core.distinct_inputs)
            query, *rest, key, value = project(x_src, *dst_lins, self.lin_key, self.lin_value)
        else:
            query, *rest = project(x_dst, *dst_lins)
            key, value = project(x_src, self.lin_key, self.lin_value)
        return (query.view(-1, H, C), key.view(-1, H, C), value.view(-1, H, C),
                rest[0] if rest else None)

    def _input_space(self, x_src: Tensor) -> bool:
        """Whether keys and values are attended in input space (:func:`_input_space`): not
        with edge features, nor where the value's bias would need the sum of a row's weights
        and it is not one (attention dropout, an explainer's mask), nor with value dropout."""
        train = self.training
        return (self.lin_edge is None and _plain(self.lin_key) and _plain(self.lin_value)
                and _input_space(x_src, self.out_channels)
                and not (self.value_dropout > 0.0 and train)
                and not (self.lin_value.bias is not None
                         and ((self.dropout > 0.0 and train) or self.explain)))

    def _attend_inputs(self, x_src: Tensor, query: Tensor, plan: GraphPlan, want_alpha):
        r"""Attention in input space: keys and values are the sources' inputs ``x_j`` (one
        head ``[N_s, 1, F]`` all heads share), the projections applied to the query before and
        to the aggregate after, per head::

            e_ij  = q_i . (W_k x_j + b_k) / sqrt(C) = (W_k^T q_i) . x_j / sqrt(C) + q_i . b_k / sqrt(C)
            out_i = sum_j alpha_ij (W_v x_j + b_v) = W_v (sum_j alpha_ij x_j) + b_v [i has in-edges]

        The softmax drops ``q_i . b_k`` (the same over ``i``'s edges); ``sum_j alpha_ij`` is
        one where ``i`` has in-edges, zero where not (:meth:`_input_space` keeps it so)."""
        H, C = self.heads, self.out_channels
        F_in = x_src.size(-1)
        x1 = x_src.unsqueeze(1)  # [N_s, 1, F]
        q_in = per_head_mm(query.reshape(-1, H * C), self.lin_key.weight.view(H, C, F_in))
        q_in = q_in.view(-1, H, F_in)  # W_k^T q_i per head
        agg, alpha = self._attend(EdgeScore.dot(q_in, x1, None, 1.0 / math.sqrt(C)), x1, plan,
                                  want_alpha, concat=True)
        out = _project_heads(agg, self.lin_value.weight, H, self.concat)  # [N_t, H*C] or [N_t, C]
        bias = self.lin_value.bias
        if bias is not None:
            bias = bias if self.concat else bias.view(H, C).mean(0)
        if self.lin_key.bias is not None:
            # The key's bias changes no output, so its gradient is zero (PyG's layer
            # computes it as zero up to rounding). It still takes part, times zero, so
            # that it has a gradient: DDP and optimisers see no unused parameter.
            unused = self.lin_key.bias.sum() * 0
            bias = unused if bias is None else bias + unused
        if self.lin_value.bias is not None:
            ptr = plan.layout().ptr
            has_in = (ptr[1:plan.num_dst + 1] > ptr[:plan.num_dst]).unsqueeze(1)  # [N_t, 1]
            out = out + has_in * bias
        elif bias is not None:
            out = out + bias
        return out, alpha

    # MessagePassing's extension point, run only by the propagate path (see
    # _AttentionConv): the same computation as the attention core, edge by edge.
    def message(self, query_i: Tensor, key_j: Tensor, value_j: Tensor,
                edge_attr: Optional[Tensor], index: Tensor, ptr: Optional[Tensor],
                size_i: Optional[int]) -> Tensor:
        H, C = self.heads, self.out_channels
        key_edge = None
        if edge_attr is not None and self.lin_edge is not None:
            edge_attr = key_edge = self.lin_edge(edge_attr.view(edge_attr.size(0), -1)).view(-1, H, C)
        alpha = S.dot_edge(key_j, query_i, key_edge, 1.0 / math.sqrt(C))
        alpha = segment_softmax(alpha, index, size_i)
        self._alpha = alpha  # PyG's TransformerConv keeps it here; forward takes it back
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)
        out = value_j if edge_attr is None else value_j + edge_attr
        return out * alpha.view(-1, H, 1)
