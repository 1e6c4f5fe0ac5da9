"""Property-based tests of the quantizer, fixed-point and 2:4 mask math.

Hypothesis draws random shapes, dtypes and values over the whole float32
range: subnormals, magnitudes up to 1e38, all-zero tensors, ties. Each
property is one a user relies on: a fake-quant output lies on the INT8 grid
it will be deployed on, fixed point keeps every value within one step, a 2:4
mask is valid, deterministic and keeps the largest weights.
"""

import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from keras_mp.muppet.quantizer import fixed_point_quantize
from keras_mp.onnx.tensorrt import is_2_4_sparse_onnx_weight
from keras_mp.quantization.fake_quant import MIN_AMAX, channel_amax, fake_quant
from keras_mp.sparsity.masks import is_2_4_sparse, magnitude_mask

TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32, 2**-126
F32_MAX = float(np.finfo(np.float32).max)


def f32(value):
    """`value` rounded to float32, as Hypothesis wants float32 bounds."""
    return float(np.float32(value))


def floats(low, high, **kwargs):
    """float32 values in [low, high]."""
    return st.floats(f32(low), f32(high), width=32, **kwargs)


# Finite float32 values over the whole range, subnormals included; and
# tensors of one "kind" so magnitudes are not always mixed.
any_float = floats(-1e38, 1e38, allow_nan=False, allow_subnormal=True)
subnormal = st.floats(
    -TINY, TINY, width=32, allow_subnormal=True, exclude_min=True
)
value_kinds = st.sampled_from(
    [
        any_float,
        floats(-10.0, 10.0),
        subnormal,
        floats(1e30, 1e38) | floats(-1e38, -1e30),
        st.just(0.0),
    ]
)
shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=6)


@st.composite
def tensors(draw, shape=shapes):
    kind = draw(value_kinds)
    return draw(hnp.arrays(np.float32, shape, elements=kind))


amaxes = floats(0.0, 1e36) | subnormal.map(abs)


def _grid(amax, narrow_range):
    scale = np.float32(max(np.float32(amax), np.float32(MIN_AMAX))) / 127
    qmin = -127 if narrow_range else -128
    return float(scale), qmin, 127


# -- fake quantization (symmetric INT8, the TensorRT Q/DQ)


@settings(max_examples=80, deadline=None)
@given(x=tensors(), amax=amaxes, narrow_range=st.booleans())
def test_fake_quant_lies_on_the_int8_grid_within_half_a_step(
    x, amax, narrow_range
):
    out = fake_quant(x, np.float32(amax), narrow_range=narrow_range).numpy()
    scale, qmin, qmax = _grid(amax, narrow_range)
    assert out.dtype == np.float32 and out.shape == x.shape
    assert np.all(np.isfinite(out))  # also for amax 0 (uncalibrated)
    codes = out.astype(np.float64) / scale
    np.testing.assert_allclose(codes, np.round(codes), atol=1e-3)
    assert codes.min(initial=0) >= qmin - 1e-3
    assert codes.max(initial=0) <= qmax + 1e-3
    clipped = np.clip(x.astype(np.float64), qmin * scale, qmax * scale)
    err = np.abs(out - clipped)
    assert np.all(err <= scale * (0.5 + 1e-4) + 1e-30)


@settings(max_examples=60, deadline=None)
@given(x=tensors(), amax=amaxes, narrow_range=st.booleans())
def test_fake_quant_is_idempotent_monotone_and_sign_preserving(
    x, amax, narrow_range
):
    def fq(v):
        return fake_quant(v, np.float32(amax), narrow_range=narrow_range)

    out = fq(x).numpy()
    np.testing.assert_array_equal(fq(out).numpy(), out)
    order = np.argsort(x.ravel(), kind="stable")
    assert np.all(np.diff(out.ravel()[order]) >= 0)
    assert np.all(np.sign(out) * np.sign(x) >= 0)
    if narrow_range:  # [-127, 127] is symmetric: so is the quantizer
        np.testing.assert_array_equal(fq(-x).numpy(), -out)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, amax=amaxes, narrow_range=st.booleans())
def test_all_zero_tensor_stays_zero(shape, amax, narrow_range):
    x = np.zeros(shape, np.float32)
    out = fake_quant(x, np.float32(amax), narrow_range=narrow_range)
    np.testing.assert_array_equal(out.numpy(), x)
    q = fixed_point_quantize(x, 8, seed=3)
    np.testing.assert_array_equal(q.numpy(), x)


@settings(max_examples=40, deadline=None)
@given(
    x=tensors(hnp.array_shapes(min_dims=2, max_dims=4, max_side=5)),
    data=st.data(),
)
def test_per_channel_equals_per_tensor_on_each_channel(x, data):
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    amax = data.draw(hnp.arrays(np.float32, x.shape[axis], elements=amaxes))
    out = fake_quant(x, amax, axis=axis, narrow_range=True).numpy()
    for c in range(x.shape[axis]):
        single = fake_quant(
            np.take(x, c, axis=axis), amax[c], narrow_range=True
        ).numpy()
        np.testing.assert_array_equal(np.take(out, c, axis=axis), single)


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(np.float32, shapes, elements=floats(-100, 100)),
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "float64"]),
    amax=floats(0.01, 100.0),
)
def test_16_and_64_bit_inputs_are_quantized_in_float32(x, dtype, amax):
    cast = tf.cast(x, dtype)
    out = fake_quant(cast, np.float32(amax))
    assert out.dtype == tf.as_dtype(dtype)
    want = fake_quant(tf.cast(cast, "float32"), np.float32(amax))
    np.testing.assert_array_equal(
        tf.cast(out, "float64").numpy(),
        tf.cast(tf.cast(want, dtype), "float64").numpy(),
    )


@settings(max_examples=40, deadline=None)
@given(x=tensors(), amax=floats(1e-6, 1e30))
def test_straight_through_gradient_is_one_inside_the_range_zero_outside(
    x, amax
):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(fake_quant(x, np.float32(amax)))
    grad = tape.gradient(y, x).numpy()
    a = np.float32(amax)
    inside = (x.numpy() >= a * np.float32(-128.0 / 127.0)) & (x.numpy() <= a)
    np.testing.assert_array_equal(grad, inside.astype(np.float32))


def test_infinite_inputs_saturate_like_onnx_quantize_linear():
    out = fake_quant(np.float32([np.inf, -np.inf, 0.0]), np.float32(2.0))
    np.testing.assert_allclose(out.numpy(), [2.0, -2.0 * 128 / 127, 0.0])


@settings(max_examples=40, deadline=None)
@given(
    kernel=tensors(hnp.array_shapes(min_dims=2, max_dims=4, max_side=5)),
    data=st.data(),
)
def test_channel_amax_is_the_per_channel_max_abs(kernel, data):
    axis = data.draw(st.integers(-kernel.ndim, kernel.ndim - 1))
    want = np.max(
        np.abs(np.moveaxis(kernel, axis, 0)).reshape(kernel.shape[axis], -1),
        axis=1,
    )
    # exact, but for subnormals, which the CPU may flush to zero
    np.testing.assert_allclose(
        channel_amax(kernel, axis).numpy(), want, rtol=0, atol=TINY
    )


# -- MuPPET dynamic fixed point


def _exponent(x, word_length):
    """The block exponent s of fixed_point_quantize's definition, in exact
    float32 arithmetic. None for an all-zero tensor; when the ratio
    U / max|x| overflows float32 (max|x| below ~3.7e-37 at 8 bits), the
    largest exponent, 126, as the quantizer takes (hypothesis found
    x = 1.92e-38 at 4 bits: 2 steps of 2**-126, not 0)."""
    half = 2.0 ** (word_length - 1)
    upper, lower = np.float32(half - 0.5), np.float32(-half - 0.5)
    x_max, x_min = np.max(x), np.min(x)
    ratios = []
    with np.errstate(over="ignore"):
        if x_max > 0:
            ratios.append(upper / x_max)
        if x_min < 0:
            ratios.append(lower / x_min)
    if not ratios:
        return None
    if not math.isfinite(min(ratios)):
        return 126
    _, e = math.frexp(float(min(ratios)))  # ratio = f * 2**e, 0.5 <= f < 1
    return int(np.clip(e - 1, -126, 126))


def _normal(x):
    """x with subnormals set to zero: CPUs may flush them (TF does)."""
    return np.where(np.abs(x) < TINY, 0.0, x).astype(np.float32)


@settings(max_examples=80, deadline=None)
@given(x=tensors(), word_length=st.integers(2, 24), stochastic=st.booleans())
def test_fixed_point_values_are_wl_bit_mantissas_times_a_power_of_two(
    x, word_length, stochastic
):
    seed = 11 if stochastic else None
    out = fixed_point_quantize(x, word_length, seed=seed).numpy()
    assert out.dtype == np.float32 and np.all(np.isfinite(out))
    s = _exponent(_normal(x), word_length)
    if s is None:
        assert np.all(np.abs(out) <= TINY)
        return
    step = 2.0**-s
    codes = out.astype(np.float64) / step
    np.testing.assert_array_equal(codes, np.round(codes))
    half = 2 ** (word_length - 1)
    assert codes.min() >= -half and codes.max() <= half - 1
    # Round to nearest: within half a step, a whole step where the top
    # code saturates; stochastic rounding: one of the two neighbours.
    if stochastic:
        bound = np.full(x.shape, step)
    else:
        bound = np.where(codes == half - 1, step, 0.5 * step)
    err = np.abs(out.astype(np.float64) - _normal(x))
    assert np.all(err <= bound + TINY)
    assert np.all(np.sign(out) * np.sign(_normal(x)) >= 0)


moderate = floats(1e-10, 1e10) | floats(-1e10, -1e-10)


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(np.float32, shapes, elements=moderate),
    word_length=st.integers(2, 16),
    k=st.integers(-20, 20),
)
def test_fixed_point_commutes_with_power_of_two_scaling(x, word_length, k):
    base = fixed_point_quantize(x, word_length).numpy()
    scaled = fixed_point_quantize(x * np.float32(2.0**k), word_length).numpy()
    np.testing.assert_array_equal(scaled, base * np.float32(2.0**k))


@settings(max_examples=30, deadline=None)
@given(
    x=tensors(hnp.array_shapes(min_dims=2, max_dims=3, max_side=5)),
    word_length=st.integers(2, 16),
)
def test_per_sample_exponent_equals_quantizing_each_sample(x, word_length):
    out = fixed_point_quantize(x, word_length, per_sample=True).numpy()
    for i in range(len(x)):
        np.testing.assert_array_equal(
            out[i], fixed_point_quantize(x[i], word_length).numpy()
        )


@settings(max_examples=30, deadline=None)
@given(x=tensors(), off=st.sampled_from([0, 32]), seed=st.integers(0, 99))
def test_word_length_0_or_32_is_exact_float32(x, off, seed):
    out = fixed_point_quantize(x, off, seed=seed).numpy()
    np.testing.assert_array_equal(out, x)  # subnormals and 1e38 included


@pytest.mark.parametrize(
    "dtype, x",
    [("float32", F32_MAX), ("float32", 3.39e38), ("float16", 65504.0)],
)
def test_fixed_point_keeps_the_largest_finite_values_finite(dtype, x):
    value = tf.constant([x, -x, 1.0], dtype)
    out = fixed_point_quantize(value, 8).numpy()
    assert np.all(np.isfinite(out)), out
    assert out[0] >= x * (1 - 2.0**-6)


# -- 2:4 structured sparsity masks


@st.composite
def kernels(draw, multiple=True):
    """(kernel, axis): rank 2 to 5, input channels a multiple of 4 on
    `axis` unless `multiple` is False, any dtype and any values."""
    rank = draw(st.integers(2, 5))
    shape = list(
        draw(hnp.array_shapes(min_dims=rank, max_dims=rank, max_side=4))
    )
    axis = draw(st.integers(-rank, rank - 1))
    groups = draw(st.integers(1, 3))
    shape[axis] = 4 * groups if multiple else draw(st.integers(1, 11))
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    kind = draw(value_kinds)
    values = draw(hnp.arrays(np.float32, tuple(shape), elements=kind))
    if draw(st.booleans()):  # many ties: a few distinct magnitudes
        values = np.round(values, 0)
    limit = np.finfo(dtype).max  # float16 saturates at 65504: keep finite
    return np.clip(values, -limit, limit).astype(dtype), axis


def _groups(array, axis):
    return np.moveaxis(np.asarray(array, np.float64), axis, -1).reshape(-1, 4)


@settings(max_examples=80, deadline=None)
@given(case=kernels())
def test_mask_keeps_exactly_2_of_every_4_and_the_largest(case):
    kernel, axis = case
    mask = magnitude_mask(kernel, axis)
    assert mask.shape == kernel.shape and mask.dtype == np.float32
    assert set(np.unique(mask)) <= {0.0, 1.0}
    g_mask, g_abs = _groups(mask, axis), np.abs(_groups(kernel, axis))
    assert np.all(g_mask.sum(-1) == 2)
    kept = np.where(g_mask > 0, g_abs, np.inf).min(-1)
    pruned = np.where(g_mask > 0, -np.inf, g_abs).max(-1)
    assert np.all(kept >= pruned)
    assert is_2_4_sparse(kernel * mask.astype(kernel.dtype), axis)
    assert is_2_4_sparse(mask, axis)


@settings(max_examples=60, deadline=None)
@given(case=kernels(), k=st.integers(-8, 8))
def test_mask_is_deterministic_sign_and_scale_invariant_and_idempotent(case, k):
    kernel, axis = case
    kernel = kernel.astype(np.float64)
    mask = magnitude_mask(kernel, axis)
    np.testing.assert_array_equal(magnitude_mask(kernel, axis), mask)
    np.testing.assert_array_equal(magnitude_mask(-kernel, axis), mask)
    np.testing.assert_array_equal(magnitude_mask(kernel * 2.0**k, axis), mask)
    np.testing.assert_array_equal(magnitude_mask(kernel * mask, axis), mask)


@settings(max_examples=80, deadline=None)
@given(case=kernels())
def test_is_2_4_sparse_counts_every_nonzero_subnormals_included(case):
    kernel, axis = case
    want = bool(np.all(np.count_nonzero(_groups(kernel, axis), axis=1) <= 2))
    assert is_2_4_sparse(kernel, axis) == want


@settings(max_examples=40, deadline=None)
@given(case=kernels(multiple=False))
def test_pad_treats_short_groups_as_zero_padded(case):
    kernel, axis = case
    channels = kernel.shape[axis]
    mask = magnitude_mask(kernel, axis, pad=True)
    assert is_2_4_sparse(kernel * mask.astype(kernel.dtype), axis, pad=True)
    tail = np.take(mask, range(channels - channels % 4, channels), axis=axis)
    assert np.all(tail.sum(axis=axis) == min(2, channels % 4))
    assert is_2_4_sparse(kernel, axis) is (
        channels % 4 == 0 and is_2_4_sparse(kernel, axis, pad=True)
    )


@settings(max_examples=40, deadline=None)
@given(case=kernels(), m_n=st.sampled_from([(1, 2), (1, 4), (3, 4), (4, 8)]))
def test_m_of_n_masks_keep_m_per_group(case, m_n):
    kernel, axis = case
    m, n = m_n
    if kernel.shape[axis] % n:
        return
    mask = magnitude_mask(kernel, axis, m=m, n=n)
    groups = np.moveaxis(mask, axis, -1).reshape(-1, n)
    assert np.all(groups.sum(-1) == m)
    assert is_2_4_sparse(kernel * mask.astype(kernel.dtype), axis, m=m, n=n)


@settings(max_examples=40, deadline=None)
@given(
    kernel=hnp.arrays(
        np.float32,
        st.tuples(
            st.integers(1, 3),
            st.integers(1, 3),
            st.integers(1, 3).map(lambda g: 4 * g),
            st.integers(1, 5),
        ),
        elements=any_float,
    ),
    prune=st.booleans(),
)
def test_keras_and_onnx_sparsity_checks_agree(kernel, prune):
    if prune:
        kernel = kernel * magnitude_mask(kernel, -2)
    onnx_conv = np.transpose(kernel, (3, 2, 0, 1))  # (kh, kw, in, out) -> OIHW
    assert is_2_4_sparse(kernel, -2) == is_2_4_sparse_onnx_weight(
        onnx_conv, "Conv"
    )
    dense = kernel.reshape(-1, kernel.shape[-1])  # (in, out): MatMul weight
    assert is_2_4_sparse(dense, 0) == is_2_4_sparse_onnx_weight(dense, "MatMul")
