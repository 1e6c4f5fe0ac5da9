"""`QuantizeConfig`: validation and serialization."""

import warnings

import pytest

import keras_mp


@pytest.mark.parametrize(
    "num_bits,match",
    [
        (16, r"integer in \[2, 8\] \(TensorRT runs 8\). Received: num_bits=16"),
        (8.0, "Received: num_bits=8.0"),
    ],
)
def test_num_bits_outside_2_to_8_is_rejected(num_bits, match):
    with pytest.raises(ValueError, match=match):
        keras_mp.QuantizeConfig(num_bits=num_bits)


def test_config_round_trips():
    config = keras_mp.QuantizeConfig(
        precision="int4", block_size=None, per_channel=False
    )
    again = keras_mp.QuantizeConfig.from_config(config.get_config())
    assert again == config and "num_bits" not in config.get_config()
    assert again.num_bits == 4 and not again.per_channel
    assert not again.blocked and again.format == "int4"


def test_int4_is_blocked_unless_block_size_is_none():
    assert keras_mp.QuantizeConfig(precision="int4").block_size == 128
    assert keras_mp.QuantizeConfig(precision="int4").blocked
    assert keras_mp.QuantizeConfig(precision="nvfp4", block_size=None).blocked


@pytest.mark.parametrize(
    "bits, precision, block_size",
    [(8, "int8", None), (5, "int5", None), (4, "int4", None)],
)
def test_num_bits_is_deprecated_for_the_precision(bits, precision, block_size):
    with pytest.warns(DeprecationWarning, match=f"precision='{precision}'"):
        config = keras_mp.QuantizeConfig(num_bits=bits)
    assert (config.precision, config.block_size) == (precision, block_size)
    assert config == keras_mp.QuantizeConfig(
        precision=precision, block_size=block_size
    )


def test_num_bits_and_a_precision_that_disagree_are_an_error():
    with pytest.raises(ValueError, match="precision='float8', num_bits=4"):
        keras_mp.QuantizeConfig(precision="float8", num_bits=4)
    with pytest.warns(DeprecationWarning, match="precision='float8'"):
        keras_mp.QuantizeConfig(precision="float8", num_bits=8)


@pytest.mark.parametrize(
    "saved, precision, block_size",
    [
        (
            {"precision": "int8", "num_bits": 4, "block_size": None},
            "int4",
            None,
        ),
        (
            {"precision": "int8", "num_bits": 8, "block_size": None},
            "int8",
            None,
        ),
        (
            {"precision": "fp8", "num_bits": 8, "block_size": None},
            "float8",
            None,
        ),
        ({"precision": "int4", "num_bits": 8, "block_size": 64}, "int4", 64),
        ({"precision": "nvfp4", "num_bits": 8, "block_size": 16}, "nvfp4", 16),
    ],
)
def test_configs_saved_with_old_names_load_silently(
    saved, precision, block_size
):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = keras_mp.QuantizeConfig.from_config(dict(saved, skip=False))
    assert (config.precision, config.block_size) == (precision, block_size)


@pytest.mark.parametrize(
    "given, name",
    [("INT8", "int8"), ("Float8", "float8"), ("int5", "int5")],
)
def test_precision_in_another_case_is_its_name(given, name):
    config = keras_mp.QuantizeConfig(precision=given)
    assert config.precision == name and config.format == name
    assert config.get_config()["precision"] == name


@pytest.mark.parametrize("given", ["fp8", "FP8", "e4m3", "float8_e4m3fn"])
def test_old_fp8_spellings_warn_and_name_float8(given):
    with pytest.warns(DeprecationWarning, match="use 'float8'"):
        config = keras_mp.QuantizeConfig(precision=given)
    assert config.precision == "float8"
    assert config.get_config()["precision"] == "float8"


@pytest.mark.parametrize("given", ["int9", "fp16", "e5m2", 8, None, "float"])
def test_unknown_precision_names_the_valid_ones(given):
    with pytest.raises(
        ValueError,
        match=r"must be one of \['int2', .* 'int8', 'float8', 'nvfp4', "
        r"'mxfp8'\] \(keras_mp's names.*Received: precision=",
    ):
        keras_mp.QuantizeConfig(precision=given if given else 8)


@pytest.mark.parametrize("given", ["FLOAT8", "fp8"])
def test_quantize_model_takes_the_precision_in_any_case(given):
    import keras

    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(16, name="fc")]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = keras_mp.quantize_model(model, precision=given)
    deprecations = [
        str(w.message) for w in caught if w.category is DeprecationWarning
    ]
    if given == "fp8":  # the old spelling works, and names the new one
        assert any("use 'float8'" in m for m in deprecations), deprecations
    else:
        assert not deprecations
    formats = {
        quantizer.quantizer.format.name
        for quantizer in keras_mp.quantization.twins.quantizers(q)
    }
    assert formats == {"float8"}
    report = keras_mp.quantization_report(q, verbose=False)
    assert {r["format"] for r in report.rows if r["quantized"]} == {"float8"}
