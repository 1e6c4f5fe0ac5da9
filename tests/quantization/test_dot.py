"""`keras.layers.Dot`, a matmul of two activations, quantized at the
`ops.matmul` of Keras' code like any layer's own ops: both operands behind
Q/DQ (a DLRM's feature interactions, every MatMul of the export
quantized), float on request, quantized after the l2-normalization of
`normalize=True`, and the ranges kept by a `.keras` round trip."""

import keras
import numpy as np
import onnx
import pytest
import tensorflow as tf

import keras_mp
from keras_mp import _models
from keras_mp.datasets import load_digits
from keras_mp.onnx.graph import GraphIndex
from keras_mp.quantization import twins

L = keras.layers
# Two categorical fields: the raw 0-16 values of two pixels of sklearn's
# digits; the dense features: one row of pixels, in [0, 1].
FIELDS = {"pixel_a": (3, 3), "pixel_b": (5, 4)}
VOCAB = 17
DIM = 8


def features(n=128, offset=0):
    """A DLRM's inputs from real data: dense float features and int32 ids
    (sklearn's 8x8 digits)."""
    (x, _), _ = load_digits(normalize=False)
    x = x[offset : offset + n]
    inputs = {"dense": (x[:, 3] / 16.0).astype("float32")}
    for name, (row, col) in FIELDS.items():
        inputs[name] = x[:, row, col].astype("int32")
    return inputs


def dlrm(normalize=False):
    """A tiny DLRM: bottom MLP on the dense features, one embedding table
    per field, the pairwise `Dot` of the three vectors, top MLP."""
    dense = keras.Input((8,), name="dense")
    ids = {name: keras.Input((), dtype="int32", name=name) for name in FIELDS}
    x = L.Dense(16, activation="relu", name="bottom_0")(dense)
    bottom = L.Dense(DIM, activation="relu", name="bottom_1")(x)
    vectors = [bottom] + [
        L.Embedding(VOCAB, DIM, name=f"table_{name}")(ids[name])
        for name in FIELDS
    ]
    dots = [
        L.Dot(axes=1, normalize=normalize, name=f"dot_{i}{j}")(
            [vectors[i], vectors[j]]
        )
        for i in range(3)
        for j in range(i + 1, 3)
    ]
    x = L.Concatenate(name="interactions")([bottom, *dots])
    x = L.Dense(16, activation="relu", name="top_0")(x)
    x = L.Dense(8, activation="relu", name="top_1")(x)
    logit = L.Dense(1, name="logit")(x)
    return keras.Model({"dense": dense, **ids}, logit, name="dlrm")


def _dots(model):
    return [
        layer
        for layer in _models.walk_layers(model)
        if isinstance(layer, L.Dot)
    ]


def _ranges(model):
    return {
        d.name: [float(q.amax.numpy()) for q in d.op_quantizers]
        for d in _dots(model)
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The DLRM quantized, calibrated and exported INT8 (ONNX Runtime
    parity checked by the export)."""
    keras.utils.set_random_seed(0)
    model = dlrm()
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, features(), verbose=0)
    path = str(tmp_path_factory.mktemp("dot") / "dlrm.onnx")
    parity = keras_mp.export_onnx(
        qmodel, path, verify_data=features(64, offset=512)
    )
    return qmodel, path, parity


def test_dlrm_exports_every_matmul_behind_qdq(exported):
    qmodel, path, parity = exported
    graph = GraphIndex(onnx.load(path))
    matmuls = [op for op in graph.weighted if op.op_type in ("MatMul", "Gemm")]
    assert len(matmuls) == 8  # 5 Dense, 3 interactions
    unquantized = [
        graph.name(op)
        for op in matmuls
        if graph.quantized_inputs(op) != [True, True]
    ]
    assert unquantized == []
    lint = keras_mp.check_tensorrt(path)
    assert lint.violations == [] and lint.warnings == [], str(lint)
    assert parity.rel_l2 < 1e-4, str(parity)
    assert all(twins.is_quantized(d) for d in _dots(qmodel))
    assert all(len(r) == 2 for r in _ranges(qmodel).values())  # 2 operands
    assert all(0 < a for r in _ranges(qmodel).values() for a in r)


def test_quantized_dlrm_round_trips_and_trains(exported, tmp_path):
    qmodel, _, _ = exported
    data = features(32, offset=256)
    path = tmp_path / "dlrm.keras"
    qmodel.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert _ranges(loaded) == _ranges(qmodel)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(data)),
        keras.ops.convert_to_numpy(qmodel(data)),
    )
    # QAT: the embedding tables learn through the interactions' Q/DQ
    # (straight-through), and the calibrated ranges stay.
    tables = [w for w in loaded.trainable_weights if "embeddings" in w.path]
    with tf.GradientTape() as tape:
        loss = keras.ops.sum(loaded(data, training=True) ** 2)
    grads = tape.gradient(loss, tables)
    assert len(tables) == 2
    assert all(float(tf.reduce_max(tf.abs(g))) > 0 for g in grads)
    assert _ranges(loaded) == _ranges(qmodel)


def test_dot_false_keeps_the_interactions_float():
    model = dlrm()
    qmodel = keras_mp.quantize_model(
        model, config=keras_mp.QuantizeConfig(dot=False)
    )
    rows = keras_mp.quantization_report(qmodel, verbose=False).rows
    by_type = {}
    for row in rows:
        by_type.setdefault(row["type"], set()).add(row["quantized"])
    assert by_type["Dense"] == {True}
    assert by_type["Dot"] == {False}
    notes = {r["note"] for r in rows if r["type"] == "Dot"}
    assert notes == {
        "matmul of two activations runs in float: not selected, or "
        "QuantizeConfig(dot=False)"
    }


def test_normalized_dot_quantizes_after_the_normalization():
    a, b = keras.Input((DIM,)), keras.Input((DIM,))
    model = keras.Model([a, b], L.Dot(axes=-1, normalize=True)([a, b]))
    rng = np.random.default_rng(0)
    x = [rng.normal(0, 3, (64, DIM)).astype("float32") for _ in range(2)]
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    (twin,) = _dots(qmodel)
    # The ranges are those of the unit vectors the matmul reads.
    amax = [float(q.amax.numpy()) for q in twin.op_quantizers]
    assert len(amax) == 2 and all(0.5 < a <= 1.0 for a in amax)
    unit = [keras.utils.normalize(v, axis=-1) for v in x]
    quantized = [q(u) for q, u in zip(twin.op_quantizers, unit)]
    want = np.sum(np.multiply(*map(np.asarray, quantized)), -1, keepdims=True)
    got = keras.ops.convert_to_numpy(qmodel(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    float_out = keras.ops.convert_to_numpy(model(x))
    assert np.abs(got - float_out).max() > 0
    keras_mp.set_quantization_enabled(qmodel, False)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(qmodel(x)), float_out
    )
