"""INT4 weight-only export: blocked DequantizeLinear (opset 21) with INT4
initializers, parity with ONNX Runtime, file size, TensorRT lint."""

import os

import keras
import numpy as np
import pytest

import keras_mp

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("tf2onnx")

from onnx import helper, numpy_helper  # noqa: E402

from keras_mp.quantization.blocks import block_encode  # noqa: E402


def _dense_stack(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((256,))
    h = inputs
    for i in range(3):
        h = keras.layers.Dense(512, activation="relu", name=f"fc{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(128, name="head")(h))


def _x(n=32, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 256)).astype("f4")


@pytest.fixture(scope="module")
def int4_file(tmp_path_factory):
    """A Dense stack exported in INT4 (blocks of 128) and in float32."""
    tmp = tmp_path_factory.mktemp("int4")
    model = _dense_stack()
    qmodel = keras_mp.quantize_model(model, precision="int4")
    keras_mp.export_onnx(model, tmp / "f32.onnx")
    with pytest.warns(UserWarning, match="exported at opset 21"):
        report = keras_mp.export_onnx(
            qmodel, tmp / "int4.onnx", verify_data=_x()
        )
    return qmodel, tmp / "int4.onnx", tmp / "f32.onnx", report


def test_int4_file_holds_blocked_int4_dq_and_matches_keras(int4_file):
    qmodel, path, f32, report = int4_file
    # ONNX Runtime 1.32's CPU provider runs blocked INT4 DequantizeLinear
    assert report.rel_l2 < 1e-5 and report.top1_agreement == 1.0
    proto = onnx.load(path)
    assert max(o.version for o in proto.opset_import if o.domain == "") == 21
    dqs = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 4
    inits = {i.name: i for i in proto.graph.initializer}
    kernel = np.asarray(qmodel.get_layer("fc1").kernel)
    want = block_encode(kernel, "int4", 128)
    found = False
    for dq in dqs:
        attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
        assert attrs == {"axis": 0, "block_size": 128} and len(dq.input) == 2
        codes = inits[dq.input[0]]
        assert codes.data_type == onnx.TensorProto.INT4
        if tuple(codes.dims) == kernel.shape:
            values = numpy_helper.to_array(codes)
            if np.array_equal(values, want.codes):
                found = True
                scale = numpy_helper.to_array(inits[dq.input[1]])
                np.testing.assert_array_equal(scale, want.scale)
    assert found
    # INT4 packs two codes a byte: the file is a fraction of float32's
    assert os.path.getsize(path) <= 0.35 * os.path.getsize(f32)
    assert keras_mp.check_tensorrt(str(path)).ok


def test_explicit_opset_below_21_is_refused_before_writing(tmp_path):
    qmodel = keras_mp.quantize_model(_dense_stack(), precision="int4")
    with pytest.raises(
        keras_mp.ExportError,
        match=r"block-scaled quantizers, whose Q/DQ need opset >= 21\. "
        r"Received: opset=19.*Nothing was written",
    ):
        keras_mp.export_onnx(qmodel, tmp_path / "q.onnx", opset=19)
    assert os.listdir(tmp_path) == []


def _findings(proto, rule="blocks"):
    report = keras_mp.check_tensorrt(proto)
    return [f.message for f in report.violations if f.rule == rule]


def test_lint_flags_block_size_32_for_tensorrt(int4_file):
    proto = onnx.load(int4_file[1])
    assert _findings(proto) == []
    dq = next(n for n in proto.graph.node if n.op_type == "DequantizeLinear")
    for a in dq.attribute:
        if a.name == "block_size":
            a.i = 32
    messages = _findings(proto)
    assert any(
        "TensorRT builds INT4 blocks of 128 or 64" in m for m in messages
    )
    assert any("scale shape" in m for m in messages), messages


def test_lint_flags_int4_on_a_convolution():
    w = np.random.default_rng(0).normal(size=(8, 128, 1, 1)).astype("f4")
    codes = block_encode(w, "int4", 64, axis=1)
    graph = helper.make_graph(
        [
            helper.make_node(
                "DequantizeLinear", ["w", "s"], ["wd"], axis=1, block_size=64
            ),
            helper.make_node("Conv", ["x", "wd"], ["y"]),
        ],
        "conv",
        [
            helper.make_tensor_value_info(
                "x", onnx.TensorProto.FLOAT, [1, 128, 4, 4]
            )
        ],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(codes.codes, "w"),
            numpy_helper.from_array(codes.scale, "s"),
        ],
    )
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21)]
    )
    messages = _findings(proto)
    assert any(
        "INT4 on Conv: TensorRT runs INT4 weight-only on MatMul and Gemm" in m
        for m in messages
    ), messages


@pytest.mark.parametrize("name", ["LlamaBackbone", "GPT2Backbone"])
def test_hub_backbone_int4_gptq_export_matches_keras(name, tmp_path):
    pytest.importorskip("keras_hub")
    from benchmarks.hub_models import BACKBONES, inputs_for
    from keras_mp.onnx.graph import GraphIndex

    model = BACKBONES[name](hidden_dim=128, num_layers=1)
    x = inputs_for(model, 4)
    qmodel = keras_mp.quantize_model(
        model, config=keras_mp.QuantizeConfig(precision="int4", block_size=64)
    )
    keras_mp.calibrate(qmodel, x, method="gptq", verbose=0)
    with pytest.warns(UserWarning):
        report = keras_mp.export_onnx(
            qmodel, tmp_path / "m.onnx", verify_data=x
        )
    assert report.rel_l2 < 1e-5
    index = GraphIndex(onnx.load(tmp_path / "m.onnx"))
    constant = [(op, source) for op, _, source in index.weights if source.name]
    # every projection's weight is a blocked INT4 DQ feeding it directly
    assert len(constant) >= 6
    assert all(source.dq is not None for _, source in constant)
    assert all(not source.layout for _, source in constant)


@pytest.mark.parametrize(
    "precision, opset, code_type, scale_type",
    [("nvfp4", 23, 23, 17), ("mxfp8", 24, 17, 24)],
)
def test_nvfp4_and_mxfp8_export_checked_with_onnx_reference(
    precision, opset, code_type, scale_type, tmp_path
):
    model = _dense_stack()
    # weight-only (W4A16 / W8A16): a float32 graph
    w = keras_mp.QuantizeConfig(precision=precision, weights_only=True)
    qmodel = keras_mp.quantize_model(model, config={".*": w})
    with pytest.warns(UserWarning, match=f"exported at opset {opset}"):
        report = keras_mp.export_onnx(
            qmodel, tmp_path / "q.onnx", verify_data=_x(8)
        )
    # ONNX Runtime 1.32 cannot dequantize FLOAT4E2M1 / FLOAT8E8M0
    assert report.runtime == "onnx.reference" and report.rel_l2 < 1e-5
    assert report.optimized_rel_l2 is None and "onnx.reference" in str(report)
    proto = onnx.load(tmp_path / "q.onnx")
    types = {i.data_type for i in proto.graph.initializer}
    assert {code_type, scale_type} <= types
    keras_mp.export_onnx(model, tmp_path / "f32.onnx")
    ratio = os.path.getsize(tmp_path / "q.onnx") / os.path.getsize(
        tmp_path / "f32.onnx"
    )
    assert ratio < (0.2 if precision == "nvfp4" else 0.3)
    assert keras_mp.check_tensorrt(proto).ok
    # a block of 64 is not one TensorRT builds for these formats
    for node in proto.graph.node:
        for a in node.attribute:
            if a.name == "block_size":
                a.i = 64
    assert any(
        f"TensorRT builds {precision.upper()} blocks of" in m
        for m in _findings(proto)
    )


@pytest.mark.parametrize("precision", ["int4", "nvfp4"])
def test_compare_onnx_runs_block_formats(precision, tmp_path):
    w = keras_mp.QuantizeConfig(precision=precision, weights_only=True)
    qmodel = keras_mp.quantize_model(_dense_stack(), config={".*": w})
    with pytest.warns(UserWarning, match="exported at opset"):
        keras_mp.export_onnx(qmodel, tmp_path / "q.onnx")
    report = keras_mp.compare_onnx(qmodel, str(tmp_path / "q.onnx"), _x(8))
    assert report.first_divergence is None and len(report.rows) == 5
    runtime = "ONNX Runtime" if precision == "int4" else "onnx.reference"
    assert report.runtime == runtime and f"Keras vs {runtime}" in str(report)
