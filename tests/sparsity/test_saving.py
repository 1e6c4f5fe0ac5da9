"""`keras_mp.RecordedModel`: 2:4 masks of nested layers survive `.keras`
save/load (the record's sparsity section)."""

import os
import warnings

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import RecordedModel, _record
from keras_mp.sparsity import (
    StructuredSparsity,
    sparse_layers,
    strip_sparsity,
)
from tests.quantization.test_nested import Block, Net, NoConfig
from tests.sparsity.conftest import compile_model
from tests.tolerance import assert_computes_like

L = keras.layers


def _state(model):
    """Per masked kernel, in walk order: mask, kept, kept_magnitude."""
    return [
        tuple(keras.ops.convert_to_numpy(v) for v in c._state())
        for _, _, c in sparse_layers(model)
    ]


def _block_model():
    inputs = keras.Input((8,))
    x = L.Dense(8, name="stem")(inputs)
    x = Block(8, name="block")(x)
    return keras.Model(inputs, L.Dense(4, name="head")(x), name="nested")


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 8)).astype("float32"), np.arange(32) % 3


@pytest.mark.parametrize("make", [_block_model, Net], ids=["custom", "sub"])
def test_masks_of_nested_layers_reload_bit_for_bit(make, tmp_path):
    x, y = _data()
    inner = make()
    inner(x[:1])
    model = compile_model(RecordedModel(inner))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "StructuredSparsity")  # no warning
        model.fit(
            x,
            y,
            batch_size=16,
            verbose=0,
            callbacks=[StructuredSparsity(schedule="gradual", end_step=2)],
        )
    state = _state(model)
    assert len(state) == 3
    assert all(int(kept) == 3 for _, kept, _ in state)  # mid-schedule
    assert all(float(mag) < 1 for _, _, mag in state)
    path = tmp_path / "sparse.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert isinstance(loaded, RecordedModel)
    got = _state(loaded)
    assert len(got) == len(state)
    for want, have in zip(state, got):
        for a, b in zip(want, have):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(loaded(x), model(x))
    # Training the loaded model keeps the masks (the constraint applies).
    compile_model(loaded).fit(x, y, batch_size=16, verbose=0)
    for (mask, _, _), (_, kernel, _) in zip(got, sparse_layers(loaded)):
        assert np.all(keras.ops.convert_to_numpy(kernel)[mask == 0] == 0)
    stripped = strip_sparsity(loaded)
    assert not sparse_layers(stripped)
    np.testing.assert_allclose(stripped(x), loaded(x), atol=1e-6)


def test_model_without_config_fails_at_save(tmp_path):
    model = NoConfig()
    model(np.zeros((1, 8), "float32"))
    sparse = RecordedModel(model)
    StructuredSparsity().set_model(sparse)
    with pytest.raises(
        ValueError, match="cannot be saved with its keras_mp state"
    ):
        sparse.save(tmp_path / "x.keras")


def test_record_of_another_model_is_rejected():
    x, _ = _data()
    net = Net(name="net")
    net(x[:1])
    with pytest.warns(UserWarning, match="RecordedModel"):
        StructuredSparsity().set_model(net)
    other = _block_model()
    with pytest.raises(ValueError, match="does not have the layers its rec"):
        _record.apply_record(other, _record.make_record(net))


@pytest.mark.slow
@pytest.mark.parametrize("name, count", [("bert", 14), ("vit", 12)])
def test_keras_hub_masks_reload_bit_for_bit(name, count, tmp_path):
    pytest.importorskip("keras_hub")
    from tests.quantization import test_keras_hub as hub

    if name == "bert":
        model, inputs = hub.bert_classifier(), hub.tokens(16)
    else:
        model, inputs = hub.vit(), hub.images(16)
    model = RecordedModel(model)
    model.compile("adam", "mse")
    out = keras.ops.convert_to_numpy(model(inputs))
    model.fit(
        inputs,
        np.zeros_like(out),
        batch_size=16,
        verbose=0,
        callbacks=[StructuredSparsity()],
    )
    state = _state(model)
    assert len(state) == count
    path = tmp_path / f"{name}.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    got = _state(loaded)
    assert len(got) == count
    for want, have in zip(state, got):
        for a, b in zip(want, have):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(loaded(inputs), model(inputs))


def test_a_sparse_model_file_of_an_earlier_release_loads():
    # Written by fixtures/make_sparse_model.py with the release before one
    # record held every kind of state: a `SparseModel` container (load-only
    # since) around a model whose pruned Dense sits inside a custom layer.
    from tests.sparsity.fixtures import make_sparse_model as made

    saved = np.load(os.path.join(made.HERE, "sparse_model.npz"))
    model = keras.saving.load_model(
        os.path.join(made.HERE, "sparse_model.keras"), safe_mode=True
    )
    assert isinstance(model, keras_mp.RecordedModel)
    inner = model.model.get_layer("block").inner
    np.testing.assert_array_equal(inner.kernel_constraint.mask, saved["mask"])
    np.testing.assert_array_equal(inner.kernel, saved["kernel"])
    assert keras_mp.is_2_4_sparse(inner.kernel.numpy(), 0)
    # computed on another CPU (float32): tests/tolerance.py
    assert_computes_like(
        model.predict(saved["x"], verbose=0), saved["y"], "float32"
    )
