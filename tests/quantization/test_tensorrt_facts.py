"""TensorRT facts written once (issue 33, item 4): the per-format facts are
fields of the `FORMATS` rows, and the cross-format rules (small GEMMs,
ops that only move values, the Q/DQ element types TensorRT runs, the
residual-Add fold) are one constant or function each, read by the
placement, the ONNX lint and the cost model alike. Each test changes the
one place and checks that every reader follows."""

import dataclasses
import types

import keras
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import keras_mp
from keras_mp.onnx import graph, rules
from keras_mp.precision import cost
from keras_mp.quantization import formats, placement, twins
from keras_mp.quantization.config import QuantizeConfig


def _patch_row(monkeypatch, name, **fields):
    """Replaces `FORMATS[name]` by a copy with `fields` changed."""
    table = dict(formats.FORMATS)
    table[name] = dataclasses.replace(table[name], **fields)
    monkeypatch.setattr(formats, "FORMATS", types.MappingProxyType(table))
    return table[name]


def _conv(channels=32, kernel=3):
    layer = keras.layers.Conv2D(channels, kernel, name="conv")
    layer.build((None, 8, 8, channels))
    return layer


def test_fp8_row_holds_the_conv_and_softmax_facts():
    fp8 = formats.FORMATS["float8"]
    assert (fp8.conv_min_channels, fp8.conv_max_taps) == (16, 32)
    assert fp8.conv_weights_per_tensor and fp8.conv_limited
    assert fp8.fixed_softmax_amax == 1.0
    int8 = formats.FORMATS["int8"]
    assert not int8.conv_limited and not int8.conv_weights_per_tensor
    assert int8.fixed_softmax_amax is None
    # the names placement kept read the row
    assert placement.FP8_MIN_CHANNELS == fp8.conv_min_channels
    assert placement.FP8_MAX_TAPS == fp8.conv_max_taps


def test_conv_tap_limit_is_read_from_the_row_by_placement_and_cost(
    monkeypatch,
):
    conv, config = _conv(), QuantizeConfig(precision="float8")
    assert placement.layer_format(conv, config) == ("float8", "")
    work = keras_mp.precision.layer_work(conv, [(8, 8, 8, 32)], [(8, 6, 6, 32)])
    assert not work.no_fp8
    _patch_row(monkeypatch, "float8", conv_max_taps=4)
    fmt, note = placement.layer_format(conv, config)
    assert fmt == "int8" and "9-tap filter" in note and "up to 4 taps" in note
    work = keras_mp.precision.layer_work(conv, [(8, 8, 8, 32)], [(8, 6, 6, 32)])
    assert "up to 4 taps" in work.no_fp8
    # priced as INT8, as placed
    assert cost.latency(work, "float8", "H100") == cost.latency(
        work, "int8", "H100"
    )


def test_conv_channel_limit_and_per_tensor_weights_come_from_the_row(
    monkeypatch,
):
    conv, config = _conv(channels=32), QuantizeConfig(precision="float8")
    kernel = placement.quantizable_row(conv).weights[0]
    assert placement.weight_axes(conv, kernel, config) == ()
    _patch_row(monkeypatch, "float8", conv_weights_per_tensor=False)
    assert placement.weight_axes(conv, kernel, config) == kernel.out_axes
    _patch_row(monkeypatch, "float8", conv_min_channels=64)
    fmt, note = placement.layer_format(conv, config)
    assert fmt == "int8" and "above 64 channels" in note
    # a row without limits (int8) never falls back
    assert placement.layer_format(conv, QuantizeConfig()) == ("int8", "")


def test_fixed_softmax_range_is_the_rows(monkeypatch):
    assert placement.fixed_range("float8", "probs") == 1.0
    assert placement.fixed_range("float8", "query") is None
    assert placement.fixed_range("int8", "probs") is None
    _patch_row(monkeypatch, "int8", fixed_softmax_amax=0.5)
    assert placement.fixed_range("int8", "probs") == 0.5


def _fp8_conv_graph(channels):
    """x -> Q/DQ (FP8) -> Conv <- DQ (FP8, per channel) <- FP8 weight."""
    fp8 = TensorProto.FLOAT8E4M3FN
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node(
            "DequantizeLinear", ["w", "ws", "wz"], ["wd"], "dq_w", axis=0
        ),
        helper.make_node("Conv", ["xd", "wd"], ["y"], "conv"),
    ]
    weights = np.ones((channels, channels, 3, 3), np.float32)
    inits = [
        numpy_helper.from_array(np.float32(0.01), "xs"),
        helper.make_tensor("xz", fp8, [], [0.0]),
        helper.make_tensor("w", fp8, weights.shape, weights.ravel()),
        numpy_helper.from_array(np.full(channels, 0.01, np.float32), "ws"),
        helper.make_tensor("wz", fp8, [channels], [0.0] * channels),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", 1, [1, channels, 8, 8])],
        [helper.make_tensor_value_info("y", 1, [1, channels, 6, 6])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])


def _per_channel_warnings(model, tmp_path):
    path = str(tmp_path / "conv.onnx")
    onnx.save(model, path)
    report = keras_mp.check_tensorrt(path)
    return [f for f in report.warnings if f.rule == "per_channel"]


def test_lint_reads_per_tensor_conv_weights_from_the_row(monkeypatch, tmp_path):
    model = _fp8_conv_graph(32)
    found = _per_channel_warnings(model, tmp_path)
    assert len(found) == 1 and "per-channel FP8 weight of Conv" in str(found[0])
    _patch_row(monkeypatch, "float8", conv_weights_per_tensor=False)
    assert _per_channel_warnings(model, tmp_path) == []


def test_tensorrt_qdq_types_are_those_of_the_rows_tensorrt_runs():
    names = {r.onnx_type for r in formats.FORMATS.values() if r.tensorrt}
    assert names == {"INT8", "FLOAT8E4M3FN"} == formats.TENSORRT_QDQ_TYPES
    assert graph.TENSORRT_QDQ_TYPES == {
        TensorProto.DataType.Value(n) for n in names
    }


def test_value_moving_ops_are_written_once():
    assert graph.LAYOUT_OPS is placement.LAYOUT_OPS
    assert placement.LAYOUT_OPS < placement.DATA_MOVEMENT_OPS
    assert rules.DATA_MOVEMENT_OPS is placement.DATA_MOVEMENT_OPS
    assert rules.RESIDUAL_FOLDED_OPS is placement.RESIDUAL_FOLDED_OPS


def test_cost_bits_and_tiles_come_from_the_rows():
    for precision in ("int8", "float8"):
        assert cost.BITS[precision] == formats.FORMATS[precision].bits
        assert cost.TILE[precision] == 16 * 8 // cost.BITS[precision]
    assert cost.BITS["float"] == 16 and cost.TILE["float"] == 8


@pytest.mark.parametrize("dim, small", [(16, False), (15, True)])
def test_small_gemm_rule_is_one_function_for_all_readers(
    monkeypatch, dim, small
):
    monkeypatch.setattr(placement, "MIN_GEMM_DIM", 16)
    dense = keras.layers.Dense(dim)
    dense.build((None, 64))
    assert bool(placement.small_gemm(dense)) is small
    work = keras_mp.precision.layer_work(dense, [(8, 64)], [(8, dim)])
    assert cost._small_gemm(work) is small

    class _Trace:
        array = np.zeros((64, dim), np.float32)

    class _Graph:
        def trace(self, name):
            return _Trace()

    matmul = helper.make_node("MatMul", ["x", "w"], ["y"])
    assert rules._small_gemm(_Graph(), matmul) is small
    # a size ONNX shape inference left unknown is not small
    assert placement.gemm_too_small(None, dim) is small
    assert not placement.gemm_too_small(None, None)


# The layer table's pooling/Concat roles and the lint's ONNX op types: one
# fact seen from Keras and from ONNX.
_ROLE_OPS = {
    "commuting": placement.COMMUTING_OPS,
    "fused": placement.FUSED_OPS,
    "same_scale": placement.SCALE_COMMUTING_OPS,
}


@pytest.mark.parametrize(
    "layer, onnx_op",
    [
        (keras.layers.MaxPooling2D(), "MaxPool"),
        (keras.layers.GlobalMaxPooling1D(), "GlobalMaxPool"),
        (keras.layers.GlobalMaxPooling2D(), "GlobalMaxPool"),
        (keras.layers.AveragePooling3D(2), "AveragePool"),
        (keras.layers.GlobalAveragePooling2D(), "GlobalAveragePool"),
        (keras.layers.Concatenate(), "Concat"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, keras.Layer) else v,
)
def test_layer_table_role_matches_the_lints_op_type(layer, onnx_op):
    role = placement.qdq_role(layer)
    assert role == keras_mp.layer_table.row_for(layer).qdq_role
    assert onnx_op in _ROLE_OPS[role]


def _global_max_pool_model():
    inputs = keras.Input((8, 8, 16))
    x = keras.layers.Conv2D(32, 3, name="conv")(inputs)
    x = keras.layers.GlobalMaxPooling2D(name="gmp")(x)
    return keras.Model(inputs, keras.layers.Dense(32, name="fc")(x))


def test_quantize_inputs_on_global_max_pooling_is_placed_and_reported(
    tmp_path,
):
    config = {"gmp": keras_mp.QuantizeConfig(quantize_inputs=True)}
    qmodel = keras_mp.quantize_model(_global_max_pool_model(), config=config)
    gmp = qmodel.get_layer("gmp")
    assert len(gmp.input_quantizers) == 1 and gmp.input_indices == [0]
    x = np.random.default_rng(0).random((8, 8, 8, 16), dtype=np.float32)
    keras_mp.calibrate(qmodel, x, verbose=0)
    rows = {
        r["layer"]: r
        for r in keras_mp.quantization_report(qmodel, verbose=False).rows
    }
    assert rows["gmp"]["quantized"] and rows["gmp"]["inputs"][0] > 0
    assert "moves it across this max pooling" in rows["gmp"]["note"]
    path = str(tmp_path / "gmp.onnx")
    keras_mp.export_onnx(qmodel, path)
    model = onnx.load(path)
    pool = next(n for n in model.graph.node if n.op_type == "GlobalMaxPool")
    producer = {o: n for n in model.graph.node for o in n.output}
    assert producer[pool.input[0]].op_type == "DequantizeLinear"
    report = keras_mp.check_tensorrt(path)
    assert report.ok and not report.warnings, report.to_markdown()


def test_quantize_inputs_that_places_nothing_says_why():
    config = {
        "gmp": keras_mp.QuantizeConfig(precision="int4", quantize_inputs=True)
    }
    with pytest.warns(UserWarning, match=r"no input Q/DQ on: gmp \(INT4"):
        qmodel = keras_mp.quantize_model(
            _global_max_pool_model(), config=config
        )
    assert not twins.is_quantized(qmodel.get_layer("gmp"))
