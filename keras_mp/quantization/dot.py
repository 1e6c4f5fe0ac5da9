"""The quantized twin of `keras.layers.Dot`: a matmul of two activations.

TensorRT runs a MatMul in INT8 when both its inputs come from a
DequantizeLinear, whether they are weights or activations (attention's
matmuls, a DLRM's feature interactions). The twin fake-quantizes both
inputs with per-tensor activation quantizers (`input_0`, `input_1`), so
the exported graph shows `Q/DQ -> MatMul <- Q/DQ`. With `normalize=True`
the inputs are l2-normalized first and quantized after, so no float op
stands between a DQ and the matmul. Guide: `docs/quantization.md`.
"""

import keras

from keras_mp.quantization.twins import QuantizedLayer


class QuantizedDot(QuantizedLayer):
    """The quantized twin of a `keras.layers.Dot` (or a subclass).

    Both inputs get a Q/DQ (`input_indices` `[0, 1]`, set by the placement
    unless `QuantizeConfig(dot=False)`); a `normalize=True` Dot quantizes
    them after its l2-normalization, right before the matmul.
    """

    def call(self, inputs, **kwargs):
        if not self.normalize:
            return super().call(inputs, **kwargs)
        # `_merge_function` quantizes, after normalizing.
        return super(QuantizedLayer, self).call(inputs, **kwargs)

    def _merge_function(self, inputs):
        if not self.normalize or not self.input_quantizers:
            return super()._merge_function(inputs)
        axes = dot_axes(self.axes, inputs)
        values = [
            keras.utils.normalize(x, axis=a) for x, a in zip(inputs, axes)
        ]
        (values,), _ = self._quantize_inputs((values,), {})
        # The float matmul of the normalized, quantized inputs: the float
        # class normalizes only when `normalize` is set.
        self.normalize = False
        try:
            return super()._merge_function(values)
        finally:
            self.normalize = True


def dot_axes(axes, inputs):
    """A Dot's `axes` as one non-negative axis per input, as Keras reads
    them."""
    if isinstance(axes, int):
        axes = (axes, axes)
    return [a % len(x.shape) for a, x in zip(axes, inputs)]
