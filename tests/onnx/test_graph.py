"""The graph index shared by export's weight folding and the lint."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from keras_mp.onnx.graph import GraphIndex, apply_layout, output_channel_axis

W = np.arange(24, dtype=np.float32).reshape(2, 3, 4, 1)


@pytest.mark.parametrize(
    "op_type, inputs, attrs, expected",
    [
        ("Transpose", [], {"perm": [3, 2, 0, 1]}, W.transpose(3, 2, 0, 1)),
        ("Reshape", [np.array([0, -1], np.int64)], {}, W.reshape(2, 12)),
        ("Flatten", [], {"axis": 2}, W.reshape(6, 4)),
        ("Squeeze", [np.array([3], np.int64)], {}, W[..., 0]),
        ("Unsqueeze", [np.array([0], np.int64)], {}, W[None]),
        ("Identity", [], {}, W),
    ],
)
def test_apply_layout_moves_values_as_onnx_does(
    op_type, inputs, attrs, expected
):
    names = [f"c{i}" for i in range(len(inputs))]
    node = helper.make_node(op_type, ["w", *names], ["y"], **attrs)
    got = apply_layout(node, W, dict(zip(names, inputs)))
    np.testing.assert_array_equal(got, expected)


def _dq_conv_graph():
    codes = numpy_helper.from_array(np.ones((4, 1, 3, 3), np.int8), "w_q")
    scale = numpy_helper.from_array(np.full(4, 0.1, np.float32), "w_s")
    zero = numpy_helper.from_array(np.zeros(4, np.int8), "w_z")
    nodes = [
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"]),
        helper.make_node("Identity", ["w"], ["w_id"], name="id"),
        helper.make_node("Conv", ["x", "w_id"], ["y"], name="conv"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [codes, scale, zero],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_index_traces_a_weight_through_layout_ops_to_its_dq():
    index = GraphIndex(_dq_conv_graph())
    (conv,) = index.weighted
    source = index.trace(conv.input[1])
    assert [n.name for n in source.layout] == ["id"]
    assert source.dq.op_type == "DequantizeLinear" and source.name == "w_q"
    assert index.quantized_inputs(conv) == [False, True]
    assert [(op.name, slot) for op, slot, _ in index.weights] == [("conv", 1)]
    assert output_channel_axis(conv, 1, 4) == 0
