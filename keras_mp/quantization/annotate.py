"""Annotate -> apply: which layers get quantized, and where Q/DQ go.

tfmot's flow for Keras 3 models, with TensorRT's Q/DQ placement rules
(`docs/quantization.md`) built in.
"""

import keras

from keras_mp import _keras, _models, layer_table
from keras_mp.layer_table import NO_INPUTS, SKIP_INPUTS
from keras_mp.quantization.config import QuantizeConfig
from keras_mp.quantization.layers import (
    QuantizeActivation,
    QuantizeWrapper,
    quantizable_row,
)
from keras_mp.selection import layer_matcher

# What a user with a subclassed model can do instead.
_SUBCLASSED = (
    "Its layers cannot be swapped automatically: wrap them in your model's "
    "__init__ with `keras_mp.QuantizeWrapper(layer)` (and "
    "`keras_mp.QuantizeActivation()` on residual inputs), or rebuild it as a "
    "Functional or Sequential model."
)


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
    if config is None or isinstance(config, QuantizeConfig):
        return config
    if isinstance(config, dict):
        for key, value in config.items():
            if layer_matcher(key)(layer):
                return value
        return None
    raise TypeError(
        "`config` must be a QuantizeConfig or a dict mapping layer names "
        f"(or regexes) to QuantizeConfig. Received: {type(config).__name__}"
    )


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
    _models.check_graph_model(model, caller, _SUBCLASSED)
    for layer in _models.walk_layers(model):
        if isinstance(layer, (QuantizeWrapper, QuantizeActivation)):
            raise ValueError(
                f"Model {model.name!r} is already quantized (layer "
                f"{layer.name!r}). Call quantize_apply on the float model, "
                "or strip it first with keras_mp.strip_quantization()."
            )


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
        `QuantizeAnnotate`.

    Raises:
        TypeError: a subclassed, tf_keras or non-Keras model.
        ValueError: the selection names an unsupported layer, or matches
            no quantizable layer.
    """
    _check_float_model(model, "quantize_annotate_model")
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


def _skip_indices(layer):
    """Residual Add: Q/DQ on the inputs TensorRT cannot fuse, when at least
    one input comes from a weighted layer; none otherwise."""
    nodes = _keras.inbound_nodes(layer)
    if not nodes:
        return []
    producers = [_keras.producer(t) for t in nodes[0].input_tensors]
    fusable = [p is not None and _is_fusable(p) for p in producers]
    if not any(fusable):
        return []
    fused = fusable.index(True)
    return [i for i in range(len(producers)) if i != fused]


def quantize_apply(model):
    """Replaces every annotated layer with a `QuantizeWrapper`.

    Returns a new model; weights and all layer state (e.g. Normalization
    statistics) are carried over, and weight ranges are set from the
    weights. Activation ranges start at 0 (not calibrated): run
    `keras_mp.calibrate` (PTQ) before `fit` (QAT) or export.

    Args:
        model: a model from `quantize_annotate_model`, or one built with
            `quantize_annotate_layer`.

    Returns:
        The quantized `keras.Model`.

    Raises:
        ValueError: nothing is annotated, or the model is already quantized.
        TypeError: a subclassed, tf_keras or non-Keras model.
    """
    _check_float_model(model, "quantize_apply")
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
            indices[id(layer)] = _skip_indices(layer)

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


def quantize_model(model, config=None, layers=None):
    """Annotates and applies in one call: the quantized copy of `model`.

    Args:
        model: Sequential or Functional `keras.Model`.
        config: `QuantizeConfig` or dict of them (see
            `quantize_annotate_model`).
        layers: selection (see `quantize_annotate_model`). Defaults to every
            supported layer.

    Returns:
        A new quantized `keras.Model`, ready for `keras_mp.calibrate`.

    Example:

    >>> qmodel = keras_mp.quantize_model(model)
    >>> keras_mp.calibrate(qmodel, x_train[:2048], method="entropy")
    >>> qmodel.compile(...); qmodel.fit(...)  # optional QAT
    """
    _check_float_model(model, "quantize_model")
    return quantize_apply(quantize_annotate_model(model, layers, config))
