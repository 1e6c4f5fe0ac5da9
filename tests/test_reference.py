"""The shared training loop of the demo and the benchmarks."""

import keras
import numpy as np
import pytest

from keras_mp.reference import fine_tune


def test_fine_tune_decays_to_zero_on_full_batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4)).astype("float32")
    y = rng.integers(0, 3, 300)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    history = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: history.append(
            float(model.optimizer.learning_rate)
        )
    )
    assert fine_tune(model, x, y, 2, 1e-2, [callback], verbose=0) is model
    # 300 images, batch 128: 2 full batches per epoch, the ragged one
    # dropped; the rate starts at 1e-2 and ends at 0 after the last step.
    assert int(model.optimizer.iterations) == 4
    assert history[0] == pytest.approx(1e-2)
    assert history == sorted(history, reverse=True)
    assert float(model.optimizer.learning_rate) == pytest.approx(0, abs=1e-9)
