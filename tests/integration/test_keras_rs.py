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
    """Breast-cancer features standardized, and for the DLRM three of them
    bucketed into quartiles (its categorical features)."""
    from sklearn.datasets import load_breast_cancer

    found = load_breast_cancer()
    x = found.data.astype("float32")
    x = (x - x.mean(0)) / x.std(0)
    order = np.random.default_rng(0).permutation(len(x))[:256]
    x, y = x[order], found.target[order].astype("float32")
    buckets = [
        np.digitize(x[:, c], np.quantile(x[:, c], [0.25, 0.5, 0.75]))
        for c in (0, 7, 20)
    ]
    return x, np.stack(buckets, 1).astype("int32"), y


def _dcn():
    """DCN-v2: a stack of two crosses (the second low-rank: two Dense
    layers made in `build`), a deep layer, a sigmoid head."""
    inputs = keras.Input((30,), name="dense")
    x0 = keras.layers.Dense(32, activation="relu", name="embed")(inputs)
    x = keras_rs.layers.FeatureCross(name="cross1")(x0)
    x = keras_rs.layers.FeatureCross(projection_dim=16, name="cross2")(x0, x)
    x = keras.layers.Dense(32, activation="relu", name="deep")(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="head")(x)
    return keras.Model(inputs, out)


def _dlrm():
    """DLRM: a bottom MLP on the dense features, one embedding per
    categorical feature, their pairwise dot products, a top MLP."""
    dense = keras.Input((30,), name="dense")
    categorical = keras.Input((3,), dtype="int32", name="categorical")
    bottom = keras.layers.Dense(32, activation="relu", name="bottom0")(dense)
    bottom = keras.layers.Dense(16, activation="relu", name="bottom1")(bottom)
    embedded = [
        keras.layers.Embedding(4, 16, name=f"embedding{i}")(categorical[:, i])
        for i in range(3)
    ]
    pairs = keras_rs.layers.DotInteraction(name="interaction")(
        [bottom, *embedded]
    )
    x = keras.layers.Concatenate()([pairs, bottom])
    x = keras.layers.Dense(32, activation="relu", name="top0")(x)
    x = keras.layers.Dense(16, activation="relu", name="top1")(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="head")(x)
    return keras.Model({"dense": dense, "categorical": categorical}, out)


MODELS = {"dcn": _dcn, "dlrm": _dlrm}


@pytest.fixture(scope="module", params=list(MODELS))
def trained(request):
    keras.utils.set_random_seed(0)
    x, categorical, y = _data()
    model = MODELS[request.param]()
    if request.param == "dlrm":
        x = {"dense": x, "categorical": categorical}
    model.compile("adam", "binary_crossentropy")
    model.fit(x, y, epochs=3, batch_size=32, verbose=0)
    return request.param, model, x, y


@pytest.mark.gemm_rule  # as users get it
def test_quantize_calibrate_export_and_reload(trained, tmp_path):
    _, model, x, _ = trained
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
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(qmodel(x)))


@pytest.mark.gemm_rule
def test_search_rows_and_choices_are_the_models_paths(trained):
    name, model, x, y = trained
    kwargs = dict(num_batches=1, calibration_batches=2, verbose=0)
    report = keras_mp.layer_sensitivity(model, x, y.astype("int32"), **kwargs)
    ours = {_models.layer_path(layer, p) for layer, p in _models.walk(model)}
    rows = {row.name for row in report.rows}
    assert rows <= ours, rows - ours
    _, searched = keras_mp.auto_quantize(
        model, x, y.astype("int32"), max_drop=1.0, **kwargs
    )
    chosen = {c.name: c.precision for c in searched.choices}
    assert set(chosen) == rows
    # the Dense layers FeatureCross makes in `build` (named by Keras'
    # counter), or the DotInteraction matmul (an op site)
    inner = (
        {n for n in ours if n.startswith(("cross1/", "cross2/"))}
        if name == "dcn"
        else {"interaction"}
    )
    assert len(inner) == (3 if name == "dcn" else 1)
    assert inner <= rows
    assert all(chosen[n] != "float16" for n in inner), chosen
    assert searched.metric_name.startswith("accuracy at threshold 0.5")
