"""Models that compute in float16 or bfloat16 export as float32 ONNX
(through a float32 twin) that ONNX Runtime runs and TensorRT accepts."""

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from keras_mp.onnx.twin import float32_twin, half_compute_dtype
from keras_mp.reference import reference_cnn
from tests.conftest import small_cnn

HALF = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def _element_types(path):
    """Every element type the graph holds: boundaries, inferred tensors,
    initializers, Constant values and Cast targets."""
    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    graph = model.graph
    values = [*graph.input, *graph.output, *graph.value_info]
    types = {v.type.tensor_type.elem_type for v in values}
    types |= {init.data_type for init in graph.initializer}
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Constant" and attr.name == "value":
                types.add(attr.t.data_type)
            if node.op_type == "Cast" and attr.name == "to":
                types.add(attr.i)
    return types


def _mixed(policy, make=small_cnn):
    with keras_mp.enable_mixed_precision(policy):
        model = keras_mp.apply_mixed_precision(make())
    return model


def _data(n=64):
    return np.random.default_rng(0).random((n, 28, 28, 1), dtype=np.float32)


def test_bfloat16_float_model_exports_float32(tmp_path):
    x = _data()
    model = _mixed("mixed_bfloat16")
    assert half_compute_dtype(model) == "bfloat16"
    path = tmp_path / "bf16.onnx"
    report = keras_mp.export_onnx(model, path, verify_data=x)
    assert not _element_types(path) & HALF
    # Parity is judged against the float32 twin, at the float32 tolerances.
    assert report.rel_l2 <= 0.01 and report.top1_agreement >= 0.999
    # ONNX Runtime's outputs are close to the bfloat16 model's own
    got = keras_mp.onnx.parity.run_session(
        keras_mp.onnx.parity.ort_session(path), [x]
    )[0]
    np.testing.assert_allclose(got, model.predict(x, verbose=0), atol=0.05)


def test_float16_quantized_model_exports_float32_and_lints_clean(tmp_path):
    x = _data()
    model = _mixed("mixed_float16", lambda: reference_cnn(width=8))
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    assert half_compute_dtype(qmodel) == "float16"
    path = tmp_path / "q16.onnx"
    report = keras_mp.export_onnx(qmodel, path, verify_data=x)
    types = _element_types(path)
    assert not types & HALF and onnx.TensorProto.INT8 in types
    assert report.rel_l2 <= 0.01 and report.top1_agreement >= 0.999
    lint = keras_mp.check_tensorrt(path)
    assert lint.ok, str(lint)
    assert lint.weighted_ops == lint.weighted_ops_quantized == 8


def test_fp16_true_still_writes_float16_for_a_mixed_model(tmp_path):
    x = _data(16)
    model = _mixed("mixed_bfloat16")
    path = tmp_path / "fp16.onnx"
    keras_mp.export_onnx(model, path, verify_data=x, fp16=True)
    types = _element_types(path)
    assert onnx.TensorProto.FLOAT16 in types
    assert onnx.TensorProto.BFLOAT16 not in types


def test_twin_computes_in_float32_with_the_same_state():
    x = _data(8)
    qmodel = keras_mp.quantize_model(_mixed("mixed_float16"))
    keras_mp.calibrate(qmodel, x, verbose=0)
    keras_mp.set_quantization_enabled(qmodel, False)
    twin = float32_twin(qmodel)
    assert half_compute_dtype(twin) is None
    assert {layer.compute_dtype for layer in twin.layers} == {"float32"}
    assert [w.name for w in twin.weights] == [w.name for w in qmodel.weights]
    for a, b in zip(qmodel.weights, twin.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), a.path)
    # the quantizers' off switch came along: the twin is the float model
    keras_mp.set_quantization_enabled(qmodel, True)
    plain = float32_twin(keras_mp.strip_quantization(qmodel))
    np.testing.assert_allclose(twin(x), plain(x), atol=1e-5)


def test_float32_model_has_no_half_compute_dtype():
    assert half_compute_dtype(small_cnn()) is None


class _NoConfig(keras.layers.Layer):
    """A custom layer whose constructor argument is not in its config."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def call(self, x):
        return x * self.scale


def test_model_that_cannot_be_rebuilt_says_what_to_do(tmp_path):
    with keras_mp.enable_mixed_precision("mixed_bfloat16"):
        inputs = keras.Input((4,))
        model = keras.Model(
            inputs, _NoConfig(2.0)(keras.layers.Dense(3)(inputs))
        )
    with pytest.raises(keras_mp.ExportError, match="rebuild the model under"):
        keras_mp.export_onnx(model, tmp_path / "n.onnx")
    assert not (tmp_path / "n.onnx").exists()


def test_saved_model_of_a_bfloat16_model_serves_its_outputs(tmp_path):
    x = _data(8)
    model = _mixed("mixed_bfloat16")
    diff = keras_mp.export_saved_model(model, tmp_path / "sm", verify_data=x)
    assert diff is not None and diff < 1e-5
