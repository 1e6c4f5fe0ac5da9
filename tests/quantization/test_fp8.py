"""FP8 E4M3: the format row, `precision=` on quantize_model and
QuantizeConfig, TensorRT's FP8 placement rules, and the ONNX export."""

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.quantization import FORMATS
from keras_mp.quantization.calibrate import activation_quantizers
from keras_mp.quantization.quantizers import fake_quant

FP8 = FORMATS["fp8"]


def test_fp8_rounding_is_e4m3_bit_for_bit_and_saturates():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.normal(0, 3, 4000), [1.0625, -1.0625, 500.0, -1e6, 2e-3, 0.0]]
    ).astype(np.float32)
    amax = np.float32(10.0)
    got = fake_quant(tf.constant(x), amax, format="fp8").numpy()
    scale = amax / np.float32(448)
    want = (
        np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    ).astype(np.float32) * scale
    np.testing.assert_array_equal(got, want)
    assert got.max() == pytest.approx(10.0) and got.min() == pytest.approx(
        -10.0
    )
    # 1.0625 lies halfway between E4M3's 1.0 and 1.125: ties go to even
    tie = fake_quant(tf.constant([1.0625]), np.float32(448), format="fp8")
    assert float(tie[0]) == 1.0
    xla = tf.function(jit_compile=True)(
        lambda v: fake_quant(v, amax, format="fp8")
    )(tf.constant(x))
    np.testing.assert_array_equal(xla.numpy(), got)


def test_fp8_gradient_is_straight_through_inside_the_range():
    x = tf.constant([-20.0, -5.0, 0.3, 5.0, 20.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(fake_quant(x, 10.0, format="fp8"))
    grad = tape.gradient(y, x).numpy()
    np.testing.assert_array_equal(grad, [0, 1, 1, 1, 0])


def _cnn(channels=32):
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(channels, 3, activation="relu", name="stem")(inputs)
    x = keras.layers.Conv2D(channels, 3, activation="relu", name="body")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(32, activation="relu", name="fc")(x)
    return keras.Model(inputs, keras.layers.Dense(16, name="head")(x))


def _formats(qmodel):
    rows = keras_mp.quantization_report(qmodel, verbose=False)
    return {
        r["layer"]: (r.get("format"), r["note"]) for r in rows if r["quantized"]
    }


def test_precision_fp8_follows_tensorrt_conv_rules():
    formats = _formats(keras_mp.quantize_model(_cnn(), precision="fp8"))
    # a 3-channel first convolution has no FP8 kernel: INT8, said so
    assert formats["stem"][0] == "int8"
    assert "FP8 asked, INT8 here" in formats["stem"][1]
    assert {formats[n][0] for n in ("body", "fc", "head")} == {"fp8"}
    assert "INT8 here" not in formats["body"][1]


def test_precision_per_layer_mixes_int8_fp8_and_float():
    qmodel = keras_mp.quantize_model(
        _cnn(),
        config={
            "fc": keras_mp.QuantizeConfig(precision="fp8"),
            "head": keras_mp.QuantizeConfig(skip=True),
        },
    )
    formats = _formats(qmodel)
    assert formats["stem"][0] == formats["body"][0] == "int8"
    assert formats["fc"][0] == "fp8" and "head" not in formats


def test_fp8_conv_weights_are_per_tensor_gemm_weights_per_channel():
    qmodel = keras_mp.quantize_model(_cnn(), precision="fp8")
    body, fc = qmodel.get_layer("body"), qmodel.get_layer("fc")
    assert body.weight_quantizers[0].out_axes == ()
    assert fc.weight_quantizers[0].out_axes == (-1,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "fp16"}, "`precision` must be one of"),
        ({"precision": "fp8", "num_bits": 4}, "`num_bits` is for int"),
    ],
)
def test_bad_precision_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_mp.QuantizeConfig(**kwargs)


def test_fp8_survives_keras_round_trip_with_safe_mode(tmp_path):
    qmodel = keras_mp.quantize_model(_cnn(), precision="fp8")
    x = np.random.default_rng(1).random((16, 8, 8, 3)).astype("float32")
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "fp8.keras")
    qmodel.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    np.testing.assert_array_equal(loaded(x), qmodel(x))
    assert _formats(loaded) == _formats(qmodel)


def test_fp8_attention_softmax_output_keeps_its_fixed_scale():
    inputs = keras.Input((8, 32))
    out = keras.layers.MultiHeadAttention(2, 16, name="mha")(inputs, inputs)
    qmodel = keras_mp.quantize_model(keras.Model(inputs, out), precision="fp8")
    x = np.random.default_rng(2).normal(size=(8, 8, 32)).astype("float32")
    keras_mp.calibrate(qmodel, x, verbose=0)
    ranges = {
        k: float(q.amax.numpy())
        for k, q in activation_quantizers(qmodel).items()
    }
    probs = [k for k in ranges if k.endswith("/probs")]
    assert probs and all(ranges[k] == 1.0 for k in probs)
    assert ranges[probs[0].replace("probs", "query")] not in (0.0, 1.0)


def _block():
    inputs = keras.Input((8, 32))
    x = keras.layers.Dense(32, name="embed")(inputs)
    x = x + keras.layers.MultiHeadAttention(2, 16, name="mha")(x, x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(32, name="out")(x))


def test_fp8_qat_calibrates_and_fits_under_mirrored_strategy(mirrored_strategy):
    x = np.random.default_rng(3).normal(size=(32, 8, 32)).astype("float32")
    with mirrored_strategy.scope():
        qmodel = keras_mp.quantize_model(_block(), precision="fp8")
        qmodel.compile(keras.optimizers.SGD(1e-2), "mse")
    keras_mp.calibrate(qmodel, x, verbose=0)
    ranges = activation_quantizers(qmodel)
    before = {n: float(q.amax.numpy()) for n, q in ranges.items()}
    assert all(v > 0 for v in before.values())
    history = qmodel.fit(x, np.zeros((32, 32)), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert {n: float(q.amax.numpy()) for n, q in ranges.items()} == before
