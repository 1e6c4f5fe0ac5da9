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

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _load(name):
    model = keras.saving.load_model(
        os.path.join(FIXTURES, f"{name}.keras"), safe_mode=True
    )
    return model, np.load(os.path.join(FIXTURES, f"{name}.npz"))


@pytest.mark.parametrize("name", ["quantized", "sparse", "loss_scaled"])
def test_fixture_outputs_unchanged(name):
    model, saved = _load(name)
    np.testing.assert_array_equal(
        model.predict(saved["x"], verbose=0), saved["y"]
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
    keras_mp.muppet.set_word_length(model, None)  # float: deterministic
    np.testing.assert_array_equal(
        model.predict(saved["x"], verbose=0), saved["y"]
    )
