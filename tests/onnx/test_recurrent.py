"""Recurrent layers end to end: LSTM, GRU, SimpleRNN and Bidirectional
export in float, INT8 (the layers around them quantized), mixed precision
and float16, each verified by the export's own ONNX Runtime parity check;
the lint and `quantization_report` say the recurrent matmuls run in float
(TensorRT's importer builds them from float inputs: `docs/export.md`,
"Recurrent layers"); bad inputs fail before anything is written.
"""

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from keras_mp.onnx.convert import _advice
from keras_mp.onnx.graph import walk
from keras_mp.quantization.report import RECURRENT_NOTE

TOKENS = np.random.default_rng(0).integers(1, 20, (4, 6)).astype("int32")
# Padding the masked cases must skip: post, pre and a hole (id 0).
TOKENS[0, 4:] = TOKENS[1, :2] = TOKENS[2, 3] = 0


def _model(cell, bidirectional=False, sequences=False, **kwargs):
    """int32 tokens -> Embedding -> `cell` (4 units) -> Dense(3)."""
    mask = kwargs.pop("mask_zero", False)
    inputs = keras.Input(
        (6,), dtype="int32", batch_size=kwargs.pop("batch", None)
    )
    x = keras.layers.Embedding(20, 8, mask_zero=mask)(inputs)
    layer = getattr(keras.layers, cell)(4, return_sequences=sequences, **kwargs)
    if bidirectional:
        layer = keras.layers.Bidirectional(layer)
    x = layer(x)
    if sequences:
        x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x))


# name: (model kwargs, mode). One export each, shared by the tests below.
CASES = {
    "bilstm_float": (dict(cell="LSTM", bidirectional=True), "float"),
    "bilstm_int8": (dict(cell="LSTM", bidirectional=True), "int8"),
    "lstm_seq_fp16": (dict(cell="LSTM", sequences=True), "fp16"),
    "gru_int8": (dict(cell="GRU"), "int8"),
    "gru_seq_fp16": (dict(cell="GRU", sequences=True), "fp16"),
    "bigru_mixed_int8": (dict(cell="GRU", bidirectional=True), "mixed"),
    "simplernn_seq_int8": (dict(cell="SimpleRNN", sequences=True), "int8"),
    "masked_gru_int8": (dict(cell="GRU", mask_zero=True), "int8"),
    "masked_bilstm_int8": (
        dict(cell="LSTM", bidirectional=True, mask_zero=True),
        "int8",
    ),
    "unrolled_lstm_int8": (dict(cell="LSTM", unroll=True), "int8"),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (exported model, ONNX path); every export verified against
    Keras with ONNX Runtime (`verify_data`)."""
    folder = tmp_path_factory.mktemp("recurrent")
    done = {}

    def export(name):
        if name not in done:
            kwargs, mode = CASES[name]
            model = _model(**kwargs)
            if mode == "mixed":
                model = keras_mp.apply_mixed_precision(model, "mixed_float16")
            if mode != "float":
                model = keras_mp.quantize_model(model)
                keras_mp.calibrate(model, TOKENS)
            path = str(folder / f"{name}.onnx")
            keras_mp.export_onnx(
                model,
                path,
                verify_data=TOKENS,
                dtype="float16" if mode == "fp16" else "float32",
            )
            done[name] = model, path
        return done[name]

    return export


@pytest.mark.parametrize("name", list(CASES))
def test_recurrent_model_exports_with_parity(exported, name):
    model, path = exported(name)
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    report = keras_mp.check_tensorrt(path)
    assert report.ok, str(report)
    if CASES[name][1] != "float":  # the Dense after the recurrent layer
        assert report.weighted_ops_quantized == 1, str(report)


@pytest.mark.parametrize(
    "name, float_ops",
    [
        ("bilstm_int8", {"LSTM"}),  # one bidirectional ONNX LSTM op
        ("gru_int8", {"MatMul"}),  # tf2onnx's Loop, MatMuls in its body
        ("simplernn_seq_int8", {"MatMul"}),
    ],
)
def test_lint_names_recurrent_matmuls_as_float(exported, name, float_ops):
    # Before: "PASS ... 1/1 weighted ops quantized" with the LSTM in float.
    _, path = exported(name)
    proto = onnx.load(path)
    inside = [
        node
        for node, _, path_ in walk(proto.graph)
        if node.op_type in ("LSTM", "GRU", "RNN")
        or (path_ and node.op_type == "MatMul")
    ]
    assert {n.op_type for n in inside} == float_ops
    report = keras_mp.check_tensorrt(path)
    assert report.weighted_ops == 1 + len(inside)
    (finding,) = [w for w in report.warnings if w.rule == "float_weighted_ops"]
    assert f"{len(inside)} of {1 + len(inside)} weighted ops" in finding.message
    assert "Recurrent ops" in finding.message
    if float_ops == {"LSTM"}:
        assert inside[0].name in finding.message


@pytest.mark.parametrize("name", ["masked_gru_int8", "masked_bilstm_int8"])
def test_masked_export_skips_padding(exported, name):
    # A masked step carries the state through, so a sequence padded before
    # or after gives one output; the parity check alone would pass a graph
    # that ignores the mask the same way Keras did not.
    ort = pytest.importorskip("onnxruntime")
    model, path = exported(name)
    tokens = np.array([[3, 7, 11, 0, 0, 0], [0, 0, 0, 3, 7, 11]], "int32")
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (onnx_out,) = session.run(None, {session.get_inputs()[0].name: tokens})
    np.testing.assert_allclose(onnx_out[0], onnx_out[1], atol=1e-5)
    np.testing.assert_allclose(onnx_out, model(tokens), atol=1e-5)


def test_quantization_report_notes_recurrent_layers(exported):
    model, _ = exported("bilstm_int8")
    rows = keras_mp.quantization_report(model, verbose=False).rows
    notes = {
        row["path"]: row["note"]
        for row in rows
        if row["type"] in ("Bidirectional", "LSTM", "LSTMCell")
    }
    assert len(notes) == 5, notes
    assert set(notes.values()) == {RECURRENT_NOTE}


def test_stateful_rnn_fails_before_writing(tmp_path):
    # Its state lives in variables and its batch size is fixed: an ONNX
    # graph holds neither (freezing used to fail inside TensorFlow).
    model = _model("LSTM", stateful=True, batch=4)
    path = tmp_path / "stateful.onnx"
    with pytest.raises(keras_mp.ExportError, match="stateful=False"):
        keras_mp.export_onnx(model, str(path))
    assert not path.exists()


def test_unconvertible_op_advice_fits_its_case():
    loop = _advice(["TensorListReserve"])
    assert "unroll=True" in loop and "GELU" not in loop
    assert "GELU" in _advice(["Erfc"])
    assert "GELU" not in _advice(["Erfinv"])
