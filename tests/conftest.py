"""Shared fixtures. TensorFlow is imported once per session; the CPU is split
into two logical devices so tf.distribute tests can run a 2-replica
MirroredStrategy on one machine."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)


# Test files that share a session fixture's costly measurement run on one
# pytest-xdist worker (`make test` distributes whole files, `--dist
# loadfile`): the golden placement test reads the zoo's fast-subset INT8
# ONNX that tests/onnx/test_zoo.py measures (`zoo_measured`, about a
# minute of exports), which a second worker would measure again.
SAME_WORKER = {
    "tests/integration/test_golden_placement.py": "tests/onnx/test_zoo.py",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope, scope)

    return SharedFileScheduling(config, log)


@pytest.fixture(autouse=True)
def _seed_and_policy():
    """Every test starts seeded and under float32, whatever the last did."""
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(scope="session", autouse=True)
def _no_small_gemm_rule():
    """Most tests build tiny layers (Dense(4)) to test other features:
    keras_mp's default rule would leave every GEMM with K or N below 16
    float (`placement.MIN_GEMM_DIM`), so it is off for them, module and
    session fixtures included. Tests marked `gemm_rule`, and every
    benchmark and example, run the default."""
    from keras_mp.quantization import placement

    default = placement.MIN_GEMM_DIM
    placement.MIN_GEMM_DIM = 0
    yield default
    placement.MIN_GEMM_DIM = default


@pytest.fixture(autouse=True)
def _small_gemm_rule(request, monkeypatch, _no_small_gemm_rule):
    if request.node.get_closest_marker("gemm_rule") is not None:
        from keras_mp.quantization import placement

        monkeypatch.setattr(placement, "MIN_GEMM_DIM", _no_small_gemm_rule)


@pytest.fixture(scope="session")
def fashion_mnist():
    """Real Fashion-MNIST, full arrays, loaded once per session."""
    from keras_mp.datasets import load_fashion_mnist

    return load_fashion_mnist()


@pytest.fixture(scope="session")
def fashion_small(fashion_mnist):
    """A small real slice: 2,048 training and 512 test images."""
    (x, y), (xt, yt) = fashion_mnist
    return (x[:2048], y[:2048]), (xt[:512], yt[:512])


@pytest.fixture(scope="session")
def digits():
    from keras_mp.datasets import load_digits

    return load_digits()


@pytest.fixture(scope="session")
def zoo_measured(tmp_path_factory):
    """`benchmarks.bench_zoo.measure` of a zoo model, once per session: the
    fast zoo tests (tests/onnx/test_zoo.py) and the golden placement test
    (tests/integration/test_golden_placement.py) share each measurement.

    Returns a function of the model name giving its row, plus `int8_onnx`:
    the path of the INT8 ONNX `measure` wrote, None when that stage failed.
    Both test files run the small-GEMM rule as users get it (`gemm_rule`);
    a measurement is shared only between tests with the same rule.
    """
    from benchmarks.bench_zoo import measure
    from keras_mp.quantization import placement

    rows = {}

    def get(name):
        key = (name, placement.MIN_GEMM_DIM)
        if key not in rows:
            directory = tmp_path_factory.mktemp(name)
            row = measure(name, str(directory))
            path = directory / f"{name}_int8.onnx"  # where `measure` puts it
            ok = row["int8_error"] is None and path.exists()
            rows[key] = {**row, "int8_onnx": str(path) if ok else None}
        return rows[key]

    return get


@pytest.fixture(scope="session")
def mirrored_strategy():
    """One strategy per process: several MirroredStrategy objects in one
    process make their collective ops collide (TF InvalidArgumentError)."""
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    return tf.distribute.MirroredStrategy(devices)


def small_cnn(input_shape=(28, 28, 1), num_classes=10):
    """A tiny conv net used across tests (seeded by the autouse fixture)."""
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(num_classes),
        ]
    )


class Subclassed(keras.Model):
    """A subclassed model: its graph is Python code, not data."""

    def __init__(self):
        super().__init__(name="subclassed")
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return self.dense(x)


def tf_keras_like(name="Sequential", module="tf_keras.src.engine.sequential"):
    """An object typed like a tf_keras (Keras 2) model: tf_keras is not
    installed here, and only its type's module matters."""
    return type(name, (), {"__module__": module})()
