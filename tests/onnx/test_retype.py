"""FP8 Q/DQ where tf2onnx moved the Q back across ops that only move
values (`keras_mp/onnx/retype.py`): a Concat (DLRM's interactions, a
Concatenate of two branches), an Unsqueeze, a Gather. The export moves
each FP8 Q to its DQ, so no op but a DQ reads FP8 codes (ONNX types
Concat and Gather for FP8 at no opset up to 28), with ONNX Runtime
parity; codes that reach an op computing with them are an ExportError
naming the layer and the op."""

import contextlib

import keras
import numpy as np
import onnx
import pytest
from keras import ops

import keras_mp
from benchmarks.op_site_models import dlrm, dlrm_data
from keras_mp.onnx import retype
from keras_mp.onnx.errors import ExportError

FP8 = onnx.TensorProto.FLOAT8E4M3FN


def _export(model, x, tmp_path, dtype=None):
    qmodel = keras_mp.quantize_model(model, precision="float8")
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "model.onnx")
    # a 16-bit dtype exports at opset 19 already: no warning then
    with (
        contextlib.nullcontext()
        if dtype
        else pytest.warns(UserWarning, match="opset 19")
    ):
        report = keras_mp.export_onnx(qmodel, path, verify_data=x, dtype=dtype)
    return report, onnx.load(path)


def _fp8_codes_only_reach_dqs(proto):
    """Every FP8 QuantizeLinear feeds DequantizeLinears only, and the graph
    passes ONNX's strict type check (FP8 into a Concat would fail it)."""
    onnx.checker.check_model(proto, full_check=True)
    inits = {i.name: i for i in proto.graph.initializer}
    fp8_qs = [
        n
        for n in proto.graph.node
        if n.op_type == "QuantizeLinear" and inits[n.input[2]].data_type == FP8
    ]
    assert fp8_qs
    for q in fp8_qs:
        readers = [n for n in proto.graph.node if q.output[0] in n.input]
        assert readers and {n.op_type for n in readers} == {
            "DequantizeLinear"
        }, q.name


def _producer(proto, tensor):
    (node,) = [n for n in proto.graph.node if tensor in n.output]
    return node


def test_fp8_dlrm_with_a_stacked_interaction_exports(tmp_path):
    """tf2onnx puts one FP8 Q per `ops.stack` input before its Unsqueeze,
    and the top MLP's Q before the interaction's Reshape, Gather and
    Concat: one Q per DQ after them, the ops in float."""
    x = dlrm_data(64)
    report, proto = _export(dlrm(), x, tmp_path)
    assert report.rel_l2 <= 1e-2 and report.top1_agreement >= 0.999, report
    _fp8_codes_only_reach_dqs(proto)
    assert keras_mp.check_tensorrt(proto).ok
    # the interaction matmul's operands and the top MLP's input: DQ(Q(x))
    # of the float stack (Concat, Transpose) and of the float Concat
    matmuls = [
        n
        for n in proto.graph.node
        if n.op_type == "MatMul" and "interaction" in n.name
    ] + [n for n in proto.graph.node if n.name.endswith("top_1/MatMul")]
    assert len(matmuls) == 2
    moved = {"interaction": [], "top": []}
    for op in matmuls:
        for tensor in op.input:
            dq = _producer(proto, tensor)
            if dq.input[0] in {i.name for i in proto.graph.initializer}:
                continue  # the weight
            q = _producer(proto, dq.input[0])
            assert q.op_type == "QuantizeLinear"
            source = _producer(proto, q.input[0]).op_type
            moved["top" if "top" in op.name else "interaction"].append(source)
    assert sorted(moved["interaction"]) == ["Concat", "Transpose"]
    assert moved["top"] == ["Concat"]


def test_fp8_dlrm_in_a_float16_graph(tmp_path):
    x = dlrm_data(64)
    report, proto = _export(dlrm(), x, tmp_path, dtype="float16")
    assert report.rel_l2 <= 5e-2, report
    _fp8_codes_only_reach_dqs(proto)
    assert keras_mp.check_tensorrt(proto).ok


def _concatenated():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((16,), name="a"), keras.Input((16,), name="b")
    h = keras.layers.Dense(16, activation="relu", name="branch")(a)
    x = keras.layers.Concatenate(name="joined")([h, b])
    return keras.Model([a, b], keras.layers.Dense(16, name="head")(x))


def test_fp8_dense_after_a_concatenate_of_a_dense_and_a_raw_input(tmp_path):
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(64, 16)).astype("float32") for _ in range(2)]
    report, proto = _export(_concatenated(), x, tmp_path)
    assert report.rel_l2 <= 1e-2, report
    _fp8_codes_only_reach_dqs(proto)
    assert keras_mp.check_tensorrt(proto).ok
    (concat,) = [n for n in proto.graph.node if n.op_type == "Concat"]
    # the Concat joins the float branch output and the raw input; the
    # head's one Q reads its output
    assert concat.input[1] == "b"
    assert _producer(proto, concat.input[0]).op_type == "Relu"
    readers = [n for n in proto.graph.node if concat.output[0] in n.input]
    assert [n.op_type for n in readers] == ["QuantizeLinear"]


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class _Reversed(keras.layers.Layer):
    """Picks features with `ops.take` (a Gather in ONNX)."""

    def call(self, x):
        return ops.take(x, np.arange(x.shape[-1])[::-1].copy(), axis=1)


def _embedded():
    keras.utils.set_random_seed(0)
    i = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(30, 16)(i)
    x = keras.layers.Flatten()(keras.layers.Dense(16, name="proj")(x))
    return keras.Model(i, keras.layers.Dense(16, name="head")(x))


def _picked():
    keras.utils.set_random_seed(0)
    i = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="proj")(i)
    x = _Reversed(name="pick")(x)
    return keras.Model(i, keras.layers.Dense(16, name="head")(x))


@pytest.mark.parametrize("make", [_embedded, _picked])
def test_fp8_dense_next_to_a_gather(make, tmp_path):
    rng = np.random.default_rng(0)
    if make is _embedded:
        x = rng.integers(0, 30, (64, 5)).astype("int32")
    else:
        x = rng.normal(size=(64, 16)).astype("float32")
    report, proto = _export(make(), x, tmp_path)
    assert report.rel_l2 <= 1e-2, report
    _fp8_codes_only_reach_dqs(proto)
    assert keras_mp.check_tensorrt(proto).ok
    (gather,) = [n for n in proto.graph.node if n.op_type == "Gather"]
    # the Gather reads float values (an embedding table stays float)
    inits = {i.name: i.data_type for i in proto.graph.initializer}
    assert inits.get(gather.input[0], onnx.TensorProto.FLOAT) == (
        onnx.TensorProto.FLOAT
    )


@pytest.fixture(scope="module")
def fp8_head():
    """An FP8 model whose layer 'head' has an input quantizer, that
    quantizer's scale, and the name scope of the model's traced ops."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(16, name="proj")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(16, name="head")(x))
    qmodel = keras_mp.quantize_model(model, precision="float8")
    keras_mp.calibrate(qmodel, np.ones((8, 16), "float32"), verbose=0)
    (scale,) = [
        row[2]
        for row in retype.carrier_quantizers(qmodel)
        if row[0] == "head/input_0"
    ]
    return qmodel, scale.reshape(()), f"{model.name}_1/{model.name}_1"


def _carrier_model(nodes, scale, shape=(2, 16)):
    """A graph from `x` (2, 16) to `y` of `shape` whose carrier Q/DQ read
    scale `s` and UINT8 zero point `z`."""
    helper = onnx.helper
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, shape)],
        [
            onnx.numpy_helper.from_array(scale, "s"),
            onnx.numpy_helper.from_array(np.uint8(0), "z"),
            onnx.numpy_helper.from_array(np.array([2, 4, 4]), "shape"),
            onnx.numpy_helper.from_array(np.array(True), "cond"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def test_fp8_q_moves_inside_a_control_flow_body(fp8_head):
    qmodel, scale, prefix = fp8_head
    helper = onnx.helper
    body = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], "q"),
            helper.make_node("Reshape", ["q", "shape"], ["r"], "r"),
            helper.make_node("DequantizeLinear", ["r", "s", "z"], ["t"], "dq"),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [2, 4, 4])],
    )
    other = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["u"], "u")],
        "else",
        [],
        [helper.make_tensor_value_info("u", onnx.TensorProto.FLOAT, [2, 4, 4])],
    )
    branch = helper.make_node(
        "If", ["cond"], ["y"], "if", then_branch=body, else_branch=other
    )
    proto = _carrier_model([branch], scale, (2, 4, 4))
    assert retype.retype_carriers(proto, qmodel) == ["head/input_0"]
    onnx.checker.check_model(proto, full_check=True)
    then = {a.name: a.g for a in proto.graph.node[0].attribute}["then_branch"]
    assert [(n.op_type, n.input[0]) for n in then.node] == [
        ("Reshape", "x"),
        ("QuantizeLinear", "r"),
        ("DequantizeLinear", "q_moved_0"),
    ]


def test_fp8_codes_reaching_an_op_that_computes_name_layer_and_op(fp8_head):
    """A graph in which FP8 codes reach a Relu (no ONNX or TensorRT op but
    a DQ computes with them): the error names the op, the Keras layer it
    belongs to, the quantizer and how to quantize that layer in INT8."""
    qmodel, scale, prefix = fp8_head
    helper = onnx.helper
    proto = _carrier_model(
        [
            helper.make_node(
                "QuantizeLinear", ["x", "s", "z"], ["q"], f"{prefix}/head_1/Q"
            ),
            helper.make_node("Relu", ["q"], ["r"], f"{prefix}/proj_1/Relu"),
            helper.make_node("DequantizeLinear", ["r", "s", "z"], ["y"], "dq"),
        ],
        scale,
    )
    with pytest.raises(ExportError) as info:
        retype.retype_carriers(proto, qmodel)
    message = str(info.value)
    for part in (
        "quantizer 'head/input_0'",
        f"ONNX op Relu '{prefix}/proj_1/Relu' (in Keras layer 'proj')",
        "computes with them",
        "config={'head': keras_mp.QuantizeConfig(precision='int8')}",
        "Nothing was written",
    ):
        assert part in message
