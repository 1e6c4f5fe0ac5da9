"""Fixed-point (block floating point) models for MuPPET training.

MuPPET (Rajagopal et al., ICML 2020, arXiv 2006.09049) trains in dynamic
fixed point: every tensor gets one power-of-two exponent and WL-bit signed
integer mantissas. `fixed_point_model()` turns a float model into a
MuPPET-trainable copy built from the layers of
`keras_mp.muppet.layers`, which quantize with
`keras_mp.muppet.quantizer`; `keras_mp.muppet.callback` holds the switching
policy.

The word length lives in a non-trainable variable of each layer (0 means
float32), so switching precision is one `assign`: the training function is
neither retraced nor recompiled.
"""

import keras

from keras_mp.muppet.layers import (
    FixedPointInput,
    FixedPointWrapper,
    PrecisionState,
)
from keras_mp.muppet.quantizer import (
    FLOAT32,
    check_word_length,
    fixed_point_quantize,
    fixed_point_ste,
)

__all__ = [
    "FLOAT32",
    "FixedPointInput",
    "FixedPointWrapper",
    "PrecisionState",
    "check_word_length",
    "fixed_point_layers",
    "fixed_point_model",
    "fixed_point_quantize",
    "fixed_point_ste",
    "precision_state",
    "set_word_length",
]

# Where tf_keras (Keras 2) keeps its model classes.
_KERAS_2_MODULES = ("tf_keras", "keras.src.engine", "keras.engine")


def _check_keras_3_model(model):
    if isinstance(model, keras.Model):
        return
    module = type(model).__module__
    hint = ""
    if module.startswith(_KERAS_2_MODULES):
        hint = (
            " This is a tf_keras (Keras 2) model, which is not supported: "
            "rebuild it with Keras 3 (`import keras`)."
        )
    raise TypeError(
        "fixed_point_model() expects a Keras 3 `keras.Model`. Received: "
        f"{module}.{type(model).__name__}.{hint}"
    )


def _is_graph_model(model):
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


def _wrap_layer(layer, seed):
    copy = layer.__class__.from_config(layer.get_config())
    if not layer.trainable_weights:
        return copy
    copy.build_from_config(layer.get_build_config())
    copy.set_weights(layer.get_weights())
    return FixedPointWrapper(copy, seed=seed, name=f"fixed_point_{layer.name}")


def fixed_point_model(model, seed=None):
    """Returns a MuPPET-trainable copy of a Sequential or Functional model.

    Every layer with trainable weights is wrapped in `FixedPointWrapper`
    (weights copied over; nested Sequential/Functional models are walked),
    every input goes through a per-sample `FixedPointInput`, and a
    `PrecisionState` layer carries the switching state. The copy starts in
    float32 (word length 0) and computes exactly what `model` computes
    until `keras_mp.PrecisionSwitching` lowers the precision.

    Args:
        model: built `keras.Sequential` or Functional `keras.Model`.
        seed: int or None. Seed of the stochastic rounding. Defaults to None.

    Returns:
        A new, uncompiled `keras.Model` whose first inputs and outputs match
        `model`'s.

    Raises:
        TypeError: `model` is not a Keras 3 model (e.g. a tf_keras one).
        ValueError: `model` is subclassed, not built, or has no trainable
            weights.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> fp = fixed_point_model(model)
    >>> fp.compile("sgd", "mse")
    """
    _check_keras_3_model(model)
    if not _is_graph_model(model):
        raise ValueError(
            "fixed_point_model() needs a Sequential or Functional model to "
            f"copy its layers; received the subclassed model "
            f"'{type(model).__name__}'. Rebuild it with the Functional API "
            "(keras.Model(inputs, outputs)), or wrap its weighted layers in "
            "keras_mp.FixedPointWrapper, add keras_mp.FixedPointInput on its "
            "inputs and a keras_mp.PrecisionState layer yourself."
        )
    if not model.built or not model.inputs:
        raise ValueError(
            f"fixed_point_model() needs a built model with known inputs; "
            f"'{model.name}' is not built. Start it with keras.Input(shape) "
            "or call it on data first."
        )
    if not model.trainable_weights:
        raise ValueError(
            f"Model '{model.name}' has no trainable weights: there is "
            "nothing to train in fixed point. Pass a model with trainable "
            "layers (check `layer.trainable`)."
        )
    clone = keras.models.clone_model(
        model,
        clone_function=lambda layer: _wrap_layer(layer, seed),
        recursive=True,
    )
    inputs = [
        keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name)
        for t in model.inputs
    ]
    quantized = [PrecisionState(name="precision_state")(inputs[0])]
    quantized += inputs[1:]
    quantized = [
        FixedPointInput(seed=seed, name=f"fixed_point_input_{i}")(t)
        for i, t in enumerate(quantized)
    ]
    if len(inputs) == 1:
        inputs, quantized = inputs[0], quantized[0]
    return keras.Model(
        inputs, clone(quantized), name=f"{model.name}_fixed_point"
    )


def fixed_point_layers(model):
    """Yields the layers of `model` that hold a `word_length` variable."""
    for layer in model.layers:
        if isinstance(layer, (FixedPointWrapper, FixedPointInput)):
            yield layer
        elif isinstance(layer, keras.Model):
            yield from fixed_point_layers(layer)


def precision_state(model):
    """Returns the `PrecisionState` layer of `model`, or None."""
    for layer in model.layers:
        if isinstance(layer, PrecisionState):
            return layer
        if isinstance(layer, keras.Model):
            found = precision_state(layer)
            if found is not None:
                return found
    return None


def set_word_length(model, word_length):
    """Sets every fixed-point layer of `model` to `word_length` bits.

    Args:
        model: a model from `fixed_point_model()`.
        word_length: int in 2..32, or None for float32.

    Raises:
        ValueError: bad `word_length`.
    """
    value = float(check_word_length(word_length))
    for layer in fixed_point_layers(model):
        layer.word_length.assign(value)
