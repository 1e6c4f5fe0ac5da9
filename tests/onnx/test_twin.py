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
    keras_mp.export_onnx(model, path, verify_data=x, dtype="float16")
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


def test_dtype_policy_map_default_policy_is_rewritten():
    """keras-hub backbones carry a `DTypePolicyMap` as `dtype`: its default
    policy (a name) and its per-path policies are all made float32."""
    from keras_mp.onnx.twin import _float32_config

    policies = keras.dtype_policies.DTypePolicyMap(
        default_policy="mixed_bfloat16"
    )
    policies["block/dense"] = "float16"
    config = {"dtype": keras.saving.serialize_keras_object(policies)}
    rebuilt = keras.saving.deserialize_keras_object(
        _float32_config(config)["dtype"]
    )
    assert rebuilt.default_policy.name == "float32"
    assert rebuilt["block/dense"].name == "float32"


@pytest.mark.slow  # 12 s on 2 cores: the slow step of .ci/run
def test_bfloat16_keras_hub_t5_exports_with_parity(tmp_path):
    """A T5 under `apply_mixed_precision("mixed_bfloat16")` (a
    `DTypePolicyMap` whose default is mixed_bfloat16): its twin computes
    in float32, so the graph mixes no float16 and bfloat16, and both of
    its dict outputs keep their keys."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=64,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        key_value_dim=8,
        dropout=0.0,
    )
    model = keras_mp.apply_mixed_precision(backbone, "mixed_bfloat16")
    assert half_compute_dtype(model) == "bfloat16"
    assert half_compute_dtype(float32_twin(model)) is None
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (8, 8)).astype("int32")
    mask = np.ones((8, 8), "int32")
    data = {
        "encoder_token_ids": ids,
        "encoder_padding_mask": mask,
        "decoder_token_ids": ids,
        "decoder_padding_mask": mask,
    }
    path = tmp_path / "t5.onnx"
    report = keras_mp.export_onnx(model, path, verify_data=data)
    assert report.rel_l2 < 1e-5
    assert not _element_types(path) & HALF
    outputs = [o.name for o in onnx.load(path).graph.output]
    assert outputs == ["decoder_sequence_output", "encoder_sequence_output"]
