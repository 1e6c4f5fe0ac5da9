"""`fixed_point_model`, `fixed_point_layers`, `set_word_length`, and the
saved state of a MuPPET model."""

import os

import keras
import numpy as np
import pytest

from keras_mp.muppet import (
    FixedPointWrapper,
    PrecisionSwitching,
    fixed_point_model,
    set_word_length,
)
from keras_mp.muppet.model import fixed_point_layers, precision_state
from tests.conftest import Subclassed, small_cnn, tf_keras_like
from tests.muppet.conftest import (
    ScriptedSwitching,
    compiled_fixed_point,
    tiny_data,
)
from tests.quantization.test_nested import Block, Net


def test_fixed_point_model_copies_weights_and_matches_in_float32():
    base = small_cnn()
    x = np.random.default_rng(0).random((4, 28, 28, 1)).astype("float32")
    model = fixed_point_model(base)
    np.testing.assert_array_equal(model(x).numpy(), base(x).numpy())
    wrappers = [
        layer
        for layer in fixed_point_layers(model)
        if isinstance(layer, FixedPointWrapper)
    ]
    assert len(wrappers) == 3  # two Conv2D and the Dense
    set_word_length(model, 16)
    close = model(x).numpy()
    np.testing.assert_allclose(close, base(x).numpy(), atol=2e-2)
    set_word_length(model, 4)
    assert not np.allclose(model(x).numpy(), close, atol=1e-3)


def test_functional_two_inputs_with_residual_add():
    a, b = keras.Input((4,)), keras.Input((4,))
    h = keras.layers.Dense(4)(a)
    out = keras.layers.Dense(2)(keras.layers.Add()([h, b]))
    base = keras.Model([a, b], out)
    model = fixed_point_model(base)
    xs = [np.ones((3, 4), "float32"), np.full((3, 4), 0.5, "float32")]
    np.testing.assert_array_equal(model(xs).numpy(), base(xs).numpy())
    assert len(list(fixed_point_layers(model))) == 4  # 2 inputs, 2 Dense


def test_muppet_learns_fashion_mnist_in_8_bits(fashion_small):
    (x, y), (xt, yt) = fashion_small
    model = fixed_point_model(small_cnn(), seed=0)
    model.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    switching = PrecisionSwitching(schedule=(8, None), epoch_schedule=(10,))
    history = model.fit(
        x, y, batch_size=64, epochs=3, verbose=0, callbacks=[switching]
    )
    assert history.history["precision"] == [8.0, 8.0, 8.0]
    assert model.evaluate(xt, yt, verbose=0)[1] > 0.4  # chance: 0.1


def test_state_survives_keras_save_and_load(tmp_path):
    x, y = tiny_data()
    model = compiled_fixed_point()
    # e=1: p=1. e=3: p=3.3 > T(3)=2.11, one violation, still 8 bits.
    cb = ScriptedSwitching([1.0, 0.3], schedule=(8, 12, None), resolution=2)
    model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[cb])
    path = os.path.join(tmp_path, "muppet.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    state = precision_state(loaded)
    assert state.violations.numpy() == 1 and state.max_diversity.numpy() == 1.0
    assert [
        layer.word_length.numpy() for layer in fixed_point_layers(loaded)
    ] == [8] * 4
    set_word_length(model, None)
    set_word_length(loaded, None)
    np.testing.assert_array_equal(model(x).numpy(), loaded(x).numpy())


def test_layers_of_a_nested_model_are_wrapped_and_found():
    inner = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8)], name="inner"
    )
    inputs = keras.Input((6,))
    base = keras.Model(inputs, keras.layers.Dense(3)(inner(inputs)))
    model = fixed_point_model(base)
    x = tiny_data(4)[0]
    np.testing.assert_array_equal(model(x).numpy(), base(x).numpy())
    kinds = sorted(type(layer).__name__ for layer in fixed_point_layers(model))
    assert kinds == ["FixedPointInput"] + ["FixedPointWrapper"] * 2
    assert precision_state(model).name == "precision_state"
    assert precision_state(base) is None


def _built_subclassed():
    model = Subclassed()
    model(np.ones((1, 3), "float32"))
    return model


def _frozen():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2, trainable=False)]
    )


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            _built_subclassed,
            ValueError,
            r"copy of Subclassed 'subclassed' rebuilt from its config.*"
            r"Give Subclassed a `get_config\(\)`.*register_keras_serializable",
        ),
        (
            tf_keras_like,
            TypeError,
            r"`fixed_point_model` expects a Keras 3.*tf_keras \(Keras 2\)",
        ),
        (
            lambda: keras.Sequential([keras.layers.Dense(2)]),
            ValueError,
            r"not built. Start it with keras.Input\(shape\)",
        ),
        (
            _frozen,
            ValueError,
            "no trainable weights.*check `layer.trainable`",
        ),
    ],
)
def test_models_it_cannot_copy_say_what_to_do(make, error, match):
    with pytest.raises(error, match=match):
        fixed_point_model(make())


def test_set_word_length_rejects_a_bad_width():
    model = compiled_fixed_point()
    with pytest.raises(ValueError, match=r"2\.\.32, or None for float32"):
        set_word_length(model, 40)
    assert {
        float(v.word_length.numpy()) for v in fixed_point_layers(model)
    } == {0.0}


def _block_model():
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, name="stem")(inputs)
    x = Block(8, name="block")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x))


def _net():
    model = Net(name="net")
    model(tiny_data(1)[0])
    return model


def _reload(model, tmp_path):
    path = os.path.join(tmp_path, "muppet.keras")
    model.save(path)
    return keras.saving.load_model(path, safe_mode=True)


def test_subclassed_model_with_a_custom_layer_trains_and_reloads(tmp_path):
    """A subclassed model (holding a custom layer): wrapped whole (the
    warning names it), trained in 8 bits, saved and loaded with
    safe_mode=True at the same precision."""
    base = _net()
    x, y = tiny_data()
    with pytest.warns(UserWarning, match="wrapped whole.*float32: net"):
        model = fixed_point_model(base, seed=0)
    np.testing.assert_array_equal(model(x).numpy(), base(x).numpy())
    model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    switching = PrecisionSwitching(schedule=(8, None), epoch_schedule=(10,))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[switching])
    assert not np.allclose(model(x).numpy(), base(x).numpy(), atol=1e-3)
    loaded = _reload(model, tmp_path)
    assert [
        float(v.word_length.numpy()) for v in fixed_point_layers(loaded)
    ] == [
        8.0,
        8.0,
    ]
    set_word_length(model, None)
    set_word_length(loaded, None)
    np.testing.assert_array_equal(model(x).numpy(), loaded(x).numpy())


def test_custom_layer_in_a_functional_model_is_wrapped_whole(tmp_path):
    base = _block_model()
    x = tiny_data(8)[0]
    with pytest.warns(UserWarning, match="wrapped whole.*float32: block"):
        model = fixed_point_model(base, seed=0)
    names = [layer.layer.name for layer in model.layers[-1].layers[1:]]
    assert names == ["stem", "block", "head"]
    set_word_length(model, 6)
    low = model(x).numpy()
    assert not np.allclose(low, base(x).numpy(), atol=1e-3)
    loaded = _reload(model, tmp_path)
    assert {
        float(v.word_length.numpy()) for v in fixed_point_layers(loaded)
    } == {6.0}


def test_functional_batchnorm_mask_argument_is_forwarded():
    """A Functional graph records `mask=` for BatchNormalization (as in every
    keras.applications model): the wrapper takes and forwards it."""
    inputs = keras.Input((6,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inputs))
    base = keras.Model(inputs, keras.layers.Dense(2)(h))
    x = tiny_data(4)[0]
    np.testing.assert_array_equal(
        fixed_point_model(base)(x).numpy(), base(x).numpy()
    )


@pytest.mark.slow
def test_keras_applications_mobilenetv2_copies():
    base = keras.applications.MobileNetV2(
        input_shape=(32, 32, 1), alpha=0.35, weights=None, classes=10
    )
    x = np.random.default_rng(0).random((2, 32, 32, 1)).astype("float32")
    model = fixed_point_model(base)
    np.testing.assert_array_equal(model(x).numpy(), base(x).numpy())
    set_word_length(model, 8)
    assert not np.allclose(model(x).numpy(), base(x).numpy(), atol=1e-4)
