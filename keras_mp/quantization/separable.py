"""A separable convolution computed in two steps, with a Q/DQ between them.

`ops.separable_conv` runs the depthwise and the pointwise convolution as
one op, so nothing can quantize the pointwise input; TensorRT then runs the
pointwise convolution in float. Computed as a depthwise convolution, a
fake-quant of its output and a 1x1 convolution, both convolutions get
their inputs from DequantizeLinear in the exported graph.
"""

from keras import ops


def separable_conv(layer, inputs, quantize_pointwise_input):
    """`layer.call(inputs)` of a `SeparableConv1D`/`SeparableConv2D`, with
    `quantize_pointwise_input` applied to the depthwise output.

    Reads the layer's kernels as variables, so a `keras.StatelessScope`
    around the call swaps in fake-quantized ones.

    Args:
        layer: a built `keras.layers.SeparableConv1D` or `SeparableConv2D`.
        inputs: its input tensor.
        quantize_pointwise_input: callable on a tensor (a
            `QuantizeActivation`, or the identity).

    Returns:
        The layer's output tensor.
    """
    x = ops.depthwise_conv(
        inputs,
        layer.depthwise_kernel,
        strides=layer.strides,
        padding=layer.padding,
        data_format=layer.data_format,
        dilation_rate=layer.dilation_rate,
    )
    q = quantize_pointwise_input(x)
    x = ops.conv(
        ops.cast(q, x.dtype),
        layer.pointwise_kernel,
        strides=1,
        padding="valid",
        data_format=layer.data_format,
    )
    if layer.use_bias:
        if layer.data_format == "channels_last":
            shape = (1,) * (layer.rank + 1) + (layer.filters,)
        else:
            shape = (1, layer.filters) + (1,) * layer.rank
        x = ops.add(x, ops.reshape(layer.bias, shape))
    if layer.activation is not None:
        return layer.activation(x)
    return x
