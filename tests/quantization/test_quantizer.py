"""The one quantizer (`TensorQuantizer`) and its number-format table.

The rows' values, the fake quant bit for bit against the int8 math it
replaced (TensorFlow's QuantizeAndDequantizeV3 with a given range), on/off,
calibration hand-off, the first-batch range under MirroredStrategy, saving,
XLA, and a format added as one row of a copy of the table.
"""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.quantization import QuantizeConfig, formats, twins
from keras_mp.quantization.formats import FORMATS, NumberFormat, number_format
from keras_mp.quantization.tensor_quantizer import TensorQuantizer
from keras_mp.quantization.twins import WeightQuantizer
from tests.quantization.conftest import images

RNG = np.random.default_rng(0)


def reference_qdq(x, amax, axis=None, narrow_range=False, num_bits=8):
    """The int8 forward as keras_mp computed it before the format table."""
    amax = tf.maximum(tf.constant(amax, tf.float32), 1e-8)
    return tf.raw_ops.QuantizeAndDequantizeV3(
        input=tf.constant(x, tf.float32),
        input_min=-amax,
        input_max=amax,
        num_bits=num_bits,
        signed_input=True,
        range_given=True,
        narrow_range=narrow_range,
        axis=-1 if axis is None else axis,
    ).numpy()


def _built(quantizer, shape, amax):
    quantizer.build(shape)
    quantizer.amax.assign(np.full(quantizer.amax.shape, amax, np.float32))
    return quantizer


# -- the table


def test_int8_row():
    row = FORMATS["int8"]
    assert (row.kind, row.bits, row.qmin, row.qmax) == ("int", 8, -128, 127)
    assert row.narrow_qmin == -127
    assert row.onnx_type == "INT8"
    assert row.scale(np.float32(2.54)) == np.float32(2.54) / np.float32(127)
    np.testing.assert_array_equal(
        row.scale([1.0, 127.0]), np.float32([1 / 127, 1.0])
    )


def test_int_rows_are_the_widths_quantize_config_accepts():
    assert list(FORMATS) == [f"int{b}" for b in range(2, 9)] + [
        "float8",
        "nvfp4",
        "mxfp8",
    ]
    for bits in range(2, 9):
        QuantizeConfig(precision=f"int{bits}")
        row = number_format(bits)
        assert row is FORMATS[f"int{bits}"]
        assert (row.qmin, row.qmax) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    # The ONNX export writes the rows TensorRT runs: int8 and float8.
    assert [r.name for r in FORMATS.values() if r.onnx_type] == [
        "int8",
        "float8",
    ]


def test_number_format_lookup():
    row = FORMATS["int4"]
    assert number_format("int4") is row
    assert number_format(row) is row
    for bad in ("fp16", 16, True, 8.0, None):
        with pytest.raises(
            ValueError, match=r"'int2', .* 'int8', 'float8', 'nvfp4', 'mxfp8'\]"
        ):
            number_format(bad)
    with pytest.warns(DeprecationWarning, match="use 'float8'"):
        assert number_format("fp8") is FORMATS["float8"]
    with pytest.warns(DeprecationWarning, match="use 'float8'"):
        assert TensorQuantizer(format="fp8").format is FORMATS["float8"]


def test_a_row_must_be_symmetric_and_of_a_known_kind():
    with pytest.raises(ValueError, match="kind='posit'"):
        NumberFormat("p8", "posit", 8, 127, -128, None, formats._int_qdq)
    with pytest.raises(ValueError, match="qmin=0, qmax=255"):
        NumberFormat("u8", "int", 8, 255, 0, None, formats._int_qdq)


# -- bit for bit against the int8 math


def test_activation_per_tensor_bit_for_bit():
    x = RNG.normal(size=(4, 6, 5)).astype(np.float32) * 3
    for bits in (8, 4):
        q = _built(keras_mp.QuantizeActivation(format=bits), (), 2.5)
        assert not q.narrow_range and q.out_axes == ()
        np.testing.assert_array_equal(
            q(x).numpy(), reference_qdq(x, 2.5, num_bits=bits)
        )


def test_weight_per_channel_bit_for_bit():
    kernel = RNG.normal(size=(3, 3, 4, 8)).astype(np.float32)
    q = WeightQuantizer(out_axes=(-1,))
    q.build(kernel.shape)
    q.update(kernel)
    amax = np.abs(kernel).max(axis=(0, 1, 2))
    np.testing.assert_array_equal(q.amax.numpy(), amax)
    np.testing.assert_array_equal(
        q(kernel).numpy(),
        reference_qdq(kernel, amax, axis=3, narrow_range=True),
    )


@pytest.mark.parametrize(
    "equation, shape, axes, order",
    [
        ("abc,cde->abde", (4, 2, 3), (1, 2), (0, 1, 2)),  # adjacent axes
        ("btd,ndh->btnh", (4, 2, 3), (0, 2), (1, 0, 2)),  # moved last
    ],
)
def test_merged_einsum_channels_bit_for_bit(equation, shape, axes, order):
    layer = keras.layers.EinsumDense(equation, shape)
    layer.build((None, 4, 6))
    kernel = layer.kernel.numpy()
    q = WeightQuantizer(out_axes=axes)
    q.build(kernel.shape)
    q.update(kernel)
    # Channels row-major over `axes`: move them last, in that order.
    moved = np.transpose(kernel, order)
    view = moved.reshape(moved.shape[0], -1)
    amax = np.abs(view).max(axis=0)
    np.testing.assert_array_equal(q.amax.numpy(), amax)
    want = reference_qdq(view, amax, axis=1, narrow_range=True)
    want = np.transpose(want.reshape(moved.shape), np.argsort(order))
    np.testing.assert_array_equal(q(kernel).numpy(), want)


def test_straight_through_gradient_bounds_come_from_the_row():
    # Full range reaches qmin / qmax * amax = -1.0079; narrow range -1.
    x = tf.constant([-1.005, -1.0, 0.5, 1.0, 1.01])
    for narrow, want in ((False, [1, 1, 1, 1, 0]), (True, [0, 1, 1, 1, 0])):
        q = _built(TensorQuantizer(narrow_range=narrow), (), 1.0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(q(x))
        np.testing.assert_array_equal(tape.gradient(y, x), want)


# -- state: on/off, calibration, training ranges


def test_disabled_passes_the_input_through():
    x = RNG.normal(size=(5, 4)).astype(np.float32)
    for q in (keras_mp.QuantizeActivation(), WeightQuantizer((-1,))):
        _built(q, (4,) if q.out_axes else (), 0.5)
        q.enabled = False
        np.testing.assert_array_equal(q(x, training=True).numpy(), x)
        np.testing.assert_array_equal(q.amax.numpy(), 0.5)  # not updated


def test_set_quantization_enabled_turns_every_quantizer_off(quantized):
    x = images(8)
    keras_mp.set_quantization_enabled(quantized, False)
    assert not any(q.quantizer.enabled for q in twins.quantizers(quantized))
    float_model = keras_mp.strip_quantization(quantized)
    np.testing.assert_allclose(
        quantized.predict(x, verbose=0),
        float_model.predict(x, verbose=0),
        atol=1e-6,
    )
    keras_mp.set_quantization_enabled(quantized, True)
    assert all(q.quantizer.enabled for q in twins.quantizers(quantized))


class _Collector:
    def __init__(self):
        self.seen = []

    def collect(self, x):
        self.seen.append(x)


def test_collector_sees_inputs_and_passes_them_through():
    x = RNG.normal(size=(3, 4)).astype(np.float32) * 10
    q = _built(keras_mp.QuantizeActivation(), (), 1.0)
    q.collector = _Collector()
    np.testing.assert_array_equal(q(x, training=True).numpy(), x)
    (seen,) = q.collector.seen
    np.testing.assert_array_equal(seen, x)
    assert float(q.amax.numpy()) == 1.0


def test_training_ranges_first_batch_then_frozen_or_tracked():
    x = RNG.normal(size=(8, 4)).astype(np.float32)
    act = _built(keras_mp.QuantizeActivation(), (), 0.0)
    act(x, training=True)
    assert float(act.amax.numpy()) == np.abs(x).max()
    act(x * 3, training=True)  # frozen after the first batch
    assert float(act.amax.numpy()) == np.abs(x).max()
    weight = _built(WeightQuantizer((-1,)), (4,), 0.0)
    for scale in (1, 3):
        weight(x * scale, training=True)  # follows the tensor
        np.testing.assert_array_equal(
            weight.amax.numpy(), np.abs(x * scale).max(0)
        )


def test_per_channel_first_batch_range():
    x = RNG.normal(size=(8, 4)).astype(np.float32)
    q = _built(TensorQuantizer(out_axes=(-1,)), (8, 4), 0.0)
    q(x, training=True)
    np.testing.assert_array_equal(q.amax.numpy(), np.abs(x).max(0))


def test_argument_errors():
    with pytest.raises(ValueError, match="Received: num_bits=0"):
        TensorQuantizer(num_bits=0)
    with pytest.raises(ValueError, match="format='int8', num_bits=4"):
        TensorQuantizer(format="int8", num_bits=4)
    with pytest.raises(ValueError, match="out_axes=\\(-1,\\)"):
        TensorQuantizer(out_axes=(-1,), learned_range=True)
    with pytest.raises(ValueError, match="narrow_range=True"):
        WeightQuantizer(learned_range=True, track_range=False)
    with pytest.warns(DeprecationWarning, match="use format='int4'"):
        assert TensorQuantizer(num_bits=4).format is FORMATS["int4"]
    with pytest.warns(DeprecationWarning, match="use format='int4'"):
        assert TensorQuantizer(format="int4", num_bits=4).num_bits == 4


def test_first_batch_range_is_the_global_max_under_mirrored_strategy(
    mirrored_strategy,
):
    strategy = mirrored_strategy
    halves = RNG.normal(size=(2, 4, 3)).astype(np.float32)
    halves[1, :, 0] *= 5  # replica 1 holds channel 0's max
    halves[0, :, 2] *= 5  # replica 0 holds channel 2's max
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(halves[ctx.replica_id_in_sync_group])
    )
    with strategy.scope():
        per_tensor = _built(keras_mp.QuantizeActivation(), (), 0.0)
        per_channel = _built(TensorQuantizer(out_axes=(-1,)), (4, 3), 0.0)

    @tf.function
    def step(x):
        per_tensor(x, training=True)
        per_channel(x, training=True)

    strategy.run(step, args=(values,))
    for quantizer, want in (
        (per_tensor, np.abs(halves).max()),
        (per_channel, np.abs(halves).max(axis=(0, 1))),
    ):
        for replica in strategy.experimental_local_results(
            quantizer.amax.value
        ):
            np.testing.assert_array_equal(replica.numpy(), want)


# -- saving, XLA


def test_save_load_safe_mode(tmp_path):
    inputs = keras.Input((4,))
    q = keras_mp.QuantizeActivation(name="qdq")
    t = TensorQuantizer(format="int4", narrow_range=True, name="t")
    model = keras.Model(inputs, t(keras.layers.Dense(3)(q(inputs))))
    q.amax.assign(1.5)
    t.amax.assign(2.0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    x = RNG.normal(size=(6, 4)).astype(np.float32)
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())
    got = loaded.get_layer("t")
    assert (got.format, got.narrow_range, got.track_range) == (
        FORMATS["int4"],
        True,
        False,
    )
    assert type(loaded.get_layer("qdq")) is keras_mp.QuantizeActivation


def test_configs_saved_before_the_format_table_load():
    old = keras_mp.QuantizeActivation.from_config(
        {"name": "a", "num_bits": 8, "learned_range": True}
    )
    assert (old.format, old.learned_range) == (FORMATS["int8"], True)
    weight = WeightQuantizer.from_config({"out_axes": [0, 2], "num_bits": 4})
    assert weight.out_axes == (0, 2) and weight.format is FORMATS["int4"]
    assert weight.narrow_range and weight.track_range
    assert weight.dtype_policy.name == "float32"
    config = weight.get_config()
    assert config["format"] == "int4" and "num_bits" not in config
    assert WeightQuantizer.from_config(config).get_config() == config
    # "fp8", the FP8 row's name before the vocabulary, loads silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8 = WeightQuantizer.from_config(dict(config, format="fp8"))
    assert fp8.format is FORMATS["float8"]
    assert fp8.get_config()["format"] == "float8"


def test_fake_quant_compiles_with_xla():
    x = RNG.normal(size=(2, 3, 4)).astype(np.float32)
    for q in (
        keras_mp.QuantizeActivation(),
        WeightQuantizer(out_axes=(0, 2)),
    ):
        _built(q, x.shape if q.out_axes else (), 0.0)
        compiled = tf.function(
            functools.partial(q, training=True), jit_compile=True
        )
        got = compiled(tf.constant(x)).numpy()
        assert float(np.min(q.amax.numpy())) > 0  # range set inside XLA
        np.testing.assert_array_equal(got, q(x).numpy())


# -- a format is one row


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_qdq(fmt, x, amax, axis, narrow_range):
    """Round to the nearest FP4 E2M1 magnitude, saturating at 6."""
    scale = amax / fmt.qmax
    if axis is not None:
        shape = [1] * x.shape.rank
        shape[axis] = -1
        scale = tf.reshape(scale, shape)
    y = tf.clip_by_value(tf.abs(x) / scale, 0.0, fmt.qmax)
    grid = tf.constant(E2M1)
    nearest = tf.argmin(tf.abs(y[..., None] - grid), axis=-1)
    return tf.sign(x) * tf.gather(grid, nearest) * scale


TOY = NumberFormat(
    name="toy_e2m1",
    kind="float",
    bits=4,
    qmax=6.0,
    qmin=-6.0,
    onnx_type=None,
    qdq=_e2m1_qdq,
)


def test_a_new_format_is_one_row(monkeypatch):
    monkeypatch.setattr(formats, "FORMATS", {**FORMATS, TOY.name: TOY})
    assert number_format("toy_e2m1") is TOY
    x = np.float32([[-7.0, -2.4, -0.2, 0.3, 0.7, 2.6, 5.1, 9.0]])
    act = _built(keras_mp.QuantizeActivation(format="toy_e2m1"), (), 6.0)
    np.testing.assert_array_equal(
        act(x).numpy(), [[-6.0, -2.0, 0.0, 0.5, 0.5, 3.0, 6.0, 6.0]]
    )
    # Per channel, narrow range (the same grid: qmin = -qmax).
    weight = WeightQuantizer(out_axes=(0,), format="toy_e2m1")
    weight.build((2, 8))
    kernel = np.concatenate([x, x / 3])
    weight.update(kernel)
    got = weight(kernel).numpy()
    np.testing.assert_array_equal(
        got[0] / (9.0 / 6), [-4, -1.5, 0, 0, 0.5, 1.5, 3, 6]
    )
    np.testing.assert_allclose(got[1], got[0] / 3, rtol=1e-6)
    # Straight-through gradient inside [-amax, amax], from the row's qmin.
    with tf.GradientTape() as tape:
        v = tf.constant(x)
        tape.watch(v)
        y = tf.reduce_sum(act(v))
    np.testing.assert_array_equal(
        tape.gradient(y, v), [[0, 1, 1, 1, 1, 1, 1, 0]]
    )
    # Saved by name, loaded through the table.
    clone = keras_mp.QuantizeActivation.from_config(act.get_config())
    assert clone.format is TOY and clone.num_bits == 4


@pytest.mark.parametrize("dtype", [None, "mixed_float16"])
def test_standalone_activation_quantizer_trains_under_mixed_float16(dtype):
    # A QuantizeActivation a user puts in a mixed_float16 model computes in
    # float32 (its default policy), and one saved with a float16 policy
    # (files of earlier releases) still trains: the range is read as
    # float32 inside the autocast scope.
    keras.mixed_precision.set_global_policy("mixed_float16")
    kwargs = {} if dtype is None else {"dtype": dtype}
    qdq = keras_mp.QuantizeActivation(name="qdq", **kwargs)
    inputs = keras.Input((8,))
    x = qdq(keras.layers.Dense(8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(x))
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(8, 8)).astype("float32")
    model.fit(x, np.zeros((8, 2), "float32"), batch_size=8, verbose=0)
    assert float(qdq.amax.numpy()) > 0
    assert qdq.compute_dtype == ("float32" if dtype is None else "float16")
