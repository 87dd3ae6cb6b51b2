"""gatlib: sparse graph attention — GAT, GATv2 and a graph Transformer on one core.

:mod:`gatlib.layers` (drop-in for PyG's), :mod:`gatlib.models`, the attention core
(:func:`graph_attention`, :class:`EdgeScore`, the reference stages) and :class:`GraphPlan`; the
``gatlib`` command's harness is :mod:`gatlib.bench`, which the library never imports.
"""
from ._core import EdgeScore, reference_attention, segment_aggregate, segment_softmax
from ._dispatch import BACKENDS, FallbackWarning, available_backends, graph_attention, record_kernels
from ._plan import GraphPlan
from ._validate import UnsupportedInputError
from .layers import GATConv, GATv2Conv, TransformerConv

__version__ = "0.1.0"

__all__ = [
    "GATConv",
    "GATv2Conv",
    "TransformerConv",
    "GraphPlan",
    "graph_attention",
    "EdgeScore",
    "reference_attention",
    "segment_softmax",
    "segment_aggregate",
    "available_backends",
    "record_kernels",
    "BACKENDS",
    "UnsupportedInputError",
    "FallbackWarning",
]
