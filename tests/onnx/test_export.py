"""Export: Q/DQ ONNX that passes the TensorRT lint and matches Keras in
ONNX Runtime, on real architectures; SavedModel; CLI export/lint."""

import os

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from keras_mp.quantization import twins
from keras_mp.reference import reference_cnn
from tests.conftest import Subclassed, small_cnn, tf_keras_like


def _quantized(model, x):
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    return qmodel


def _check_artifact(path, expect_weighted):
    report = keras_mp.check_tensorrt(path)
    assert report.ok, str(report)
    assert report.weighted_ops == expect_weighted
    assert report.weighted_ops_quantized == report.weighted_ops
    graph = onnx.load(path).graph
    producers = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type in ("Conv", "MatMul", "ConvTranspose"):
            # the weight's DQ feeds the weighted op directly
            assert producers[node.input[1]].op_type == "DequantizeLinear"
    return report


def _concat_transpose_model():
    inputs = keras.Input((16, 16, 8))
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    b = keras.layers.Conv2D(8, 1, activation="relu")(inputs)
    x = keras.layers.Concatenate()([a, b])
    x = keras.layers.Conv2DTranspose(8, 3, strides=2, padding="same")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


ARCHITECTURES = [
    # residual adds, depthwise convolutions, a dense head
    ("reference_cnn", lambda: reference_cnn(width=8), (28, 28, 1), 8),
    # inverted residuals, depthwise (ReLU6), squeeze-free; slow, as the
    # one below (`.ci/run` runs them; the zoo's fast subset has
    # MobileNetV3Small in `make test`)
    pytest.param(
        "MobileNetV2",
        lambda: keras.applications.MobileNetV2(
            input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10
        ),
        (32, 32, 3),
        None,
        marks=pytest.mark.slow,
        id="MobileNetV2",
    ),
    # squeeze-excite multiplies, depthwise, swish
    pytest.param(
        "EfficientNetB0",
        lambda: keras.applications.EfficientNetB0(
            input_shape=(32, 32, 3), weights=None, classes=10
        ),
        (32, 32, 3),
        None,
        marks=pytest.mark.slow,
        id="EfficientNetB0",
    ),
    ("concat_transpose", _concat_transpose_model, (16, 16, 8), 4),
]


@pytest.mark.parametrize(
    "name,make,shape,weighted",
    ARCHITECTURES,
    ids=[getattr(a, "id", None) or a[0] for a in ARCHITECTURES],
)
def test_export_lint_clean_and_parity(name, make, shape, weighted, tmp_path):
    x = np.random.default_rng(0).random((32,) + shape, dtype=np.float32)
    model = make()
    qmodel = _quantized(model, x)
    path = str(tmp_path / f"{name}.onnx")
    # A random-weight EfficientNet's softmax is near uniform (its logits
    # about 1e-8): top-1 flips on 1e-9 differences, so relative L2 judges.
    min_top1 = 0.0 if name == "EfficientNetB0" else 0.999
    parity = keras_mp.export_onnx(
        qmodel, path, verify_data=x, min_top1_agreement=min_top1
    )
    assert parity.top1_agreement >= min_top1 and parity.rel_l2 <= 0.01
    quantized = twins.quantized_layers(qmodel)
    n_weighted = sum(bool(w.weight_ranges) for w in quantized)
    n_weighted += sum(
        isinstance(w, keras.layers.SeparableConv2D) for w in quantized
    )
    _check_artifact(path, weighted or n_weighted)


def test_float_and_mixed_precision_models_export(tmp_path):
    x = np.random.default_rng(0).random((16, 28, 28, 1), dtype=np.float32)
    model = small_cnn()
    keras_mp.export_onnx(model, tmp_path / "f.onnx", verify_data=x)
    keras_mp.enable_mixed_precision("mixed_float16")
    mixed = keras_mp.apply_mixed_precision(small_cnn())
    mixed(x)
    report = keras_mp.export_onnx(
        mixed, tmp_path / "m.onnx", verify_data=x, max_rel_l2=0.02
    )
    assert report.top1_agreement >= 0.999
    graph = onnx.load(tmp_path / "m.onnx").graph
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    # float32 inside too (traced from a float32 twin): TensorRT picks
    assert onnx.TensorProto.FLOAT16 not in {
        i.data_type for i in graph.initializer
    }


def test_bad_exports_leave_nothing_half_written(tmp_path):
    x = np.random.default_rng(0).random((8, 28, 28, 1), dtype=np.float32)
    qmodel = keras_mp.quantize_model(small_cnn())
    path = tmp_path / "q.onnx"
    with pytest.raises(
        keras_mp.ExportError,
        match=r"Uncalibrated.* in conv2d(_\d+)?/input_0.*keras_mp.calibrate",
    ):
        keras_mp.export_onnx(qmodel, path)
    assert not path.exists()
    keras_mp.calibrate(qmodel, x, verbose=0)
    path.write_bytes(b"previous")
    with pytest.raises(
        keras_mp.ExportError,
        match=r"q.onnx exists. Pass overwrite=True "
        r"\(CLI: --overwrite\)",
    ):
        keras_mp.export_onnx(qmodel, path)
    # a parity failure (a tolerance the float16 arithmetic of a float
    # model's graph exceeds) leaves the previous file
    with pytest.raises(keras_mp.ParityError, match="Tolerance"):
        keras_mp.export_onnx(
            small_cnn(),
            path,
            verify_data=x,
            overwrite=True,
            dtype="float16",
            max_rel_l2=1e-9,
        )
    assert path.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["q.onnx"]
    with pytest.raises(
        FileNotFoundError,
        match="folder .*missing does not exist. Create it first",
    ):
        keras_mp.export_onnx(qmodel, tmp_path / "missing" / "q.onnx")
    with pytest.raises(
        keras_mp.ExportError,
        match="Per-channel Q/DQ needs opset >= 13. Received: opset=11",
    ):
        keras_mp.export_onnx(qmodel, tmp_path / "o.onnx", opset=11)
    never_called = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(
        keras_mp.ExportError, match=r"never been called.*keras.Input"
    ):
        keras_mp.export_onnx(never_called, tmp_path / "n.onnx")


def test_saved_model_round_trip(tmp_path):
    x = np.random.default_rng(0).random((8, 28, 28, 1), dtype=np.float32)
    qmodel = _quantized(small_cnn(), x)
    diff = keras_mp.export_saved_model(qmodel, tmp_path / "sm", verify_data=x)
    assert diff is not None and diff < 1e-5


def test_strip_quantization_gives_the_float_model():
    x = np.random.default_rng(0).random((4, 28, 28, 1), dtype=np.float32)
    model = small_cnn()
    stripped = keras_mp.strip_quantization(_quantized(model, x))
    assert not any(twins.is_quantized(w) for w in stripped.layers)
    assert twins.quantizers(stripped) == []  # none at any depth
    np.testing.assert_allclose(stripped(x), model(x), atol=1e-6)


def test_sparse_then_qat_keeps_2_4_through_export(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.random((64, 12, 12, 8), dtype=np.float32)
    y = np.arange(64) % 4
    inputs = keras.Input((12, 12, 8))
    h = keras.layers.Conv2D(16, 3, activation="relu", name="conv")(inputs)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="fc")(h))
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(
        x, y, epochs=1, verbose=0, callbacks=[keras_mp.StructuredSparsity()]
    )
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    qmodel.compile(
        keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy"
    )
    qmodel.fit(
        x, y, epochs=2, verbose=0, callbacks=[keras_mp.StructuredSparsity()]
    )
    for name in ("conv", "fc"):
        kernel = qmodel.get_layer(name).kernel.numpy()
        axis = 0 if kernel.ndim == 2 else -2
        assert keras_mp.is_2_4_sparse(kernel, axis), name
    path = tmp_path / "sparse.onnx"
    keras_mp.export_onnx(qmodel, path, verify_data=x)
    report = keras_mp.check_tensorrt(path, check_sparsity=True)
    assert report.ok, str(report)
    assert len(report.sparse_weights) == 2
    assert "--sparsity=enable" in keras_mp.trtexec_command(path, report)


def test_fp16_export_is_int8_plus_float16_with_float32_boundaries(tmp_path):
    x = np.random.default_rng(0).random((64, 28, 28, 1), dtype=np.float32)
    qmodel = _quantized(reference_cnn(width=8), x)
    path = str(tmp_path / "fp16.onnx")
    parity = keras_mp.export_onnx(qmodel, path, verify_data=x, dtype="float16")
    assert parity.top1_agreement >= 0.999 and parity.rel_l2 <= 0.05
    proto = onnx.load(path)
    assert max(o.version for o in proto.opset_import if o.domain == "") == 19
    graph = proto.graph
    FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    assert graph.input[0].type.tensor_type.elem_type == FLOAT
    assert graph.output[0].type.tensor_type.elem_type == FLOAT
    # inside the graph a float32 constant is read only by the float32
    # nodes the export lists (the output layer): scales, biases and
    # BatchNormalization statistics are float16 elsewhere, weights INT8
    islands = {e.node for e in parity.typed.rows}
    assert {e.reason for e in parity.typed.rows} <= {"policy", "qdq"}
    dtypes = {init.name: init.data_type for init in graph.initializer}
    for node in graph.node:
        for name in node.input:
            if dtypes.get(name) == FLOAT:
                assert node.name in islands, (node.name, name)
    assert FLOAT16 in dtypes.values()
    types = {v.name: v.type.tensor_type.elem_type for v in graph.value_info}
    for node in graph.node:
        if node.op_type in ("Conv", "MatMul") and node.name not in islands:
            assert types.get(node.input[0]) == FLOAT16, node.name
    report = _check_artifact(path, 8)
    assert report.num_qdq == 24


def test_fp16_needs_opset_19_and_says_so(tmp_path):
    x = np.random.default_rng(0).random((8, 28, 28, 1), dtype=np.float32)
    with pytest.raises(keras_mp.ExportError, match="opset >= 19.*opset=19"):
        keras_mp.export_onnx(
            small_cnn(), tmp_path / "a.onnx", opset=17, dtype="float16"
        )
    assert not (tmp_path / "a.onnx").exists()
    # opsets past tf2onnx's 18 go through ONNX's version converter
    keras_mp.export_onnx(
        small_cnn(), tmp_path / "b.onnx", opset=19, verify_data=x
    )
    proto = onnx.load(tmp_path / "b.onnx")
    assert max(o.version for o in proto.opset_import if o.domain == "") == 19


def _two_input_model():
    image = keras.Input((8, 8, 4), name="image")
    extra = keras.Input((6,), name="extra")
    h = keras.layers.Conv2D(8, 3, activation="relu")(image)
    h = keras.layers.GlobalAveragePooling2D()(h)
    e = keras.layers.Dense(8, activation="relu")(extra)
    h = keras.layers.Concatenate()([h, e])
    return keras.Model([image, extra], keras.layers.Dense(5)(h))


def _activation_quantizers(model):
    return keras_mp.quantization.activation_quantizers(model).values()


def test_multi_input_model_calibrates_exports_and_verifies(tmp_path):
    rng = np.random.default_rng(0)
    xs = [
        rng.random((32, 8, 8, 4), np.float32),
        rng.random((32, 6), np.float32),
    ]
    qmodel = keras_mp.quantize_model(_two_input_model())
    keras_mp.calibrate(qmodel, xs, verbose=0)
    amax = [q.amax.numpy() for q in _activation_quantizers(qmodel)]
    # the same data as (dict of inputs, labels) batches gives the same ranges
    batches = [
        ({"image": xs[0][i : i + 8], "extra": xs[1][i : i + 8]}, None)
        for i in range(0, 32, 8)
    ]
    keras_mp.calibrate(qmodel, batches, verbose=0)
    np.testing.assert_array_equal(
        amax, [q.amax.numpy() for q in _activation_quantizers(qmodel)]
    )
    path = tmp_path / "two.onnx"
    report = keras_mp.export_onnx(qmodel, path, verify_data=xs)
    assert report.samples == 32 and report.top1_agreement >= 0.999
    assert keras_mp.check_tensorrt(path).ok
    by_name = keras_mp.verify_onnx(
        qmodel, path, {"image": xs[0], "extra": xs[1]}
    )
    assert by_name.rel_l2 == pytest.approx(report.rel_l2, rel=1e-3, abs=1e-7)
    with pytest.raises(keras_mp.ExportError, match="1 array.*2 input"):
        keras_mp.verify_onnx(qmodel, path, xs[0])
    with pytest.raises(keras_mp.ExportError, match="different batch sizes"):
        keras_mp.verify_onnx(qmodel, path, [xs[0], xs[1][:5]])


def test_onnx_outputs_are_named_like_the_keras_outputs(tmp_path):
    """Dict outputs by key, list and Sequential outputs by output layer."""
    x = keras.Input((4,), name="x")
    logits = keras.layers.Dense(3, name="logits")(x)
    probs = keras.layers.Softmax(name="probs")(logits)
    models = {
        "dict": (keras.Model(x, {"b": probs, "a": logits}), ["a", "b"]),
        "list": (keras.Model(x, [logits, probs]), ["logits", "probs"]),
        "sequential": (
            keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]),
            None,
        ),
    }
    data = np.random.default_rng(0).random((8, 4), np.float32)
    for kind, (model, want) in models.items():
        path = tmp_path / f"{kind}.onnx"
        keras_mp.export_onnx(model, path, verify_data=data)
        got = [o.name for o in onnx.load(path).graph.output]
        if want is None:  # Sequential: its last layer's name
            want = [model.layers[-1].name]
        assert got == want, kind


def test_keras_int8_model_export_warns_it_is_not_tensorrt_ready(tmp_path):
    x = np.random.default_rng(0).random((8, 16), dtype=np.float32)
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(4)(inputs))
    model.quantize("int8")
    with pytest.warns(UserWarning, match="keras_mp.quantize_model"):
        keras_mp.export_onnx(
            model, tmp_path / "k.onnx", verify_data=x, max_rel_l2=0.1
        )
    assert (tmp_path / "k.onnx").exists()


def test_models_export_cannot_take_are_named(tmp_path):
    with pytest.raises(TypeError, match=r"tf_keras \(Keras 2\) models"):
        keras_mp.export_onnx(tf_keras_like(), tmp_path / "t.onnx")
    subclassed = Subclassed()
    subclassed(np.ones((2, 8), "float32"))
    with pytest.raises(keras_mp.ExportError, match="subclassed keras.Model"):
        keras_mp.export_onnx(subclassed, tmp_path / "s.onnx")
    with pytest.raises(keras_mp.ExportError, match="subclassed keras.Model"):
        keras_mp.export_saved_model(subclassed, tmp_path / "s_sm")
    never_called = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(
        keras_mp.ExportError, match="never been called. Call it once first"
    ):
        keras_mp.export_saved_model(never_called, tmp_path / "n_sm")
    os.makedirs(tmp_path / "existing_sm")
    with pytest.raises(
        keras_mp.ExportError, match="existing_sm exists. Pass overwrite=True"
    ):
        keras_mp.export_saved_model(small_cnn(), tmp_path / "existing_sm")
    assert sorted(os.listdir(tmp_path)) == ["existing_sm"]


def test_fewer_than_8_bits_is_refused_and_writes_nothing(tmp_path):
    x = np.random.default_rng(6).random((8, 6), np.float32)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(3, name="fc")(inputs))
    qmodel = keras_mp.quantize_model(
        model, config=keras_mp.QuantizeConfig(precision="int4", block_size=None)
    )
    keras_mp.calibrate(qmodel, x, verbose=0)
    path = tmp_path / "q4.onnx"
    with pytest.raises(
        keras_mp.ExportError,
        match=r"INT8 Q/DQ .* 2 quantizer\(s\) .* fewer bits: "
        r".*fc.*\(int4\).*precision=.int8.*Nothing was written",
    ):
        keras_mp.export_onnx(qmodel, path)
    assert os.listdir(tmp_path) == []


@keras.saving.register_keras_serializable("keras_mp_tests")
class _StepLoop(keras.layers.Layer):
    """A Python loop over the sequence length, as keras-hub's RWKV7
    time mixing: it needs a fixed length to trace."""

    def call(self, x):
        total = 0.0
        for t in range(keras.ops.shape(x)[1]):
            total = total + x[:, t]
        return total

    def compute_output_shape(self, shape):
        return (shape[0], shape[2])


def test_dynamic_length_a_layer_needs_fixed_gets_a_clear_error(tmp_path):
    x = np.random.default_rng(0).random((4, 5, 3), dtype=np.float32)
    inputs = keras.Input((None, 3), name="steps")
    model = keras.Model(inputs, _StepLoop()(inputs))
    path = tmp_path / "m.onnx"
    with pytest.raises(
        keras_mp.ExportError,
        match=r"_StepLoop.call\(\).*fixed size.*steps.*dynamic \(None\)"
        r".*keras.Input. of fixed shapes. Nothing was written",
    ):
        keras_mp.export_onnx(model, path, verify_data=x)
    assert not path.exists() and not list(tmp_path.iterdir())
    # what the error says to do
    fixed = keras.Input((5, 3), name="steps")
    keras_mp.export_onnx(keras.Model(fixed, model(fixed)), path, verify_data=x)
    assert path.exists()


@pytest.mark.parametrize(
    "name, match",
    [
        ("folder", r"`path` is a directory.* e.g. '.*folder/model.onnx'"),
        ("m.keras", r"not a Keras model file. .* Name it '.*m.onnx'"),
        ("m.h5", r"path='.*m.h5'.* Name it '.*m.onnx'"),
    ],
    ids=["directory", "keras", "h5"],
)
def test_path_that_cannot_take_the_graph_is_refused_first(
    tmp_path, name, match
):
    """Checked before anything else: an uncalibrated model would otherwise
    fail first, and a directory used to fail after the conversion."""
    (tmp_path / "folder").mkdir()
    qmodel = keras_mp.quantize_model(small_cnn())
    for overwrite in (False, True):
        with pytest.raises(keras_mp.ExportError, match=match):
            keras_mp.export_onnx(qmodel, tmp_path / name, overwrite=overwrite)
    assert os.listdir(tmp_path) == ["folder"]
    assert os.listdir(tmp_path / "folder") == []


def test_fp16_is_a_deprecated_alias_of_dtype(tmp_path):
    inputs = keras.Input((8, 8, 1))
    model = keras.Model(inputs, keras.layers.Conv2D(4, 3)(inputs))
    with pytest.warns(DeprecationWarning, match="dtype='float16'"):
        keras_mp.export_onnx(model, str(tmp_path / "a.onnx"), fp16=True)
    with pytest.raises(keras_mp.ExportError, match="Pass only dtype"):
        keras_mp.export_onnx(
            model, str(tmp_path / "b.onnx"), fp16=True, dtype="bfloat16"
        )
    assert not (tmp_path / "b.onnx").exists()
