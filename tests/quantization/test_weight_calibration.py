"""Weight calibration (max, MSE, AWQ, GPTQ) on a trained Dense layer: the
layer output error on held-out inputs, with outlier input channels."""

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

from keras_mp.quantization import kernel_calibration as wc
from keras_mp.quantization.blocks import block_quantize_dequantize


@pytest.fixture(scope="module")
def trained():
    """The 256 -> 128 hidden Dense of an MLP trained on sklearn's digits,
    its inputs on the digits (half for calibration, half held out) with
    four live input channels made outliers (x 30), as in language
    models."""
    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu", name="in"),
            keras.layers.Dense(128, activation="relu", name="hidden"),
            keras.layers.Dense(10, name="out"),
        ]
    )
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(x, digits.target, epochs=8, batch_size=64, verbose=0)
    assert history.history["accuracy"][-1] > 0.9
    features = keras.ops.convert_to_numpy(model.get_layer("in")(x))
    live = np.flatnonzero(features[::2].mean(0) > 0.1)
    outliers = live[[3, 50, 97, 150]]
    features[:, outliers] *= 30.0
    kernel = keras.ops.convert_to_numpy(model.get_layer("hidden").kernel)
    return kernel, features[::2], features[1::2], outliers


def _error(trained, quantized, input_scale=None):
    kernel, _, held_out, _ = trained
    return wc.output_error(kernel, held_out, quantized, input_scale)


@pytest.mark.parametrize("block_size", [64, 128])
def test_gptq_beats_max_on_the_layer_output(trained, block_size):
    kernel, calib, *_ = trained
    plain = block_quantize_dequantize(kernel, "int4", block_size).numpy()
    result = wc.gptq(kernel, calib, block_size)
    assert result.scale.shape == (256 // block_size, 128)
    assert _error(trained, result.kernel) < 0.7 * _error(trained, plain)
    # The GPTQ kernel lies on its scales' grid: export writes it exactly.
    again = block_quantize_dequantize(
        result.kernel, "int4", block_size, scale=result.scale
    ).numpy()
    np.testing.assert_array_equal(again, result.kernel)


def test_awq_beats_max_on_activations_with_outlier_channels(trained):
    kernel, calib, _, outliers = trained
    plain = block_quantize_dequantize(kernel, "int4").numpy()
    result = wc.awq(kernel, calib)
    assert set(result.errors) == set(wc.ALPHAS) and result.alpha > 0
    quantized = block_quantize_dequantize(result.kernel, "int4").numpy()
    awq_error = _error(trained, quantized, result.input_scale)
    assert awq_error < 0.8 * _error(trained, plain)
    # Outlier channels get the largest scales: their weights are kept
    # finer.
    assert set(np.argsort(result.scales)[-4:]) == set(outliers)


@pytest.mark.parametrize("format", ["nvfp4", "mxfp8"])
def test_awq_searches_in_any_block_format(trained, format):
    kernel, calib, *_ = trained
    result = wc.awq(kernel, calib, format=format, alphas=(0.0, 0.5))
    assert result.alpha in (0.0, 0.5)
    assert result.errors[result.alpha] == min(result.errors.values())


def test_mse_scales_never_lose_to_max_on_the_weights(trained):
    kernel = trained[0]
    top = wc.max_scales(kernel)
    best = wc.mse_scales(kernel)
    assert np.all(best <= top) and np.any(best < top)

    def weight_error(scale):
        q = block_quantize_dequantize(kernel, "int4", scale=scale).numpy()
        return np.sum((q - kernel) ** 2)

    assert weight_error(best) < weight_error(top)


def test_dead_input_channels_get_zero_rows():
    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(64, 8)).astype("float32")
    x = rng.normal(size=(32, 64)).astype("float32")
    x[:, 5] = 0
    result = wc.gptq(kernel, x, block_size=32)
    assert not np.any(result.kernel[5])
    assert np.all(np.isfinite(result.kernel))


def test_errors_say_what_was_received():
    w = np.zeros((64, 4), np.float32)
    with pytest.raises(ValueError, match=r"\(K, N\).*shape=\(2, 32, 4\)"):
        wc.gptq(np.zeros((2, 32, 4)), np.zeros((3, 64)))
    with pytest.raises(ValueError, match="K=64.*inputs.shape=.3, 32"):
        wc.awq(w, np.zeros((3, 32)))
    with pytest.raises(ValueError, match="damping=1.5"):
        wc.gptq(w, np.zeros((3, 64)), 32, damping=1.5)
    with pytest.raises(ValueError, match="multiple of block_size"):
        wc.gptq(np.zeros((96, 4)), np.zeros((3, 96)), 64)
