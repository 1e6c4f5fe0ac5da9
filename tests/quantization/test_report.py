"""`quantization_report`: one row per layer, ranges and reasons."""

import re

import pytest

import keras_mp
from tests.quantization.conftest import cnn


def test_report_lists_ranges_and_reasons(quantized, capsys):
    rows = {r["layer"]: r for r in keras_mp.quantization_report(quantized).rows}
    assert list(rows) == ["conv", "pool", "head"]
    conv = rows["conv"]
    assert conv["type"] == "Conv2D" and conv["quantized"]
    q = quantized.get_layer("conv")
    assert conv["inputs"] == {0: float(q.input_quantizers[0].amax.numpy())}
    low, high = conv["weights"]["kernel"]
    assert 0 < low <= high == float(q.weight_ranges[0][2].numpy().max())
    assert conv["note"] == ""
    assert rows["pool"]["note"].startswith("no Q/DQ needed")
    assert re.search(r"^Q head +Dense", capsys.readouterr().out, re.M)


def test_report_says_what_is_left_to_do():
    rows = keras_mp.quantization_report(
        keras_mp.quantize_model(cnn()), verbose=False
    ).rows
    assert "run keras_mp.calibrate" in rows[0]["note"]
    rows = keras_mp.quantization_report(cnn(), verbose=False).rows
    assert not any(r["quantized"] for r in rows)
    assert rows[0]["note"] == "not selected, or skipped by QuantizeConfig"


def test_report_needs_a_model():
    with pytest.raises(TypeError, match="keras.Model"):
        keras_mp.quantization_report("model.keras")
