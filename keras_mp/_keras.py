"""The one door to Keras and TensorFlow internals.

Every private attribute, `keras.src` or `tensorflow.python` import that
keras_mp relies on is here, so a Keras or TensorFlow release that moves one
breaks this module only, loudly. Read from Keras 3.15.1 and TensorFlow
2.21.0 (tested there), with the `keras.ops` interception that op-level
quantization reads (`intercept_ops`, keras-hub 0.32's layers call ops
through those module attributes). `check_versions` warns once on a Keras outside
the range below and fails on one that lacks a method keras_mp overrides.
"""

import contextlib
import re
import warnings

import keras
from keras.src.models.functional import Functional
from keras.src.saving.keras_saveable import KerasSaveable

# Keras (major, minor) releases whose internals match what is used here.
VERIFIED_KERAS = ((3, 3), (3, 15))
# Private LossScaleOptimizer hooks that keras_mp.LossScaleOptimizer
# overrides (scale bounds, skipped-step count): renamed, they would be
# silently bypassed, so their absence stops the import.
LOSS_SCALE_HOOKS = (
    "_stateful_handle_finite_grads",
    "_stateful_handle_non_finite_grads",
)
_warned = []


def check_versions():
    """Fails when Keras lacks a hook keras_mp overrides; warns, once, when
    Keras is outside the releases checked here."""
    missing = [
        name
        for name in LOSS_SCALE_HOOKS
        if not hasattr(keras.optimizers.LossScaleOptimizer, name)
    ]
    if missing:
        raise ImportError(
            f"keras {keras.__version__} has no "
            f"LossScaleOptimizer.{', '.join(missing)}, which "
            "keras_mp.LossScaleOptimizer overrides. Install a Keras between "
            f"{VERIFIED_KERAS[0][0]}.{VERIFIED_KERAS[0][1]} and "
            f"{VERIFIED_KERAS[1][0]}.{VERIFIED_KERAS[1][1]}."
        )
    version = tuple(int(p) for p in keras.__version__.split(".")[:2])
    outside = not VERIFIED_KERAS[0] <= version <= VERIFIED_KERAS[1]
    if outside and not _warned:
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
        return model._functional
    return model


def nodes_by_depth(graph):
    """The nodes of a Functional graph, deepest first: lists of nodes."""
    return list(graph._nodes_by_depth.values())


def inbound_nodes(layer):
    """The nodes at which `layer` was called in Functional graphs."""
    return list(layer._inbound_nodes)


def outbound_nodes(layer):
    """The nodes at which outputs of `layer` were taken as inputs."""
    return list(layer._outbound_nodes)


def keras_history(tensor):
    """`(operation, node_index, tensor_index)` of a symbolic tensor, or
    None for a tensor no layer produced."""
    return getattr(tensor, "_keras_history", None)


def producer(tensor):
    """The layer (operation) that produced a symbolic tensor, or None."""
    history = keras_history(tensor)
    return None if history is None else history.operation


def own_variables(layer):
    """The variables `layer` created itself (not its sublayers'), in the
    order its weights file stores them."""
    return layer._trainable_variables + layer._non_trainable_variables


def sublayers(layer):
    """The layers `layer` tracks directly (attributes, lists, a wrapper's
    inner layer), in tracking order: Keras' own layer tracker."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def call_training():
    """The `training` flag of the Keras call in progress (None outside one):
    what a layer's sublayers receive when the call passes it on."""
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value("training")


def in_xla_context():
    """True while tracing a function compiled with XLA (`jit_compile`)."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:
        # Moved in a later TensorFlow: assume XLA. The caller then adds a
        # select that is correct either way, only slower without XLA.
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


# Function attributes that keep grappler from inlining a call: Keras' TF
# backend runs grouped convolutions through `tf.function(jit_compile=True)`,
# whose call nodes carry them, and tf2onnx cannot convert the
# `(Stateful)PartitionedCall` nodes left behind.
NO_INLINE_ATTRS = ("_XlaMustCompile", "_noinline")


def frozen_graph_def(concrete_function):
    """A concrete function frozen to a GraphDef that grappler can inline.

    Variables and captured eager tensors (the mean and variance of
    `keras.layers.Normalization`) become constants, so the graph's only
    inputs are the function's own arguments; `NO_INLINE_ATTRS` are removed
    from every call node and library function.

    Control flow stays functional (`While`, `If`): lowered, a recurrent
    layer's loop becomes TensorList ops that tf2onnx cannot convert,
    while a `While` tf2onnx turns into an ONNX `Loop`, or an `LSTM`/`GRU`/
    `RNN` op when it recognizes the cell (`docs/export.md`, "Recurrent
    layers"). A graph without control flow freezes the same either way.

    Args:
        concrete_function: a `tf.function`'s concrete function.

    Returns:
        `(graph_def, input_names, output_names)`, tensor names such as
        `"input_0:0"`.
    """
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    frozen = convert_variables_to_constants_v2(
        concrete_function, lower_control_flow=False
    )
    graph_def = frozen.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
        for attr in NO_INLINE_ATTRS:
            if attr in function.attr:
                del function.attr[attr]
    for node in nodes:
        for attr in NO_INLINE_ATTRS:
            if attr in node.attr:
                del node.attr[attr]
    inputs = [t.name for t in frozen.inputs if t.dtype.name != "resource"]
    return graph_def, inputs, [t.name for t in frozen.outputs]


def inputs_are_dict(model):
    """Whether a Functional `model` was built from a dict of inputs (and so
    is called with a dict keyed like it), e.g. keras-hub backbones."""
    return isinstance(getattr(model, "_inputs_struct", None), dict)


_AUTO_INPUT_NAME = re.compile(r"(keras_tensor|input_layer)(_\d+)?")


def input_names(model):
    """The names of `model.inputs`, in order, as a user calls them: the
    dict keys of a model built from a dict (flattened sorted, as Keras
    does), else the input tensors' names. An input Keras named itself
    (`keras_tensor_<n>`, `input_layer_<n>`: a counter that changes with
    what the process built before, e.g. on reload) is `input_<i>`."""
    if inputs_are_dict(model):
        return sorted(model._inputs_struct)
    return [
        f"input_{i}" if _AUTO_INPUT_NAME.fullmatch(t.name) else t.name
        for i, t in enumerate(model.inputs)
    ]


@contextlib.contextmanager
def unlocked(layer):
    """Lets `layer` take new sublayers and variables after it was built
    (Keras locks a layer's tracker at the end of `build`)."""
    tracker = layer._tracker
    was_locked = tracker.locked
    tracker.unlock()
    try:
        yield layer
    finally:
        if was_locked:
            tracker.lock()


def copy_mask(source, target):
    """Gives tensor `target` the Keras mask of `source`, if it has one."""
    from keras.src import backend

    mask = backend.get_keras_mask(source)
    if mask is not None:
        backend.set_keras_mask(target, mask)


def float_value(variable):
    """A Keras variable's value in its own dtype, also inside an autocast
    scope (a mixed-precision layer's call reads float16 otherwise)."""
    from keras.src import backend

    with backend.AutocastScope(None):
        return variable.value


def is_plain_graph_model(model):
    """True for a `keras.Sequential` or a model built by
    `keras.Model(inputs, outputs)`, not a subclass of either (keras-hub
    backbones are Functional subclasses with their own config)."""
    return type(model) in (keras.Sequential, Functional)


def to_numpy(x):
    """A Keras or TensorFlow variable or eager tensor as a NumPy array.

    Keras 3.15's `ops.convert_to_numpy` of a variable calls
    `np.array(x, copy=False)`, which a TensorFlow variable's `__array__`
    does not accept under NumPy 2 (a DeprecationWarning at every call);
    the variable's own `numpy()` reads the same value without it.
    """
    numpy = getattr(x, "numpy", None)
    if callable(numpy):
        import numpy as np

        return np.asarray(numpy())
    return keras.ops.convert_to_numpy(x)


def intercept_ops(names, make_wrapper):
    """Replaces each `keras.ops` function of `names` by
    `make_wrapper(name, original)`, in every Keras module that exposes it
    (`keras.ops`, `keras.ops.numpy`, `keras.src.ops`, ...; not the module
    that defines it, whose own functions call it): keras-hub's and Keras'
    own layers call `ops.<name>` through one of those module attributes at
    call time (checked on Keras 3.15.1 and keras-hub 0.32). Idempotent.
    Returns `{name: original}`.

    A module that bound the function under its own name at import time
    (`from keras.src.ops.numpy import matmul`) keeps the original: such a
    call is not reached.
    """
    import sys

    import keras.src.ops.nn  # noqa: F401  (the modules that define them)
    import keras.src.ops.numpy  # noqa: F401

    originals = {}
    for name in names:
        current = getattr(keras.ops, name)
        original = getattr(current, "_keras_mp_original", None)
        if original is not None:  # already intercepted
            originals[name] = original
            continue
        originals[name] = original = current
        wrapper = make_wrapper(name, original)
        wrapper._keras_mp_original = original
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith("keras") or module is None:
                continue
            if module_name == original.__module__:
                continue  # its own module's internal calls stay as they are
            # the module's own names only: no module `__getattr__` runs
            # (those of renamed modules warn, `keras_mp._moved`)
            if getattr(module, "__dict__", {}).get(name) is original:
                setattr(module, name, wrapper)
    return originals


def intercept_tensor_matmul(matmul):
    """Makes the `@` operator of TensorFlow tensors call `matmul(x1, x2)`
    (keras-hub's SegFormer and ViTDet attention write `q @ k`, which
    reaches `tf.matmul` without `keras.ops`). Returns the operator's
    original function. Checked on TensorFlow 2.21: the operator is set on
    `tf.Tensor` and inherited by eager and graph tensors."""
    import tensorflow as tf

    current = tf.Tensor.__matmul__
    original = getattr(current, "_keras_mp_original", None)
    if original is None:
        original = current

        def __matmul__(self, other):
            return matmul(self, other)

        def __rmatmul__(self, other):
            return matmul(other, self)

        __matmul__._keras_mp_original = original
        tf.Tensor.__matmul__ = __matmul__
        tf.Tensor.__rmatmul__ = __rmatmul__
    return original
