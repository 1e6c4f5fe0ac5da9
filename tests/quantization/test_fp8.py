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
from keras_mp.quantization.fake_quant import fake_quant

FP8 = FORMATS["float8"]


def test_fp8_rounding_is_e4m3_bit_for_bit_and_saturates():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.normal(0, 3, 4000), [1.0625, -1.0625, 500.0, -1e6, 2e-3, 0.0]]
    ).astype(np.float32)
    amax = np.float32(10.0)
    got = fake_quant(tf.constant(x), amax, format="float8").numpy()
    scale = amax / np.float32(448)
    want = (
        np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    ).astype(np.float32) * scale
    np.testing.assert_array_equal(got, want)
    assert got.max() == pytest.approx(10.0) and got.min() == pytest.approx(
        -10.0
    )
    # 1.0625 lies halfway between E4M3's 1.0 and 1.125: ties go to even
    tie = fake_quant(tf.constant([1.0625]), np.float32(448), format="float8")
    assert float(tie[0]) == 1.0
    xla = tf.function(jit_compile=True)(
        lambda v: fake_quant(v, amax, format="float8")
    )(tf.constant(x))
    np.testing.assert_array_equal(xla.numpy(), got)


FLOAT_FORMATS = [row for row in FORMATS.values() if row.kind == "float"]


def _onnx_qdq(fmt, x, scale, axis):
    """`x` through ONNX's QuantizeLinear (saturate=1) and DequantizeLinear
    to `fmt`'s type, by ONNX's reference evaluator and by ONNX Runtime."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    zero = np.zeros(np.shape(scale), fmt.storage)
    nodes = [
        helper.make_node(
            "QuantizeLinear", ["x", "s", "z"], ["q"], axis=axis, saturate=1
        ),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=axis),
    ]
    value = lambda n: helper.make_tensor_value_info(  # noqa: E731
        n, TensorProto.FLOAT, x.shape
    )
    graph = helper.make_graph(
        nodes,
        "qdq",
        [value("x")],
        [value("y")],
        [
            numpy_helper.from_array(scale, "s"),
            numpy_helper.from_array(zero, "z"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", fmt.min_opset)]
    )
    session = ort.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return [
        session.run(None, {"x": x})[0],
        ReferenceEvaluator(model).run(None, {"x": x})[0],
    ]


def _sweep(fmt):
    """Values in units of the scale: every finite code, the ties between
    neighbours and a float32 step either side of them, values beyond the
    largest code, +-inf, NaN, +-0 and float32 subnormals."""
    uint = f"uint{8 * np.dtype(fmt.storage).itemsize}"
    codes = np.arange(2**fmt.bits).astype(uint).view(fmt.storage)
    grid = np.unique(codes.astype(np.float32))
    grid = grid[np.isfinite(grid)]
    ties = (grid[1:] + grid[:-1]) / 2
    up = np.nextafter(ties, np.float32(np.inf))
    down = np.nextafter(ties, np.float32(-np.inf))
    edges = np.float32(fmt.qmax) * np.float32([1.03, 1.07, 1.5, 1e6])
    special = [np.inf, np.nan, 0.0, 1e-45, 1e-39]
    x = np.concatenate([grid, ties, up, down, edges, np.float32(special)])
    return np.concatenate([x, -x]).astype(np.float32)


def _ranges(fmt):
    """Ranges whose float32 scale `amax / qmax` differs from `amax * (1 /
    qmax)` (what Grappler and XLA made of the division), and two exact
    ones: scale 1 (ties exact) and a power of two."""
    amax = np.random.default_rng(0).uniform(1e-3, 1e3, 64).astype(np.float32)
    product = amax * np.float32(1 / np.float64(fmt.qmax))
    rewritten = amax[product != fmt.scale(amax)][:4]
    assert len(rewritten) == 4
    exact = np.float32(fmt.qmax) * np.float32([1.0, 2.0**-12])
    return np.concatenate([exact, rewritten])


def _same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    uint = f"uint{8 * got.dtype.itemsize}"
    np.testing.assert_array_equal(got[~nan].view(uint), want[~nan].view(uint))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=lambda f: f.name)
def test_float_rounding_is_onnx_bit_for_bit_eager_traced_and_under_xla(
    fmt, dtype
):
    """Grappler's constant folding and XLA turned `amax / qmax` into a
    product by the reciprocal, a scale often one float32 step off the one
    the export writes: a traced model took the other code at near ties."""
    amax = _ranges(fmt)
    sweep = _sweep(fmt)
    # one column per range, quantized per channel; the last one per tensor
    x = (sweep[:, None] * fmt.scale(amax)).astype(np.float32)
    x = tf.cast(x, dtype).numpy()
    wide = x.astype(np.float32)
    per_channel = _onnx_qdq(fmt, wide, fmt.scale(amax), axis=1)
    per_tensor = _onnx_qdq(fmt, wide[:, -1], fmt.scale(amax[-1]), axis=0)
    channels, scalar = tf.Variable(amax), tf.Variable(amax[-1])

    def both(v):
        return (
            fake_quant(v, channels, axis=1, format=fmt),
            fake_quant(v[:, -1], scalar, format=fmt),
        )

    runs = {
        "eager": both(tf.constant(x)),
        "tf.function": tf.function(both)(tf.constant(x)),
        "xla": tf.function(both, jit_compile=True)(tf.constant(x)),
    }
    for got_channels, got_tensor in runs.values():
        for want in per_channel:
            _same_bits(got_channels.numpy(), want.astype(x.dtype))
        for want in per_tensor:
            _same_bits(got_tensor.numpy(), want.astype(x.dtype))


def test_fp8_gradient_is_straight_through_inside_the_range():
    x = tf.constant([-20.0, -5.0, 0.3, 5.0, 20.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(fake_quant(x, 10.0, format="float8"))
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
    rows = keras_mp.quantization_report(qmodel, verbose=False).rows
    return {
        r["layer"]: (r.get("format"), r["note"]) for r in rows if r["quantized"]
    }


def test_precision_fp8_follows_tensorrt_conv_rules():
    formats = _formats(keras_mp.quantize_model(_cnn(), precision="float8"))
    # a 3-channel first convolution has no FP8 kernel: INT8, said so
    assert formats["stem"][0] == "int8"
    assert "FP8 asked, INT8 here" in formats["stem"][1]
    assert {formats[n][0] for n in ("body", "fc", "head")} == {"float8"}
    assert "INT8 here" not in formats["body"][1]


def test_precision_per_layer_mixes_int8_fp8_and_float():
    qmodel = keras_mp.quantize_model(
        _cnn(),
        config={
            "fc": keras_mp.QuantizeConfig(precision="float8"),
            "head": keras_mp.QuantizeConfig(skip=True),
        },
    )
    formats = _formats(qmodel)
    assert formats["stem"][0] == formats["body"][0] == "int8"
    assert formats["fc"][0] == "float8" and "head" not in formats


def test_fp8_conv_weights_are_per_tensor_gemm_weights_per_channel():
    qmodel = keras_mp.quantize_model(_cnn(), precision="float8")
    body, fc = qmodel.get_layer("body"), qmodel.get_layer("fc")
    assert body.weight_quantizers[0].out_axes == ()
    assert fc.weight_quantizers[0].out_axes == (-1,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "fp16"}, "`precision` must be one of"),
        ({"precision": "float8", "num_bits": 4}, "name different formats"),
    ],
)
def test_bad_precision_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_mp.QuantizeConfig(**kwargs)


def test_fp8_survives_keras_round_trip_with_safe_mode(tmp_path):
    qmodel = keras_mp.quantize_model(_cnn(), precision="float8")
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
    qmodel = keras_mp.quantize_model(
        keras.Model(inputs, out), precision="float8"
    )
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
        qmodel = keras_mp.quantize_model(_block(), precision="float8")
        qmodel.compile(keras.optimizers.SGD(1e-2), "mse")
    keras_mp.calibrate(qmodel, x, verbose=0)
    ranges = activation_quantizers(qmodel)
    before = {n: float(q.amax.numpy()) for n, q in ranges.items()}
    assert all(v > 0 for v in before.values())
    history = qmodel.fit(x, np.zeros((32, 32)), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert {n: float(q.amax.numpy()) for n, q in ranges.items()} == before
