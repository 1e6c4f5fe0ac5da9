"""Files saved by the last release with hand-written MultiHeadAttention and
`Dot` twins (`fixtures/legacy_twins.keras`, written by
`fixtures/make_legacy_twins.py` with the code of f3937cf): they load with
their ranges onto the load-only twins of `quantization/legacy_twins.py`,
compute what they computed, and save and load again as they are. New
quantization reaches both layers at their op sites instead."""

import os

import keras
import numpy as np

import keras_mp
from keras_mp import _models
from keras_mp.quantization import legacy_twins, twins
from tests.tolerance import assert_computes_like

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _load():
    path = os.path.join(FIXTURES, "legacy_twins.keras")
    saved = np.load(os.path.join(FIXTURES, "legacy_twins.npz"))
    model = keras.saving.load_model(path, safe_mode=True)
    return model, [saved["a"], saved["b"]], saved["out"]


def _by_name(model):
    return {
        layer.name: layer
        for layer in _models.walk_layers(model)
        if twins.is_quantized(layer)
    }


def test_an_old_file_loads_onto_the_legacy_twins(tmp_path):
    model, x, want = _load()
    layers = _by_name(model)
    assert isinstance(layers["self_mha"], legacy_twins.QuantizedAttention)
    assert isinstance(layers["cross_mha"], legacy_twins.QuantizedAttention)
    assert isinstance(layers["dot"], legacy_twins.QuantizedDot)
    # self-attention: one input Q/DQ; cross-attention: query and value
    assert layers["self_mha"].input_names == ["query"]
    assert layers["cross_mha"].input_names == ["query", "value"]
    ranges = [
        float(q.amax.numpy())
        for name in ("self_mha", "cross_mha", "dot")
        for q in layers[name].named_quantizers().values()
    ]
    assert len(ranges) == 5 + 6 + 2 and all(r > 0 for r in ranges)
    got = keras.ops.convert_to_numpy(model(x))
    assert_computes_like(got, want, "float32", quantized=True)
    # saved again by this release, it is the same model
    path = tmp_path / "again.keras"
    model.save(path)
    again = keras.saving.load_model(path, safe_mode=True)
    assert isinstance(
        _by_name(again)["self_mha"], legacy_twins.QuantizedAttention
    )
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(again(x)), got)


def test_new_quantization_of_the_same_model_uses_op_sites():
    model, x, _ = _load()
    float_model = keras_mp.strip_quantization(model)
    layers = _by_name(keras_mp.quantize_model(float_model))
    for name in ("self_mha", "cross_mha", "dot"):
        assert not isinstance(
            layers[name],
            (legacy_twins.QuantizedAttention, legacy_twins.QuantizedDot),
        )
        assert layers[name].op_sites
