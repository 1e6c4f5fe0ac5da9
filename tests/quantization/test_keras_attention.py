"""Keras' `GroupQueryAttention`, `Attention` and `AdditiveAttention`: the
inputs of every matmul of two activations behind Q/DQ in the INT8 export
(ONNX Runtime parity, lint), ranges kept by a `.keras` round trip, float
on request with `QuantizeConfig(attention=False)`, causal and padding
masks. No class of keras_mp knows them: the matmuls and
`dot_product_attention` calls of Keras' own code are quantized at their
op sites (`keras_mp/quantization/op_sites.py`)."""

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from keras_mp import _models
from keras_mp.onnx.graph import GraphIndex

L = keras.layers
VOCAB, STEPS, DIM = 20, 6, 8


def tokens(n=32, seed=0):
    """int32 ids with trailing padding (id 0) on every other row."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (n, STEPS)).astype("int32")
    ids[::2, STEPS - 2 :] = 0
    return ids


def _embedded():
    ids = keras.Input((STEPS,), dtype="int32", name="ids")
    return ids, L.Embedding(VOCAB, DIM, mask_zero=True, name="embed")(ids)


def _head(ids, x, name):
    x = L.GlobalAveragePooling1D()(x)
    return keras.Model(ids, L.Dense(4, name="head")(x), name=name)


def gqa_model():
    """Causal, padded self-attention with 4 query heads over 2 key/value
    heads."""
    ids, x = _embedded()
    x = L.GroupQueryAttention(4, 4, 2, name="attention")(
        x, x, use_causal_mask=True
    )
    return _head(ids, x, "gqa")


def luong_model():
    """Scaled dot-product attention of two projections, causal, padded."""
    ids, x = _embedded()
    query = L.Dense(DIM, name="query")(x)
    value = L.Dense(DIM, name="value")(x)
    x = L.Attention(use_scale=True, name="attention")(
        [query, value], use_causal_mask=True
    )
    return _head(ids, x, "luong")


def additive_model():
    """Additive attention over a distinct query, value and key, padded."""
    ids, x = _embedded()
    query, value, key = (L.Dense(DIM, name=n)(x) for n in ("q", "v", "k"))
    x = L.AdditiveAttention(name="attention")([query, value, key])
    return _head(ids, x, "additive")


# kind -> (builder, matmuls of two activations in the export)
KINDS = {
    "gqa": (gqa_model, 2),
    "luong": (luong_model, 2),
    "additive": (additive_model, 1),  # its scores: a tanh sum, no matmul
}


def _ranges(model):
    (layer,) = [x for x in _models.walk_layers(model) if x.name == "attention"]
    return {
        k: float(q.amax.numpy()) for k, q in layer.named_quantizers().items()
    }


@pytest.fixture(scope="module", params=list(KINDS))
def exported(request, tmp_path_factory):
    """Each model quantized, calibrated and exported INT8 (ONNX Runtime
    parity checked by the export)."""
    kind = request.param
    keras.utils.set_random_seed(0)
    model = KINDS[kind][0]()
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, tokens(), verbose=0)
    path = str(tmp_path_factory.mktemp(kind) / "model.onnx")
    parity = keras_mp.export_onnx(qmodel, path, verify_data=tokens(16, 1))
    return kind, model, qmodel, path, parity


def test_every_attention_matmul_is_behind_qdq(exported):
    kind, model, qmodel, path, parity = exported
    _, pairs = KINDS[kind]
    assert qmodel.get_layer("attention").op_sites
    ranges = _ranges(qmodel)
    # each matmul input (GQA's dot_product_attention: the scaled query,
    # key, value and softmax output)
    assert len(ranges) == 2 * pairs, ranges
    assert all(a > 0 for a in ranges.values()), ranges
    graph = GraphIndex(onnx.load(path))
    matmuls = [op for op in graph.weighted if op.op_type == "MatMul"]
    activations = [
        op for op in matmuls if graph.trace(op.input[1]).name is None
    ]
    assert len(activations) == pairs
    float_ops = [
        graph.name(op)
        for op in matmuls
        if graph.quantized_inputs(op) != [True, True]
    ]
    assert float_ops == []
    lint = keras_mp.check_tensorrt(path)
    assert lint.violations == [], str(lint)
    assert lint.weighted_ops == lint.weighted_ops_quantized
    if kind != "gqa":  # gqa: test_gqa_lint_has_no_warnings
        assert lint.warnings == [], str(lint)
    assert parity.rel_l2 < 1e-4, str(parity)
    # The Q/DQ change the outputs: the matmuls read quantized values.
    x = tokens(16, 1)
    assert not np.allclose(np.asarray(qmodel(x)), model(x), atol=1e-6)


# tf2onnx's QDQ optimizer moves the key's and value's Q above the head
# repeat (Q -> Unsqueeze -> Tile -> Reshape -> Transpose -> DQ -> MatMul):
# the lint follows the INT8 values to their DQ across Tile.
@pytest.mark.parametrize("exported", ["gqa"], indirect=True)
def test_gqa_lint_has_no_warnings(exported):
    _, _, _, path, _ = exported
    lint = keras_mp.check_tensorrt(path)
    assert lint.warnings == [], str(lint)


def test_round_trip_keeps_ranges_and_outputs(exported, tmp_path):
    _, _, qmodel, _, _ = exported
    path = tmp_path / "model.keras"
    qmodel.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert _ranges(loaded) == _ranges(qmodel)
    x = tokens(8, 2)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(qmodel(x)))


@pytest.mark.parametrize("kind", list(KINDS))
def test_attention_false_keeps_the_matmuls_float(kind):
    model = KINDS[kind][0]()
    model(tokens(2))
    qmodel = keras_mp.quantize_model(
        model, config=keras_mp.QuantizeConfig(attention=False)
    )
    rows = keras_mp.quantization_report(qmodel, verbose=False).rows
    (row,) = [r for r in rows if r["layer"] == "attention"]
    assert not row["quantized"]
    assert row["note"].startswith(
        "attention matmuls run in float: not selected, or "
        "QuantizeConfig(attention=False)"
    )
    # The projections (EinsumDense inside, Dense before) stay quantized.
    projections = [r for r in rows if r["type"] in ("EinsumDense", "Dense")]
    assert len(projections) >= 3 and all(r["quantized"] for r in projections)


def _flash_gqa(flash):
    ids, x = _embedded()
    x = L.GroupQueryAttention(4, 2, 1, flash_attention=flash, name="attention")(
        x, x
    )
    return _head(ids, x, "flash")


def test_flash_attention_layer_quantizes_on_the_einsum_path():
    """A GroupQueryAttention set to flash attention (which Keras' TF
    backend refuses to run) computes its quantized attention on the einsum
    path with the Q/DQ hooks, close to the same layer without flash."""
    keras.utils.set_random_seed(0)
    model, plain = _flash_gqa(True), _flash_gqa(None)
    plain.set_weights(model.get_weights())
    x = tokens(4, 1)
    with pytest.raises(ValueError, match="Flash attention is not supported"):
        model(x)
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, tokens(), verbose=0)
    assert all(a > 0 for a in _ranges(qmodel).values())
    got, want = np.asarray(qmodel(x)), np.asarray(plain(x))
    assert np.linalg.norm(got - want) < 0.05 * np.linalg.norm(want)


@keras.saving.register_keras_serializable(package="test_keras_attention")
class _DoubledScores(L.Attention):
    def _calculate_scores(self, query, key):
        return super()._calculate_scores(query, key) * 2.0


def test_subclass_with_its_own_attention_math_is_quantized_as_it_computes():
    # An override of Keras' attention math is followed, not replaced: the
    # op sites are the subclass's own calls.
    a, b = keras.Input((STEPS, DIM)), keras.Input((STEPS, DIM))
    x = _DoubledScores(name="attention")([a, b])
    model = keras.Model([a, b], L.Dense(4)(x))
    rng = np.random.default_rng(0)
    data = [rng.normal(size=(16, STEPS, DIM)).astype("float32")] * 2
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, data, verbose=0)
    assert len(_ranges(qmodel)) == 4
    got, want = np.asarray(qmodel(data)), np.asarray(model(data))
    assert 0 < np.linalg.norm(got - want) < 0.05 * np.linalg.norm(want)


@keras.saving.register_keras_serializable("keras_mp_tests")
class _TwoStream(L.MultiHeadAttention):
    """A MultiHeadAttention subclass called its own way (as XLNet's
    TwoStreamRelativeAttention): no `query`/`value` arguments."""

    def build(self, content_shape, stream_shape):
        super().build(stream_shape, content_shape)

    def call(self, content, stream):
        return super().call(stream, content)


def test_attention_subclass_with_its_own_call_is_quantized_at_its_ops():
    inputs = keras.Input((6, 8))
    x = _TwoStream(2, 4, name="two_stream")(inputs, inputs)
    model = keras.Model(inputs, L.Dense(3)(L.GlobalAveragePooling1D()(x)))
    x = np.random.default_rng(0).random((16, 6, 8), dtype=np.float32)
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)  # raised TypeError before
    rows = {r["path"]: r for r in keras_mp.quantization_report(qmodel).rows}
    # Its call does not fit the MultiHeadAttention twin: the attention ops
    # of its (inherited) code are quantized where they are called.
    assert rows["two_stream"]["quantized"]
    assert len(rows["two_stream"]["inputs"]) >= 2, rows["two_stream"]
    # its projections are EinsumDense rows of their own
    assert rows["two_stream/query"]["quantized"]
    np.testing.assert_allclose(qmodel(x), model(x), atol=0.05)
