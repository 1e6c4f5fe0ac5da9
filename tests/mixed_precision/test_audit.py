import keras
import pytest

import keras_mp
from keras_mp.quantization import twins
from tests.conftest import small_cnn


def test_audit_reports_dtypes_and_alignment(capsys):
    with keras_mp.enable_mixed_precision("mixed_float16"):
        model = keras_mp.apply_mixed_precision(small_cnn())
    report = keras_mp.mixed_precision_audit(model, batch_size=100)
    printed = capsys.readouterr().out
    rows = {r.name: r for r in report.rows}
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


def test_audit_reaches_layers_of_nested_models():
    inner = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(12, name="inner_dense")],
        name="inner",
    )
    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(8, name="head")(inner(inputs))
    report = keras_mp.mixed_precision_audit(
        keras.Model(inputs, outputs), verbose=False
    )
    assert [r.name for r in report.rows] == ["inner/inner_dense", "head"]
    assert report.findings == [
        "inner/inner_dense: units=12 not a multiple of 8",
        "head: input features=12 not a multiple of 8",
    ]


def test_audit_rejects_what_is_not_a_built_model():
    with pytest.raises(
        TypeError,
        match=r"`mixed_precision_audit` expects a Keras 3 `keras.Model`. "
        r"Received: builtins.str",
    ):
        keras_mp.mixed_precision_audit("model.keras")
    with pytest.raises(
        ValueError, match=r"is not built.*call `model.build\(input_shape\)`"
    ):
        keras_mp.mixed_precision_audit(
            keras.Sequential([keras.layers.Dense(8)])
        )


def test_audit_lists_a_quantize_wrapper_as_one_row():
    qmodel = keras_mp.quantize_model(small_cnn())
    report = keras_mp.mixed_precision_audit(qmodel, verbose=False)
    names = [r.name for r in report.rows]
    # One row per layer of the float model: a quantized layer's quantizers
    # are not rows of their own, and it keeps its float name.
    assert len(names) == len(set(names)) == len(qmodel.model.layers)
    quantized = {
        r.name.split("/")[-1]
        for r in report.rows
        if r.class_name.startswith("Quantized")
    }
    assert quantized and quantized == {
        layer.name for layer in twins.quantized_layers(qmodel)
    }


def test_nested_layers_by_path_and_no_quantizer_rows():
    # Layers inside custom layers are named by path (two blocks each hold
    # a `query`); the quantizers a layer quantized in place owns are not
    # rows of their own.
    from tests.sparsity.test_report import nested_blocks

    model = nested_blocks()
    names = [r.name for r in keras_mp.mixed_precision_audit(model).rows]
    assert names == [
        "block_0",
        "block_0/query",
        "block_1",
        "block_1/query",
        "head",
    ]
    qmodel = keras_mp.quantize_model(model)  # in place, in a RecordedModel
    quantized = keras_mp.mixed_precision_audit(qmodel, verbose=False)
    assert [(r.name, r.class_name) for r in quantized.rows] == [
        ("blocks/block_0", "_QueryBlock"),
        ("blocks/block_0/query", "QuantizedDense"),
        ("blocks/block_1", "_QueryBlock"),
        ("blocks/block_1/query", "QuantizedDense"),
        ("blocks/head", "QuantizedDense"),
    ]
