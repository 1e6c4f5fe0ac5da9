"""The one door to Keras and TensorFlow internals.

Every private attribute, `keras.src` or `tensorflow.python` import that
keras_mp relies on is here, so a Keras or TensorFlow release that moves one
breaks this module only. Checked against Keras 3.15.1 and TensorFlow 2.21.0;
`check_versions` warns once on a Keras outside the range verified here.
"""

import warnings

import keras
from keras.src.models.functional import Functional
from keras.src.saving.keras_saveable import KerasSaveable

# Keras (major, minor) releases these internals were read from.
VERIFIED_KERAS = ((3, 3), (3, 15))
_warned = []


def check_versions():
    """Warns, once, when Keras is newer than the releases checked here."""
    version = tuple(int(p) for p in keras.__version__.split(".")[:2])
    if version > VERIFIED_KERAS[1] and not _warned:
        _warned.append(version)
        warnings.warn(
            f"keras_mp was verified with Keras {VERIFIED_KERAS[0][0]}."
            f"{VERIFIED_KERAS[0][1]} to {VERIFIED_KERAS[1][0]}."
            f"{VERIFIED_KERAS[1][1]}; found {keras.__version__}. If a "
            "feature fails with an AttributeError from keras_mp/_keras.py, "
            "pin keras<=3.15 and report it.",
            stacklevel=2,
        )


def is_graph_model(model):
    """True for Sequential and Functional models (their graph is data)."""
    return isinstance(model, (keras.Sequential, Functional))


def functional_graph(model):
    """The Functional graph of a Sequential or Functional model, or None
    for a Sequential model built without an input shape."""
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    return model


def nodes_by_depth(graph):
    """The nodes of a Functional graph, deepest first: lists of nodes."""
    return list(graph._nodes_by_depth.values())


def inbound_nodes(layer):
    """The nodes at which `layer` was called in Functional graphs."""
    return list(getattr(layer, "_inbound_nodes", ()) or ())


def keras_history(tensor):
    """`(operation, node_index, tensor_index)` of a symbolic tensor, or
    None for a tensor no layer produced."""
    return getattr(tensor, "_keras_history", None)


def producer(tensor):
    """The layer (operation) that produced a symbolic tensor, or None."""
    history = keras_history(tensor)
    return None if history is None else history.operation


def sublayers(layer):
    """The layers `layer` tracks directly (attributes, lists, a wrapper's
    inner layer), in tracking order: Keras' own layer tracker."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def in_xla_context():
    """True while tracing a function compiled with XLA (`jit_compile`)."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # moved in a later TensorFlow: assume XLA
        return True
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


class SaveableState(KerasSaveable):
    """Base for a non-layer object (a constraint) whose variables must be
    saved in the `.keras` weights file beside its layer's.

    Keras' weights saver visits every `KerasSaveable` attribute of a layer;
    `_obj_type` picks which attributes of the object it skips, and "Loss"
    is the plain list. The subclass implements `save_own_variables` and
    `load_own_variables`.
    """

    def _obj_type(self):
        return "Loss"
