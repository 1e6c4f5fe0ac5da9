"""The dynamic fixed-point quantizer and its straight-through estimator."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from keras_mp.muppet import fixed_point_quantize
from keras_mp.muppet.quantizer import check_word_length, fixed_point_ste


def q(x, bits, seed=None, per_sample=False):
    x = np.asarray(x, "float32")
    return fixed_point_quantize(x, bits, seed, per_sample).numpy()


def test_exponent_choice_hand_cases():
    # WL=4: U=7.5, L=-8.5; min(7.5/0.9, 8.5/1) = 8.33 -> s=3.
    np.testing.assert_array_equal(q([0.3, -1.0, 0.9], 4), [0.25, -1.0, 0.875])
    # Exact powers of two: 127.5/1 -> s=6; 127.5/0.5 = 255 -> s=7.
    np.testing.assert_array_equal(q([1.0], 8), [1.0])
    np.testing.assert_array_equal(q([0.5, 0.25], 8), [0.5, 0.25])
    # 127.5/0.01 = 12750 -> s=13: 0.01 * 8192 = 81.92 -> 82 / 8192.
    np.testing.assert_array_equal(q([0.01], 8), [82 / 8192])
    # Negative side bounds: 128.5/2 = 64.25 -> s=6, -128 fits exactly.
    np.testing.assert_array_equal(q([-2.0, 1.0], 8), [-2.0, 1.0])


def test_zero_and_one_signed_tensors():
    np.testing.assert_array_equal(q(np.zeros(4), 8), np.zeros(4))
    # Positive only: 127.5/3 -> s=5 -> 32, 64, 96 exact.
    np.testing.assert_array_equal(q([1.0, 2.0, 3.0], 8), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(q([-1.0, -2.0, -3.0], 8), [-1, -2, -3])
    out = q([1e-30, 0.0], 8)
    assert np.all(np.isfinite(out)) and out[1] == 0.0
    # The smallest normal float32 overflows the ratio 127.5 / x: the
    # exponent stops at 126, where 2**-126 is one grid step.
    np.testing.assert_array_equal(q([2.0**-126], 8), [2.0**-126])


def test_clamp_to_signed_range():
    seed = keras.random.SeedGenerator(3)
    # s=6, 2**6 * x = 127.3: stochastic rounding gives 128 30% of the time
    # without the clamp; the clamp keeps 127 (the reference code's bug).
    top = np.stack([q([1.9890625], 8, seed) for _ in range(200)])
    np.testing.assert_array_equal(np.unique(top), [127 / 64])
    # 128.5/2.0078125 = 64 -> s=6, 2**6 * x = -128.5: -129 is clamped.
    low = np.stack([q([-2.0078125], 8, seed) for _ in range(200)])
    np.testing.assert_array_equal(np.unique(low), [-2.0])


def test_stochastic_rounding_is_unbiased():
    x = np.full(40_000, 0.3, "float32")
    x[0] = 1.0  # s=2 at WL=4: 0.3 -> 1.2 -> 1 or 2 (20% of the time)
    out = q(x, 4, keras.random.SeedGenerator(0))
    assert set(np.unique(out[1:])) == {0.25, 0.5}
    assert abs(out[1:].mean() - 0.3) < 0.002
    assert q(x, 4)[1] == 0.25  # round to nearest is biased


def test_per_sample_exponents():
    x = [[1.0, 0.3], [100.0, 30.0]]
    # Sample 0: s=2 -> [4, 1]/4; sample 1: 7.5/100 -> s=-4 -> [6, 2]*16.
    np.testing.assert_array_equal(
        q(x, 4, per_sample=True), [[1, 0.25], [96, 32]]
    )


@pytest.mark.parametrize("off", [0, 32])
def test_float32_mode_is_exact_pass_through(off):
    x = np.random.default_rng(0).normal(size=(5, 7)).astype("float32")
    np.testing.assert_array_equal(q(x, off, seed=1), x)


@settings(max_examples=25, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        st.integers(1, 12),
        elements=st.floats(-1e4, 1e4, width=32),
    ),
    bits=st.integers(2, 16),
)
def test_quantized_values_lie_on_the_grid(x, bits):
    out = q(x, bits, seed=7)
    assert np.all(np.isfinite(out))
    if not np.any(x):
        np.testing.assert_array_equal(out, 0.0)
        return
    bound = max(
        float(np.max(x)) / (2 ** (bits - 1) - 0.5),
        float(np.min(x)) / -(2 ** (bits - 1) + 0.5),
    )
    s = min(math.floor(math.log2(1 / bound)), 126)  # exponents stop at 126
    step = 2.0**-s
    ints = out / step
    np.testing.assert_array_equal(ints, np.round(ints))
    assert ints.max() <= 2 ** (bits - 1) - 1 and ints.min() >= -(
        2 ** (bits - 1)
    )
    assert np.all(np.abs(out - x) < step * (1 + 1e-6))


def test_straight_through_gradient_quantized_and_recorded():
    x = tf.Variable([0.1, -0.7, 0.4])
    upstream = tf.constant([0.3, -1.0, 0.9])
    record = tf.Variable(tf.zeros(3))
    for bits, expected in ((4, [0.25, -1.0, 0.875]), (0, upstream.numpy())):
        with tf.GradientTape() as tape:
            y = fixed_point_ste(
                x,
                tf.constant(float(bits)),
                keras.random.SeedGenerator(0),
                record=record,
            )
            loss = tf.reduce_sum(y * upstream)
        grad = tape.gradient(loss, x).numpy()
        # Stochastic rounding of the gradient: within one step (1/8).
        tol = 0.125 if bits else 0.0
        np.testing.assert_allclose(grad, expected, atol=tol)
        np.testing.assert_array_equal(record.numpy(), grad)


@pytest.mark.parametrize("bad", [1, 33, 40, 8.0, True, "8"])
def test_bad_word_length_names_the_range(bad):
    with pytest.raises(
        ValueError,
        match=r"`word_length` must be an integer bit width in 2\.\.32, or "
        rf"None for float32. Received: word_length={bad!r}$",
    ):
        check_word_length(bad)
    assert check_word_length(None) == 0 and check_word_length(16) == 16
