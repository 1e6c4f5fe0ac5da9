"""Saving a fixed-point model: one `keras_mp>RecordedModel` with the
"muppet" record section, loaded with `safe_mode=True`; and an interrupted
`fit` resumed by `BackupAndRestore` at the same precision and noise."""

import json
import os
import zipfile

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
from tests.muppet.conftest import tiny_data
from tests.muppet.test_model import _two_dense_model


def _compiled(seed=0):
    keras.utils.set_random_seed(seed)
    model = fixed_point_model(_two_dense_model(), seed=0)
    model.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_saved_config_is_the_float_model_and_the_muppet_record(tmp_path):
    model = _compiled()
    set_word_length(model, 8)
    path = os.path.join(tmp_path, "fp.keras")
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    text = json.dumps(config)
    assert config["registered_name"] == "keras_mp>RecordedModel"
    assert "FixedPoint" not in text  # no twin, no wrapper: the float model
    record = config["config"]["record"]
    section = record["muppet"]
    paths = [record["paths"][e["index"]] for e in section["layers"]]
    assert [p.split("/")[0] for p in paths] == ["stem", "pair", "pair", "head"]
    assert record["paths"][section["state"]] == "stem"
    assert section["layers"][0]["inputs"] == [0]
    loaded = keras.saving.load_model(path, safe_mode=True)
    # Named layers keep their names; those a custom layer makes without a
    # name get Keras' next automatic name, as in any rebuilt model.
    assert [layer.name for layer in fixed_point_layers(loaded)][::3] == [
        "stem",
        "head",
    ]
    assert is_fixed_point(loaded.get_layer("pair").second)
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    # Same weights and random streams: the same draws, in fixed point too.
    x = tiny_data(8)[0]
    np.testing.assert_array_equal(model(x).numpy(), loaded(x).numpy())


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("interrupted")


def _fit(model, backup, epochs, extra=()):
    x, y = tiny_data(64)
    switching = PrecisionSwitching(
        schedule=(6, 8, None), resolution=2, patience=1
    )
    callbacks = [switching]
    if backup:
        callbacks.append(keras.callbacks.BackupAndRestore(backup))
    return model.fit(
        x,
        y,
        batch_size=32,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks + list(extra),
    )


def test_backup_and_restore_resumes_precision_noise_and_weights(tmp_path):
    """Interrupted at the start of epoch 2, resumed into a new model: it
    restores the weights, word lengths, random streams and switching state,
    so its epoch 2 is exactly the interrupted model's, continued."""
    backup = os.path.join(tmp_path, "backup")
    interrupted = _compiled()
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(interrupted, backup, 3, [_Interrupt(2)])
    resumed = _compiled(seed=1)  # other initial weights: all restored
    history = _fit(resumed, backup, 3).history["precision"]
    x, y = tiny_data(64)
    continued = interrupted.fit(
        x,
        y,
        batch_size=32,
        epochs=3,
        initial_epoch=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            PrecisionSwitching(schedule=(6, 8, None), resolution=2, patience=1)
        ],
    )
    assert history == continued.history["precision"]
    for a, b in zip(interrupted.weights, resumed.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert precision_state(resumed).window_epochs.numpy() == 1.0
