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
