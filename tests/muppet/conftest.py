"""Shared helpers of the MuPPET tests: a small model, data, a compiled
fixed-point copy, and a callback fed scripted diversities."""

import keras
import numpy as np

from keras_mp.muppet import PrecisionSwitching, fixed_point_model

# Checks every 3 epochs at e = 2, 5, 8, ...; T(e) = 1 + 1.5 exp(-0.1 e).
DIVERSITIES = [1.0, 0.5, 0.62, 0.6, 0.3, 0.2, 0.25, 0.2, 0.1]
# e=2: p=1. e=5: p=2.0 > 1.910 (1). e=8: p=1.613 < 1.674. e=11: p=1.667 >
# 1.499 (2): switch to 12 bits. e=14: max reset, p=1. e=17: 1.5 > 1.274 (1).
# e=20: 1.2 < 1.203. e=23: 1.5 > 1.150 (2): switch to float32. e=26: final.
EXPECTED_SWITCHES = [11, 23]


def mlp(inputs=6, classes=3):
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(classes),
        ]
    )


def tiny_data(n=64, inputs=6, classes=3):
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(n, inputs)).astype("float32"),
        rng.integers(0, classes, n),
    )


def compiled_fixed_point(base=None, lr=0.05):
    model = fixed_point_model(base or mlp(), seed=1)
    model.compile(keras.optimizers.SGD(lr), "sparse_categorical_crossentropy")
    return model


class ScriptedSwitching(PrecisionSwitching):
    """Feeds synthetic window diversities instead of measured ones."""

    def __init__(self, diversities, **kwargs):
        super().__init__(**kwargs)
        self.diversities = list(diversities)

    def _window_diversity(self):
        super()._window_diversity()  # still exercises the reset
        return self.diversities.pop(0)
