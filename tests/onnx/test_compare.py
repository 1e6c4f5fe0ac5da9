"""`compare_onnx`: per-layer Keras vs ONNX Runtime errors that find the
layer where an exported graph goes wrong."""

import keras
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import keras_mp
from keras_mp.quantization import twins
from tests.conftest import Subclassed, small_cnn


def break_second_conv(path, out):
    """Negates part of the second Conv's INT8 weights; returns `out`."""
    proto = onnx.load(path)
    producers = {o: n for n in proto.graph.node for o in n.output}
    conv = [n for n in proto.graph.node if n.op_type == "Conv"][1]
    weight = producers[conv.input[1]].input[0]
    init = next(i for i in proto.graph.initializer if i.name == weight)
    values = numpy_helper.to_array(init).copy()
    values.flat[: values.size // 4] *= -1
    init.CopyFrom(numpy_helper.from_array(values, init.name))
    onnx.save(proto, out)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A small quantized, calibrated CNN and its ONNX export."""
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).random((32, 16, 16, 1), dtype=np.float32)
    qmodel = keras_mp.quantize_model(small_cnn((16, 16, 1)))
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path_factory.mktemp("compare") / "m.onnx")
    keras_mp.export_onnx(qmodel, path)
    return qmodel, path, x


def test_clean_export_matches_every_layer_within_one_step(exported):
    qmodel, path, x = exported
    report = keras_mp.compare_onnx(qmodel, path, x)
    assert report.samples == 32
    assert [r.name for r in report.rows] == _rows(qmodel)
    # one row per input Q/DQ, judged in steps; one per quantized layer
    qdqs = [r for r in report.rows if r.kind == "QuantizeActivation"]
    assert len(qdqs) == len(keras_mp.quantization.activation_quantizers(qmodel))
    assert all(r.steps is not None and r.steps <= 1.0 for r in qdqs)
    quantized = [r for r in report.rows if r.kind.startswith("Quantized")]
    assert len(quantized) == len(twins.quantized_layers(qmodel)) > 0
    assert max(r.rel_l2 for r in report.rows) < 1e-5
    assert report.first_divergence is None
    assert "no layer diverges" in str(report)
    assert report.to_markdown().count("\n") == len(report.rows) + 1


def _rows(qmodel):
    """The row names of a `RecordedModel` of a Sequential model: each
    layer by its path from the float model, a quantized layer's input
    Q/DQs just before it, the float model last."""
    inner = qmodel.model
    names = []
    for layer in inner.layers:
        if twins.is_quantized(layer):
            names += [
                f"{inner.name}/{layer.name}/{q.name}"
                for q in layer.input_quantizers
            ]
        names.append(f"{inner.name}/{layer.name}")
    return names + [inner.name]


def test_broken_weight_is_found_at_its_layer(exported, tmp_path):
    qmodel, path, x = exported
    bad = break_second_conv(path, str(tmp_path / "bad.onnx"))
    report = keras_mp.compare_onnx(qmodel, bad, x, samples=8)
    second_conv = [
        f"{qmodel.model.name}/{layer.name}"
        for layer in twins.quantized_layers(qmodel)
        if isinstance(layer, keras.layers.Conv2D)
    ][1]
    assert report.samples == 8
    assert report.first_divergence.name == second_conv
    before = report.rows[: report.first_divergence.depth]
    assert not any(r.diverged for r in before)
    # the damage reaches the next Q/DQ (the Dense head's input) as many
    # quantization steps
    qdqs = [r for r in report.rows if r.kind == "QuantizeActivation"]
    assert qdqs[-1].depth > report.first_divergence.depth
    assert qdqs[-1].steps > 1.0
    assert f"first divergence at layer {second_conv!r}" in str(report)


def test_plot_writes_a_png(exported, tmp_path):
    qmodel, path, x = exported
    report = keras_mp.compare_onnx(qmodel, path, x[:4])
    out = report.plot(str(tmp_path / "err.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs_say_what_was_wrong(exported, tmp_path):
    qmodel, path, x = exported
    never_called = keras.Sequential([keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="never been called"):
        keras_mp.compare_onnx(never_called, path, x)
    with pytest.raises(TypeError, match="subclassed"):
        keras_mp.compare_onnx(Subclassed(), path, x)
    with pytest.raises(ValueError, match=r"shape \(4, 8, 8, 1\).*expects"):
        keras_mp.compare_onnx(qmodel, path, x[:4, :8, :8])
    with pytest.raises(FileNotFoundError, match="missing.onnx"):
        keras_mp.compare_onnx(qmodel, str(tmp_path / "missing.onnx"), x)
    inputs = keras.Input((16, 16, 1))
    other = keras.Model(
        inputs,
        keras.layers.Dense(3, name="head")(keras.layers.Flatten()(inputs)),
    )
    with pytest.raises(ValueError, match="not an export of this model"):
        keras_mp.compare_onnx(other, path, x)


def test_functional_residual_depthwise_model(tmp_path):
    from keras_mp.reference import reference_cnn

    x = np.random.default_rng(0).random((16, 28, 28, 1), dtype=np.float32)
    qmodel = keras_mp.quantize_model(reference_cnn(width=8))
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "ref.onnx")
    keras_mp.export_onnx(qmodel, path)
    report = keras_mp.compare_onnx(qmodel, path, x)
    # res_a's input Q/DQ can be merged by tf2onnx with the one of the
    # residual Add it shares its input with, under one of the two layers'
    # names or another layer's (which depends on tf2onnx's node order):
    # those left without one are listed as unmatched, with the reason
    inner = qmodel.model.name
    shared = {f"{inner}/{n}/{n}_input_0" for n in ("res_a", "res_add")}
    assert all(
        name in shared and "no ONNX node carries its name" in why
        for name, why in report.unmatched
    )
    qdqs = keras_mp.quantization.activation_quantizers(qmodel)
    # every layer but the input, every input Q/DQ and the float model
    assert len(report.rows) + len(report.unmatched) == (
        len(qmodel.model.layers) - 1 + len(qdqs) + 1
    )
    weighted = [r for r in report.rows if "Conv" in r.kind or "Dense" in r.kind]
    assert len(weighted) == 8
    stepped = [r for r in report.rows if r.kind == "QuantizeActivation"]
    assert len(stepped) >= len(qdqs) - 2 >= 7
    assert all(r.steps is not None and r.steps <= 1 for r in stepped)
    assert report.first_divergence is None


def test_dict_of_integer_and_float_inputs(tmp_path):
    """Token ids stay integers, a dict is matched to the inputs by name (not
    by order) and a float array for the ids is refused by name."""
    ids = keras.Input((8,), dtype="int32", name="token_ids")
    feats = keras.Input((4,), name="features")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(50, 4)(ids))
    joined = keras.layers.Concatenate()([embedded, feats])
    model = keras.Model(
        {"token_ids": ids, "features": feats}, keras.layers.Dense(3)(joined)
    )
    rng = np.random.default_rng(0)
    data = {
        "features": rng.random((16, 4), dtype=np.float32),
        "token_ids": rng.integers(0, 50, (16, 8)).astype("int32"),
    }
    path = str(tmp_path / "dict.onnx")
    keras_mp.export_onnx(model, path)
    report = keras_mp.compare_onnx(model, path, data, samples=8)
    assert report.samples == 8
    assert report.first_divergence is None
    assert max(r.rel_l2 for r in report.rows) < 1e-5
    bad = dict(data, token_ids=data["token_ids"].astype("float32"))
    with pytest.raises(ValueError, match="'token_ids'.*int32"):
        keras_mp.compare_onnx(model, path, bad)
    with pytest.raises(ValueError, match="missing: \\['features'\\]"):
        keras_mp.compare_onnx(model, path, {"token_ids": data["token_ids"]})


def test_one_step_flip_is_not_a_divergence_at_one_step():
    from keras_mp.onnx.compare_rows import _diverged

    # a rounding flip measured in float32 steps: 1.0000008, not 1.0
    assert not _diverged(1e-5, 1.0000008, 1.0, 1e-3)
    assert _diverged(1e-5, 2.0, 1.0, 1e-3)
    assert _diverged(2e-3, None, 1.0, 1e-3)
    assert not _diverged(1e-5, None, 1.0, 1e-3)


L = keras.layers


def _conv1d(x):
    return L.Conv1D(4, 3)(L.Conv1D(4, 3, padding="same")(x))


def _separable_conv1d(x):
    return L.ReLU()(L.SeparableConv1D(4, 3, padding="same")(x))


def _conv3d(x):
    return L.Conv3D(4, 3)(x)


def _time_distributed_conv2d(x):
    return L.TimeDistributed(L.Conv2D(4, 3))(x)


def _lstm(x):
    return L.LSTM(6)(x)


def _gru(x):
    return L.GRU(6)(x)


@pytest.mark.parametrize(
    "body, shape",
    [
        pytest.param(_conv1d, (16, 3), id="Conv1D"),
        pytest.param(_separable_conv1d, (16, 3), id="SeparableConv1D"),
        pytest.param(_conv3d, (6, 6, 6, 2), id="Conv3D"),
        pytest.param(_time_distributed_conv2d, (3, 8, 8, 2), id="TD-Conv2D"),
        pytest.param(_lstm, (5, 4), id="LSTM"),
        pytest.param(_gru, (5, 4), id="GRU"),
    ],
)
def test_layouts_that_change_rank_or_put_time_first_are_mapped(
    body, shape, tmp_path
):
    """ONNX runs a Conv1D as a 2-D Conv on `(N, C, 1, W)`, a Conv3D on
    NCDHW, a `TimeDistributed` layer once per time step and stacks them,
    an LSTM as an LSTM op with a `(T, 1, N, H)` output, a GRU as a Loop:
    an exact INT8 export has no divergence, every Q/DQ within a step
    (more recurrent cases: tests/onnx/test_compare_recurrent.py)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    features = body(inputs)
    model = keras.Model(inputs, L.Dense(3)(L.Flatten()(features)))
    x = np.random.default_rng(0).random((16,) + shape, dtype=np.float32)
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "m.onnx")
    keras_mp.export_onnx(qmodel, path, verify_data=x)
    report = keras_mp.compare_onnx(qmodel, path, x)
    assert report.first_divergence is None, str(report)
    assert report.precision == "float32"
    # the convolutions and recurrent layers themselves are compared, in
    # their own layout
    weighted = [
        r for r in report.rows if "Conv" in r.kind or r.kind in ("LSTM", "GRU")
    ]
    assert weighted and max(r.rel_l2 for r in weighted) < 1e-5, str(report)
    qdqs = [r for r in report.rows if r.kind == "QuantizeActivation"]
    assert qdqs and all(r.steps <= 1.0 + 1e-3 for r in qdqs), str(report)


def test_layouts_come_from_the_shapes():
    from keras_mp.onnx.compare_graph import error, fits

    rng = np.random.default_rng(0)
    keras_nwc = rng.random((2, 5, 3))  # Conv1D output (N, W, C)
    onnx_nc1w = keras_nwc.transpose(0, 2, 1)[:, :, None, :]
    assert fits((None, 3, 1, 5), keras_nwc.shape)
    assert error(onnx_nc1w, keras_nwc) == (0.0, 0.0)
    keras_ntc = rng.random((4, 3, 6))  # TimeDistributed output (N, T, C)
    time_major = keras_ntc.transpose(1, 0, 2)
    assert fits((3, None, 6), keras_ntc.shape)
    assert error(time_major, keras_ntc) == (0.0, 0.0)
    merged = keras_ntc.reshape(12, 6)  # a MatMul on (N * T, C)
    assert error(merged, keras_ntc) == (0.0, 0.0)
    assert error(rng.random((4, 5)), keras_ntc) is None  # other sizes
    assert not fits((None, 7), keras_ntc.shape)


@pytest.fixture(scope="module")
def mixed_export(tmp_path_factory):
    """A mixed_float16 CNN, quantized and calibrated, exported as float32
    (through its float32 twin) and as float16 (`fp16=True`)."""
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).random((32, 16, 16, 1), dtype=np.float32)
    model = keras_mp.apply_mixed_precision(
        small_cnn((16, 16, 1)), "mixed_float16"
    )
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    directory = tmp_path_factory.mktemp("mixed")
    paths = {}
    for precision in ("float32", "float16"):
        paths[precision] = str(directory / f"{precision}.onnx")
        keras_mp.export_onnx(
            qmodel, paths[precision], verify_data=x, dtype=precision
        )
    return qmodel, paths, x


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_mixed_precision_model_is_compared_with_what_was_exported(
    mixed_export, precision
):
    """The export traced the float32 twin: its layers are what the graph
    computes, not the float16 layers of the model (which are 1e-3 apart);
    a float16 graph is judged at float16 tolerances, and says so."""
    qmodel, paths, x = mixed_export
    report = keras_mp.compare_onnx(qmodel, paths[precision], x)
    assert report.first_divergence is None, str(report)
    assert report.precision == precision
    assert f"{precision} graph" in str(report)
    assert report.max_rel_l2 == (1e-3 if precision == "float32" else 1e-2)
    names = [r.name for r in report.rows]
    assert names == _rows(qmodel)  # named after the model's own layers
    if precision == "float32":
        assert max(r.rel_l2 for r in report.rows) < 1e-5
