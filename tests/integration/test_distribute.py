"""Every training feature under tf.distribute matches the single-device run.

MirroredStrategy over the two logical CPUs of conftest.py, and (marked
slow) MultiWorkerMirroredStrategy with two worker processes on localhost,
train the scenarios of `resume_worker.py`: QAT with calibrated ranges +
gradual 2:4 sparsity + dynamic loss scaling, and MuPPET with adaptive
precision switching; calibration runs under the strategy too. Against the
single-device run: activation ranges equal, weight ranges and weights within
1e-4, masks identical, precision history identical, loss scale within two
halvings; every replica (worker) holds the same values. A non-finite step
on one replica only is skipped on every replica (and worker), and an
uncalibrated QAT model takes its first-batch range from the global batch.
"""

import json
import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.muppet.model import fixed_point_layers, precision_state
from keras_mp.quantization import twins
from keras_mp.quantization.twins import quantizers
from keras_mp.sparsity.masks import is_2_4_sparse
from keras_mp.sparsity.model import sparse_layers
from tests.integration import resume_worker as rw

WORKER = os.path.join(os.path.dirname(__file__), "resume_worker.py")


# (run name, scenario, options). QAT and 2:4 are compared in float32:
# float16 rounds the two half-batch gradients differently from the full
# batch, and QAT's rounding steps turn that into visibly different weights
# within a few dozen steps (measured: 2% apart in plain float16, 30% with
# QAT), so masks computed from trained weights could not be identical. Loss
# scaling is compared under mixed_float16, where steps overflow.
RUNS = (
    ("sparse_qat", "sparse_qat", {"policy": "float32"}),
    (
        "loss_scale",
        "sparse_qat",
        {"policy": "mixed_float16", "initial_scale": 2.0**22, "epochs": 2},
    ),
    ("muppet", "muppet", {}),
)


@pytest.fixture(scope="module")
def runs(mirrored_strategy):
    """Each run single-device and mirrored: `{(run, kind): (model,
    history, state)}`."""
    out = {}
    for run, scenario, options in RUNS:
        for kind, strategy in (
            ("single", tf.distribute.get_strategy()),
            ("mirrored", mirrored_strategy),
        ):
            model, history = rw.train(scenario, strategy, **options)
            out[run, kind] = (model, history, rw.state(model, history))
    keras.mixed_precision.set_global_policy("float32")
    return out


def _replicas(strategy, variable):
    return [
        np.asarray(v)
        for v in strategy.experimental_local_results(variable.value)
    ]


def _assert_replicas_equal(strategy, variables):
    for v in variables:
        values = _replicas(strategy, v)
        assert len(values) == 2, v.path
        np.testing.assert_array_equal(values[0], values[1], v.path)


def test_float16_loss_scaling_close_to_single_device(runs, mirrored_strategy):
    single = runs["loss_scale", "single"][2]
    model, _, mirrored = runs["loss_scale", "mirrored"]
    steps = 2 * rw.SAMPLES // rw.BATCH
    for run in (single, mirrored):
        # skipped steps do not count as optimizer iterations
        assert run["iterations"] + run["skipped_steps"] == steps
        assert run["skipped_steps"] > 0  # float16 overflow steps happened
    # Which step overflows float16 depends on the partial sums each replica
    # forms (a replica sums half the batch), so the scale may follow the
    # single-device one a step or two apart, never further.
    assert abs(mirrored["skipped_steps"] - single["skipped_steps"]) <= 2
    ratio = np.log2(mirrored["loss_scale"] / single["loss_scale"])
    assert abs(ratio) <= 2
    optimizer = model.optimizer
    assert isinstance(optimizer, keras_mp.LossScaleOptimizer)
    _assert_replicas_equal(
        mirrored_strategy, [optimizer.dynamic_scale, optimizer.iterations]
    )
    # A replica that overflows alone skips the step on every replica (this
    # run measured -inf in a kernel before the all-replica finite check).
    for w in model.weights:
        assert np.all(np.isfinite(w.numpy())), w.path


def test_non_finite_step_on_one_replica_is_skipped_on_all(mirrored_strategy):
    runs = []
    for strategy in (tf.distribute.get_strategy(), mirrored_strategy):
        model, _ = rw.train("nan_step", strategy, epochs=1)
        runs.append((model, model.optimizer))
    (single, single_opt), (model, optimizer) = runs
    assert single_opt.skipped_steps == 1 and single_opt.loss_scale == 128.0
    assert np.all(np.isfinite(single.weights[0].numpy()))
    assert optimizer.skipped_steps == 1 and optimizer.loss_scale == 128.0
    for a, b in zip(single.weights, model.weights):
        value = keras.ops.convert_to_numpy(b)
        assert np.all(np.isfinite(value)), b.path
        np.testing.assert_allclose(value, a.numpy(), rtol=1e-5, atol=1e-6)
    _assert_replicas_equal(
        mirrored_strategy, model.weights + [optimizer.dynamic_scale]
    )


def test_qat_ranges_match_single_device_and_agree_across_replicas(
    runs, mirrored_strategy
):
    single = runs["sparse_qat", "single"][2]
    mirrored = runs["sparse_qat", "mirrored"][2]
    keys = sorted(k for k in single if k.startswith("range/"))
    assert keys == sorted(k for k in mirrored if k.startswith("range/"))
    for key in keys:
        if key.endswith("input_0"):
            # calibrated, then frozen through QAT
            assert mirrored[key] == single[key], key
        else:
            # max|w| of weights trained on all-reduced gradients
            np.testing.assert_allclose(
                mirrored[key], single[key], rtol=1e-4, err_msg=key
            )
    model = runs["sparse_qat", "mirrored"][0]
    variables = [q.quantizer.amax for q in quantizers(model)]
    assert variables
    _assert_replicas_equal(mirrored_strategy, variables)


def test_calibration_under_mirrored_strategy_matches(mirrored_strategy):
    x, _ = rw.image_data()

    def calibrated(strategy, method):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras_mp.quantize_model(
                keras.Sequential(
                    [
                        keras.Input((8, 8, 4)),
                        keras.layers.Conv2D(8, 3, activation="relu"),
                        keras.layers.GlobalAveragePooling2D(),
                        keras.layers.Dense(4),
                    ]
                )
            )
        report = keras_mp.calibrate(
            model, x, method=method, batch_size=32, verbose=0
        )
        return model, list(report.ranges.values())

    for method in ("max", "entropy"):
        _, single = calibrated(tf.distribute.get_strategy(), method)
        model, mirrored = calibrated(mirrored_strategy, method)
        assert mirrored == single, method
        amaxes = [
            q.quantizer.amax for q in quantizers(model) if q.weight is None
        ]
        _assert_replicas_equal(mirrored_strategy, amaxes)
        for amax, value in zip(amaxes, single):
            assert _replicas(mirrored_strategy, amax)[1] == np.float32(value)


def test_2_4_masks_identical_to_single_device_on_every_replica(
    runs, mirrored_strategy
):
    single = runs["sparse_qat", "single"][2]
    model = runs["sparse_qat", "mirrored"][0]
    layers = sparse_layers(model)
    assert {layer.name for layer, _, _ in layers} == {
        "conv_a",
        "conv_b",
        "head",
    }
    for layer, kernel, constraint in layers:
        # gradual 2:4 reached at step 28: masks from trained weights
        assert int(keras.ops.convert_to_numpy(constraint.kept)) == 2
        for mask in _replicas(mirrored_strategy, constraint.mask):
            np.testing.assert_array_equal(
                mask, single[f"mask/{layer.name}"], layer.name
            )
        for value in _replicas(mirrored_strategy, kernel):
            assert is_2_4_sparse(value, constraint.axis)
        _assert_replicas_equal(mirrored_strategy, [kernel])


def test_qat_weights_close_to_single_device(runs, mirrored_strategy):
    single = runs["sparse_qat", "single"][2]
    model, _, mirrored = runs["sparse_qat", "mirrored"]
    keys = [k for k in single if k.startswith("weight/")]
    assert len(keys) == len(model.weights)
    for key in keys:
        np.testing.assert_allclose(
            mirrored[key], single[key], rtol=1e-4, atol=1e-5, err_msg=key
        )
    np.testing.assert_allclose(mirrored["loss"], single["loss"], rtol=1e-4)
    _assert_replicas_equal(mirrored_strategy, model.trainable_weights)


def test_precision_switching_matches_single_device(runs, mirrored_strategy):
    single_history = runs["muppet", "single"][1].history
    model, history, mirrored = runs["muppet", "mirrored"]
    history = history.history
    assert history["precision"] == single_history["precision"]
    assert 8.0 in history["precision"]  # it switched, at the same epoch
    checks = [e for e, d in enumerate(single_history["diversity"]) if d == d]
    assert checks == [e for e, d in enumerate(history["diversity"]) if d == d]
    np.testing.assert_allclose(
        [history["diversity"][e] for e in checks],
        [single_history["diversity"][e] for e in checks],
        rtol=0.1,
    )
    for key in ("precision/stage", "precision/violations"):
        assert mirrored[key] == runs["muppet", "single"][2][key], key
    state = precision_state(model)
    _assert_replicas_equal(mirrored_strategy, state.weights)
    _assert_replicas_equal(
        mirrored_strategy,
        [layer.word_length for layer in fixed_point_layers(model)],
    )


def test_uncalibrated_qat_range_comes_from_the_global_batch(
    mirrored_strategy,
):
    rng = np.random.default_rng(0)
    x = rng.random((32, 8), dtype=np.float32)
    x[16:] *= 3.0  # replica 1's half of the global batch holds the max
    y = rng.random((32, 2), dtype=np.float32)
    ranges = []
    for strategy in (tf.distribute.get_strategy(), mirrored_strategy):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras_mp.quantize_model(
                keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
            )
            model.compile("sgd", "mse")
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        (dense,) = twins.quantized_layers(model)
        ranges.append(float(dense.input_quantizers[0].amax.numpy()))
    assert ranges[0] == pytest.approx(float(np.abs(x).max()))
    assert ranges[1] == pytest.approx(ranges[0])


# -- MultiWorkerMirroredStrategy: two worker processes on localhost


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _run_workers(out_dir, name, timeout):
    """Runs `resume_worker.py name worker` as a 2-worker cluster.

    Returns the exit codes, None for a worker still running `timeout`
    seconds after the start (it is then killed).
    """
    cluster = {"worker": [f"localhost:{p}" for p in _free_ports(2)]}
    procs = []
    for index in range(2):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        with open(out_dir / f"{name}_worker{index}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, name, "worker", str(out_dir)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return codes


def _load(path):
    with np.load(path) as data:
        return dict(data)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Runs both scenarios on a 2-worker cluster; returns the states."""
    out_dir = tmp_path_factory.mktemp("multi_worker")
    codes = _run_workers(out_dir, "all", timeout=600)
    for index, code in enumerate(codes):
        if code != 0:
            log = out_dir / f"all_worker{index}.log"
            pytest.fail(f"worker {index}: {code}\n{log.read_text()[-3000:]}")
    return {
        (name, index): _load(out_dir / f"{name}_worker{index}.npz")
        for name in rw.SCENARIOS
        for index in range(2)
    }


@pytest.mark.slow
def test_multi_worker_workers_agree(workers):
    for name in rw.SCENARIOS:
        a, b = workers[name, 0], workers[name, 1]
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], f"{name} {key}")


@pytest.mark.slow
def test_multi_worker_matches_single_device(workers, runs):
    qat, single = workers["sparse_qat", 0], runs["sparse_qat", "single"][2]
    for key in ("loss_scale", "skipped_steps", "iterations", "kept/head"):
        assert qat[key] == single[key], key
    for key in single:
        if key.startswith("mask/"):
            np.testing.assert_array_equal(qat[key], single[key], key)
        if key.startswith("range/") and key.endswith("input_0"):
            assert qat[key] == single[key], key
        if key.startswith("weight/"):
            np.testing.assert_allclose(
                qat[key], single[key], rtol=1e-4, atol=1e-5, err_msg=key
            )
    fixed, single = workers["muppet", 0], runs["muppet", "single"][2]
    np.testing.assert_array_equal(
        fixed["precision_history"], single["precision_history"]
    )
    for key in ("precision/stage", "precision/violations"):
        assert fixed[key] == single[key], key


@pytest.mark.slow
def test_multi_worker_non_finite_step_is_skipped_without_deadlock(tmp_path):
    codes = _run_workers(tmp_path, "nan_step", timeout=120)
    assert codes == [0, 0], "workers deadlocked or failed"
    states = [_load(tmp_path / f"nan_step_worker{i}.npz") for i in range(2)]
    for state in states:
        assert state["skipped_steps"] == 1 and state["loss_scale"] == 128.0
        assert np.all(np.isfinite(state["weight/000"]))


def test_op_sites_calibrate_and_train_under_mirrored_strategy(
    mirrored_strategy,
):
    """Quantizers at the op sites of a custom layer (each replica traces
    the layer's code in its own thread): calibration as on one device, and
    QAT weights within 1e-4 of the single-device run, equal on both
    replicas."""
    from tests.quantization.test_op_sites import _data, _model

    x = _data(32)
    y = np.random.default_rng(1).normal(size=(32, 4)).astype("float32")

    def trained(strategy):
        with strategy.scope():
            model = keras_mp.quantize_model(_model("hand"))
        report = keras_mp.calibrate(model, x, batch_size=16, verbose=0)
        with strategy.scope():
            model.compile(keras.optimizers.SGD(1e-2), "mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model, report

    single, single_report = trained(tf.distribute.get_strategy())
    model, report = trained(mirrored_strategy)
    assert [n for n in report.ranges if "matmul_" in n]
    # in walk order (the head's automatic name differs between the two)
    assert list(report.ranges.values()) == list(single_report.ranges.values())
    sites = [q for q in quantizers(model) if "/matmul_" in q.name]
    _assert_replicas_equal(mirrored_strategy, [q.quantizer.amax for q in sites])
    for a, b in zip(model.weights, single.weights):
        np.testing.assert_allclose(
            np.asarray(a.value), np.asarray(b.value), rtol=1e-4, atol=1e-6
        )
