"""MuPPET on the op-level mechanism of quantization: the matmuls a layer
writes in its own code (a hand-written attention, `keras.layers.Dot`) run
their activation operands in fixed point, found by the one probe
(`quantization/op_probe.py`) and applied by `op_sites.CallScope`, as
quantization's Q/DQ are; the sites are in the record, so a `.keras` file
loads with them."""

import keras
import numpy as np

import keras_mp
from benchmarks.op_site_models import HandAttention
from keras_mp import _models
from keras_mp.muppet import twins
from keras_mp.muppet.model import set_word_length

L = keras.layers


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    x = HandAttention(16, name="attention")(inputs)
    d = L.Dot(axes=2, name="dot")([x, inputs])  # (B, 8, 8)
    out = L.Dense(4, name="head")(L.Flatten()(d))
    return keras.Model(inputs, out)


def _x(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8, 16)).astype("float32")


def _layers(model):
    return {
        layer.name: layer
        for layer in _models.walk_layers(model)
        if twins.is_fixed_point(layer)
    }


def test_own_matmuls_run_in_fixed_point(tmp_path):
    model = _model()
    x = _x()
    fp = keras_mp.fixed_point_model(model, seed=1)
    layers = _layers(fp)
    # the attention's 6 matmuls (q, k, v, scores, probs @ v, output),
    # each with an activation operand; the Dot, without weights, joins
    # for its matmul of two activations
    attention, dot = layers["attention"], layers["dot"]
    assert len(attention.op_sites) == 6
    assert sum(bool(q) for q in attention.op_quantizers_by_site.values()) == 6
    assert len(dot.op_sites) == 1 and not dot.fixed_point.weight_shapes
    # word length 0: the float model's outputs, bit for bit
    want = keras.ops.convert_to_numpy(model(x))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(fp(x)), want)
    # 6 bits: the activations inside the layers are fixed point too
    set_word_length(fp, 6)
    got = keras.ops.convert_to_numpy(fp(x))
    for layer in (attention, dot):
        object.__setattr__(layer, "saved_sites", layer.op_sites)
        object.__setattr__(layer, "op_sites", [])  # no op sites
    without = keras.ops.convert_to_numpy(fp(x))
    for layer in (attention, dot):
        object.__setattr__(layer, "op_sites", layer.saved_sites)
    assert np.abs(got - without).max() > 0
    assert 0 < np.linalg.norm(got - want) / np.linalg.norm(want) < 0.5
    # saved and loaded: the sites come back from the record
    path = tmp_path / "fp.keras"
    fp.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    again = _layers(loaded)
    assert again["attention"].op_sites == attention.op_sites
    assert int(again["attention"].word_length.numpy()) == 6
    # QAT-style training step runs through the sites (straight-through)
    loaded.compile("sgd", "mse")
    history = loaded.fit(x, np.zeros((8, 4)), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
