"""Quantizers, the quantize wrapper, annotate/apply, calibration, QAT."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tests.conftest import small_cnn
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import keras_mp
from keras_mp.quantization.quantizers import fake_quant
from keras_mp.reference import compile_classifier, reference_cnn


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


# Layer conformance: every supported layer type through the same checks.
# Adding a layer type is one line here.
LAYER_CASES = [
    ("Conv1D", lambda: keras.layers.Conv1D(8, 3), (10, 4)),
    ("Conv2D", lambda: keras.layers.Conv2D(8, 3), (8, 8, 4)),
    ("Conv3D", lambda: keras.layers.Conv3D(8, 2), (4, 4, 4, 4)),
    (
        "DepthwiseConv2D",
        lambda: keras.layers.DepthwiseConv2D(3, depth_multiplier=2),
        (8, 8, 4),
    ),
    ("SeparableConv2D", lambda: keras.layers.SeparableConv2D(8, 3), (8, 8, 4)),
    (
        "Conv2DTranspose",
        lambda: keras.layers.Conv2DTranspose(8, 3, strides=2),
        (4, 4, 4),
    ),
    ("Dense", lambda: keras.layers.Dense(8), (12,)),
    (
        "EinsumDense",
        lambda: keras.layers.EinsumDense("ab,bc->ac", output_shape=8),
        (12,),
    ),
]


@pytest.mark.parametrize(
    "name,make,shape", LAYER_CASES, ids=[c[0] for c in LAYER_CASES]
)
def test_layer_conformance(name, make, shape, tmp_path):
    inputs = keras.Input(shape)
    model = keras.Model(inputs, make()(inputs))
    x = np.random.default_rng(0).standard_normal((4,) + shape).astype("float32")
    qmodel = keras_mp.quantize_model(model)
    wrapper = qmodel.layers[1]
    assert isinstance(wrapper, keras_mp.QuantizeWrapper)
    keras_mp.calibrate(qmodel, x, verbose=0)
    want, got = model(x), qmodel(x)
    assert got.shape == want.shape
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0 < rel < 0.05, rel  # quantized: close, not identical
    # per-channel weight ranges sized to the output channels
    for _, _, amax in wrapper.weight_ranges:
        assert np.all(amax.numpy() > 0)
    # gradients reach every trainable weight
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(qmodel(x, training=True) ** 2)
    grads = tape.gradient(loss, qmodel.trainable_variables)
    assert all(g is not None and np.any(g.numpy() != 0) for g in grads)
    # save / load: identical outputs
    path = tmp_path / "q.keras"
    qmodel.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_array_equal(loaded(x), qmodel(x))
    # XLA
    xla = tf.function(lambda v: qmodel(v, training=True), jit_compile=True)
    np.testing.assert_allclose(xla(x), qmodel(x), rtol=1e-4, atol=1e-4)


def test_mixed_precision_qat_trains_under_xla():
    keras_mp.enable_mixed_precision("mixed_float16")
    model = keras_mp.apply_mixed_precision(small_cnn())
    qmodel = keras_mp.quantize_model(model)
    x = np.random.default_rng(0).random((32, 28, 28, 1), dtype=np.float32)
    y = np.arange(32) % 10
    keras_mp.calibrate(qmodel, x, verbose=0)
    assert qmodel.layers[1].compute_dtype == "float16"
    compile_classifier(qmodel, jit_compile=True)
    history = qmodel.fit(x, y, epochs=3, batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]


def _normalized_model():
    inputs = keras.Input((28, 28, 1))
    norm = keras.layers.Normalization(mean=0.3, variance=0.1)
    x = norm(inputs)
    inner = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
        ],
        name="inner",
    )
    x = inner(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def test_apply_carries_state_and_disabled_equals_float():
    model = _normalized_model()
    qmodel = keras_mp.quantize_model(model)
    wrapped = list(qmodel.get_layer("inner").layers)
    assert isinstance(wrapped[0], keras_mp.QuantizeWrapper)  # nested model
    x = np.random.default_rng(1).random((4, 28, 28, 1), dtype=np.float32)
    keras_mp.set_quantization_enabled(qmodel, False)
    np.testing.assert_array_equal(qmodel(x), model(x))
    keras_mp.set_quantization_enabled(qmodel, True)
    keras_mp.calibrate(qmodel, x, verbose=0)
    assert not np.array_equal(qmodel(x), model(x))


def test_residual_add_quantizes_only_the_skip_input():
    qmodel = keras_mp.quantize_model(reference_cnn(width=8))
    add = qmodel.get_layer("quant_res_add")
    assert add.input_indices == [0]  # input 1 comes from conv -> BN: fused
    concat_in = keras.Input((4, 4, 8))
    a = keras.layers.Conv2D(8, 1)(concat_in)
    b = keras.layers.Conv2D(8, 1)(concat_in)
    cat = keras.Model(concat_in, keras.layers.Concatenate()([a, b]))
    qcat = keras_mp.quantize_model(cat)
    assert qcat.layers[-1].input_indices == [0, 1]


def test_selection_and_config():
    model = reference_cnn(width=8)
    q = keras_mp.quantize_model(model, layers=["stem", keras.layers.Dense])
    names = {
        layer.name
        for layer in q.layers
        if isinstance(layer, keras_mp.QuantizeWrapper)
    }
    assert names == {"quant_stem", "quant_fc", "quant_logits"}
    q = keras_mp.quantize_model(
        model,
        config={
            "logits": keras_mp.QuantizeConfig(skip=True),
            "fc": keras_mp.QuantizeConfig(per_channel=False),
        },
    )
    assert "logits" in [layer.name for layer in q.layers]
    assert q.get_layer("quant_fc").weight_ranges[0][2].shape == ()


def test_calibrators_set_ranges_and_report():
    (x, _), _ = keras_mp.load_digits()
    model = small_cnn((8, 8, 1))
    ranges = {}
    for method in ("max", "percentile", "entropy", "mse"):
        qmodel = keras_mp.quantize_model(model)
        report = keras_mp.calibrate(
            qmodel, x[:256], method=method, batch_size=64, verbose=0
        )
        assert report.batches == 4 and report.samples == 256
        ranges[method] = report.ranges
    for name, amax in ranges["max"].items():
        for method in ("percentile", "entropy", "mse"):
            assert 0 < ranges[method][name] <= amax * 1.001, (method, name)
    assert ranges["max"][f"{qmodel.layers[0].name}/input_0"] == pytest.approx(
        float(x[:256].max())
    )
    rows = keras_mp.quantization_report(qmodel, verbose=False)
    assert any(r["quantized"] and r["inputs"] for r in rows)
    assert any("no Q/DQ needed" in r["note"] for r in rows)


def test_calibrate_accepts_dataset_and_generator():
    model = keras_mp.quantize_model(small_cnn((8, 8, 1)))
    x = np.random.default_rng(0).random((64, 8, 8, 1), dtype=np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, np.zeros(64))).batch(16)
    assert keras_mp.calibrate(model, ds, verbose=0).batches == 4
    gen = (x[i : i + 32] for i in range(0, 64, 32))
    assert (
        keras_mp.calibrate(
            model, gen, num_batches=1, verbose=0
        ).batches
        == 1
    )


def test_qat_with_frozen_ranges_keeps_activation_ranges(fashion_small):
    (x, y), (xt, yt) = fashion_small
    model = compile_classifier(reference_cnn(width=8))
    model.fit(x, y, epochs=3, batch_size=64, verbose=0)
    float_acc = model.evaluate(xt, yt, verbose=0)[1]
    qmodel = keras_mp.quantize_model(model)
    report = keras_mp.calibrate(qmodel, x[:512], verbose=0)
    compile_classifier(qmodel, learning_rate=1e-4)
    qmodel.fit(x, y, epochs=1, batch_size=64, verbose=0)
    for name, amax in report.ranges.items():
        layer_name, _ = name.split("/")
        q = qmodel.get_layer(layer_name).input_quantizers[0]
        assert float(q.amax.numpy()) == pytest.approx(amax)
    acc = qmodel.evaluate(xt, yt, verbose=0)[1]
    assert acc > float_acc - 0.05, (acc, float_acc)


def test_weights_only_save_load(tmp_path):
    model = keras_mp.quantize_model(small_cnn((8, 8, 1)))
    x = np.random.default_rng(0).random((8, 8, 8, 1), dtype=np.float32)
    keras_mp.calibrate(model, x, verbose=0)
    model.save_weights(tmp_path / "w.weights.h5")
    other = keras_mp.quantize_model(small_cnn((8, 8, 1)))
    other.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_array_equal(other(x), model(x))


def test_bad_inputs_name_the_fault():
    no_quant = keras.Sequential([keras.Input((4,)), keras.layers.ReLU()])
    with pytest.raises(ValueError, match="No quantizable layer"):
        keras_mp.quantize_model(no_quant)
    flat = keras.Sequential(
        [
            keras.Input((4, 4)),
            keras.layers.Flatten(name="flat"),
            keras.layers.Dense(2),
        ]
    )
    with pytest.raises(ValueError, match="'flat' of type Flatten cannot be"):
        keras_mp.quantize_model(flat, layers="flat")
    model = small_cnn((8, 8, 1))
    qmodel = keras_mp.quantize_model(model)
    with pytest.raises(ValueError, match="already quantized"):
        keras_mp.quantize_apply(qmodel)
    with pytest.raises(ValueError, match="empty"):
        keras_mp.calibrate(
            qmodel, np.zeros((0, 8, 8, 1), "float32")
        )
    with pytest.raises(ValueError, match="expects"):
        keras_mp.calibrate(
            qmodel, np.zeros((4, 9, 9, 1), "float32")
        )
    bad = np.zeros((4, 8, 8, 1), "float32")
    bad[2, 1, 1, 0] = np.nan
    with pytest.raises(
        ValueError, match=r"NaN/Inf \(batch 0, first at index \(2, 1, 1, 0\)"
    ):
        keras_mp.calibrate(qmodel, bad)
    with pytest.raises(ValueError, match="Unknown calibration method"):
        keras_mp.calibrate(qmodel, bad, method="kl")
    with pytest.raises(TypeError, match="keras.Model"):
        keras_mp.quantize_model("model.keras")

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(3)

        def call(self, x):
            return self.d(x)

    with pytest.raises(TypeError, match="subclassed"):
        keras_mp.quantize_model(Sub())
    with pytest.raises(ValueError, match="num_bits"):
        keras_mp.QuantizeConfig(num_bits=16)


def test_entropy_calibrator_is_not_fooled_by_relu_zeros():
    from keras_mp.calibrate import HistogramCollector, _entropy

    rng = np.random.default_rng(0)
    relu = np.maximum(rng.standard_normal(200_000), 0.0)  # half exact zeros
    collector = HistogramCollector("relu")
    collector.update(relu)
    amax = _entropy(collector)
    # KL keeps most of the range of a half-normal: not the 10% the zero
    # spike would pick, not the outlier max either
    assert 0.5 * collector.amax < amax < collector.amax
