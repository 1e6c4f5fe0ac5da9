"""Fake-quant math: symmetric, per-tensor or per-channel, with a gradient.

The rounding comes from the quantizer's `NumberFormat` (`formats.py`); the
gradients here are the same for every format: straight-through inside the
range, and PACT for a learned range. For int8 the rounding is TensorFlow's
`QuantizeAndDequantizeV3` with a given range, which tf2onnx exports as a
QuantizeLinear/DequantizeLinear pair with a constant scale. Why this op,
and why full range for activations: see `docs/quantization.md` ("How the
fake quantization is built").
"""

import tensorflow as tf

from keras_mp.quantization.blocks import block_quantize_dequantize, exact_divide
from keras_mp.quantization.formats import number_format

# The smallest range a quantizer uses: a channel whose weights are all zero
# (e.g. pruned) still gets a positive scale, which TensorRT requires.
MIN_AMAX = 1e-8


def _broadcast(amax, rank, axis):
    if axis is None:
        return amax
    shape = [1] * rank
    shape[axis] = -1
    return tf.reshape(amax, shape)


def fake_quant(x, amax, axis=None, narrow_range=False, format="int8"):
    """Quantizes then dequantizes `x` the way ONNX Q/DQ does.

    `q = saturate(round(x / scale))`, `scale = amax / qmax`, output
    `q * scale`; saturation at `[qmin, qmax]` of the format, or `[-qmax,
    qmax]` with `narrow_range`. For int8: round half to even, `qmax = 127`,
    `qmin = -128`. The gradient is the straight-through estimator: passed
    through inside the clipping range, zero outside.

    Args:
        x: float tensor. float16/bfloat16 are quantized in float32 and cast
            back (the TF op has no 16-bit kernels).
        amax: float32 scalar (per-tensor) or vector of length
            `x.shape[axis]` (per-channel).
        axis: int or None. The channel axis for a per-channel `amax`.
        narrow_range: bool. Use `[-qmax, qmax]` (weights: `[-127, 127]`)
            instead of `[qmin, qmax]` (activations: `[-128, 127]`).
            Defaults to False.
        format: str, int or `NumberFormat`. The number format
            (`formats.number_format`). Defaults to `"int8"`.

    Returns:
        A tensor like `x`.
    """
    fmt = number_format(format)
    dtype = x.dtype
    x32 = tf.cast(x, tf.float32)
    amax = tf.maximum(tf.cast(amax, tf.float32), MIN_AMAX)
    if axis is not None and axis < 0:
        axis += x32.shape.rank
    out = _fake_quant_ste(x32, amax, axis, narrow_range, fmt)
    return tf.cast(out, dtype)


def _fake_quant_ste(x, amax, axis, narrow_range, fmt):
    low = (fmt.narrow_qmin if narrow_range else fmt.qmin) / fmt.qmax

    @tf.custom_gradient
    def forward(x):
        y = fmt.quantize_dequantize(x, amax, axis, narrow_range)

        def grad(dy):
            a = _broadcast(amax, x.shape.rank, axis)
            inside = tf.logical_and(x >= a * low, x <= a)
            return dy * tf.cast(inside, dy.dtype)

        return y, grad

    return forward(x)


def block_fake_quant(view, amax, format, block_size):
    """Block-scaled fake quantization of the `(K, N)` matrix `view` with
    ranges `amax` of shape `(K / block_size, N)`: for INT4 `scale = amax /
    qmax` per block (1 for an all-zero block, whose codes are 0); NVFP4 and
    MXFP8 scales follow from the values (ModelOpt's); the codes of
    the format's `block` row (`blocks.block_quantize_dequantize`, which
    `blocks.block_encode` repeats for the export, bit for bit). Straight-
    through gradient inside each block's range."""
    fmt = number_format(format)
    scale = None  # NVFP4 / MXFP8: the scales follow from the values
    if fmt.block_format.scale_onnx_type == "FLOAT":
        scale = block_scale(amax, fmt)
    return block_quantize_dequantize(
        view, fmt.block_format, block_size, axis=0, scale=scale
    )


def block_scale(amax, format):
    """The block scales of block ranges `amax`: `amax / qmax` rounded once
    to float32 (`blocks.exact_divide`), 1 for an all-zero block."""
    fmt = number_format(format)
    amax = tf.cast(amax, tf.float32)
    return tf.where(amax > 0, exact_divide(amax, fmt.qmax), 1.0)


def fake_quant_learned(x, amax, format="int8"):
    """Per-tensor fake quant with a trainable range (PACT-style gradient).

    The gradient with respect to `amax` is the sum of the upstream gradient
    over values clipped at the top, minus that at the bottom (scaled by
    `qmin / qmax`; PACT, Choi et al. 2018); inside the range values pass
    straight through.
    """
    fmt = number_format(format)
    dtype = x.dtype
    x32 = tf.cast(x, tf.float32)
    low = fmt.qmin / fmt.qmax

    @tf.custom_gradient
    def forward(x, amax):
        a = tf.maximum(amax, MIN_AMAX)
        y = fmt.quantize_dequantize(x, a)

        def grad(dy):
            above = tf.cast(x > a, dy.dtype)
            below = tf.cast(x < a * low, dy.dtype)
            inside = 1.0 - above - below
            d_amax = tf.reduce_sum(dy * above) + low * tf.reduce_sum(dy * below)
            return dy * inside, tf.reshape(d_amax, tf.shape(amax))

        return y, grad

    return tf.cast(forward(x32, tf.cast(amax, tf.float32)), dtype)


def channel_amax(kernel, axis):
    """Per-channel `max|w|` over every axis but `axis` (float32)."""
    kernel = tf.abs(tf.cast(kernel, tf.float32))
    axes = [
        a for a in range(kernel.shape.rank) if a != axis % kernel.shape.rank
    ]
    return tf.reduce_max(kernel, axis=axes)
