"""`fixed_point_model`, `fixed_point_layers`, `set_word_length`: layers in
fixed point in place, at any depth, under their own names."""

import os
import warnings

import keras
import numpy as np
import pytest

from keras_mp.muppet import (
    PrecisionSwitching,
    fixed_point_model,
    is_fixed_point,
    set_word_length,
)
from keras_mp.muppet.model import fixed_point_layers, precision_state
from tests.conftest import Subclassed, small_cnn, tf_keras_like
from tests.muppet.conftest import (
    ScriptedSwitching,
    compiled_fixed_point,
    tiny_data,
)
from tests.quantization.test_nested import Net


def test_fixed_point_model_copies_weights_and_matches_in_float32():
    base = small_cnn()
    x = np.random.default_rng(0).random((4, 28, 28, 1)).astype("float32")
    model = fixed_point_model(base)
    np.testing.assert_array_equal(model(x).numpy(), base(x).numpy())
    layers = list(fixed_point_layers(model))
    assert [type(layer).__name__ for layer in layers] == [
        "FixedPointConv2D",
        "FixedPointConv2D",
        "FixedPointDense",
    ]
    # Same names, in a copy: the float model's layers stay float.
    assert [layer.name for layer in layers] == [
        layer.name for layer in base.layers if layer.weights
    ]
    assert not any(is_fixed_point(layer) for layer in base.layers)
    assert layers[0].fixed_point.inputs == (0,)  # the input, per sample
    set_word_length(model, 16)
    close = model(x).numpy()
    np.testing.assert_allclose(close, base(x).numpy(), atol=2e-2)
    set_word_length(model, 4)
    assert not np.allclose(model(x).numpy(), close, atol=1e-3)


def test_functional_two_inputs_with_residual_add():
    a, b = keras.Input((4,)), keras.Input((4,))
    h = keras.layers.Dense(4, name="first")(a)
    out = keras.layers.Dense(2, name="last")(
        keras.layers.Add(name="add")([h, b])
    )
    base = keras.Model([a, b], out)
    model = fixed_point_model(base)
    xs = [np.ones((3, 4), "float32"), np.full((3, 4), 0.5, "float32")]
    np.testing.assert_array_equal(model(xs).numpy(), base(xs).numpy())
    # Input a goes to a Dense; input b to the Add, which quantizes it only.
    found = {
        layer.name: (layer.fixed_point.inputs, len(layer.last_gradients))
        for layer in fixed_point_layers(model)
    }
    assert found == {"first": ((0,), 2), "add": ((1,), 0), "last": ((), 2)}


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
    loaded = _reload(model, tmp_path)
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    state = precision_state(loaded)
    assert state.violations.numpy() == 1 and state.max_diversity.numpy() == 1.0
    assert [
        layer.word_length.numpy() for layer in fixed_point_layers(loaded)
    ] == [8] * 3
    set_word_length(model, None)
    set_word_length(loaded, None)
    np.testing.assert_array_equal(model(x).numpy(), loaded(x).numpy())


def test_layers_of_a_nested_model_are_switched_and_found():
    inner = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8)], name="inner"
    )
    inputs = keras.Input((6,))
    base = keras.Model(inputs, keras.layers.Dense(3)(inner(inputs)))
    model = fixed_point_model(base)
    x = tiny_data(4)[0]
    np.testing.assert_array_equal(model(x).numpy(), base(x).numpy())
    names = [layer.name for layer in fixed_point_layers(model)]
    assert names == [layer.name for layer in (inner.layers[0], base.layers[-1])]
    assert model.model.get_layer("inner").layers[0].fixed_point.inputs == (0,)
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


@pytest.mark.parametrize("in_place", [False, True])
def test_quantized_model_is_refused_naming_the_float_model(in_place):
    """It used to fail in the copy, about `get_config()`."""
    import keras_mp

    q = keras_mp.quantize_model(small_cnn())
    before = [type(layer) for layer in q.model.layers]
    with pytest.raises(
        ValueError,
        match=r"trains a float model in fixed point; model '.*' is "
        r"quantized \(layer 'conv2d(_\d+)?', in_place=(True|False)\).*"
        r"keras_mp.strip_quantization\(model\)",
    ):
        fixed_point_model(q, in_place=in_place)
    assert [type(layer) for layer in q.model.layers] == before
    assert not list(fixed_point_layers(q))


def test_set_word_length_rejects_a_bad_width():
    model = compiled_fixed_point()
    with pytest.raises(ValueError, match=r"2\.\.32, or None for float32"):
        set_word_length(model, 40)
    assert {
        float(v.word_length.numpy()) for v in fixed_point_layers(model)
    } == {0.0}


def _net():
    model = Net(name="net")
    model(tiny_data(1)[0])
    return model


def _reload(model, tmp_path):
    path = os.path.join(tmp_path, "muppet.keras")
    model.save(path)
    return keras.saving.load_model(path, safe_mode=True)


def _no_warnings(make):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return make()


def test_subclassed_model_with_a_custom_layer_trains_and_reloads(tmp_path):
    """A subclassed model holding a custom layer: every weighted layer at
    any depth in fixed point, no warning, trained in 8 bits, saved and
    loaded with safe_mode=True at the same precision."""
    base = _net()
    x, y = tiny_data()
    model = _no_warnings(lambda: fixed_point_model(base, seed=0))
    np.testing.assert_array_equal(model(x).numpy(), base(x).numpy())
    inner = model.model
    assert type(inner) is Net and inner.name == "net"
    assert [layer.name for layer in fixed_point_layers(model)] == [
        inner.stem.name,
        inner.block.fc.name,
        inner.block.norm.name,
        inner.head.name,
    ]
    model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    switching = PrecisionSwitching(schedule=(8, None), epoch_schedule=(10,))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[switching])
    assert not np.allclose(model(x).numpy(), base(x).numpy(), atol=1e-3)
    loaded = _reload(model, tmp_path)
    assert [
        float(v.word_length.numpy()) for v in fixed_point_layers(loaded)
    ] == [8.0] * 4
    set_word_length(model, None)
    set_word_length(loaded, None)
    np.testing.assert_array_equal(model(x).numpy(), loaded(x).numpy())


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class TwoDense(keras.layers.Layer):
    """Dense -> tanh -> Dense: the activation between them is internal."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.first = keras.layers.Dense(units)
        self.second = keras.layers.Dense(units)

    def build(self, shape):
        self.first.build(shape)
        self.second.build((*shape[:-1], self.units))

    def call(self, x):
        return self.second(keras.ops.tanh(self.first(x)))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _two_dense_model():
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, name="stem")(inputs)
    x = TwoDense(name="pair")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x))


def _levels(values):
    """The number of distinct values and whether they are multiples of one
    power of two (a fixed-point grid)."""
    values = np.unique(values)
    step = np.min(np.diff(values))
    scaled = values / 2.0 ** np.floor(np.log2(step))
    return len(values), np.array_equal(scaled, np.round(scaled))


def test_activation_inside_a_custom_layer_is_quantized(tmp_path):
    """The output of the first Dense inside the custom layer (the tanh's
    input) is on a 4-bit grid: quantized in place, not wrapped whole."""
    base = _two_dense_model()
    x = tiny_data(8)[0]
    model = _no_warnings(lambda: fixed_point_model(base, seed=0))
    pair = model.get_layer("pair")
    assert not is_fixed_point(pair)  # no weights of its own
    assert is_fixed_point(pair.first) and is_fixed_point(pair.second)
    assert [layer.name for layer in model.model.layers[1:]] == [
        "stem",
        "pair",
        "head",
    ]
    hidden = model.get_layer("stem")(x)
    np.testing.assert_array_equal(
        pair.first(hidden).numpy(), base.get_layer("pair").first(hidden)
    )
    set_word_length(model, 4)
    count, on_grid = _levels(pair.first(hidden).numpy())
    assert count <= 16 and on_grid
    assert not np.allclose(model(x).numpy(), base(x).numpy(), atol=1e-3)
    loaded = _reload(model, tmp_path)
    assert {
        float(v.word_length.numpy()) for v in fixed_point_layers(loaded)
    } == {4.0}
    assert is_fixed_point(loaded.get_layer("pair").first)


def test_multi_head_attention_projections_are_fixed_point():
    inputs = keras.Input((5, 8))
    h = keras.layers.MultiHeadAttention(2, 4, name="mha")(inputs, inputs)
    outputs = keras.layers.Dense(3, name="head")(h)
    base = keras.Model(inputs, outputs)
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    model = _no_warnings(lambda: fixed_point_model(base, seed=0))
    np.testing.assert_array_equal(model(x).numpy(), base(x).numpy())
    mha = model.get_layer("mha")
    assert type(mha).__name__ == "FixedPointMultiHeadAttention"
    assert mha.fixed_point.inputs == (0, 1) and not mha.last_gradients
    projections = [mha._query_dense, mha._key_dense, mha._value_dense]
    projections.append(mha._output_dense)
    assert all(is_fixed_point(p) for p in projections)
    assert [p.name for p in projections] == [
        "query",
        "key",
        "value",
        "attention_output",
    ]
    set_word_length(model, 6)
    assert not np.allclose(model(x).numpy(), base(x).numpy(), atol=1e-3)


def test_in_place_switches_the_model_itself():
    base = _two_dense_model()
    x = tiny_data(4)[0]
    expected = base(x).numpy()
    model = fixed_point_model(base, seed=0, in_place=True)
    assert model.model is base
    assert is_fixed_point(base.get_layer("stem"))
    np.testing.assert_array_equal(model(x).numpy(), expected)
    with pytest.raises(ValueError, match="in fixed point already"):
        fixed_point_model(base)


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


def test_recurrent_layer_runs_its_cell_in_fixed_point():
    """The cell of an LSTM runs once per time step inside a loop: the LSTM
    is the fixed-point layer (its cell's weights, its outputs), and the
    embedding's sparse gradient is quantized as a dense one."""
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 4, name="embed")(inputs)
    h = keras.layers.LSTM(6, name="lstm")(h)
    base = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    x = np.arange(40, dtype="int32").reshape(8, 5) % 20
    model = fixed_point_model(base, seed=0)
    np.testing.assert_array_equal(model(x).numpy(), base(x).numpy())
    lstm = model.get_layer("lstm")
    assert is_fixed_point(lstm) and not is_fixed_point(lstm.cell)
    assert len(lstm.last_gradients) == 3  # kernel, recurrent, bias
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(True))
    switching = PrecisionSwitching(schedule=(8, None), epoch_schedule=(10,))
    model.fit(x, np.arange(8) % 2, verbose=0, callbacks=[switching])
    assert all(np.any(v.numpy()) for v in lstm.last_gradients)
