"""PyG's ``Inspector`` reads gatlib's layers as it reads PyG's own: the signatures
of their ``message``/``edge_update``, and the types of what their ``forward``
passes to ``propagate``/``edge_updater`` (from the ``*_type`` comments PyG's
layers carry). ``MessagePassing.__init__`` builds the ``propagate`` it generates
from those; code that inspects layers (PyG's own tests among it) reads them too."""
import inspect

import pytest
import torch
import torch_geometric.nn as pyg_nn
from torch import Tensor
from torch_geometric.inspector import Inspector, Parameter, Signature
from torch_geometric.typing import OptPairTensor, OptTensor

import gatlib

LAYERS = {"gat": (gatlib.GATConv, pyg_nn.GATConv),
          "gatv2": (gatlib.GATv2Conv, pyg_nn.GATv2Conv),
          "transformer": (gatlib.TransformerConv, pyg_nn.TransformerConv)}

# The methods MessagePassing.__init__ inspects, with the arguments it leaves out.
INSPECTED = {"message": None, "aggregate": [0, "aggr"], "message_and_aggregate": [0],
             "update": [0], "edge_update": None}
EXTENSION_POINTS = ["message", "aggregate", "message_and_aggregate", "update", "edge_update",
                    "explain_message"]


def param(name, type_, type_repr):
    return Parameter(name, type_, type_repr, inspect._empty)


def test_pygs_test_inspector_gat_conv():
    """The checks of PyG 2.8's ``test_inspector_gat_conv``, on gatlib's GATConv."""
    GATConv = gatlib.GATConv
    inspector = Inspector(GATConv)
    assert str(inspector) == "Inspector(GATConv)"
    assert inspector.implements("message")
    assert not inspector.implements("message_and_aggregate")

    out = inspector.inspect_signature(GATConv.message)
    assert isinstance(out, Signature)
    assert out.param_dict == {"x_j": param("x_j", Tensor, "Tensor"),
                              "alpha": param("alpha", Tensor, "Tensor")}
    assert out.return_type == Tensor
    assert inspector.get_flat_params(["message", "message"]) == [
        param("x_j", Tensor, "Tensor"), param("alpha", Tensor, "Tensor")]
    assert inspector.get_flat_param_names(["message"]) == ["x_j", "alpha"]

    kwargs = {"x_j": torch.randn(5), "alpha": torch.randn(5)}
    data = inspector.collect_param_data("message", kwargs)
    assert len(data) == 2
    torch.testing.assert_close(data["x_j"], kwargs["x_j"])
    torch.testing.assert_close(data["alpha"], kwargs["alpha"])

    # (upstream passes SAGEConv.propagate: only the method's name is read)
    assert inspector.get_params_from_method_call(GATConv.propagate) == {
        "x": param("x", OptPairTensor, "OptPairTensor"),
        "alpha": param("alpha", Tensor, "Tensor"),
    }
    assert inspector.get_params_from_method_call("edge_updater") == {
        "alpha": param("alpha", OptPairTensor, "OptPairTensor"),
        "edge_attr": param("edge_attr", OptTensor, "OptTensor"),
    }


@pytest.mark.parametrize("name", LAYERS)
def test_inspector_reads_gatlib_as_it_reads_pyg(name):
    ours, theirs = (Inspector(cls) for cls in LAYERS[name])
    for method in EXTENSION_POINTS:
        assert ours.implements(method) == theirs.implements(method), method
    for method, exclude in INSPECTED.items():
        assert ours.inspect_signature(method, exclude) == theirs.inspect_signature(method, exclude), method
    funcs = ["message", "aggregate", "update"]
    assert ours.get_flat_params(funcs) == theirs.get_flat_params(funcs)
    for method in ["propagate", "edge_updater"]:
        for exclude in (None, [0, "size"], [0, "edge_index", "size"]):  # upstream's test; PyG's own calls
            assert (ours.get_params_from_method_call(method, exclude)
                    == theirs.get_params_from_method_call(method, exclude)), (method, exclude)


@pytest.mark.parametrize("name", LAYERS)
def test_generated_propagate_has_pygs_signature(name):
    """MessagePassing.__init__ generates ``propagate``/``edge_updater`` from what
    the Inspector read: for gatlib's layer, the same as for PyG's."""
    ours, theirs = (cls(6, 4, heads=2) for cls in LAYERS[name])
    generated = ["propagate", "edge_updater"] if ours.inspector.implements("edge_update") else ["propagate"]
    for method in generated:  # (PyG falls back to its own quietly if generating fails)
        assert getattr(type(ours), method).__module__ == f"gatlib.layers_{type(ours).__name__}_{method}"
    for method in ["propagate", "edge_updater"]:
        ours_fn, theirs_fn = getattr(type(ours), method), getattr(type(theirs), method)
        assert inspect.signature(ours_fn) == inspect.signature(theirs_fn), method
    assert ours._user_args == theirs._user_args
    assert ours._edge_user_args == theirs._edge_user_args
    assert ours.fuse == theirs.fuse


def test_a_subclass_inherits_the_types():
    """A subclass that overrides ``message`` (and so runs through ``propagate``)
    has its base's call types, as a subclass of PyG's layer has."""
    class Ours(gatlib.GATConv):
        def message(self, x_j: Tensor, alpha: Tensor) -> Tensor:
            return 2 * super().message(x_j, alpha)

    class Theirs(pyg_nn.GATConv):
        def message(self, x_j: Tensor, alpha: Tensor) -> Tensor:
            return 2 * super().message(x_j, alpha)

    for method in ["propagate", "edge_updater"]:
        assert (Inspector(Ours).get_params_from_method_call(method)
                == Inspector(Theirs).get_params_from_method_call(method))
    ours, theirs = Ours(6, 4), Theirs(6, 4)
    assert type(ours).propagate.__module__.endswith("_Ours_propagate")
    assert inspect.signature(type(ours).propagate) == inspect.signature(type(theirs).propagate)
