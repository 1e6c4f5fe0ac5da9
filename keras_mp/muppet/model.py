"""`fixed_point_model`: the MuPPET-trainable copy of a float model, and the
helpers that find and set its fixed-point layers. Guide: `docs/muppet.md`.
"""

import warnings

import keras

from keras_mp import _keras, _models
from keras_mp.muppet.layers import (
    FixedPointInput,
    FixedPointWrapper,
    PrecisionState,
)
from keras_mp.muppet.quantizer import check_word_length


def _holds_weighted_sublayers(layer):
    return any(sub.trainable_weights for sub in _models.walk_layers(layer))


def _wrap(layer, seed, whole):
    """`layer`, copied, in a `FixedPointWrapper`; `whole` collects the names
    of wrapped layers with weighted sublayers (activations inside stay
    float32)."""
    if _holds_weighted_sublayers(layer):
        whole.append(layer.name)
    copy = _models.copy_model(layer, "fixed_point_model")
    return FixedPointWrapper(copy, seed=seed, name=f"fixed_point_{layer.name}")


def _clone_graph(model, seed, whole):
    """A copy of a plain Sequential or Functional model with every layer
    that has trainable weights wrapped (nested plain models entered)."""

    def clone(layer):
        if _keras.is_plain_graph_model(layer):
            return _clone_graph(layer, seed, whole)
        if not getattr(layer, "trainable_weights", None):
            return layer.__class__.from_config(layer.get_config())
        return _wrap(layer, seed, whole)

    return keras.models.clone_model(model, clone_function=clone)


def fixed_point_model(model, seed=None):
    """Returns a MuPPET-trainable copy of a Keras 3 model.

    In a Sequential or Functional model (nested ones are entered) every
    layer with trainable weights is wrapped in `FixedPointWrapper`, weights
    copied over. Any other model (subclassed, keras-hub backbones and other
    Functional subclasses) is wrapped whole, and so is a custom layer that
    holds weighted sublayers: the wrapper runs every weight inside it, at
    any depth, in fixed point, and quantizes its outputs and their
    gradients, but the activations between its sublayers stay float32 (a
    warning names these layers). Every input goes through a per-sample
    `FixedPointInput`, and a `PrecisionState` layer carries the switching
    state. The copy starts in float32 (word length 0) and computes exactly
    what `model` computes until `keras_mp.PrecisionSwitching` lowers the
    precision. It saves to `.keras` and loads with `safe_mode=True`.

    Args:
        model: built `keras.Model`. A subclassed one needs a `get_config()`
            returning its constructor arguments and a registered class.
        seed: int or None. Seed of the stochastic rounding. Defaults to None.

    Returns:
        A new, uncompiled Functional `keras.Model` taking `model`'s inputs
        (same structure) and returning its outputs.

    Raises:
        TypeError: `model` is not a Keras 3 model (e.g. a tf_keras one).
        ValueError: `model` is not built, has no trainable weights, or
            cannot be rebuilt from its config.

    Example:

    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> fp = fixed_point_model(model)
    >>> fp.compile("sgd", "mse")
    """
    _models.check_model(model, "fixed_point_model")
    if not model.built or (_keras.is_graph_model(model) and not model.inputs):
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
    whole = []
    if _keras.is_plain_graph_model(model):
        body = _clone_graph(model, seed, whole)
    else:
        body = _wrap(model, seed, whole)
    if whole:
        warnings.warn(
            "fixed_point_model: these layers are wrapped whole, their "
            "weights (at any depth) trained in fixed point but the "
            "activations between their sublayers kept in float32: "
            f"{', '.join(whole)}. Rebuild them as Functional models to "
            "quantize every activation.",
            stacklevel=2,
        )
    inputs = _models.symbolic_inputs(model)
    flat = keras.tree.flatten(inputs)
    quantized = [PrecisionState(name="precision_state")(flat[0])]
    quantized += flat[1:]
    quantized = [
        FixedPointInput(seed=seed, name=f"fixed_point_input_{i}")(t)
        for i, t in enumerate(quantized)
    ]
    quantized = keras.tree.pack_sequence_as(inputs, quantized)
    return keras.Model(
        inputs, body(quantized), name=f"{model.name}_fixed_point"
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
