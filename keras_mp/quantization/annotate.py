"""Annotate -> apply: which layers get quantized, and where Q/DQ go.

tfmot's flow for Keras 3 models, with TensorRT's Q/DQ placement rules
(`docs/quantization.md`) built in. Two mechanisms, one rule set: a
Sequential or Functional model whose quantizable layers are all layers of
its graph is copied graph-wise with each of them in a `QuantizeWrapper`;
any other model (subclassed, keras-hub backbones, layers inside custom
layers or `MultiHeadAttention`) is quantized in place (`inplace.py`).
"""

import keras

from keras_mp import _keras, _models, layer_table
from keras_mp.layer_table import NO_INPUTS, SKIP_INPUTS
from keras_mp.quantization import inplace
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.layers import (
    QuantizeActivation,
    QuantizeWrapper,
    quantizable_row,
)
from keras_mp.quantization.model import QuantizedModel
from keras_mp.quantization.twins import is_quantized
from keras_mp.selection import layer_matcher


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizeAnnotate(keras.layers.Wrapper):
    """Marks a layer for `quantize_apply`; computes exactly like the layer.

    Args:
        layer: the layer to quantize.
        config: `QuantizeConfig` or None.
    """

    def __init__(self, layer, config=None, **kwargs):
        kwargs.setdefault("dtype", layer.dtype_policy)
        kwargs.setdefault("name", f"annotate_{layer.name}")
        super().__init__(layer, **kwargs)
        if isinstance(config, dict):
            config = QuantizeConfig.from_config(config)
        self.config = config

    def call(self, inputs, *args, **kwargs):
        return self.layer(inputs, *args, **kwargs)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def get_config(self):
        config = super().get_config()
        config["config"] = self.config.get_config() if self.config else None
        return config


def quantize_annotate_layer(layer, config=None):
    """Marks one layer for quantization (use it while building a model).

    Args:
        layer: `keras.layers.Layer` of a supported type.
        config: `QuantizeConfig`. Defaults to the type's defaults.

    Returns:
        A `QuantizeAnnotate` wrapper that computes like `layer`.

    Raises:
        ValueError: the layer type is not supported.

    Example:

    >>> model = keras.Sequential([
    ...     keras.Input((28, 28, 1)),
    ...     keras_mp.quantize_annotate_layer(keras.layers.Conv2D(8, 3)),
    ...     keras.layers.Flatten(),
    ...     keras.layers.Dense(10),
    ... ])
    >>> qmodel = keras_mp.quantize_apply(model)
    """
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(
            f"Expected a Keras 3 layer. Received: {type(layer).__name__}"
        )
    if quantizable_row(layer) is None:
        QuantizeWrapper(layer)  # raises the unsupported-type error
    return QuantizeAnnotate(layer, config)


def _config_for(layer, config):
    return inplace.config_for((layer,), config)


def graph_layers(model):
    """The layers `keras.models.clone_model(recursive=True)` rebuilds: those
    of `model` and of every model nested in it, in a stable order."""
    models = [model] + [
        layer
        for layer in _models.walk_layers(model, include_models=True)
        if isinstance(layer, keras.Model)
    ]
    return [layer for m in models for layer in m.layers]


def _check_float_model(model, caller):
    _models.check_model(model, caller)
    quantized = (QuantizeWrapper, QuantizeActivation, QuantizedModel)
    for layer in [model, *_models.walk_layers(model, include_models=True)]:
        if isinstance(layer, quantized) or is_quantized(layer):
            raise ValueError(
                f"Model {model.name!r} is already quantized (layer "
                f"{layer.name!r}). Call quantize_apply on the float model, "
                "or strip it first with keras_mp.strip_quantization()."
            )
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} has never been called, so its layers "
            f"have no weights yet for `{caller}`. Build it with "
            "`keras.Input(...)` or call it once on a batch first."
        )


def _graph_path(model):
    """Whether the graph copy reaches every quantizable layer of `model`:
    it and its nested models are plain Sequential/Functional models, and
    no layer of their graphs holds quantizable layers of its own."""
    for layer in [model, *_models.walk_layers(model, include_models=True)]:
        if isinstance(layer, keras.Model) and not _keras.is_plain_graph_model(
            layer
        ):
            return False
    for layer in graph_layers(model):
        if isinstance(layer, keras.Model):
            continue
        inner = unwrap(layer)
        row = layer_table.row_for(inner)
        if row is not None and row.attention:
            return False
        if any(
            quantizable_row(sub) is not None
            for sub in _models.walk_layers(inner)
        ):
            return False
    return True


def _copy_layer(layer):
    return layer.__class__.from_config(layer.get_config())


def quantize_annotate_model(model, layers=None, config=None):
    """Marks layers of a Sequential/Functional model for quantization.

    Args:
        model: `keras.Model`, Sequential or Functional (nested allowed).
        layers: which layers: a name, regex, layer class, callable, or a list
            of them. Defaults to every supported layer.
        config: a `QuantizeConfig` for all, or a dict mapping names/regexes
            to `QuantizeConfig`. `QuantizeConfig(skip=True)` leaves a layer
            in float.

    Returns:
        A copy of `model` (same weights) with the selected layers wrapped in
        `QuantizeAnnotate`; for a model quantized in place (subclassed,
        nested custom layers), a copy whose selected layers are marked.

    Raises:
        TypeError: a tf_keras or non-Keras model.
        ValueError: the selection names an unsupported layer, or matches
            no quantizable layer; a model that cannot be copied.
    """
    _check_float_model(model, "quantize_annotate_model")
    if not _graph_path(model):
        return inplace.annotate_in_place(model, layers, config)
    match = layer_matcher(layers)
    chosen = {}
    for layer in graph_layers(model):
        if isinstance(layer, (keras.Model, keras.layers.InputLayer)):
            continue
        if not match(layer) or isinstance(layer, QuantizeAnnotate):
            continue
        layer_config = _config_for(layer, config)
        if layer_config is not None and layer_config.skip:
            continue
        row = quantizable_row(layer)
        if row is None:
            if layers is not None and isinstance(layers, str):
                QuantizeWrapper(layer)  # raises, naming the layer
            continue
        wants_inputs = (layer_config and layer_config.quantize_inputs) or (
            row.inputs != NO_INPUTS
        )
        if row.weights or wants_inputs:
            chosen[id(layer)] = layer_config
    if not chosen:
        raise ValueError(
            f"No quantizable layer in model {model.name!r} matches "
            f"layers={layers!r}. Supported types: "
            f"{', '.join(layer_table.quantizable_names())}."
        )

    def clone(layer):
        if id(layer) in chosen:
            return QuantizeAnnotate(_copy_layer(layer), chosen[id(layer)])
        if isinstance(layer, QuantizeAnnotate):
            return QuantizeAnnotate(_copy_layer(layer.layer), layer.config)
        return _copy_layer(layer)

    return clone_with_weights(model, clone)


def clone_with_weights(model, clone):
    """`keras.models.clone_model(model, clone_function=clone)`, nested models
    included, with every layer's weights (and state) copied over."""
    new = keras.models.clone_model(model, clone_function=clone, recursive=True)
    for old, fresh in zip(graph_layers(model), graph_layers(new)):
        if isinstance(old, keras.Model):
            continue
        unwrap(fresh).set_weights(unwrap(old).get_weights())
    return new


def unwrap(layer):
    """The float layer inside annotate / quantize wrappers."""
    while isinstance(layer, (QuantizeAnnotate, QuantizeWrapper)):
        layer = layer.layer
    return layer


def _is_fusable(layer):
    """True when TensorRT can fuse this producer into a following Add: a
    weighted layer, optionally through BatchNormalization."""
    inner = unwrap(layer)
    if isinstance(inner, keras.layers.BatchNormalization):
        nodes = _keras.inbound_nodes(inner)
        tensors = nodes[0].input_tensors if nodes else []
        parents = [_keras.producer(t) for t in tensors]
        return any(p is not None and _is_fusable(p) for p in parents)
    row = layer_table.row_for(inner)
    return row is not None and row.weighted


def skip_indices(layer):
    """Residual Add: Q/DQ on the inputs TensorRT cannot fuse, when at least
    one input comes from a weighted layer; none otherwise."""
    nodes = _keras.inbound_nodes(layer)
    if not nodes:
        return []
    producers = [_keras.producer(t) for t in nodes[0].input_tensors]
    fusable = [p is not None and _is_fusable(p) for p in producers]
    if not any(fusable):
        return []
    # TensorRT fuses the Add into a GEMM whose output feeds the Add only;
    # one that also feeds other layers (a transformer's residual stream)
    # keeps its output, so its tensor is the skip input.
    alone = [
        i
        for i, p in enumerate(producers)
        if fusable[i] and len(_keras.outbound_nodes(p)) == 1
    ]
    fused = alone[0] if alone else fusable.index(True)
    return [i for i in range(len(producers)) if i != fused]


def quantize_apply(model):
    """Quantizes every annotated layer.

    Returns a new model; weights and all layer state (e.g. Normalization
    statistics) are carried over, and weight ranges are set from the
    weights. Activation ranges start at 0 (not calibrated): run
    `keras_mp.calibrate` (PTQ) before `fit` (QAT) or export. In a graph
    model each annotated layer becomes a `QuantizeWrapper`; any other model
    is quantized in place and returned as a `keras_mp.QuantizedModel`.

    Args:
        model: a model from `quantize_annotate_model`, or one built with
            `quantize_annotate_layer`.

    Returns:
        The quantized `keras.Model`.

    Raises:
        ValueError: nothing is annotated, the model is already quantized or
            cannot be copied.
        TypeError: a tf_keras or non-Keras model.
    """
    _check_float_model(model, "quantize_apply")
    if not _graph_path(model):
        return inplace.quantize_in_place(model, annotated=True)
    annotated = [
        layer
        for layer in graph_layers(model)
        if isinstance(layer, QuantizeAnnotate)
    ]
    if not annotated:
        raise ValueError(
            f"Model {model.name!r} has no annotated layer. Call "
            "keras_mp.quantize_annotate_model(model) first, or use "
            "keras_mp.quantize_model(model)."
        )
    indices = {}
    for layer in annotated:
        row = quantizable_row(layer.layer)
        overridden = layer.config and layer.config.quantize_inputs is not None
        if row.inputs == SKIP_INPUTS and not overridden:
            indices[id(layer)] = skip_indices(layer)

    def clone(layer):
        if isinstance(layer, QuantizeAnnotate):
            return QuantizeWrapper(
                _copy_layer(layer.layer),
                layer.config,
                input_indices=indices.get(id(layer)),
                name=f"quant_{layer.layer.name}",
            )
        return _copy_layer(layer)

    new = clone_with_weights(model, clone)
    for layer in graph_layers(new):
        if isinstance(layer, QuantizeWrapper):
            layer.update_weight_ranges()
    return new


def quantize_model(model, config=None, layers=None, in_place=False):
    """Annotates and applies in one call: the quantized copy of `model`.

    Any Keras 3 model: Sequential, Functional, subclassed, and models built
    from keras-hub backbones, with layers at any depth (inside custom
    layers, inside `MultiHeadAttention`). A Sequential or Functional model
    whose quantizable layers are all in its graph gets a `QuantizeWrapper`
    per layer; any other is quantized in place and returned as a
    `keras_mp.QuantizedModel`, which saves and loads as `.keras`.

    Args:
        model: a built `keras.Model`.
        config: `QuantizeConfig` or dict of them (see
            `quantize_annotate_model`; a key matching a custom layer or an
            attention layer configures everything inside it).
        layers: selection (see `quantize_annotate_model`; a custom layer's
            name selects the layers inside it). Defaults to every supported
            layer.
        in_place: bool. Quantize the layers of `model` itself instead of a
            copy rebuilt from its config; for a model that has no working
            `get_config()` (it then saves with `save_weights` only).
            Defaults to False.

    Returns:
        A new quantized `keras.Model` (or `model`'s own layers, quantized,
        in a `QuantizedModel`, with `in_place`), ready for
        `keras_mp.calibrate`.

    Raises:
        ValueError: the model is already quantized, was never built, has
            no quantizable layer in the selection, or cannot be rebuilt
            from its config (the message says what to do).
        TypeError: a tf_keras or non-Keras model.

    Example:

    >>> qmodel = keras_mp.quantize_model(model)
    >>> keras_mp.calibrate(qmodel, x_train[:2048], method="entropy")
    >>> qmodel.compile(...); qmodel.fit(...)  # optional QAT
    """
    _check_float_model(model, "quantize_model")
    if in_place or not _graph_path(model):
        return inplace.quantize_in_place(
            model, layers, config, in_place=in_place
        )
    return quantize_apply(quantize_annotate_model(model, layers, config))
