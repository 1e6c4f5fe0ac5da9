"""AWQ's per-input-channel pre-scale of a quantized GEMM layer.

`calibrate(method="awq")` multiplies a block-scaled kernel by `s` along K
and the layer's input by `1 / s`, so the layer computes what it did
before (`kernel_calibration.awq`). keras_mp does not fold `1 / s` into the
op before the layer (a LayerNorm/RMSNorm gamma, a previous GEMM): in a
keras-hub block that op feeds several GEMMs (query, key, value; gate and
up) whose AWQ scales differ, and in a Functional model it may feed a
residual too. So the pre-scale is a variable of the quantized layer
(`InputScale`, non-trainable, saved in the `.keras` file), applied in the
twin's call before the GEMM; the traced graph exports it as a `Mul` by a
constant before the MatMul, which TensorRT fuses into the producer and
ModelOpt's export writes as `pre_quant_scale`. Guide:
`docs/quantization.md` ("INT4 weight-only").
"""

import keras
import numpy as np

from keras_mp import _keras, _models
from keras_mp.layer_table import _einsum_parts

ATTR = "pre_quant_scale"


@keras.saving.register_keras_serializable(package="keras_mp")
class InputScale(keras.layers.Layer):
    """Multiplies a layer's input by a constant per input channel.

    The channels are the input's last axes, `shape` of them (a Dense's
    `(K,)`; an EinsumDense's contracted axes, e.g. `(heads, head_dim)`).

    Args:
        shape: tuple of int. The shape of the scale.
        **kwargs: Base layer arguments (`name`).

    Example:

    >>> scale = InputScale((64,))
    >>> scale.build()
    >>> y = scale(x)  # x * scale.scale over its last axis
    """

    def __init__(self, shape, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.scale_shape = tuple(int(d) for d in shape)

    def build(self, input_shape=None):
        self.scale = self.add_weight(
            name="scale",
            shape=self.scale_shape,
            initializer="ones",
            trainable=False,
        )

    def call(self, inputs):
        scale = _keras.float_value(self.scale)
        return inputs * keras.ops.cast(scale, inputs.dtype)

    def get_config(self):
        config = super().get_config()
        config.update(shape=self.scale_shape)
        return config


def input_shape_of(layer, weight_quantizer):
    """The shape of the pre-scale of `layer`'s block-scaled weight (its K
    axes), or None when the layer's input does not end with them in the
    kernel's order (an EinsumDense that contracts inner input axes): such
    a layer gets no AWQ."""
    axes = weight_quantizer.block_axes
    kernel = layer.kernel
    shape = tuple(int(kernel.shape[a]) for a in axes)
    if isinstance(layer, keras.layers.EinsumDense):
        x_spec, kernel_spec, _ = _einsum_parts(layer.equation)
        contracted = "".join(kernel_spec[a] for a in axes)
        if not x_spec.endswith(contracted):
            return None
    return shape


def get(layer):
    """`layer`'s `InputScale`, or None."""
    return getattr(layer, ATTR, None)


def add(layer, shape):
    """Gives `layer` an `InputScale` of ones of `shape` (idempotent)."""
    found = get(layer)
    if found is not None:
        return found
    scale = InputScale(shape, name=f"{layer.name}_{ATTR}")
    scale.build()
    with _keras.unlocked(layer):
        setattr(layer, ATTR, scale)
    _models.own(layer, scale)
    return scale


def scale_inputs(layer, args, kwargs, first):
    """`(args, kwargs)` with the layer's first input (named `first` when
    passed by name) multiplied by its pre-scale, if it has one."""
    scale = get(layer)
    if scale is None:
        return args, kwargs
    if args:
        return (scale(args[0]),) + tuple(args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs[first] = scale(kwargs[first])
    return args, kwargs


def fold_into_kernels(source, copy):
    """Multiplies the kernel of each layer of the float `copy` by the
    pre-scale of the same layer of `source` (its quantized original) along
    K, so the copy, which has no pre-scale, computes what `source` does."""
    pairs = zip(_models.walk(source), _models.walk(copy))
    for (layer, _), (twin, _) in pairs:
        scale = get(layer)
        if scale is not None:
            twin.kernel.assign(on_kernel(layer, twin.kernel, scale.scale))


def on_kernel(layer, kernel, scale):
    """`kernel * scale`, the pre-scale `scale` (shaped like the kernel's K
    axes, in the weight quantizer's `block_axes` order) broadcast on
    them."""
    q = layer.weight_quantizers[layer.weight_attrs.index("kernel")]
    kernel = np.asarray(kernel)
    axes = list(q.block_axes)
    s = np.transpose(np.asarray(scale), np.argsort(axes))
    shape = [1] * kernel.ndim
    for a in sorted(axes):
        shape[a] = kernel.shape[a]
    return (kernel * s.reshape(shape)).astype(kernel.dtype)
