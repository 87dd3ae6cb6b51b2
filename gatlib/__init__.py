"""gatlib: sparse graph attention — GAT, GATv2 and a graph Transformer on one core."""
from ._backend import BACKENDS, available_backends
from ._core import (DotProductScore, GATScore, GATv2Score, graph_attention, segment_aggregate,
                    segment_softmax)
from .layers import GATConv, GATv2Conv, TransformerConv

__version__ = "0.1.0"

__all__ = [
    "GATConv",
    "GATv2Conv",
    "TransformerConv",
    "graph_attention",
    "segment_softmax",
    "segment_aggregate",
    "GATScore",
    "GATv2Score",
    "DotProductScore",
    "available_backends",
    "BACKENDS",
]
