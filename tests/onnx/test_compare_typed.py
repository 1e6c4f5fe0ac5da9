"""`compare_onnx` on mixed-precision models and typed (16-bit) graphs,
and on FP8 Q/DQ: no false divergence on a faithful export, a changed
Q/DQ scale still found at its layer."""

import keras
import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import keras_mp
from keras_mp.quantization.formats import FORMATS

L = keras.layers


def mobile_block(shape=(16, 16, 3)):
    """The pieces of a MobileNetV3 block: BatchNorm after each conv,
    hard-swish, a depthwise conv, squeeze-excite with hard-sigmoid, a
    projection and a residual Add."""
    inputs = keras.Input(shape)
    x = L.Conv2D(8, 3, padding="same", use_bias=False, name="stem")(inputs)
    x = L.BatchNormalization(name="stem_bn")(x)
    x = L.Activation("hard_swish", name="stem_hs")(x)
    y = L.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(x)
    y = L.BatchNormalization(name="dw_bn")(y)
    y = L.ReLU(name="dw_relu")(y)
    s = L.GlobalAveragePooling2D(keepdims=True, name="se_pool")(y)
    s = L.ReLU(name="se_relu")(L.Conv2D(4, 1, name="se_reduce")(s))
    s = L.Conv2D(8, 1, name="se_expand")(s)
    s = L.Activation("hard_sigmoid", name="se_hs")(s)
    y = L.Multiply(name="se_mul")([y, s])
    y = L.Conv2D(8, 1, use_bias=False, name="project")(y)
    y = L.BatchNormalization(name="project_bn")(y)
    x = L.Add(name="residual")([x, y])
    x = L.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, L.Dense(10, name="logits")(x))


def change_scale(path, out, scope, factor):
    """Multiplies the scale of the activation Q/DQ pair of layer `scope`
    (its first DequantizeLinear of a computed tensor) by `factor`."""
    proto = onnx.load(path)
    inits = {i.name: i for i in proto.graph.initializer}
    dq = next(
        n
        for n in proto.graph.node
        if n.op_type == "DequantizeLinear"
        and n.input[0] not in inits
        and any(f"/{scope}_1/" in t for t in (n.name, n.output[0]))
    )
    init = inits[dq.input[1]]
    scale = numpy_helper.to_array(init)
    changed = (scale * factor).astype(scale.dtype)
    init.CopyFrom(numpy_helper.from_array(changed, init.name))
    onnx.save(proto, out)
    return out


@pytest.fixture(scope="module")
def mixed_exports(tmp_path_factory):
    """A mixed_float16 MobileNetV3-like block, quantized and calibrated on
    small inputs (so that some Q/DQ scales are below float16's smallest
    normal number, which the float16 export raises, with a warning),
    exported as float32 and as a typed float16 graph."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.random((16, 16, 16, 3), dtype=np.float32) * 1e-2
    model = keras_mp.apply_mixed_precision(mobile_block(), "mixed_float16")
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    directory = tmp_path_factory.mktemp("typed")
    paths = {dtype: str(directory / f"{dtype}.onnx") for dtype in ("32", "16")}
    keras_mp.export_onnx(qmodel, paths["32"], verify_data=x)
    # an untrained model's logits nearly tie: parity by relative L2 alone
    with pytest.warns(UserWarning, match="raised to the smallest normal"):
        keras_mp.export_onnx(
            qmodel,
            paths["16"],
            dtype="float16",
            verify_data=x,
            min_top1_agreement=0.0,
        )
    return qmodel, paths, x


@pytest.mark.parametrize("dtype", ["32", "16"])
def test_mixed_model_and_typed_export_have_no_false_divergence(
    mixed_exports, dtype
):
    """Every layer call is matched and within tolerance: the float16
    graph is compared with the float32 twin on the grids the graph
    quantizes with (scales raised to float16's smallest normal), and its
    float16 rounding, carried from Q/DQ to Q/DQ, is told from a fault."""
    qmodel, paths, x = mixed_exports
    report = keras_mp.compare_onnx(qmodel, paths[dtype], x)
    assert report.first_divergence is None, str(report)
    assert report.unmatched == [], str(report)
    assert report.precision == f"float{dtype}"
    twin = keras_mp.compare_onnx(qmodel, paths["32"], x)
    assert [r.name for r in report.rows] == [r.name for r in twin.rows]
    qdqs = [r for r in report.rows if r.kind == "QuantizeActivation"]
    assert len(qdqs) >= 7
    assert all(r.steps <= report.max_steps + 1e-3 for r in qdqs)


@pytest.mark.parametrize("dtype", ["32", "16"])
def test_changed_qdq_scale_is_found_at_its_layer(
    mixed_exports, dtype, tmp_path
):
    qmodel, paths, x = mixed_exports
    bad = change_scale(paths[dtype], str(tmp_path / "bad.onnx"), "project", 0.5)
    report = keras_mp.compare_onnx(qmodel, bad, x)
    first = report.first_divergence
    project = f"{qmodel.model.name}/project"
    assert first is not None and first.name.startswith(project), str(report)
    assert not any(r.diverged for r in report.rows if r.depth < first.depth)


def test_bfloat16_graph_is_refused_with_what_to_compare(
    mixed_exports, tmp_path
):
    qmodel, _, x = mixed_exports
    path = str(tmp_path / "bf16.onnx")
    keras_mp.export_onnx(qmodel, path, dtype="bfloat16")
    with pytest.raises(ValueError, match="bfloat16 graph.*dtype='float16'"):
        keras_mp.compare_onnx(qmodel, path, x)


def test_fp8_local_step_is_the_spacing_of_the_codes():
    fp8 = FORMATS["float8"]
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    grid = np.unique(np.abs(codes[np.isfinite(codes)].astype(np.float64)))
    assert np.array_equal(np.diff(grid), fp8.local_step(grid[:-1]))
    assert fp8.local_step([448.0, 300.0, 1.0])[0] == 32.0
    assert np.all(FORMATS["int8"].local_step([-128, 0, 5.5]) == 1.0)


@pytest.fixture(scope="module")
def fp8_typed(tmp_path_factory):
    """Two FP8 Dense layers exported as a float16 graph, where float16
    rounding of the Q inputs flips E4M3 codes, some at large values."""
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).standard_normal((256, 64)).astype("float32")
    inputs = keras.Input((64,))
    hidden = L.Dense(64, name="hidden")(inputs)
    outputs = L.Dense(10)(L.Dense(32, name="mid")(hidden))
    model = keras.Model(inputs, outputs)
    qmodel = keras_mp.quantize_model(model, precision="float8")
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path_factory.mktemp("fp8") / "fp8.onnx")
    keras_mp.export_onnx(qmodel, path, dtype="float16", verify_data=x)
    return qmodel, path, x


def test_fp8_code_flip_at_a_large_value_is_one_step(fp8_typed, tmp_path):
    """A flip between neighbouring E4M3 codes near 448 is 16 or 32 times
    the scale apart: one step of the format there, not a divergence;
    a halved scale still diverges at its Q/DQ."""
    qmodel, path, x = fp8_typed
    report = keras_mp.compare_onnx(qmodel, path, x)
    assert report.first_divergence is None, str(report)
    qdqs = [r for r in report.rows if r.kind == "QuantizeActivation"]
    quantizers = keras_mp.quantization.activation_quantizers(qmodel)
    scale = float(quantizers["hidden/input_0"].amax) / 448
    # the first Q/DQ reads the graph's input, rounded to float16: some
    # of its codes flip, at large values many scales apart, one step
    assert qdqs[0].name.endswith("hidden/hidden_input_0")
    assert qdqs[0].max_abs / scale >= 8.0
    assert qdqs[0].steps <= report.max_steps

    bad = change_scale(path, str(tmp_path / "bad.onnx"), "mid", 0.5)
    report = keras_mp.compare_onnx(qmodel, bad, x)
    mid = f"{qmodel.model.name}/mid"
    first = report.first_divergence
    assert first is not None and first.name.startswith(mid), str(report)
    assert first.kind == "QuantizeActivation" and first.steps > 4.0
