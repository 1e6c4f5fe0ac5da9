"""`layer_sensitivity` and `auto_quantize` on a model built under a
`tf.distribute.MirroredStrategy` (the two logical CPUs of conftest.py):
the same scores and choices as the single-device model."""

import keras
import numpy as np
import pytest

import keras_mp


def _model():
    inputs = keras.Input((8, 8, 1))
    conv = keras.layers.Conv2D(16, 3, padding="same", name="conv")
    x = keras.layers.GlobalAveragePooling2D()(keras.ops.relu(conv(inputs)))
    x = keras.layers.Dense(32, activation="relu", name="fc")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x))


def test_scores_and_choices_match_the_single_device_model(
    digits, mirrored_strategy
):
    (x, y), _ = digits
    keras.utils.set_random_seed(0)
    single = _model()
    single.compile("adam", "sparse_categorical_crossentropy")
    single.fit(x, y, epochs=2, batch_size=64, verbose=0)
    with mirrored_strategy.scope():
        mirrored = _model()
        mirrored.set_weights(single.get_weights())
    kwargs = dict(num_batches=2, calibration_batches=2, verbose=0)
    with mirrored_strategy.scope():
        _, choice = keras_mp.auto_quantize(
            mirrored, x[:256], y[:256], max_drop=0.02, **kwargs
        )
    _, want_choice = keras_mp.auto_quantize(
        single, x[:256], y[:256], max_drop=0.02, **kwargs
    )
    # the search's scores are layer_sensitivity's
    got, want = choice.sensitivity, want_choice.sensitivity
    assert [r.name for r in got.rows] == [r.name for r in want.rows]
    for a, b in zip(got.rows, want.rows):
        for p in ("int8", "float8"):
            assert a.scores[p] == pytest.approx(b.scores[p], rel=1e-4)
    assert [c.precision for c in choice.choices] == [
        c.precision for c in want_choice.choices
    ]
    assert choice.metric == pytest.approx(want_choice.metric)
    assert np.isfinite(choice.speedup_over_fp16)
