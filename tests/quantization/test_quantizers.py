"""Fake-quant math against ONNX QuantizeLinear/DequantizeLinear in NumPy."""

import numpy as np
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from keras_mp.quantization.fake_quant import fake_quant


def onnx_qdq(x, scale, axis=None, qmin=-128, qmax=127):
    """ONNX QuantizeLinear + DequantizeLinear, zero point 0, in NumPy:
    round half to even, saturate."""
    if axis is not None:
        shape = [1] * x.ndim
        shape[axis] = -1
        scale = scale.reshape(shape)
    q = np.clip(np.rint(x / scale), qmin, qmax)
    return (q * scale).astype(np.float32)


floats = st.floats(-1024.0, 1024.0, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(
        np.float32, hnp.array_shapes(max_dims=3, max_side=8), elements=floats
    ),
    amax=st.floats(0.0009765625, 1024.0, width=32),
)
def test_per_tensor_equals_onnx_qdq(x, amax):
    scale = np.float32(amax) / np.float32(127)
    got = fake_quant(x, np.float32(amax)).numpy()
    np.testing.assert_allclose(
        got, onnx_qdq(x, scale), rtol=1e-6, atol=1e-6 * amax
    )


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(np.float32, (4, 3, 5), elements=floats),
    amax=hnp.arrays(
        np.float32, (5,), elements=st.floats(0.0078125, 1024.0, width=32)
    ),
)
def test_per_channel_narrow_equals_onnx_qdq(x, amax):
    got = fake_quant(x, amax, axis=-1, narrow_range=True).numpy()
    want = onnx_qdq(x, amax / np.float32(127), axis=2, qmin=-127)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * amax.max())


def test_ties_round_half_to_even_and_saturation():
    scale = np.float32(1.0 / 127)
    codes = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 200, -128.4, -300])
    x = (codes * scale).astype(np.float32)
    got = np.round(fake_quant(x, np.float32(1.0)).numpy() / scale)
    np.testing.assert_array_equal(got, [0, 2, 2, 0, -2, 126, 127, -128, -128])
    narrow = np.round(fake_quant(x, 1.0, narrow_range=True).numpy() / scale)
    assert narrow.min() == -127


def test_straight_through_gradient_is_zero_outside_range():
    x = tf.constant([-3.0, -0.5, 0.0, 0.5, 3.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(fake_quant(x, 1.0) * 2.0)
    np.testing.assert_array_equal(tape.gradient(y, x), [0, 2, 2, 2, 0])


def test_float16_is_quantized_in_float32_and_cast_back():
    x = tf.constant([0.3, -0.7, 1.2], tf.float16)
    y = fake_quant(x, 1.0)
    assert y.dtype == tf.float16
    np.testing.assert_allclose(
        y.numpy(), onnx_qdq(x.numpy().astype(np.float32), 1 / 127), atol=1e-3
    )
