"""NVFP4 / MXFP8 activations (W4A4, W8A8): TensorRT's DynamicQuantize in
the ONNX graph, checked with onnx.reference against the Keras fake quant."""

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import keras_mp

onnx = pytest.importorskip("onnx")
pytest.importorskip("tf2onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from keras_mp.onnx.dynamic_blocks import reference_evaluator  # noqa: E402
from keras_mp.quantization.blocks import (  # noqa: E402
    activation_global_scale,
    block_activation_quantize_dequantize,
)


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4, 64))
    h = keras.layers.Dense(64, name="fc1")(inputs)
    h = keras.layers.EinsumDense("abc,cd->abd", (4, 32), name="ein")(h)
    return keras.Model(inputs, keras.layers.Dense(32, name="fc2")(h))


def _x(n=8, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 4, 64)).astype("f4")


def _dq_graph(precision, x, amax):
    """DynamicQuantize + DequantizeLinear(s) as the export writes them,
    float32 out."""
    nodes, inits = [], []
    if precision == "nvfp4":
        gs = np.float32(activation_global_scale(amax).numpy())
        inits.append(numpy_helper.from_array(gs, "gs"))
        nodes = [
            helper.make_node(
                "TRT_FP4DynamicQuantize",
                ["x", "gs"],
                ["c", "s8"],
                domain="trt",
                axis=-1,
                block_size=16,
                scale_type=17,
            ),
            helper.make_node("DequantizeLinear", ["s8", "gs"], ["s"]),
            helper.make_node(
                "DequantizeLinear", ["c", "s"], ["y"], axis=-1, block_size=16
            ),
        ]
    else:
        nodes = [
            helper.make_node(
                "TRT_MXFP8DynamicQuantize",
                ["x"],
                ["c", "s"],
                domain="trt",
                axis=-1,
                block_size=32,
                output_dtype=17,
            ),
            helper.make_node(
                "DequantizeLinear",
                ["c", "s"],
                ["y"],
                axis=-1,
                block_size=32,
                output_dtype=TensorProto.FLOAT,
            ),
        ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)],
        initializer=inits,
    )
    proto = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", 24),
            helper.make_opsetid("trt", 1),
        ],
    )
    return reference_evaluator(proto).run(None, {"x": x})[0]


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8"])
def test_fake_quant_equals_reference_dequantization_bit_for_bit(precision):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 64)) * np.exp(rng.normal(size=(6, 64)) * 3)
    x = x.astype(np.float16).astype(np.float32)  # a float16 graph's input
    x[0, :32] = 0.0  # all-zero blocks
    x[1, :16] = 0.0
    x[1, 3] = 7.0  # ties: halfway between E2M1 / E4M3 neighbours
    x[2] = np.float32(1.25) * (np.arange(64) % 7)
    x[3, :] = 448.0 * 2.0 ** np.arange(-20, 44)[:64].astype(np.float32) / 2**30
    amax = np.float32(np.max(np.abs(x)) / 3)  # blocks beyond the range too
    want = _dq_graph(precision, x, amax)
    eager = block_activation_quantize_dequantize(x, precision, amax).numpy()
    xla = tf.function(
        lambda v: block_activation_quantize_dequantize(v, precision, amax),
        jit_compile=True,
    )(x).numpy()
    np.testing.assert_array_equal(eager, want)
    np.testing.assert_array_equal(xla, want)
    assert np.isfinite(want).all() and np.any(want != x)


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8"])
def test_quantize_calibrate_export_float16_matches_keras(precision, tmp_path):
    qmodel = keras_mp.quantize_model(_model(), precision=precision)
    rows = {r["path"]: r for r in keras_mp.quantization_report(qmodel).rows}
    assert rows["fc1"]["format"] == precision and rows["ein"]["inputs"]
    x = _x()
    keras_mp.calibrate(qmodel, x, verbose=0)
    with pytest.warns(UserWarning):
        report = keras_mp.export_onnx(
            qmodel, tmp_path / "q.onnx", dtype="float16", verify_data=x
        )
    assert report.runtime == "onnx.reference"
    assert report.rel_l2 < 0.05 and "DynamicQuantize" in str(report)
    proto = onnx.load(tmp_path / "q.onnx")
    op = {
        "nvfp4": "TRT_FP4DynamicQuantize",
        "mxfp8": "TRT_MXFP8DynamicQuantize",
    }
    dynamic = [n for n in proto.graph.node if n.op_type == op[precision]]
    assert len(dynamic) == 3 and all(n.domain == "trt" for n in dynamic)
    opset = {o.domain: o.version for o in proto.opset_import}
    assert opset[""] == (23 if precision == "nvfp4" else 24)
    assert keras_mp.check_tensorrt(proto).ok
    # a float32 input or another block size is flagged
    for node in dynamic:
        for a in node.attribute:
            if a.name == "block_size":
                a.i = 64
    findings = keras_mp.check_tensorrt(proto).violations
    assert any("block_size=64" in f.message for f in findings)


def test_float32_export_is_refused_before_writing(tmp_path):
    qmodel = keras_mp.quantize_model(_model(), precision="nvfp4")
    keras_mp.calibrate(qmodel, _x(), verbose=0)
    with pytest.raises(keras_mp.ExportError, match="dtype='float16'"):
        keras_mp.export_onnx(qmodel, tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()
    # weight-only still exports in float32
    w4 = keras_mp.QuantizeConfig(precision="nvfp4", weights_only=True)
    wmodel = keras_mp.quantize_model(
        _model(), config={"fc1": w4, "ein": w4, "fc2": w4}
    )
    with pytest.warns(UserWarning, match="opset 23"):
        keras_mp.export_onnx(wmodel, tmp_path / "w.onnx")


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8"])
def test_save_load_safe_mode_and_qat_step(precision, tmp_path):
    qmodel = keras_mp.quantize_model(_model(), precision=precision)
    x = _x()
    keras_mp.calibrate(qmodel, x, verbose=0)
    qmodel.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras", safe_mode=True)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(qmodel(x)))
    before = np.asarray(qmodel.get_layer("fc1").kernel).copy()
    qmodel.compile(optimizer="sgd", loss="mse")
    qmodel.fit(x, np.zeros((8, 4, 32), "f4"), epochs=1, verbose=0)
    assert np.any(np.asarray(qmodel.get_layer("fc1").kernel) != before)


def test_k_not_divisible_and_weights_only_config():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((48,))
    model = keras.Model(inputs, keras.layers.Dense(64, name="fc")(inputs))
    # K=48 is no multiple of MXFP8's 32: the weights are refused (an
    # input alone falls back to weight-only: the next test)
    with pytest.raises(ValueError, match="block_size"):
        keras_mp.quantize_model(model, precision="mxfp8")
    with pytest.raises(ValueError, match="weights_only"):
        keras_mp.QuantizeConfig(precision="int4", weights_only=False)
    assert keras_mp.QuantizeConfig(precision="int4").weights_only
    assert not keras_mp.QuantizeConfig(precision="nvfp4").weights_only
    assert ml_dtypes.float4_e2m1fn  # the codes' type


def test_an_input_tensorrt_cannot_block_falls_back_to_weights_only(tmp_path):
    # An attention output projection sums over heads and head size
    # (`abcd,cde->abe`): the ONNX graph transposes and reshapes them into
    # K, where TensorRT's DynamicQuantize cannot sit. Its weights take
    # NVFP4, its input stays float16, and the report and a warning say so.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 4, 16))
    out = keras.layers.EinsumDense(
        "abcd,cde->abe", output_shape=(None, 32), name="attention_output"
    )(inputs)
    out = keras.layers.Dense(32, name="fc")(out)
    model = keras.Model(inputs, out)
    with pytest.warns(UserWarning, match="weights only of attention_output"):
        qmodel = keras_mp.quantize_model(model, precision="nvfp4")
    x = np.random.default_rng(0).normal(size=(4, 8, 4, 16)).astype("f4")
    keras_mp.calibrate(qmodel, x, verbose=0)
    rows = {
        r["layer"]: r
        for r in keras_mp.quantization_report(qmodel, verbose=False).rows
    }
    assert rows["attention_output"]["inputs"] == {}
    assert "sums over 2 input axes" in rows["attention_output"]["note"]
    assert rows["fc"]["inputs"] and rows["fc"]["note"] == ""
    report = keras_mp.export_onnx(
        qmodel, tmp_path / "m.onnx", verify_data=x, dtype="float16"
    )
    assert report.top1_agreement == 1.0 and report.rel_l2 < 0.05
    proto = onnx.load(tmp_path / "m.onnx")
    dynamic = [n for n in proto.graph.node if n.domain == "trt"]
    assert len(dynamic) == 1  # the Dense's input only


def test_nvfp4_weight_global_scale_stays_float32_in_float16(tmp_path):
    # K=128 -> 256: glorot range ~0.14, so the weight's global scale
    # amax / 2688 is below float16's smallest normal. It stays a float32
    # constant (DQ -> DQ -> Cast(f16) -> MatMul, as ModelOpt), not raised
    # to 6.1e-5 with its FP8 block scales "requantized" as INT8 codes.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 128))
    h = keras.layers.Dense(256, name="up")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(32, name="down")(h))
    qmodel = keras_mp.quantize_model(model, precision="nvfp4")
    x = np.random.default_rng(0).normal(size=(8, 4, 128)).astype("f4")
    keras_mp.calibrate(qmodel, x, verbose=0)
    report = keras_mp.export_onnx(
        qmodel, tmp_path / "q.onnx", dtype="float16", verify_data=x
    )
    assert report.rel_l2 < 0.05
    proto = onnx.load(tmp_path / "q.onnx")
    inits = {i.name: i for i in proto.graph.initializer}
    assert not any("fp16_normal" in name for name in inits)
    scale_dqs = [
        n
        for n in proto.graph.node
        if n.op_type == "DequantizeLinear"
        and n.input[1] in inits
        and inits[n.input[1]].data_type == TensorProto.FLOAT
        and "weight_global_scale" in n.input[1]
    ]
    assert len(scale_dqs) == 2
    gs = float(numpy_helper.to_array(inits[scale_dqs[0].input[1]]))
    assert gs < np.finfo(np.float16).tiny
    # the DQs' float32 weights are the Keras fake-quantized kernels
    from keras_mp.quantization.twins import quantizers

    weights = [n.output[0] for n in scale_dqs]
    weights = [
        n.output[0]
        for n in proto.graph.node
        if n.op_type == "DequantizeLinear" and n.input[1] in weights
    ]
    proto.graph.output.extend(
        [helper.make_empty_tensor_value_info(w) for w in weights]
    )
    got = reference_evaluator(proto).run(weights, {"input_0": x})
    want = [
        q.quantizer(w).numpy()
        for q in quantizers(qmodel, "export_onnx")
        if q.weight
        for w in q.layer.weights
        if w.path.endswith("kernel")
    ]
    assert all(g.dtype == np.float32 for g in got)
    assert sorted(float(np.sum(g)) for g in got) == sorted(
        float(np.sum(w)) for w in want
    )
    assert keras_mp.check_tensorrt(proto).ok


def _td_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3, 32))
    h = keras.layers.TimeDistributed(keras.layers.Dense(32, name="fc"))(inputs)
    x = np.random.default_rng(0).normal(size=(4, 3, 32)).astype("f4")
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(h)), x


def _lstm_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(50, 32)(inputs)
    h = keras.layers.Bidirectional(keras.layers.LSTM(32))(h)
    x = np.random.default_rng(0).integers(0, 50, (4, 5)).astype("int32")
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(h)), x


@pytest.mark.parametrize("make", [_td_model, _lstm_model])
@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8"])
def test_quantize_placed_after_ops_that_keep_the_blocks(
    make, precision, tmp_path
):
    # tf2onnx moves the carrier Q back across TimeDistributed's Transpose
    # and per-step Slice / Squeeze, or a Bidirectional LSTM's Slice /
    # Squeeze / Concat (of two 32-wide halves): none moves a block, so the
    # DynamicQuantize goes on the float values before the MatMul.
    model, x = make()
    qmodel = keras_mp.quantize_model(model, precision=precision)
    keras_mp.calibrate(qmodel, x, verbose=0)
    report = keras_mp.export_onnx(
        qmodel, tmp_path / "q.onnx", dtype="float16", verify_data=x
    )
    assert report.rel_l2 < 0.05 and report.top1_agreement == 1.0
    proto = onnx.load(tmp_path / "q.onnx")
    assert any(n.domain == "trt" for n in proto.graph.node)
    assert keras_mp.check_tensorrt(proto).ok


def test_an_op_that_moves_the_blocks_is_refused():
    from keras_mp.onnx.dynamic_blocks import _keeps_blocks

    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 1]),
            helper.make_node("Transpose", ["c"], ["k"], perm=[1, 0, 2]),
            helper.make_node("Slice", ["c", "s", "e", "last"], ["l"]),
            helper.make_node("Slice", ["c", "s", "e", "first"], ["f"]),
            helper.make_node("Reshape", ["c", "flat"], ["r"]),
            helper.make_node("Unsqueeze", ["c", "last"], ["u"]),
        ],
        "g",
        [],
        [],
        [
            numpy_helper.from_array(np.asarray(v, np.int64), n)
            for n, v in [
                ("s", [0]),
                ("e", [16]),
                ("last", [-1]),
                ("first", [0]),
                ("flat", [-1, 24]),
            ]
        ],
    )
    shapes = {"c": [2, 3, 32], "r": [None, 24]}
    keeps = {
        n.output[0]: _keeps_blocks(n, "c", graph, shapes, 16)
        for n in graph.node
    }
    assert keeps == {
        "t": False,
        "k": True,
        "l": False,
        "f": True,
        "r": False,
        "u": False,
    }


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8"])
def test_fake_quant_of_an_input_with_several_unknown_dims(precision):
    # (batch, sequence, hidden) with batch and sequence unknown: the
    # block reshape reads them at run time (one -1 at most)
    x = np.random.default_rng(0).normal(size=(2, 3, 64)).astype("f4")
    fn = tf.function(
        lambda t: block_activation_quantize_dequantize(t, precision, 4.0),
        input_signature=[tf.TensorSpec((None, None, 64), tf.float32)],
    )
    want = block_activation_quantize_dequantize(x, precision, 4.0)
    np.testing.assert_array_equal(fn(x).numpy(), want.numpy())


@pytest.mark.parametrize("precision", ["nvfp4", "mxfp8"])
def test_gpt2_backbone_exports(precision, tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64,
        num_layers=1,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=8,
    )
    x = {
        "token_ids": np.random.default_rng(0)
        .integers(0, 64, (2, 8))
        .astype("int32"),
        "padding_mask": np.ones((2, 8), "int32"),
    }
    with pytest.warns(UserWarning, match="attention_output"):
        qmodel = keras_mp.quantize_model(backbone, precision=precision)
    keras_mp.calibrate(qmodel, x, verbose=0)
    # NVFP4 activations: E2M1 rounding flips turn float16's 2**-11 into
    # several % at the outputs (as much as Keras itself moves under that
    # noise; `export_onnx`'s NVFP4 defaults: rel. L2 0.25, top-1 0.8); this
    # untrained model's logits are nearly flat, so top-1 flips more
    tolerances = {"min_top1_agreement": 0.5} if precision == "nvfp4" else {}
    report = keras_mp.export_onnx(
        qmodel,
        tmp_path / "q.onnx",
        dtype="float16",
        verify_data=x,
        **tolerances,
    )
    assert report.runtime == "onnx.reference"
    proto = onnx.load(tmp_path / "q.onnx")
    assert any(n.domain == "trt" for n in proto.graph.node)
