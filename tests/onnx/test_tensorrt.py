"""The TensorRT lint on graphs broken on purpose, and on ONNX Runtime's PTQ.

Each broken graph starts from a clean Q/DQ Conv or MatMul graph (which ONNX
Runtime runs) and breaks one rule; the test checks that exactly that rule
fires on exactly that node.
"""

import os

import keras
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from keras_mp.onnx.tensorrt import check_tensorrt, is_2_4_sparse_onnx_weight

RNG = np.random.default_rng(0)


def _fired(report, rule, warnings=False):
    findings = report.warnings if warnings else report.violations
    return {f.node for f in findings if f.rule == rule}


def _rules(report):
    return {f.rule for f in report.violations}


def _model(nodes, inits, x_shape, y_shape, opset=17):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)]
    )


def _int8(shape):
    return RNG.integers(-100, 100, shape).astype(np.int8)


def _act_inits():
    return {"x_scale": np.float32(0.02), "x_zp": np.int8(0)}


def _act_qdq(x_zp="x_zp"):
    return [
        helper.make_node(
            "QuantizeLinear", ["x", "x_scale", x_zp], ["xq"], "q_x"
        ),
        helper.make_node(
            "DequantizeLinear", ["xq", "x_scale", x_zp], ["xdq"], "dq_x"
        ),
    ]


def conv_model(axis=0, opset=17, **inits):
    """x -> Q/DQ -> Conv <- DQ(int8 OIHW weight, per-channel) -> y.

    Keyword arguments replace initializers by name (`x_zp=np.uint8(128)`).
    """
    values = {
        **_act_inits(),
        "w_q": _int8((8, 8, 3, 3)),
        "w_scale": np.full(8, 0.01, np.float32),
        "w_zp": np.zeros(8, np.int8),
        "b": np.zeros(8, np.float32),
        **inits,
    }
    nodes = _act_qdq() + [
        helper.make_node(
            "DequantizeLinear",
            ["w_q", "w_scale", "w_zp"],
            ["wdq"],
            "dq_w",
            axis=axis,
        ),
        helper.make_node("Conv", ["xdq", "wdq", "b"], ["y"], "conv"),
    ]
    return _model(nodes, values, [1, 8, 6, 6], [1, 8, 4, 4], opset)


def matmul_model(weight=None, axis=1):
    """x -> Q/DQ -> MatMul <- DQ(int8 (in, out) weight) -> y."""
    weight = _int8((16, 8)) if weight is None else weight
    values = {
        **_act_inits(),
        "w_q": weight,
        "w_scale": np.full(weight.shape[axis], 0.01, np.float32),
        "w_zp": np.zeros(weight.shape[axis], np.int8),
    }
    nodes = _act_qdq() + [
        helper.make_node(
            "DequantizeLinear",
            ["w_q", "w_scale", "w_zp"],
            ["wdq"],
            "dq_w",
            axis=axis,
        ),
        helper.make_node("MatMul", ["xdq", "wdq"], ["y"], "matmul"),
    ]
    return _model(nodes, values, [2, 16], [2, 8])


def matmul_model_with(**inits):
    model = matmul_model()
    for init in model.graph.initializer:
        if init.name in inits:
            init.CopyFrom(numpy_helper.from_array(inits[init.name], init.name))
    return model


def _replace_node(model, name, *new_nodes):
    nodes = list(model.graph.node)
    i = next(i for i, n in enumerate(nodes) if n.name == name)
    nodes[i : i + 1] = new_nodes
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _two_four(shape, axis):
    """A random dense array made 2:4 sparse along `axis`."""
    w = np.moveaxis(_int8(shape), axis, -1).copy()
    groups = w.reshape(-1, 4)
    groups[:, 1::2] = 0
    return np.moveaxis(groups.reshape(w.shape), -1, axis)


@pytest.mark.parametrize("build", [conv_model, matmul_model])
def test_clean_graph_passes_and_runs(build):
    model = build()
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString())
    x_shape = [
        d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim
    ]
    session.run(None, {"x": np.ones(x_shape, np.float32)})
    report = check_tensorrt(model)
    assert report.ok, str(report)
    assert report.warnings == []
    assert (report.num_qdq, report.weighted_ops) == (3, 1)
    assert report.weighted_ops_quantized == 1
    assert "PASS" in str(report)


def test_uint8_zero_point_is_flagged():
    report = check_tensorrt(conv_model(x_zp=np.uint8(128)))
    assert _fired(report, "zero_point") == {"q_x", "dq_x"}
    assert "UINT8" in str(report)
    assert not report.ok and "FAIL" in str(report)


def test_missing_zero_point_means_uint8():
    model = conv_model()
    _replace_node(model, "q_x", *_act_qdq(x_zp="")[:1])
    _replace_node(model, "dq_x", *_act_qdq(x_zp="")[1:])
    report = check_tensorrt(model)
    assert _fired(report, "zero_point") == {"q_x", "dq_x"}
    assert "has no zero point" in str(report)


def test_nonzero_zero_point_is_flagged():
    report = check_tensorrt(matmul_model_with(x_zp=np.int8(5)))
    assert _fired(report, "zero_point") == {"q_x", "dq_x"}
    assert _rules(report) == {"zero_point"}


def test_run_time_scale_is_flagged():
    model = conv_model()
    runtime = [
        helper.make_node("Abs", ["x"], ["ax"], "abs"),
        helper.make_node("ReduceMax", ["ax"], ["amax"], "amax", keepdims=0),
        helper.make_node("Div", ["amax", "c127"], ["x_scale_rt"], "div"),
    ]
    model.graph.initializer.append(
        numpy_helper.from_array(np.float32(127), "c127")
    )
    qdq = _act_qdq()
    for node in qdq:
        node.input[1] = "x_scale_rt"
    _replace_node(model, "q_x", *runtime, qdq[0])
    _replace_node(model, "dq_x", qdq[1])
    report = check_tensorrt(model)
    assert _fired(report, "scale") == {"q_x", "dq_x"}
    assert "Div 'div'" in str(report)


@pytest.mark.parametrize("scale", [0.0, -0.5, np.inf])
def test_non_positive_or_infinite_scale_is_flagged(scale):
    report = check_tensorrt(conv_model(x_scale=np.float32(scale)))
    assert _fired(report, "scale") == {"q_x", "dq_x"}


def test_float16_scale_is_flagged_before_opset_19():
    report = check_tensorrt(conv_model(x_scale=np.float16(0.02)))
    assert _fired(report, "scale") == {"q_x", "dq_x"}
    assert "opset >= 19" in str(report)


def test_float16_scale_is_accepted_at_opset_19():
    # QuantizeLinear-19 takes float16 input and scale (float16 graphs for
    # strongly typed TensorRT builds); other dtypes stay violations.
    ok = conv_model(opset=19, x_scale=np.float16(0.02))
    assert not _fired(check_tensorrt(ok), "scale")
    bad = conv_model(opset=19, x_scale=np.float64(0.02))
    assert _fired(check_tensorrt(bad), "scale") == {"q_x", "dq_x"}


def test_scale_from_constant_node_is_accepted():
    model = conv_model()
    constant = helper.make_node(
        "Constant", [], ["x_scale_c"], "scale_c", value_float=0.02
    )
    qdq = _act_qdq()
    for node in qdq:
        node.input[1] = "x_scale_c"
    _replace_node(model, "q_x", constant, qdq[0])
    _replace_node(model, "dq_x", qdq[1])
    assert check_tensorrt(model).ok


def test_wrong_per_channel_axis_on_conv_weight():
    report = check_tensorrt(conv_model(axis=1))
    assert _fired(report, "per_channel") == {"dq_w"}
    assert "output-channel axis is 0" in str(report)


def test_wrong_per_channel_axis_on_matmul_weight():
    report = check_tensorrt(matmul_model(axis=0))
    assert _fired(report, "per_channel") == {"dq_w"}
    assert "output-channel axis is 1" in str(report)


def test_per_channel_activation_is_flagged():
    report = check_tensorrt(conv_model(x_scale=np.full(8, 0.02, np.float32)))
    assert _fired(report, "per_channel") == {"q_x", "dq_x"}
    assert "per-tensor" in str(report)


def test_per_channel_needs_opset_13():
    report = check_tensorrt(conv_model(opset=12))
    assert _fired(report, "per_channel") == {"dq_w"}
    assert "opset >= 13" in str(report)


def test_per_channel_scale_count_must_match_channels():
    report = check_tensorrt(conv_model(w_scale=np.full(4, 0.01, np.float32)))
    assert _fired(report, "per_channel") == {"dq_w"}


@pytest.mark.parametrize(
    "op_type, shape, attrs, good_axis, bad_axis",
    [
        ("ConvTranspose", (8, 4, 3, 3), {}, 1, 0),
        ("Gemm", (8, 16), {"transB": 1}, 0, 1),
        ("Gemm", (16, 8), {}, 1, 0),
    ],
)
def test_per_channel_axis_follows_op_layout(
    op_type, shape, attrs, good_axis, bad_axis
):
    def build(axis):
        n = shape[axis]
        values = {
            **_act_inits(),
            "w_q": _int8(shape),
            "w_scale": np.full(n, 0.01, np.float32),
            "w_zp": np.zeros(n, np.int8),
        }
        nodes = _act_qdq() + [
            helper.make_node(
                "DequantizeLinear",
                ["w_q", "w_scale", "w_zp"],
                ["wdq"],
                "dq_w",
                axis=axis,
            ),
            helper.make_node(op_type, ["xdq", "wdq"], ["y"], "op", **attrs),
        ]
        return _model(nodes, values, None, None)

    assert check_tensorrt(build(good_axis)).ok
    assert _fired(check_tensorrt(build(bad_axis)), "per_channel") == {"dq_w"}


def test_qoperator_nodes_are_flagged():
    values = {
        "x_scale": np.float32(0.02),
        "x_zp": np.uint8(128),
        "w": _int8((8, 8, 3, 3)),
        "w_scale": np.float32(0.01),
        "w_zp": np.int8(0),
        "y_scale": np.float32(0.1),
        "y_zp": np.uint8(128),
        "m": _int8((36, 4)),
    }
    nodes = [
        helper.make_node(
            "QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"], "q_x"
        ),
        helper.make_node(
            "QLinearConv",
            [
                "xq",
                "x_scale",
                "x_zp",
                "w",
                "w_scale",
                "w_zp",
                "y_scale",
                "y_zp",
            ],
            ["cq"],
            "qconv",
        ),
        helper.make_node("Reshape", ["cq", "shape"], ["r"], "reshape"),
        helper.make_node("MatMulInteger", ["r", "m"], ["y"], "mmi"),
    ]
    values["shape"] = np.array([-1, 36], np.int64)
    report = check_tensorrt(_model(nodes, values, None, None))
    assert _fired(report, "qoperator") == {"qconv", "mmi"}
    assert "QuantFormat.QDQ" in str(report)


@pytest.mark.parametrize("layout_op", ["Transpose", "Identity"])
def test_op_between_weight_dq_and_conv_is_flagged(layout_op):
    weight = _int8((8, 8, 3, 3))
    if layout_op == "Transpose":  # stored HWIO, as Keras keeps it
        weight = np.ascontiguousarray(weight.transpose(2, 3, 1, 0))
    model = conv_model(w_q=weight, w_scale=np.float32(0.01), w_zp=np.int8(0))
    dq_w = helper.make_node(
        "DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_hwio"], "dq_w"
    )
    attrs = {"perm": [3, 2, 0, 1]} if layout_op == "Transpose" else {}
    move = helper.make_node(layout_op, ["w_hwio"], ["wdq"], "move", **attrs)
    _replace_node(model, "dq_w", dq_w, move)
    report = check_tensorrt(model)
    assert _fired(report, "weight_dq_direct") == {"conv"}
    assert f"{layout_op} 'move'" in str(report)


def test_quantize_dequantize_of_float_weight_is_traced():
    w = RNG.normal(size=(8, 8, 3, 3)).astype(np.float32)
    model = conv_model(w_f=w)
    q_w = helper.make_node(
        "QuantizeLinear", ["w_f", "w_scale", "w_zp"], ["w_q"], "q_w", axis=1
    )
    model.graph.initializer.remove(
        next(i for i in model.graph.initializer if i.name == "w_q")
    )
    dq_w = helper.make_node(
        "DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["wdq"], "dq_w", axis=1
    )
    _replace_node(model, "dq_w", q_w, dq_w)
    report = check_tensorrt(model)
    assert _fired(report, "per_channel") == {"q_w", "dq_w"}
    assert report.weighted_ops_quantized == 1


def test_pruned_weight_breaking_2_4_is_flagged():
    w = _int8((8, 8, 3, 3))
    w[::2] = 0  # half the output channels zero: 50% zeros, not 2:4
    report = check_tensorrt(conv_model(w_q=w))
    assert _fired(report, "sparsity_2_4") == {"conv"}
    assert "looks pruned (50% zeros)" in str(report)
    assert check_tensorrt(conv_model(w_q=w), check_sparsity=False).ok


def test_2_4_weights_are_listed():
    conv = check_tensorrt(conv_model(w_q=_two_four((8, 8, 3, 3), axis=1)))
    matmul = check_tensorrt(matmul_model(_two_four((16, 8), axis=0)))
    assert conv.ok and matmul.ok
    assert conv.sparse_weights == ["w_q"] == matmul.sparse_weights
    assert "--sparsity=enable" in str(conv)
    # 2:4 along the output axis is not 2:4 for TensorRT.
    wrong = check_tensorrt(matmul_model(_two_four((16, 8), axis=1)))
    assert _fired(wrong, "sparsity_2_4") == {"matmul"}


def test_check_sparsity_true_requires_2_4_everywhere():
    dense = conv_model()
    assert check_tensorrt(dense).ok
    report = check_tensorrt(dense, check_sparsity=True)
    assert _fired(report, "sparsity_2_4") == {"conv"}
    assert check_tensorrt(dense, check_sparsity=False).sparse_weights == []


def test_is_2_4_sparse_onnx_weight():
    assert is_2_4_sparse_onnx_weight(_two_four((8, 8, 3, 3), 1), "Conv")
    assert not is_2_4_sparse_onnx_weight(_two_four((8, 8, 3, 3), 0), "Conv")
    assert is_2_4_sparse_onnx_weight(_two_four((16, 8), 0), "MatMul")
    assert is_2_4_sparse_onnx_weight(_two_four((8, 16), 1), "Gemm", True)
    assert not is_2_4_sparse_onnx_weight(np.zeros((6, 4)), "MatMul")
    with pytest.raises(ValueError, match="op_type="):
        is_2_4_sparse_onnx_weight(np.zeros((4, 4)), "Add")
    with pytest.raises(ValueError, match="shape"):
        is_2_4_sparse_onnx_weight(np.zeros(4), "Conv")


def test_only_weight_quantized_warns():
    model = conv_model()
    conv = next(n for n in model.graph.node if n.name == "conv")
    conv.input[0] = "x"
    report = check_tensorrt(model)
    assert report.ok
    assert _fired(report, "partial_quantization", warnings=True) == {"conv"}
    assert _fired(check_tensorrt(model, strict=True), "partial_quantization")


def test_weighted_op_left_float_warns_once_for_all():
    model = conv_model()
    conv = next(n for n in model.graph.node if n.name == "conv")
    conv.output[0] = "c"
    model.graph.initializer.append(
        numpy_helper.from_array(RNG.random((8, 8, 1, 1), np.float32), "w2")
    )
    model.graph.node.append(helper.make_node("Conv", ["c", "w2"], ["y"], "pw"))
    report = check_tensorrt(model)
    assert report.ok
    assert (report.weighted_ops, report.weighted_ops_quantized) == (2, 1)
    assert _fired(report, "float_weighted_ops", warnings=True) == {"pw"}
    (finding,) = [f for f in report.warnings if f.rule == "float_weighted_ops"]
    assert "1 of 2 weighted ops" in finding.message
    # a float graph is not a partly quantized one: no warning
    assert not _fired(check_tensorrt(float_conv()), "float_weighted_ops", True)
    assert not _fired(check_tensorrt(conv_model()), "float_weighted_ops", True)


def float_conv():
    """x -> Conv (float32 weight) -> y, no Q/DQ at all."""
    return _model(
        [helper.make_node("Conv", ["x", "w"], ["y"], "conv")],
        {"w": RNG.random((8, 8, 3, 3), np.float32)},
        [1, 8, 6, 6],
        [1, 8, 4, 4],
    )


def test_output_qdq_feeding_nothing_quantized_warns():
    model = conv_model(y_scale=np.float32(0.1), y_zp=np.int8(0))
    conv = next(n for n in model.graph.node if n.name == "conv")
    conv.output[0] = "c"
    model.graph.node.extend(
        [
            helper.make_node(
                "QuantizeLinear", ["c", "y_scale", "y_zp"], ["cq"], "q_out"
            ),
            helper.make_node(
                "DequantizeLinear", ["cq", "y_scale", "y_zp"], ["y"], "dq_out"
            ),
        ]
    )
    report = check_tensorrt(model)
    assert report.ok
    assert _fired(report, "output_qdq", warnings=True) == {"q_out"}


def _conv_output_qdq(where, feeds_matmul):
    """conv_model with a Q/DQ on the Conv output and a Transpose `where`
    ("before_q", "between", "after_dq") on its way, then a quantized MatMul
    (or the graph output when not `feeds_matmul`)."""
    model = conv_model(
        y_scale=np.float32(0.1),
        y_zp=np.int8(0),
        m_q=_int8((128, 8)),
        m_scale=np.full(8, 0.01, np.float32),
        m_zp=np.zeros(8, np.int8),
    )
    conv = next(n for n in model.graph.node if n.name == "conv")
    conv.output[0] = "c"
    chain, tensor = [], "c"
    for step in ("before_q", "q", "between", "dq", "after_dq"):
        out = f"{tensor}_{step}"
        if step == where:
            node = helper.make_node(
                "Transpose", [tensor], [out], "move", perm=[0, 2, 3, 1]
            )
        elif step in ("q", "dq"):
            op = "QuantizeLinear" if step == "q" else "DequantizeLinear"
            node = helper.make_node(
                op, [tensor, "y_scale", "y_zp"], [out], f"{step}_out"
            )
        else:
            continue
        chain.append(node)
        tensor = out
    if feeds_matmul:
        chain += [
            helper.make_node("Flatten", [tensor], ["flat"], "flatten"),
            helper.make_node(
                "DequantizeLinear",
                ["m_q", "m_scale", "m_zp"],
                ["mdq"],
                "dq_m",
                axis=1,
            ),
            helper.make_node("MatMul", ["flat", "mdq"], ["y"], "matmul"),
        ]
        shape = [1, 8]
    else:
        chain.append(helper.make_node("Identity", [tensor], ["y"], "out"))
        shape = [1, 4, 4, 8]
    model.graph.node.extend(chain)
    model.graph.output[0].CopyFrom(
        helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    )
    return model


@pytest.mark.parametrize("where", ["before_q", "between", "after_dq"])
def test_output_qdq_is_followed_through_layout_ops(where):
    # Q/DQ on a Conv output that feeds a MatMul's input is a TensorRT
    # placement, whatever Transpose stands on the way (tf2onnx puts the
    # attention head split there); feeding nothing weighted, it warns.
    clean = _conv_output_qdq(where, feeds_matmul=True)
    ort.InferenceSession(clean.SerializeToString()).run(
        None, {"x": np.ones((1, 8, 6, 6), np.float32)}
    )
    report = check_tensorrt(clean)
    assert report.ok and report.warnings == [], str(report)
    assert report.weighted_ops == report.weighted_ops_quantized == 2
    wasted = check_tensorrt(_conv_output_qdq(where, feeds_matmul=False))
    assert _fired(wasted, "output_qdq", warnings=True) == {"q_out"}


@pytest.mark.parametrize("fusable", [True, False])
def test_output_qdq_on_a_residual_skip_input(fusable):
    # ResNet50V2's shortcut Conv feeds the residual Add through the skip
    # input Q/DQ that lets TensorRT fuse the other Conv with the Add: not a
    # wasted pair. Behind a Relu the other Conv cannot fuse: it is.
    model = conv_model(y_scale=np.float32(0.1), y_zp=np.int8(0))
    conv = next(n for n in model.graph.node if n.name == "conv")
    conv.output[0] = "c"
    main = "c2" if fusable else "r2"
    model.graph.node.extend(
        [
            helper.make_node(
                "QuantizeLinear", ["c", "y_scale", "y_zp"], ["cq"], "q_out"
            ),
            helper.make_node(
                "DequantizeLinear", ["cq", "y_scale", "y_zp"], ["cdq"], "dq_out"
            ),
            helper.make_node("Conv", ["xdq", "wdq", "b"], ["c2"], "conv2"),
            helper.make_node("Relu", ["c2"], ["r2"], "relu"),
            helper.make_node("Add", [main, "cdq"], ["y"], "add"),
        ]
    )
    report = check_tensorrt(model)
    assert report.ok
    if fusable:
        assert report.warnings == [], str(report)
    else:
        assert _fired(report, "output_qdq", warnings=True) == {"q_out"}
        assert _fired(report, "residual_add", warnings=True) == {"add"}


def test_residual_add_with_unquantized_skip_warns():
    # Conv -> Add -> Q/DQ -> Conv: the Add's output is quantized next, so a
    # quantized skip input lets TensorRT run Conv + Add as one INT8 kernel
    # (tests/onnx/test_rules.py has the cases where it cannot).
    model = conv_model()
    conv = next(n for n in model.graph.node if n.name == "conv")
    conv.output[0] = "c"
    conv.attribute.extend([helper.make_attribute("pads", [1, 1, 1, 1])])
    model.graph.node.extend(
        [
            helper.make_node("Add", ["c", "x"], ["sum"], "add"),
            helper.make_node(
                "QuantizeLinear", ["sum", "x_scale", "x_zp"], ["sq"], "q_sum"
            ),
            helper.make_node(
                "DequantizeLinear", ["sq", "x_scale", "x_zp"], ["sdq"], "dq_sum"
            ),
            helper.make_node("Conv", ["sdq", "wdq", "b"], ["y"], "conv2"),
        ]
    )
    ort.InferenceSession(model.SerializeToString()).run(
        None, {"x": np.ones((1, 8, 6, 6), np.float32)}
    )
    report = check_tensorrt(model)
    assert report.ok
    assert _fired(report, "residual_add", warnings=True) == {"add"}
    assert "skip input 'x'" in str(report)


def _bad_files(d):
    """Files a user may hand to the lint by mistake."""
    (d / "junk.onnx").write_bytes(b"\x08\x07junk, not protobuf \xff\xfe")
    (d / "empty.onnx").write_bytes(b"")
    valid = conv_model().SerializeToString()
    (d / "truncated.onnx").write_bytes(valid[:20])
    os.makedirs(d / "folder")


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ("none.onnx", ValueError, "No ONNX file at .*none.onnx"),
        ("folder", ValueError, "No ONNX file at .*folder"),
        ("junk.onnx", ValueError, "junk.onnx' is not a readable ONNX model"),
        (
            "empty.onnx",
            ValueError,
            r"empty.onnx' is not an ONNX model \(no IR version or opset\)",
        ),
        ("truncated.onnx", ValueError, "truncated.onnx' is not"),
        (3, TypeError, "ONNX file path or an onnx.ModelProto. Received: int"),
    ],
    ids=["missing", "folder", "junk", "empty", "truncated", "not_a_path"],
)
def test_bad_input_raises_clear_error(tmp_path, bad, error, match):
    _bad_files(tmp_path)
    if isinstance(bad, str):
        bad = str(tmp_path / bad)
    with pytest.raises(error, match=match):
        check_tensorrt(bad)


def test_a_keras_model_instead_of_onnx_is_named():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(TypeError, match="Received: Sequential"):
        check_tensorrt(model)


def test_bad_check_sparsity_raises():
    with pytest.raises(
        ValueError,
        match="check_sparsity must be 'auto', True or False. Received: "
        "check_sparsity='yes'",
    ):
        check_tensorrt(conv_model(), check_sparsity="yes")


def test_reads_a_file(tmp_path):
    path = tmp_path / "conv.onnx"
    onnx.save(conv_model(x_zp=np.int8(3)), str(path))
    report = check_tensorrt(path)
    assert report.source == str(path)
    assert _fired(report, "zero_point") == {"q_x", "dq_x"}


# ONNX Runtime's own post-training quantization on a small residual CNN.


def _float_cnn():
    def weight(*shape):
        return RNG.normal(0, 0.3, shape).astype(np.float32)

    nodes = [
        helper.make_node(
            "Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1] * 4
        ),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node(
            "Conv", ["r1", "w2", "b2"], ["c2"], "conv2", pads=[1] * 4
        ),
        helper.make_node("Add", ["c2", "r1"], ["a"], "add"),
        helper.make_node("Relu", ["a"], ["r2"], "relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], "gap"),
        helper.make_node("Flatten", ["g"], ["f"], "flatten"),
        helper.make_node("MatMul", ["f", "wd"], ["m"], "dense"),
        helper.make_node("Add", ["m", "bd"], ["y"], "dense_bias"),
    ]
    inits = {
        "w1": weight(8, 4, 3, 3),
        "b1": weight(8),
        "w2": weight(8, 8, 3, 3),
        "b2": weight(8),
        "wd": weight(8, 10),
        "bd": weight(10),
    }
    return _model(nodes, inits, [1, 4, 8, 8], [1, 10], opset=17)


@pytest.fixture(scope="module")
def ort_quantized(tmp_path_factory):
    """Float CNN quantized by ONNX Runtime in four configurations."""
    from onnxruntime import quantization as q

    class Reader(q.CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(1)
            batches = rng.normal(size=(4, 1, 4, 8, 8)).astype(np.float32)
            self.batches = iter({"x": b} for b in batches)

        def get_next(self):
            return next(self.batches, None)

    folder = tmp_path_factory.mktemp("ort")
    float_path = str(folder / "float.onnx")
    onnx.save(_float_cnn(), float_path)
    symmetric = {
        "quant_format": q.QuantFormat.QDQ,
        "activation_type": q.QuantType.QInt8,
        "weight_type": q.QuantType.QInt8,
        "per_channel": True,
        "extra_options": {"ActivationSymmetric": True, "WeightSymmetric": True},
    }
    no_bias = dict(
        symmetric,
        extra_options={**symmetric["extra_options"], "QuantizeBias": False},
    )
    configs = {
        "symmetric": symmetric,
        "symmetric_float_bias": no_bias,
        "default": {},
        "uint8": {"activation_type": q.QuantType.QUInt8},
    }
    paths = {"float": float_path}
    for name, kwargs in configs.items():
        paths[name] = str(folder / f"{name}.onnx")
        q.quantize_static(float_path, paths[name], Reader(), **kwargs)
    return paths


def test_float_model_has_nothing_to_report(ort_quantized):
    report = check_tensorrt(ort_quantized["float"])
    assert report.ok and report.warnings == []
    assert (report.num_qdq, report.weighted_ops) == (0, 3)


def test_ort_symmetric_per_channel_ptq(ort_quantized):
    # Measured: INT8, zero point 0, per-channel weights on the right axes
    # (Conv 0, MatMul 1), every weighted op fully quantized; the only
    # violations are ONNX Runtime's INT32 quantized Conv biases.
    report = check_tensorrt(ort_quantized["symmetric"])
    assert _rules(report) == {"zero_point"}
    assert _fired(report, "zero_point") == {
        "b1_DequantizeLinear",
        "b2_DequantizeLinear",
    }
    assert "QuantizeBias=False" in str(report)
    assert report.weighted_ops == report.weighted_ops_quantized == 3
    # Q/DQ on every op output: conservative placement, warned about.
    assert _fired(report, "output_qdq", warnings=True) == {
        "c1_QuantizeLinear",
        "c2_QuantizeLinear",
        "m_QuantizeLinear",
    }
    float_bias = check_tensorrt(ort_quantized["symmetric_float_bias"])
    assert float_bias.ok, str(float_bias)
    assert float_bias.num_qdq < report.num_qdq


def test_ort_default_ptq_is_flagged(ort_quantized):
    # Measured with onnxruntime 1.32: the default is INT8 activations, but
    # asymmetric (non-zero zero points, e.g. -128 after a Relu).
    report = check_tensorrt(ort_quantized["default"])
    assert not report.ok
    assert "r1_QuantizeLinear" in _fired(report, "zero_point")
    assert "asymmetric" in str(report)
    uint8 = check_tensorrt(ort_quantized["uint8"])
    assert "x_QuantizeLinear" in _fired(uint8, "zero_point")
    assert "UINT8" in str(uint8)


def test_ort_symmetric_ptq_of_keras_export(tmp_path):
    import keras
    from onnxruntime import quantization as q

    model = keras.Sequential(
        [
            keras.Input((12, 12, 4)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.DepthwiseConv2D(3),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(8),
        ]
    )
    x = np.random.default_rng(2).random((3, 1, 12, 12, 4), np.float32)
    model(x[0])
    float_path, int8_path = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    model.export(float_path, format="onnx", verbose=False)
    assert check_tensorrt(float_path).ok
    name = onnx.load(float_path).graph.input[0].name

    class Reader(q.CalibrationDataReader):
        batches = iter({name: b} for b in x)

        def get_next(self):
            return next(self.batches, None)

    q.quantize_static(
        float_path,
        int8_path,
        Reader(),
        quant_format=q.QuantFormat.QDQ,
        per_channel=True,
        extra_options={
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            "QuantizeBias": False,
        },
    )
    report = check_tensorrt(int8_path)
    assert report.ok, str(report)
    assert report.weighted_ops == report.weighted_ops_quantized == 3
    assert {f.rule for f in report.warnings} == {"output_qdq"}
