"""The quantized layers (twins) and the activation Q/DQ layer, per layer
type."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.quantization import strip_quantization, twins
from keras_mp.reference import compile_classifier
from tests.conftest import small_cnn
from tests.quantization.conftest import cnn, images

L = keras.layers

# Layer conformance: every quantizable weighted type through the same
# checks. Adding a layer type is one line here.
LAYER_CASES = [
    ("Conv1D", lambda: L.Conv1D(8, 3), (10, 4)),
    ("Conv2D", lambda: L.Conv2D(8, 3), (8, 8, 4)),
    ("Conv3D", lambda: L.Conv3D(8, 2), (4, 4, 4, 4)),
    (
        "DepthwiseConv1D",
        lambda: L.DepthwiseConv1D(3, depth_multiplier=2),
        (10, 4),
    ),
    (
        "DepthwiseConv2D",
        lambda: L.DepthwiseConv2D(3, depth_multiplier=2),
        (8, 8, 4),
    ),
    ("SeparableConv1D", lambda: L.SeparableConv1D(8, 3), (10, 4)),
    ("SeparableConv2D", lambda: L.SeparableConv2D(8, 3), (8, 8, 4)),
    ("Conv2DTranspose", lambda: L.Conv2DTranspose(8, 3, strides=2), (4, 4, 4)),
    ("Dense", lambda: L.Dense(8), (12,)),
    ("EinsumDense", lambda: L.EinsumDense("ab,bc->ac", output_shape=8), (12,)),
]


def _output_channels(kernel, out_axes):
    return int(np.prod([kernel.shape[a] for a in out_axes]))


@pytest.mark.parametrize(
    "name,make,shape", LAYER_CASES, ids=[c[0] for c in LAYER_CASES]
)
def test_layer_conformance(name, make, shape, tmp_path):
    inputs = keras.Input(shape)
    model = keras.Model(inputs, make()(inputs))
    x = np.random.default_rng(0).standard_normal((4,) + shape).astype("float32")
    qmodel = keras_mp.quantize_model(model)
    layer = qmodel.get_layer(model.layers[1].name)
    assert twins.is_quantized(layer)
    keras_mp.calibrate(qmodel, x, verbose=0)
    want, got = model(x), qmodel(x)
    assert got.shape == want.shape
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0 < rel < 0.05, rel  # quantized: close, not identical
    # per-channel weight ranges: one per output channel, each max|w|
    for attr, axes, amax in layer.weight_ranges:
        kernel = getattr(layer, attr).numpy()
        assert amax.shape == (_output_channels(kernel, axes),)
        flat = np.moveaxis(kernel, axes, range(-len(axes), 0))
        flat = flat.reshape(-1, amax.shape[0])
        np.testing.assert_allclose(amax.numpy(), np.abs(flat).max(axis=0))
    # gradients reach every trainable weight
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(qmodel(x, training=True) ** 2)
    grads = tape.gradient(loss, qmodel.trainable_variables)
    assert all(g is not None and np.any(g.numpy() != 0) for g in grads)
    # one training step moves the weights and stays close to float
    qmodel.compile(keras.optimizers.SGD(1e-3), "mse")
    before = [w.numpy() for w in qmodel.trainable_weights]
    loss = qmodel.train_on_batch(x, np.zeros_like(want))
    assert np.isfinite(loss)
    after = qmodel.trainable_weights
    assert all(np.any(b != a.numpy()) for b, a in zip(before, after))
    model.set_weights(strip_quantization(qmodel).get_weights())
    want, got = model(x), qmodel(x)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05
    # save / load: identical outputs
    path = tmp_path / "q.keras"
    qmodel.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_array_equal(loaded(x), qmodel(x))
    # XLA
    xla = tf.function(lambda v: qmodel(v, training=True), jit_compile=True)
    np.testing.assert_allclose(xla(x), qmodel(x), rtol=1e-4, atol=1e-4)


def test_per_tensor_config_gives_one_weight_range():
    model = keras.Sequential(
        [keras.Input((8, 8, 4)), L.DepthwiseConv2D(3, depth_multiplier=2)]
    )
    qmodel = keras_mp.quantize_model(
        model, config=keras_mp.QuantizeConfig(per_channel=False)
    )
    layer = qmodel.get_layer(model.layers[0].name)
    assert twins.is_quantized(layer)
    ((_, axes, amax),) = layer.weight_ranges
    assert axes == () and amax.shape == ()
    kernel = layer.kernel.numpy()
    assert float(amax.numpy()) == np.abs(kernel).max()


def test_mixed_precision_qat_trains_under_xla():
    keras_mp.enable_mixed_precision("mixed_float16")
    model = keras_mp.apply_mixed_precision(small_cnn())
    qmodel = keras_mp.quantize_model(model)
    x = np.random.default_rng(0).random((32, 28, 28, 1), dtype=np.float32)
    y = np.arange(32) % 10
    keras_mp.calibrate(qmodel, x, verbose=0)
    convs = [
        layer
        for layer in twins.quantized_layers(qmodel)
        if isinstance(layer, L.Conv2D)
    ]
    assert convs and all(layer.compute_dtype == "float16" for layer in convs)
    compile_classifier(qmodel, jit_compile=True)
    history = qmodel.fit(x, y, epochs=3, batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_weights_only_save_load(tmp_path):
    model = keras_mp.quantize_model(small_cnn((8, 8, 1)))
    x = np.random.default_rng(0).random((8, 8, 8, 1), dtype=np.float32)
    keras_mp.calibrate(model, x, verbose=0)
    model.save_weights(tmp_path / "w.weights.h5")
    other = keras_mp.quantize_model(small_cnn((8, 8, 1)))
    other.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_array_equal(other(x), model(x))


def test_disabled_quantization_computes_the_float_model(quantized):
    x = images(4)
    model = cnn()
    model.set_weights(strip_quantization(quantized).get_weights())
    quantized.predict(x, verbose=0)  # traces predict_function
    keras_mp.set_quantization_enabled(quantized, False)
    np.testing.assert_array_equal(quantized.predict(x, verbose=0), model(x))
    keras_mp.set_quantization_enabled(quantized, True)
    assert not np.array_equal(quantized.predict(x, verbose=0), model(x))


def test_an_unsupported_type_is_rejected():
    with pytest.raises(
        ValueError,
        match="'lstm' of type LSTM cannot be quantized. Supported types: "
        "Add, .*AveragePooling2D, .*Concatenate, Conv1D.*QuantizeConfig",
    ):
        keras_mp.quantize_annotate_layer(L.LSTM(4, name="lstm"))


def test_activation_rejects_zero_bits():
    with pytest.raises(ValueError, match="Received: num_bits=0"):
        keras_mp.QuantizeActivation(num_bits=0)


def test_set_quantization_enabled_needs_a_model():
    with pytest.raises(TypeError, match="keras.Model"):
        keras_mp.set_quantization_enabled("model.keras", False)


def test_separable_conv_quantizes_the_pointwise_input(tmp_path):
    model = keras.Sequential([keras.Input((8, 8, 4)), L.SeparableConv2D(8, 3)])
    qmodel = keras_mp.quantize_model(model)
    x = images(8)
    report = keras_mp.calibrate(qmodel, x, verbose=0)
    layer = qmodel.get_layer(model.layers[0].name)
    assert twins.is_quantized(layer)
    assert f"{layer.name}/pointwise_input" in report.ranges
    amax = layer.inner_quantizers[0].amax.numpy()
    assert amax > 0
    # the pointwise Q/DQ and its range are saved
    qmodel.save(tmp_path / "q.keras")
    loaded = keras.saving.load_model(tmp_path / "q.keras", safe_mode=True)
    (pointwise,) = loaded.get_layer(layer.name).inner_quantizers
    np.testing.assert_array_equal(pointwise.amax.numpy(), amax)
    np.testing.assert_array_equal(loaded(x), qmodel(x))


def test_legacy_separable_wrapper_saved_before_pointwise_loads_without_it():
    # A (load-only) QuantizeWrapper saved before the pointwise Q/DQ existed
    # has no `pointwise_input` in its config: it loads without one.
    config = {
        "module": "keras_mp.quantization.legacy",
        "class_name": "QuantizeWrapper",
        "registered_name": "keras_mp>QuantizeWrapper",
        "config": {
            "name": "quant_sep",
            "layer": keras.saving.serialize_keras_object(
                L.SeparableConv2D(8, 3, name="sep")
            ),
            "config": keras_mp.QuantizeConfig().get_config(),
            "input_indices": [0],
        },
    }
    old = keras.saving.deserialize_keras_object(config)
    assert isinstance(old, keras_mp.legacy.QuantizeWrapper)
    assert not old.pointwise_input


def test_grouped_conv_quantizes_per_output_channel():
    model = keras.Sequential(
        [keras.Input((8, 8, 4)), L.Conv2D(8, 3, groups=2), L.Flatten()]
    )
    qmodel = keras_mp.quantize_model(model)
    x = images(16)
    keras_mp.calibrate(qmodel, x, verbose=0)
    layer = qmodel.get_layer(model.layers[0].name)
    assert twins.is_quantized(layer)
    ((_, axes, amax),) = layer.weight_ranges
    kernel = layer.kernel.numpy()  # (3, 3, 4 / 2, 8)
    assert axes == (-1,) and amax.shape == (8,)
    np.testing.assert_allclose(amax.numpy(), np.abs(kernel).max((0, 1, 2)))
    qmodel.compile(keras.optimizers.SGD(1e-2), "mse", jit_compile=True)
    history = qmodel.fit(x, np.zeros((16, 288)), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
