"""Conversion of real Keras models: captured constants (EfficientNet),
grouped convolutions (ConvNeXt), exact GELU, tf2onnx's skipped optimizers,
ops ONNX does not have; float parity with ONNX Runtime, INT8 lint-clean."""

import os

import keras
import numpy as np
import onnx
import pytest

import keras_mp
from keras_mp.onnx.convert import OP_HANDLERS, keras_layers_of

# Float export: ONNX Runtime within this relative L2 of Keras.
FLOAT_REL_L2 = 1e-4


def _gelu_dense():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="gelu", name="gelu_dense")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4)(h), name="gelu_model")


def _grouped_conv():
    inputs = keras.Input((8, 8, 8))
    h = keras.layers.Conv2D(8, 3, groups=2, padding="same", activation="relu")(
        inputs
    )
    h = keras.layers.Conv2D(16, 3, groups=4)(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(3)(h))


def _convnext_block():
    """ConvNeXt's block: depthwise 7x7 as Conv2D(groups=channels) (as
    keras.applications.ConvNeXt builds it), LayerNorm, Dense-GELU-Dense,
    residual."""
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(16, 4, strides=4)(inputs)
    h = keras.layers.Conv2D(16, 7, padding="same", groups=16)(x)
    h = keras.layers.LayerNormalization(epsilon=1e-6)(h)
    h = keras.layers.Dense(64, activation="gelu")(h)
    h = keras.layers.Dense(16)(h)
    x = keras.layers.Add()([x, h])
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(5)(x))


def _app(name, **kwargs):
    def make():
        return getattr(keras.applications, name)(
            input_shape=(32, 32, 3), weights=None, classes=10, **kwargs
        )

    return make


# One model per handler of keras_mp.onnx.convert.OP_HANDLERS that exercises
# it: a new handler without a test fails test_every_handler_has_a_test.
HANDLER_MODELS = {"Erfc": _gelu_dense}


def _data(model, n=16, scale=1.0):
    rng = np.random.default_rng(0)
    return (
        scale * rng.standard_normal((n,) + tuple(model.inputs[0].shape[1:]))
    ).astype(np.float32)


def _node_types(path):
    return {node.op_type for node in onnx.load(path).graph.node}


def test_every_handler_has_a_test():
    assert sorted(HANDLER_MODELS) == sorted(OP_HANDLERS)


@pytest.mark.parametrize("op", sorted(OP_HANDLERS))
def test_op_handler_converts_and_matches(op, tmp_path):
    model = HANDLER_MODELS[op]()
    # wide inputs reach the tails, where 1 - erf(x) loses erfc's precision
    x = _data(model, n=64, scale=4.0)
    path = tmp_path / f"{op}.onnx"
    report = keras_mp.export_onnx(
        model, path, verify_data=x, max_rel_l2=FLOAT_REL_L2
    )
    assert report.rel_l2 <= FLOAT_REL_L2 and report.max_abs_diff < 1e-5
    assert op not in _node_types(path)


FLOAT_MODELS = [
    ("gelu_dense", _gelu_dense, set()),
    ("grouped_conv", _grouped_conv, set()),
    ("convnext_block", _convnext_block, set()),
    # its INT8 export, and the two below: `.ci/run`'s slow step
    pytest.param(
        "EfficientNetB0",
        _app("EfficientNetB0"),
        set(),
        marks=pytest.mark.slow,
        id="EfficientNetB0",
    ),
    pytest.param(
        "MobileNetV3Small",
        _app("MobileNetV3Small"),
        {"optimize_transpose"},
        id="MobileNetV3Small",
    ),
    pytest.param(
        "EfficientNetV2B0",
        _app("EfficientNetV2B0"),
        set(),
        marks=pytest.mark.slow,
        id="EfficientNetV2B0",
    ),
    pytest.param(
        "ConvNeXtTiny",
        _app("ConvNeXtTiny"),
        set(),
        marks=pytest.mark.slow,
        id="ConvNeXtTiny",
    ),
]


@pytest.mark.parametrize(
    "name,make,skipped_optimizers",
    FLOAT_MODELS,
    ids=[getattr(m, "id", None) or m[0] for m in FLOAT_MODELS],
)
def test_float_export_matches_onnx_runtime(
    name, make, skipped_optimizers, tmp_path, recwarn
):
    model = make()
    x = _data(model)
    path = tmp_path / f"{name}.onnx"
    # judged by relative L2: a random-weight softmax is near uniform, and
    # its top-1 flips on 1e-9 differences
    report = keras_mp.export_onnx(
        model,
        path,
        verify_data=x,
        max_rel_l2=FLOAT_REL_L2,
        min_top1_agreement=0.0,
    )
    assert report.rel_l2 <= FLOAT_REL_L2
    graph = onnx.load(path).graph
    # the real input only: Normalization's mean and variance are constants
    assert [i.name for i in graph.input] == ["input_0"]
    types = _node_types(path)
    assert not types & {"PartitionedCall", "StatefulPartitionedCall"}
    if name in ("grouped_conv", "convnext_block", "ConvNeXtTiny"):
        groups = [
            a.i
            for n in graph.node
            if n.op_type == "Conv"
            for a in n.attribute
            if a.name == "group"
        ]
        assert max(groups) > 1  # a plain grouped Conv, not a call
    warned = " ".join(str(w.message) for w in recwarn)
    for optimizer in skipped_optimizers:
        # tf2onnx skips it after a crash: said, not silent
        assert f"{optimizer} optimizer(s) crashed" in warned
    if not skipped_optimizers:
        assert "crashed" not in warned


def _quantized(model, x):
    qmodel = keras_mp.quantize_model(model)
    keras_mp.calibrate(qmodel, x, verbose=0)
    return qmodel


@pytest.mark.parametrize(
    "name,make",
    [
        ("grouped_conv", _grouped_conv),
        ("convnext_block", _convnext_block),
    ],
)
def test_int8_export_is_tensorrt_clean(name, make, tmp_path):
    # EfficientNetB0 INT8: tests/onnx/test_export.py (slow)
    model = make()
    x = np.random.default_rng(0).random(
        (32,) + tuple(model.inputs[0].shape[1:]), dtype=np.float32
    )
    qmodel = _quantized(model, x)
    path = tmp_path / f"{name}.onnx"
    parity = keras_mp.export_onnx(qmodel, path, verify_data=x)
    assert parity.top1_agreement >= 0.999 and parity.rel_l2 <= 0.01
    report = keras_mp.check_tensorrt(path)
    assert report.ok, str(report)
    assert report.weighted_ops > 0
    assert report.weighted_ops_quantized == report.weighted_ops


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class InverseErf(keras.layers.Layer):
    def call(self, x):
        return keras.ops.erfinv(keras.ops.tanh(x))


def test_unconvertible_op_names_op_and_layer_and_writes_nothing(tmp_path):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4, name="before")(inputs)
    h = InverseErf(name="inverse_erf")(h)
    model = keras.Model(inputs, h)
    path = tmp_path / "e.onnx"
    with pytest.raises(
        keras_mp.ExportError,
        match=r"cannot convert the TensorFlow op\(s\) Erfinv .*"
        r"layer 'inverse_erf'.*OP_HANDLERS. Nothing was written",
    ):
        keras_mp.export_onnx(model, path)
    assert os.listdir(tmp_path) == []


def test_op_names_map_to_keras_layers():
    model = _gelu_dense()
    assert keras_layers_of("functional_1/gelu_dense_1/Gelu/Erfc", model) == [
        "gelu_dense"
    ]
    assert keras_layers_of("Identity", model) == []


def test_resize_to_an_uneven_size_keeps_its_size(tmp_path):
    """tf2onnx writes the float32 scale 9 / 5 for a 5 -> 9 resize, and
    ONNX's shape inference sizes that 8 (keras-hub's DepthAnythingBackbone
    then failed to load in ONNX Runtime): the export raises the scale to
    the float32 that gives 9 everywhere."""
    inputs = keras.Input((5, 5, 2))
    small = keras.layers.Conv2D(2, 1)(inputs)
    big = keras.layers.Conv2D(2, 1)(keras.layers.Resizing(9, 9)(inputs))
    added = keras.layers.Add()([big, keras.layers.Resizing(9, 9)(small)])
    model = keras.Model(inputs, added)
    path = str(tmp_path / "resize.onnx")
    x = np.random.default_rng(0).random((2, 5, 5, 2), np.float32)
    keras_mp.export_onnx(model, path, verify_data=x)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(path)).graph
    sizes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in inferred.value_info
    }
    resized = [n.output[0] for n in inferred.node if n.op_type == "Resize"]
    assert len(resized) == 2
    assert all(sizes[name][-2:] == [9, 9] for name in resized), sizes
