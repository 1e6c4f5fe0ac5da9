"""FP8 export: FLOAT8E4M3FN Q/DQ at opset 19, FP8 weight initializers whose
DequantizeLinear feeds the GEMM, ONNX Runtime parity on trained networks
(scikit-learn's digits), INT8 and FP8 mixed in one graph."""

import os
import re

import keras
import numpy as np
import onnx
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.onnx.errors import ExportError

FP8, INT8 = onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.INT8


def _cnn():
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="cnn")


def _transformer():
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Reshape((8, 8))(inputs)
    x = keras.layers.Dense(32, name="embed")(x)
    a = keras.layers.MultiHeadAttention(2, 16, name="mha")(x, x)
    x = keras.layers.LayerNormalization()(x + a)
    h = keras.layers.Dense(64, activation="gelu", name="fc1")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(32)(h))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="block")


@pytest.fixture(scope="module")
def trained(digits):
    (x, y), (xt, _) = digits
    models = {}
    for make in (_cnn, _transformer):
        keras.utils.set_random_seed(0)
        model = make()
        model.compile(
            keras.optimizers.Adam(3e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        model.fit(x, y, epochs=5, batch_size=64, verbose=0)
        models[model.name] = model
    return models, x[:512], xt


def _fp8(model, calibration, config=None):
    qmodel = keras_mp.quantize_model(
        model, precision=None if config else "float8", config=config
    )
    keras_mp.calibrate(qmodel, calibration, verbose=0)
    return qmodel


def _zero_point_types(path):
    proto = onnx.load(path)
    inits = {i.name: i for i in proto.graph.initializer}
    types = {}
    for node in proto.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            types[node.name] = inits[node.input[2]].data_type
    return proto, types


@pytest.mark.parametrize("name", ["cnn", "block"])
def test_fp8_export_matches_onnx_runtime_on_a_trained_network(
    name, trained, tmp_path
):
    models, calibration, test = trained
    qmodel = _fp8(models[name], calibration)
    path = str(tmp_path / f"{name}.onnx")
    with pytest.warns(UserWarning, match="exported at opset 19"):
        report = keras_mp.export_onnx(qmodel, path, verify_data=test)
    assert report.rel_l2 <= 1e-2 and report.top1_agreement >= 0.99, report
    assert "FP8 graph" in report.note
    proto, types = _zero_point_types(path)
    assert max(o.version for o in proto.opset_import if o.domain == "") == 19
    assert FP8 in types.values()
    # FP8 weights are FP8 initializers whose DQ feeds the GEMM directly
    producers = {o: n for n in proto.graph.node for o in n.output}
    inits = {i.name: i for i in proto.graph.initializer}
    gemms = [
        n for n in proto.graph.node if n.op_type in ("Conv", "MatMul", "Gemm")
    ]
    fp8_weights = 0
    for op in gemms:
        dq = producers.get(op.input[1])
        if dq is not None and dq.op_type == "DequantizeLinear":
            codes = inits.get(dq.input[0])
            fp8_weights += codes is not None and codes.data_type == FP8
    assert fp8_weights >= 2
    # no weight is quantized at run time: every Q reads an activation
    assert not [
        n
        for n in proto.graph.node
        if n.op_type == "QuantizeLinear" and n.input[0] in inits
    ]
    assert keras_mp.check_tensorrt(path).ok


def test_fp8_softmax_output_is_exported_with_scale_1_over_448(
    trained, tmp_path
):
    models, calibration, _ = trained
    qmodel = _fp8(models["block"], calibration)
    path = str(tmp_path / "block.onnx")
    with pytest.warns(UserWarning, match="opset 19"):
        keras_mp.export_onnx(qmodel, path)
    proto, types = _zero_point_types(path)
    inits = {
        i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer
    }
    (softmax,) = [n for n in proto.graph.node if n.op_type == "Softmax"]
    q = softmax  # the softmax output's Q, past tf2onnx's head transposes
    while q.op_type != "QuantizeLinear":
        (q,) = [n for n in proto.graph.node if q.output[0] in n.input]
    assert types[q.name] == FP8
    assert inits[q.input[1]] == np.float32(1.0) / np.float32(448)


def test_int8_and_fp8_layers_mix_in_one_graph(trained, tmp_path):
    models, calibration, test = trained
    fp8 = keras_mp.QuantizeConfig(precision="float8")
    qmodel = _fp8(models["block"], calibration, config={"mha|fc1": fp8})
    path = str(tmp_path / "mixed.onnx")
    with pytest.warns(UserWarning, match="opset 19"):
        report = keras_mp.export_onnx(qmodel, path, verify_data=test)
    assert report.rel_l2 <= 1e-2, report
    _, types = _zero_point_types(path)
    assert {FP8, INT8} <= set(types.values())
    assert keras_mp.check_tensorrt(path).ok


def test_fp8_with_a_lower_explicit_opset_is_refused_before_writing(
    trained, tmp_path
):
    models, calibration, _ = trained
    qmodel = _fp8(models["cnn"], calibration)
    path = str(tmp_path / "low.onnx")
    with pytest.raises(
        ExportError, match="need opset >= 19. Received: opset=17"
    ):
        keras_mp.export_onnx(qmodel, path, opset=17)
    assert not os.listdir(tmp_path)


def test_fp8_after_a_recurrent_layer_exports(tmp_path):
    """tf2onnx puts Squeeze/Slice ops between an LSTM output's FP8 Q and its
    DQ (found on a model no test had): the Q moves past them."""
    model = keras.Sequential(
        [
            keras.Input((10,), dtype="int32"),
            keras.layers.Embedding(50, 32),
            keras.layers.LSTM(32),
            keras.layers.Dense(32),
        ]
    )
    x = np.random.default_rng(0).integers(0, 50, (16, 10)).astype("int32")
    qmodel = keras_mp.quantize_model(model, precision="float8")
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = str(tmp_path / "lstm.onnx")
    with pytest.warns(UserWarning, match="opset 19"):
        report = keras_mp.export_onnx(qmodel, path, verify_data=x)
    assert report.rel_l2 <= 1e-2, report
    _, types = _zero_point_types(path)
    assert FP8 in types.values()


def test_fp8_in_a_float16_strongly_typed_graph(trained, tmp_path):
    models, calibration, test = trained
    qmodel = _fp8(models["cnn"], calibration)
    path = str(tmp_path / "cnn16.onnx")
    # a 16-bit dtype exports at opset 19 already: no warning
    report = keras_mp.export_onnx(
        qmodel, path, verify_data=test[:128], dtype="float16"
    )
    assert report.rel_l2 <= 5e-2, report
    proto, types = _zero_point_types(path)
    assert FP8 in types.values()
    assert onnx.TensorProto.FLOAT16 in {
        i.data_type for i in proto.graph.initializer
    }
    assert keras_mp.check_tensorrt(path).ok


def _file_weights(path):
    """`{initializer name: DequantizeLinear(codes)}` of the FP8 weights in
    the ONNX file (numpy: codes times the scale along the node's axis)."""
    proto = onnx.load(path)
    inits = {i.name: i for i in proto.graph.initializer}
    weights = {}
    for node in proto.graph.node:
        codes = inits.get(node.input[0])
        if node.op_type != "DequantizeLinear" or codes is None:
            continue
        if codes.data_type != FP8:
            continue
        array = onnx.numpy_helper.to_array
        scale = array(inits[node.input[1]])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        shape = [1] * len(codes.dims)
        if scale.ndim:
            shape[axis] = -1
        values = array(codes).astype(np.float32)
        weights[codes.name] = values * scale.reshape(shape)
    return weights


def test_fp8_eager_traced_xla_and_onnx_round_alike(tmp_path):
    """Issue 34: Grappler folded `amax / 448` into a product by the
    reciprocal, so a traced FP8 model (predict, fit, the parity reference)
    used scales a float32 step off the eager model's and the file's."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 16))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(32, 3, activation="relu", name="body")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(32, activation="relu", name="fc")(x)
    model = keras.Model(inputs, keras.layers.Dense(16)(x))
    data = np.random.default_rng(0).random((32, 8, 8, 16)).astype("float32")
    qmodel = _fp8(model, data)
    eager = qmodel(data).numpy()
    np.testing.assert_array_equal(tf.function(qmodel)(data), eager)
    np.testing.assert_array_equal(qmodel.predict(data, verbose=0), eager)
    # XLA's own GEMMs round differently: its FP8 weights must not
    xla = tf.function(qmodel, jit_compile=True)(data).numpy()
    assert np.linalg.norm(xla - eager) <= 1e-6 * np.linalg.norm(eager)

    path = str(tmp_path / "fp8.onnx")
    with pytest.warns(UserWarning, match="opset 19"):
        report = keras_mp.export_onnx(qmodel, path, verify_data=data)
    assert report.rel_l2 <= 1e-6, report
    in_file = _file_weights(path)
    for name, layout in [("body", (3, 2, 0, 1)), ("fc", (0, 1))]:
        layer = qmodel.get_layer(name)
        assert layer.weight_quantizers[0].format.name == "float8"
        # tf2onnx names a weight after its op's scope: ".../body_1/..."
        (key,) = [k for k in in_file if re.search(rf"/{name}(_\d+)?/", k)]

        def weight(layer=layer):
            return layer.weight_quantizers[0](layer.kernel)

        want = np.transpose(weight().numpy(), layout)
        np.testing.assert_array_equal(in_file[key], want)
        for jit in (False, True):
            got = tf.function(weight, jit_compile=jit)().numpy()
            np.testing.assert_array_equal(np.transpose(got, layout), want)
