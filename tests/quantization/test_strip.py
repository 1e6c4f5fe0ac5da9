"""`strip_quantization`: a float copy with the trained weights."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.quantization import strip_quantization, twins
from tests.quantization.conftest import cnn, images


def test_strip_gives_the_float_model_with_trained_weights(quantized):
    x = images(8)
    quantized.compile(keras.optimizers.SGD(0.1), "mse")
    quantized.fit(x, np.ones((8, 4)), epochs=1, verbose=0)  # QAT step
    stripped = strip_quantization(quantized)
    assert not any(
        twins.is_quantized(layer)
        or isinstance(layer, keras_mp.QuantizeActivation)
        for layer in stripped.layers
    )
    assert twins.quantizers(stripped) == []  # none at any depth
    assert [type(layer) for layer in stripped.layers] == [
        type(layer) for layer in cnn().layers
    ]
    keras_mp.set_quantization_enabled(quantized, False)
    np.testing.assert_array_equal(stripped(x), quantized(x))


def test_strip_needs_a_model():
    with pytest.raises(TypeError, match="keras.Model"):
        strip_quantization("model.keras")
