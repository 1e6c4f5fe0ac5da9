"""Trains one keras_mp scenario, in its own process or imported by a test.

Two scenarios, each a `fit` that carries state a resumed or distributed run
must reproduce:

- `sparse_qat`: QAT (calibrated ranges) + gradual 2:4 sparsity + dynamic
  loss scaling under `mixed_float16`: masks, weight and activation ranges,
  loss scale and skipped steps.
- `muppet`: MuPPET fixed-point training with adaptive `PrecisionSwitching`:
  word lengths, stage, violation count, maximum diversity, window sums.

`nan_step` (a NaN on the second replica under loss scaling) is a third
builder, for test_distribute.py only.

Command line (used by test_resume.py and test_distribute.py):

    python tests/integration/resume_worker.py SCENARIO MODE OUT_DIR

MODE is one of:

- `interrupt`: train with `BackupAndRestore(OUT_DIR/backup)`; at
  `KILL_AT[SCENARIO]` (epoch, batch) write `OUT_DIR/ready` and wait to be
  killed by the test.
- `resume`: train again with the same `BackupAndRestore` (it resumes) and
  save the final state to `OUT_DIR/resumed.npz`; then, in the same process,
  train uninterrupted and save `OUT_DIR/reference.npz`.
- `worker`: one `MultiWorkerMirroredStrategy` worker (cluster from
  `TF_CONFIG`); SCENARIO, or every scenario in turn for `all`, states
  saved to `OUT_DIR/<scenario>_worker<index>.npz`.

TensorFlow is imported only through keras and keras_mp, and op determinism
is switched on in the worker process so runs can be compared bit for bit.
Keras 3.15's own `fit` fails under MultiWorkerMirroredStrategy for every
model; `worker` mode patches it first (see `_patch_keras_multi_worker_fit`).
"""

import json
import os
import signal
import sys
import time

import numpy as np

EPOCHS = 6
BATCH = 16
SAMPLES = 128
# (epoch, batch) at which `interrupt` mode stops and waits for the signal.
KILL_AT = {"sparse_qat": (2, 3), "muppet": (4, 2)}


def image_data():
    """Seeded 8x8x4 images with 4 learnable classes."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 8, 8, 4)).astype("float32")
    w = rng.normal(size=(4, 4))
    y = np.argmax(x.mean(axis=(1, 2)) @ w, axis=-1)
    return x, y


def vector_data():
    """Seeded 16-feature vectors with 3 learnable classes."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, 16)).astype("float32")
    w = rng.normal(size=(16, 3))
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(SAMPLES, 3)), axis=-1)
    return x, y


def sparse_qat(strategy, policy="mixed_float16", initial_scale=2.0**15):
    """QAT + 2:4 + loss scaling. Returns `(model, (x, y), callbacks)`."""
    import keras

    import keras_mp

    keras.utils.set_random_seed(0)
    keras_mp.enable_mixed_precision(policy)
    L = keras.layers
    x, y = image_data()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 4)),
                L.Conv2D(8, 3, activation="relu", name="conv_a"),
                L.Conv2D(8, 3, activation="relu", name="conv_b"),
                L.GlobalAveragePooling2D(name="pool"),
                L.Dense(4, dtype="float32", name="head"),
            ],
            name="sparse_qat",
        )
        model = keras_mp.quantize_model(model)
    keras_mp.calibrate(model, x[:64], method="percentile", verbose=0)
    with strategy.scope():
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9),
            initial_scale=initial_scale,
            dynamic_growth_steps=4,
        )
        model.compile(
            optimizer,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    sparsity = keras_mp.StructuredSparsity(
        schedule="gradual", begin_step=4, end_step=28
    )
    return model, (x, y), [sparsity]


def muppet(strategy):
    """MuPPET + adaptive switching. Returns `(model, (x, y), callbacks)`."""
    import keras

    import keras_mp

    keras.utils.set_random_seed(0)
    keras_mp.enable_mixed_precision("float32")
    L = keras.layers
    x, y = vector_data()
    with strategy.scope():
        base = keras.Sequential(
            [
                keras.Input((16,)),
                L.Dense(32, activation="relu", name="hidden"),
                L.Dense(3, name="head"),
            ],
            name="muppet",
        )
        model = keras_mp.fixed_point_model(base, seed=0)
        model.compile(
            keras.optimizers.SGD(0.05),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    # Two epochs at a large step, then a small one: the last-minibatch
    # gradients turn from scattered to aligned, the window diversity drops
    # and the rule switches 6 -> 8 bits at the check after epoch 3.
    warmup = keras.callbacks.LearningRateScheduler(
        lambda epoch: 2.0 if epoch < 2 else 0.05
    )
    switching = keras_mp.PrecisionSwitching(
        schedule=(6, 8, 12, None),
        resolution=2,
        patience=1,
        hold_learning_rate=False,
    )
    return model, (x, y), [warmup, switching]


def nan_step(strategy):
    """A NaN in the last sample of batch 2 under dynamic loss scaling.

    That sample lands on the second replica (or worker) of a 2-way
    strategy. The step must be skipped everywhere, with no NaN in the
    weights. Returns `(model, (x, y), callbacks)`.
    """
    import keras

    import keras_mp

    keras.utils.set_random_seed(0)
    keras_mp.enable_mixed_precision("float32")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, 8)).astype("float32")
    y = rng.normal(size=(4 * BATCH, 2)).astype("float32")
    x[3 * BATCH - 1, 3] = np.nan
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(2, name="dense")],
            name="nan_step",
        )
        optimizer = keras_mp.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=256.0
        )
        model.compile(optimizer, "mse")
    return model, (x, y), []


SCENARIOS = {"sparse_qat": sparse_qat, "muppet": muppet}
BUILDERS = {**SCENARIOS, "nan_step": nan_step}
# Options of the multi-worker runs. float32: a float16 overflow on one
# worker only makes the workers take different branches of the loss-scale
# step and wait on each other forever (see test_distribute.py).
# The NaN scenario runs one epoch: its non-finite batch comes round once.
WORKER_OPTIONS = {
    "sparse_qat": {"policy": "float32"},
    "nan_step": {"epochs": 1},
}


def train(name, strategy=None, extra_callbacks=(), epochs=EPOCHS, **options):
    """Builds scenario `name` under `strategy` and fits it.

    The scenario's own callbacks come first, so `PrecisionSwitching`'s
    epoch-end update is in a `BackupAndRestore` checkpoint (as its docs say).

    Args:
        name: str. A key of `BUILDERS`.
        strategy: a `tf.distribute.Strategy`. Defaults to the default one.
        extra_callbacks: callbacks listed after the scenario's own.
        epochs: int. Defaults to `EPOCHS`.
        **options: passed to the scenario builder (e.g. `policy`).

    Returns:
        `(model, history)`.
    """
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    model, (x, y), callbacks = BUILDERS[name](strategy, **options)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks + list(extra_callbacks),
    )
    return model, history


def _numpy(variable):
    import keras

    return np.asarray(keras.ops.convert_to_numpy(variable))


def state(model, history=None):
    """Everything a resumed or distributed run must reproduce, as arrays.

    Keys: `weight/NNN` (every model weight, in order), `mask/<layer>`,
    `range/<layer>/<input or weight>`, `loss_scale`, `skipped_steps`,
    `iterations`, `word_length/<layer>`, `precision/<variable>`, and from
    the history `loss` and `precision_history`.
    """
    from keras_mp.muppet.model import fixed_point_layers, precision_state
    from keras_mp.quantization.twins import quantizers
    from keras_mp.sparsity.model import sparse_layers

    out = {}
    for i, v in enumerate(model.weights):
        out[f"weight/{i:03d}"] = _numpy(v)
    for layer, _, constraint in sparse_layers(model):
        out[f"mask/{layer.name}"] = _numpy(constraint.mask)
        out[f"kept/{layer.name}"] = _numpy(constraint.kept)
    for q in quantizers(model):
        out[f"range/{q.name}"] = _numpy(q.quantizer.amax)
    optimizer = model.optimizer
    out["iterations"] = _numpy(optimizer.iterations)
    if hasattr(optimizer, "dynamic_scale"):
        out["loss_scale"] = np.asarray(optimizer.loss_scale)
        out["skipped_steps"] = np.asarray(optimizer.skipped_steps)
    for layer in fixed_point_layers(model):
        out[f"word_length/{layer.name}"] = _numpy(layer.word_length)
    precision = precision_state(model)
    if precision is not None:
        for v in precision.weights:
            out[f"precision/{v.name}"] = _numpy(v)
    if history is not None:
        out["loss"] = np.asarray(history.history["loss"])
        if "precision" in history.history:
            out["precision_history"] = np.asarray(history.history["precision"])
    return out


def _pause_for_kill(out_dir, at):
    import keras

    class PauseForKill(keras.callbacks.Callback):
        """Stops mid-epoch at `at` and waits for the test's signal."""

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == at:
                ready = os.path.join(out_dir, "ready")
                with open(ready + ".tmp", "w") as f:
                    f.write(json.dumps({"epoch": self.epoch, "batch": batch}))
                os.replace(ready + ".tmp", ready)  # never seen half-written
                # Short sleeps: the kernel may deliver the signal to one of
                # TensorFlow's threads, and then a long sleep in the main
                # thread is not interrupted (CPython raises KeyboardInterrupt
                # only when the main thread next runs bytecode).
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline:
                    time.sleep(0.05)

    return PauseForKill()


def _patch_keras_multi_worker_fit():
    """Makes Keras 3.15's `fit` run under MultiWorkerMirroredStrategy.

    Two upstream bugs stop any Keras 3 model, keras_mp or not: `fit`
    reduces the first (x, y) batch as one nested PerReplica value, which
    the collective strategy cannot (keras-team/keras#20585), and it
    averages the scalar logs over axis 0 (tensorflow/tensorflow#72388).
    The batch only serves to build shapes, so take the local replica's;
    average the logs over workers without an axis.
    """
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    build = trainer.TensorFlowTrainer._maybe_symbolic_build
    reduce = trainer.reduce_per_replica

    def local(value, strategy):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is not None and strategy is not None:
            for _, _, it in iterator:
                data_batch = tf.nest.map_structure(
                    lambda v: local(v, strategy), next(it)
                )
                break
        return build(self, data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and (
            trainer._collective_all_reduce_multi_worker(strategy)
        ):
            return tf.nest.map_structure(
                lambda v: strategy.reduce("MEAN", v, axis=None), values
            )
        return reduce(values, strategy, reduction)

    trainer.TensorFlowTrainer._maybe_symbolic_build = maybe_symbolic_build
    trainer.reduce_per_replica = reduce_per_replica


def _save(path, arrays):
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def main(argv):
    name, mode, out_dir = argv
    # Ctrl-C semantics whatever the parent left us: a shell starts
    # background jobs (`cmd &`) with SIGINT ignored, children inherit that,
    # and Python then never raises KeyboardInterrupt (CI hung on it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import keras
    import tensorflow as tf

    if mode == "worker":
        # Before any other TensorFlow call: it starts the collective runtime.
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        _patch_keras_multi_worker_fit()
    from keras_mp.quantization import placement

    # The small-GEMM rule off, as tests/conftest.py sets it for the
    # in-process runs these are compared with (test_distribute.py's
    # single-device run): with it on here, the 10-class head would be
    # quantized there and float here, and the weights would differ.
    placement.MIN_GEMM_DIM = 0
    tf.config.experimental.enable_op_determinism()
    backup_dir = os.path.join(out_dir, "backup")
    if mode == "interrupt":
        train(
            name,
            extra_callbacks=[
                keras.callbacks.BackupAndRestore(backup_dir),
                _pause_for_kill(out_dir, KILL_AT[name]),
            ],
        )
        raise SystemExit("not killed: the test never sent its signal")
    if mode == "resume":
        backup = keras.callbacks.BackupAndRestore(backup_dir)
        model, history = train(name, extra_callbacks=[backup])
        _save(os.path.join(out_dir, "resumed.npz"), state(model, history))
        model, history = train(name)
        _save(os.path.join(out_dir, "reference.npz"), state(model, history))
        return
    if mode == "worker":
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        for scenario in SCENARIOS if name == "all" else [name]:
            model, history = train(
                scenario, strategy, **WORKER_OPTIONS.get(scenario, {})
            )
            _save(
                os.path.join(out_dir, f"{scenario}_worker{index}.npz"),
                state(model, history),
            )
        return
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
