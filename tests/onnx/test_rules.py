"""The residual-Add rule: which Adds it flags, on small graphs ONNX Runtime
runs, and on a keras-hub-style block exported by keras_mp.

TensorRT's Conv+Add fusion takes an INT8 skip input when the Add's output is
quantized next (a Q before the next weighted op); a transformer's residual
Add feeds a LayerNormalization in float, where a skip Q/DQ fuses into
nothing (`_rule_residual_add`'s docstring has the sources).
"""

import keras
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import keras_mp
from keras_mp.onnx.tensorrt import check_tensorrt

RNG = np.random.default_rng(0)


def _qdq(tensor, name):
    """Q/DQ of `tensor` with scale `s`, zero point `zp`; returns the nodes
    and the dequantized tensor."""
    nodes = [
        helper.make_node(
            "QuantizeLinear", [tensor, "s", "zp"], [f"{name}_q"], f"q_{name}"
        ),
        helper.make_node(
            "DequantizeLinear",
            [f"{name}_q", "s", "zp"],
            [f"{name}_dq"],
            f"dq_{name}",
        ),
    ]
    return nodes, f"{name}_dq"


def _weight(name, shape, axis):
    """An INT8 weight with its per-channel DQ; returns the node, the tensor
    and the initializers."""
    channels = shape[axis]
    inits = {
        f"{name}_q": RNG.integers(-100, 100, shape).astype(np.int8),
        f"{name}_s": np.full(channels, 0.01, np.float32),
        f"{name}_zp": np.zeros(channels, np.int8),
    }
    node = helper.make_node(
        "DequantizeLinear",
        list(inits),
        [f"{name}_dq"],
        f"dq_{name}",
        axis=axis,
    )
    return node, f"{name}_dq", inits


def _residual(kind, after, skip_quantized=False, batchnorm=False, layout=False):
    """x -> Q/DQ -> weighted op [-> BatchNorm] -> Add(., skip) -> `after`.

    `kind`: "conv" (x of shape (1, 8, 6, 6), 3x3 Conv) or "dense" (x of
    shape (1, 4, 8), MatMul + bias). The skip input is x, quantized by the
    same Q/DQ as the op's input when `skip_quantized`. `after`: "qdq_op"
    (Relu, Q/DQ, the same weighted op again: the next layer's INT8 input),
    "layernorm" (LayerNormalization in float, then Q/DQ and the op: a
    transformer block), or "output" (the Add is the graph output).
    """
    inits = {"s": np.float32(0.05), "zp": np.int8(0)}
    nodes, xdq = _qdq("x", "x")
    if kind == "conv":
        shape = [1, 8, 6, 6]
        dq, w, values = _weight("w", (8, 8, 3, 3), 0)
        inits.update(values, b=np.zeros(8, np.float32))

        def op(tensor, out):
            return [
                helper.make_node(
                    "Conv", [tensor, w, "b"], [out], out, pads=[1] * 4
                )
            ]

    else:
        shape = [1, 4, 8]
        dq, w, values = _weight("w", (8, 8), 1)
        inits.update(values, b=np.zeros(8, np.float32))

        def op(tensor, out):
            return [
                helper.make_node("MatMul", [tensor, w], [f"{out}_mm"], out),
                helper.make_node(
                    "Add", [f"{out}_mm", "b"], [out], f"{out}_bias"
                ),
            ]

    nodes += [dq] + op(xdq, "main")
    main = "main"
    if layout:  # NHWC and back, as tf2onnx leaves them without its optimizer
        nodes += [
            helper.make_node(
                "Transpose", [main], ["nhwc"], "t1", perm=[0, 2, 3, 1]
            ),
            helper.make_node(
                "Transpose", ["nhwc"], ["nchw"], "t2", perm=[0, 3, 1, 2]
            ),
        ]
        main = "nchw"
    if batchnorm:
        inits.update(
            gamma=np.ones(8, np.float32),
            beta=np.zeros(8, np.float32),
            mean=np.zeros(8, np.float32),
            var=np.ones(8, np.float32),
        )
        nodes.append(
            helper.make_node(
                "BatchNormalization",
                [main, "gamma", "beta", "mean", "var"],
                ["bn"],
                "bn",
            )
        )
        main = "bn"
    skip = xdq if skip_quantized else "x"
    nodes.append(helper.make_node("Add", [main, skip], ["sum"], "add"))
    if after == "qdq_op":
        nodes.append(helper.make_node("Relu", ["sum"], ["act"], "relu"))
        more, actdq = _qdq("act", "act")
        nodes += more + op(actdq, "y")
    elif after == "layernorm":
        width = shape[-1]  # normalized over the last axis
        inits.update(
            ln_g=np.ones(width, np.float32), ln_b=np.zeros(width, np.float32)
        )
        nodes.append(
            helper.make_node(
                "LayerNormalization", ["sum", "ln_g", "ln_b"], ["ln"], "ln"
            )
        )
        more, lndq = _qdq("ln", "ln")
        nodes += more + op(lndq, "y")
    else:
        nodes.append(helper.make_node("Identity", ["sum"], ["y"], "out"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)]
    )
    ort.InferenceSession(model.SerializeToString()).run(
        None, {"x": RNG.random(shape, dtype=np.float32)}
    )
    return model


def _residual_findings(model):
    report = check_tensorrt(model)
    assert report.ok, str(report)
    return [f for f in report.warnings if f.rule == "residual_add"]


@pytest.mark.parametrize("batchnorm", [False, True], ids=["conv", "conv_bn"])
def test_conv_add_feeding_a_quantized_conv_needs_the_skip_qdq(batchnorm):
    # ResNet's block: Conv [-> BN] -> Add -> Relu -> Q/DQ -> Conv. With the
    # skip quantized, TensorRT runs Conv + Add as one INT8 kernel.
    found = _residual_findings(_residual("conv", "qdq_op", batchnorm=batchnorm))
    assert [f.node for f in found] == ["add"]
    assert "skip input 'x'" in found[0].message
    assert "Conv 'main'" in found[0].message
    clean = _residual(
        "conv", "qdq_op", skip_quantized=True, batchnorm=batchnorm
    )
    assert _residual_findings(clean) == []


@pytest.mark.parametrize("skip_quantized", [False, True])
def test_conv_side_is_found_through_layout_transposes(skip_quantized):
    # MobileNetV3Small: tf2onnx's transpose optimizer crashes and is
    # skipped, leaving Conv -> Transpose -> BatchNorm -> Add. The Conv is
    # still the Add's weighted side: a quantized skip is clean (it used to
    # read as "one quantized input, no weighted op"), a float one flagged.
    model = _residual(
        "conv", "qdq_op", skip_quantized, batchnorm=True, layout=True
    )
    found = _residual_findings(model)
    if skip_quantized:
        assert found == []
    else:
        assert [f.node for f in found] == ["add"]
        assert "Conv 'main'" in found[0].message


def test_dense_add_feeding_a_quantized_gemm_is_flagged_too():
    # The fusion is about the consumer, not the op type: a GEMM + Add whose
    # output is quantized next can write INT8 as a Conv + Add does.
    found = _residual_findings(_residual("dense", "qdq_op"))
    assert [f.node for f in found] == ["add"]
    assert "MatMul 'main'" in found[0].message


@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("after", ["layernorm", "output"])
def test_add_with_a_float_output_is_not_flagged(kind, after):
    # A transformer's residual Add feeds a LayerNormalization in float (or
    # the Add is a graph output): the fused output is float whatever the
    # skip input, so a skip Q/DQ would only add a Q and a DQ.
    assert _residual_findings(_residual(kind, after)) == []


def test_one_quantized_input_without_a_weighted_op_is_still_flagged():
    # x's Q/DQ on one side, x itself on the other, no weighted op before
    # the Add: quantize both or neither, whatever follows the Add.
    model = _residual("conv", "output")
    add = next(n for n in model.graph.node if n.name == "add")
    add.input[0] = "x_dq"
    found = _residual_findings(model)
    assert [f.node for f in found] == ["add"]
    assert "quantize both or neither" in found[0].message


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class _Block(keras.layers.Layer):
    """A post-LayerNorm transformer sublayer written as keras-hub writes
    it: `LayerNorm(x + Dense(x))`, the residual Add a plain `+`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)
        self.norm = keras.layers.LayerNormalization()

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.norm.build(input_shape)

    def call(self, x):
        return self.norm(x + self.dense(x))


def test_keras_hub_style_residual_add_exports_lint_clean(tmp_path):
    # In-place quantization of a custom layer (keras-hub's route), exported
    # by tf2onnx, which decomposes LayerNormalization into pooling and
    # arithmetic: the Dense -> Add -> LayerNorm residual is not flagged,
    # and the next Dense's input still has its Q/DQ.
    # 2-D features: tf2onnx lowers the Dense to MatMul + bias, no Reshape
    # between it and the Add (as keras-hub's attention output projection).
    inputs = keras.Input((8,))
    x = _Block()(_Block()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    data = RNG.random((16, 8), dtype=np.float32)
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, data, verbose=0)
    path = str(tmp_path / "block.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=data)
    report = check_tensorrt(path)
    assert report.ok and report.warnings == [], str(report)
    assert report.weighted_ops == report.weighted_ops_quantized == 3


def _pooled(op, out_quantized, branches=1, same_scale=True, dq_late=False):
    """`branches` x (x -> Q/DQ -> Conv -> Q/DQ) [-> Concat] -> `op`
    [-> GlobalAveragePool] [-> Q/DQ] -> output, with `op` "AveragePool",
    "MaxPool" (followed by a GlobalAveragePool) or "GlobalAveragePool".
    `dq_late`: each branch's Q feeds the Concat, one DQ after it (what
    tf2onnx's optimizer makes of equal scales)."""
    shape = (1, 4, 6, 6)
    nodes, x_dq = _qdq("x", "x")
    inits = {
        "s": np.float32(0.02),
        "s2": np.float32(0.03),
        "zp": np.int8(0),
    }
    outputs = []
    for b in range(branches):
        w, w_dq, w_inits = _weight(f"w{b}", (4, 4, 1, 1), 0)
        inits.update(w_inits)
        conv = helper.make_node("Conv", [x_dq, w_dq], [f"c{b}"], f"conv{b}")
        qdq, c_dq = _qdq(f"c{b}", f"c{b}")
        if not same_scale and b:
            for node in qdq:
                node.input[1] = "s2"
        if dq_late:
            qdq, c_dq = qdq[:1], qdq[0].output[0]
        nodes += [w, conv, *qdq]
        outputs.append(c_dq)
    if branches > 1:
        nodes.append(
            helper.make_node("Concat", outputs, ["cat"], "cat", axis=1)
        )
        outputs = ["cat"]
        if dq_late:
            nodes.append(
                helper.make_node(
                    "DequantizeLinear", ["cat", "s", "zp"], ["cat_dq"], "dq"
                )
            )
            outputs = ["cat_dq"]
    kwargs = {"kernel_shape": [2, 2]} if op != "GlobalAveragePool" else {}
    nodes.append(helper.make_node(op, outputs, ["pool"], "pool", **kwargs))
    last = "pool"
    if op == "MaxPool":
        nodes.append(helper.make_node("GlobalAveragePool", [last], ["gap"]))
        last = "gap"
    if out_quantized:
        qdq, last = _qdq(last, "out")
        nodes += qdq
    nodes.append(helper.make_node("Identity", [last], ["y"], "y"))
    graph = helper.make_graph(
        nodes,
        "pooled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)]
    )
    ort.InferenceSession(model.SerializeToString()).run(
        None, {"x": RNG.random(shape, dtype=np.float32)}
    )
    return model


def _output_qdq(model):
    report = check_tensorrt(model)
    assert report.ok, str(report)
    return sorted(f.node for f in report.warnings if f.rule == "output_qdq")


@pytest.mark.parametrize("op", ["AveragePool", "GlobalAveragePool", "MaxPool"])
def test_qdq_into_a_pooling_with_a_quantized_output_is_fused(op):
    # TensorRT fuses DQ -> AveragePool -> Q into one INT8 pooling, and
    # moves the DQ across a MaxPool (placement.qdq_role has the source).
    assert _output_qdq(_pooled(op, out_quantized=True)) == []


@pytest.mark.parametrize("op", ["AveragePool", "GlobalAveragePool"])
def test_qdq_into_a_pooling_with_a_float_output_still_warns(op):
    # Non-weighted INT8 ops need an INT8 output: a Q/DQ a user put before
    # a pooling whose output stays float fuses into nothing.
    assert _output_qdq(_pooled(op, out_quantized=False)) == ["q_c0"]


def test_concat_inputs_commute_only_with_one_scale():
    # TensorRT moves the DQs of a Concat's inputs past it only when their
    # scales are equal; then they reach the quantized pooling after it.
    same = _pooled("GlobalAveragePool", True, branches=2, same_scale=True)
    assert _output_qdq(same) == []
    other = _pooled("GlobalAveragePool", True, branches=2, same_scale=False)
    assert _output_qdq(other) == ["q_c0", "q_c1"]
    # The same with the one DQ moved past the Concat (tf2onnx does so for
    # keras_mp's Concatenate, whose inputs share one range).
    late = _pooled("GlobalAveragePool", True, 2, same_scale=True, dq_late=True)
    assert _output_qdq(late) == []
    late = _pooled("GlobalAveragePool", False, 2, same_scale=True, dq_late=True)
    assert _output_qdq(late) == ["q_c0", "q_c1"]


def _up_concat(sparse=False):
    """A U-Net decoder step: x -> Q/DQ -> ConvTranspose -> Q/DQ (scale s2)
    -> Concat with x's DQ (scale s) -> Q/DQ -> Conv -> output. The
    ConvTranspose weight (C_in 8, C_out 8, 2, 2) is 2:4 sparse along its
    input channels (axis 0) when `sparse`."""
    shape = (1, 8, 4, 4)
    inits = {"s": np.float32(0.05), "s2": np.float32(0.03), "zp": np.int8(0)}
    nodes, x_dq = _qdq("x", "x")
    up_dq, up_w, up_inits = _weight("up", (8, 8, 2, 2), 1)
    if sparse:
        codes = up_inits["up_q"]
        codes[1::4] = codes[2::4] = 0  # two zeros in each group of 4
    conv_dq, conv_w, conv_inits = _weight("cv", (8, 16, 3, 3), 0)
    inits.update(up_inits, **conv_inits)
    up_qdq, up_out = _qdq("up", "up_out")
    for node in up_qdq:
        node.input[1] = "s2"
    cat_qdq, cat_out = _qdq("cat", "cat")
    nodes += [
        up_dq,
        helper.make_node(
            "ConvTranspose", [x_dq, up_w], ["up"], "up", strides=[2, 2]
        ),
        *up_qdq,
        helper.make_node("Resize", [x_dq, "", "scales"], ["x_up"], "resize"),
        helper.make_node("Concat", [up_out, "x_up"], ["cat"], "cat", axis=1),
        *cat_qdq,
        conv_dq,
        helper.make_node(
            "Conv", [cat_out, conv_w], ["y"], "conv", pads=[1] * 4
        ),
    ]
    inits["scales"] = np.array([1, 1, 2, 2], np.float32)
    graph = helper.make_graph(
        nodes,
        "up_concat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)]
    )
    ort.InferenceSession(model.SerializeToString()).run(
        None, {"x": RNG.random(shape, dtype=np.float32)}
    )
    return model


def test_output_qdq_follows_a_concat_to_the_next_quantized_conv():
    # Before: a false `output_qdq` on the ConvTranspose's Q, whose DQ
    # reaches the Conv's input Q through a Concat of two scales.
    assert _output_qdq(_up_concat()) == []


def test_conv_transpose_2_4_weights_are_counted():
    # Before: the lint looked at Conv, MatMul and Gemm weights only (a
    # U-Net with 6 sparse weights listed 5).
    report = check_tensorrt(_up_concat(sparse=True), check_sparsity=True)
    assert "up_q" in report.sparse_weights
    report = check_tensorrt(_up_concat(sparse=False), check_sparsity=True)
    assert "up_q" not in report.sparse_weights
    assert "up" in {f.node for f in report.violations}  # breaks 2:4


def _interaction(quantize_embedding=True):
    """A DLRM interaction: x -> Q/DQ -> MatMul (a Dense) -> Q/DQ ->
    Unsqueeze -> MatMul <- Unsqueeze <- [Q/DQ] <- e (an embedding row):
    the dot product of two activations, as keras.layers.Dot exports."""
    inits = {"s": np.float32(0.05), "zp": np.int8(0)}
    inits["axes1"], inits["axes2"] = np.array([1]), np.array([2])
    nodes, x_dq = _qdq("x", "x")
    w, w_dq, w_inits = _weight("w", (8, 8), 1)
    inits.update(w_inits)
    bottom_qdq, bottom = _qdq("bottom", "bottom")
    nodes += [
        w,
        helper.make_node("MatMul", [x_dq, w_dq], ["bottom"], "dense"),
        *bottom_qdq,
    ]
    e = "e"
    if quantize_embedding:
        e_qdq, e = _qdq("e", "e")
        nodes += e_qdq
    nodes += [
        helper.make_node("Unsqueeze", [bottom, "axes1"], ["a"], "unsqueeze_a"),
        helper.make_node("Unsqueeze", [e, "axes2"], ["b"], "unsqueeze_b"),
        helper.make_node("MatMul", ["a", "b"], ["y"], "interaction"),
    ]
    graph = helper.make_graph(
        nodes,
        "interaction",
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, (2, 8))
            for n in ("x", "e")
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)]
    )
    feeds = {n: RNG.random((2, 8), dtype=np.float32) for n in ("x", "e")}
    ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    return model


def test_matmul_of_two_activations_is_a_quantized_weighted_op():
    # The Q/DQ on the Dense output feeds the interaction MatMul: it is
    # used (no `output_qdq`), and that MatMul counts as INT8.
    report = check_tensorrt(_interaction())
    assert report.ok and report.warnings == [], str(report)
    assert report.weighted_ops == report.weighted_ops_quantized == 2
    # With one input float, TensorRT runs it in float: said so.
    report = check_tensorrt(_interaction(quantize_embedding=False))
    rules = [(f.rule, f.node) for f in report.warnings]
    assert rules == [("partial_quantization", "interaction")]
