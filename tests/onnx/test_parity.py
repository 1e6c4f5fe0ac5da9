"""`verify_onnx` and the parity check of `export_onnx`: what a wrong
`verify_data` or a missing file says, and the ONNX Runtime helpers."""

import os

import numpy as np
import pytest

import keras_mp
from keras_mp.onnx.parity import ort_session, run_session
from tests.conftest import small_cnn


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    model = small_cnn()
    path = d / "f.onnx"
    keras_mp.export_onnx(model, path)
    return model, path


def test_run_session_batches_give_the_model_outputs(exported):
    model, path = exported
    x = np.random.default_rng(0).random((10, 28, 28, 1), dtype=np.float32)
    for optimized in (False, True):
        got = run_session(ort_session(path, optimized), [x], batch_size=3)
        assert len(got) == 1 and got[0].shape == (10, 10)
        np.testing.assert_allclose(got[0], model(x), atol=1e-5)


@pytest.mark.parametrize(
    "data, match",
    [
        (np.zeros((0, 28, 28, 1), np.float32), "`verify_data` is empty"),
        (
            np.zeros((4, 28, 28), np.float32),
            r"`verify_data`: input 'input_0' has shape \(4, 28, 28\), but "
            r"model .* expects \(None, 28, 28, 1\)",
        ),
    ],
    ids=["empty", "wrong_shape"],
)
def test_bad_verify_data_says_what_is_wrong(tmp_path, data, match):
    with pytest.raises(keras_mp.ExportError, match=match):
        keras_mp.export_onnx(small_cnn(), tmp_path / "v.onnx", verify_data=data)
    assert os.listdir(tmp_path) == []


def test_missing_onnx_file_is_named(exported, tmp_path):
    model, _ = exported
    x = np.zeros((2, 28, 28, 1), np.float32)
    with pytest.raises(FileNotFoundError, match="none.onnx"):
        keras_mp.verify_onnx(model, tmp_path / "none.onnx", x)


def test_onnx_runtime_failure_is_an_export_error_with_guidance(tmp_path):
    """A graph ONNX Runtime rejects (float16 meeting bfloat16 in an Add,
    which `onnx.checker` accepts) gives keras_mp's own error, saying what
    to do, with ONNX Runtime's message in it and as its cause."""
    import keras
    import onnx
    from onnx import TensorProto, helper

    inputs = keras.Input((4,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(4)(inputs))
    nodes = [
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["x"], ["b"], to=TensorProto.BFLOAT16),
        helper.make_node("Add", ["h", "b"], ["s"]),
        helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
    )
    path = str(tmp_path / "mixed.onnx")
    onnx.save(helper.make_model(graph), path)
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(keras_mp.ExportError) as caught:
        keras_mp.verify_onnx(model, path, x)
    message = str(caught.value)
    assert "ONNX Runtime could not load" in message
    assert "bfloat16" in message and "mixed_precision_audit" in message
    assert type(caught.value.__cause__).__module__.startswith("onnxruntime")
