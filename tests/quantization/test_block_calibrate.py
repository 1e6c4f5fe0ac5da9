"""`calibrate(method="gptq")`: GPTQ on a model's INT4 weights."""

import keras
import numpy as np
import pytest

import keras_mp


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 128))
    h = keras.layers.Dense(128, activation="gelu", name="fc1")(inputs)
    h = keras.layers.EinsumDense("btk,kn->btn", (8, 128), name="ein")(h)
    return keras.Model(inputs, keras.layers.Dense(64, name="fc2")(h))


def _data(n, seed):
    rng = np.random.default_rng(seed)
    # correlated inputs with a few loud channels, as in language models
    x = rng.normal(size=(n, 8, 128)) * np.linspace(0.2, 3.0, 128)
    return x.astype("float32")


def _error(qmodel, model, x):
    ref = np.asarray(model(x))
    return np.linalg.norm(np.asarray(qmodel(x)) - ref) / np.linalg.norm(ref)


def test_gptq_lowers_the_output_error_on_held_out_data():
    model = _model()
    config = keras_mp.QuantizeConfig(precision="int4", block_size=64)
    qmodel = keras_mp.quantize_model(model, config=config)
    held_out = _data(32, seed=1)
    before = _error(qmodel, model, held_out)
    report = keras_mp.calibrate(qmodel, _data(64, seed=0), method="gptq")
    assert report.method == "gptq"
    assert set(report.weight_errors) == {
        "fc1/kernel",
        "ein/kernel",
        "fc2/kernel",
    }
    assert all(a < b for b, a in report.weight_errors.values())
    assert _error(qmodel, model, held_out) < 0.8 * before
    # the rounded kernel is on the grid its quantizer keeps
    fc1 = qmodel.get_layer("fc1")
    kernel = np.asarray(fc1.kernel)
    np.testing.assert_allclose(
        np.asarray(fc1.weight_quantizers[0](kernel)), kernel, rtol=1e-6
    )


def test_gptq_ranges_reach_the_onnx_file(tmp_path):
    pytest.importorskip("tf2onnx")
    pytest.importorskip("onnxruntime")
    qmodel = keras_mp.quantize_model(
        _model(),
        config=keras_mp.QuantizeConfig(precision="int4", block_size=64),
    )
    keras_mp.calibrate(qmodel, _data(16, seed=0), method="gptq", verbose=0)
    with pytest.warns(UserWarning, match="opset 21"):
        report = keras_mp.export_onnx(
            qmodel, tmp_path / "gptq.onnx", verify_data=_data(8, seed=2)
        )
    assert report.rel_l2 < 1e-5


def test_gptq_needs_int4_weights():
    qmodel = keras_mp.quantize_model(_model())
    with pytest.raises(
        ValueError,
        match="no block-scaled weight for GPTQ.*Nothing was calibrated",
    ):
        keras_mp.calibrate(qmodel, _data(8, seed=0), method="gptq", verbose=0)


def _outlier_data(n, seed):
    """Inputs with four loud channels (20x the loudest other), AWQ's
    case: their weights' rounding error dominates the output error."""
    x = _data(n, seed)
    x[..., :4] *= 300.0
    return x


def _awq_model():
    model = _model()
    config = keras_mp.QuantizeConfig(precision="int4", block_size=64)
    qmodel = keras_mp.quantize_model(model, config=config)
    return model, qmodel


def test_awq_lowers_the_output_error_on_held_out_data_keeping_the_function():
    model, qmodel = _awq_model()
    held_out = _outlier_data(32, seed=1)
    before = _error(qmodel, model, held_out)
    report = keras_mp.calibrate(
        qmodel, _outlier_data(64, seed=0), method="awq", verbose=0
    )
    assert report.method == "awq"
    assert set(report.weight_errors) == {
        "fc1/kernel",
        "ein/kernel",
        "fc2/kernel",
    }
    assert all(a <= b for b, a in report.weight_errors.values())
    after, fc1 = report.weight_errors["fc1/kernel"]
    assert fc1 < 0.8 * after  # the layer that sees the loud channels
    # 0.134 -> 0.116: the later layers' errors are AWQ's too, smaller
    assert _error(qmodel, model, held_out) < 0.9 * before
    # kernel s * W, input pre-scale 1 / s: the float function is kept
    layer = qmodel.get_layer("fc1")
    s = 1.0 / np.asarray(layer.pre_quant_scale.scale)
    np.testing.assert_allclose(
        np.asarray(layer.kernel),
        s[:, None] * np.asarray(model.get_layer("fc1").kernel),
        rtol=1e-5,
    )
    assert s[:4].min() > s[4:].max()  # the loud channels scaled up
    keras_mp.set_quantization_enabled(qmodel, False)
    np.testing.assert_allclose(
        np.asarray(qmodel(held_out)), np.asarray(model(held_out)), atol=1e-4
    )
    float_model = keras_mp.strip_quantization(qmodel)
    np.testing.assert_allclose(
        np.asarray(float_model(held_out)),
        np.asarray(model(held_out)),
        atol=1e-4,
    )


def test_awq_pre_scale_saves_and_loads_exactly(tmp_path):
    _, qmodel = _awq_model()
    keras_mp.calibrate(
        qmodel, _outlier_data(32, seed=0), method="awq", verbose=0
    )
    x = _outlier_data(8, seed=3)
    qmodel.save(tmp_path / "awq.keras")
    loaded = keras.saving.load_model(tmp_path / "awq.keras", safe_mode=True)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(qmodel(x)))
    np.testing.assert_array_equal(
        np.asarray(loaded.get_layer("fc1").pre_quant_scale.scale),
        np.asarray(qmodel.get_layer("fc1").pre_quant_scale.scale),
    )


@pytest.mark.parametrize("precision", ["int4", "nvfp4"])
def test_awq_exports_a_mul_before_the_matmul_matching_keras(
    precision, tmp_path
):
    pytest.importorskip("tf2onnx")
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from keras_mp.onnx.graph import GraphIndex

    model = _model()
    # weight-only: a float32 graph (NVFP4 inputs need a 16-bit one)
    config = keras_mp.QuantizeConfig(precision=precision, weights_only=True)
    qmodel = keras_mp.quantize_model(model, config=config)
    keras_mp.calibrate(
        qmodel, _outlier_data(16, seed=0), method="awq", verbose=0
    )
    with pytest.warns(UserWarning, match="opset"):
        report = keras_mp.export_onnx(
            qmodel, tmp_path / "awq.onnx", verify_data=_outlier_data(8, seed=2)
        )
    assert report.rel_l2 < 1e-5
    proto = onnx.load(tmp_path / "awq.onnx")
    index = GraphIndex(proto)
    matmuls = [n for n in index.nodes if n.op_type == "MatMul"]
    producers = {o: n for n in index.nodes for o in n.output}
    first = producers[matmuls[0].input[0]]
    while first.op_type == "Reshape":  # a 3-D input, flattened
        first = producers[first.input[0]]
    # the pre-scale: a Mul by a constant (ModelOpt's pre_quant_scale)
    assert first.op_type == "Mul"
    assert any(i in index.constants for i in first.input)
    assert keras_mp.check_tensorrt(proto).ok


def test_mse_searches_int4_block_ranges_and_they_reach_the_onnx_file(
    tmp_path,
):
    pytest.importorskip("tf2onnx")
    pytest.importorskip("onnxruntime")
    model, qmodel = _awq_model()
    fc1 = qmodel.get_layer("fc1").weight_quantizers[0]
    top = np.asarray(fc1.amax).copy()
    report = keras_mp.calibrate(qmodel, _data(8, seed=0), method="mse")
    assert report.method == "mse" and report.batches == 0
    assert set(report.weight_errors) == {
        "fc1/kernel",
        "ein/kernel",
        "fc2/kernel",
    }
    assert all(a < b for b, a in report.weight_errors.values())
    ranges = np.asarray(fc1.amax)
    assert np.all(ranges <= top * (1 + 1e-6)) and np.any(ranges < 0.99 * top)
    with pytest.warns(UserWarning, match="opset 21"):
        parity = keras_mp.export_onnx(
            qmodel, tmp_path / "mse.onnx", verify_data=_data(8, seed=2)
        )
    assert parity.rel_l2 < 1e-5


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_layer_inside_time_distributed_is_observed(method):
    # TimeDistributed calls its layer's `call`, not `__call__`: the inputs
    # are observed there (before: "the calibration data never reached")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 128))
    h = keras.layers.TimeDistributed(
        keras.layers.Dense(128, name="inner"), name="td"
    )(inputs)
    model = keras.Model(inputs, keras.layers.Dense(32, name="head")(h))
    qmodel = keras_mp.quantize_model(model, precision="int4")
    x = np.random.default_rng(0).normal(size=(8, 5, 128)).astype("f4")
    report = keras_mp.calibrate(qmodel, x, method=method, verbose=0)
    before, after = report.weight_errors["td/inner/kernel"]
    assert after <= before


def test_gptq_on_a_model_whose_int4_layers_all_took_int8_says_why():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(32, 3, name="conv")(inputs)
    model = keras.Model(inputs, h)
    qmodel = keras_mp.quantize_model(model, precision="int4")
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype("f4")
    with pytest.raises(ValueError, match="all took INT8 or FP8.*method='max'"):
        keras_mp.calibrate(qmodel, x, method="gptq", verbose=0)
