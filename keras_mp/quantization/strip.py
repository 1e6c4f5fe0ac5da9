"""`strip_quantization`: back from a quantized model to a float one."""

from keras_mp import _models
from keras_mp.quantization.annotate import QuantizeAnnotate, clone_with_weights
from keras_mp.quantization.inplace import rebuild
from keras_mp.quantization.layers import QuantizeWrapper
from keras_mp.quantization.model import QuantizedModel


def _strip_in_place(model):
    """The float model inside a `QuantizedModel`, rebuilt from its config,
    with the trained weights."""
    inner = model.model
    return rebuild(
        inner,
        model.float_config(),
        "strip_quantization",
        "build the float model yourself and copy the trained weights layer "
        "by layer.",
    )


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
