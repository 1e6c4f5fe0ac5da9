"""`fixed_point_model`: the MuPPET-trainable copy of a float model, and the
helpers that find and set its fixed-point layers. Guide: `docs/muppet.md`.
"""

import keras

from keras_mp import _models
from keras_mp.muppet.layers import (
    FixedPointInput,
    FixedPointWrapper,
    PrecisionState,
)
from keras_mp.muppet.quantizer import check_word_length


def _wrap_layer(layer, seed):
    """A copy of `layer`, wrapped in `FixedPointWrapper` if it has weights."""
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
        TypeError: `model` is not a Keras 3 model (e.g. a tf_keras one), or
            is subclassed.
        ValueError: `model` is not built, or has no trainable weights.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> fp = fixed_point_model(model)
    >>> fp.compile("sgd", "mse")
    """
    _models.check_graph_model(
        model,
        "fixed_point_model",
        "Rebuild it with the Functional API (keras.Model(inputs, outputs)), "
        "or wrap its weighted layers in keras_mp.FixedPointWrapper, add "
        "keras_mp.FixedPointInput on its inputs and a "
        "keras_mp.PrecisionState layer yourself.",
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
    """Yields the layers of `model`, at any depth, that hold a `word_length`
    variable (`FixedPointWrapper`s and `FixedPointInput`s)."""
    fixed = (FixedPointWrapper, FixedPointInput)
    for layer in _models.walk_layers(model, stop_at=fixed):
        if isinstance(layer, fixed):
            yield layer


def precision_state(model):
    """Returns the `PrecisionState` layer of `model`, or None."""
    for layer in _models.walk_layers(model, stop_at=(FixedPointWrapper,)):
        if isinstance(layer, PrecisionState):
            return layer
    return None


def set_word_length(model, word_length):
    """Sets every fixed-point layer of `model` to `word_length` bits.

    Args:
        model: a model from `fixed_point_model()`.
        word_length: int in 2..32, or None for float32.

    Raises:
        ValueError: bad `word_length`.

    Example:

    >>> set_word_length(fixed_point_model(model), 8)
    """
    value = float(check_word_length(word_length))
    for layer in fixed_point_layers(model):
        layer.word_length.assign(value)
