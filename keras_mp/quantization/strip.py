"""`strip_quantization`: back from a quantized model to a float one."""

import keras

from keras_mp import _models
from keras_mp.quantization.annotate import QuantizeAnnotate, clone_with_weights
from keras_mp.quantization.inplace import copy_state
from keras_mp.quantization.layers import QuantizeWrapper
from keras_mp.quantization.model import QuantizedModel
from keras_mp.quantization.recipe import (
    check_same_structure,
    float_class_name,
    walk,
)


def _strip_in_place(model):
    """The float model inside a `QuantizedModel`, rebuilt from its config,
    with the trained weights."""
    inner = model.model
    try:
        fresh = keras.saving.deserialize_keras_object(
            model.float_config(), safe_mode=False
        )
    except Exception as e:  # any layer's from_config can fail its own way
        raise ValueError(
            f"strip_quantization rebuilds the float model {inner.name!r} "
            f"from its config, and that failed ({type(e).__name__}: {e}). "
            f"Give {type(inner).__name__} a `get_config()` returning its "
            "constructor arguments, or build the float model yourself and "
            "copy the trained weights layer by layer."
        ) from e
    layers = [float_class_name(layer) for layer, _ in walk(inner)]
    check_same_structure(fresh, layers, "strip_quantization")
    copy_state(inner, fresh)
    return fresh


def strip_quantization(model):
    """A float copy of a quantized model: quantizers removed, weights kept.

    Every `QuantizeWrapper` and `QuantizeAnnotate` is replaced by a copy of
    the layer it wraps, with the trained weights; stand-alone
    `QuantizeActivation` layers are kept. Nested models are stripped too.
    A `QuantizedModel` (a model quantized in place) gives the float model
    it holds, rebuilt from its config, with the trained weights.

    Args:
        model: `keras.Model`, e.g. from `keras_mp.quantize_model` after QAT.

    Returns:
        A new `keras.Model` computing in float.

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: the float model of a `QuantizedModel` cannot be rebuilt
            from its config.

    Example:

    >>> qmodel = keras_mp.quantize_model(model)
    >>> float_model = keras_mp.strip_quantization(qmodel)
    """
    _models.check_model(model, "strip_quantization")
    if isinstance(model, QuantizedModel):
        return _strip_in_place(model)

    def clone(layer):
        if isinstance(layer, (QuantizeWrapper, QuantizeAnnotate)):
            layer = layer.layer
        return layer.__class__.from_config(layer.get_config())

    return clone_with_weights(model, clone)
