"""Fake-quant math: symmetric, per-tensor or per-channel, with a gradient.

The rounding comes from the quantizer's `NumberFormat` (`formats.py`); the
gradients here are the same for every format: straight-through inside the
range, and PACT for a learned range. For int8 the rounding is TensorFlow's
`QuantizeAndDequantizeV3` with a given range, which tf2onnx exports as a
QuantizeLinear/DequantizeLinear pair with a constant scale. Why this op,
and why full range for activations: see `docs/quantization.md` ("How the
fake quantization is built").
"""

import math

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


def matrix_view(weight, block_axes):
    """`(view, back)`: `weight` as the matrix `(K, N)` of its GEMM, the K
    axes `block_axes` first (merged, in order) and the output axes after
    (merged, in order): the MatMul weight tf2onnx writes for a Dense or
    EinsumDense kernel; `back` restores the shape."""
    rank = len(weight.shape)
    k_axes = [a % rank for a in block_axes]
    perm = k_axes + [a for a in range(rank) if a not in k_axes]
    k = math.prod(int(weight.shape[a]) for a in k_axes)
    moved = tf.transpose(weight, perm) if perm != sorted(perm) else weight
    view = tf.reshape(moved, (k, -1))
    inverse = [perm.index(a) for a in range(rank)]

    def back(q):
        q = tf.reshape(q, tf.shape(moved))
        return tf.transpose(q, inverse) if perm != sorted(perm) else q

    return view, back


def block_shape(shape, block_axes, block_size):
    """The shape of a blocked weight's ranges: `(K / block_size, N)` of its
    `(K, N)` matrix view (`matrix_view`).

    Raises:
        ValueError: K is not a multiple of `block_size` (TensorRT infers
            the block size from the weight and scale shapes: no shorter
            last block).
    """
    rank = len(shape)
    k_axes = [a % rank for a in block_axes]
    k = math.prod(int(shape[a]) for a in k_axes)
    n = math.prod(int(shape[a]) for a in range(rank) if a not in k_axes)
    if k % block_size:
        raise ValueError(
            f"A weight of shape {tuple(shape)} has K={k} (axes {k_axes}), "
            f"not a multiple of block_size={block_size}."
        )
    return (k // block_size, n)


def block_amax(view, block_size):
    """`max|w|` of each block of `block_size` rows of the `(K, N)` matrix
    `view`, shaped `(K / block_size, N)` (float32)."""
    k, n = view.shape
    blocks = tf.reshape(tf.abs(tf.cast(view, tf.float32)), (-1, block_size, n))
    return tf.reduce_max(blocks, axis=1)


def check_block_size(fmt, block_size, out_axes, learned_range, fixed_range):
    """A quantizer's `block_size` checked against its format's block sizes
    (None stays None, except for a block-only format)."""
    if block_size is None:
        if fmt.kind == "block":
            raise ValueError(
                f"Format {fmt.name!r} is block-scaled only: pass block_size "
                f"(one of {list(fmt.block_sizes)})."
            )
        return None
    if block_size not in fmt.block_sizes:
        raise ValueError(
            f"Format {fmt.name!r} takes block_size in "
            f"{list(fmt.block_sizes) or 'none (not block-scaled)'}. "
            f"Received: block_size={block_size!r}"
        )
    if out_axes or learned_range or fixed_range is not None:
        raise ValueError(
            "Block ranges are one per block and output channel, set from "
            "the weights: block_size needs out_axes=(), learned_range=False "
            f"and fixed_range=None. Received: out_axes={out_axes}, "
            f"learned_range={learned_range}, fixed_range={fixed_range}"
        )
    return int(block_size)
