"""Annotate -> apply: layer selection, Q/DQ placement, model checks."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.quantization import twins
from keras_mp.reference import reference_cnn
from tests.conftest import Subclassed, tf_keras_like
from tests.quantization.conftest import cnn

L = keras.layers


def _normalized_model():
    inputs = keras.Input((28, 28, 1))
    x = L.Normalization(mean=0.3, variance=0.1)(inputs)
    inner = keras.Sequential(
        [keras.Input((28, 28, 1)), L.Conv2D(8, 3, activation="relu")],
        name="inner",
    )
    x = L.GlobalAveragePooling2D()(inner(x))
    return keras.Model(inputs, L.Dense(10)(x))


def test_apply_carries_state_and_disabled_equals_float():
    model = _normalized_model()
    qmodel = keras_mp.quantize_model(model)
    inner = list(qmodel.get_layer("inner").layers)
    assert twins.is_quantized(inner[0])  # nested model
    x = np.random.default_rng(1).random((4, 28, 28, 1), dtype=np.float32)
    keras_mp.set_quantization_enabled(qmodel, False)
    np.testing.assert_array_equal(qmodel(x), model(x))
    keras_mp.set_quantization_enabled(qmodel, True)
    keras_mp.calibrate(qmodel, x, verbose=0)
    assert not np.array_equal(qmodel(x), model(x))


def test_residual_add_quantizes_only_the_skip_input():
    qmodel = keras_mp.quantize_model(reference_cnn(width=8))
    add = qmodel.get_layer("res_add")
    assert twins.is_quantized(add)
    assert add.input_indices == [0]  # input 1 comes from conv -> BN: fused


def test_concatenate_leaves_its_inputs_to_the_consumer_unless_asked():
    # TensorRT moves the consumer's input Q backwards across the concat
    # into both convs: Q/DQ on the concat inputs would only requantize.
    concat_in = keras.Input((4, 4, 8))
    a = L.Conv2D(8, 1, name="a")(concat_in)
    b = L.Conv2D(8, 1, name="b")(concat_in)
    x = L.Concatenate(name="cat")([a, b])
    cat = keras.Model(concat_in, L.Conv2D(4, 1, name="head")(x))
    qcat = keras_mp.quantize_model(cat)
    assert not twins.is_quantized(qcat.get_layer("cat"))  # not quantized
    assert qcat.get_layer("head").input_indices == [0]
    asked = keras_mp.quantize_model(
        cat, config={"cat": keras_mp.QuantizeConfig(quantize_inputs=True)}
    )
    assert twins.is_quantized(asked.get_layer("cat"))
    assert asked.get_layer("cat").input_indices == [0, 1]


def test_selection_and_config():
    model = reference_cnn(width=8)
    q = keras_mp.quantize_model(model, layers=["stem", L.Dense])
    names = {layer.name for layer in twins.quantized_layers(q)}
    assert names == {"stem", "fc", "logits"}
    q = keras_mp.quantize_model(
        model,
        config={
            "logits": keras_mp.QuantizeConfig(skip=True),
            "fc": keras_mp.QuantizeConfig(per_channel=False),
        },
    )
    assert not twins.is_quantized(q.get_layer("logits"))
    assert q.get_layer("fc").weight_ranges[0][2].shape == ()


def test_annotate_layer_then_apply():
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras_mp.quantize_annotate_layer(L.Dense(4, name="fc")),
            L.Dense(2, name="out"),
        ]
    )
    qmodel = keras_mp.quantize_apply(model)
    quantized = [layer.name for layer in twins.quantized_layers(qmodel)]
    assert quantized == ["fc"]


def _built(model):
    model(np.zeros((1, 3), "float32"))
    return model


def _flat_model():
    return keras.Sequential(
        [keras.Input((4, 4)), L.Flatten(name="flat"), L.Dense(2)]
    )


@pytest.mark.parametrize(
    "call,error,match",
    [
        (
            lambda: keras_mp.quantize_model("model.keras"),
            TypeError,
            r"Keras 3 `keras.Model`. Received: builtins.str",
        ),
        (
            lambda: keras_mp.quantize_model(tf_keras_like()),
            TypeError,
            r"tf_keras \(Keras 2\) models are not supported",
        ),
        (
            lambda: keras_mp.quantize_model(Subclassed()),
            ValueError,
            r"'subclassed' has never been called.*call it once on a batch",
        ),
        (
            lambda: keras_mp.quantize_annotate_model(_built(Subclassed())),
            ValueError,
            r"rebuilt from its config.*TypeError.*get_config\(\).*"
            r"in_place=True",
        ),
        (
            lambda: keras_mp.quantize_model(
                keras.Sequential([keras.Input((4,)), L.ReLU()])
            ),
            ValueError,
            "No quantizable layer.*Supported types: Add, .*AveragePooling2D, "
            ".*Concatenate, Conv1D, .*Dot, ",
        ),
        (
            lambda: keras_mp.quantize_model(
                keras.Sequential(
                    [keras.Input((6, 4)), L.GRU(8, name="gru"), L.ReLU()]
                )
            ),
            ValueError,
            r"No quantizable layer.*Recurrent layers stay float \(gru "
            r"\(GRU\)\): TensorRT builds",
        ),
        (
            lambda: keras_mp.quantize_model(cnn(), layers="dense_.*"),
            ValueError,
            r"is named \(or matches\) 'dense_\.\*'",
        ),
        (
            lambda: keras_mp.quantize_model(cnn(), layers=3),
            TypeError,
            r"`layers` selects layers by name or regex.*Received: 3",
        ),
        (
            lambda: keras_mp.quantize_model(_flat_model(), layers="flat"),
            ValueError,
            "'flat' of type Flatten cannot be quantized. Supported types",
        ),
        (
            lambda: keras_mp.quantize_model(cnn(), config=8),
            TypeError,
            "`config` must be a QuantizeConfig or a dict.*Received: int",
        ),
        (
            lambda: keras_mp.quantize_apply(cnn()),
            ValueError,
            "no annotated layer.*quantize_annotate_model",
        ),
        (
            lambda: keras_mp.quantize_annotate_layer("dense"),
            TypeError,
            "Expected a Keras 3 layer. Received: str",
        ),
        (
            lambda: keras_mp.quantize_annotate_layer(L.Flatten(name="flat")),
            ValueError,
            "'flat' of type Flatten cannot be quantized. Supported types",
        ),
    ],
    ids=[
        "path_instead_of_model",
        "tf_keras_model",
        "unbuilt_subclassed_model",
        "annotate_subclassed_model_without_config",
        "nothing_quantizable",
        "only_recurrent_layers",
        "selection_matches_nothing",
        "selection_wrong_type",
        "unsupported_layer_by_name",
        "config_wrong_type",
        "apply_without_annotation",
        "annotate_layer_not_a_layer",
        "annotate_unsupported_layer",
    ],
)
def test_bad_input_names_the_fault(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_quantizing_a_quantized_model_is_rejected(quantized):
    with pytest.raises(ValueError, match="already quantized.*strip_quantiz"):
        keras_mp.quantize_model(quantized)


def test_a_model_keras_quantized_is_refused_and_keras_quantize_too():
    # Keras' own int8 mode switches a Dense to `quantized_call`: a twin's
    # call would never run (ranges 0, export blaming calibration).
    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(16, name="dense")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(16, name="out")(outputs))
    qmodel = keras_mp.quantize_model(model)
    with pytest.raises(ValueError, match=r"Keras' own `quantize\('int8'\)`"):
        qmodel.quantize("int8")
    assert qmodel.model.get_layer("dense").quantization_mode is None
    model.quantize("int8")
    with pytest.raises(ValueError, match=r"'dense' \(int8\).*float model"):
        keras_mp.quantize_model(model)
