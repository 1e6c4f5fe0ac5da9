"""`PrecisionSwitching`: the schedule during `fit`, learning-rate hold,
resuming, tf.distribute."""

import math

import keras
import numpy as np
import pytest

from keras_mp.muppet import (
    FixedPointLayer,
    PrecisionSwitching,
    fixed_point_model,
)
from keras_mp.muppet.model import fixed_point_layers, precision_state
from tests.muppet.conftest import (
    DIVERSITIES,
    ScriptedSwitching,
    compiled_fixed_point,
    mlp,
    tiny_data,
)


def test_callback_switches_exactly_when_rule_says():
    x, y = tiny_data(32)
    model = compiled_fixed_point()
    cb = ScriptedSwitching(DIVERSITIES, schedule=(8, 12, None))
    hist = model.fit(x, y, batch_size=32, epochs=27, verbose=0, callbacks=[cb])
    assert cb.switch_epochs == [12, 24]
    assert hist.history["precision"] == [8.0] * 12 + [12.0] * 12 + [32.0] * 3
    p = hist.history["p"]
    assert p[5] == pytest.approx(2.0) and math.isnan(p[4])
    assert hist.history["switched"][11] == 1.0
    assert [
        layer.word_length.numpy() for layer in fixed_point_layers(model)
    ] == [0] * 3  # two Dense and the BatchNormalization


def test_measured_diversity_is_logged():
    x, y = tiny_data(64)
    model = compiled_fixed_point()
    cb = PrecisionSwitching(schedule=(8, None), resolution=2)
    hist = model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[cb])
    d = hist.history["diversity"]
    assert math.isnan(d[0]) and d[1] > 0 and d[3] > 0
    layer = next(iter(fixed_point_layers(model)))
    assert np.any(layer.last_gradients[0].numpy())


def test_precision_switch_does_not_retrace(monkeypatch):
    traces = []
    original = FixedPointLayer.call

    def counting_call(self, *args, **kwargs):
        traces.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FixedPointLayer, "call", counting_call)
    x, y = tiny_data()
    model = compiled_fixed_point()
    per_epoch = []
    probe = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: per_epoch.append(len(traces))
    )
    cb = PrecisionSwitching(
        schedule=(8, 12, 16, None), epoch_schedule=(1, 2, 3)
    )
    hist = model.fit(
        x, y, batch_size=16, epochs=4, verbose=0, callbacks=[cb, probe]
    )
    assert hist.history["precision"] == [8.0, 12.0, 16.0, 32.0]
    assert per_epoch[0] > 0 and len(set(per_epoch)) == 1


def test_learning_rate_held_in_fixed_point():
    x, y = tiny_data()
    model = compiled_fixed_point(lr=0.1)
    seen = []
    probe = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: seen.append(
            round(float(model.optimizer.learning_rate.numpy()), 6)
        )
    )
    halve = keras.callbacks.LearningRateScheduler(lambda e, lr: lr / 2)
    cb = PrecisionSwitching(schedule=(8, None), epoch_schedule=(2,))
    model.fit(x, y, epochs=4, verbose=0, callbacks=[halve, cb, probe])
    # The scheduler (listed first) halves at epoch 0; that value is held
    # through the fixed-point epochs, then the schedule resumes.
    assert seen == [0.05, 0.05, 0.025, 0.0125]


def test_state_survives_backup_and_restore(tmp_path):
    x, y = tiny_data()
    base = mlp()
    backup = str(tmp_path / "backup")

    def interrupt(epoch, logs):
        if epoch == 4:
            raise RuntimeError("interrupted")

    # Checks at e=1: p=1; e=3: p=2.5 > T(3)=2.11, 1 violation. Stop at e=4.
    first = ScriptedSwitching([1.0, 0.4], schedule=(8, None), resolution=2)
    with pytest.raises(RuntimeError, match="interrupted"):
        compiled_fixed_point(base).fit(
            x,
            y,
            epochs=8,
            verbose=0,
            callbacks=[
                first,
                keras.callbacks.BackupAndRestore(backup),
                keras.callbacks.LambdaCallback(on_epoch_begin=interrupt),
            ],
        )
    # Resumed at e=4; e=5: p = 1.0/0.4 = 2.5 > T(5)=1.91 is the 2nd violation
    # only if the maximum and the count were restored.
    second = ScriptedSwitching([0.4, 0.4], schedule=(8, None), resolution=2)
    hist = compiled_fixed_point(base).fit(
        x,
        y,
        epochs=8,
        verbose=0,
        callbacks=[second, keras.callbacks.BackupAndRestore(backup)],
    )
    assert second.switch_epochs == [6]
    assert hist.history["precision"] == [8.0, 8.0, 32.0, 32.0]


# -- distribution, cost model, plot


def test_mirrored_strategy_smoke(mirrored_strategy):
    x, y = tiny_data(64)
    with mirrored_strategy.scope():
        model = compiled_fixed_point()
    cb = PrecisionSwitching(schedule=(8, None), resolution=2, patience=1)
    hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    assert np.all(np.isfinite(hist.history["loss"]))
    assert hist.history["diversity"][1] > 0  # read from on-read variables
    assert hist.history["precision"][0] == 8.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"schedule": (8, 16)}, "must end with None"),
        ({"resolution": 0}, "`resolution` must be >= 1. Received"),
        ({"resolution": 1}, "one-epoch window is always 1"),
        ({"patience": 1.5}, "`patience` must be a positive int"),
        (
            {"schedule": (8, None), "epoch_schedule": (2, 4)},
            r"one strictly increasing epoch >= 1 per switch \(1 for "
            r"schedule=\(8, None\)\). Received: epoch_schedule=\(2, 4\)",
        ),
        (
            {"schedule": (8, 12, None), "epoch_schedule": (4, 2)},
            "epoch_schedule=\\(4, 2\\)",
        ),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrecisionSwitching(**kwargs)


def test_a_float_model_is_refused_at_fit():
    plain = mlp()
    plain.compile("sgd", "sparse_categorical_crossentropy")
    x, y = tiny_data()
    with pytest.raises(
        ValueError, match="needs a model built by keras_mp.fixed_point_model"
    ):
        plain.fit(x, y, epochs=1, verbose=0, callbacks=[PrecisionSwitching()])


def test_resume_with_a_shorter_schedule_is_refused():
    model = fixed_point_model(mlp())
    precision_state(model).stage.assign(3.0)
    model.compile("sgd", "sparse_categorical_crossentropy")
    x, y = tiny_data(8)
    switching = PrecisionSwitching(schedule=(8, None))
    with pytest.raises(
        ValueError,
        match=r"stage 3, past the end of schedule=\(8, None\). Resume with "
        "the schedule",
    ):
        model.fit(x, y, verbose=0, callbacks=[switching])
