"""keras-rs ranking models through the whole pipeline (issue #34 item 8,
issue #33's goal for `DotInteraction` and `FeatureCross`): a DCN of
`FeatureCross` layers (each makes an unnamed `Dense` in `build`) and a
DLRM whose `DotInteraction` does its matmul in its own code, on
scikit-learn's breast-cancer data (one sigmoid output): quantized,
calibrated, exported with ONNX Runtime parity, lint clean, every GEMM
the small-GEMM rule leaves behind Q/DQ, `.keras` exact with
`safe_mode=True`, and `auto_quantize` keyed by the model's own paths."""

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from keras_mp import _models
from keras_mp.onnx.graph import GraphIndex

keras_rs = pytest.importorskip("keras_rs")  # installed by the test extra


def _data():
    from sklearn.datasets import load_breast_cancer

    found = load_breast_cancer()
    x = found.data.astype("float32")
    x = (x - x.mean(0)) / x.std(0)
    return x[:256], found.target[:256].astype("float32")


def _dcn():
    inputs = keras.Input((30,))
    x0 = keras.layers.Dense(32, activation="relu", name="embed")(inputs)
    x = keras_rs.layers.FeatureCross(name="cross1")(x0)
    x = keras_rs.layers.FeatureCross(name="cross2")(x0, x)
    x = keras.layers.Dense(32, activation="relu", name="deep")(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="head")(x)
    return keras.Model(inputs, out)


def _dlrm():
    inputs = keras.Input((30,))
    towers = [
        keras.layers.Dense(32, activation="relu", name=f"tower{i}")(inputs)
        for i in range(3)
    ]
    pairs = keras_rs.layers.DotInteraction(name="interact")(towers)
    x = keras.layers.Concatenate()([pairs, towers[0]])
    x = keras.layers.Dense(32, activation="relu", name="top")(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="head")(x)
    return keras.Model(inputs, out)


@pytest.mark.gemm_rule  # as users get it
@pytest.mark.parametrize("make", [_dcn, _dlrm], ids=["dcn", "dlrm"])
def test_keras_rs_model_end_to_end(make, tmp_path):
    keras.utils.set_random_seed(0)
    x, y = _data()
    model = make()
    model.compile("adam", "binary_crossentropy")
    model.fit(x, y, epochs=3, batch_size=32, verbose=0)
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "m.onnx")
    parity = keras_mp.export_onnx(qmodel, path, verify_data=x)
    assert parity.rel_l2 < 1e-3, str(parity)
    lint = keras_mp.check_tensorrt(path)
    assert lint.ok, lint.to_markdown()
    graph = GraphIndex(onnx.load(path))
    gemms = [op for op in graph.weighted if op.op_type in ("MatMul", "Gemm")]
    float_gemms = [
        graph.name(op) for op in gemms if not all(graph.quantized_inputs(op))
    ]
    # only the one-unit head (N = 1) is left float, by the small-GEMM rule
    assert len(float_gemms) == 1 and "head" in float_gemms[0], float_gemms
    keras_path = tmp_path / "m.keras"
    qmodel.save(keras_path)
    loaded = keras.saving.load_model(keras_path, safe_mode=True)
    np.testing.assert_array_equal(
        np.asarray(loaded(x[:32])), np.asarray(qmodel(x[:32]))
    )


@pytest.mark.gemm_rule
def test_auto_quantize_on_feature_cross_uses_the_models_paths():
    keras.utils.set_random_seed(0)
    x, y = _data()
    model = _dcn()
    model.compile("adam", "binary_crossentropy")
    model.fit(x, y, epochs=3, batch_size=32, verbose=0)
    _, report = keras_mp.auto_quantize(
        model,
        x,
        y,
        max_drop=1.0,
        num_batches=1,
        calibration_batches=2,
        verbose=0,
    )
    ours = {_models.layer_path(layer, p) for layer, p in _models.walk(model)}
    chosen = {c.name: c.precision for c in report.choices}
    assert set(chosen) <= ours, set(chosen) - ours
    crosses = [n for n in chosen if n.startswith(("cross1/", "cross2/"))]
    assert len(crosses) == 2 and all(chosen[n] != "float16" for n in crosses)
    assert report.metric_name.startswith("accuracy at threshold 0.5")
