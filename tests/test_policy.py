import keras
import numpy as np
import pytest
from tests.conftest import small_cnn

import keras_mp
from keras_mp.mixed_precision import policy


def test_enable_returns_previous_and_restores_as_context():
    previous = keras_mp.enable_mixed_precision("mixed_float16")
    assert previous == "float32"
    assert keras.mixed_precision.global_policy().name == "mixed_float16"
    with keras_mp.enable_mixed_precision("mixed_bfloat16") as prev:
        assert prev == "mixed_float16"
        assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    assert keras.mixed_precision.global_policy().name == "mixed_float16"


def test_auto_picks_what_this_hardware_supports_and_says_why():
    expected, reason = policy.resolve_auto_policy()
    previous = keras_mp.enable_mixed_precision("auto")
    assert keras.mixed_precision.global_policy().name == expected
    assert previous.reason == reason and len(reason) > 20


@pytest.mark.parametrize("bad", ["float16", "mixed_fp16", None, 16])
def test_unknown_policy_is_rejected_with_the_choices(bad):
    with pytest.raises(ValueError, match="mixed_bfloat16.*Received"):
        keras_mp.enable_mixed_precision(bad)


def _functional_with_softmax():
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(12)(x)
    x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(5, activation="softmax")(x)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_apply_keeps_sensitive_layers_float32(name):
    model = _functional_with_softmax()
    mixed = keras_mp.apply_mixed_precision(model, name)
    half = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}[name]
    for layer in mixed.layers[1:]:
        sensitive = (
            isinstance(
                layer,
                (
                    keras.layers.BatchNormalization,
                    keras.layers.LayerNormalization,
                ),
            )
            or layer is mixed.layers[-1]
        )
        want = "float32" if sensitive else half
        assert layer.compute_dtype == want, layer.name
        assert layer.variable_dtype == "float32"
    x = np.random.rand(4, 16, 16, 3).astype("float32")
    out = mixed(x)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    np.testing.assert_allclose(out, model(x), atol=2e-2)


def test_softmax_layer_and_output_are_sensitive():
    model = _functional_with_softmax()
    assert keras_mp.is_precision_sensitive(model.layers[-1], model)
    assert keras_mp.is_precision_sensitive(keras.layers.Softmax())
    assert not keras_mp.is_precision_sensitive(model.layers[1], model)


def test_apply_rejects_non_keras_objects():
    with pytest.raises(TypeError, match="keras.Model"):
        keras_mp.apply_mixed_precision(object())
    with pytest.raises(ValueError, match="policy"):
        keras_mp.apply_mixed_precision(small_cnn(), "half")


def test_audit_reports_dtypes_and_alignment(capsys):
    with keras_mp.enable_mixed_precision("mixed_float16"):
        model = keras_mp.apply_mixed_precision(small_cnn())
    report = keras_mp.mixed_precision_audit(model, batch_size=100)
    printed = capsys.readouterr().out
    rows = {r.name: r for r in report.layers}
    conv = model.layers[0].name
    assert rows[conv].compute_dtype == "float16"
    assert rows[conv].variable_dtype == "float32"
    assert any("input channels=1" in f for f in rows[conv].findings)
    dense = model.layers[-1].name
    assert rows[dense].compute_dtype == "float32"  # output kept float32
    assert any("units=10" in f for f in rows[dense].findings)
    assert "batch_size=100" in report.batch_finding
    assert report.summary in printed and "Tensor Core" in report.summary
    assert len(report.findings) == 3


def test_audit_needs_a_built_model():
    model = keras.Sequential([keras.layers.Dense(8)])
    with pytest.raises(ValueError, match="not built"):
        keras_mp.mixed_precision_audit(model)


def test_set_tf32_returns_previous_state():
    previous = keras_mp.set_tf32(False)
    assert keras_mp.set_tf32(previous) is False
