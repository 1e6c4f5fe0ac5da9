"""Load-only classes (`keras_mp.legacy`, issue 33 item 6): constructing
one outside Keras loading raises a TypeError that says what to use
instead, while files of earlier releases holding them still load."""

import os

import keras
import numpy as np
import pytest

import keras_mp

HERE = os.path.dirname(__file__)
# Committed files of earlier releases, each holding load-only classes.
OLD_FILES = {
    "integration/fixtures/quantized.keras": "QuantizeWrapper",
    "integration/fixtures/muppet.keras": "FixedPointWrapper",
    "quantization/fixtures/per_tensor_mha.keras": "QuantizedModel",
    "sparsity/fixtures/sparse_model.keras": "SparseModel",
}
# What each load-only class's error names instead.
REPLACEMENTS = {
    "QuantizeWrapper": "keras_mp.quantize_model",
    "QuantizeAnnotate": "keras_mp.quantize_annotate_layer",
    "FixedPointWrapper": "keras_mp.fixed_point_model",
    "FixedPointInput": "keras_mp.fixed_point_model",
    "QuantizedModel": "keras_mp.RecordedModel",
    "SparseModel": "keras_mp.RecordedModel",
}


def _args(name):
    if name in ("QuantizedModel", "SparseModel"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        return (model,)
    return () if name == "FixedPointInput" else (keras.layers.Dense(2),)


def test_every_load_only_class_is_covered():
    # PrecisionState is the live MuPPET switching state, not load-only.
    assert set(keras_mp.legacy.__all__) - {"PrecisionState"} == set(
        REPLACEMENTS
    )


@pytest.mark.parametrize("name", sorted(REPLACEMENTS))
def test_constructing_a_load_only_class_says_what_to_use(name):
    cls = getattr(keras_mp.legacy, name)
    with pytest.raises(TypeError) as error:
        cls(*_args(name))
    message = str(error.value)
    assert f"keras_mp.legacy.{name} is load-only" in message
    assert REPLACEMENTS[name] in message
    assert "keras_mp.upgrade(model)" in message


@pytest.mark.parametrize("name", sorted(REPLACEMENTS))
def test_inside_loading_it_builds_and_the_scope_ends(name):
    cls = getattr(keras_mp.legacy, name)
    with keras_mp.legacy.loading():
        built = cls(*_args(name))
    assert built is not None
    with pytest.raises(TypeError, match="load-only"):
        cls(*_args(name))


def test_a_saved_config_deserializes_outside_the_scope():
    with keras_mp.legacy.loading():
        wrapper = keras_mp.legacy.QuantizeWrapper(keras.layers.Dense(2))
    config = keras.saving.serialize_keras_object(wrapper)
    again = keras.saving.deserialize_keras_object(config)
    assert isinstance(again, keras_mp.legacy.QuantizeWrapper)
    assert isinstance(again.layer, keras.layers.Dense)


@pytest.mark.parametrize("path", sorted(OLD_FILES))
def test_files_of_earlier_releases_still_load(path):
    # registers the custom layer the sparse file's model holds
    from tests.sparsity.fixtures import make_sparse_model  # noqa: F401

    model = keras.saving.load_model(os.path.join(HERE, path), safe_mode=True)
    assert isinstance(model, keras.Model)
    x = np.zeros((1, *model.inputs[0].shape[1:]), "float32")
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(model(x))))
    # loading ended its scope: new code still cannot build the class
    name = OLD_FILES[path]
    with pytest.raises(TypeError, match="load-only"):
        getattr(keras_mp.legacy, name)(*_args(name))


def test_load_only_twins_refuse_construction():
    from keras_mp.quantization import legacy_twins, recipe

    twin = recipe.twin_class(keras.layers.MultiHeadAttention, legacy=True)
    assert issubclass(twin, legacy_twins.QuantizedAttention)
    with pytest.raises(TypeError, match="load-only.*keras_mp.quantize_model"):
        twin(num_heads=2, key_dim=4)
    with pytest.raises(TypeError, match="legacy_twins.QuantizedDot is load"):
        legacy_twins.QuantizedDot()
