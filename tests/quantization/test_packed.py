"""`keras_mp.pack_weights`: INT4 weights stored as packed 4-bit codes in
the `.keras` file, exact outputs, no training, the same ONNX."""

import os

import keras
import ml_dtypes
import numpy as np
import pytest

import keras_mp
from keras_mp.quantization import packed
from keras_mp.quantization.blocks import block_encode, pack_nibbles


def _dense_stack(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((256,))
    h = inputs
    for i in range(3):
        h = keras.layers.Dense(512, activation="relu", name=f"fc{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(128, name="head")(h))


def _x(n=16, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 256)).astype("f4")


def test_nibbles_unpack_to_the_codes_packed():
    codes = np.arange(-8, 8, dtype=np.int8).repeat(3)
    got = packed.unpack_nibbles(
        pack_nibbles(codes.astype(ml_dtypes.int4)), codes.size
    )
    np.testing.assert_array_equal(got, codes)


def test_packed_file_is_a_seventh_of_float32_and_loads_exactly(tmp_path):
    model = _dense_stack()
    qmodel = keras_mp.quantize_model(model, precision="int4")
    x = _x()
    before = np.asarray(qmodel(x))
    assert keras_mp.pack_weights(qmodel) == [
        "fc0/kernel",
        "fc1/kernel",
        "fc2/kernel",
        "head/kernel",
    ]
    np.testing.assert_array_equal(np.asarray(qmodel(x)), before)
    # the kernel holds the codes times their scales
    fc1 = qmodel.get_layer("fc1")
    kernel = np.asarray(fc1.kernel)
    codes = block_encode(kernel, "int4", 128)
    assert len(np.unique(codes.codes.astype(np.int8))) <= 16
    model.save(tmp_path / "f32.keras")
    qmodel.save(tmp_path / "int4.keras")
    ratio = os.path.getsize(tmp_path / "int4.keras") / os.path.getsize(
        tmp_path / "f32.keras"
    )
    assert ratio < 0.2  # codes 1/8, scales and ranges 2/128 of float32
    loaded = keras.saving.load_model(tmp_path / "int4.keras", safe_mode=True)
    np.testing.assert_array_equal(np.asarray(loaded(x)), before)
    assert packed.is_packed(loaded)
    loaded.save(tmp_path / "again.keras")  # a loaded model saves packed
    assert os.path.getsize(tmp_path / "again.keras") < 0.2 * os.path.getsize(
        tmp_path / "f32.keras"
    )


def test_a_packed_model_refuses_training_and_calibration():
    qmodel = keras_mp.quantize_model(_dense_stack(), precision="int4")
    keras_mp.pack_weights(qmodel)
    qmodel.compile("adam", "mse")
    with pytest.raises(ValueError, match="packed INT4 weights.*quantize the"):
        qmodel.fit(_x(), np.zeros((16, 128), "f4"), verbose=0)
    with pytest.raises(ValueError, match="`calibrate`.*before packing"):
        keras_mp.calibrate(qmodel, _x(), method="awq", verbose=0)


def test_pack_needs_int4_weights():
    qmodel = keras_mp.quantize_model(_dense_stack())
    with pytest.raises(ValueError, match="no enabled INT4 weight to pack"):
        keras_mp.pack_weights(qmodel)


def test_awq_then_pack_keeps_the_pre_scale(tmp_path):
    model = _dense_stack()
    qmodel = keras_mp.quantize_model(model, precision="int4")
    x = _x(64)
    x[:, :3] *= 50.0
    keras_mp.calibrate(qmodel, x, method="awq", verbose=0)
    assert qmodel.get_layer("fc0").pre_quant_scale is not None
    before = np.asarray(qmodel(x[:8]))
    keras_mp.pack_weights(qmodel)
    qmodel.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras", safe_mode=True)
    np.testing.assert_array_equal(np.asarray(loaded(x[:8])), before)


def test_packed_model_exports_the_same_onnx(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("tf2onnx")
    from onnx import numpy_helper

    qmodel = keras_mp.quantize_model(_dense_stack(), precision="int4")
    with pytest.warns(UserWarning, match="opset 21"):
        keras_mp.export_onnx(qmodel, tmp_path / "float.onnx")
    keras_mp.pack_weights(qmodel)
    qmodel.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras", safe_mode=True)
    with pytest.warns(UserWarning, match="opset 21"):
        keras_mp.export_onnx(loaded, tmp_path / "packed.onnx")
    a, b = (
        onnx.load(tmp_path / "float.onnx"),
        onnx.load(tmp_path / "packed.onnx"),
    )
    assert [n.op_type for n in a.graph.node] == [
        n.op_type for n in b.graph.node
    ]
    first = {i.name: numpy_helper.to_array(i) for i in a.graph.initializer}
    second = {i.name: numpy_helper.to_array(i) for i in b.graph.initializer}
    assert first.keys() == second.keys()
    for name, value in first.items():
        np.testing.assert_array_equal(second[name], value)
