"""`calibrate`: ranges from arrays, datasets and generators, per bit width,
and the errors for bad models and data."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.reference import compile_classifier, reference_cnn
from tests.conftest import small_cnn
from tests.quantization.conftest import SHAPE, cnn, images


def test_calibrate_reports_every_quantizer(digits):
    (x, _), _ = digits
    qmodel = keras_mp.quantize_model(small_cnn((8, 8, 1)))
    report = keras_mp.calibrate(
        qmodel, x[:256], method="max", batch_size=64, verbose=0
    )
    assert report.batches == 4 and report.samples == 256
    first = f"{qmodel.model.layers[0].name}/input_0"
    assert report.ranges[first] == pytest.approx(float(x[:256].max()))
    assert report.ranges == report.observed_max  # max: nothing clipped
    for name, amax in report.ranges.items():
        layer_name, _ = name.split("/")
        q = qmodel.get_layer(layer_name).input_quantizers[0]
        assert float(q.amax.numpy()) == pytest.approx(amax)
    assert first in str(report)
    report = keras_mp.calibrate(
        qmodel, x[:256], batch_size=64, num_batches=2, verbose=0
    )
    assert report.batches == 2 and report.samples == 128


def test_a_range_that_clips_more_than_1_percent_is_named():
    """The spiky ReLU data of the demo CNN's stem (see
    test_calibrators.py): entropy clips past the last spike, over 10% of
    the inputs; the warning names the quantizer and the fix, the report
    has the fraction. `max` clips nothing and warns of nothing."""
    import warnings

    import keras

    rng = np.random.default_rng(0)
    relu = 0.6 * np.maximum(rng.laplace(size=40_000), 0.0)
    spikes = np.repeat(np.linspace(0.1, 0.8, 9), 1_000)  # 2% each
    x = rng.permutation(np.concatenate([relu, spikes]))
    x = x.reshape(-1, 8).astype(np.float32)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(16, name="fc")(inputs))
    qmodel = keras_mp.quantize_model(model)
    with pytest.warns(UserWarning, match=r"'fc/input_0' 1\d\.\d%.*auto"):
        report = keras_mp.calibrate(qmodel, x, method="entropy", verbose=0)
    want = float(np.mean(x > report.ranges["fc/input_0"]))
    assert report.saturated["fc/input_0"] == pytest.approx(want, abs=2e-3)
    assert "saturates" in str(report)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = keras_mp.calibrate(qmodel, x, method="max", verbose=0)
    assert report.saturated == {}


def test_array_dataset_and_generator_give_identical_ranges():
    x = np.random.default_rng(0).standard_normal((64, 8, 8, 4))
    x = x.astype(np.float32)
    model = keras_mp.quantize_model(cnn())
    sources = {
        "array": lambda: x,
        "dataset": lambda: tf.data.Dataset.from_tensor_slices(
            (x, np.zeros(64))
        ).batch(16),
        "generator": lambda: (x[i : i + 16] for i in range(0, 64, 16)),
    }
    for method in ("max", "percentile", "entropy", "mse"):
        ranges = {
            name: keras_mp.calibrate(
                model, make(), method=method, batch_size=16, verbose=0
            ).ranges
            for name, make in sources.items()
        }
        assert ranges["array"] == ranges["dataset"] == ranges["generator"]
        assert all(v > 0 for v in ranges["array"].values())


@pytest.mark.parametrize("method", ["entropy", "mse"])
def test_four_bit_layers_get_four_bit_ranges(method):
    """The calibrators are given each quantizer's `num_bits`: a 4-bit
    model clips harder than the same model at 8 bits."""
    x = np.random.default_rng(0).standard_normal((256, 8, 8, 4))
    x = x.astype(np.float32)
    ranges = {}
    for bits in (8, 4):
        config = keras_mp.QuantizeConfig(
            precision=f"int{bits}", block_size=None
        )
        qmodel = keras_mp.quantize_model(cnn(), config=config)
        report = keras_mp.calibrate(qmodel, x, method=method, verbose=0)
        ranges[bits] = report.ranges
    for name, eight in ranges[8].items():
        assert ranges[4][name] < 0.9 * eight, (name, ranges[4][name], eight)


def test_qat_with_frozen_ranges_keeps_activation_ranges(fashion_small):
    (x, y), (xt, yt) = fashion_small
    model = compile_classifier(reference_cnn(width=8))
    model.fit(x, y, epochs=2, batch_size=64, verbose=0)
    float_acc = model.evaluate(xt, yt, verbose=0)[1]
    qmodel = keras_mp.quantize_model(model)
    report = keras_mp.calibrate(qmodel, x[:512], verbose=0)
    compile_classifier(qmodel, learning_rate=1e-4)
    qmodel.fit(x[:1024], y[:1024], epochs=1, batch_size=64, verbose=0)
    for name, amax in report.ranges.items():
        layer_name, _ = name.split("/")
        q = qmodel.get_layer(layer_name).input_quantizers[0]
        assert float(q.amax.numpy()) == pytest.approx(amax)
    acc = qmodel.evaluate(xt, yt, verbose=0)[1]
    assert acc > float_acc - 0.05, (acc, float_acc)


def _inf_in_second_batch(model):
    x = images()
    x[20, 1, 2, 3] = np.inf
    keras_mp.calibrate(model, x, batch_size=16, verbose=0)


def _nan_inside(model):
    model = keras_mp.quantize_model(cnn("nan_inside"))
    conv = model.get_layer("conv")
    conv.kernel.assign(np.full(conv.kernel.shape, np.nan, "float32"))
    keras_mp.calibrate(model, images(), verbose=0)


def _calibrate(data, **kwargs):
    return lambda model: keras_mp.calibrate(model, data, verbose=0, **kwargs)


X = images()
BAD = {
    "calibrate_float_model": (
        lambda model: keras_mp.calibrate(cnn(), X, verbose=0),
        ValueError,
        "no activation quantizer.*keras_mp.quantize_model",
    ),
    "calibrate_unknown_method": (
        _calibrate(X, method="kl"),
        ValueError,
        "Unknown calibration method.*'entropy'.*Received: method='kl'",
    ),
    "calibrate_percentile_zero": (
        _calibrate(X, method="percentile", percentile=0),
        ValueError,
        r"`percentile` must be in \(0, 100\]. Received: 0",
    ),
    "calibrate_empty_array": (
        _calibrate(X[:0]),
        ValueError,
        "`calibrate` data is empty",
    ),
    "calibrate_empty_dataset": (
        _calibrate(tf.data.Dataset.from_tensor_slices(X[:0]).batch(4)),
        ValueError,
        "`calibrate` data is empty",
    ),
    "calibrate_wrong_shape": (
        _calibrate(X[..., :1]),
        ValueError,
        r"shape \(32, 8, 8, 1\), but model 'q' expects \(None, 8, 8, 4\)",
    ),
    "calibrate_missing_batch_axis": (
        _calibrate(list(X)),
        ValueError,
        r"shape \(8, 8, 4\).*batch first",
    ),
    "calibrate_nan_in_data": (
        _calibrate(np.where(X > 0.999, np.nan, X)),
        ValueError,
        r"NaN/Inf \(batch 0, first at index \(",
    ),
    "calibrate_inf_in_second_batch": (
        _inf_in_second_batch,
        ValueError,
        r"NaN/Inf \(batch 1, first at index \(4, 1, 2, 3\)\)",
    ),
    "calibrate_nan_inside_model": (
        _nan_inside,
        ValueError,
        r"non-finite value\(s\) at the input of 'head/input_0' "
        r"\(batch 0\)",
    ),
    "calibrate_path_instead_of_data": (
        _calibrate("x.npy"),
        TypeError,
        "`data` must be a NumPy array, a tf.data.Dataset.*Received: str",
    ),
    "calibrate_dict_with_wrong_key": (
        _calibrate({"x": X}),
        ValueError,
        r"dict with keys \['x'\], but model 'q' has inputs.*unexpected",
    ),
    "calibrate_number_as_data": (_calibrate(5), TypeError, "Received: int"),
    "calibrate_path_instead_of_model": (
        lambda model: keras_mp.calibrate("model.keras", X),
        TypeError,
        r"`calibrate` expects a Keras 3 `keras.Model`",
    ),
    "calibrate_batch_size_zero": (
        _calibrate(X, batch_size=0),
        ValueError,
        "`batch_size` must be a positive integer. Received: 0",
    ),
    "calibrate_num_batches_zero": (
        _calibrate(X, num_batches=0),
        ValueError,
        "`num_batches` must be a positive integer.*Received: 0",
    ),
    "calibrate_infinite_dataset": (
        _calibrate(tf.data.Dataset.from_tensor_slices(X).batch(8).repeat()),
        ValueError,
        r"infinite tf.data.Dataset \(`repeat\(\)` without a count\), and "
        r"`num_batches` is None.*Pass `num_batches=`",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_the_fault(case, quantized):
    call, error, match = BAD[case]
    with pytest.raises(error, match=match):
        call(quantized)


def test_a_failed_calibration_leaves_the_model_usable(quantized):
    before = quantized(X)
    with pytest.raises(ValueError):
        _calibrate(np.where(X > 0.999, np.nan, X))(quantized)
    np.testing.assert_array_equal(quantized(X), before)


def test_infinite_dataset_with_num_batches_calibrates(quantized):
    endless = tf.data.Dataset.from_tensor_slices(X).batch(8).repeat()
    report = keras_mp.calibrate(quantized, endless, num_batches=3, verbose=0)
    assert report.batches == 3 and report.samples == 24


PIXELS = (X * 255).astype("uint8")


@pytest.mark.parametrize(
    "data",
    [PIXELS, tf.data.Dataset.from_tensor_slices((PIXELS, PIXELS[:, 0, 0, 0]))],
    ids=["array", "dataset_with_labels"],
)
def test_integer_images_for_a_float_input_warn(quantized, data):
    """A warning, not an error: the model may take raw pixels."""
    with pytest.warns(
        UserWarning,
        match=r"input 'input_0' of model 'q' is float32, but the "
        r"data for it is uint8.*the ranges will fit raw integer values "
        r"\(0..255",
    ):
        report = keras_mp.calibrate(
            quantized,
            data.batch(8) if hasattr(data, "batch") else data,
            verbose=0,
        )
    assert report.observed_max["conv/input_0"] == 254


def test_integer_images_are_fine_for_a_model_that_rescales_them():
    model = keras.Sequential(
        [keras.Input(SHAPE), keras.layers.Rescaling(1 / 255), *cnn().layers]
    )
    q = keras_mp.quantize_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras_mp.calibrate(q, PIXELS, verbose=0)
