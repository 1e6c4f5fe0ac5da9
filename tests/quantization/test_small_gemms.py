"""TensorRT's small-GEMM rule: a Dense/EinsumDense with K or N below 16 gets
no Q/DQ (INT8 and FP8), the report says why, the lint does not count it,
`QuantizeConfig(small_gemms=True)` quantizes it anyway."""

import keras
import numpy as np
import pytest

import keras_mp

pytestmark = pytest.mark.gemm_rule


def _mlp():
    inputs = keras.Input((32,))
    x = keras.layers.Dense(64, activation="relu", name="fc")(inputs)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x))


@pytest.mark.parametrize("precision", ["int8", "float8"])
def test_a_10_class_head_stays_float_with_a_reason(precision):
    qmodel = keras_mp.quantize_model(_mlp(), precision=precision)
    rows = {
        r["layer"]: r
        for r in keras_mp.quantization_report(qmodel, verbose=False).rows
    }
    assert rows["fc"]["quantized"] and rows["fc"]["format"] == precision
    assert not rows["head"]["quantized"]
    assert "K=64, N=10" in rows["head"]["note"]


def test_small_gemms_true_quantizes_them_anyway():
    config = keras_mp.QuantizeConfig(small_gemms=True)
    qmodel = keras_mp.quantize_model(_mlp(), config=config)
    rows = keras_mp.quantization_report(qmodel, verbose=False).rows
    assert [r["layer"] for r in rows if r["quantized"]] == ["fc", "head"]


def test_lint_does_not_count_a_small_gemm_as_lost_speed(tmp_path):
    qmodel = keras_mp.quantize_model(_mlp())
    x = np.random.default_rng(0).normal(size=(64, 32)).astype("float32")
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "mlp.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=x)
    report = keras_mp.check_tensorrt(path)
    assert report.ok
    assert not [f for f in report.warnings if f.rule == "float_weighted_ops"]


def test_a_model_of_small_gemms_only_is_a_clear_error():
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(4, name="tiny")(inputs))
    with pytest.raises(
        ValueError, match=r"K or N below 16 stay float \(tiny\)"
    ):
        keras_mp.quantize_model(model)
