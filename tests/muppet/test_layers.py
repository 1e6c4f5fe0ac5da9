"""The MuPPET layers: fixed-point twins and their `FixedPointState`,
`PrecisionState`, and the load-only `FixedPointWrapper` and
`FixedPointInput`."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.muppet import (
    FixedPointInput,
    FixedPointState,
    FixedPointWrapper,
    PrecisionState,
    fixed_point_twin_class,
    is_fixed_point,
)
from keras_mp.muppet.twins import attach


@pytest.fixture(autouse=True)
def _load_only_layers_allowed():
    """These tests build the load-only layers as Keras loading does."""
    with keras_mp.legacy.loading():
        yield


def test_wrapper_is_the_inner_layer_in_float32_and_quantizes_below():
    dense = keras.layers.Dense(4)
    wrapper = FixedPointWrapper(dense, seed=3)
    x = np.random.default_rng(0).normal(size=(2, 3)).astype("float32")
    np.testing.assert_array_equal(wrapper(x).numpy(), dense(x).numpy())
    assert [v.name for v in wrapper.non_trainable_weights][0] == "word_length"
    wrapper.word_length.assign(4.0)
    assert not np.allclose(wrapper(x).numpy(), dense(x).numpy(), atol=1e-3)


def test_layers_round_trip_their_config():
    wrapper = FixedPointWrapper(keras.layers.Dense(4), seed=3, name="w")
    copy = FixedPointWrapper.from_config(wrapper.get_config())
    assert copy.seed == 3 and copy.name == "w"
    assert isinstance(copy.layer, keras.layers.Dense) and copy.layer.units == 4
    assert (
        FixedPointInput.from_config(FixedPointInput(seed=5).get_config()).seed
        == 5
    )
    state = PrecisionState()
    x = np.ones((2, 3), "float32")
    np.testing.assert_array_equal(state(x), x)
    assert float(state.held_learning_rate.numpy()) == -1.0


def test_input_quantizes_per_sample_and_passes_integers():
    layer = FixedPointInput(seed=1)
    x = np.array([[1.0, 0.3], [100.0, 30.0]], "float32")
    np.testing.assert_array_equal(layer(x), x)  # word length 0: float32
    layer.word_length.assign(4.0)
    # Sample 0: exponent 2, grid step 1/4; sample 1: exponent -4, step 16.
    out = layer(x).numpy()
    np.testing.assert_array_equal(
        out * [[4], [1 / 16]], np.round(out * [[4], [1 / 16]])
    )
    ids = np.array([[3, 7]], "int32")
    np.testing.assert_array_equal(layer(ids), ids)


def test_a_layer_without_weights_is_refused():
    with pytest.raises(
        ValueError, match="layer 'flat' has none. Leave it unwrapped"
    ):
        FixedPointWrapper(keras.layers.Flatten(name="flat"))(np.ones((2, 3)))


@pytest.mark.parametrize("layer", [FixedPointWrapper, FixedPointInput])
def test_a_bad_seed_is_refused(layer):
    args = (keras.layers.Dense(2),) if layer is FixedPointWrapper else ()
    with pytest.raises(
        ValueError, match=r"`seed` must be an int or None. Received: seed=1.5"
    ):
        layer(*args, seed=1.5)


def test_twin_class_is_a_subclass_of_the_float_class():
    twin = fixed_point_twin_class(keras.layers.Dense)
    assert issubclass(twin, keras.layers.Dense) and twin.__name__ == (
        "FixedPointDense"
    )
    assert twin.float_class is keras.layers.Dense
    assert fixed_point_twin_class(keras.layers.Dense) is twin  # one per class


def test_attached_layer_is_float_at_word_length_0_and_quantized_below():
    dense = keras.layers.Dense(4, name="d")
    x = np.random.default_rng(0).normal(size=(2, 3)).astype("float32")
    expected = dense(x).numpy()
    state = attach(dense, seed=3, inputs=(0,))
    assert is_fixed_point(dense) and dense.name == "d"
    assert isinstance(state, FixedPointState) and dense.fixed_point is state
    assert [v.name for v in state.weights] == [
        "word_length",
        "weight_0_last_gradient",
        "weight_1_last_gradient",
        "weight_0_gradient_sum",
        "weight_1_gradient_sum",
        "gradient_square_sums",
        "seed_state",
        "input_seed_state",
    ]
    np.testing.assert_array_equal(dense(x).numpy(), expected)
    dense.word_length.assign(4.0)
    assert not np.allclose(dense(x).numpy(), expected, atol=1e-3)


def test_batch_normalization_twin_updates_its_moving_statistics():
    norm = keras.layers.BatchNormalization(momentum=0.5)
    x = np.random.default_rng(0).normal(3.0, 1.0, (16, 4)).astype("float32")
    norm.build(x.shape)
    attach(norm, seed=1)
    norm.word_length.assign(8.0)
    norm(x, training=True)
    np.testing.assert_allclose(
        norm.moving_mean.numpy(), 0.5 * x.mean(axis=0), rtol=1e-5
    )
    # The random stream moved on: two draws per weight, two for the output.
    assert norm.seed_state.numpy().tolist() == [1, 6]
