import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp


def _mlp():
    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(64, activation="tanh"),
            keras.layers.Dense(64, activation="tanh"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


def _data(n=256):
    rng = np.random.default_rng(0)
    return (
        rng.random((n, 32), dtype=np.float32),
        rng.random((n, 1), dtype=np.float32),
    )


def test_float16_gradients_underflow_without_scaling_and_survive_with_it():
    keras_mp.enable_mixed_precision("mixed_float16")
    model = _mlp()
    x, y = _data()
    opt = keras_mp.LossScaleOptimizer(keras.optimizers.SGD())
    zero_fraction = {}
    for name, scale in (("none", 1.0), ("scaled", opt.loss_scale)):
        with tf.GradientTape() as tape:
            # A small loss (e.g. a weighted auxiliary term): its gradients
            # fall below float16's smallest subnormal (6e-8).
            loss = 1e-5 * tf.reduce_mean((model(x) - y) ** 2)
            loss = loss * scale
        grads = tape.gradient(loss, model.trainable_variables)
        kernel = grads[0].numpy()
        zero_fraction[name] = float(np.mean(kernel == 0))
    assert zero_fraction["none"] > 0.99  # underflow: nothing to learn from
    assert zero_fraction["scaled"] < 0.01


def _built_optimizer(**kwargs):
    var = keras.Variable(np.ones((3,), "float32"))
    opt = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), **kwargs)
    opt.build([var])
    return opt, var


def test_overflow_skips_step_halves_scale_and_counts():
    opt, var = _built_optimizer(initial_scale=1024.0)
    opt.apply([tf.constant([1.0, np.inf, 1.0])], [var])
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0, 1.0])
    assert opt.loss_scale == 512.0 and opt.skipped_steps == 1
    opt.apply([tf.constant([np.nan, 0.0, 0.0])], [var])
    assert opt.loss_scale == 256.0 and opt.skipped_steps == 2
    np.testing.assert_array_equal(var.numpy(), [1.0, 1.0, 1.0])


def test_scale_grows_after_configured_finite_steps():
    opt, var = _built_optimizer(initial_scale=8.0, dynamic_growth_steps=3)
    for _ in range(2):
        opt.apply([tf.constant([8.0, 8.0, 8.0])], [var])
        assert opt.loss_scale == 8.0
    opt.apply([tf.constant([8.0, 8.0, 8.0])], [var])
    assert opt.loss_scale == 16.0
    # gradients were unscaled before the update: 3 steps of 0.1 * 1.0
    np.testing.assert_allclose(var.numpy(), [0.7] * 3, rtol=1e-6)


def test_bounds_are_respected():
    opt, var = _built_optimizer(
        initial_scale=4.0, dynamic_growth_steps=1, min_scale=2.0, max_scale=8.0
    )
    for _ in range(5):
        opt.apply([tf.constant([1.0, 1.0, 1.0])], [var])
    assert opt.loss_scale == 8.0
    for _ in range(5):
        opt.apply([tf.constant([np.inf] * 3)], [var])
    assert opt.loss_scale == 2.0 and opt.skipped_steps == 5


def test_custom_training_loop_scale_loss_and_apply():
    keras_mp.enable_mixed_precision("mixed_float16")
    model = _mlp()
    x, _ = _data(64)
    y = x[:, :1] - x[:, 1:2]  # a learnable target
    opt = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    losses = []
    for _ in range(30):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert opt.loss_scale == 2.0**15 and opt.skipped_steps == 0


def test_compile_does_not_wrap_again_and_monitor_logs(tmp_path):
    keras_mp.enable_mixed_precision("mixed_float16")
    model = _mlp()
    opt = keras_mp.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0**20, max_scale=2.0**21
    )
    model.compile(opt, "mse")
    assert model.optimizer is opt
    x, y = _data(64)
    history = model.fit(
        x,
        y,
        epochs=2,
        batch_size=16,
        verbose=0,
        callbacks=[keras_mp.LossScaleMonitor()],
    )
    assert history.history["loss_scale"][-1] == opt.loss_scale
    assert history.history["skipped_steps"][-1] == opt.skipped_steps
    assert opt.loss_scale <= 2.0**21

    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is keras_mp.LossScaleOptimizer
    assert loaded.optimizer.loss_scale == opt.loss_scale
    assert loaded.optimizer.skipped_steps == opt.skipped_steps
    assert loaded.optimizer.max_scale == 2.0**21
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0)
    )


def test_mirrored_strategy_matches_single_device(mirrored_strategy):
    x, y = _data(64)
    results = []
    for strategy in (tf.distribute.get_strategy(), mirrored_strategy):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            keras_mp.enable_mixed_precision("mixed_float16")
            model = _mlp()
            opt = keras_mp.LossScaleOptimizer(
                keras.optimizers.SGD(0.01),
                initial_scale=2.0**30,
                max_scale=2.0**30,
            )
            model.compile(opt, "mse")
        model.fit(x, y, epochs=1, batch_size=16, verbose=0, shuffle=False)
        results.append((opt.loss_scale, opt.skipped_steps))
    assert results[0] == results[1]
    assert results[0][1] > 0  # 2**30 overflows float16 at least once


def _tf_keras_optimizer():
    # tf_keras is not installed here; only the type's module matters.
    return type("Adam", (), {"__module__": "tf_keras.src.optimizers.adam"})()


def _sgd():
    return keras.optimizers.SGD()


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: keras_mp.LossScaleOptimizer(
                keras_mp.LossScaleOptimizer(_sgd())
            ),
            ValueError,
            r"already a LossScaleOptimizer.*\(`opt.inner_optimizer`\).*"
            "Received: LossScaleOptimizer",
        ),
        (
            lambda: keras_mp.LossScaleOptimizer(
                keras.optimizers.LossScaleOptimizer(_sgd())
            ),
            ValueError,
            "already a LossScaleOptimizer",
        ),
        (
            lambda: keras_mp.LossScaleOptimizer("adam"),
            TypeError,
            r"Keras 3 optimizer, e.g. `keras.optimizers.Adam\(\)`. "
            "Received: builtins.str",
        ),
        (
            lambda: keras_mp.LossScaleOptimizer(_tf_keras_optimizer()),
            TypeError,
            "Received: tf_keras.src.optimizers.adam.Adam",
        ),
        (
            lambda: keras_mp.LossScaleOptimizer(
                _sgd(), min_scale=8.0, max_scale=2.0
            ),
            ValueError,
            "0 < min_scale <= max_scale. Received: min_scale=8.0, "
            "max_scale=2.0",
        ),
        (
            lambda: keras_mp.LossScaleOptimizer(_sgd(), initial_scale=2.0**30),
            ValueError,
            r"`initial_scale` must lie within \[min_scale, max_scale\]. "
            "Received: initial_scale=1073741824.0",
        ),
        (
            lambda: keras_mp.LossScaleOptimizer(_sgd(), initial_scale=0.5),
            ValueError,
            "Received: initial_scale=0.5, min_scale=1.0",
        ),
        (
            lambda: keras_mp.LossScaleOptimizer(_sgd(), dynamic_growth_steps=0),
            ValueError,
            "`dynamic_growth_steps` must be a positive integer. "
            "Received: dynamic_growth_steps=0",
        ),
        (
            lambda: keras_mp.LossScaleOptimizer(
                _sgd(), dynamic_growth_steps=2.5
            ),
            ValueError,
            "Received: dynamic_growth_steps=2.5",
        ),
        (
            lambda: keras_mp.LossScaleOptimizer(_sgd(), initial_scale="big"),
            ValueError,
            "`initial_scale` must be a positive finite number. "
            "Received: initial_scale='big'",
        ),
        (
            lambda: keras_mp.LossScaleOptimizer(_sgd(), max_scale=np.inf),
            ValueError,
            "Received: max_scale=inf",
        ),
        (
            lambda: keras_mp.LossScaleMonitor(log_every=0),
            ValueError,
            "`log_every` must be >= 1. Received: log_every=0",
        ),
    ],
)
def test_bad_arguments_say_what_to_do(make, error, match):
    with pytest.raises(error, match=match):
        make()
