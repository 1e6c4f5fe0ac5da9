"""`QuantizeConfig`: validation and serialization."""

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
    config = keras_mp.QuantizeConfig(num_bits=4, per_channel=False)
    again = keras_mp.QuantizeConfig.from_config(config.get_config())
    assert again == config
    assert again.num_bits == 4 and not again.per_channel


@pytest.mark.parametrize(
    "given, name",
    [
        ("INT8", "int8"),
        ("FP8", "fp8"),
        ("Fp8", "fp8"),
        ("e4m3", "fp8"),
        ("float8_e4m3fn", "fp8"),
    ],
)
def test_precision_in_another_case_or_an_alias_is_its_name(given, name):
    config = keras_mp.QuantizeConfig(precision=given)
    assert config.precision == name and config.format == name
    assert config.get_config()["precision"] == name


@pytest.mark.parametrize("given", ["int2", "fp16", "e5m2", 8, None])
def test_unknown_precision_names_the_valid_ones(given):
    with pytest.raises(
        ValueError,
        match=r"must be one of \['int8', 'fp8', 'int4', 'nvfp4', 'mxfp8'\] "
        r"\(any case; FP8 is E4M3, "
        r"also named 'e4m3'.*num_bits\). Received: precision=",
    ):
        keras_mp.QuantizeConfig(precision=given)


def test_quantize_model_takes_the_precision_in_any_case():
    import keras

    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(16, name="fc")]
    )
    q = keras_mp.quantize_model(model, precision="FP8")
    formats = {
        quantizer.quantizer.format.name
        for quantizer in keras_mp.quantization.twins.quantizers(q)
    }
    assert formats == {"fp8"}
