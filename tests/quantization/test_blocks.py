"""Block-scaled formats (INT4, NVFP4, MXFP8) against ONNX's reference
QuantizeLinear / DequantizeLinear with `block_size`, bit for bit."""

import ml_dtypes
import numpy as np
import onnx
import pytest
import tensorflow as tf
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from keras_mp.quantization.blocks import (
    FORMATS,
    block_encode,
    block_quantize_dequantize,
    pack_nibbles,
)

NAMES = list(FORMATS)
# FLOAT4E2M1 (opset 23) and FLOAT8E8M0 (opset 24) need a recent onnx.
pytestmark = pytest.mark.skipif(
    not hasattr(TensorProto, "FLOAT8E8M0"),
    reason=f"onnx {onnx.__version__} has no FLOAT8E8M0 (opset 24)",
)


def _onnx_qdq(encoded, x):
    """Runs `QuantizeLinear -> DequantizeLinear` on `x` in ONNX's reference
    evaluator with the scales of `encoded`, and the exporter's graph: a
    DequantizeLinear of the encoded codes. Returns (qdq, codes, dq)."""
    fmt = FORMATS[encoded.format]
    blocked = dict(axis=encoded.axis, block_size=encoded.block_size)
    qtype = getattr(TensorProto, fmt.onnx_type)
    inits = [
        numpy_helper.from_array(encoded.scale, "s_stored"),
        numpy_helper.from_array(encoded.codes, "codes"),
    ]
    nodes = []
    if fmt.global_scale:
        # NVFP4 as ModelOpt exports it: the FP8 block scales dequantized by
        # the float32 per-tensor scale feed the blocked DequantizeLinear.
        inits.append(numpy_helper.from_array(encoded.global_scale, "g"))
        nodes.append(
            helper.make_node("DequantizeLinear", ["s_stored", "g"], ["s"])
        )
    else:
        nodes.append(helper.make_node("Identity", ["s_stored"], ["s"]))
    out = {} if fmt.scale_onnx_type == "FLOAT" else {"output_dtype": 1}
    nodes += [
        helper.make_node(
            "QuantizeLinear", ["x", "s"], ["q"], output_dtype=qtype, **blocked
        ),
        helper.make_node(
            "DequantizeLinear", ["q", "s"], ["y"], **blocked, **out
        ),
        helper.make_node(
            "DequantizeLinear", ["codes", "s"], ["dq"], **blocked, **out
        ),
    ]
    shape = list(x.shape)
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("q", qtype, shape),
            helper.make_tensor_value_info("dq", TensorProto.FLOAT, shape),
        ],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", fmt.min_opset)]
    )
    # The types are legal at the format's opset (INT4 21, FLOAT4E2M1 23,
    # FLOAT8E8M0 scales 24).
    onnx.checker.check_model(model, full_check=True)
    return ReferenceEvaluator(model).run(["y", "q", "dq"], {"x": x})


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def _sweep(name, rng):
    """Weights (K=256, N=6): normal values, exact ties of the format's
    rounding, zeros, an all-zero block, values spanning 2**-20..2**11."""
    block = FORMATS[name].block_sizes[0]
    w = rng.normal(0, 0.05, (256, 6)).astype(np.float32)
    # Column 0: ties. The block's max sets its scale to 1 (for NVFP4 with
    # the per-tensor scale amax / 2688 = 1, from w[200, 5]).
    ties = {
        "int4": [7, 0.5, 1.5, 2.5, -0.5, -2.5, 6.5, -6.5],
        "nvfp4": [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, -0.25],
        "mxfp8": [448, 1.0625, 17, -17, 2.0**-10, 3 * 2.0**-10, 232, -232],
    }[name]
    w[:block, 0] = 0
    w[: len(ties), 0] = ties
    w[200, 5] = 2688.0
    w[:, 1] = 0  # zeros
    w[block : 2 * block, 2] = 0  # one all-zero block
    w[:, 3] = np.exp2(rng.uniform(-20, 11, 256)) * rng.choice([-1, 1], 256)
    w[5, 4] = -0.0
    return w


@pytest.mark.parametrize("name", NAMES)
def test_fake_quant_equals_onnx_qdq_bit_for_bit(name):
    w = _sweep(name, np.random.default_rng(0))
    encoded = block_encode(w, name)
    got = block_quantize_dequantize(tf.constant(w), name).numpy()
    qdq, codes, dq = _onnx_qdq(encoded, w)
    np.testing.assert_array_equal(_bits(got), _bits(qdq))
    np.testing.assert_array_equal(_bits(got), _bits(dq))
    np.testing.assert_array_equal(
        codes.view(np.uint8), encoded.codes.view(np.uint8)
    )


def test_nvfp4_sweep_saturates_where_fp8_scales_round_down():
    # E4M3 block scales below amax / 6 push the block's max past E2M1's 6:
    # the equality above covers ONNX's saturation there.
    w = _sweep("nvfp4", np.random.default_rng(0))
    encoded = block_encode(w, "nvfp4")
    scale = encoded.scale.astype(np.float32) * encoded.global_scale
    scaled = np.abs(w) / np.repeat(np.where(scale > 0, scale, 1), 16, 0)
    assert np.sum(scaled > 6) > 10


def test_ties_round_to_even():
    w = _sweep("int4", np.random.default_rng(0))
    got = block_quantize_dequantize(tf.constant(w), "int4").numpy()[:8, 0]
    np.testing.assert_array_equal(got, [7, 0, 2, 2, -0, -2, 6, -6])
    w = _sweep("nvfp4", np.random.default_rng(0))
    got = block_quantize_dequantize(tf.constant(w), "nvfp4").numpy()[:10, 0]
    np.testing.assert_array_equal(got, [6, 0, 1, 1, 2, 2, 4, 4, -4, -0.0])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("axis", [1, -1])
def test_other_axes_and_ranks(name, axis):
    block = FORMATS[name].block_sizes[0]
    rng = np.random.default_rng(1)
    w = rng.normal(0, 1, (3, 2 * block, 4)).astype(np.float32)
    if axis == -1:
        w = w.transpose(0, 2, 1).copy()  # PyTorch's (N, K) layout
    encoded = block_encode(w, name, axis=axis)
    assert encoded.scale.shape[encoded.axis] == 2
    got = block_quantize_dequantize(tf.constant(w), name, axis=axis).numpy()
    qdq, _, dq = _onnx_qdq(encoded, w)
    np.testing.assert_array_equal(_bits(got), _bits(qdq))
    np.testing.assert_array_equal(_bits(got), _bits(dq))


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_int4_given_scales_saturate_like_onnx(block_size):
    rng = np.random.default_rng(2)
    w = rng.normal(0, 1, (256, 8)).astype(np.float32)
    amax = np.abs(w.reshape(256 // block_size, block_size, 8)).max(1)
    scale = (0.6 * amax / 7).astype(np.float32)  # clipped: beyond range
    got = block_quantize_dequantize(
        tf.constant(w), "int4", block_size, scale=scale
    ).numpy()
    encoded = block_encode(w, "int4", block_size, scale=scale)
    np.testing.assert_array_equal(encoded.scale, scale)
    qdq, codes, _ = _onnx_qdq(encoded, w)
    np.testing.assert_array_equal(_bits(got), _bits(qdq))
    assert codes.astype(int).min() == -8 and codes.astype(int).max() == 7


def test_scales_follow_modelopt():
    """The scale formulas of ModelOpt's NVFP4QTensor (global amax / 2688,
    block amax / (6 * global), zero -> 1, cast to E4M3) and MXFP8 exporter
    (ceil(log2(amax / 448)), at least -127, biased by 127), and INT4
    (amax / 7)."""
    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, (128, 64)).astype(np.float32) * np.exp2(
        rng.integers(-6, 6, (1, 64))
    ).astype(np.float32)
    w[16:32, 3] = 0
    amax16 = np.abs(w.reshape(8, 16, 64)).max(1)
    g = np.float32(np.abs(w).max() / np.float32(6.0 * 448.0))
    block = amax16 / (np.float32(6.0) * g)
    block[block == 0] = 1.0
    nv = block_encode(w, "nvfp4")
    assert nv.global_scale == g
    np.testing.assert_array_equal(
        nv.scale, block.astype(ml_dtypes.float8_e4m3fn)
    )
    amax32 = np.abs(w.reshape(4, 32, 64)).max(1)
    e8m0 = np.ceil(np.maximum(np.log2(amax32 / np.float32(448)), -127)) + 127
    mx = block_encode(w, "mxfp8")
    np.testing.assert_array_equal(
        mx.scale.view(np.uint8), e8m0.astype(np.uint8)
    )
    amax128 = np.abs(w).max(0, keepdims=True)
    np.testing.assert_array_equal(block_encode(w, "int4").scale, amax128 / 7)


@pytest.mark.parametrize("name", NAMES)
def test_eager_function_and_xla_agree(name):
    w = tf.constant(_sweep(name, np.random.default_rng(4)))
    eager = block_quantize_dequantize(w, name).numpy()
    for jit in (False, True):
        fn = tf.function(jit_compile=jit)(
            lambda v: block_quantize_dequantize(v, name)
        )
        np.testing.assert_array_equal(_bits(fn(w).numpy()), _bits(eager))


@pytest.mark.parametrize("name", NAMES)
def test_gradient_is_straight_through(name):
    w = tf.Variable(
        np.random.default_rng(5).normal(size=(128, 3)), dtype="float32"
    )

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(
                3.0 * block_quantize_dequantize(w, name, axis=0)
            )
        return tape.gradient(loss, w)

    np.testing.assert_array_equal(step().numpy(), np.full((128, 3), 3.0))


def test_given_int4_scale_stops_the_gradient_outside_the_range():
    w = tf.constant([[-9.0], [-8.0], [0.3], [7.0], [7.5]] * 32)
    scale = np.ones((5, 1), np.float32)
    with tf.GradientTape() as tape:
        tape.watch(w)
        y = block_quantize_dequantize(w, "int4", 32, scale=scale)
    grad = tape.gradient(y, w).numpy()[:5, 0]
    np.testing.assert_array_equal(grad, [0, 1, 1, 1, 0])


def test_nvfp4_block_scale_underflow_dequantizes_to_zero():
    # A block whose scale rounds to FP8 zero (ModelOpt keeps that 0): any
    # code dequantizes to 0; ONNX's codes there are +-6 (x / 0), ours 0.
    w = np.full((32, 2), 1e-6, np.float32)
    w[0, 0], w[1:16, 1] = 2688.0, -3e-7
    encoded = block_encode(w, "nvfp4")
    assert float(encoded.scale[0, 1].astype(np.float32)) == 0.0
    got = block_quantize_dequantize(tf.constant(w), "nvfp4").numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        qdq, _, dq = _onnx_qdq(encoded, w)
    np.testing.assert_array_equal(got, qdq)
    np.testing.assert_array_equal(got, dq)
    assert not np.any(got[:16, 1])


def test_bfloat16_is_quantized_in_float32():
    w = tf.constant(np.random.default_rng(6).normal(size=(32, 4)), tf.bfloat16)
    got = block_quantize_dequantize(w, "mxfp8")
    assert got.dtype == tf.bfloat16
    want = block_quantize_dequantize(tf.cast(w, tf.float32), "mxfp8")
    np.testing.assert_array_equal(
        tf.cast(got, tf.float32).numpy(),
        tf.cast(tf.cast(want, tf.bfloat16), tf.float32).numpy(),
    )


def test_pack_nibbles_is_onnx_layout():
    codes = block_encode(
        np.random.default_rng(7).normal(size=(32, 3)).astype(np.float32),
        "int4",
        32,
    ).codes
    packed = pack_nibbles(codes)
    assert packed.size == 48
    assert packed.tobytes() == numpy_helper.from_array(codes).raw_data
    fp4 = np.array([0.5, -6, 3], ml_dtypes.float4_e2m1fn)
    assert pack_nibbles(fp4).tobytes() == numpy_helper.from_array(fp4).raw_data


def test_errors_say_what_was_received():
    w = np.zeros((100, 4), np.float32)
    with pytest.raises(
        ValueError, match="multiple of block_size.*shape=.100, 4"
    ):
        block_quantize_dequantize(w, "int4", 32)
    with pytest.raises(ValueError, match=r"block_size in \[16\]"):
        block_encode(np.zeros((64, 4), np.float32), "nvfp4", 32)
    with pytest.raises(ValueError, match="only formats with float32 scales"):
        block_encode(
            np.zeros((64, 4), np.float32), "mxfp8", scale=np.ones((2, 4))
        )
    with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        block_encode(
            np.zeros((64, 4), np.float32), "int4", 32, scale=np.ones(4)
        )
    with pytest.raises(ValueError, match="Unknown block format"):
        block_encode(w, "int3")
    with pytest.raises(ValueError, match="ml_dtypes.int4"):
        pack_nibbles(np.zeros(4, np.int8))
