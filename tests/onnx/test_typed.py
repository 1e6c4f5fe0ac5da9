"""Strongly typed export (`export_onnx(dtype=...)`): 16-bit where safe,
float32 islands where the Keras policy, measured magnitudes or ONNX ask
for them, Casts only at island boundaries and never between a
DequantizeLinear and its GEMM; bfloat16 checked structurally."""

import re
import warnings

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from keras_mp.onnx.graph import LAYOUT_OPS, WEIGHT_SLOTS
from tests.conftest import small_cnn

FLOAT, FLOAT16, BFLOAT16 = (
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
)


def _encoder():
    """Dense -> LayerNorm -> Dense -> Softmax -> pool -> Dense, and a Dense
    branch whose values are 1000 (all-1000 kernel times softmax outputs
    that sum to 1), past the 512 threshold."""
    inputs = keras.Input((8, 16))
    x = keras.layers.Dense(16)(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    x = keras.layers.Softmax(name="attn")(x)
    big = keras.layers.Dense(
        16, use_bias=False, kernel_initializer="ones", name="big"
    )
    big = keras.layers.Rescaling(1000.0)(big(x))
    x = keras.layers.Add()([x, keras.layers.Dense(16)(big)])
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))


@pytest.fixture(scope="module")
def encoder():
    keras.utils.set_random_seed(0)
    return _encoder(), np.random.default_rng(0).random((16, 8, 16), "float32")


def _types(proto):
    graph = onnx.shape_inference.infer_shapes(proto).graph
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*graph.value_info, *graph.input, *graph.output]
    }
    types.update({i.name: i.data_type for i in graph.initializer})
    return types


def _check_casts_at_boundaries(proto, islands):
    """Every Cast this export added joins a float32 node (or the graph's
    float32 input/output) to a 16-bit one: never two nodes of one side."""
    graph = proto.graph
    producers = {o: n for n in graph.node for o in n.output}
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    added = [
        n
        for n in graph.node
        if n.op_type == "Cast" and (n.name.endswith("_Cast"))
    ]
    assert added
    for cast in added:
        source = producers.get(cast.input[0])
        before = source is None or source.name in islands
        for reader in consumers.get(cast.output[0], []):
            assert (reader.name in islands) != before, (cast.name, reader.name)


def test_policy_and_magnitude_islands(encoder, tmp_path):
    model, x = encoder
    path = tmp_path / "f16.onnx"
    report = keras_mp.export_onnx(model, path, dtype="float16", verify_data=x)
    assert report.rel_l2 <= 0.05
    typed = report.typed
    assert str(typed) == str(keras_mp.typed_graph(path))
    proto = onnx.load(path)
    islands = {e.node: e for e in typed.rows}
    by_op = {}
    for node in proto.graph.node:
        by_op.setdefault(node.op_type, []).append(node)
    # LayerNorm's reductions and the Softmax: policy islands
    norm = [
        n
        for n in proto.graph.node
        if "/norm" in n.name and not n.name.endswith("_Cast")
    ]
    assert norm and all(islands[n.name].reason == "policy" for n in norm)
    (softmax,) = by_op["Softmax"]
    assert islands[softmax.name].reason == "policy"
    assert "Softmax" in islands[softmax.name].detail
    # the `big` branch's values pass 512: measured, kept float32
    big = [e for e in typed.rows if e.reason == "magnitude"]
    assert big and any("rescaling" in e.node for e in big)
    assert all(float(e.detail.rsplit("= ", 1)[1]) > 512 for e in big)
    # the reasons are in the file, node by node
    for node in proto.graph.node:
        assert (node.name in islands) == node.doc_string.startswith(
            "keras_mp: float32"
        )
    types = _types(proto)
    for node in proto.graph.node:
        want = FLOAT if node.name in islands else FLOAT16
        for name in node.output:
            if types.get(name) in (FLOAT, FLOAT16) and node.op_type != "Cast":
                assert types[name] == want, (node.name, name)
    _check_casts_at_boundaries(proto, islands)
    assert {v.type.tensor_type.elem_type for v in proto.graph.input} == {FLOAT}
    assert {v.type.tensor_type.elem_type for v in proto.graph.output} == {FLOAT}


def _transformer():
    """Dense -> MultiHeadAttention -> LayerNorm -> Dense(gelu) -> Dense.
    The input projection's scope is `proj_1` (TF suffixes every scope of
    the trace), the name of the output layer: it must not be taken for
    it. The attention's softmax is `ops.dot_product_attention`'s, not a
    Softmax layer's."""
    inputs = keras.Input((8, 16))
    x = keras.layers.Dense(16, name="proj")(inputs)
    x = keras.layers.MultiHeadAttention(2, 8, name="mha")(x, x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Dense(32, activation="gelu", name="ffn")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="proj_1")(x))


def test_transformer_islands_are_norm_softmax_and_output_only(tmp_path):
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).random((16, 8, 16), "float32")
    path = tmp_path / "t.onnx"
    report = keras_mp.export_onnx(
        _transformer(), path, dtype="float16", verify_data=x
    )
    assert report.rel_l2 <= 0.01
    proto = onnx.load(path)
    islands = {e.node: e for e in report.typed.rows}
    # Expected from the node names alone: the LayerNorm's scope (`norm_<n>`),
    # the output Dense's (`proj_1_<n>`), and the attention's Softmax.
    scope = re.compile(r"^[^/]+/(norm|proj_1)_\d+/")
    expected = {
        n.name
        for n in proto.graph.node
        if not n.name.endswith("_Cast")
        and (scope.match(n.name) or n.op_type == "Softmax")
    }
    assert set(islands) == expected
    assert {e.reason for e in islands.values()} == {"policy"}
    # the input projection, the attention's projections and the FFN: 16-bit
    matmuls = [n.name for n in proto.graph.node if n.op_type == "MatMul"]
    assert sum(name in islands for name in matmuls) == 1
    assert len(islands) < len(proto.graph.node) / 4
    _check_casts_at_boundaries(proto, islands)


class _Block(keras.layers.Layer):
    """A residual block as keras-hub writes them: its code, not a graph."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(8, name="inner")
        self.norm = keras.layers.LayerNormalization(name="ln")

    def call(self, x):
        return self.norm(x + self.inner(x))


def test_layer_with_sublayers_making_the_output_is_not_an_island(tmp_path):
    """A backbone whose output is a custom block's (ViT's encoder): only
    the block's LayerNorm is float32, not its Dense nor its residual Add."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))
    backbone = keras.Model(
        inputs, _Block(name="block")(keras.layers.Dense(8)(inputs))
    )
    outer = keras.Input((4, 8))
    model = keras.Model(outer, backbone(outer))
    path = tmp_path / "b.onnx"
    keras_mp.export_onnx(model, path, dtype="float16")
    proto = onnx.load(path)
    float32 = {e.node for e in keras_mp.typed_graph(path).rows}
    norm = {
        n.name
        for n in proto.graph.node
        if re.search(r"/block_\d+/ln_\d+/", n.name)
        and not n.name.endswith("_Cast")
    }
    assert norm and float32 == norm


def test_threshold_is_a_parameter(encoder, tmp_path):
    model, x = encoder
    report = keras_mp.export_onnx(
        model,
        tmp_path / "a.onnx",
        dtype="float16",
        verify_data=x,
        max_magnitude=1e4,
    )
    assert "magnitude" not in report.typed.by_reason()
    assert "policy" in report.typed.by_reason()


@pytest.mark.filterwarnings("ignore:`fp16=True` is deprecated")
def test_fp16_true_is_dtype_float16(encoder, tmp_path):
    model, x = encoder
    a = keras_mp.export_onnx(
        model, tmp_path / "a.onnx", fp16=True, verify_data=x
    )  # the deprecated alias still makes the same graph
    b = keras_mp.export_onnx(
        model,
        tmp_path / "b.onnx",
        dtype="float16",
        verify_data=x,
    )
    assert a.typed.dtype == "float16"
    assert [(e.op_type, e.reason) for e in a.typed.rows] == [
        (e.op_type, e.reason) for e in b.typed.rows
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dtype": "float8"}, "dtype must be.*FP8 is a quantization format"),
        ({"dtype": "bfloat16", "fp16": True}, "alias of dtype='float16'"),
        ({"dtype": "float16", "opset": 17}, "opset >= 19"),
    ],
)
def test_bad_dtype_is_a_clear_error_and_writes_nothing(tmp_path, kwargs, match):
    path = tmp_path / "m.onnx"
    with pytest.raises(keras_mp.ExportError, match=match):
        keras_mp.export_onnx(small_cnn(), path, **kwargs)
    assert not path.exists()


@pytest.fixture(scope="module")
def int8_cnn():
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).random((16, 28, 28, 1), dtype=np.float32)
    qmodel = keras_mp.quantize_model(small_cnn())
    keras_mp.calibrate(qmodel, x, verbose=0)
    return qmodel, x


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_no_cast_between_dequantize_and_its_gemm(int8_cnn, tmp_path, dtype):
    qmodel, x = int8_cnn
    path = tmp_path / f"{dtype}.onnx"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keras_mp.export_onnx(qmodel, path, dtype=dtype, verify_data=x)
    parity_skipped = [
        w for w in caught if "parity not checked" in str(w.message)
    ]
    assert bool(parity_skipped) == (dtype == "bfloat16")
    proto = onnx.load(path)
    assert keras_mp.check_tensorrt(proto).ok
    graph = proto.graph
    producers = {o: n for n in graph.node for o in n.output}
    gemms = [n for n in graph.node if n.op_type in WEIGHT_SLOTS]
    assert len(gemms) == 3
    for gemm in gemms:
        for slot in (0, 1):
            assert producers[gemm.input[slot]].op_type == "DequantizeLinear"
    for dq in (n for n in graph.node if n.op_type == "DequantizeLinear"):
        source = producers.get(dq.input[0])
        while source is not None and source.op_type in LAYOUT_OPS:
            source = producers.get(source.input[0])  # INT8 layout ops
        if source is not None:  # an activation pair: Q -> DQ, no Cast
            assert source.op_type == "QuantizeLinear", dq.name
    islands = {e.node for e in keras_mp.typed_graph(path).rows}
    _check_casts_at_boundaries(proto, islands)
    if dtype == "float16":
        # the output Dense (a quantized layer: its quantizers are not
        # sublayers) and only the Q/DQ nodes tied to it
        head = gemms[-1]
        dqs = [producers[name] for name in head.input[:2]]
        tied = [producers.get(dq.input[0]) for dq in dqs]
        expected = {head.name} | {n.name for n in dqs + tied if n is not None}
        assert islands == expected


def test_bfloat16_graph_structure(encoder, tmp_path):
    model, x = encoder
    path = tmp_path / "bf16.onnx"
    with pytest.warns(UserWarning, match="no bfloat16 kernels"):
        assert (
            keras_mp.export_onnx(model, path, dtype="bfloat16", verify_data=x)
            is None
        )
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    types = set(_types(proto).values())
    assert BFLOAT16 in types and FLOAT16 not in types
    typed = keras_mp.typed_graph(path)
    assert typed.dtype == "bfloat16" and typed.measured_samples == 16
    _check_casts_at_boundaries(proto, {e.node for e in typed.rows})
    assert {v.type.tensor_type.elem_type for v in proto.graph.input} == {FLOAT}


class _PerBatch(keras.layers.Layer):
    """Divides by the batch size: a 0-d float tensor (a Cast of a dynamic
    shape) in the graph, as a causal mask's scalar is."""

    def call(self, x):
        return x / keras.ops.cast(keras.ops.shape(x)[0], x.dtype)


def test_zero_dimensional_tensor_is_measured(tmp_path):
    """The magnitude probe exposes every float tensor, 0-d ones included,
    and measures them over several batches."""
    inputs = keras.Input((8,))
    x = _PerBatch()(keras.layers.Dense(8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4)(x))
    data = np.random.default_rng(0).random((40, 8), dtype=np.float32)
    report = keras_mp.export_onnx(
        model, tmp_path / "z.onnx", dtype="float16", verify_data=data
    )
    assert report.typed.measured_samples == 40
    assert report.rel_l2 < 0.05
