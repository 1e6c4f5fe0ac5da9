"""The modules of `keras_mp.quantization` renamed in this release still
import from their old paths, with a warning naming the new one."""

import importlib

import pytest

import keras_mp

RENAMED = {
    "annotate": ("quantize", "quantize_model"),
    "inplace": ("attach", "quantize_in_place"),
    "model": ("record", "quantization_record"),
    "quantizer": ("tensor_quantizer", "TensorQuantizer"),
    "quantizers": ("fake_quant", "fake_quant"),
    "layers": ("activation", "QuantizeActivation"),
    "block_calibrate": ("calibrate_weights", "block_quantizers"),
    "weight_calibration": ("kernel_calibration", "gptq"),
}


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_module_path_warns_and_gives_the_same_object(old):
    new, name = RENAMED[old]
    module = importlib.import_module(f"keras_mp.quantization.{old}")
    with pytest.warns(DeprecationWarning, match=f"keras_mp.quantization.{new}"):
        got = getattr(module, name)
    want = getattr(
        importlib.import_module(f"keras_mp.quantization.{new}"), name
    )
    assert got is want


def test_from_import_of_an_old_path_works():
    with pytest.warns(DeprecationWarning, match="tensor_quantizer"):
        from keras_mp.quantization.quantizer import TensorQuantizer
    assert TensorQuantizer is keras_mp.quantization.TensorQuantizer


def test_an_unknown_name_of_an_old_path_is_an_attribute_error():
    module = importlib.import_module("keras_mp.quantization.annotate")
    with pytest.warns(DeprecationWarning), pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018
