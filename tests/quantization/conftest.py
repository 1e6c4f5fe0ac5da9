"""Small models shared by the quantization tests (built per test, seeded)."""

import keras
import numpy as np
import pytest

import keras_mp

L = keras.layers
SHAPE = (8, 8, 4)


def cnn(name="cnn"):
    """Conv -> global pooling -> Dense head, on 8x8x4 inputs."""
    return keras.Sequential(
        [
            keras.Input(SHAPE),
            L.Conv2D(8, 3, activation="relu", name="conv"),
            L.GlobalAveragePooling2D(name="pool"),
            L.Dense(4, name="head"),
        ],
        name=name,
    )


def images(n=32, seed=0):
    return np.random.default_rng(seed).random((n,) + SHAPE, dtype=np.float32)


@pytest.fixture
def quantized():
    """`cnn("q")` quantized and calibrated on `images()`."""
    model = keras_mp.quantize_model(cnn("q"))
    keras_mp.calibrate(model, images(), verbose=0)
    return model
