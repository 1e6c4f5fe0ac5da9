"""`strip_quantization`: back from a quantized model to a float one."""

from keras_mp import _models
from keras_mp.quantization.annotate import QuantizeAnnotate, clone_with_weights
from keras_mp.quantization.layers import QuantizeWrapper


def strip_quantization(model):
    """A float copy of a quantized model: wrappers removed, weights kept.

    Every `QuantizeWrapper` and `QuantizeAnnotate` is replaced by a copy of
    the layer it wraps, with the trained weights; stand-alone
    `QuantizeActivation` layers are kept. Nested models are stripped too.

    Args:
        model: `keras.Model`, Sequential or Functional, e.g. from
            `keras_mp.quantize_model` after QAT.

    Returns:
        A new `keras.Model` computing in float.

    Raises:
        TypeError: `model` is not a Keras 3 model.

    Example:

    >>> qmodel = keras_mp.quantize_model(model)
    >>> float_model = keras_mp.strip_quantization(qmodel)
    """
    _models.check_model(model, "strip_quantization")

    def clone(layer):
        if isinstance(layer, (QuantizeWrapper, QuantizeAnnotate)):
            layer = layer.layer
        return layer.__class__.from_config(layer.get_config())

    return clone_with_weights(model, clone)
