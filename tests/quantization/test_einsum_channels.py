"""EinsumDense kernels with several output axes (attention Q/K/V
projections) are quantized per output channel, flattened: in Keras, in
the exported ONNX (a per-channel DequantizeLinear feeding the MatMul/Gemm),
and in files saved while they were per-tensor."""

import os

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from keras_mp import _models, layer_table
from keras_mp.onnx.graph import GraphIndex, attr, output_channel_axis
from tests.tolerance import assert_computes_like

L = keras.layers
pytest.importorskip("tf2onnx")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.mark.parametrize(
    "equation, shape, axes",
    [
        ("abc,cde->abde", (4, 2, 3), (1, 2)),  # MultiHeadAttention Q/K/V
        ("btd,ndh->btnh", (4, 2, 3), (0, 2)),  # keras-hub Gemma, Llama
        ("abcd,cde->abe", (4, 5), (2,)),  # attention output
        ("abc,ced->abde", (4, 3, 2), (2, 1)),  # in the output's order
        ("abc,bcd->abd", (4, 5), ()),  # `b` is an input axis too
    ],
)
def test_einsum_row_channel_axes(equation, shape, axes):
    layer = L.EinsumDense(equation, shape)
    assert layer_table.row_for(layer).weights[0].out_axes == axes


def _projections(qmodel):
    """`(layer, float kernel, amax)` of each EinsumDense with several
    output-channel axes."""
    found = []
    for layer in _models.walk_layers(qmodel):
        if not isinstance(layer, L.EinsumDense):
            continue
        for attr_name, axes, amax in getattr(layer, "weight_ranges", ()):
            if len(axes) > 1:
                kernel = np.asarray(getattr(layer, attr_name))
                found.append((layer, kernel, np.asarray(amax)))
    return found


def _expected_amax(layer, kernel):
    """max|w| per output channel, channels ordered as in the output."""
    x_spec, kernel_spec, output = layer_table._einsum_parts(layer.equation)
    order = [c for c in output if c in kernel_spec]
    rest = [c for c in kernel_spec if c not in order]
    moved = np.einsum(f"{kernel_spec}->{''.join(rest + order)}", kernel)
    return np.abs(moved.reshape(-1, np.prod(moved.shape[len(rest) :]))).max(0)


def _check_export(qmodel, data, path, channels):
    report = keras_mp.export_onnx(qmodel, path, verify_data=data)
    assert report.top1_agreement == 1.0 and report.rel_l2 < 1e-5, report
    lint = keras_mp.check_tensorrt(path)
    assert lint.ok, lint.to_markdown()
    assert lint.weighted_ops == lint.weighted_ops_quantized
    index = GraphIndex(onnx.load(path))
    dqs = {}
    for op in index.weighted:
        dq = index.producers.get(op.input[1])
        if dq is not None and dq.op_type == "DequantizeLinear":
            dqs[index.const(dq.input[1]).tobytes()] = (op, dq)
    projections = _projections(qmodel)
    assert projections
    for layer, kernel, amax in projections:
        assert amax.size == channels[layer.name], layer.name
        np.testing.assert_array_equal(amax, _expected_amax(layer, kernel))
        scale = (amax / np.float32(127)).astype(np.float32)
        op, dq = dqs[scale.tobytes()]  # the projection's own weight DQ
        codes = index.const(dq.input[0])
        assert codes.dtype == np.int8, layer.name
        axis = output_channel_axis(op, 1, codes.ndim)
        assert attr(dq, "axis", 1) == axis, layer.name
        assert codes.shape[axis] == amax.size
    return projections


def test_multi_head_attention_qkv_per_channel(tmp_path):
    # Beside the attention, two EinsumDense whose kernel's output axes are
    # apart ("dce") or reversed ("ced"): their channels follow the output's
    # order, as tf2onnx's MatMul weight does.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 16))
    y = L.MultiHeadAttention(2, 8, name="mha")(inputs, inputs)
    outputs = [L.Dense(3, name="head")(L.GlobalAveragePooling1D()(y))] + [
        L.EinsumDense(equation, (6, 3, 2), name=name)(inputs)
        for name, equation in (
            ("apart", "abc,dce->abde"),
            ("rev", "abc,ced->abde"),
        )
    ]
    data = np.random.default_rng(0).standard_normal((32, 6, 16), "float32")
    qmodel = keras_mp.quantize_model(keras.Model(inputs, outputs))
    keras_mp.calibrate(qmodel, data, verbose=0)
    channels = {"query": 16, "key": 16, "value": 16, "apart": 6, "rev": 6}
    found = _check_export(qmodel, data, str(tmp_path / "mha.onnx"), channels)
    assert sorted(layer.name for layer, _, _ in found) == sorted(channels)


def test_keras_hub_gemma_qkv_per_channel(tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    model = keras_hub.models.GemmaBackbone(
        vocabulary_size=50,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,  # grouped-query attention
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
    )
    rng = np.random.default_rng(0)
    data = {
        "token_ids": rng.integers(1, 50, (8, 6)).astype("int32"),
        "padding_mask": np.ones((8, 6), "int32"),
    }
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, data, verbose=0)
    found = _check_export(
        qmodel,
        data,
        str(tmp_path / "gemma.onnx"),
        {"query": 16, "key": 8, "value": 8},
    )
    assert len(found) == 3


@pytest.mark.parametrize("name", ["einsum", "mha"])
def test_per_tensor_file_loads_and_computes_the_same(name):
    saved = np.load(os.path.join(FIXTURES, "per_tensor_einsum.npz"))
    with pytest.warns(UserWarning, match="one per-tensor weight range"):
        model = keras.saving.load_model(
            os.path.join(FIXTURES, f"per_tensor_{name}.keras"), safe_mode=True
        )
    # Computed on another CPU: float32 with 8-bit fake quant (tolerance.py)
    assert_computes_like(model(saved["x"]), saved[name], "float32", True)
    if name == "einsum":  # a `QuantizeWrapper` graph copy: upgrade first
        upgraded = keras_mp.upgrade(model)
        np.testing.assert_array_equal(  # same process: exact
            np.asarray(upgraded(saved["x"])), np.asarray(model(saved["x"]))
        )
        model = upgraded
    keras_mp.calibrate(model, saved["x"], verbose=0)
    found = _projections(model)
    assert len(found) == (1 if name == "einsum" else 3)
    for layer, kernel, amax in found:
        want = _expected_amax(layer, kernel)
        np.testing.assert_array_equal(amax, want)
        assert np.unique(want).size > 1, layer.name  # per channel now
