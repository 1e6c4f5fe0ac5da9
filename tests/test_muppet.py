"""Tests of MuPPET: fixed-point quantizer, wrappers, policy, callback."""

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tests.conftest import small_cnn
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from keras_mp.muppet import (
    FixedPointWrapper,
    PrecisionSwitching,
    SwitchingPolicy,
    estimate_speedup,
    fixed_point_model,
    fixed_point_quantize,
    gradient_diversity,
    plot_precision,
    set_word_length,
    switching_threshold,
)
from keras_mp.muppet.model import fixed_point_layers, precision_state
from keras_mp.muppet.quantizer import fixed_point_ste


def q(x, bits, seed=None, per_sample=False):
    x = np.asarray(x, "float32")
    return fixed_point_quantize(x, bits, seed, per_sample).numpy()


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


# -- quantizer


def test_exponent_choice_hand_cases():
    # WL=4: U=7.5, L=-8.5; min(7.5/0.9, 8.5/1) = 8.33 -> s=3.
    np.testing.assert_array_equal(q([0.3, -1.0, 0.9], 4), [0.25, -1.0, 0.875])
    # Exact powers of two: 127.5/1 -> s=6; 127.5/0.5 = 255 -> s=7.
    np.testing.assert_array_equal(q([1.0], 8), [1.0])
    np.testing.assert_array_equal(q([0.5, 0.25], 8), [0.5, 0.25])
    # 127.5/0.01 = 12750 -> s=13: 0.01 * 8192 = 81.92 -> 82 / 8192.
    np.testing.assert_array_equal(q([0.01], 8), [82 / 8192])
    # Negative side bounds: 128.5/2 = 64.25 -> s=6, -128 fits exactly.
    np.testing.assert_array_equal(q([-2.0, 1.0], 8), [-2.0, 1.0])


def test_zero_and_one_signed_tensors():
    np.testing.assert_array_equal(q(np.zeros(4), 8), np.zeros(4))
    # Positive only: 127.5/3 -> s=5 -> 32, 64, 96 exact.
    np.testing.assert_array_equal(q([1.0, 2.0, 3.0], 8), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(q([-1.0, -2.0, -3.0], 8), [-1, -2, -3])
    out = q([1e-30, 0.0], 8)
    assert np.all(np.isfinite(out)) and out[1] == 0.0


def test_clamp_to_signed_range():
    seed = keras.random.SeedGenerator(3)
    # s=6, 2**6 * x = 127.3: stochastic rounding gives 128 30% of the time
    # without the clamp; the clamp keeps 127 (the reference code's bug).
    top = np.stack([q([1.9890625], 8, seed) for _ in range(200)])
    np.testing.assert_array_equal(np.unique(top), [127 / 64])
    # 128.5/2.0078125 = 64 -> s=6, 2**6 * x = -128.5: -129 is clamped.
    low = np.stack([q([-2.0078125], 8, seed) for _ in range(200)])
    np.testing.assert_array_equal(np.unique(low), [-2.0])


def test_stochastic_rounding_is_unbiased():
    x = np.full(40_000, 0.3, "float32")
    x[0] = 1.0  # s=2 at WL=4: 0.3 -> 1.2 -> 1 or 2 (20% of the time)
    out = q(x, 4, keras.random.SeedGenerator(0))
    assert set(np.unique(out[1:])) == {0.25, 0.5}
    assert abs(out[1:].mean() - 0.3) < 0.002
    assert q(x, 4)[1] == 0.25  # round to nearest is biased


def test_per_sample_exponents():
    x = [[1.0, 0.3], [100.0, 30.0]]
    # Sample 0: s=2 -> [4, 1]/4; sample 1: 7.5/100 -> s=-4 -> [6, 2]*16.
    np.testing.assert_array_equal(
        q(x, 4, per_sample=True), [[1, 0.25], [96, 32]]
    )


@pytest.mark.parametrize("off", [0, 32])
def test_float32_mode_is_exact_pass_through(off):
    x = np.random.default_rng(0).normal(size=(5, 7)).astype("float32")
    np.testing.assert_array_equal(q(x, off, seed=1), x)


@settings(max_examples=25, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        st.integers(1, 12),
        elements=st.floats(-1e4, 1e4, width=32),
    ),
    bits=st.integers(2, 16),
)
def test_quantized_values_lie_on_the_grid(x, bits):
    out = q(x, bits, seed=7)
    assert np.all(np.isfinite(out))
    if not np.any(x):
        np.testing.assert_array_equal(out, 0.0)
        return
    bound = max(
        np.max(x) / (2 ** (bits - 1) - 0.5),
        np.min(x) / -(2 ** (bits - 1) + 0.5),
    )
    s = math.floor(math.log2(1 / bound))
    step = 2.0**-s
    ints = out / step
    np.testing.assert_array_equal(ints, np.round(ints))
    assert ints.max() <= 2 ** (bits - 1) - 1 and ints.min() >= -(
        2 ** (bits - 1)
    )
    assert np.all(np.abs(out - x) < step * (1 + 1e-6))


def test_straight_through_gradient_quantized_and_recorded():
    x = tf.Variable([0.1, -0.7, 0.4])
    upstream = tf.constant([0.3, -1.0, 0.9])
    record = tf.Variable(tf.zeros(3))
    for bits, expected in ((4, [0.25, -1.0, 0.875]), (0, upstream.numpy())):
        with tf.GradientTape() as tape:
            y = fixed_point_ste(
                x,
                tf.constant(float(bits)),
                keras.random.SeedGenerator(0),
                record=record,
            )
            loss = tf.reduce_sum(y * upstream)
        grad = tape.gradient(loss, x).numpy()
        # Stochastic rounding of the gradient: within one step (1/8).
        tol = 0.125 if bits else 0.0
        np.testing.assert_allclose(grad, expected, atol=tol)
        np.testing.assert_array_equal(record.numpy(), grad)


# -- fixed_point_model


def test_fixed_point_model_copies_weights_and_matches_in_float32():
    base = small_cnn()
    x = np.random.default_rng(0).random((4, 28, 28, 1)).astype("float32")
    model = fixed_point_model(base)
    np.testing.assert_array_equal(model(x).numpy(), base(x).numpy())
    wrappers = [
        layer
        for layer in fixed_point_layers(model)
        if isinstance(layer, FixedPointWrapper)
    ]
    assert len(wrappers) == 3  # two Conv2D and the Dense
    set_word_length(model, 16)
    close = model(x).numpy()
    np.testing.assert_allclose(close, base(x).numpy(), atol=2e-2)
    set_word_length(model, 4)
    assert not np.allclose(model(x).numpy(), close, atol=1e-3)


def test_functional_two_inputs_with_residual_add():
    a, b = keras.Input((4,)), keras.Input((4,))
    h = keras.layers.Dense(4)(a)
    out = keras.layers.Dense(2)(keras.layers.Add()([h, b]))
    base = keras.Model([a, b], out)
    model = fixed_point_model(base)
    xs = [np.ones((3, 4), "float32"), np.full((3, 4), 0.5, "float32")]
    np.testing.assert_array_equal(model(xs).numpy(), base(xs).numpy())
    assert len(list(fixed_point_layers(model))) == 4  # 2 inputs, 2 Dense


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


# -- gradient diversity and the policy


def test_gradient_diversity_hand_cases():
    a, b = np.array([3.0, 4.0]), np.array([1.0, 0.0])
    assert gradient_diversity([[a], [a], [a]]) == pytest.approx(1 / 3)
    assert gradient_diversity([[a], [np.array([-4.0, 3.0])]]) == pytest.approx(
        1.0
    )
    # Second tensor sums to zero and is left out of the mean.
    assert gradient_diversity([[a, b], [a, -b]]) == pytest.approx(0.5)
    assert math.isnan(gradient_diversity([[b], [-b]]))


# Checks every 3 epochs at e = 2, 5, 8, ...; T(e) = 1 + 1.5 exp(-0.1 e).
DIVERSITIES = [1.0, 0.5, 0.62, 0.6, 0.3, 0.2, 0.25, 0.2, 0.1]
# e=2: p=1. e=5: p=2.0 > 1.910 (1). e=8: p=1.613 < 1.674. e=11: p=1.667 >
# 1.499 (2): switch to 12 bits. e=14: max reset, p=1. e=17: 1.5 > 1.274 (1).
# e=20: 1.2 < 1.203. e=23: 1.5 > 1.150 (2): switch to float32. e=26: final.
EXPECTED_SWITCHES = [11, 23]


def test_policy_on_synthetic_sequence():
    policy = SwitchingPolicy((8, 12, None), patience=2)
    switched = []
    for i, d in enumerate(DIVERSITIES):
        epoch = 3 * i + 2
        p, t, did = policy.update(d, epoch)
        assert t == pytest.approx(1 + 1.5 * math.exp(-0.1 * epoch))
        if did:
            switched.append(epoch)
    assert switched == EXPECTED_SWITCHES
    assert policy.stage == 2 and policy.final
    assert switching_threshold(0) == 2.5


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
    ] == [0] * 4


def test_measured_diversity_is_logged():
    x, y = tiny_data(64)
    model = compiled_fixed_point()
    cb = PrecisionSwitching(schedule=(8, None), resolution=2)
    hist = model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[cb])
    d = hist.history["diversity"]
    assert math.isnan(d[0]) and d[1] > 0 and d[3] > 0
    wrapper = next(
        layer
        for layer in fixed_point_layers(model)
        if isinstance(layer, FixedPointWrapper)
    )
    assert np.any(wrapper.last_gradients[0].numpy())


def test_precision_switch_does_not_retrace(monkeypatch):
    traces = []
    original = FixedPointWrapper.call

    def counting_call(self, *args, **kwargs):
        traces.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FixedPointWrapper, "call", counting_call)
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


# -- state persistence


def test_state_survives_keras_save_and_load(tmp_path):
    x, y = tiny_data()
    model = compiled_fixed_point()
    # e=1: p=1. e=3: p=3.3 > T(3)=2.11, one violation, still 8 bits.
    cb = ScriptedSwitching([1.0, 0.3], schedule=(8, 12, None), resolution=2)
    model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[cb])
    path = os.path.join(tmp_path, "muppet.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    state = precision_state(loaded)
    assert state.violations.numpy() == 1 and state.max_diversity.numpy() == 1.0
    assert [
        layer.word_length.numpy() for layer in fixed_point_layers(loaded)
    ] == [8] * 4
    set_word_length(model, None)
    set_word_length(loaded, None)
    np.testing.assert_array_equal(model(x).numpy(), loaded(x).numpy())


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


def test_cost_model_hand_computed():
    # RTX 2080 Ti, 60% compute: INT8 0.4 + 0.6*13.4/215.2, FP16
    # 0.4 + 0.6*13.4/53.8, FP32 1.
    est = estimate_speedup([8, 8, 16, None])
    int8, fp16 = 0.4 + 0.6 * 13.4 / 215.2, 0.4 + 0.6 * 13.4 / 53.8
    assert est["speedup"] == pytest.approx(4 / (2 * int8 + fp16 + 1))
    assert est["epochs_per_precision"] == {8: 2, 16: 1, 32: 1}
    assert estimate_speedup([32, None])["speedup"] == 1.0
    with pytest.raises(ValueError, match="Unknown `gpu`"):
        estimate_speedup([8], gpu="cpu")


def test_plot_precision_writes_png(tmp_path):
    cb = PrecisionSwitching()
    cb.history = {
        "epoch": [0, 1, 2],
        "precision": [8, 8, 12],
        "p": [math.nan, math.nan, 1.3],
        "T": [2.5, 2.36, 2.23],
    }
    path = plot_precision(cb, str(tmp_path / "p.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["p.png"]


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"keras-mp\[plot\]"):
        plot_precision({"precision": [8]}, str(tmp_path / "p.png"))


# -- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"schedule": (8, 16)}, "must end with None"),
        ({"schedule": (16, 8, None)}, "strictly increase"),
        ({"schedule": (1, 8, None)}, r"2\.\.32.*Received: schedule entry=1"),
        ({"schedule": (8, 33, None)}, "Received: schedule entry=33"),
        ({"schedule": (8.5, None)}, "8.5"),
        ({"schedule": "8,16"}, "sequence of bit widths"),
        ({"resolution": 0}, "resolution"),
        ({"resolution": 1}, "always 1"),
        ({"patience": 1.5}, "patience"),
        ({"schedule": (8, None), "epoch_schedule": (2, 4)}, "epoch_schedule"),
    ],
)
def test_bad_callback_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrecisionSwitching(**kwargs)


def test_bad_models():
    frozen = mlp()
    frozen.trainable = False
    with pytest.raises(ValueError, match="no trainable weights"):
        fixed_point_model(frozen)

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(ValueError, match="Functional API"):
        fixed_point_model(Sub())
    plain = mlp()
    plain.compile("sgd", "sparse_categorical_crossentropy")
    x, y = tiny_data()
    with pytest.raises(ValueError, match="fixed_point_model"):
        plain.fit(x, y, epochs=1, verbose=0, callbacks=[PrecisionSwitching()])
    with pytest.raises(ValueError, match="2..32"):
        set_word_length(compiled_fixed_point(), 40)
