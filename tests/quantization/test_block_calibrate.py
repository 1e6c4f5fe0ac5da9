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
