"""Export's weight fold gives each weight the INT8 codes Keras' weight
quantizer computed, bit for bit, on weights full of rounding ties."""

import re

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from keras_mp.onnx.graph import GraphIndex
from keras_mp.quantization import twins

L = keras.layers
pytest.importorskip("tf2onnx")


def _model():
    """Conv2D (per channel and per tensor), grouped Conv2D, DepthwiseConv2D,
    Dense (per tensor), EinsumDense (per channel over two output axes,
    heads x head_dim, with a kernel Reshape in the graph; and over one)."""
    x = keras.Input((6, 6, 4))
    y = L.Conv2D(8, 3, padding="same", name="conv")(x)
    y = L.Conv2D(8, 3, padding="same", groups=2, name="grouped")(y)
    y = L.DepthwiseConv2D(3, depth_multiplier=2, padding="same", name="dw")(y)
    y = L.Conv2D(6, 1, name="conv_pt")(y)
    y = L.GlobalAveragePooling2D()(y)
    y = L.Dense(24, name="dense_pt")(y)
    y = L.Reshape((4, 6))(y)
    y = L.EinsumDense("abc,cde->abde", (4, 4, 4), name="einsum_heads")(y)
    y = L.Flatten()(y)
    y = L.EinsumDense("ab,bc->ac", 5, bias_axes="c", name="einsum")(y)
    return keras.Model(x, y)


def _ambiguous_amax(rng, n):
    """`n` float32 ranges `amax` with `float32(float32(amax / 127) * 127)
    != amax`: the range is not recovered by multiplying the scale back."""
    found = []
    while len(found) < n:
        a = (10.0 ** rng.uniform(-3, 1, 4096)).astype(np.float32)
        back = (a / np.float32(127) * np.float32(127)).astype(np.float32)
        found.extend(a[back != a])
    return np.asarray(found[:n], np.float32)


def _tie_weights(shape, channels, rng):
    """A weight of `shape` whose trailing axes hold `channels` output
    channels, each with its own range, half of them ambiguous ones. Every
    value sits at or one or two float32 steps from a rounding tie of TF's
    `w * (127 / amax)`; each channel holds its `amax` once."""
    amax = (10.0 ** rng.uniform(-3, 1, channels)).astype(np.float32)
    amax[::2] = _ambiguous_amax(rng, len(amax[::2]))
    rows = int(np.prod(shape)) // channels
    k = rng.integers(-127, 127, (rows, channels))
    w = ((k + 0.5) * (amax / np.float32(127)).astype(np.float64)).astype(
        np.float32
    )
    for step in rng.integers(-2, 3, (2, rows, channels)):
        w = np.where(step > 0, np.nextafter(w, np.float32(np.inf)), w)
        w = np.where(step < 0, np.nextafter(w, np.float32(-np.inf)), w)
    w = np.clip(w, -amax, amax)
    w[0] = amax * np.sign(rng.standard_normal(channels)).astype(np.float32)
    return w.reshape(shape)


def _keras_codes(layer):
    """The INT8 codes of a quantized layer's kernel from its own fake
    quantization, its float kernel and the ONNX scale, one column per
    output channel."""
    amax_var = layer.weight_ranges[0][2]
    kernel, fake = layer._weight_mapping()[0]
    scale = (np.asarray(amax_var) / np.float32(127)).astype(np.float32)
    flat = (-1, scale.size)  # the output axes are the trailing ones
    fake = np.asarray(fake).reshape(flat)
    w = np.asarray(kernel).reshape(flat)
    return np.rint(fake / scale.reshape(1, -1)), w, scale.reshape(1, -1)


def test_fold_matches_keras_codes_at_ties(tmp_path):
    rng = np.random.default_rng(0)
    model = _model()
    x = rng.standard_normal((16, 6, 6, 4)).astype("float32")
    model(x)
    for layer in model.layers:
        if layer.weights:
            kernel = layer.weights[0]
            channels = 1 if layer.name.endswith("_pt") else kernel.shape[-1]
            if isinstance(layer, L.DepthwiseConv2D) or "heads" in layer.name:
                channels *= kernel.shape[-2]
            kernel.assign(_tie_weights(kernel.shape, channels, rng))
    per_tensor = keras_mp.QuantizeConfig(per_channel=False)
    qmodel = keras_mp.quantize_model(
        model, config={"conv_pt": per_tensor, "dense_pt": per_tensor}
    )
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "ties.onnx")
    report = keras_mp.export_onnx(qmodel, path, verify_data=x)
    assert report.rel_l2 < 1e-5, report

    index = GraphIndex(onnx.load(path))
    quantized = twins.quantized_layers(qmodel)
    assert len(quantized) == 7
    for layer in quantized:
        want, w, scale = _keras_codes(layer)
        # the weights are made of ties: ONNX's own rounding of w / scale
        # picks other codes than Keras did
        assert (np.clip(np.rint(w / scale), -128, 127) != want).any()
        (op,) = [
            op
            for op in index.weighted
            if re.search(rf"/{layer.name}(_\d+)?/", op.name)
        ]
        dq = index.producers[op.input[1]]
        assert dq.op_type == "DequantizeLinear", layer.name
        got = index.const(dq.input[0])
        assert got is not None and got.dtype == np.int8, layer.name
        assert index.const(dq.input[1]).size == scale.size, layer.name
        np.testing.assert_array_equal(
            np.sort(got, axis=None), np.sort(want, axis=None), layer.name
        )


def _einsum_kernel_graph():
    """The graph tf2onnx writes for an EinsumDense kernel when the sequence
    length is dynamic: the weight's DQ reaches its Gemm through Unsqueeze,
    Transpose and a Reshape whose shape is computed from the weight's own
    Shape at run time, and the output's shape reads that Shape too."""
    h = onnx.helper
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 4, 6)).astype(np.float32)
    scale = (np.abs(w).max(axis=(0, 1)) / 127).astype(np.float32)

    def const(name, value):
        return onnx.numpy_helper.from_array(np.asarray(value), name)

    nodes = [
        h.make_node("QuantizeLinear", ["w", "s", "zp"], ["wq"], axis=2),
        h.make_node("DequantizeLinear", ["wq", "s", "zp"], ["wdq"], axis=2),
        h.make_node("Unsqueeze", ["wdq", "zero"], ["w1"]),
        h.make_node("Transpose", ["w1"], ["w2"], perm=[0, 3, 1, 2]),
        h.make_node("Shape", ["w2"], ["w2_shape"]),
        h.make_node("Gather", ["w2_shape", "in_axes"], ["in_dims"]),
        h.make_node("ReduceProd", ["in_dims"], ["k"], keepdims=1),
        h.make_node("Concat", ["minus_one", "k"], ["w_shape"], axis=0),
        h.make_node("Reshape", ["w2", "w_shape"], ["w3"]),
        h.make_node("Gemm", ["x", "w3"], ["y"], transB=1),
        h.make_node("Shape", ["x"], ["x_shape"]),
        h.make_node("Slice", ["x_shape", "zero", "one"], ["batch"]),
        h.make_node("Gather", ["w2_shape", "one"], ["n"]),
        h.make_node("Concat", ["batch", "n"], ["y_shape"], axis=0),
        h.make_node("Reshape", ["y", "y_shape"], ["out"]),
    ]
    graph = h.make_graph(
        nodes,
        "einsum_kernel",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 8])],
        [h.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["n", 6])],
        [
            const("w", w),
            const("s", scale),
            const("zp", np.zeros(6, np.int8)),
            const("zero", np.array([0], np.int64)),
            const("one", np.array([1], np.int64)),
            const("minus_one", np.array([-1], np.int64)),
            const("in_axes", np.array([2, 3], np.int64)),
        ],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_fold_evaluates_a_weight_shape_computed_at_run_time():
    ort = pytest.importorskip("onnxruntime")
    from keras_mp.onnx.fold import fold_weight_qdq

    model = _einsum_kernel_graph()
    before = ort.InferenceSession(model.SerializeToString())
    folded = fold_weight_qdq(model)
    onnx.checker.check_model(folded)
    index = GraphIndex(folded)
    (gemm,) = index.weighted
    dq = index.producers[gemm.input[1]]
    assert dq.op_type == "DequantizeLinear"
    assert index.const(dq.input[0]).dtype == np.int8
    assert index.const(dq.input[0]).shape == (6, 8)
    ops = [n.op_type for n in folded.graph.node]
    assert "QuantizeLinear" not in ops and ops.count("Shape") == 1  # of x
    after = ort.InferenceSession(folded.SerializeToString())
    rng = np.random.default_rng(1)
    for batch in (1, 5):  # the run-time dimension
        x = {"x": rng.standard_normal((batch, 8)).astype(np.float32)}
        np.testing.assert_array_equal(
            after.run(None, x)[0], before.run(None, x)[0]
        )


def _loop_graph():
    """x -> Q/DQ -> MatMul(W) -> a Loop of 3 steps `v = v @ transpose(R)`
    whose body reads the Transpose of R from the outer graph (tf2onnx's
    GRU)."""
    h = onnx.helper
    rng = np.random.default_rng(0)
    f = onnx.TensorProto.FLOAT

    def const(name, value):
        return onnx.numpy_helper.from_array(np.asarray(value), name)

    body = h.make_graph(
        [
            h.make_node("Identity", ["cond_in"], ["cond_out"]),
            h.make_node("MatMul", ["v_in", "r_t"], ["v_out"], "body_matmul"),
        ],
        "body",
        [
            h.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
            h.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
            h.make_tensor_value_info("v_in", f, [1, 4]),
        ],
        [
            h.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
            h.make_tensor_value_info("v_out", f, [1, 4]),
        ],
    )
    nodes = [
        h.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"]),
        h.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xdq"]),
        h.make_node("QuantizeLinear", ["w", "s", "zp"], ["wq"]),
        h.make_node("DequantizeLinear", ["wq", "s", "zp"], ["wdq"]),
        h.make_node("MatMul", ["xdq", "wdq"], ["v0"], "dense"),
        h.make_node("Transpose", ["r"], ["r_t"], "r_transpose", perm=[1, 0]),
        h.make_node("Loop", ["steps", "true", "v0"], ["y"], "loop", body=body),
    ]
    graph = h.make_graph(
        nodes,
        "loop",
        [h.make_tensor_value_info("x", f, [1, 4])],
        [h.make_tensor_value_info("y", f, [1, 4])],
        [
            const("w", rng.standard_normal((4, 4)).astype(np.float32)),
            const("r", rng.standard_normal((4, 4)).astype(np.float32) / 4),
            const("s", np.float32(0.02)),
            const("zp", np.int8(0)),
            const("steps", np.int64(3)),
            const("true", np.bool_(True)),
        ],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_fold_keeps_what_a_loop_body_reads_from_outside():
    # Before: the pruning counted the inputs of top-level nodes only and
    # removed the Transpose of R, read only inside the Loop body (GRU):
    # "Nodes in a graph must be topologically sorted".
    ort = pytest.importorskip("onnxruntime")
    from keras_mp.onnx.fold import fold_weight_qdq

    model = _loop_graph()
    x = {"x": np.random.default_rng(1).standard_normal((1, 4), np.float32)}
    expected = ort.InferenceSession(model.SerializeToString()).run(None, x)
    folded = fold_weight_qdq(model)
    onnx.checker.check_model(folded, full_check=True)
    assert "r_transpose" in [n.name for n in folded.graph.node]
    assert "r" in [i.name for i in folded.graph.initializer]
    session = ort.InferenceSession(folded.SerializeToString())
    np.testing.assert_allclose(session.run(None, x)[0], expected[0], 1e-6)


def test_lint_counts_a_weighted_op_inside_a_loop_body_as_float():
    from keras_mp.onnx.fold import fold_weight_qdq

    report = keras_mp.check_tensorrt(fold_weight_qdq(_loop_graph()))
    assert (report.weighted_ops, report.weighted_ops_quantized) == (2, 1)
    (finding,) = [w for w in report.warnings if w.rule == "float_weighted_ops"]
    assert "'loop/body_matmul'" in finding.message
