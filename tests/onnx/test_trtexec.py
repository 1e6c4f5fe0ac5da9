"""`trtexec_command`: the TensorRT build line for an exported file."""

import onnx
import pytest

import keras_mp
from tests.conftest import small_cnn


def test_trtexec_command_has_shapes_for_the_dynamic_batch(tmp_path):
    path = str(tmp_path / "f.onnx")
    keras_mp.export_onnx(small_cnn(), path)
    command = keras_mp.trtexec_command(path)
    assert command.startswith(f"trtexec --onnx={path} ")
    assert "--stronglyTyped" in command and "--int8" not in command
    name = onnx.load(path).graph.input[0].name
    assert f"--minShapes={name}:1x28x28x1" in command
    assert f"--optShapes={name}:32x28x28x1" in command
    assert f"--maxShapes={name}:128x28x28x1" in command
    legacy = keras_mp.trtexec_command(path, batch=(2, 4, 8), legacy=True)
    assert (
        "--int8 --fp16" in legacy and f"--maxShapes={name}:8x28x28x1" in legacy
    )
    with pytest.raises(ValueError, match="min <= opt <= max"):
        keras_mp.trtexec_command(path, batch=(8, 4, 2))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="No ONNX file at .*none.onnx"):
        keras_mp.trtexec_command(str(tmp_path / "none.onnx"))
