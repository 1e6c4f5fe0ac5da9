"""The MuPPET layers: `FixedPointWrapper`, `FixedPointInput`,
`PrecisionState`."""

import keras
import numpy as np
import pytest

from keras_mp.muppet import FixedPointInput, FixedPointWrapper, PrecisionState


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
