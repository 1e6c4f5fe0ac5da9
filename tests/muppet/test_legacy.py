"""Models of earlier keras_mp (`FixedPointWrapper` layers): they still load
and run, and `upgrade_fixed_point` gives the current form with the same
outputs, word length, random streams and switching state."""

import os

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import RecordedModel
from keras_mp.muppet import (
    FixedPointInput,
    FixedPointWrapper,
    PrecisionState,
    is_fixed_point,
    set_word_length,
)
from keras_mp.muppet.legacy import upgrade_fixed_point
from keras_mp.muppet.model import fixed_point_layers, precision_state
from tests.muppet.conftest import mlp, tiny_data
from tests.quantization.test_nested import Net
from tests.tolerance import assert_computes_like

FIXTURES = os.path.join(
    os.path.dirname(__file__), os.pardir, "integration", "fixtures"
)


def _old_form(body, inputs_shape=(6,), seed=0):
    """The model the earlier `fixed_point_model` built around `body`."""
    inputs = keras.Input(inputs_shape)
    x = PrecisionState(name="precision_state")(inputs)
    x = FixedPointInput(seed=seed, name="fixed_point_input_0")(x)
    return keras.Model(inputs, body(x), name="old_fixed_point")


def _old_sequential():
    base = mlp()
    wrapped = keras.Sequential(
        [keras.Input((6,))]
        + [
            FixedPointWrapper(layer, seed=1, name=f"fixed_point_{layer.name}")
            if layer.weights
            else layer
            for layer in base.layers
        ],
        name="mlp",
    )
    return _old_form(wrapped)


def _old_whole():
    net = Net(name="net")
    net(tiny_data(1)[0])
    return _old_form(FixedPointWrapper(net, seed=1, name="fixed_point_net"))


def _set_state(old, word_length):
    set_word_length(old, word_length)
    state = precision_state(old)
    state.violations.assign(1.0)
    state.max_diversity.assign(0.5)
    for layer in fixed_point_layers(old):
        for v in getattr(layer, "gradient_sums", []):
            v.assign(np.full(v.shape, 0.25, "float32"))


@pytest.mark.parametrize("make", [_old_sequential, _old_whole])
def test_upgrade_keeps_outputs_names_and_state(make):
    with keras_mp.legacy.loading():  # built as the earlier release did
        old = make()
    x = tiny_data(8)[0]
    _set_state(old, 8)
    new = upgrade_fixed_point(old)
    assert isinstance(new, RecordedModel) and new.name == old.name
    layers = list(fixed_point_layers(new))
    assert layers and all(is_fixed_point(layer) for layer in layers)
    assert not any(layer.name.startswith("fixed_point_") for layer in layers)
    assert {float(layer.word_length.numpy()) for layer in layers} == {8.0}
    state = precision_state(new)
    assert state.violations.numpy() == 1.0
    assert state.max_diversity.numpy() == 0.5
    weighted = [layer for layer in layers if layer.gradient_sums]
    assert all(
        np.all(v.numpy() == 0.25)
        for layer in weighted
        for v in layer.gradient_sums
    )
    if make is _old_sequential:
        # Same random streams, same draws: identical even in fixed point.
        np.testing.assert_array_equal(new(x).numpy(), old(x).numpy())
    set_word_length(old, None)
    set_word_length(new, None)
    np.testing.assert_array_equal(new(x).numpy(), old(x).numpy())


def test_upgrade_refuses_a_current_model():
    with pytest.raises(ValueError, match="nothing to upgrade"):
        upgrade_fixed_point(mlp())


def test_committed_fixture_upgrades_with_the_same_outputs(tmp_path):
    old = keras.saving.load_model(
        os.path.join(FIXTURES, "muppet.keras"), safe_mode=True
    )
    saved = np.load(os.path.join(FIXTURES, "muppet.npz"))
    new = keras_mp.upgrade(old)  # the public entry: upgrade_fixed_point
    assert [layer.name for layer in fixed_point_layers(new)] == [
        "conv",
        "bn",
        "head",
    ]
    assert {float(v.word_length.numpy()) for v in fixed_point_layers(new)} == {
        float(w) for w in saved["word_lengths"]
    }
    x = saved["x"]
    np.testing.assert_array_equal(new(x).numpy(), old(x).numpy())
    path = os.path.join(tmp_path, "upgraded.keras")
    new.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    for model in (new, loaded):
        set_word_length(model, None)
        # computed on another CPU (float32): tolerance.py
        assert_computes_like(model.predict(x, verbose=0), saved["y"], "float32")


def test_the_package_name_is_a_deprecated_alias_of_upgrade():
    import keras_mp.muppet

    with pytest.warns(DeprecationWarning, match="keras_mp.upgrade"):
        with pytest.raises(ValueError, match="nothing to upgrade"):
            keras_mp.muppet.upgrade_fixed_point(mlp())
