"""`verify_onnx` and the parity check of `export_onnx`: what a wrong
`verify_data` or a missing file says, and the ONNX Runtime helpers."""

import os

import keras
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


def _near_tie_model():
    """Two logits `x` and `x * (1 + 2**-12)`: class 1 wins in float32 by a
    margin of 2.4e-4 of the logit, which float16 weights (ulp 2**-10 at 1)
    round away, so a float16 graph computes a tie and picks class 0."""
    inputs = keras.Input((1,))
    pair = keras.layers.Dense(2, use_bias=False, name="pair")
    x = pair(inputs)
    pair.kernel.assign([[1.0, 1.0 + 2.0**-12]])
    return keras.Model(inputs, keras.layers.Activation("linear")(x))


def test_near_ties_are_not_counted_in_top1_agreement(tmp_path):
    """A float16 graph's rounding flips predictions whose margin is within
    its expected error; they are counted as near-ties, not disagreements,
    while a float32 graph is judged on every prediction."""
    model = _near_tie_model()
    x = 1.0 + np.random.default_rng(0).random((16, 1), dtype=np.float32)
    report = keras_mp.export_onnx(
        model, tmp_path / "h.onnx", dtype="float16", verify_data=x
    )
    assert report.near_ties == 16 and report.top1_agreement == 1.0
    assert "16 near-tie prediction(s) not counted" in str(report)
    assert "float16 graph's expected error" in str(report)
    report = keras_mp.export_onnx(model, tmp_path / "f.onnx", verify_data=x)
    assert report.near_ties == 0 and report.top1_agreement == 1.0
    assert "near-tie" not in str(report)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"min_top1_agreement": 99.9},
            r"in \[0, 1\] \(a percentage\? pass 0.999\). Received: "
            r"min_top1_agreement=99.9",
        ),
        ({"min_top1_agreement": -0.1}, "min_top1_agreement=-0.1"),
        ({"min_top1_agreement": "0.99"}, "min_top1_agreement='0.99'"),
        ({"max_rel_l2": 0.0}, "a positive number .* max_rel_l2=0.0"),
        ({"max_rel_l2": -1}, "max_rel_l2=-1"),
        ({"max_rel_l2": float("nan")}, "max_rel_l2=nan"),
    ],
    ids=["percent", "negative", "string", "zero_l2", "negative_l2", "nan"],
)
def test_tolerance_outside_its_range_is_a_value_error(
    exported, tmp_path, kwargs, match
):
    model, path = exported
    x = np.zeros((2, 28, 28, 1), np.float32)
    with pytest.raises(ValueError, match=match):
        keras_mp.verify_onnx(model, path, x, **kwargs)
    with pytest.raises(ValueError, match=match):
        keras_mp.export_onnx(
            model, tmp_path / "t.onnx", verify_data=x, **kwargs
        )
    assert os.listdir(tmp_path) == []
