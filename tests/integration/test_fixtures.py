"""`.keras` files saved by an earlier release still load and compute the same.

The fixtures were written by `fixtures/make_fixtures.py` beside this file,
with the code from before the package moved to one folder per feature:
every registered `keras_mp>` name and every piece of saved state must keep
loading.
"""

import os

import keras
import numpy as np
import pytest

import keras_mp
from tests.tolerance import assert_computes_like

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _load(name):
    model = keras.saving.load_model(
        os.path.join(FIXTURES, f"{name}.keras"), safe_mode=True
    )
    return model, np.load(os.path.join(FIXTURES, f"{name}.npz"))


# What each fixture computes in (its narrowest compute dtype) and whether it
# rounds activations to an 8-bit grid: the outputs are compared within the
# tolerance that follows (tests/tolerance.py), since they were computed on
# another CPU; what the files store is compared exactly below.
COMPUTES = {
    "quantized": ("float32", True),
    "sparse": ("float32", False),
    "loss_scaled": ("float16", False),
}


@pytest.mark.parametrize("name", list(COMPUTES))
def test_fixture_outputs_unchanged(name):
    model, saved = _load(name)
    dtype, quantized = COMPUTES[name]
    assert_computes_like(
        model.predict(saved["x"], verbose=0), saved["y"], dtype, quantized
    )


@pytest.mark.parametrize("name", list(COMPUTES))
def test_fixture_tolerance_catches_a_changed_weight(name):
    model, saved = _load(name)
    kernel = next(  # "conv2/kernel", or "quant_conv2/conv2/kernel"
        v for v in model.weights if v.path.endswith("conv2/kernel")
    )
    kernel.assign(kernel * 1.01)
    dtype, quantized = COMPUTES[name]
    with pytest.raises(AssertionError):
        assert_computes_like(
            model.predict(saved["x"], verbose=0), saved["y"], dtype, quantized
        )


def test_quantized_fixture_keeps_ranges():
    model, saved = _load("quantized")
    ranges = {
        v.path: v.numpy() for v in model.weights if v.path.endswith("amax")
    }
    expected = {
        k[len("range:") :]: saved[k] for k in saved if k.startswith("range:")
    }
    assert ranges.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_array_equal(ranges[path], value, path)
        assert np.all(value > 0), path


def test_sparse_fixture_keeps_masks_and_loss_scale():
    model, saved = _load("sparse")
    for key in (k for k in saved if k.startswith("mask:")):
        layer = model.get_layer(key[len("mask:") :])
        np.testing.assert_array_equal(
            layer.kernel_constraint.mask.numpy(), saved[key]
        )
        assert keras_mp.is_2_4_sparse(
            layer.kernel.numpy(), layer.kernel_constraint.axis
        )
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert model.optimizer.loss_scale == float(saved["loss_scale"])


def test_loss_scaled_fixture_keeps_optimizer_state():
    model, saved = _load("loss_scaled")
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert model.optimizer.loss_scale == float(saved["loss_scale"])
    assert model.optimizer.skipped_steps == int(saved["skipped_steps"]) > 0
    assert model.get_layer("conv").compute_dtype == "float16"
    assert model.get_layer("head").compute_dtype == "float32"


def test_muppet_fixture_keeps_word_length():
    model, saved = _load("muppet")
    words = [
        float(v.word_length.numpy())
        for v in keras_mp.muppet.fixed_point_layers(model)
    ]
    np.testing.assert_array_equal(words, saved["word_lengths"])
    keras_mp.muppet.set_word_length(model, None)  # float32, not stochastic
    assert_computes_like(
        model.predict(saved["x"], verbose=0), saved["y"], "float32"
    )
