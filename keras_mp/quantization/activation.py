"""The activation Q/DQ layer, and which layers can be quantized.

`QuantizeActivation` is the `TensorQuantizer` (`tensor_quantizer.py`) with an
activation's defaults. Guide: `docs/quantization.md`.
"""

import keras

from keras_mp import layer_table
from keras_mp.quantization.tensor_quantizer import TensorQuantizer


@keras.saving.register_keras_serializable(package="keras_mp")
class QuantizeActivation(TensorQuantizer):
    """Per-tensor symmetric fake quantization of an activation (Q/DQ).

    A `TensorQuantizer` with an activation's defaults: one range per
    tensor, full range (int8: `[-128, 127]`, as ONNX QuantizeLinear), set
    by `keras_mp.calibrate` or by the first training batch, then frozen
    unless `learned_range=True`.

    Args:
        num_bits: int or None. Deprecated: pass `format` (`"int8"` by
            default). Defaults to None.
        learned_range: bool. Train `amax`. Defaults to False.
        **kwargs: `TensorQuantizer` arguments (`format`) and base layer
            arguments (`name`, `dtype`).

    Example:

    >>> qdq = keras_mp.QuantizeActivation(name="skip_qdq")
    >>> y = keras.layers.Add()([conv_out, qdq(skip)])
    """

    def __init__(self, num_bits=None, learned_range=False, **kwargs):
        super().__init__(
            num_bits=num_bits, learned_range=learned_range, **kwargs
        )


def quantizable_row(layer):
    """The `layer_table.LayerRow` of `layer` if it can be wrapped, else
    None."""
    row = layer_table.row_for(layer)
    return row if row is not None and row.quantizable else None
