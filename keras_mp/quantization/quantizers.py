"""Fake-quant math: symmetric signed INT8, per-tensor or per-channel, STE.

Built on TensorFlow's `QuantizeAndDequantizeV3` with a given range, which
tf2onnx exports as a QuantizeLinear/DequantizeLinear pair with a constant
scale. Why this op, and why full range for activations: see
`docs/quantization.md` ("How the fake quantization is built").
"""

import tensorflow as tf

# The smallest range a quantizer uses: a channel whose weights are all zero
# (e.g. pruned) still gets a positive scale, which TensorRT requires.
MIN_AMAX = 1e-8


def _qdq(x, amax, axis, narrow_range, num_bits):
    return tf.raw_ops.QuantizeAndDequantizeV3(
        input=x,
        input_min=-amax,
        input_max=amax,
        num_bits=num_bits,
        signed_input=True,
        range_given=True,
        narrow_range=narrow_range,
        axis=-1 if axis is None else axis,
    )


def _broadcast(amax, rank, axis):
    if axis is None:
        return amax
    shape = [1] * rank
    shape[axis] = -1
    return tf.reshape(amax, shape)


def fake_quant(x, amax, axis=None, narrow_range=False, num_bits=8):
    """Quantizes then dequantizes `x` the way ONNX Q/DQ does.

    `q = saturate(round_half_to_even(x / scale))`, `scale = amax / (2^(b-1)
    - 1)`, output `q * scale`; saturation at `[-2^(b-1), 2^(b-1) - 1]`, or
    `[-(2^(b-1) - 1), 2^(b-1) - 1]` with `narrow_range`. The gradient is the
    straight-through estimator: passed through inside the clipping range,
    zero outside.

    Args:
        x: float tensor. float16/bfloat16 are quantized in float32 and cast
            back (the TF op has no 16-bit kernels).
        amax: float32 scalar (per-tensor) or vector of length
            `x.shape[axis]` (per-channel).
        axis: int or None. The channel axis for a per-channel `amax`.
        narrow_range: bool. Use `[-127, 127]` (weights) instead of
            `[-128, 127]` (activations). Defaults to False.
        num_bits: int. Defaults to 8.

    Returns:
        A tensor like `x`.
    """
    dtype = x.dtype
    x32 = tf.cast(x, tf.float32)
    amax = tf.maximum(tf.cast(amax, tf.float32), MIN_AMAX)
    if axis is not None and axis < 0:
        axis += x32.shape.rank
    out = _fake_quant_ste(x32, amax, axis, narrow_range, num_bits)
    return tf.cast(out, dtype)


def _fake_quant_ste(x, amax, axis, narrow_range, num_bits):
    qmax = 2.0 ** (num_bits - 1) - 1
    qmin = -qmax if narrow_range else -(qmax + 1)

    @tf.custom_gradient
    def forward(x):
        y = _qdq(x, amax, axis, narrow_range, num_bits)

        def grad(dy):
            a = _broadcast(amax, x.shape.rank, axis)
            inside = tf.logical_and(x >= a * (qmin / qmax), x <= a)
            return dy * tf.cast(inside, dy.dtype)

        return y, grad

    return forward(x)


def fake_quant_learned(x, amax, num_bits=8):
    """Per-tensor fake quant with a trainable range (PACT-style gradient).

    The gradient with respect to `amax` is the sum of the upstream gradient
    over values clipped at the top, minus that at the bottom (PACT, Choi et
    al. 2018); inside the range values pass straight through.
    """
    dtype = x.dtype
    x32 = tf.cast(x, tf.float32)
    qmax = 2.0 ** (num_bits - 1) - 1
    low = -(qmax + 1) / qmax

    @tf.custom_gradient
    def forward(x, amax):
        a = tf.maximum(amax, MIN_AMAX)
        y = _qdq(x, a, None, False, num_bits)

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
