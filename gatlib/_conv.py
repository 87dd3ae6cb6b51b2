r"""What the three layers of :mod:`gatlib.layers` share: their ``MessagePassing``
base (argument checks, input splitting, the graph and its self-loops, the call
of the attention core, the output, the detour through ``propagate`` where a
subclass or a hook asks for PyG's flow), and the rule for attending in input
space (:func:`_input_space`) with the per-head projection after it.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor
from torch.nn.parameter import UninitializedTensorMixin
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.typing import OptPairTensor
from torch_geometric.utils import add_self_loops as _add_self_loops
from torch_geometric.utils import remove_self_loops as _remove_self_loops

from . import _adjacency as A
from . import _validate as V
from ._dispatch import attend_planned, check_backend_name
from ._heads import per_head_mm
from ._plan import GraphPlan, as_plan, base_edge_index
from ._record import log as _log

# The module of gatlib's own layers: a class defined there is a gatlib layer, a
# subclass defined anywhere else a user's (see _AttentionConv.__init_subclass__).
LAYERS_MODULE = "gatlib.layers"

# MessagePassing's extension points: a subclass (or an instance) that replaces one
# of these asks for PyG's message-passing flow, which the attention core cannot run.
_EXTENSION_POINTS = ("message", "aggregate", "update", "message_and_aggregate", "edge_update",
                     "explain_message")
_HOOKS = ("_propagate_forward_pre_hooks", "_propagate_forward_hooks",
          "_message_forward_pre_hooks", "_message_forward_hooks",
          "_aggregate_forward_pre_hooks", "_aggregate_forward_hooks",
          "_message_and_aggregate_forward_pre_hooks", "_message_and_aggregate_forward_hooks",
          "_edge_update_forward_pre_hooks", "_edge_update_forward_hooks")


class _AttentionConv(MessagePassing):
    """Shared plumbing: argument checks, input splitting, self-loops, output.

    An ordinary call runs the attention core (explain mode too: :meth:`_explain_weight`); one
    that uses MessagePassing's extension points (:data:`_EXTENSION_POINTS`, :data:`_HOOKS`)
    runs through ``propagate``, and the ``*_type`` comments above those calls are for PyG's
    ``Inspector`` (docs/pyg_compatibility.md, "PyG's MessagePassing machinery").
    """

    def __init__(self):
        super().__init__(aggr="add", node_dim=0)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__module__ == LAYERS_MODULE:  # gatlib's own layers; a user's subclass inherits it
            cls._gatlib_layer = cls

    def _use_propagate(self) -> Optional[str]:
        """Why this call must run through ``propagate``, or ``None``; where it must, a layer
        built for a fused backend raises, and ``record_kernels()`` logs ``"propagate"``."""
        cls, base, own = type(self), self._gatlib_layer, self.__dict__
        reason = None
        for name in _EXTENSION_POINTS:  # a gatlib class is compared only when subclassed
            if name in own or (cls is not base and getattr(cls, name) is not getattr(base, name)):
                reason = f"{name}() is overridden"
                break
        for name in _HOOKS if reason is None else ():
            if own[name] if name in own else getattr(self, name):
                reason = f"a {name.strip('_').replace('_', ' ')[:-1]} is registered"
                break
        if reason is not None:
            if self.backend not in ("auto", "torch"):
                raise ValueError(f"backend={self.backend!r} cannot run this call: {reason}, "
                                 "which only MessagePassing.propagate honours; build the layer "
                                 "with backend='auto' or 'torch'")
            _log("propagate")
        return reason

    def _explain_weight(self, plan: GraphPlan) -> Optional[Tensor]:
        """In explain mode, the edge mask PyG's explainer set, as a weight per edge
        of ``plan`` — by ``MessagePassing.explain_message``'s rule: sigmoid if
        asked, and where the layer added self-loops, the mask's own self-loop
        entries dropped and the added loops weighted 1."""
        if not self.explain:
            return None
        mask = self._edge_mask
        if mask is None:
            raise ValueError(f"{type(self).__name__} is in explain mode but has no edge mask "
                             "(_edge_mask); set one with torch_geometric.explain.algorithm."
                             "utils.set_masks")
        if self._apply_sigmoid:
            mask = mask.sigmoid()
        if mask.size(0) != plan.num_edges and self._loop_mask is not None:
            mask = torch.cat([mask[self._loop_mask], mask.new_ones(plan.num_dst)])
        if mask.size(0) != plan.num_edges:
            raise ValueError(f"the edge mask has {mask.size(0)} entries but the layer attends "
                             f"over {plan.num_edges} edges")
        return mask

    # With a torch.sparse adjacency, PyG's GAT layers return the adjacency holding
    # alpha; its TransformerConv returns the adjacency it was given.
    _adjacency_holds_alpha = True

    def _init_common(self, in_channels, out_channels, heads, concat, dropout, edge_dim, backend,
                     value_dropout):
        """Check and keep the arguments the three layers share (PyG's attribute names)."""
        V.check_in_channels("in_channels", in_channels)
        V.check_positive_int("out_channels", out_channels)
        V.check_positive_int("heads", heads)
        V.check_probability("dropout", dropout)
        V.check_probability("value_dropout", value_dropout)
        if edge_dim is not None:
            V.check_positive_int("edge_dim", edge_dim)
        check_backend_name(backend)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.concat = concat
        self.dropout = dropout
        self.edge_dim = edge_dim
        self.backend = backend
        self.value_dropout = value_dropout

    def _residual_and_bias(self, in_dst, width: int, residual: bool, bias: bool) -> None:
        """GAT's and GATv2's linear skip ``res`` (if ``residual``) and output ``bias``."""
        if residual:
            self.res = Linear(in_dst, width, bias=False, weight_initializer="glorot")
        else:
            self.register_parameter("res", None)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(width))
        else:
            self.register_parameter("bias", None)

    def _split(self, x, weight: Optional[Tensor], allow_missing_dst: bool = False) -> OptPairTensor:
        """Validate ``x`` (a tensor or a ``(x_src, x_dst)`` pair) against ``in_channels`` and
        the dtype and device of ``weight``, a plain projection's (:func:`_weight`; ``None``: the
        module checks what it takes)."""
        in_src, in_dst = ((self.in_channels, self.in_channels)
                          if isinstance(self.in_channels, int) else self.in_channels)
        if isinstance(x, Tensor):
            V.check_features("x", x, in_src, weight)
            if in_dst != in_src:
                V.check_features("x", x, in_dst, weight)
            return x, x
        if not isinstance(x, (tuple, list)) or len(x) != 2:
            raise TypeError("x must be a tensor [N, F] or a pair (x_src, x_dst) of tensors; "
                            f"got {type(x).__name__}")
        x_src = V.check_features("x[0] (source features)", x[0], in_src, weight)
        if x[1] is None and allow_missing_dst:
            return x_src, None
        x_dst = V.check_features("x[1] (destination features)", x[1], in_dst, weight)
        return x_src, x_dst

    def _graph(self, edge_index, edge_attr, num_src: int, num_dst: Optional[int], x: Tensor,
               self_loops: bool, fill_value=None, loop_nodes: Optional[int] = None,
               propagate: Optional[str] = None):
        """The :class:`GraphPlan` to attend over (with self-loops if asked; a given plan keeps
        its self-loop'ed twin) and the checked ``edge_attr`` (with the self-loops' fill values;
        an adjacency's values may be the edge features: :func:`gatlib._adjacency.edge_features`).
        ``propagate``: :meth:`_use_propagate`'s reason (a subclass's own ``edge_update`` or
        ``message`` may read ``edge_attr`` whatever ``edge_dim`` is, as in PyG)."""
        plan = as_plan(edge_index, num_src, num_dst, x.device, self_loops, loop_nodes)
        adjacency = V.is_adjacency(edge_index)
        edges = None  # [2, E] before the loops (read-only), where the loops need them
        if self_loops and (adjacency or edge_attr is not None):
            edges = base_edge_index(plan)
        if adjacency:
            edge_attr = A.edge_features(edge_index, edge_attr, self.edge_dim, self_loops, x)
            if self_loops:
                A.check_loops(edge_index, edges, plan.num_src, plan.num_dst)
        if edge_attr is not None or self.edge_dim is not None:
            edge_attr = V.check_edge_attr(edge_attr,
                                          plan.num_edges if edges is None else edges.size(1),
                                          self.edge_dim, x,
                                          user_defined=(edge_attr is not None
                                                        and self.edge_dim is None
                                                        and propagate is not None
                                                        and propagate.startswith(
                                                            ("edge_update", "message"))))
        if edges is not None and edge_attr is not None:
            n = min(plan.num_src, plan.num_dst) if loop_nodes is None else loop_nodes
            if plan.sink:  # the graph's own loops kept, pointed at the sink (GraphPlan.num_rows)
                E, sink = edges.size(1), plan.num_dst
                ei = torch.stack([edges[0], torch.where(edges[0] != edges[1], edges[1], sink)])
                # PyG's loop features over the remaining edges: the sink's are computed and cut
                edge_attr = _add_self_loops(ei, edge_attr, fill_value=fill_value,
                                            num_nodes=sink + 1)[1][:E + n]
            else:
                if torch.compiler.is_compiling():
                    # an eager twin (a warmed plan) in a compiled graph: how many edges
                    # stay is its edge count, so no size here follows from the values;
                    # the others are scattered to one slot past the end and cut
                    keep, left = edges[0] != edges[1], plan.num_edges - n
                    slot = torch.where(keep, keep.cumsum(0) - 1, left)
                    stay = edges.new_zeros(left + 1).scatter_(
                        0, slot, torch.arange(keep.numel(), device=keep.device))[:left]
                    ei, edge_attr = edges[:, stay], edge_attr[stay]
                else:
                    ei, edge_attr = _remove_self_loops(edges, edge_attr)
                edge_attr = _add_self_loops(ei, edge_attr, fill_value=fill_value, num_nodes=n)[1]
        return plan, edge_attr

    def _attend(self, score, value, plan, want_alpha, value_edge=None, concat=None):
        """Run the attention core over ``plan`` with this layer's dropout, head mode (or
        ``concat``) and backend; ``alpha`` only where wanted."""
        if self.value_dropout > 0.0:  # scores above came from the undropped features
            value = torch.nn.functional.dropout(value, self.value_dropout, self.training)
        return attend_planned(score, value, plan, value_edge, self.dropout, self.training,
                              self.concat if concat is None else concat, self.backend,
                              bool(want_alpha), self._explain_weight(plan) if self.explain else None)

    def _output(self, out, alpha, plan: GraphPlan, edge_index, return_attention_weights):
        if not return_attention_weights:
            return out
        if V.is_adjacency(edge_index):  # what PyG returns for it
            return out, A.attention_weights(edge_index, plan, alpha,
                                            looped=getattr(self, "add_self_loops", False),
                                            alpha_values=self._adjacency_holds_alpha)
        # plan.edge_index is a copy: editing it cannot reach the plan
        return out, (plan.edge_index, alpha)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"


def _plain(lin) -> bool:
    """Whether calling ``lin`` is exactly ``F.linear(x, lin.weight, lin.bias)``: a
    PyG ``Linear`` (not a subclass, a parametrized one, or a replacement such as a
    LoRA wrapper), initialised, without module hooks of its own (``prune``'s among
    them) or global ones (a lazy layer's initialising hook among them). Only then may
    a fast path read ``lin.weight`` instead of calling ``lin``."""
    return (type(lin) is Linear and not isinstance(lin.weight, UninitializedTensorMixin)
            and "forward" not in lin.__dict__  # (an instance's own forward)
            and not (lin._forward_hooks or lin._forward_pre_hooks or lin._backward_hooks
                     or lin._backward_pre_hooks)
            and not (torch.nn.modules.module._global_forward_hooks
                     or torch.nn.modules.module._global_forward_pre_hooks
                     or torch.nn.modules.module._global_backward_hooks
                     or torch.nn.modules.module._global_backward_pre_hooks))


def _weight(lin) -> Optional[Tensor]:
    """``lin.weight`` where :func:`_plain` allows reading it in place of calling ``lin``,
    else ``None``."""
    return lin.weight if _plain(lin) else None


def project(x: Tensor, *lins) -> List[Tensor]:
    """``[lin(x) for lin in lins]``, as one batched product where the layers are plain PyG
    ``Linear`` layers (:func:`_plain`) of one shape, all with a bias or none: one launch each
    way for all, each output a contiguous block (docs/design.md, "Fewer launches per step").
    Any other layer, or a sparse ``x``, is called as itself."""
    first = lins[0]
    # (not under torch.jit.trace, whose tracer fails on _StackedLinear with "unordered_map::at";
    # before, a set of traced shapes that never compared equal kept it out by accident)
    batched = len(lins) > 1 and x.layout == torch.strided and not torch.jit.is_tracing()
    for lin in lins:  # (a loop, not comprehensions: the route stays short, docs/benchmarks.md)
        if not batched:
            break
        batched = (_plain(lin) and tuple(lin.weight.shape) == tuple(first.weight.shape)
                   and (lin.bias is None) == (first.bias is None))
    if not batched:
        return [lin(x) for lin in lins]
    out_f, in_f = first.weight.shape
    lead = x.shape[:-1]
    biased = first.bias is not None
    # every weight and bias in one vector: one launch to gather them, and one
    # gradient vector whose pieces are the parameters' gradients, contiguous
    parts = [lin.weight.reshape(-1) for lin in lins]
    flat = torch.cat(parts + [lin.bias for lin in lins] if biased else parts)
    x = x.reshape(math.prod(lead), in_f)
    device = x.device.type
    if V.autocast_enabled(device):
        # as F.linear under autocast: in its dtype
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            y = _StackedLinear.apply(x.to(dtype), flat.to(dtype), len(lins), out_f, biased)
    else:
        y = _StackedLinear.apply(x, flat, len(lins), out_f, biased)
    return [t.view(*lead, out_f) for t in y.unbind(0)]


class _StackedLinear(torch.autograd.Function):
    """``y[g] = x @ w[g]^T + b[g]`` for ``x [R, F_in]`` and ``G`` weights ``w [G, F_out, F_in]``
    and biases ``b [G, F_out]`` (or none), all in the one vector ``flat``, as one batched
    product. Its backward writes the parameters' gradients into one vector in that layout, so
    each is contiguous (autograd's ``bmm`` backward would give transposed, strided ones)."""

    @staticmethod
    def forward(x, flat, groups: int, out_f: int, biased: bool):
        w, b = _StackedLinear._split(flat, groups, out_f, x.size(1), biased)
        xs = x.unsqueeze(0).expand(groups, *x.shape)  # one x for all: no copy
        if b is None:
            return torch.bmm(xs, w.transpose(1, 2))
        return torch.baddbmm(b.unsqueeze(1), xs, w.transpose(1, 2))

    @staticmethod
    def _split(flat, groups, out_f, in_f, biased):
        n = groups * out_f * in_f
        return flat[:n].view(groups, out_f, in_f), (flat[n:].view(groups, out_f) if biased else None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, flat, groups, out_f, biased = inputs
        ctx.save_for_backward(x, flat)
        ctx.shape = (groups, out_f, x.size(1), biased)

    @staticmethod
    def backward(ctx, g):
        x, flat = ctx.saved_tensors
        groups, out_f, in_f, biased = ctx.shape
        w, _ = _StackedLinear._split(flat, groups, out_f, in_f, biased)
        xs = x.unsqueeze(0).expand(groups, *x.shape)
        gx = gflat = None
        if ctx.needs_input_grad[0]:
            # sum_g g[g] @ w[g] as one product over (g, out): the only temporary is
            # g in [rows, G * F_out] order, no [G, rows, F_in] stack of products
            gx = g.transpose(0, 1).reshape(x.size(0), groups * out_f) @ w.reshape(-1, in_f)
        if ctx.needs_input_grad[1]:
            # double backward: out= is not differentiable; compiled or exported:
            # dynamo before torch 2.13 fixes the sizes of an out= product's operands,
            # so each new node count recompiled (up to the recompile limit, then eager)
            if torch.is_grad_enabled() or torch.compiler.is_compiling():
                parts = [torch.bmm(g.transpose(1, 2), xs).reshape(-1)]
                gflat = torch.cat(parts + ([g.sum(1).reshape(-1)] if biased else []))
            else:
                gflat = torch.empty_like(flat)
                gw, gb = _StackedLinear._split(gflat, groups, out_f, in_f, biased)
                torch.bmm(g.transpose(1, 2), xs, out=gw)
                if biased:
                    torch.sum(g, 1, out=gb)
        return gx, gflat, None, None, None


def _input_space(x: Tensor, channels: int) -> bool:
    r"""Whether a layer aggregates its sources' *inputs* and projects afterwards,
    :math:`\mathbf{W}_h \sum_j \alpha^h_{ij} \mathbf{x}_j` (equal, the projection being
    linear): where the input is narrower than a head (``F < C``), every edge then moves ``F``
    values per head instead of ``C``, in every backend (docs/design.md, "Input-space
    aggregation"). The layer asks it only of a plain projection (:func:`_plain`)."""
    return x.size(-1) < channels


def _project_heads(agg: Tensor, weight: Tensor, heads: int, concat: bool) -> Tensor:
    """``W_h agg_h`` for each head from input-space aggregates ``agg`` ``[N, H*F]``
    and a projection ``weight`` ``[H*C, F]``: heads concatenated ``[N, H*C]``, or
    averaged ``[N, C]`` (as one ``[N, H*F] @ [H*F, C]`` product)."""
    HC, F_in = weight.shape
    w = weight.view(heads, HC // heads, F_in).transpose(1, 2)  # [H, F, C]
    if concat:
        return per_head_mm(agg, w)
    return agg @ w.reshape(heads * F_in, HC // heads) / heads
