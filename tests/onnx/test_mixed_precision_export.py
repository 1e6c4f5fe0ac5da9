"""Mixed precision end to end: a model trained under a 16-bit policy, then
quantized, calibrated and fine-tuned, exports a float32 graph and a
float16 (`dtype="float16"`) graph, each lint-clean with every weighted op behind
Q/DQ; a Q/DQ scale below float16's smallest normal is raised to it, with a
warning naming the Keras quantizer and the cost."""

import re
import warnings

import keras
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import keras_mp
from benchmarks.bench_zoo import refresh_batchnorm
from keras_mp.onnx.fp16 import to_half
from keras_mp.onnx.graph import LAYOUT_OPS
from keras_mp.onnx.parity import ort_session, run_session
from keras_mp.onnx.subnormal import raise_subnormal_scales
from keras_mp.onnx.twin import half_compute_dtype
from tests.onnx.test_twin import HALF, _element_types

FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
TINY = np.float16(np.finfo(np.float16).tiny)  # 2**-14
WEIGHTED = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def _export(model, path, **kwargs):
    """`export_onnx`, with the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = keras_mp.export_onnx(model, path, **kwargs)
    return report, [w for w in caught if issubclass(w.category, UserWarning)]


def _indexed(path):
    proto = onnx.load(path)
    graph = proto.graph
    producers = {o: n for n in graph.node for o in n.output}
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    return proto, producers, consts


def _check_weighted_ops_behind_dq(path):
    """Every Conv/MatMul/Gemm reads both inputs straight from a
    DequantizeLinear (no Cast or layout op in between)."""
    proto, producers, _ = _indexed(path)
    ops = [n for n in proto.graph.node if n.op_type in WEIGHTED]
    assert ops
    for op in ops:
        for slot in (0, 1):
            source = producers.get(op.input[slot])
            assert source is not None, (op.name, slot)
            assert source.op_type == "DequantizeLinear", (
                op.name,
                slot,
                source.op_type,
            )
    return len(ops)


def _check_pairs_share_scales(path):
    """The QuantizeLinear and DequantizeLinear of each pair (through layout
    ops tf2onnx moved between them) read the same scale values."""
    proto, producers, consts = _indexed(path)
    pairs = 0
    for dq in proto.graph.node:
        if dq.op_type != "DequantizeLinear" or dq.input[0] in consts:
            continue
        node = producers[dq.input[0]]
        while node.op_type in LAYOUT_OPS:
            node = producers[node.input[0]]
        assert node.op_type == "QuantizeLinear", dq.name
        np.testing.assert_array_equal(
            consts[node.input[1]], consts[dq.input[1]], dq.name
        )
        pairs += 1
    return pairs


def _qdq_scales(path):
    proto, _, consts = _indexed(path)
    return [
        consts[n.input[1]]
        for n in proto.graph.node
        if n.op_type in ("QuantizeLinear", "DequantizeLinear")
    ]


def _check_strongly_typed_float16(path):
    """Inputs and outputs float32; inside, every float tensor (Q/DQ scales
    included) is float16 outside the float32 nodes the file lists, and no
    float16 scale is below float16's smallest normal."""
    proto = onnx.load(path)
    graph = proto.graph
    assert max(o.version for o in proto.opset_import if o.domain == "") == 19
    assert {v.type.tensor_type.elem_type for v in graph.input} == {FLOAT}
    assert {v.type.tensor_type.elem_type for v in graph.output} == {FLOAT}
    inferred = onnx.shape_inference.infer_shapes(proto).graph
    inner = {v.name: v.type.tensor_type.elem_type for v in inferred.value_info}
    islands = {e.node for e in keras_mp.typed_graph(proto).rows}
    producers = {o: n for n in graph.node for o in n.output}
    # an output made by a float32 island (the softmax) needs no Cast
    boundary = {f"{v.name}_fp16" for v in graph.input} | {
        f"{v.name}_fp16"
        for v in graph.output
        if producers[v.name].name not in islands
    }
    float32_inside = [
        n
        for n, t in inner.items()
        if t == FLOAT
        and producers[n].op_type != "Cast"
        and producers[n].name not in islands
    ]
    assert not float32_inside, float32_inside[:5]
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.name)
    for init in graph.initializer:
        if init.data_type == FLOAT:
            assert readers[init.name] <= islands, init.name
    assert boundary <= set(inner)
    scales = [s for s in _qdq_scales(path) if s.dtype == np.float16]
    assert scales
    assert min(float(s.min()) for s in scales) >= TINY


# --- a MobileNetV2 trained under mixed_bfloat16, quantized, fine-tuned ----


@pytest.fixture(scope="module")
def mobilenet(tmp_path_factory):
    """MobileNetV2 (alpha 0.35) under mixed_bfloat16: BatchNorm statistics
    from the data (a random MobileNet's signal dies out otherwise),
    quantize_model, calibrate, two QAT steps, both exports."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.random((32, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, 32)
    base = keras.applications.MobileNetV2(
        alpha=0.35, weights=None, input_shape=(32, 32, 3), classes=10
    )
    model = keras_mp.apply_mixed_precision(base, "mixed_bfloat16")
    refresh_batchnorm(model, x)
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    before = qmodel.get_layer("Conv1").kernel.numpy()
    # Eager: two steps cost less than tracing MobileNetV2's train step.
    qmodel.compile(
        keras.optimizers.SGD(0.01),
        "sparse_categorical_crossentropy",
        run_eagerly=True,
    )
    history = qmodel.fit(x[:16], y[:16], batch_size=8, verbose=0)
    directory = tmp_path_factory.mktemp("mobilenet")
    f32, f16 = directory / "f32.onnx", directory / "f16.onnx"
    _, f32_warnings = _export(qmodel, f32)
    _, f16_warnings = _export(qmodel, f16, dtype="float16")
    return {
        "qmodel": qmodel,
        "x": x[:8],
        "trained": not np.array_equal(
            before, qmodel.get_layer("Conv1").kernel.numpy()
        ),
        "loss": history.history["loss"][-1],
        "f32": str(f32),
        "f16": str(f16),
        "warnings": (f32_warnings, f16_warnings),
    }


@pytest.mark.slow  # run by .ci/run after `make test` (10-minute budget)
def test_mobilenet_was_fine_tuned_in_bfloat16(mobilenet):
    assert half_compute_dtype(mobilenet["qmodel"]) == "bfloat16"
    assert mobilenet["trained"] and np.isfinite(mobilenet["loss"])


@pytest.mark.slow  # run by .ci/run after `make test` (10-minute budget)
def test_mobilenet_float32_graph_is_lint_clean_and_float32(mobilenet):
    path = mobilenet["f32"]
    lint = keras_mp.check_tensorrt(path)
    assert lint.ok, str(lint)
    ops = _check_weighted_ops_behind_dq(path)
    assert lint.weighted_ops == lint.weighted_ops_quantized == ops == 53
    assert not _element_types(path) & HALF
    assert {s.dtype for s in _qdq_scales(path)} == {np.dtype(np.float32)}
    assert _check_pairs_share_scales(path) > 50
    out = run_session(ort_session(path, optimized=False), [mobilenet["x"]])
    assert out[0].shape == (8, 10) and np.all(np.isfinite(out[0]))


@pytest.mark.slow  # run by .ci/run after `make test` (10-minute budget)
def test_mobilenet_float16_graph_is_strongly_typed_and_lint_clean(mobilenet):
    path = mobilenet["f16"]
    lint = keras_mp.check_tensorrt(path)
    assert lint.ok, str(lint)
    ops = _check_weighted_ops_behind_dq(path)
    assert lint.weighted_ops == lint.weighted_ops_quantized == ops == 53
    _check_strongly_typed_float16(path)
    assert _check_pairs_share_scales(path) > 50
    assert onnx.TensorProto.BFLOAT16 not in _element_types(path)
    out = run_session(ort_session(path, optimized=False), [mobilenet["x"]])
    assert out[0].dtype == np.float32 and out[0].shape == (8, 10)
    assert np.all(np.isfinite(out[0]))
    np.testing.assert_allclose(out[0].sum(axis=1), 1.0, atol=1e-2)


# --- a sub-normal activation scale, under mixed_float16 -----------------


def _small_activation_model():
    """conv_b's input is ~1e-3: bn_a's gamma is scaled down 1000x (and
    conv_b's kernel up, so later ranges are ordinary). bn_a is frozen, as
    in fine-tuning: a training step would move the small gamma far."""
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(8, 3, name="conv_a")(inputs)
    h = keras.layers.BatchNormalization(name="bn_a")(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Conv2D(16, 3, activation="relu", name="conv_b")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(10, name="fc")(h))
    bn = model.get_layer("bn_a")
    bn.gamma.assign(bn.gamma * 1e-3)
    bn.trainable = False
    conv_b = model.get_layer("conv_b")
    conv_b.kernel.assign(conv_b.kernel * 1e3)
    return model


@pytest.fixture(scope="module")
def small_activation(tmp_path_factory):
    """The model above under mixed_float16 with a LossScaleOptimizer:
    calibrated, one QAT step, one output channel of conv_b pruned to zero,
    then exported as float32 and as dtype="float16" (parity checked)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.random((64, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 64)
    model = keras_mp.apply_mixed_precision(
        _small_activation_model(), "mixed_float16"
    )
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    qmodel.compile(
        keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.01)),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        run_eagerly=True,
    )
    qmodel.fit(x[:8], y[:8], batch_size=8, verbose=0)
    conv_b = qmodel.get_layer("conv_b")
    kernel = conv_b.kernel.numpy()
    kernel[..., 3] = 0.0  # a pruned channel: its range is MIN_AMAX
    conv_b.kernel.assign(kernel)
    conv_b.update_weight_ranges()
    directory = tmp_path_factory.mktemp("small_activation")
    f32, f16 = directory / "f32.onnx", directory / "f16.onnx"
    f32_report, f32_warnings = _export(qmodel, f32, verify_data=x)
    f16_report, f16_warnings = _export(
        qmodel, f16, verify_data=x, dtype="float16"
    )
    return {
        "qmodel": qmodel,
        "amax": float(conv_b.input_quantizers[0].amax.numpy()),
        "f32": (str(f32), f32_report, f32_warnings),
        "f16": (str(f16), f16_report, f16_warnings),
    }


def _conv_b(path):
    """(activation scale, weight scale, weight codes) of conv_b's Conv."""
    proto, producers, consts = _indexed(path)
    (conv,) = [
        n
        for n in proto.graph.node
        if n.op_type == "Conv" and re.search(r"/conv_b(_\d+)?/", n.name)
    ]
    x_dq, w_dq = producers[conv.input[0]], producers[conv.input[1]]
    return consts[x_dq.input[1]], consts[w_dq.input[1]], consts[w_dq.input[0]]


def test_subnormal_scale_warning_names_the_keras_quantizer_and_cost(
    small_activation,
):
    amax = small_activation["amax"]
    assert half_compute_dtype(small_activation["qmodel"]) == "float16"
    assert 1e-4 < amax < 127 * TINY  # its float32 scale is sub-normal
    _, _, caught = small_activation["f16"]
    raised = [w for w in caught if "smallest normal" in str(w.message)]
    assert len(raised) == 1, [str(w.message) for w in caught]
    message = str(raised[0].message)
    steps = round(amax / float(TINY))
    assert (
        f"  - conv_b/input_0 (input): its INT8 grid "
        f"gets {steps} instead of 127 steps over its calibrated range "
        f"[-{amax:.3g}, {amax:.3g}], and it clips at {127 * float(TINY):.3g} "
        f"instead of {amax:.3g}" in message
    )
    assert "  - conv_b/kernel (weight): 1 of 16 channel(s) raised" in message
    assert "1 hold only zeros and lose nothing" in message
    assert "quant_scale__" not in message  # Keras names, not ONNX tensors
    assert "conv_a" not in message and "'fc'" not in message
    # the warning points at the caller's export_onnx line
    assert raised[0].filename == __file__


def test_subnormal_scale_is_raised_to_the_smallest_normal(small_activation):
    path, report, _ = small_activation["f16"]
    x_scale, w_scale, codes = _conv_b(path)
    assert x_scale.dtype == np.float16 and x_scale == TINY
    assert w_scale.dtype == np.float16 and w_scale[3] == TINY
    assert not np.any(np.moveaxis(codes, 0, -1)[..., 3])
    # other channels keep their scales, to float16 rounding
    _, w32, codes32 = _conv_b(small_activation["f32"][0])
    keep = np.arange(16) != 3
    np.testing.assert_array_equal(w_scale[keep], w32[keep].astype(np.float16))
    np.testing.assert_array_equal(codes[keep], codes32[keep])
    assert _check_pairs_share_scales(path) == 3
    _check_strongly_typed_float16(path)
    # parity against Keras judged the raised graph, at the fp16 defaults
    assert report.rel_l2 <= 0.05 and report.top1_agreement >= 0.99
    lint = keras_mp.check_tensorrt(path)
    assert lint.ok, str(lint)
    assert lint.weighted_ops == lint.weighted_ops_quantized == 3
    out = run_session(ort_session(path), [np.ones((2, 28, 28, 1), np.float32)])
    assert out[0].shape == (2, 10) and np.all(np.isfinite(out[0]))


def test_float32_graph_keeps_the_small_scale(small_activation):
    path, report, caught = small_activation["f32"]
    assert not [w for w in caught if "smallest normal" in str(w.message)]
    x_scale, w_scale, _ = _conv_b(path)
    amax = np.float32(small_activation["amax"])
    assert x_scale.dtype == np.float32 and x_scale == amax / np.float32(127)
    assert w_scale[3] == np.float32(1e-8) / np.float32(127)
    assert not _element_types(path) & HALF
    assert report.rel_l2 <= 0.01 and report.top1_agreement >= 0.999
    assert keras_mp.check_tensorrt(path).ok
    assert _check_weighted_ops_behind_dq(path) == 3


# --- the fp16 pass on small hand-built graphs ---------------------------


def _conv_graph(w_scale, x_scale=0.01, extra=None):
    """x -> Q/DQ(x_scale) -> Conv(DQ(codes, w_scale per channel)) -> y, and
    optionally `extra(graph)` nodes."""
    codes = np.array([[[[100]]], [[[-127]]], [[[0]]]], np.int8)  # (3,1,1,1)
    initializers = [
        numpy_helper.from_array(np.float32(x_scale), "x_scale"),
        numpy_helper.from_array(np.int8(0), "x_zero"),
        numpy_helper.from_array(codes, "w_codes"),
        numpy_helper.from_array(np.asarray(w_scale, np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(3, np.int8), "w_zero"),
    ]
    nodes = [
        helper.make_node(
            "QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"], name="q"
        ),
        helper.make_node(
            "DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"], name="dq"
        ),
        helper.make_node(
            "DequantizeLinear",
            ["w_codes", "w_scale", "w_zero"],
            ["wd"],
            name="w_dq",
            axis=0,
        ),
        helper.make_node("Conv", ["xd", "wd"], ["y"], name="conv"),
    ]
    outputs = [helper.make_tensor_value_info("y", FLOAT, [1, 3, 2, 2])]
    if extra is not None:
        more_nodes, more_outputs = extra()
        nodes += more_nodes
        outputs += more_outputs
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", FLOAT, [1, 1, 2, 2])],
        outputs,
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def _run(proto, x):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    session = ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": x})


def test_weight_codes_are_requantized_to_the_raised_scale():
    w_scale = [1e-3, 2e-5, 1e-8 / 127]  # normal, sub-normal, pruned channel
    proto = _conv_graph(w_scale)
    x = np.array([[[[0.5, -0.25], [1.0, 0.125]]]], np.float32)
    before = _run(proto, x)[0]
    raised = raise_subnormal_scales(proto)
    assert [r.tensor for r in raised] == ["w_scale"]
    np.testing.assert_array_equal(raised[0].empty, [False, False, True])
    onnx.checker.check_model(proto)
    consts = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    (dq,) = [n for n in proto.graph.node if n.name == "w_dq"]
    np.testing.assert_array_equal(
        consts[dq.input[1]], np.float32([1e-3, TINY, TINY])
    )
    # channel 1: -127 * 2e-5 = -2.54e-3 is now round(-2.54e-3 / 2**-14) = -42
    np.testing.assert_array_equal(consts[dq.input[0]].ravel(), [100, -42, 0])
    assert "w_scale" not in consts and "w_codes" not in consts  # replaced
    after = _run(proto, x)[0]
    np.testing.assert_array_equal(after[0, [0, 2]], before[0, [0, 2]])
    # channel 1 moved by at most half a new step per weight
    assert np.max(np.abs(after[0, 1] - before[0, 1])) <= float(TINY) / 2


def test_activation_pair_keeps_one_scale_and_other_readers_keep_theirs():
    def mul_by_x_scale():
        # a Mul that happens to read the same constant as the Q/DQ pair
        node = helper.make_node("Mul", ["x", "x_scale"], ["z"], name="mul")
        return [node], [helper.make_tensor_value_info("z", FLOAT, [1, 1, 2, 2])]

    proto = _conv_graph([1e-3] * 3, x_scale=1e-5, extra=mul_by_x_scale)
    raised = raise_subnormal_scales(proto)
    assert [r.tensor for r in raised] == ["x_scale"] and raised[0].empty is None
    nodes = {n.name: n for n in proto.graph.node}
    assert nodes["q"].input[1] == nodes["dq"].input[1] != "x_scale"
    assert nodes["mul"].input[1] == "x_scale"
    x = np.ones((1, 1, 2, 2), np.float32)
    np.testing.assert_allclose(_run(proto, x)[1], np.float32(1e-5))


def test_to_float16_without_a_model_names_the_onnx_tensor():
    with pytest.warns(UserWarning, match=r"ONNX scale 'x_scale' \(read by q"):
        half = to_half(_conv_graph([1e-3] * 3, x_scale=1e-5))
    onnx.checker.check_model(half)


@pytest.mark.parametrize("bad", [0.0, -0.01, np.inf])
def test_zero_negative_or_infinite_scale_is_an_error(bad):
    with pytest.raises(ValueError, match="must be positive and finite"):
        to_half(_conv_graph([1e-3] * 3, x_scale=bad))


def test_constant_beyond_float16_range_is_still_an_error():
    def add_big():
        big = helper.make_tensor("big", FLOAT, [], [1e6])
        const = helper.make_node("Constant", [], ["big"], value=big)
        add = helper.make_node("Add", ["x", "big"], ["z"], name="add")
        out = helper.make_tensor_value_info("z", FLOAT, [1, 1, 2, 2])
        return [const, add], [out]

    with pytest.raises(ValueError, match="beyond float16's largest value"):
        to_half(_conv_graph([1e-3] * 3, extra=add_big))
