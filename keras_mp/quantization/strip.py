"""`strip_quantization`: back from a quantized model to a float one."""

from keras_mp import _models, _record
from keras_mp.quantization import pre_scale
from keras_mp.quantization.legacy import check_current


def strip_quantization(model):
    """A float copy of a quantized model: quantizers removed, weights kept.

    The model a `keras_mp.RecordedModel` holds comes back rebuilt from its
    float config, with the trained weights (and 2:4 masks), an AWQ
    pre-scale multiplied back into its kernel; stand-alone
    `QuantizeActivation` layers of a model built with them are kept.

    Args:
        model: `keras.Model`, e.g. from `keras_mp.quantize_model` after QAT.

    Returns:
        A new `keras.Model` computing in float.

    Raises:
        TypeError: `model` is not a Keras 3 model.
        ValueError: the float model cannot be rebuilt from its config, or
            `model` holds layers of an earlier keras_mp (`keras_mp.upgrade`
            first).

    Example:

    >>> qmodel = keras_mp.quantize_model(model)
    >>> float_model = keras_mp.strip_quantization(qmodel)
    """
    _models.check_model(model, "strip_quantization")
    check_current(model, "strip_quantization")
    inner = _record.contents(model)
    copy = _models.copy_model(
        inner,
        "strip_quantization",
        "or build the float model yourself and copy the trained weights "
        "layer by layer.",
    )
    pre_scale.fold_into_kernels(inner, copy)  # AWQ's `1 / s` back into W
    return copy
