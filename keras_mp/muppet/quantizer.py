"""Dynamic fixed-point (block floating point) quantization math for MuPPET.

MuPPET (Rajagopal et al., ICML 2020, arXiv 2006.09049) trains in dynamic
fixed point: every tensor gets one power-of-two exponent and WL-bit signed
integer mantissas. This module holds the quantizer and its straight-through
estimator; `keras_mp.muppet.layers` holds the layers that apply them.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

FLOAT32 = 0
"""Word length value meaning "no quantization" (32 means the same)."""

_MIN_WORD_LENGTH = 2
_MAX_WORD_LENGTH = 32
_MAX_EXPONENT = 126.0  # 2**s and 2**-s stay finite, normal float32 numbers


def check_word_length(word_length, name="word_length"):
    """Returns `word_length` as an int, or `FLOAT32` for None.

    Raises:
        ValueError: not None and not an integer in 2..32.
    """
    if word_length is None:
        return FLOAT32
    if (
        isinstance(word_length, bool)
        or not isinstance(word_length, (int, np.integer))
        or not _MIN_WORD_LENGTH <= word_length <= _MAX_WORD_LENGTH
    ):
        raise ValueError(
            f"`{name}` must be an integer bit width in "
            f"{_MIN_WORD_LENGTH}..{_MAX_WORD_LENGTH}, or None for float32. "
            f"Received: {name}={word_length!r}"
        )
    return int(word_length)


def _uniform(x, seed):
    """Uniform [0, 1) noise shaped like `x` from a (2,) int seed tensor."""
    return tf.random.stateless_uniform(ops.shape(x), seed, dtype="float32")


def _block_quantize(x, word_length, seed, per_sample):
    x32 = ops.cast(x, "float32")
    half = ops.power(2.0, word_length - 1.0)
    upper, lower = half - 0.5, -half - 0.5
    axes = tuple(range(1, len(x32.shape))) if per_sample else None
    x_max = ops.max(x32, axis=axes, keepdims=True)
    x_min = ops.min(x32, axis=axes, keepdims=True)
    # A side with no values of its sign (one-signed or all-zero tensors)
    # puts no bound on the exponent.
    ratio_up = ops.where(
        x_max > 0, upper / ops.where(x_max > 0, x_max, 1.0), np.inf
    )
    ratio_low = ops.where(
        x_min < 0, lower / ops.where(x_min < 0, x_min, -1.0), np.inf
    )
    # Values so small that the ratio overflows (or an all-zero tensor) take
    # the largest exponent.
    ratio = ops.minimum(ops.minimum(ratio_up, ratio_low), 2.0**_MAX_EXPONENT)
    s = ops.floor(ops.log2(ratio))
    # log2 is not exact at powers of two: fix s so 2**s <= ratio < 2**(s+1).
    s = ops.where(ops.power(2.0, s + 1.0) <= ratio, s + 1.0, s)
    s = ops.where(ops.power(2.0, s) > ratio, s - 1.0, s)
    scale = ops.power(2.0, ops.clip(s, -_MAX_EXPONENT, _MAX_EXPONENT))
    scaled = x32 * scale
    if seed is None:
        q = ops.round(scaled)
    else:
        # floor(y + u), u ~ U[0, 1), is round(y + u - 0.5): the paper's
        # stochastic rounding, unbiased: E[q] = y.
        q = ops.floor(scaled + _uniform(scaled, seed))
    # Saturate: near the dtype's largest finite number the top code times
    # 2**-s can exceed it (65504 in float16 rounds up to code 64 * 2**10 =
    # 65536 at 8 bits), so clamp to the largest code that stays finite.
    # Exact: `scale` is a power of two.
    limit = ops.floor(float(tf.as_dtype(x.dtype).max) * scale)
    q = ops.clip(q, ops.maximum(-half, -limit), ops.minimum(half - 1.0, limit))
    return ops.cast(q / scale, x.dtype)


def _as_seed(seed):
    if isinstance(seed, keras.random.SeedGenerator):
        return seed.next()
    if isinstance(seed, (int, np.integer)):
        return ops.convert_to_tensor([int(seed), 0], dtype="int32")
    return seed


def fixed_point_quantize(x, word_length, seed=None, per_sample=False):
    """Quantizes `x` to dynamic fixed point (block floating point).

    One power-of-two exponent per tensor (or per sample):
    `s = floor(log2(min(|U / max x|, |L / min x|)))` with
    `U = 2**(WL-1) - 0.5` and `L = -2**(WL-1) - 0.5`; the mantissas
    `q = round(2**s x + noise)` are clamped to the signed WL-bit range
    `[-2**(WL-1), 2**(WL-1) - 1]` and the result is `q / 2**s`. All-zero
    tensors stay zero; one-signed tensors use the bound of their sign only.
    Values within a step of the dtype's largest finite number saturate to
    the largest grid value that is finite in that dtype (never inf).

    Args:
        x: float tensor.
        word_length: int or scalar tensor. Bits per value, sign included.
            0 or >= 32 means float32: `x` is returned unchanged.
        seed: `keras.random.SeedGenerator`, int, or (2,) int32 tensor for
            stochastic rounding; None rounds to nearest. Defaults to None.
        per_sample: bool. One exponent per entry of the first axis, as
            MuPPET does for network inputs. Defaults to False.

    Returns:
        A tensor like `x` holding the fixed-point values.

    Example:

    >>> fixed_point_quantize([0.3, -1.0, 0.9], 4).numpy()  # s = 3
    array([ 0.25 , -1.   ,  0.875], dtype=float32)
    """
    x = ops.convert_to_tensor(x)
    word_length = ops.cast(word_length, "float32")
    seed = _as_seed(seed)
    enabled = ops.logical_and(word_length > 0, word_length < 32)
    return ops.cond(
        enabled,
        lambda: _block_quantize(x, word_length, seed, per_sample),
        lambda: x,
    )


def _record(record, gradient, loss_scale):
    """Writes `gradient / loss_scale()` into `record` if it is finite."""
    gradient = ops.cast(gradient, record.dtype)  # a 2**24 scale is inf in fp16
    if loss_scale is not None:
        gradient = gradient / ops.cast(loss_scale(), record.dtype)
    finite = ops.all(ops.isfinite(gradient))
    return record.assign(ops.where(finite, gradient, record))


def fixed_point_ste(
    x,
    word_length,
    seed_generator,
    per_sample=False,
    quantize_gradient=True,
    record=None,
    loss_scale=None,
):
    """Fixed-point forward pass with a straight-through, quantized backward.

    Forward: `fixed_point_quantize(x)` with stochastic rounding. Backward:
    the incoming gradient passes straight through the rounding and, when
    `quantize_gradient`, is itself quantized to `word_length` bits
    (MuPPET quantizes the gradients flowing between layers and the weight
    gradients). With `record`, the (quantized) gradient divided by the loss
    scale is also written into that variable, unless it holds an inf or a
    NaN (a step that loss scaling skips): this is how `PrecisionSwitching`
    sees each step's gradients.

    Args:
        x: float tensor.
        word_length: scalar tensor; 0 means float32 (exact pass-through in
            both directions).
        seed_generator: `keras.random.SeedGenerator`, or any object whose
            `next()` returns a (2,) int seed tensor, for both roundings.
        per_sample: bool. One exponent per sample in the forward pass.
        quantize_gradient: bool. Quantize the gradient too.
        record: optional variable shaped like `x` receiving the gradient.
        loss_scale: optional callable returning the factor the loss was
            multiplied by (e.g. `lambda: optimizer.scale_loss(1.0)`); the
            recorded gradient is divided by it. None records the gradient
            as it is. Defaults to None.

    Returns:
        The quantized tensor.
    """
    forward_seed = seed_generator.next()
    backward_seed = seed_generator.next()

    @tf.custom_gradient
    def _ste(value):
        out = fixed_point_quantize(value, word_length, forward_seed, per_sample)

        def grad(upstream):
            if isinstance(upstream, tf.IndexedSlices):
                # An embedding table's gradient: its scale is per tensor.
                upstream = tf.convert_to_tensor(upstream)
            if quantize_gradient:
                upstream = fixed_point_quantize(
                    upstream, word_length, backward_seed
                )
            if record is None:
                return upstream
            with tf.control_dependencies(
                [_record(record, upstream, loss_scale)]
            ):
                return tf.identity(upstream)

        return out, grad

    return _ste(x)
